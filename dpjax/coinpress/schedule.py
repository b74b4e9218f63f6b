"""CoinPress's shared schedule: budget split, public radii, validation (docs/algorithms.md §3.5–3.6).

Biswas, Dong, Kamath & Ullman (NeurIPS 2020) refine a coarse public confidence region — a ball
``B(c, r) ∋ μ`` for a mean, a Loewner bound ``Σ ⪯ κ I`` for a covariance — in a few rounds. Each
round clips the rows to a region derived from the current bound, releases a clipped statistic
with Gaussian noise, and shrinks the region around the release. This is the refinement step of
the Ashtiani–Liaw pipeline (docs/algorithms.md §3.5, Thm 5.5): the AL learner gives a constant-factor
preconditioner, CoinPress turns it into a small-error estimate.

Privacy accounting. Every round is a Gaussian mechanism on a statistic whose replace-one
ℓ2-sensitivity ``Δ_t`` is a public number; it is described as a ``dp_accounting``
``GaussianDpEvent`` with noise multiplier ``z_t = σ_t/Δ_t`` and the rounds can be composed by a
``dp_accounting`` accountant. The paper's zCDP budget split
``ρ_t = f_t ρ`` becomes ``z_t = s/sqrt(f_t)`` with one common scale ``s`` that is calibrated on
the host so that the composition is (ε, δ)-DP under replace-one. For Gaussian mechanisms the
composition is exactly a single Gaussian mechanism with multiplier
``(Σ_t z_t^{-2})^{-1/2} = s`` (Dong, Roth & Su 2019), so with continuous noise
(``secure=False``, ``accountant="analytic"``) ``s`` is the analytic Gaussian σ of (ε, δ) at
sensitivity 1 (exact, instant); ``"pld"`` and ``"rdp"`` calibrate with dp_accounting instead (PLD
agrees up to its discretisation and is the tests' cross-check; it takes 15–25 s at ε ≥ 10). The
default float-safe release (``secure=True``, below) adds discrete Gaussian noise, whose
guarantee is its Rényi DP: it is calibrated with ``"rdp"`` (zCDP composition, ρ = Σ_t 1/(2z_t²)).

[CAUTION] ``GaussianDpEvent(z)`` means "a Gaussian of std z on a statistic that moves by at most
1 between neighbours". That is what the RDP accountant and the PLD accountant under
``ADD_OR_REMOVE_ONE`` compute for an unsampled Gaussian, and it is the right reading here because
``Δ_t`` is already the replace-one sensitivity (the largest change of the statistic when one row is
replaced). ``dp_accounting``'s PLD accountant under ``REPLACE_ONE`` instead reads ``z`` relative to
a per-record bound and doubles the shift (ε ≈ 2.1 instead of 1.0 at the same σ); it is not used.

Example::

    import jax, numpy as np
    from dpjax.coinpress import coinpress_covariance, coinpress_mean
    X = np.random.default_rng(0).normal(size=(20_000, 10)) + 3.0     # N(3·1, I)
    res = coinpress_mean(jax.random.key(0), X, epsilon=1.0, delta=1e-6,
                         center=np.zeros(10), radius=100.0)
    res.estimate            # (10,) float64, within res.info["error_bound"] of μ w.p. ≥ 0.99
    cov = coinpress_covariance(jax.random.key(1), X - 3.0, epsilon=1.0, delta=1e-6, kappa=2.0)
    cov.estimate            # (10, 10) float64, symmetric PSD

Numerics: the public radii, noise scales and bounds are computed on the host in float64 (NumPy and
``math``); the steps run in JAX in float64 through :func:`dpjax._host.float64`: eagerly under
``jax.enable_x64(True)`` (float64 NumPy outputs whatever the global x64 flag), under ``jit`` /
``vmap`` staged in the caller's program, which must be traced with x64 on (a float32 trace
raises ``TypeError``). No JAX runs inside a host callback: the float-safe releases below are
the mechanism's NumPy callbacks.

Floating point (docs/algorithms.md §1.10). By default (``secure=True``) every step's release goes
through :func:`dpjax.mechanisms.discretized_gaussian_mechanism`: exact discrete Gaussian noise on
a public power-of-two grid, so each released centre (mean) or noisy second moment (covariance) is a
multiple of its grid step whatever the data, and the later steps and the output are
post-processing of those releases. Its guarantee is proved through Rényi DP, so the steps are
calibrated with the RDP accountant (``accountant="rdp"``, about 5% more noise than the exact
analytic composition). ``secure=False`` keeps the continuous noise sampled in floating point, with
the ``"analytic"`` (default there), ``"pld"`` or ``"rdp"`` calibration; its float releases are
open to the low-order-bit attacks of §1.10.

References:
  S. Biswas, Y. Dong, G. Kamath, J. Ullman, "CoinPress: Practical Private Mean and Covariance
  Estimation", NeurIPS 2020, arXiv:2006.06618 (Algorithms 1–4; budget split of its experiments).
  B. Laurent & P. Massart, "Adaptive estimation of a quadratic functional by model selection",
  Ann. Statist. 2000 (χ² tail bound, Lemma 1).
  K. Davidson & S. Szarek, "Local operator theory, random matrices and Banach spaces", 2001
  (singular values of Gaussian matrices); R. Vershynin, "High-Dimensional Probability", 2018.
  J. Dong, A. Roth, W. Su, "Gaussian Differential Privacy", 2019 (composition of Gaussians).
  M. Bun & T. Steinke, "Concentrated Differential Privacy", TCC 2016 (zCDP of the Gaussian).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import dp_accounting
import jax
import jax.numpy as jnp

from dpjax import _validation as v
from dpjax import accounting

__all__ = ["calibrate_noise_scale"]

ACCOUNTANTS = accounting.GAUSSIAN_ACCOUNTANTS
CONTINUOUS_ONLY = ("analytic", "pld")    # exact for continuous Gaussian noise only
DEFAULT_STEPS = 4
MAX_STEPS = 64


def default_fractions(steps: int) -> tuple[float, ...]:
  """The paper's budget split: the last step gets 3/4, the others share 1/4 equally.

  ``steps == 1`` gives ``(1.0,)``; ``steps == 4`` gives ``(1/12, 1/12, 1/12, 3/4)``. This is the
  split used in all of CoinPress's experiments (fractions of the zCDP budget ρ).

  Args:
    steps: number of steps T ≥ 1.

  Returns:
    A tuple of T positive floats summing to 1.

  Raises:
    ValueError / TypeError: ``steps`` not an integer in ``[1, 64]``.
  """
  steps = v.check_int(steps, "steps", low=1, high=MAX_STEPS)
  if steps == 1:
    return (1.0,)
  return (0.25 / (steps - 1),) * (steps - 1) + (0.75,)


def gaussian_norm_radius(d: int, beta: float) -> float:
  """``sqrt(d + 2 sqrt(d ln(1/β)) + 2 ln(1/β))``: ``P(‖g‖ > radius) ≤ β`` for ``g ~ N(0, I_d)``.

  Laurent & Massart (2000, Lemma 1): ``P(χ²_d ≥ d + 2 sqrt(d x) + 2x) ≤ e^{−x}``. This is the
  paper's γ (its "Gaussian tail bound").

  Args:
    d: dimension ≥ 1.
    beta: failure probability in (0, 1).

  Returns:
    The radius as a Python float.
  """
  d = v.check_int(d, "d", low=1)
  beta = v.check_probability(beta, "beta", open_high=True)
  x = math.log(1.0 / beta)
  return math.sqrt(d + 2.0 * math.sqrt(d * x) + 2.0 * x)


def calibrate_noise_scale(epsilon: float, delta: float, fractions: Sequence[float], *,
                          accountant: str = "pld") -> float:
  """The common scale s for which ``z_t = s/sqrt(f_t)`` composes to (ε, δ)-DP.

  :func:`dpjax.accounting.calibrate_gaussian_composition`: ``dp_accounting``'s calibration
  (Brent's method, its own bracket search from the analytic single-Gaussian σ — the composition
  of the steps is exactly a Gaussian with multiplier s). ``gaussian_composition_epsilon(s/sqrt(
  f_t), δ) ≤ ε`` always holds, with equality to about 1e-6 relative precision in s. Results are
  cached per ``(ε, δ, fractions, accountant)``.

  Args:
    epsilon: ε > 0.
    delta: δ ∈ (0, 1).
    fractions: the per-step budget fractions ``f_t > 0`` summing to 1.
    accountant: "analytic", "pld" or "rdp".

  ``"analytic"`` uses that the composition of Gaussian mechanisms with multipliers
  ``z_t = s/sqrt(f_t)``, ``Σ f_t = 1``, is exactly one Gaussian mechanism with multiplier
  ``(Σ z_t^{-2})^{-1/2} = s`` (Dong, Roth & Su 2019, GDP composition), so the exact s is the
  analytic Gaussian σ of (ε, δ) at sensitivity 1 (Balle & Wang 2018,
  :func:`dpjax.mechanisms.analytic_gaussian_sigma`). PLD agrees up to its discretisation (tests
  cross-check it) but takes 15–25 s at ε ≥ 10; RDP is an upper bound (≈ 5% more noise).

  Returns:
    s as a Python float; ``1/(2 s²)`` is the total zCDP ρ of the steps.

  Raises:
    ValueError: bad ε, δ, fractions or accountant, or no s in ``[1e-3, 1e6]`` reaches the target.
  """
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  fractions = _check_fractions(fractions, None)
  v.check_choice(accountant, "accountant", ACCOUNTANTS)
  return accounting.calibrate_gaussian_composition(epsilon, delta, fractions,
                                                   accountant=accountant)[0]


def steps_event(noise_multipliers, secure: bool) -> dp_accounting.DpEvent:
  """The ``dp_accounting`` event of CoinPress's T Gaussian steps with multipliers ``z_t``
  (sensitivities under replace-one): ``ComposedDpEvent`` of ``GaussianDpEvent(z_t)`` for
  continuous noise (exact for PLD and RDP, :func:`dpjax.accounting.gaussian_composition_event`);
  for the float-safe discrete Gaussian (``secure``) the Rényi statement it rests on,
  ``ZCDpEvent(ρ = Σ 1/(2 z_t²))`` (Canonne, Kamath & Steinke 2020, Thm 4), which the RDP
  accountant composes."""
  if secure:
    return dp_accounting.ZCDpEvent(sum(0.5 / (z * z) for z in noise_multipliers))
  return accounting.gaussian_composition_event(noise_multipliers)


@functools.partial(jax.jit, static_argnums=(1,))
def _standard_normal(key, shape):
  """i.i.d. ``N(0, 1)`` of the given static shape in the current default float dtype.

  One draw of shape ``(T, ...)`` from one key gives every step its own independent noise; it is
  compiled per ``(T, d)`` only, so the data-sized cores below carry no RNG and compile faster.
  """
  return jax.random.normal(key, shape, jnp.result_type(float))


def _check_fractions(fractions, steps: int | None) -> tuple[float, ...]:
  if fractions is None:
    return default_fractions(DEFAULT_STEPS if steps is None else steps)
  try:
    values = [float(f) for f in fractions]
  except (TypeError, ValueError) as exc:
    raise TypeError(f"fractions must be a sequence of real numbers, got {fractions!r}.") from exc
  if not values or len(values) > MAX_STEPS:
    raise ValueError(f"fractions must hold between 1 and {MAX_STEPS} values, got "
                     f"{len(values)}.")
  if steps is not None and len(values) != steps:
    raise ValueError(f"fractions has {len(values)} entries but steps={steps}; they must match.")
  if not all(math.isfinite(f) and f > 0.0 for f in values):
    raise ValueError(f"fractions must all be finite and > 0, got {tuple(values)}.")
  total = math.fsum(values)
  if abs(total - 1.0) > 1e-6:
    raise ValueError(f"fractions must sum to 1, got sum={total!r}.")
  return tuple(f / total for f in values)


def _check_common(epsilon, delta, beta, steps, fractions, accountant, secure):
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  beta = v.check_probability(beta, "beta", open_high=True)
  if steps is not None:
    steps = v.check_int(steps, "steps", low=1, high=MAX_STEPS)
  fractions = _check_fractions(fractions, steps)
  if accountant is None:
    accountant = "rdp" if secure else "analytic"
  v.check_choice(accountant, "accountant", ACCOUNTANTS)
  if secure and accountant in CONTINUOUS_ONLY:
    raise ValueError(f"accountant={accountant!r} is exact for continuous Gaussian noise only; "
                     "secure=True releases discrete Gaussian noise, whose guarantee is proved "
                     "through Rényi DP: use accountant='rdp' (the default) or secure=False.")
  return epsilon, delta, beta, fractions, accountant
