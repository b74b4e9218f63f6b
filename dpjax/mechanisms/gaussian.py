"""The Gaussian mechanism with the analytic (Balle–Wang) and classic calibrations (§1.2)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from scipy import special

from dpjax import _validation as v
from dpjax.mechanisms.laplace import _float_value


def _analytic_delta(sigma: float, epsilon: float, sensitivity: float) -> float:
  """``Φ(Δ/2σ − εσ/Δ) − e^ε Φ(−Δ/2σ − εσ/Δ)``, the exact δ of N(0, σ²) noise [BW18 Thm 8]."""
  a = sensitivity / (2.0 * sigma)
  b = epsilon * sigma / sensitivity
  return float(special.ndtr(a - b) - math.exp(epsilon + special.log_ndtr(-a - b)))


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
  """The smallest σ for which ``N(0, σ²)`` noise is (ε, δ)-DP at ℓ2-sensitivity Δ.

  Solves Balle & Wang (2018) Thm 8's exact condition
  ``Φ(Δ/(2σ) − εσ/Δ) − e^ε Φ(−Δ/(2σ) − εσ/Δ) ≤ δ`` by bisection on the host in float64 (the left
  side decreases in σ; ``e^ε Φ(·)`` is evaluated in log space). Valid for every ε > 0.

  Raises:
    ValueError: ε ≤ 0, δ ∉ (0, 1), Δ ≤ 0.
  """
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  sensitivity = v.check_positive(sensitivity, "sensitivity")
  lo, hi = 1e-12 * sensitivity, sensitivity
  while _analytic_delta(hi, epsilon, sensitivity) > delta:
    lo, hi = hi, 2.0 * hi
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if _analytic_delta(mid, epsilon, sensitivity) > delta:
      lo = mid
    else:
      hi = mid
    if hi - lo <= 1e-14 * hi:
      break
  return hi


def classic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
  """``σ = Δ sqrt(2 ln(1.25/δ))/ε`` (Dwork–Roth Thm A.1), valid only for ε < 1.

  Raises:
    ValueError: ε ≥ 1 (the classic bound does not hold there; use the analytic calibration), or
      bad ε, δ, Δ.
  """
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  sensitivity = v.check_positive(sensitivity, "sensitivity")
  if epsilon >= 1.0:
    raise ValueError(f"the classic Gaussian calibration needs epsilon < 1, got "
                     f"epsilon={epsilon}; use calibration='analytic'.")
  return sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def gaussian_noise(key: jax.Array, shape=(), *, sigma: float, dtype=None) -> jax.Array:
  """I.i.d. ``N(0, σ²)`` samples."""
  v.check_key(key)
  sigma = v.check_positive(sigma, "sigma", allow_zero=True)
  return sigma * jax.random.normal(key, tuple(shape), dtype or jnp.result_type(float))


def gaussian_mechanism(key: jax.Array, value, *, sensitivity: float, epsilon: float,
                       delta: float, calibration: str = "analytic") -> jax.Array:
  """Releases ``value + N(0, σ² I)`` with σ calibrated to (ε, δ).

  Guarantee: (ε, δ)-DP under the caller's neighbouring relation when ``value`` has ℓ2-sensitivity
  ``sensitivity`` under it. ``calibration="analytic"`` (default) is exact for every ε > 0
  [BW18]; ``"classic"`` refuses ε ≥ 1.

  Raises:
    TypeError: non-float ``value``, non-key ``key``.
    ValueError: NaN/inf in ``value``; bad ε, δ, Δ; unknown calibration.
  """
  v.check_key(key)
  v.check_choice(calibration, "calibration", ("analytic", "classic"))
  value = _float_value(value)
  calibrate = analytic_gaussian_sigma if calibration == "analytic" else classic_gaussian_sigma
  sigma = calibrate(epsilon, delta, sensitivity)
  return value + sigma * jax.random.normal(key, value.shape, value.dtype)
