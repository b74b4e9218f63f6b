"""CoinPress: iterative private refinement of a mean and of a covariance (ALGORITHMS.md §3.5–3.6).

Biswas, Dong, Kamath & Ullman (NeurIPS 2020) refine a coarse public confidence region — a ball
``B(c, r) ∋ μ`` for a mean, a Loewner bound ``Σ ⪯ κ I`` for a covariance — in a few rounds. Each
round clips the rows to a region derived from the current bound, releases a clipped statistic
with Gaussian noise, and shrinks the region around the release. This is the refinement step of
the Ashtiani–Liaw pipeline (ALGORITHMS.md §3.5, Thm 5.5): the AL learner gives a constant-factor
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
    from dpjax.covariance.coinpress import coinpress_covariance, coinpress_mean
    X = np.random.default_rng(0).normal(size=(20_000, 10)) + 3.0     # N(3·1, I)
    res = coinpress_mean(jax.random.key(0), X, epsilon=1.0, delta=1e-6,
                         center=np.zeros(10), radius=100.0)
    res.estimate            # (10,) float64, within res.info["error_bound"] of μ w.p. ≥ 0.99
    cov = coinpress_covariance(jax.random.key(1), X - 3.0, epsilon=1.0, delta=1e-6, kappa=2.0)
    cov.estimate            # (10, 10) float64, symmetric PSD

Numerics: the public radii, noise scales and bounds are computed on the host in float64 (NumPy and
``math``); the jitted cores run under ``jax.enable_x64(True)`` in float64 and return float64
arrays, whatever the global x64 flag.

Floating point (ALGORITHMS.md §1.10). By default (``secure=True``) every step's release goes
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
from typing import Any, NamedTuple, Sequence

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np

from dpjax import _validation as v
from dpjax import linalg
from dpjax.mechanisms.gaussian import analytic_gaussian_sigma, discretized_gaussian_mechanism
from dpjax.mechanisms.grid import discretization

REPLACE_ONE = "replace_one"
ACCOUNTANTS = ("analytic", "pld", "rdp")
CONTINUOUS_ONLY = ("analytic", "pld")    # exact for continuous Gaussian noise only
DEFAULT_STEPS = 4
_AUTO_MAX_STEPS = 8          # choose_covariance_steps searches T in 1..8
_MAX_STEPS = 64
_SCALE_FLOOR = 1e-3          # noise scales s searched in [1e-3, 1e6]
_SCALE_CEILING = 1e6


class CoinPressResult(NamedTuple):
  """Outcome of :func:`coinpress_mean` or :func:`coinpress_covariance` (a pytree).

  Attributes:
    estimate: float64 NumPy array, ``(d,)`` for the mean, ``(d, d)`` symmetric PSD for the
      covariance (NumPy, so that it keeps float64 whatever the global ``jax_enable_x64`` flag).
    epsilon: ε (nats) spent, as composed by the accountant (≤ the requested ε).
    delta: δ spent (the requested δ).
    neighbouring: ``"replace_one"``: datasets with the same public n that differ in one row.
    info: public quantities only — the step count, budget fractions, noise multipliers and
      standard deviations, clipping radii and the other public bounds, and (mean only) the
      released intermediate centres, which are DP releases accounted for in ``epsilon``.
  """
  estimate: np.ndarray
  epsilon: float
  delta: float
  neighbouring: str
  info: dict[str, Any]


# --------------------------------------------------------------------------------------------
# Public calibration helpers (host, float64).
# --------------------------------------------------------------------------------------------


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
  steps = v.check_int(steps, "steps", low=1, high=_MAX_STEPS)
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


def coinpress_event(noise_multipliers: Sequence[float]) -> dp_accounting.DpEvent:
  """``ComposedDpEvent`` of one ``GaussianDpEvent(z_t)`` per CoinPress step.

  ``z_t = σ_t/Δ_t`` with Δ_t the replace-one ℓ2-sensitivity of step t's statistic. Compose it
  with ``RdpAccountant()`` or ``PLDAccountant()`` (add/remove relation: the event is read as a
  shift-1 Gaussian; see the module docstring's CAUTION), never with the PLD ``REPLACE_ONE``
  relation.
  """
  zs = [v.check_positive(z, "noise_multiplier") for z in noise_multipliers]
  if not zs:
    raise ValueError("noise_multipliers must not be empty.")
  return dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z) for z in zs])


def coinpress_epsilon(noise_multipliers: Sequence[float], delta: float, *,
                      accountant: str = "pld") -> float:
  """ε at ``delta`` of the composed CoinPress steps (replace-one, Δ_t = replace-one sensitivity).

  Args:
    noise_multipliers: ``z_t = σ_t/Δ_t > 0``, one per step.
    delta: δ ∈ (0, 1).
    accountant: "pld" (tight; default) or "rdp" (an upper bound, fast).

  Returns:
    ε as a Python float.
  """
  delta = v.check_delta(delta)
  event = coinpress_event(noise_multipliers)
  return float(_shift_one_accountant(accountant).compose(event).get_epsilon(delta))


def calibrate_noise_scale(epsilon: float, delta: float, fractions: Sequence[float], *,
                          accountant: str = "pld") -> float:
  """The common scale s for which ``z_t = s/sqrt(f_t)`` composes to (ε, δ)-DP.

  ``dp_accounting.calibrate_dp_mechanism`` (Brent's method) searches s inside a bracket found by
  expanding around the analytic single-Gaussian σ (the composition of the steps is exactly a
  Gaussian with multiplier s, so the bracket is narrow). The result is re-checked with a fresh
  accountant: ``coinpress_epsilon(s/sqrt(f_t), δ) ≤ ε`` always holds, and equality holds to
  about 1e-6 relative precision in s. Results are cached per ``(ε, δ, fractions, accountant)``.

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
  return _calibrate_cached(epsilon, delta, fractions, accountant)[0]


# --------------------------------------------------------------------------------------------
# Mean.
# --------------------------------------------------------------------------------------------


def coinpress_mean(key: jax.Array, X, *, epsilon: float, delta: float, center, radius: float,
                   steps: int | None = None, beta: float = 0.01,
                   fractions: Sequence[float] | None = None, accountant: str | None = None,
                   secure: bool = True) -> CoinPressResult:
  """CoinPress private mean (the paper's MVMRec, Algorithms 1–2), (ε, δ)-DP under replace-one.

  Model (for utility only): rows ``x_i ~ N(μ, Σ)`` i.i.d. with ``Σ ⪯ I`` and a public prior
  ``‖μ − center‖ ≤ radius``. For data whitened by a preconditioner with
  ``(1/K) I ⪯ Σ_w ⪯ K I`` divide the whitened rows, the prior centre and the radius by
  ``sqrt(K)`` (then ``Σ ⪯ I``) and multiply the estimate back.

  Algorithm. With ``γ = gaussian_norm_radius(d, β/(2n))`` (all n rows lie within γ of μ w.p.
  ≥ 1 − β/2) and ``γ' = gaussian_norm_radius(d, β/(2T))``, start from ``c_0 = center``,
  ``r_0 = radius`` and for ``t = 0..T−1``:

    1. clip every row to the ball ``B(c_t, R_t)``, ``R_t = r_t + γ``
       (``x ↦ c_t + (x − c_t) min(1, R_t/‖x − c_t‖)``);
    2. release ``c_{t+1} = mean(clipped rows) + N(0, σ_t² I_d)``, ``σ_t = z_t · 2R_t/n`` (by
       default the float-safe discretized Gaussian: σ_t is then ``z_t`` times the grid
       sensitivity, at most ``(1 + 2^-10)·2R_t/n``; module docstring);
    3. shrink: ``r_{t+1} = γ' sqrt(1/n + σ_t²)``.

  Output ``c_T``. Every ``R_t``, ``σ_t`` and ``r_t`` is a public function of
  ``(n, d, radius, ε, δ, β, fractions)``; no data-dependent radius is ever used.

  Utility [DERIVED, the paper's argument]: on the event that all ``‖x_i − μ‖ ≤ γ`` (prob ≥ 1 −
  β/2) and ``‖μ − c_t‖ ≤ r_t``, nothing is clipped, so ``c_{t+1} − μ = (x̄ − μ) + Y_t`` with
  covariance ``Σ/n + σ_t² I ⪯ (1/n + σ_t²) I``, hence ``‖c_{t+1} − μ‖ ≤ r_{t+1}`` w.p.
  ≥ 1 − β/(2T). By induction, w.p. ≥ 1 − β: ``‖μ̂ − μ‖ ≤ r_T = info["error_bound"]``; the
  typical error is that of ``N(0, (1/n + σ_{T−1}²) I_d)``, about ``sqrt(d (1/n + σ_{T−1}²))``
  (sampling plus the last step's noise). If the prior or the model is wrong the output is still
  private, only less accurate.

  Privacy. Step t releases a function of the rows clipped to ``B(c_t, R_t)``; ``c_t`` is an
  earlier release and ``R_t`` is public, so (adaptive composition) the step is a Gaussian
  mechanism on the clipped mean, whose replace-one ℓ2-sensitivity is ``Δ_t = 2R_t/n``: replacing
  ``x`` by ``x'`` moves the mean by ``(x̃ − x̃')/n`` and both clipped rows lie in a ball of radius
  ``R_t``. The T steps are ``GaussianDpEvent(z_t)`` events composed by ``dp_accounting``, with
  ``z_t = s/sqrt(f_t)`` and s calibrated so the total is (ε, δ)-DP (replace-one; n is public).

  Args:
    key: a JAX PRNG key, used once: one draw gives all T steps independent noise.
    X: ``(n, d)`` real array, rows are individuals, ``n ≥ 2``; integer input is converted.
    epsilon: ε > 0 (nats).
    delta: δ ∈ (0, 1).
    center: ``(d,)`` public prior centre.
    radius: public prior radius > 0 with ``‖μ − center‖ ≤ radius``.
    steps: number of steps T (default 4, or ``len(fractions)``).
    beta: failure probability of the utility guarantee, in (0, 1) (default 0.01, as in the
      paper's code). It sets public radii only; privacy does not depend on it.
    fractions: per-step budget fractions ``f_t > 0`` summing to 1 (default
      :func:`default_fractions`: 3/4 to the last step, 1/4 shared by the others).
    accountant: None (``"rdp"`` when ``secure``, else ``"analytic"``), ``"analytic"`` (exact
      for continuous noise, see :func:`calibrate_noise_scale`), ``"pld"`` or ``"rdp"``. Only
      ``"rdp"`` is valid with ``secure=True``.
    secure: float-safe discretized releases (default) or raw continuous noise.

  Returns:
    :class:`CoinPressResult` with ``estimate`` a float64 ``(d,)`` array (with ``secure=True``
    a multiple of ``info["grids"][-1]``) and ``info`` holding
    ``steps``, ``fractions``, ``noise_scale`` (s), ``noise_multipliers`` (z_t), ``sigmas``
    (σ_t), ``sensitivities`` (Δ_t), ``clip_radii`` (R_t), ``radii`` (r_0..r_T),
    ``error_bound`` (r_T), ``centers`` (``(T, d)`` released c_1..c_T), ``gamma``, ``beta``,
    ``zcdp_rho`` (= 1/(2s²)), ``accountant``, ``secure`` and (secure) ``grids`` (Λ_t).

  Raises:
    TypeError: ``key`` not a PRNG key; non-numeric ``X``/``center``; non-integer ``steps``.
    ValueError: ``X`` not 2-D, ``n < 2``, NaN/inf in ``X`` or ``center``; ``center`` not of
      shape ``(d,)``; ``radius ≤ 0``; ε ≤ 0; δ ∉ (0, 1); β ∉ (0, 1); bad ``fractions`` or
      ``steps``; unknown ``accountant``, or ``"analytic"``/``"pld"`` with ``secure=True``.

  References:
    Biswas, Dong, Kamath & Ullman, NeurIPS 2020, Algorithms 1–2 (MVM, MVMRec).
  """
  key = v.check_key(key)
  X64 = v.check_data64(X, "X", min_rows=2)
  n, d = X64.shape
  center64 = _check_center(center, d)
  radius = v.check_positive(radius, "radius")
  epsilon, delta, beta, fractions, accountant = _check_common(
      epsilon, delta, beta, steps, fractions, accountant, secure)
  T = len(fractions)

  s, spent = _calibrate_cached(epsilon, delta, fractions, accountant)
  zs = tuple(s / math.sqrt(f) for f in fractions)
  gamma = gaussian_norm_radius(d, beta / (2.0 * n))
  gamma_step = gaussian_norm_radius(d, beta / (2.0 * T))
  radii, clip_radii, sens, sigmas, grids = [radius], [], [], [], []
  for z in zs:
    big_r = radii[-1] + gamma
    clip_radii.append(big_r)
    sens.append(2.0 * big_r / n)
    if secure:                                  # the discretized release's effective std
      grid = discretization(sens[-1], d)
      grids.append(grid.grid)
      sigmas.append(z * grid.grid_sensitivity * grid.grid)
    else:
      sigmas.append(z * sens[-1])
    radii.append(gamma_step * math.sqrt(1.0 / n + sigmas[-1] ** 2))

  with jax.enable_x64(True):
    X_j, c = jnp.asarray(X64), jnp.asarray(center64)
    if secure:
      centers = []
      for k_step, big_r, sensitivity, z in zip(jax.random.split(key, T), clip_radii, sens, zs):
        stat = np.asarray(_clipped_mean(X_j, c, jnp.float64(big_r)), np.float64)
        released = discretized_gaussian_mechanism(k_step, stat, sensitivity=sensitivity,
                                                  noise_multiplier=z)
        centers.append(released)
        c = jnp.asarray(released)
      centers = np.stack(centers)
      estimate = centers[-1]
    else:
      estimate, centers = _mean_core(key, X_j, c, jnp.asarray(clip_radii, jnp.float64),
                                     jnp.asarray(sigmas, jnp.float64))
      estimate, centers = np.asarray(estimate, np.float64), np.asarray(centers, np.float64)
  info = dict(steps=T, fractions=fractions, noise_scale=s, noise_multipliers=zs,
              sigmas=tuple(sigmas), sensitivities=tuple(sens), clip_radii=tuple(clip_radii),
              radii=tuple(radii), error_bound=radii[-1], centers=centers, gamma=gamma,
              beta=beta, zcdp_rho=1.0 / (2.0 * s * s), accountant=accountant,
              secure=bool(secure))
  if secure:
    info["grids"] = tuple(grids)
  return CoinPressResult(estimate, spent, delta, REPLACE_ONE, info)


@functools.partial(jax.jit, static_argnums=(1,))
def _standard_normal(key, shape):
  """i.i.d. ``N(0, 1)`` of the given static shape in the current default float dtype.

  One draw of shape ``(T, ...)`` from one key gives every step its own independent noise; it is
  compiled per ``(T, d)`` only, so the data-sized cores below carry no RNG and compile faster.
  """
  return jax.random.normal(key, shape, jnp.result_type(float))


def _mean_core(key, X, center, clip_radii, sigmas):
  """Traceable CoinPress mean with raw continuous noise (float64 under x64): returns
  ``(c_T, centres (T, d))``."""
  noise = _standard_normal(key, (clip_radii.shape[0], X.shape[1]))
  return _mean_steps(X, center, clip_radii, sigmas, noise)


def _clipped_mean_impl(X, c, big_r):
  """Mean of the rows clipped to the ball ``B(c, R)`` (the statistic each step releases)."""
  diff = X - c
  norms = jnp.sqrt(jnp.sum(diff * diff, axis=1))
  scale = jnp.minimum(1.0, big_r / jnp.maximum(norms, jnp.finfo(X.dtype).tiny))
  return c + jnp.mean(diff * scale[:, None], axis=0)


_clipped_mean = jax.jit(_clipped_mean_impl)


@jax.jit
def _mean_steps(X, center, clip_radii, sigmas, noise):
  """T clip-and-noise steps given the standard normal noise ``(T, d)``."""

  def step(c, inputs):
    big_r, sigma, g = inputs
    c_next = _clipped_mean_impl(X, c, big_r) + sigma * g      # the release of this step
    return c_next, c_next

  return jax.lax.scan(step, center, (clip_radii, sigmas, noise))


# --------------------------------------------------------------------------------------------
# Covariance.
# --------------------------------------------------------------------------------------------


def coinpress_covariance(key: jax.Array, X, *, epsilon: float, delta: float, kappa: float,
                         steps: int | None = None, beta: float = 0.01,
                         fractions: Sequence[float] | None = None,
                         accountant: str | None = None, secure: bool = True) -> CoinPressResult:
  """CoinPress private covariance (the paper's MVCRec, Algorithms 3–4), (ε, δ)-DP, replace-one.

  Model (for utility only): rows ``x_i ~ N(0, Σ)`` i.i.d. with ``I ⪯ Σ ⪯ κ I`` for a public κ
  (only ``Σ ⪯ κI`` is needed for the no-clipping event; ``I ⪯ Σ`` enters the error bound). For
  an unknown mean use the differences ``(x_{2i} − x_{2i−1})/√2`` (n/2 rows).

  Use after a preconditioner (ALGORITHMS.md §3.5): if Σ̃ satisfies ``(1/K) I ⪯ Σ_w ⪯ K I`` for
  ``Σ_w = Σ̃^{-1/2} Σ Σ̃^{-1/2}``, feed ``Y = sqrt(K) · X Σ̃^{-1/2}`` (covariance ``K Σ_w``, so
  ``I ⪯ K Σ_w ⪯ K² I``) with ``kappa = K²``, and map back
  ``Σ̂ = Σ̃^{1/2} Σ̂_Y Σ̃^{1/2} / K``. Since Σ̃ is itself a DP release, this is post-processing of
  it and the budgets compose.

  Algorithm. Keep a whitening matrix ``M_t`` (``M_0 = κ^{-1/2} I``) with, on the good event,
  ``Σ_t := M_t Σ M_tᵀ ⪯ I``. Public constants: ``γ = gaussian_norm_radius(d, β/(3n))``,
  ``Δ = √2 γ²/n``, ``a = sqrt(d/n) + sqrt(2 ln(6/β)/n)``. For ``t = 0..T−1``:

    1. whiten ``w_i = M_t x_i`` and clip to norm ≤ γ: ``w̃_i = w_i min(1, γ/‖w_i‖)``;
    2. release ``Z_t = (1/n) Σ_i w̃_i w̃_iᵀ + E_t`` with ``E_t = σ_t (G + Gᵀ)/2``, G i.i.d.
       ``N(0, 1)``, ``σ_t = z_t Δ`` (a Gaussian on symmetric matrices with the Frobenius norm;
       by default the float-safe discretized Gaussian on the ``d(d+1)/2`` isometric coordinates,
       σ_t then ``z_t`` times the grid sensitivity ≤ ``(1 + 2^-10)Δ``);
    3. ``η_t = 2a + a² + σ_t (sqrt(2d) + sqrt(2 ln(6T/β)))`` (public), and
       ``U_t = P_+(Z_t) + η_t I``, ``M_{t+1} = U_t^{-1/2} M_t`` (P_+: projection onto the PSD
       cone).

  Output ``Σ̂ = M_{T−1}^{-1} P_+(Z_{T−1}) M_{T−1}^{-ᵀ}``, symmetric PSD (P_+ and the change of basis
  are post-processing).

  Privacy. Step t is a Gaussian mechanism on ``f_t(X) = (1/n) Σ w̃_i w̃_iᵀ`` in the Euclidean space
  of symmetric matrices with ``⟨A, B⟩ = tr(AB)`` (isometric to R^{d(d+1)/2} via the entries
  ``A_ii`` and ``√2 A_ij``, i < j; in those coordinates ``E_t`` is ``N(0, σ_t² I)``). ``M_t`` is a
  function of earlier releases only, and γ is public. Replace-one Frobenius sensitivity
  ``Δ = √2 γ²/n``: replacing row i changes ``f_t`` by ``(w wᵀ − w' w'ᵀ)/n`` with
  ``‖w‖, ‖w'‖ ≤ γ``, and
  ``‖w wᵀ − w' w'ᵀ‖_F² = ‖w‖⁴ + ‖w'‖⁴ − 2 (wᵀw')² ≤ 2γ⁴`` (tight for orthogonal w, w' of norm
  γ). The T steps are ``GaussianDpEvent(z_t)`` events composed by ``dp_accounting`` with
  ``z_t = s/sqrt(f_t)`` and s calibrated to (ε, δ) under replace-one.

  Utility [DERIVED, the paper's argument with explicit constants]. Write ``x_i = Σ^{1/2} g_i``.
  Good event (prob ≥ 1 − β): all ``‖g_i‖ ≤ γ`` (β/3, union over rows); ``‖(1/n)Σ g_i g_iᵀ − I‖
  ≤ 2a + a²`` (β/3, Gaussian singular values); and every ``‖E_t‖ ≤ σ_t(sqrt(2d) +
  sqrt(2 ln(6T/β)))`` (β/(3T) each: ``E λ_max(E_t) ≤ σ_t sqrt(2d)`` by Sudakov–Fernique and
  λ_max is σ_t-Lipschitz in the Gaussian coordinates). On it, by induction, ``Σ_t ⪯ I`` (so
  nothing is clipped), ``‖Z_t − Σ_t‖ ≤ η_t``, ``Σ_t ⪯ U_t ⪯ Σ_t + 3η_t I`` and
  ``λ_min(Σ_{t+1}) ≥ λ_{t+1} = λ_t/(λ_t + 3η_t)``, ``λ_0 = 1/κ``; finally
  ``‖Σ^{-1/2} Σ̂ Σ^{-1/2} − I‖_2 ≤ 2a + a² + 2‖E_{T−1}‖/λ_{T−1} = info["error_bound"]``. This
  bound is worst-case (η_t dominates λ_t when κ is large and n small); typical errors are much
  smaller.

  Args:
    key: a JAX PRNG key, used once: one draw gives all T steps independent noise.
    X: ``(n, d)`` real array, rows are individuals, ``n ≥ 2``.
    epsilon: ε > 0 (nats).
    delta: δ ∈ (0, 1).
    kappa: public κ ≥ 1 with ``I ⪯ Σ ⪯ κ I``.
    steps: number of steps T. Default (``steps`` and ``fractions`` both None) [PROPOSED]:
      :func:`choose_covariance_steps`, a public function of ``(n, d, κ, ε, δ, β)`` — too many
      steps hurt at small n (d = 10, n = 1e4, κ = 10, ε = 1: error ≈0.7 at T = 1, ≈3 at
      T = 4). Otherwise ``len(fractions)``, or 4 when only ``fractions`` is None.
    beta: failure probability of the utility guarantee, in (0, 1) (default 0.01). Sets the
      public clipping radius γ and η_t; privacy does not depend on it.
    fractions: per-step budget fractions ``f_t > 0`` summing to 1 (default
      :func:`default_fractions`).
    accountant: None (``"rdp"`` when ``secure``, else ``"analytic"``), ``"analytic"`` (exact
      for continuous noise, see :func:`calibrate_noise_scale`), ``"pld"`` or ``"rdp"``. Only
      ``"rdp"`` is valid with ``secure=True``.
    secure: float-safe discretized releases (default) or raw continuous noise.

  Returns:
    :class:`CoinPressResult` with ``estimate`` a float64 ``(d, d)`` symmetric PSD array and
    ``info`` holding ``steps``, ``fractions``, ``noise_scale``, ``noise_multipliers``,
    ``sigmas``, ``sensitivities`` (Δ per step), ``clip_radii`` (γ per step), ``etas``,
    ``lower_bounds`` (λ_0..λ_{T−1}), ``error_bound``, ``beta``, ``steps_rule``
    ("choose_covariance_steps" or "given"), ``zcdp_rho``, ``accountant``, ``secure`` and
    (secure) ``grids`` (Λ_t) and ``releases`` (the ``(T, d, d)`` released Z_t, DP releases
    accounted in ε, on their grids in the isometric coordinates).

  Raises:
    TypeError: ``key`` not a PRNG key; non-numeric ``X``; non-integer ``steps``.
    ValueError: ``X`` not 2-D, ``n < 2``, NaN/inf in ``X``; ``kappa`` not finite or < 1; ε ≤ 0;
      δ ∉ (0, 1); β ∉ (0, 1); bad ``fractions`` or ``steps``; unknown ``accountant``, or
      ``"analytic"``/``"pld"`` with ``secure=True``.

  References:
    Biswas, Dong, Kamath & Ullman, NeurIPS 2020, Algorithms 3–4 (MVC, MVCRec);
    Ashtiani & Liaw, COLT 2022, Thm 5.5 (refinement after a preconditioner).
  """
  key = v.check_key(key)
  X64 = v.check_data64(X, "X", min_rows=2)
  n, d = X64.shape
  kappa = v.check_positive(kappa, "kappa")
  if kappa < 1.0:
    raise ValueError(f"kappa must be >= 1 (the bound I ⪯ Σ ⪯ kappa·I), got kappa={kappa!r}.")
  auto_steps = steps is None and fractions is None
  epsilon, delta, beta, fractions, accountant = _check_common(
      epsilon, delta, beta, steps, fractions, accountant, secure)
  if auto_steps:
    fractions = default_fractions(choose_covariance_steps(n, d, kappa=kappa, epsilon=epsilon,
                                                          delta=delta, beta=beta))
  T = len(fractions)

  s, spent = _calibrate_cached(epsilon, delta, fractions, accountant)
  zs = tuple(s / math.sqrt(f) for f in fractions)
  plan = _covariance_plan(n, d, kappa, beta, fractions, s, secure=secure)
  gamma, sens, sigmas, etas = plan.gamma, plan.sensitivity, plan.sigmas, plan.etas
  m0 = 1.0 / math.sqrt(kappa)

  with jax.enable_x64(True):
    X_j = jnp.asarray(X64)
    if secure:
      M, M_inv = jnp.eye(d) * m0, jnp.eye(d) / m0
      releases = []
      for k_step, z, eta in zip(jax.random.split(key, T), zs, etas):
        coords = np.asarray(_svec(_whitened_second_moment(X_j, M, jnp.float64(gamma))))
        released = discretized_gaussian_mechanism(k_step, coords, sensitivity=sens,
                                                  noise_multiplier=z)
        Z = _unsvec(jnp.asarray(released), d)           # post-processing of the release
        releases.append(np.asarray(Z))
        M_inv_used = M_inv                              # the whitening Z was released in
        M, M_inv = _whitening_update(Z, M, M_inv, jnp.float64(eta))
      estimate = np.asarray(linalg.symmetrize(_covariance_estimate(Z, M_inv_used)), np.float64)
    else:
      estimate = _covariance_core(key, X_j, jnp.float64(m0), jnp.float64(gamma),
                                  jnp.asarray(sigmas, jnp.float64),
                                  jnp.asarray(etas, jnp.float64))
      estimate = np.asarray(linalg.symmetrize(estimate), np.float64)
  info = dict(steps=T, fractions=fractions, noise_scale=s, noise_multipliers=zs,
              sigmas=sigmas, sensitivities=(sens,) * T, clip_radii=(gamma,) * T, etas=etas,
              lower_bounds=plan.lower_bounds, error_bound=plan.error_bound, beta=beta,
              steps_rule="choose_covariance_steps" if auto_steps else "given",
              zcdp_rho=1.0 / (2.0 * s * s), accountant=accountant, secure=bool(secure))
  if secure:
    info.update(grids=(plan.grid,) * T, releases=np.stack(releases))
  return CoinPressResult(estimate, spent, delta, REPLACE_ONE, info)


def choose_covariance_steps(n: int, d: int, *, kappa: float, epsilon: float, delta: float,
                            beta: float = 0.01) -> int:
  """[PROPOSED] The default T of :func:`coinpress_covariance`, a public function of its arguments.

  The paper leaves T to the user (its theory takes T = O(log κ); its experiments use 1–5). Too
  many steps hurt when n is small — each step whose η_t exceeds the whitened covariance shrinks
  it further below the fixed clipping radius — and too few leave the preconditioning unfinished.
  Rule: among T = 1..8 with the paper's split, take the smallest T whose *typical-case* error
  proxy is within 10% of the best. The proxy is the ``error_bound`` recursion with the tail terms
  dropped: ``2 sqrt(d/n)`` for the sampling error, ``σ_t sqrt(2d)`` for ``‖E_t‖``,
  ``λ_{t+1} = λ_t/(λ_t + 2η_t)``, and ``2 sqrt(d/n) + 2 σ_{T−1} sqrt(2d)/λ_{T−1}`` at the end.
  (The rigorous bound itself is too pessimistic to choose with: it prefers T = 1 where T = 3
  halves the measured error.) The analytic Gaussian σ of (ε, δ) stands in for the accountant's
  common scale s (they agree up to the PLD discretisation), so no accountant runs here.

  Measured ``‖Σ^{-1/2}Σ̂Σ^{-1/2} − I‖_2`` (ε = 1, δ = 1e-6, κ = 10, mean over 5–8 seeds; chosen
  T in brackets): d = 10, n = 1e4, Σ eigenvalues 1..10 [1]: 0.72 (T = 4: 3.3); d = 10, n = 2e4,
  Σ = I [2]: 0.56 (T = 3: 0.51, T = 1: 0.90); d = 5 and 10, n = 5e4 [3, 4]: within 10% of the
  best T (0.03 and 0.06).

  Args:
    n: number of rows ≥ 2.
    d: dimension ≥ 1.
    kappa: κ ≥ 1 with ``I ⪯ Σ ⪯ κ I``.
    epsilon: ε > 0.
    delta: δ ∈ (0, 1).
    beta: β ∈ (0, 1).

  Returns:
    T as an int in ``[1, 8]``.
  """
  n = v.check_int(n, "n", low=2)
  d = v.check_int(d, "d", low=1)
  kappa = v.check_positive(kappa, "kappa")
  if kappa < 1.0:
    raise ValueError(f"kappa must be >= 1 (the bound I ⪯ Σ ⪯ kappa·I), got kappa={kappa!r}.")
  beta = v.check_probability(beta, "beta", open_high=True)
  s0 = analytic_gaussian_sigma(epsilon, delta, 1.0)
  proxies = [_covariance_plan(n, d, kappa, beta, default_fractions(t), s0).typical_error
             for t in range(1, _AUTO_MAX_STEPS + 1)]
  best = min(proxies)
  return 1 + next(i for i, p in enumerate(proxies) if p <= 1.1 * best)


class _CovariancePlan(NamedTuple):
  gamma: float
  sensitivity: float
  grid: float | None
  sigmas: tuple[float, ...]
  etas: tuple[float, ...]
  lower_bounds: tuple[float, ...]
  error_bound: float
  typical_error: float


def _covariance_plan(n: int, d: int, kappa: float, beta: float, fractions: tuple[float, ...],
                     scale: float, secure: bool = False) -> _CovariancePlan:
  """The public constants of :func:`coinpress_covariance` (host, float64). With ``secure`` the
  noise std is the discretized release's (z times the grid sensitivity, in matrix units)."""
  T = len(fractions)
  gamma = gaussian_norm_radius(d, beta / (3.0 * n))
  sens = math.sqrt(2.0) * gamma * gamma / n
  grid, noise_unit = None, sens
  if secure:
    discrete_grid = discretization(sens, d * (d + 1) // 2)
    grid, noise_unit = discrete_grid.grid, discrete_grid.grid_sensitivity * discrete_grid.grid
  sigmas = tuple(scale / math.sqrt(f) * noise_unit for f in fractions)
  a = math.sqrt(d / n) + math.sqrt(2.0 * math.log(6.0 / beta) / n)
  sampling = 2.0 * a + a * a
  tail = math.sqrt(2.0 * d) + math.sqrt(2.0 * math.log(6.0 * T / beta))
  noise_norms = tuple(sg * tail for sg in sigmas)
  etas = tuple(sampling + e for e in noise_norms)
  lower = [1.0 / kappa]
  for eta in etas[:-1]:
    lower.append(lower[-1] / (lower[-1] + 3.0 * eta))
  error_bound = sampling + 2.0 * noise_norms[-1] / lower[-1]
  # Typical-case proxy (choose_covariance_steps): the same recursion without the tail terms.
  sampling_typ = 2.0 * math.sqrt(d / n)
  lam = 1.0 / kappa
  for sg in sigmas[:-1]:
    lam = lam / (lam + 2.0 * (sampling_typ + sg * math.sqrt(2.0 * d)))
  typical = sampling_typ + 2.0 * sigmas[-1] * math.sqrt(2.0 * d) / lam
  return _CovariancePlan(gamma, sens, grid, sigmas, etas, tuple(lower), error_bound, typical)


def _psd_part(Z):
  """``(P_+(Z), eigenvalues, eigenvectors)`` of a symmetric matrix."""
  lam, V = jnp.linalg.eigh(Z)
  return (V * jnp.maximum(lam, 0.0)) @ V.T, lam, V


def _svec(S):
  """Isometric coordinates of a symmetric matrix: ``S_ii`` and ``√2 S_ij`` (i < j), row-major
  upper triangle; ``‖svec(S)‖₂ = ‖S‖_F``."""
  d = S.shape[0]
  rows, cols = np.triu_indices(d)
  return S[rows, cols] * jnp.where(rows == cols, 1.0, math.sqrt(2.0)).astype(S.dtype)


def _unsvec(v, d: int):
  """Inverse of :func:`_svec` (exactly symmetric)."""
  rows, cols = np.triu_indices(d)
  upper = jnp.zeros((d, d), v.dtype).at[rows, cols].set(
      v / jnp.where(rows == cols, 1.0, math.sqrt(2.0)).astype(v.dtype))
  return upper + jnp.triu(upper, 1).T


@jax.jit
def _whitened_second_moment(X, M, gamma):
  """``(1/n) Σ w̃_i w̃_iᵀ`` for ``w_i = M x_i`` clipped to norm γ: the statistic of one step."""
  W = X @ M.T
  norms = jnp.sqrt(jnp.sum(W * W, axis=1))
  W = W * jnp.minimum(1.0, gamma / jnp.maximum(norms, jnp.finfo(X.dtype).tiny))[:, None]
  S = (W.T @ W) / X.shape[0]
  return 0.5 * (S + S.T)


@jax.jit
def _whitening_update(Z, M, M_inv, eta):
  """``U = P_+(Z) + η I``, ``M ← U^{-1/2} M`` (post-processing of the release Z)."""
  _, lam, V = _psd_part(Z)
  u = jnp.maximum(lam, 0.0) + eta
  return (V * (1.0 / jnp.sqrt(u))) @ V.T @ M, M_inv @ (V * jnp.sqrt(u)) @ V.T


@jax.jit
def _covariance_estimate(Z, M_inv):
  """``Σ̂ = M^{-1} P_+(Z) M^{-ᵀ}`` from the last release (post-processing), exactly symmetric."""
  Zp, _, _ = _psd_part(Z)
  return M_inv @ Zp @ M_inv.T          # symmetric up to rounding; the wrapper makes it exact


def _covariance_core(key, X, m0, gamma, sigmas, etas):
  """Traceable CoinPress covariance with raw continuous noise (float64 under x64): the
  symmetric PSD ``(d, d)`` estimate."""
  d = X.shape[1]
  noise = _standard_normal(key, (sigmas.shape[0], d, d))
  return _covariance_steps(X, m0, gamma, sigmas, etas, noise)


@jax.jit
def _covariance_steps(X, m0, gamma, sigmas, etas, noise):
  """T whiten–clip–noise steps given standard normal ``(T, d, d)`` matrices G_t."""
  d = X.shape[1]
  eye = jnp.eye(d, dtype=X.dtype)

  def step(carry, inputs):
    M, M_inv, _, _ = carry
    sigma, eta, G = inputs
    Z = _whitened_second_moment(X, M, gamma) + sigma * 0.5 * (G + G.T)   # this step's release
    return _whitening_update(Z, M, M_inv, eta) + (Z, M_inv), None

  init = (m0 * eye, eye / m0, jnp.zeros_like(eye), eye / m0)
  (_, _, Z, M_inv), _ = jax.lax.scan(step, init, (sigmas, etas, noise))
  return _covariance_estimate(Z, M_inv)      # through the whitening that Z was released in

# --------------------------------------------------------------------------------------------
# Validation and calibration internals.
# --------------------------------------------------------------------------------------------


def _check_center(center, d: int) -> np.ndarray:
  arr = v.check_data64(center, "center", ndim=1)
  if arr.shape != (d,):
    raise ValueError(f"center must have shape (d,) = ({d},) to match X, got shape {arr.shape}.")
  return arr


def _check_fractions(fractions, steps: int | None) -> tuple[float, ...]:
  if fractions is None:
    return default_fractions(DEFAULT_STEPS if steps is None else steps)
  try:
    values = [float(f) for f in fractions]
  except (TypeError, ValueError) as exc:
    raise TypeError(f"fractions must be a sequence of real numbers, got {fractions!r}.") from exc
  if not values or len(values) > _MAX_STEPS:
    raise ValueError(f"fractions must hold between 1 and {_MAX_STEPS} values, got "
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
    steps = v.check_int(steps, "steps", low=1, high=_MAX_STEPS)
  fractions = _check_fractions(fractions, steps)
  if accountant is None:
    accountant = "rdp" if secure else "analytic"
  v.check_choice(accountant, "accountant", ACCOUNTANTS)
  if secure and accountant in CONTINUOUS_ONLY:
    raise ValueError(f"accountant={accountant!r} is exact for continuous Gaussian noise only; "
                     "secure=True releases discrete Gaussian noise, whose guarantee is proved "
                     "through Rényi DP: use accountant='rdp' (the default) or secure=False.")
  return epsilon, delta, beta, fractions, accountant


def _shift_one_accountant(name: str) -> dp_accounting.PrivacyAccountant:
  """An accountant that reads ``GaussianDpEvent(z)`` as a shift-1 Gaussian (see CAUTION above)."""
  v.check_choice(name, "accountant", ACCOUNTANTS)
  relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
  if name == "rdp":
    return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
  return dp_accounting.pld.PLDAccountant(neighboring_relation=relation)


def _analytic_scale(epsilon: float, delta: float) -> float:
  """Start of the bracket: σ of a single sensitivity-1 Gaussian that is (ε, δ)-DP (BW18)."""
  return analytic_gaussian_sigma(epsilon, delta, 1.0)


@functools.lru_cache(maxsize=256)
def _calibrate_cached(epsilon: float, delta: float, fractions: tuple[float, ...],
                      accountant: str) -> tuple[float, float]:
  """``(s, ε(s))``: the calibrated common scale and the accountant's ε at it."""
  if accountant == "analytic":
    return _analytic_scale(epsilon, delta), epsilon
  roots = [math.sqrt(f) for f in fractions]

  def eps_at(scale: float) -> float:
    return coinpress_epsilon([scale / r for r in roots], delta, accountant=accountant)

  # The composition is (up to the PLD discretisation) the analytic single Gaussian, so the
  # bracket starts ±1e-4 around it and widens ×10 per miss (then doubles): 2–3 evaluations.
  start = min(max(_analytic_scale(epsilon, delta), _SCALE_FLOOR), _SCALE_CEILING)
  high, width = start * (1.0 + 1e-4), 1e-4
  while eps_at(high) > epsilon:
    if high >= _SCALE_CEILING:
      raise ValueError(f"no noise scale <= {_SCALE_CEILING:g} reaches epsilon={epsilon}; raise "
                       "the budget.")
    width = min(width * 10.0, 1.0)
    high = min(max(start * (1.0 + width), 2.0 * high if width >= 1.0 else 0.0), _SCALE_CEILING)
  low, width = max(start / (1.0 + 1e-4), _SCALE_FLOOR), 1e-4
  while eps_at(low) <= epsilon:
    if low <= _SCALE_FLOOR:
      return _SCALE_FLOOR, eps_at(_SCALE_FLOOR)
    width = min(width * 10.0, 1.0)
    high, low = low, max(min(start / (1.0 + width), low / 2.0 if width >= 1.0 else low),
                         _SCALE_FLOOR)
  scale = float(dp_accounting.calibrate_dp_mechanism(
      lambda: _shift_one_accountant(accountant),
      lambda sc: coinpress_event([sc / r for r in roots]),
      epsilon, delta, bracket_interval=dp_accounting.ExplicitBracketInterval(low, high),
      tol=1e-7 * low))  # relative 1e-7 in s: ε within ~1e-6 of the target
  spent = eps_at(scale)
  if spent > epsilon:  # pragma: no cover - calibrate_dp_mechanism guarantees it
    scale, spent = high, eps_at(high)
  return scale, spent
