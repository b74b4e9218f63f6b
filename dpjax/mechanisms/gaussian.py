"""The Gaussian mechanism with the analytic (Balle–Wang) and classic calibrations (§1.2).

The calibrations run on the host in float64 with :mod:`math` only (no SciPy at run time): the
standard normal log-CDF is evaluated with ``math.erfc`` and, deep in the lower tail, with its
asymptotic series, so the Balle–Wang condition stays accurate for tiny δ and large ε.
"""

from __future__ import annotations

import math

import jax

from dpjax import _validation as v
from dpjax.mechanisms.laplace import check_float_dtype, check_float_value, check_shape

_SQRT2 = math.sqrt(2.0)
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _log_ndtr(x: float) -> float:
  """``log Φ(x)`` for the standard normal CDF Φ, accurate to a few ulps in both tails (host)."""
  if x > 0.0:
    return math.log1p(-0.5 * math.erfc(x / _SQRT2))
  if x > -20.0:
    return math.log(0.5 * math.erfc(-x / _SQRT2))
  # Φ(x) = φ(x)/|x| · (1 − 1/x² + 3/x⁴ − 15/x⁶ + …); at x ≤ −20 ten terms leave < 1e-17.
  inv = 1.0 / (x * x)
  term, series = 1.0, 1.0
  for n in range(1, 11):
    term *= -(2 * n - 1) * inv
    series += term
  return -0.5 * x * x - math.log(-x) - _HALF_LOG_2PI + math.log(series)


def _log_analytic_delta(sigma: float, epsilon: float, sensitivity: float) -> float:
  """``log δ(σ)`` with ``δ(σ) = Φ(Δ/2σ − εσ/Δ) − e^ε Φ(−Δ/2σ − εσ/Δ)`` [BW18, Thm 8].

  Computed as ``log Φ(a−b) + log(1 − exp(ε + log Φ(−a−b) − log Φ(a−b)))`` so that neither the
  two terms nor their difference under- or overflows. ``−inf`` where rounding leaves nothing.
  """
  a = sensitivity / (2.0 * sigma)
  b = epsilon * sigma / sensitivity
  log_first = _log_ndtr(a - b)
  ratio = epsilon + _log_ndtr(-a - b) - log_first          # log of (second term / first term)
  if ratio >= 0.0:
    return -math.inf
  return log_first + math.log(-math.expm1(ratio))


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
  """The smallest σ for which ``N(0, σ²)`` noise is (ε, δ)-DP at ℓ2-sensitivity Δ.

  Solves Balle & Wang's exact condition (2018, Thm 8)

    ``Φ(Δ/(2σ) − εσ/Δ) − e^ε Φ(−Δ/(2σ) − εσ/Δ) ≤ δ``

  by bisection on ``log σ`` on the host in float64 (the left side decreases in σ; both terms are
  handled in log space). Valid for every ε > 0, unlike the classic calibration. The returned σ
  satisfies the condition, and σ·(1 − 1e-12) does not.

  Args:
    epsilon: ``ε > 0``.
    delta: ``δ ∈ (0, 1)``.
    sensitivity: ℓ2-sensitivity ``Δ > 0`` (default 1).

  Returns:
    σ as a Python float.

  Raises:
    ValueError: ε not finite and > 0, δ ∉ (0, 1), Δ not finite and > 0 (NaN included).
    TypeError: a non-real argument.

  References:
    ALGORITHMS.md §1.2; Balle & Wang, "Improving the Gaussian mechanism for differential
    privacy: analytical calibration and optimal denoising", ICML 2018, Thm 8.
  """
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  sensitivity = v.check_positive(sensitivity, "sensitivity")
  target = math.log(delta)

  def too_small(sigma):        # True iff σ does not yet meet the condition
    return _log_analytic_delta(sigma, epsilon, sensitivity) > target

  lo = hi = sensitivity
  while too_small(hi):
    lo, hi = hi, 2.0 * hi
  while lo == hi or not too_small(lo):
    lo *= 0.5
  for _ in range(200):                       # geometric bisection: relative precision 1e-15
    if hi / lo - 1.0 <= 1e-15:
      break
    mid = math.sqrt(lo * hi)
    if too_small(mid):
      lo = mid
    else:
      hi = mid
  return hi


def classic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
  """``σ = Δ sqrt(2 ln(1.25/δ))/ε``, the classic calibration (Dwork–Roth Thm A.1), for ε < 1.

  Args:
    epsilon: ``ε ∈ (0, 1)``.
    delta: ``δ ∈ (0, 1)``.
    sensitivity: ℓ2-sensitivity ``Δ > 0`` (default 1).

  Returns:
    σ as a Python float (always larger than :func:`analytic_gaussian_sigma`).

  Raises:
    ValueError: ε ≥ 1 (the classic bound is not valid there; use the analytic calibration), or
      bad ε, δ, Δ.

  References:
    ALGORITHMS.md §1.2; Dwork & Roth (2014), Thm A.1.
  """
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  sensitivity = v.check_positive(sensitivity, "sensitivity")
  if epsilon >= 1.0:
    raise ValueError(f"the classic Gaussian calibration needs epsilon < 1, got "
                     f"epsilon={epsilon}; use calibration='analytic'.")
  return sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def gaussian_noise(key: jax.Array, shape=(), *, sigma: float, dtype=None) -> jax.Array:
  """I.i.d. ``N(0, σ²)`` samples (a sampler; the guarantee comes from calibrating σ).

  Args:
    key: JAX PRNG key.
    shape: output shape, a tuple of non-negative ints.
    sigma: standard deviation ``σ ≥ 0``.
    dtype: float dtype (default: JAX's default float).

  Returns:
    Array of ``shape`` and ``dtype``.

  Raises:
    TypeError: non-key ``key``, bad ``shape`` or non-float ``dtype``.
    ValueError: σ negative, NaN or infinite.

  References:
    ALGORITHMS.md §1.2.
  """
  v.check_key(key)
  shape = check_shape(shape)
  sigma = v.check_positive(sigma, "sigma", allow_zero=True)
  dtype = check_float_dtype(dtype)
  return (sigma * jax.random.normal(key, shape, dtype)).astype(dtype)


def gaussian_mechanism(key: jax.Array, value, *, sensitivity: float, epsilon: float,
                       delta: float, calibration: str = "analytic") -> jax.Array:
  """Releases ``value + N(0, σ² I)`` with σ calibrated to (ε, δ).

  Guarantee: (ε, δ)-DP under the caller's neighbouring relation when ``value`` has
  ℓ2-sensitivity ``sensitivity`` under it. ``calibration="analytic"`` (default) uses the exact
  Balle–Wang condition (:func:`analytic_gaussian_sigma`), valid for every ε > 0;
  ``"classic"`` uses ``Δ sqrt(2 ln(1.25/δ))/ε`` and refuses ε ≥ 1. Noise is added in
  ``value``'s dtype (floating-point caveat: ALGORITHMS.md §1.10).

  Args:
    key: JAX PRNG key.
    value: float array of any shape.
    sensitivity: ℓ2-sensitivity ``Δ > 0``.
    epsilon: ``ε > 0``.
    delta: ``δ ∈ (0, 1)``.
    calibration: ``"analytic"`` or ``"classic"``.

  Returns:
    JAX array with ``value``'s shape and dtype.

  Raises:
    TypeError: non-float ``value``, non-key ``key``.
    ValueError: NaN/inf in ``value``; bad ε, δ, Δ; unknown ``calibration``; ε ≥ 1 with
      ``"classic"``.

  References:
    ALGORITHMS.md §1.2; [BW18] Thm 8; Dwork & Roth (2014), Thm A.1.
  """
  v.check_key(key)
  v.check_choice(calibration, "calibration", ("analytic", "classic"))
  value = check_float_value(value)
  calibrate = analytic_gaussian_sigma if calibration == "analytic" else classic_gaussian_sigma
  sigma = calibrate(epsilon, delta, sensitivity)
  return value + (sigma * jax.random.normal(key, value.shape, value.dtype)).astype(value.dtype)
