"""Private ERM for linear classifiers by output and objective perturbation ([CMS11] Algorithms 1
and 2; docs/algorithms.md §5.1, §5.2).

Data: rows ``x_i ∈ ℝ^d`` with ``‖x_i‖ ≤ B`` (the public ``data_norm``, default 1) and labels
``y_i ∈ {−1, +1}``. The learners run on the unit-scale rows ``u_i = x_i/B`` (``‖u_i‖ ≤ 1``, as
[CMS11] assume) and minimise

    ``J(f) = (1/n) Σ ℓ(y_i fᵀu_i) + (Λ/2)‖f‖²``

for a convex, differentiable loss with ``|ℓ'| ≤ 1`` and ``ℓ'' ≤ c``:

* ``"logistic"``: ``ℓ(z) = ln(1 + e^{−z})``, ``c = 1/4``.
* ``"huber"`` ([CMS11]'s Huber SVM, with a public width h): ``ℓ(z) = 0`` for
  ``z > 1 + h``, ``(1 + h − z)²/(4h)`` for ``|1 − z| ≤ h``, ``1 − z`` for ``z < 1 − h``;
  ``c = 1/(2h)``. It is differentiable everywhere but twice differentiable only off the two
  points ``z = 1 ± h``; see :func:`objective_perturbation` for what that means for its proof.

The released coefficients are returned for the original rows (``f/B``: ``fᵀu = (f/B)ᵀx``); the
model predicts ``sign(x·f)``.

Intercept: there is no ``fit_intercept``. Append a public constant column ``a`` to every row and
bound the new norm publicly: with ``‖x‖ ≤ B``, ``[x, a]`` has norm ``≤ sqrt(B² + a²)``, which is
the ``data_norm`` to pass (e.g. ``a = B``, as benchmarks/erm_regularization.py does for digits);
the last coefficient times ``a`` is the intercept. The intercept is then regularised like the
other coefficients. Never rescale rows by a data-dependent maximum: only public constants keep
the guarantee.

Optimisation: L-BFGS (``optax.lbfgs`` with a zoom line search) inside ``jax.lax.while_loop``,
from ``f = 0``, until ``‖∇J̃(f)‖ ≤ tol`` (default 1e-10) or ``max_iterations`` (J̃ the
objective actually minimised), in float64 in JAX (:func:`dpjax._host.float64`, no host
callback): eagerly the validating wrappers run under ``jax.enable_x64(True)`` (inside, not
global); under ``jit`` / ``vmap`` they are staged inline and need the trace to run with x64 on (a
float32 trace raises ``TypeError``). The traceable core :func:`erm_core` runs in its input's
dtype (float32 cannot reach ``tol = 1e-10``: enable x64 to use it in float64).

Three caveats, stated once for every function here:

1. Approximate minimiser: [CMS11]'s proofs assume the exact minimiser. J̃ is Λ-strongly convex,
   so the returned ``f̂`` satisfies ``‖f̂ − f*‖ ≤ ‖∇J̃(f̂)‖/Λ``. Output perturbation absorbs this:
   its noise is calibrated to the sensitivity ``2/(nΛ) + 2·tol/Λ`` of any point with gradient
   norm ≤ tol, so its guarantee covers ``f̂`` whenever the optimiser reached tol on both
   neighbours (it does on well-conditioned problems long before ``max_iterations``; if the cap
   stops it first, the guarantee is not established and the diagnostic below says so). For
   objective perturbation an approximate minimiser is not covered by [CMS11]'s proof; Iyengar,
   Near, Song, Thakkar, Thakurta & Wang (2019), "Towards practical differentially private convex
   optimization" (approximate minima perturbation), give the variant that pays for it (extra
   Gaussian noise, δ > 0). Here the gap is ≤ tol/Λ in ℓ2 (1e-10/Λ by default), far below the
   noise, but it is not accounted for.
2. The reached gradient norm (``ERMResult.nonprivate_gradient_norm``) is a function of the data
   and is NOT covered by the DP guarantee: a diagnostic for the analyst, not for publication.
3. The number of L-BFGS iterations, hence the running time, depends on the data: timing is not
   protected.

Under ``vmap`` (e.g. over keys) the solves run one after another inside the compiled program
(``lax.map``), not batched; see ``_solver``.

Floating point (``release``, docs/algorithms.md §5.1, §1.10). A float64 value plus continuous
noise is not safe to publish bit for bit: the set of floats ``f̂ + b`` can take depends on f̂
(Mironov 2012). On neighbours that attain the sensitivity (Huber loss, one label flipped,
``nΛ = 3``, ε = 4) the sign and the mantissa's parity of the raw release give an empirical
ε ≥ 4.81 (100,000 runs a side; :func:`dpjax.audit.low_bits`, tests/audit/
test_classic_erm_audits.py); an independent audit read ε ≥ 6.9 against a claim of 2 from the
exact bits. Two releases, one compiled program:

* ``"grid"`` (default), output perturbation. (1) Clamp each coordinate of the unit-scale f̂ to
  the public ``[−R, R]``, ``R = sqrt(2ℓ(0)/Λ) + tol/Λ`` (``J(f*) ≤ J(0) = ℓ(0)`` and
  ``J(f) ≥ (Λ/2)‖f‖²`` bound ``‖f*‖``; ``‖f̂ − f*‖ ≤ tol/Λ``): on valid data it never binds, and
  a projection onto a convex set is 1-Lipschitz in ℓ2, so the sensitivity stays Δ₂. (2) Divide
  by the public power-of-two step Λ_g of ``dpjax.mechanisms.discretization(Δ₂, d, R)`` (exact)
  and round: the index ``i(X) ∈ ℤ^d`` moves by at most ``Δ_Λ = Δ₂/Λ_g + √d ≤ (1 + 2^-10)Δ₂/Λ_g``
  between neighbours (each coordinate rounds by ≤ ½). (3) Draw b, ℓ2-Laplace with rate
  ``β_g = ε/Δ_Λ`` per grid step, in float64, round it to the nearest integer vector k, and
  release ``Λ_g(i(X) + k)/B``: integer-valued float64 below 2^51, so the sum and the product by
  the power of two are exact; the division by B is post-processing (the coefficients are
  ``fl(Λ_g·m/B)`` for an integer m, exact multiples of Λ_g/B when B is a power of two).
  Privacy: the output is a function of the integer vector ``m = i(X) + k`` alone, so its set of
  values is the same public lattice whatever the data. The law of k is the discretised
  ℓ2-Laplace ``P(k) = ∫_cell(k) p(b) db`` (``cell(k) = k + [−½, ½)^d``, ``p ∝ e^{−β_g‖b‖}``), and
  for any lattice shift s with ``‖s‖ ≤ Δ_Λ``, ``P(k)/P(k + s) ≤ e^{β_g‖s‖} ≤ e^ε``: the pointwise
  ratio ``p(b)/p(b + s) ≤ e^{β_g‖s‖}`` integrated over the cell. So ``m`` is ε-DP under
  replace-one for the ideal P. Residual, stated exactly: b is sampled in float64 (a Gamma norm
  times a normalised Gaussian) and then rounded, so the implemented law of k only approximates P
  — at cell boundaries, where the sample's relative rounding (about 2^-52 of ‖b‖, at most 2^-6
  of a step anywhere the sampler reaches: ``erm_parameters`` keeps the mean noise within 2^40
  steps) decides the cell, and in the far tail, which the sampler truncates (each exponential is
  at most 52 ln 2). It is a sampler approximation of a data-independent law, not a
  data-dependent output set: the floating-point attack has nothing to read.
* ``"grid"``, objective perturbation: the released minimiser is rounded to the public
  power-of-two step of ``discretization(2/(n(Λ + Δ)), d)`` (≤ 2^-11/√d of the non-private
  minimiser's sensitivity per coordinate, far below the noise), not clamped (the perturbed
  minimiser is not confined to the box above, and rounding to a power of two is exact at any
  magnitude). This is post-processing of a release whose proof is in real arithmetic ([CMS11]
  Theorem 9): it zeroes the low-order bits, but it is not a proof of float safety. (The
  low-bits audit found no excess in the raw release either: 2.36 against a claim of 4 at
  100,000 runs a side; the rounded one 2.29.)
* ``"raw"``: the float64 value itself, today's release bit for bit: ε-DP in real arithmetic
  only (the leak above; :func:`dpjax.mechanisms.l2_laplace_mechanism`, "not float-safe").

``"grid"`` refuses (``ValueError``) scales float64 cannot hold as a lattice: R beyond 2^50
steps, a mean noise norm ``d·Δ_Λ/ε`` beyond 2^40 steps (ε below about ``d^{3/2}·2^-29``), or
``Λ_g/B`` outside float64's normal range (an extreme ``data_norm``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from dp_accounting import NeighboringRelation
from optax import tree_utils as otu

from dpjax import _validation as v
from dpjax import linalg
from dpjax._core.noise import l2_laplace_sample
from dpjax._host import float64
from dpjax.mechanisms.grid import discretization
from dpjax.results import ERMResult, warn_underpowered
from dpjax.ledger import with_ledger

__all__ = ["ERMParameters", "ObjectivePerturbationBudget", "default_regularization", "erm_core",
           "erm_parameters", "erm_required_n", "objective_perturbation", "objective_perturbation_budget",
           "one_vs_rest", "one_vs_rest_core", "output_perturbation", "predict"]

LOSSES = ("logistic", "huber")
METHODS = ("output", "objective")
# "grid" (default): the release lies on a public power-of-two lattice (module docstring,
# "Floating point"); "raw": the float64 value itself, ε-DP in real arithmetic only.
RELEASES = ("grid", "raw")
DEFAULT_TOL = 1e-10
DEFAULT_MAX_ITERATIONS = 1000
# Λ = κ · sqrt(d/(n ε)) (see default_regularization); κ measured on digits and synthetic data.
REGULARIZATION_FACTORS = {"output": 0.3, "objective": 0.1}
# Rows within a relative 1e-6 of the bound pass the check (float32 rounding of rows normalised to
# norm B); the core clips them to the bound exactly, so the slack costs no privacy.
_NORM_SLACK = 1e-6
# The grid release of output perturbation keeps the mean noise norm at most 2^40 grid steps: the
# float64 sampler's largest draw (a sum of d exponentials, each at most 52 ln 2 ≈ 36.04) is then
# below 2^46 steps, the float64 noise resolves every cell it can reach to 2^-6 of a step or finer,
# and the lattice index stays far below 2^53 (every output exact in float64).
_MAX_MEAN_NOISE_STEPS = 2.0**40


class ObjectivePerturbationBudget(NamedTuple):
  """The public constants of [CMS11] Algorithm 2 (:func:`objective_perturbation_budget`).

  Attributes:
    epsilon_prime: ε' (the noise's share of ε).
    extra_regularization: Δ ≥ 0, added to Λ.
    beta: the noise rate ``β = ε'/2``.
    branch: ``"Delta=0"`` (ε' > 0 at Λ) or ``"Delta>0"`` (Λ too small for ε: Δ raises the
      regularisation to ``c/(n(e^{ε/4} − 1))`` and ε' = ε/2).
  """
  epsilon_prime: float
  extra_regularization: float
  beta: float
  branch: str


class ERMParameters(NamedTuple):
  """Public parameters of :func:`erm_core` (from :func:`erm_parameters`).

  Attributes:
    method: ``"output"`` or ``"objective"``.
    loss: ``"logistic"`` or ``"huber"``.
    huber_width: h (used by ``"huber"`` only).
    regularization: Λ.
    extra_regularization: Δ (objective perturbation; 0 for output perturbation).
    beta: the ℓ2-Laplace rate β of the noise b (density ∝ exp(−β‖b‖)) in the units b is drawn
      in: per unit-scale coefficient, except for the output method's ``"grid"`` release, where b
      is drawn in grid steps (``β = ε/Δ_Λ``).
    data_norm: B, the public row-norm bound.
    tol: the gradient-norm target of the optimiser.
    max_iterations: the L-BFGS iteration cap.
    release: ``"grid"`` or ``"raw"`` (module docstring, "Floating point").
    grid: the public power-of-two step Λ_g of the ``"grid"`` release, in unit-scale
      coefficients (1.0, unused, for ``"raw"``).
    grid_bound: the public clamp R of the output method's ``"grid"`` release (``inf``
      otherwise: objective perturbation's release is rounded, not clamped).
  """
  method: str
  loss: str
  huber_width: float
  regularization: float
  extra_regularization: float
  beta: float
  data_norm: float
  tol: float
  max_iterations: int
  release: str
  grid: float
  grid_bound: float


def loss_curvature(loss: str, huber_width: float = 0.5) -> float:
  """``c = sup ℓ''``: 1/4 for the logistic loss, ``1/(2h)`` for the Huber SVM of width h."""
  v.check_choice(loss, "loss", LOSSES)
  if loss == "logistic":
    return 0.25
  return 1.0 / (2.0 * v.check_positive(huber_width, "huber_width"))


def logistic_loss(z):
  """``ln(1 + e^{−z})`` (stable for any z)."""
  return jnp.logaddexp(jnp.zeros((), z.dtype), -z)


def huber_loss(z, width):
  """[CMS11]'s Huber SVM loss of width h: 0, ``(1 + h − z)²/(4h)`` or ``1 − z``."""
  quadratic = (1.0 + width - z) ** 2 / (4.0 * width)
  return jnp.where(z > 1.0 + width, jnp.zeros_like(z),
                   jnp.where(z < 1.0 - width, 1.0 - z, quadratic))


def default_regularization(n: int, d: int, epsilon: float, method: str = "objective") -> float:
  """The default Λ: ``κ_method · sqrt(d/(n ε))``, from public quantities only.

  Derivation: with a Lipschitz-1 loss and ``‖u‖ ≤ 1`` the excess risk of noise b on the
  coefficients is at most ``‖b‖``, whose mean is ``d/β = 2d/(nΛε)`` for output perturbation
  (``≈ 2d/(nΛε')`` for objective perturbation, whose noise ``b/n`` moves the minimiser by at
  most ``‖b‖/(nΛ)``); the regularisation bias is ``(Λ/2)‖f₀‖²`` for a reference model f₀.
  Equating them gives ``Λ = (2/‖f₀‖)·sqrt(d/(nε))``; ``κ = 2/‖f₀‖`` is set from measurements on
  sklearn's digits and synthetic data (docs/algorithms.md §5; ``REGULARIZATION_FACTORS``).
  For one-vs-rest pass the per-class ε.

  Raises:
    ValueError: n or d < 1, ε not finite and > 0, unknown method.
  """
  n = v.check_int(n, "n", low=1)
  d = v.check_int(d, "d", low=1)
  epsilon = v.check_epsilon(epsilon)
  v.check_choice(method, "method", METHODS)
  return REGULARIZATION_FACTORS[method] * math.sqrt(d / (n * epsilon))


def objective_perturbation_budget(n: int, epsilon: float, regularization: float,
                                  c: float) -> ObjectivePerturbationBudget:
  """[CMS11] Algorithm 2's public constants (docs/algorithms.md §5.2), on the host.

  ``ε' = ε − ln(1 + 2c/(nΛ) + c²/(n²Λ²))`` (computed as ``ε − 2 ln1p(c/(nΛ))``, the same number);
  if ``ε' > 0``: ``Δ = 0``; else ``Δ = c/(n(e^{ε/4} − 1)) − Λ`` and ``ε' = ε/2``. ``β = ε'/2``.
  The branch depends only on the public ``(n, Λ, ε, c)``.

  Raises:
    ValueError: bad n, ε, Λ or c.
  """
  n = v.check_int(n, "n", low=1)
  epsilon = v.check_epsilon(epsilon)
  lam = v.check_positive(regularization, "regularization")
  c = v.check_positive(c, "c")
  epsilon_prime = epsilon - 2.0 * math.log1p(c / (n * lam))
  if epsilon_prime > 0.0:
    return ObjectivePerturbationBudget(epsilon_prime, 0.0, epsilon_prime / 2.0, "Delta=0")
  extra = c / (n * math.expm1(epsilon / 4.0)) - lam
  # ε' ≤ 0 means c/(nΛ) ≥ e^{ε/2} − 1 ≥ e^{ε/4} − 1, so Δ ≥ 0 (up to rounding).
  return ObjectivePerturbationBudget(epsilon / 2.0, max(extra, 0.0), epsilon / 4.0, "Delta>0")


def erm_parameters(n: int, d: int, *, epsilon: float, method: str,
                   regularization: float | None = None, loss: str = "logistic",
                   huber_width: float = 0.5, data_norm: float = 1.0, tol: float = DEFAULT_TOL,
                   max_iterations: int = DEFAULT_MAX_ITERATIONS,
                   release: str = "grid") -> tuple[ERMParameters, dict]:
  """Validated public parameters of :func:`erm_core` and the public ``info`` that describes them.

  Output perturbation: ``β = ε/Δ₂`` with ``Δ₂ = 2/(nΛ) + 2·tol/Λ`` (module docstring, caveat 1;
  ``nΛε/2`` up to the factor ``1/(1 + n·tol)``); with ``release="grid"`` the grid
  ``discretization(Δ₂, d, R)`` (step Λ_g, grid sensitivity Δ_Λ) and the rate ``ε/Δ_Λ`` per grid
  step (module docstring, "Floating point"). Objective perturbation:
  :func:`objective_perturbation_budget` with ``c = loss_curvature(loss, huber_width)``, and with
  ``release="grid"`` the step of ``discretization(2/(n(Λ + Δ)), d)``.

  Returns:
    ``(params, info)``: :class:`ERMParameters` and a dict of public values (n, d, method, loss,
    c, Λ, its rule, β per unit-scale coefficient, the release mode, and ε', Δ and the branch for
    objective perturbation, or the sensitivity for output perturbation; with ``"grid"`` the step
    ``grid``, and for output perturbation ``grid_sensitivity`` Δ_Λ, ``grid_beta`` (the rate per
    grid step) and ``grid_bound`` R).

  Raises:
    ValueError / TypeError: any argument out of range (named in the message); with
      ``release="grid"``, scales whose lattice float64 cannot hold exactly (module docstring).
  """
  n = v.check_int(n, "n", low=1)
  d = v.check_int(d, "d", low=1)
  epsilon = v.check_epsilon(epsilon)
  v.check_choice(method, "method", METHODS)
  v.check_choice(loss, "loss", LOSSES)
  v.check_choice(release, "release", RELEASES)
  huber_width = v.check_positive(huber_width, "huber_width")
  c = loss_curvature(loss, huber_width)
  data_norm = v.check_positive(data_norm, "data_norm")
  tol = v.check_positive(tol, "tol")
  max_iterations = v.check_int(max_iterations, "max_iterations", low=1)
  if regularization is None:
    lam, rule = default_regularization(n, d, epsilon, method), "default"
  else:
    lam, rule = v.check_positive(regularization, "regularization"), "given"
  info = dict(method=method, loss=loss, c=c, regularization=lam, regularization_rule=rule,
              n=n, d=d, data_norm=data_norm, tol=tol, max_iterations=max_iterations,
              noise="l2-laplace", release=release)
  if loss == "huber":
    info["huber_width"] = huber_width
  grid, bound = 1.0, math.inf
  if method == "output":
    sensitivity = 2.0 / (n * lam) + 2.0 * tol / lam
    beta, extra = epsilon / sensitivity, 0.0
    info.update(sensitivity=sensitivity, beta=beta)
    if release == "grid":
      lattice = _output_lattice(sensitivity, d, lam, tol, loss, huber_width, epsilon)
      grid, bound = lattice.grid, lattice.bound
      beta = epsilon / lattice.grid_sensitivity        # per grid step
      info.update(beta=beta / grid, grid=grid, grid_sensitivity=lattice.grid_sensitivity,
                  grid_beta=beta, grid_bound=bound, noise="discretised l2-laplace")
  else:
    budget = objective_perturbation_budget(n, epsilon, lam, c)
    beta, extra = budget.beta, budget.extra_regularization
    info.update(epsilon_prime=budget.epsilon_prime, extra_regularization=extra,
                branch=budget.branch, beta=beta)
    if release == "grid":
      grid = discretization(2.0 / (n * (lam + extra)), d).grid
      info.update(grid=grid)
  if release == "grid":
    _check_output_scale(grid, data_norm)
  params = ERMParameters(method, loss, huber_width, lam, extra, beta, data_norm, tol,
                         max_iterations, release, grid, bound)
  return params, info


def erm_required_n(d: int, *, epsilon: float, method: str = "objective", accuracy: float = 1.0,
                   regularization: float | None = None, loss: str = "logistic",
                   huber_width: float = 0.5, tol: float = DEFAULT_TOL) -> int:
  """Rows :func:`output_perturbation` / :func:`objective_perturbation` need for their noise to
  move the coefficients typically by at most ``accuracy`` times the largest norm the minimiser
  can have; the number their :class:`dpjax.UnderpoweredWarning` quotes (at the default
  ``accuracy = 1``: the noise as large as any minimiser), which they give exactly when n is
  below it. For :func:`one_vs_rest` pass the per-class ε (ε/K).

  >>> import dpjax
  >>> dpjax.classic.erm_required_n(64, epsilon=0.1, method="output")
  2895

  The largest minimiser norm is ``sqrt(2ℓ(0)/Λ_tot)`` (``(Λ_tot/2)‖f*‖² ≤ J(f*) ≤ J(0) = ℓ(0)``,
  Λ_tot = Λ + Δ); the typical move is the noise's mean norm ``d/β`` for output perturbation and
  ``d/(β n Λ_tot)`` for objective perturbation (the term ``bᵀf/n`` moves a Λ_tot-strongly
  convex minimiser by at most ``‖b‖/(nΛ_tot)``), with the call's β, Λ (the default rule at each
  n, or ``regularization``) and Δ (docs/algorithms.md §5.6). Measured: at ratio ≥ 1 breast_cancer
  (output, ε = 0.1) scored 0.45 and digits one-vs-rest (objective, ε = 1) 0.13; a ratio below
  1 is no promise (digits, output, ε = 10: ratio 0.3, accuracy 0.14). Public numbers only.

  Raises:
    ValueError: bad arguments, or no n up to 10¹² reaches ``accuracy``.
  """
  d = v.check_int(d, "d", low=1)
  epsilon = v.check_epsilon(epsilon)
  v.check_choice(method, "method", METHODS)
  accuracy = v.check_positive(accuracy, "accuracy")
  c = loss_curvature(loss, huber_width)
  tol = v.check_positive(tol, "tol")
  if regularization is not None:
    regularization = v.check_positive(regularization, "regularization")
  zero_loss = _zero_model_loss(loss, huber_width)

  def enough(n):
    lam = (default_regularization(n, d, epsilon, method) if regularization is None
           else regularization)
    if method == "output":
      total, move = lam, d * (2.0 / (n * lam) + 2.0 * tol / lam) / epsilon
    else:
      budget = objective_perturbation_budget(n, epsilon, lam, c)
      total = lam + budget.extra_regularization
      move = d / (budget.beta * n * total)
    return move <= accuracy * math.sqrt(2.0 * zero_loss / total)

  return v.smallest_n(enough, f"no n up to 1e12 reaches accuracy={accuracy:g} for d={d}")


def _zero_model_loss(loss: str, huber_width: float) -> float:
  """``ℓ(0)``: ln 2 for the logistic loss; the Huber SVM's 1 (h < 1) or ``(1 + h)²/(4h)``."""
  if loss == "logistic":
    return math.log(2.0)
  return 1.0 if huber_width < 1.0 else (1.0 + huber_width) ** 2 / (4.0 * huber_width)


def _warn_if_underpowered(n, d, epsilon, method, regularization, loss, huber_width, tol,
                          learner, per_class=""):
  try:
    need = erm_required_n(d, epsilon=epsilon, method=method, regularization=regularization,
                          loss=loss, huber_width=huber_width, tol=tol)
  except ValueError:                   # no n reaches it (ε so small that tol's term dominates)
    warn_underpowered(
        f"{learner}: no number of rows up to 1e12 makes its noise (d={d}, ε={epsilon:g}"
        f"{per_class}, method={method!r}) smaller than the largest norm the minimiser can have "
        "(dpjax.classic.erm_required_n): raise epsilon. The result is still private.")
    return
  if n < need:
    options = "" if regularization is None else f", regularization={regularization:g}"
    options += "" if loss == "logistic" else f", loss={loss!r}, huber_width={huber_width:g}"
    warn_underpowered(
        f"{learner}: at n={n:,} rows (d={d}, ε={epsilon:g}{per_class}, method={method!r}) its "
        "noise typically moves the coefficients by more than the largest norm the minimiser "
        f"can have: the classifier is mostly noise. Noise at most that large needs n ≥ "
        f"{need:,} rows (dpjax.classic.erm_required_n({d}, epsilon={epsilon:g}, "
        f"method={method!r}{options})); or raise epsilon. The result is still private.")


def _coefficient_bound(loss: str, regularization: float, huber_width: float = 0.5,
                       tol: float = DEFAULT_TOL) -> float:
  """A public bound R on every coordinate of the unit-scale minimiser f̂ (host; private).

  ``J(f*) ≤ J(0) = ℓ(0)`` and ``J(f) ≥ (Λ/2)‖f‖²`` (ℓ ≥ 0) give ``‖f*‖ ≤ sqrt(2ℓ(0)/Λ)``, and a
  point with gradient norm ≤ tol lies within ``tol/Λ`` of f* (Λ-strong convexity), so
  ``R = sqrt(2ℓ(0)/Λ) + tol/Λ`` with ``ℓ(0) = ln 2`` (logistic) or the Huber loss at 0 (1 for
  h < 1, ``(1 + h)²/(4h)`` for h ≥ 1). Arguments validated by the caller."""
  lam, h = regularization, huber_width
  at_zero = math.log(2.0) if loss == "logistic" else (1.0 if h < 1.0 else (1 + h) ** 2 / (4 * h))
  return math.sqrt(2.0 * at_zero / lam) + tol / lam


def _output_lattice(sensitivity, d, lam, tol, loss, huber_width, epsilon):
  """The output method's public grid: ``discretization(Δ₂, d, R)``, R from
  :func:`_coefficient_bound` (at least one step; at most 2^50 steps, else ValueError), with the
  noise's mean norm ``d/β_g = d·Δ_Λ/ε`` at most 2^40 steps (else ValueError)."""
  step = discretization(sensitivity, d).grid
  bound = max(_coefficient_bound(loss, lam, huber_width, tol), step)
  if bound > 2.0**50 * step:
    raise ValueError(
        f"release='grid' needs the public coefficient bound R = {bound:.6g} within 2^50 grid "
        f"steps of {step:.6g} (the sensitivity {sensitivity:.6g} is too small against "
        f"regularization={lam!r}); use release='raw' (ε-DP in real arithmetic only).")
  lattice = discretization(sensitivity, d, bound)
  if d * lattice.grid_sensitivity / epsilon > _MAX_MEAN_NOISE_STEPS:
    raise ValueError(
        f"epsilon={epsilon!r} is too small for release='grid' with d={d}: the noise would span "
        f"about {d * lattice.grid_sensitivity / epsilon:.3g} grid steps, beyond the 2^40 that "
        "float64 samples resolve cell by cell; use a larger epsilon or release='raw'.")
  return lattice


def _check_output_scale(grid, data_norm):
  """The released coefficients ``Λ_g·m/B`` must be normal float64 numbers: ``Λ_g/B`` not below
  the smallest normal, and ``2^51·Λ_g/B`` (output perturbation: |m| < 2^51) finite."""
  step = grid / data_norm
  if step < np.finfo(np.float64).tiny or 2.0**51 * step > np.finfo(np.float64).max:
    raise ValueError(
        f"data_norm={data_norm!r} puts the grid release's step Λ_g/B = {grid:.6g}/{data_norm:g}"
        " outside float64's normal range; rescale the data by a public constant or use "
        "release='raw'.")


# ------------------------------------------------------------------------ the traceable core


def erm_core(key: jax.Array, X: jax.Array, y: jax.Array,
             params: ERMParameters) -> tuple[jax.Array, jax.Array]:
  """Private ERM on ``X (n, d)``, ``y (n,)``: ``(coefficients (d,), gradient norm ())``.

  Traceable (``jit``, ``vmap`` over keys); no host-side validation. Before anything else it
  applies fixed public per-row maps, so the guarantee holds for every input: rows are divided
  by ``data_norm``, non-finite entries set to 0 and rows clipped to norm 1
  (``u ↦ u/max(1, ‖u‖)``), and labels mapped to ``+1`` if ``y > 0`` else ``−1``. On valid data
  (``‖x_i‖ ≤ B``, ``y_i = ±1``) these maps change nothing.

  * ``params.method == "output"`` ([CMS11] Algorithm 1): ``f̂ = argmin J`` then ``f̂ + b``
    (``"raw"``), or with ``params.release == "grid"`` the lattice point
    ``Λ_g(round(clamp(f̂, ±R)/Λ_g) + round(b))``, b drawn in grid steps.
  * ``"objective"`` (Algorithm 2): ``f̂ = argmin J(f) + (1/n) bᵀf + (Δ/2)‖f‖²``, rounded to
    the grid ``Λ_g·round(f̂/Λ_g)`` with ``"grid"`` (post-processing).

  ``b`` is ℓ2-Laplace with rate ``params.beta`` (:func:`dpjax.mechanisms.l2_laplace_noise`).
  Both methods, both losses and both releases run one compiled program per shape (they enter
  as public flags), so sweeps over them and over ε or Λ do not recompile.

  Guarantee: ε-DP under replace-one (n public) for the ε ``params`` were made for
  (:func:`erm_parameters`), subject to the module docstring's caveats (exact minimiser; the
  ``"grid"`` release's sampler approximation, or real arithmetic only for ``"raw"``). The second
  output, the gradient norm ``‖∇J̃(f̂)‖`` the optimiser reached, is NOT private: a diagnostic,
  keep it out of any publication.

  Returns:
    ``(coefficients (d,) for the original rows (divided by B), gradient norm ())`` in X's float
    dtype.

  Raises:
    ValueError: ``params.release`` not in ``RELEASES``.
    TypeError: the output method's ``"grid"`` release in a dtype other than float64 (its
      lattice arithmetic needs integers up to 2^51 exactly: enable x64).
  """
  dtype = X.dtype if jnp.issubdtype(X.dtype, jnp.floating) else jnp.result_type(float)
  objective = params.method == "objective"
  on_grid = v.check_choice(params.release, "release", RELEASES) == "grid"
  if on_grid and not objective and jnp.dtype(dtype) != jnp.float64:
    raise TypeError(f"erm_core's grid release of output perturbation needs float64, got X of "
                    f"dtype {jnp.dtype(dtype)}: enable JAX's x64 mode (`with "
                    f"jax.enable_x64(True):`) or use release='raw'.")
  scalars = jnp.asarray([params.regularization + params.extra_regularization, params.beta,
                         params.huber_width, params.data_norm, params.tol, float(objective),
                         float(params.loss == "huber"), float(on_grid), params.grid,
                         params.grid_bound], dtype)
  return _solver(params.max_iterations)(key, jnp.asarray(X, dtype), jnp.asarray(y, dtype),
                                        scalars)


@functools.lru_cache(maxsize=None)
def _solver(max_iterations: int):
  """:func:`_erm` for one iteration cap. Under ``vmap`` the solves run one after another inside
  the program (``lax.map``), not batched: a batched L-BFGS turns every branch of its line search
  into a select and iterates until the slowest problem converges (on XLA:CPU 2× the compile
  time and 6× the run time for 10^4 keys, measured), and each problem's output stays a
  function of its own inputs alone."""
  solve = jax.custom_batching.custom_vmap(
      functools.partial(_erm, max_iterations=max_iterations))

  @solve.def_vmap
  def _(axis_size, in_batched, *args):
    del axis_size
    out = _map_solves(tuple(args), batched=tuple(bool(b) for b in in_batched),
                      max_iterations=max_iterations)
    return out, (True, True)

  return solve


@functools.partial(jax.jit, static_argnames=("batched", "max_iterations"))
def _map_solves(args, *, batched, max_iterations):
  """``lax.map`` of the solver over the batched ``args`` (the others shared). Jitted at module
  level, so that an eager ``vmap`` (e.g. the auditor's) compiles it once per shape."""
  mapped = [a for a, b in zip(args, batched) if b]
  shared = [a for a, b in zip(args, batched) if not b]

  def one(values):
    values, others = iter(values), iter(shared)
    return _solver(max_iterations)(*[next(values) if b else next(others) for b in batched])

  return jax.lax.map(one, mapped)


@functools.partial(jax.jit, static_argnames=("max_iterations",))
def _erm(key, X, y, scalars, *, max_iterations):
  """:func:`erm_core` with the public scalars traced: ``[Λ + Δ, β, h, B, tol, objective (0/1),
  huber (0/1), grid release (0/1), Λ_g, R]`` (one program per shape and iteration cap)."""
  (strength, beta, width, data_norm, tol, objective, huber, on_grid, grid,
   bound) = (scalars[i] for i in range(10))
  n, d = X.shape
  dtype = X.dtype
  U = _unit_rows(X, data_norm)
  labels = jnp.where(y > 0, 1.0, -1.0).astype(dtype)
  b = l2_laplace_sample(key, beta, d=d, dtype=jnp.dtype(dtype))
  linear = objective * b / n                 # objective perturbation's (1/n) bᵀf; 0 otherwise

  def perturbed_objective(f):
    z = labels * linalg.matmul(U, f)       # full precision on every backend (no TF32 passes)
    losses = jnp.where(huber > 0, huber_loss(z, width), logistic_loss(z))
    return jnp.mean(losses) + 0.5 * strength * jnp.sum(f * f) + jnp.sum(linear * f)

  f, grad_norm = minimise(perturbed_objective, jnp.zeros(d, dtype), tol, max_iterations)
  noise = (1.0 - objective) * b              # output perturbation's noise; 0 otherwise
  raw = f + noise
  # The grid release: integer-valued float64 throughout (|index| ≤ 2^50, |round(noise)| < 2^46
  # by erm_parameters' checks), so the sum is exact and the product by the power of two Λ_g too.
  index = jnp.round(jnp.clip(f, -bound, bound) / grid)
  lattice = (index + jnp.round(noise)) * grid
  return jnp.where(on_grid > 0, lattice, raw) / data_norm, grad_norm


def _unit_rows(X, data_norm):
  """``x/B`` with non-finite entries set to 0, clipped to norm ≤ 1: a fixed map of each row."""
  U = X / data_norm
  U = jnp.where(jnp.isfinite(U), U, jnp.zeros((), U.dtype))
  norms = jnp.sqrt(jnp.sum(U * U, axis=1, keepdims=True))
  return U / jnp.maximum(norms, 1.0)


def minimise(objective, f0, tol, max_iterations: int, memory_size: int = 10):
  """L-BFGS (``optax.lbfgs``, zoom line search) in a ``while_loop`` from ``f0`` until the
  gradient norm is ≤ ``tol`` or ``max_iterations`` steps; returns ``(f, ‖∇objective(f)‖)``.

  Traceable. The line search stores the gradient at the new point, which the loop reuses
  (``optax.value_and_grad_from_state``); the returned norm is recomputed at the final point.
  """
  solver = optax.lbfgs(memory_size=memory_size, linesearch=optax.scale_by_zoom_linesearch(
      max_linesearch_steps=30, initial_guess_strategy="one"))
  value_and_grad = optax.value_and_grad_from_state(objective)

  def step(carry):
    f, state, it, _ = carry
    value, grad = value_and_grad(f, state=state)
    updates, state = solver.update(grad, state, f, value=value, grad=grad, value_fn=objective)
    f = optax.apply_updates(f, updates)
    return f, state, it + 1, _norm(otu.tree_get(state, "grad"))

  def running(carry):
    return (carry[2] < max_iterations) & (carry[3] > tol)

  start = (f0, solver.init(f0), jnp.asarray(0, jnp.int32), _norm(jax.grad(objective)(f0)))
  f = jax.lax.while_loop(running, step, start)[0]
  return f, _norm(jax.grad(objective)(f))


def _norm(g):
  return jnp.sqrt(jnp.sum(g * g))


# ------------------------------------------------------------------ the validating wrappers


@with_ledger
def output_perturbation(key: jax.Array, X, y, *, epsilon: float,
                        regularization: float | None = None, loss: str = "logistic",
                        huber_width: float = 0.5, data_norm: float = 1.0, clip: bool = False,
                        tol: float = DEFAULT_TOL,
                        max_iterations: int = DEFAULT_MAX_ITERATIONS,
                        release: str = "grid") -> ERMResult:
  """Private linear classifier by output perturbation ([CMS11] Algorithm 1; §5.1).

  Usage::

      res = dpjax.classic.output_perturbation(jax.random.key(0), X, y, epsilon=1.0)
      res.coefficients      # (d,) float64, predicts sign(x·f); X (n, d), ‖x_i‖ ≤ 1; y (n,) ±1

  ``f_priv = argmin J + b``, ``b`` ℓ2-Laplace with ``β = ε/Δ₂``, ``Δ₂ = 2/(nΛ) + 2·tol/Λ`` (a
  factor ``1 + n·1e-10`` over [CMS11]'s ``β = nΛε/2`` at the default tol). Guarantee: (ε, 0)-DP
  under replace-one (one row ``(x_i, y_i)`` replaced; n public), for any loss in ``LOSSES``
  (differentiable, convex, ``|ℓ'| ≤ 1``), whenever the optimiser reaches tol: J is Λ-strongly
  convex and one row moves its gradient by ≤ 2/n, so the exact minimiser's ℓ2-sensitivity is
  ``2/(nΛ)`` ([CMS11]), plus ``2·tol/Λ`` for stopping at gradient norm tol. ``release="grid"``
  (default) releases a function of an integer vector on a public lattice (clamped minimiser
  rounded to a power-of-two step, plus discretised ℓ2-Laplace): ε-DP for the ideal discretised
  law, which the float64 sampler approximates. ``release="raw"``: in real arithmetic only (its
  low bits leak). Proofs, residual: docs/algorithms.md §5.1, the module docstring.

  Args:
    key: PRNG key.
    X: ``(n, d)`` real rows (individuals), ``‖x_i‖ ≤ data_norm`` (float64 whatever the dtype).
    y: ``(n,)`` labels in {−1, +1}.
    epsilon: ε > 0.
    regularization: Λ > 0 (default :func:`default_regularization`, a public rule).
    loss: ``"logistic"`` (default) or ``"huber"``.
    huber_width: the Huber width h > 0 (public; default 0.5).
    data_norm: the public row-norm bound B (default 1).
    clip: False (default): a row with ``‖x‖ > B`` raises. True: such rows are scaled down to
      norm B (a fixed map of each row: DP-safe).
    tol: gradient-norm target (default 1e-10).
    max_iterations: L-BFGS iteration cap (default 1000).
    release: ``"grid"`` (default: the public lattice, float-safe up to the sampler
      approximation) or ``"raw"`` (the float64 ``f̂ + b``, ε-DP in real arithmetic only); one of
      ``RELEASES``.

  Returns:
    :class:`~dpjax.results.ERMResult` (``ok`` True, ``epsilon``, ``delta = 0``, neighboring
    ``REPLACE_ONE``): ``coefficients (d,)`` (float64 NumPy eagerly; with ``"grid"`` each is
    ``fl(Λ_g·m/B)``, m an integer), predicting ``sign(x·f)``; ``nonprivate_gradient_norm`` — NOT
    private, a diagnostic only; ``info`` (public): method, loss, c, Λ and its rule, Δ₂, ``beta``,
    ``noise``, ``release``, n, d, data_norm, clip, tol, max_iterations, and with ``"grid"``
    ``grid`` (Λ_g), ``grid_sensitivity`` (Δ_Λ), ``grid_beta``, ``grid_bound`` (R). Eagerly the
    float64 program runs on the CPU under ``jax.enable_x64(True)`` whatever the flag; traceable
    in ``key``, ``X``, ``y`` with x64 on (staged inline; a float32 trace raises ``TypeError``),
    where data outside the domain (NaN, a label not ±1, a row above B without ``clip``) give
    ``ok=False`` and zeros (the guarantee is stated on the domain).

  Raises:
    TypeError: bad key, non-numeric X or y; traced with JAX's x64 mode off.
    ValueError: NaN/inf in X or y, labels not in {−1, +1}, a row above ``data_norm`` without
      ``clip`` (the message gives the number of rows), shapes, or a bad ε, Λ, loss, h, B, tol,
      max_iterations, release; with ``"grid"``, scales float64 cannot hold as a lattice (ε
      below about ``d^{3/2}·2^-29``, an extreme B or nΛ; module docstring).

  Warns:
    dpjax.UnderpoweredWarning: n below :func:`erm_required_n` (the noise typically moves the
      coefficients by more than any minimiser's norm), or no n suffices; the message says which.

  References:
    [CMS11] Chaudhuri, Monteleoni & Sarwate, "Differentially private empirical risk
    minimization", JMLR 12 (2011), Algorithm 1 and its sensitivity bound.
  """
  return _fit(key, X, y, "output", epsilon=epsilon, regularization=regularization, loss=loss,
              huber_width=huber_width, data_norm=data_norm, clip=clip, tol=tol,
              max_iterations=max_iterations, release=release)


@with_ledger
def objective_perturbation(key: jax.Array, X, y, *, epsilon: float,
                           regularization: float | None = None, loss: str = "logistic",
                           huber_width: float = 0.5, data_norm: float = 1.0, clip: bool = False,
                           tol: float = DEFAULT_TOL,
                           max_iterations: int = DEFAULT_MAX_ITERATIONS,
                           release: str = "grid") -> ERMResult:
  """Private linear classifier by objective perturbation ([CMS11] Algorithm 2; §5.2).

  With ``c = sup ℓ''`` (logistic 1/4, Huber 1/(2h)):
  ``ε' = ε − ln(1 + 2c/(nΛ) + c²/(n²Λ²))``; if ``ε' > 0`` then ``Δ = 0``, else
  ``Δ = c/(n(e^{ε/4} − 1)) − Λ`` and ``ε' = ε/2``; ``b`` ℓ2-Laplace with ``β = ε'/2``; release
  ``f_priv = argmin J(f) + (1/n) bᵀf + (Δ/2)‖f‖²``
  (:func:`objective_perturbation_budget`). The branch depends only on public ``(n, Λ, ε, c)``
  and is reported in ``info["branch"]``.

  Privacy guarantee: (ε, 0)-DP under replace-one (n public) for the exact minimiser, in real
  arithmetic ([CMS11] Theorem 9: the regulariser is 1-strongly convex and twice differentiable,
  ℓ convex and twice differentiable with ``|ℓ'| ≤ 1``, ``|ℓ''| ≤ c``, ``‖u_i‖ ≤ 1``). The
  returned point has gradient norm ≤ tol, i.e. lies within ``tol/(Λ + Δ)`` of the exact
  minimiser; that gap is not covered by the proof (module docstring, caveat 1). Huber: the
  loss is twice differentiable only off ``z = 1 ± h``, so Theorem 9 does not apply verbatim.
  [CMS11] run Algorithm 2 on the Huber SVM with ``c = 1/(2h)`` and state it is ε-DP; the
  argument: the map ``f ↦ b`` (b the noise that makes f the minimiser) is a Lipschitz
  bijection, differentiable off the points f where some ``y_i fᵀu_i = 1 ± h`` (a finite union
  of hyperplanes, a null set), so the change of variables behind Theorem 9 holds almost
  everywhere with ``ℓ'' ∈ {0, c}``, and so does its density-ratio bound.

  Floating point: ``release="grid"`` (default) rounds the minimiser to the public power-of-two
  step of ``discretization(2/(n(Λ + Δ)), d)`` (``info["grid"]``; no clamp): post-processing of
  the real-arithmetic release above, which zeroes its low-order bits but is not a proof of
  float safety (module docstring). ``release="raw"`` returns the float64 minimiser itself.

  Args and Raises: as :func:`output_perturbation`.

  Returns:
    :class:`~dpjax.results.ERMResult` as :func:`output_perturbation`, with ``info`` holding
    ``epsilon_prime``, ``extra_regularization`` (Δ), ``branch`` (``"Delta=0"`` or
    ``"Delta>0"``), ``beta``, ``release`` and with ``"grid"`` the step ``grid``;
    ``nonprivate_gradient_norm`` is NOT private (diagnostic).

  References:
    [CMS11] Algorithm 2, Theorem 9 and its Huber-SVM application; Iyengar et al. (2019),
    approximate minima perturbation; docs/algorithms.md §5.2.
  """
  return _fit(key, X, y, "objective", epsilon=epsilon, regularization=regularization, loss=loss,
              huber_width=huber_width, data_norm=data_norm, clip=clip, tol=tol,
              max_iterations=max_iterations, release=release)


def _fit(key, X, y, method, *, epsilon, clip, **kwargs) -> ERMResult:
  key = v.check_key(key)
  X = v.check_data64(X, "X")
  n, d = X.shape
  y = _check_labels(y, n, "y", allowed=(-1, 1), hint=" (map {0, 1} labels by 2*y - 1)")
  params, info = erm_parameters(n, d, epsilon=epsilon, method=method, **kwargs)
  _warn_if_underpowered(n, d, float(epsilon), method, kwargs["regularization"],
                        params.loss, params.huber_width, params.tol, f"{method}_perturbation")
  clip = bool(clip)
  if not v.is_traced(X):
    _check_norms(X, params.data_norm, clip)

  def run(key, X, y):
    ok = _in_domain(X, y, jnp.asarray([-1.0, 1.0], X.dtype), params.data_norm, clip)
    coefficients, grad_norm = erm_core(key, X, y, params)
    return _bottom(ok, coefficients, grad_norm)

  ok, coefficients, grad_norm = _run_x64(f"{method}_perturbation", run, key, X, y)
  return ERMResult(ok=ok, coefficients=coefficients, nonprivate_gradient_norm=grad_norm,
                   epsilon=float(epsilon), delta=0.0,
                   neighboring=NeighboringRelation.REPLACE_ONE, info=dict(info, clip=clip))


@with_ledger
def one_vs_rest(key: jax.Array, X, labels, *, classes: Sequence[int], epsilon: float,
                method: str = "objective", regularization: float | None = None,
                loss: str = "logistic", huber_width: float = 0.5, data_norm: float = 1.0,
                clip: bool = False, tol: float = DEFAULT_TOL,
                max_iterations: int = DEFAULT_MAX_ITERATIONS, release: str = "grid") -> ERMResult:
  """Private multiclass linear classifier: one binary problem per class, ε split equally.

  For each public class ``k`` (in the order of ``classes``), labels ``+1`` where
  ``labels == k`` and ``−1`` elsewhere, solved by ``method`` (``"objective"`` or ``"output"``)
  at ``ε/K`` with independent noise. The classes are a PUBLIC argument, never inferred from the
  data (the set of labels present is itself private).

  Privacy guarantee: (ε, 0)-DP under replace-one. Replacing one row changes every one of the K
  binary datasets in one row, each problem is (ε/K)-DP, and basic composition gives ε (the
  problems see the same rows, so no parallel composition applies). Caveats of the module
  docstring apply to each problem. The default Λ uses the per-class ε/K.

  Args:
    key: PRNG key (split into K).
    X: ``(n, d)`` rows with ``‖x_i‖ ≤ data_norm``.
    labels: ``(n,)`` integer labels, each one of ``classes``.
    classes: the public class labels, K ≥ 2 distinct integers.
    epsilon: the total ε > 0.
    method: ``"objective"`` (default) or ``"output"``.
    regularization, loss, huber_width, data_norm, clip, tol, max_iterations, release: as
      :func:`output_perturbation` / :func:`objective_perturbation` (shared by all classes; the
      ``"grid"`` lattice is that of one binary problem at ε/K).

  Returns:
    :class:`~dpjax.results.ERMResult` with ``coefficients (K, d)`` (predict
    ``classes[argmax_k x·f_k]``, :func:`predict`), ``nonprivate_gradient_norm (K,)`` (NOT
    private), ``epsilon`` the total, and ``info`` holding ``classes``, ``num_classes``,
    ``epsilon_per_class`` and ``composition`` besides the per-problem values. Traceable as
    :func:`output_perturbation` (with x64 on; a label outside ``classes`` is outside the domain:
    ``ok=False`` under tracing).

  Raises:
    TypeError: non-integer ``classes`` or labels; traced with JAX's x64 mode off.
    ValueError: fewer than 2 or repeated classes, a label outside ``classes`` (the message gives
      the count), and everything :func:`output_perturbation` raises.

  Warns:
    dpjax.UnderpoweredWarning: n below :func:`erm_required_n` at the per-class ε (the noise
      as large as any minimiser); the message gives that number.
  """
  key = v.check_key(key)
  X = v.check_data64(X, "X")
  n, d = X.shape
  classes = _check_classes(classes)
  K = len(classes)
  labels = _check_labels(labels, n, "labels", allowed=classes, integer=True)
  epsilon = v.check_epsilon(epsilon)
  params, info = erm_parameters(n, d, epsilon=epsilon / K, method=method,
                                regularization=regularization, loss=loss,
                                huber_width=huber_width, data_norm=data_norm, tol=tol,
                                max_iterations=max_iterations, release=release)
  _warn_if_underpowered(n, d, epsilon / K, method, regularization, params.loss,
                        params.huber_width, params.tol, "one_vs_rest",
                        per_class=f" per class of ε={epsilon:g}")
  clip = bool(clip)
  if not v.is_traced(X):
    _check_norms(X, params.data_norm, clip)

  def run(key, X, labels):
    class_array = jnp.asarray(classes, labels.dtype)
    ok = _in_domain(X, labels, class_array, params.data_norm, clip)
    if v.is_traced(key, X, labels):           # staged inline: one vmapped program
      coefficients, grad_norm = one_vs_rest_core(key, X, labels, class_array, params)
    else:                                     # concrete: the binary program, class by class
      keys, signs = _class_problems(key, labels, class_array)
      rows = [erm_core(keys[k], X, signs[k], params) for k in range(K)]
      coefficients, grad_norm = (jnp.stack(parts) for parts in zip(*rows))
    return _bottom(ok, coefficients, grad_norm)

  ok, coefficients, grad_norm = _run_x64("one_vs_rest", run, key, X, labels)
  info = dict(info, clip=clip, classes=classes, num_classes=K, epsilon_per_class=epsilon / K,
              composition="basic (each replaced row changes all K problems)")
  return ERMResult(ok=ok, coefficients=coefficients, nonprivate_gradient_norm=grad_norm,
                   epsilon=epsilon, delta=0.0, neighboring=NeighboringRelation.REPLACE_ONE,
                   info=info)


def one_vs_rest_core(key: jax.Array, X: jax.Array, labels: jax.Array, classes: jax.Array,
                     params: ERMParameters) -> tuple[jax.Array, jax.Array]:
  """Traceable one-vs-rest: :func:`erm_core` for each of the public ``classes (K,)`` with
  independent keys, vmapped; ``(coefficients (K, d), gradient norms (K,))``. ``params`` must
  be made for the per-class ε (ε/K for a total ε). The gradient norms are NOT private."""
  keys, signs = _class_problems(key, labels, classes)
  return jax.vmap(lambda k, s: erm_core(k, X, s, params))(keys, signs)


def _class_problems(key, labels, classes):
  """``(K keys, (K, n) labels ±1)``: class k's key and its one-vs-rest labels."""
  keys = jax.random.split(key, classes.shape[0])
  return keys, jnp.where(labels[None, :] == classes[:, None], 1.0, -1.0)


def predict(coefficients, X, classes: Sequence[int] | None = None):
  """Post-processing: ``sign(X f)`` (ties +1) for ``(d,)`` coefficients, or
  ``classes[argmax_k X f_k]`` for ``(K, d)`` ones; a NumPy array of ``(n,)`` labels."""
  coefficients, X = np.asarray(coefficients), np.asarray(X)
  scores = X @ coefficients.T
  if coefficients.ndim == 1:
    return np.where(scores >= 0, 1, -1)
  index = np.argmax(scores, axis=1)
  return index if classes is None else np.asarray(classes)[index]


# --------------------------------------------------------------------------------- helpers


def _run_x64(name, run, key, *args):
  """``run(key, *args)`` in float64 (:func:`dpjax._host.float64`, float arrays cast): traced
  with x64 on, staged inline; traced with x64 off, ``TypeError`` naming ``name``; eagerly under
  ``jax.enable_x64(True)`` on the CPU with the key committed to it (so that the eager programs
  are compiled once, whatever the default device), outputs as NumPy float64. Returns
  ``(ok, *outputs)``."""
  if v.is_traced(key, args):
    return float64(name, run, key, *args)
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    ok, *outputs = float64(name, run, jax.device_put(key, cpu), *args)
  return (jnp.asarray(ok), *outputs)


@jax.jit
def _bottom(ok, *outputs):
  return (ok,) + tuple(jnp.where(ok, o, jnp.zeros_like(o)) for o in outputs)


@functools.partial(jax.jit, static_argnames=("clip",))
def _in_domain(X, labels, allowed, data_norm, clip):
  """The domain of the guarantee as a traceable bool: finite X, every label in ``allowed``,
  and (unless ``clip``) every row norm ≤ B (a relative 1e-6 of slack for rounding)."""
  ok = jnp.all(jnp.isfinite(X)) & jnp.all(jnp.any(labels[:, None] == allowed[None, :], axis=1))
  if not clip:
    norms = jnp.sqrt(jnp.sum((X / data_norm) ** 2, axis=1))
    ok = ok & jnp.all(norms <= 1.0 + _NORM_SLACK)
  return ok


def _check_norms(X: np.ndarray, data_norm: float, clip: bool) -> None:
  if clip:
    return
  norms = np.linalg.norm(np.asarray(X, np.float64) / data_norm, axis=1)
  above = int(np.sum(norms > 1.0 + _NORM_SLACK))
  if above:
    raise ValueError(
        f"X has {above} of {X.shape[0]} rows with norm above data_norm={data_norm:g}. Pass "
        "clip=True to scale them down to the bound (a fixed map of each row), or divide the "
        "data by a PUBLIC constant first (e.g. the largest norm the features can have); never "
        "rescale by the data's own maximum norm, which is not private.")


def _check_labels(labels, n: int, name: str, *, allowed, integer: bool = False, hint: str = ""):
  """Validates ``(n,)`` labels: float64 NumPy (or int64 for ``integer``) or the tracer."""
  arr = labels if isinstance(labels, jax.Array) else np.asarray(labels)
  dtype = arr.dtype
  numeric = np.issubdtype(dtype, np.integer) or (not integer and np.issubdtype(dtype, np.floating))
  if dtype == np.bool_ or not numeric:
    kind = "integer" if integer else "real"
    raise TypeError(f"{name} must be a {kind} array, got dtype={dtype}.")
  if arr.shape != (n,):
    raise ValueError(f"{name} must have shape ({n},) to match X, got {tuple(arr.shape)}.")
  if v.is_traced(arr):
    return arr
  with jax.enable_x64(True):
    host = np.asarray(arr, np.int64 if integer else np.float64)
  if not integer and not np.all(np.isfinite(host)):
    raise ValueError(f"{name} contains NaN or infinite entries.")
  outside = int(np.sum(~np.isin(host, np.asarray(allowed))))
  if outside:
    raise ValueError(f"{name} has {outside} of {n} entries outside {sorted(allowed)}{hint}.")
  return host


def _check_classes(classes) -> tuple[int, ...]:
  values = tuple(classes) if isinstance(classes, (list, tuple, range, np.ndarray)) else None
  if values is None or any(isinstance(c, bool) or not isinstance(c, (int, np.integer))
                           for c in values):
    raise TypeError(f"classes must be a sequence of integers (public), got {classes!r}.")
  values = tuple(int(c) for c in values)
  if len(values) < 2 or len(set(values)) != len(values):
    raise ValueError(f"classes must hold at least 2 distinct integers, got {values}.")
  return values
