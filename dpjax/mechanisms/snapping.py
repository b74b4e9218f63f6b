"""Mironov's snapping mechanism: Laplace noise without the floating-point side channel (§1.10).

Textbook Laplace noise in floating point has gaps and uneven rounding, so the set of reachable
outputs ``f(X) + Y`` depends on ``f(X)`` and can identify it exactly (Mironov 2012). Snapping
clamps the value to a public range ``[−B, B]``, adds ``S·λ·ln U`` with ``U`` a uniformly drawn
double, rounds to the nearest multiple of ``Λ`` (the smallest power of two ≥ λ) and clamps again,
so every output lies on the public grid ``ΛZ ∩ [−B, B]`` whatever the input.

Guarantee [Mironov 2012, Thm 1]: for a statistic of sensitivity 1 and ``λ < B < 2^46 λ``, the
result is ``(1/λ + 2^{-49} B/λ)``-DP in IEEE double precision with a correctly rounded logarithm
(NumPy's ``log`` is within one ulp; the bound is stated for exact rounding). dpjax calibrates λ
so that this expression equals the requested ε. Runs on the host in float64 (NumPy): it is meant
for released statistics, not for the inside of DP-SGD (where float32 noise is the norm and the
floating-point caveat is documented, as in every DP-SGD library).
"""

from __future__ import annotations

import math

import jax
import numpy as np

from dpjax import _validation as v
from dpjax._host import host_call

__all__ = ["snapping_l1_mechanism", "snapping_mechanism", "snapping_parameters"]

_BOUND_FACTOR = 2.0**32          # default B = 2^32 λ: clamps nothing realistic, costs ε·2^-17


def snapping_parameters(sensitivity: float, epsilon: float,
                        bound: float | None = None) -> tuple[float, float, float]:
  """``(λ, Λ, B)`` in the statistic's units for a target ε (host, float64).

  With the statistic divided by Δ (sensitivity 1): ``ε = (1 + 2^{-49} B')/λ'``. If ``bound`` is
  None, ``B' = 2^32 λ'`` (so ``λ' = 1/(ε − 2^{-17})``); else ``λ' = (1 + 2^{-49} B')/ε``. Then
  ``λ = Δλ'``, ``Λ = Δ·2^{⌈log2 λ'⌉}``, ``B = ΔB'``.

  Raises:
    ValueError: bad Δ or ε, or ``λ < B < 2^46 λ`` fails.
  """
  sensitivity = v.check_positive(sensitivity, "sensitivity")
  epsilon = v.check_epsilon(epsilon)
  if bound is None:
    if epsilon <= 2.0**-17:
      raise ValueError(f"epsilon must exceed 2^-17 for the default bound, got {epsilon}.")
    lam = 1.0 / (epsilon - 2.0**-17)
    b = _BOUND_FACTOR * lam
  else:
    b = v.check_positive(bound, "bound") / sensitivity
    lam = (1.0 + 2.0**-49 * b) / epsilon
  if not lam < b < 2.0**46 * lam:
    raise ValueError(f"bound must satisfy λ < bound < 2^46 λ (λ = {lam * sensitivity:.6g}); got "
                     f"bound={b * sensitivity:.6g}.")
  grid = 2.0 ** math.ceil(math.log2(lam))
  return lam * sensitivity, grid * sensitivity, b * sensitivity


def _uniform_doubles(rng: np.random.Generator, size: int) -> np.ndarray:
  """Doubles in (0, 1] distributed as a uniform real rounded down to a double (host, NumPy).

  The exponent is geometric (leading zero bits of a random stream, up to 2^-1074's range in
  principle; 128 bits here, so the chance of running out is 2^-128), the 52-bit mantissa uniform;
  unlike ``k / 2^53`` this reaches every double in (0, 1] with the right probability.
  """
  words = rng.integers(0, 2**64, size=(size, 3), dtype=np.uint64)
  stream, stream2 = words[:, 0], words[:, 1]
  mantissa = words[:, 2] >> np.uint64(12)                                      # 52 bits
  zeros = _leading_zeros(stream)
  zeros = np.where(zeros == 64, 64 + _leading_zeros(stream2), zeros)
  exponent = -1 - zeros
  return np.ldexp(1.0 + mantissa.astype(np.float64) / 2.0**52, exponent.astype(np.int32))


def _leading_zeros(words: np.ndarray) -> np.ndarray:
  """Leading zero bits of uint64 words, exactly (frexp of 32-bit halves, exact in float64)."""
  hi = (words >> np.uint64(32)).astype(np.float64)
  lo = (words & np.uint64(0xFFFFFFFF)).astype(np.float64)
  bits_hi = np.frexp(hi)[1]              # bit length (0 for 0)
  bits_lo = np.frexp(lo)[1]
  return np.where(hi > 0, 32 - bits_hi, 64 - bits_lo).astype(np.int64)


def snapping_mechanism(key: jax.Array, value, *, sensitivity: float, epsilon: float,
                       bound: float | None = None) -> np.ndarray:
  """Releases ``value`` (each coordinate) with the snapping mechanism; float64 NumPy output.

  Guarantee: ε-DP per coordinate for a statistic of sensitivity ``sensitivity``, under the
  caller's neighboring relation; every output is a multiple of the public grid step Λ inside
  ``[−B, B]`` (:func:`snapping_parameters`). For a VECTOR whose ℓ1-sensitivity is
  ``sensitivity``, the coordinates compose as for Laplace except that Mironov's floating-point
  slack ``2^{-49}B/λ`` is paid per coordinate: ``D`` coordinates at the default bound give
  ``(ε + (D − 1)·2^{-17})``-DP. :func:`snapping_l1_mechanism` calibrates a vector to exactly ε.

  Args:
    key: PRNG key.
    value: float array (any shape), the exact statistic.
    sensitivity: Δ > 0.
    epsilon: ε > 0.
    bound: public clamp B (default ``2^32 λ``, far beyond any value the noise scale suits).

  Returns:
    Eagerly: a float64 ``np.ndarray`` shaped like ``value`` (the mechanism's analysis is for
    IEEE doubles). Traced (``jit`` / ``vmap``): the same host computation as a
    ``jax.pure_callback`` (same output per key), returned in JAX's default float dtype (a
    rounding of the released value: post-processing). NaN/inf entries of ``value`` are replaced
    by 0 first (a fixed map: raising would branch on private data).

  Raises:
    TypeError: non-float value or non-key key. ValueError: bad Δ, ε, bound.
  """
  v.check_key(key)
  value = v.check_float_array(value)
  lam, grid, b = snapping_parameters(sensitivity, epsilon, bound)

  def release(rng, value):
    flat = np.clip(v.sanitise_host_value(value).astype(np.float64).reshape(-1), -b, b)
    signs = np.where(rng.integers(0, 2, size=flat.shape) == 1, 1.0, -1.0)
    noisy = flat + signs * lam * np.log(_uniform_doubles(rng, flat.size))
    snapped = grid * np.round(noisy / grid)        # division by a power of two is exact
    return np.clip(snapped, -b, b).reshape(value.shape)

  return host_call(release, jax.ShapeDtypeStruct(value.shape, np.float64), key, value)


def snapping_l1_mechanism(key: jax.Array, value, *, l1_sensitivity: float, epsilon: float,
                          bound: float) -> np.ndarray:
  """Releases a vector statistic of ℓ1-sensitivity ``Δ₁`` by snapping every coordinate; ε-DP
  in total, the floating-point slack of every coordinate counted.

  Mironov's bound for one coordinate whose change is ``Δ_i`` (in units of ``Δ₁``, noise
  ``λ'``): loss ``≤ (Δ_i/Δ₁ + 2^{-49} B')/λ'`` with ``B' = B/Δ₁``. Summed over the ``D``
  coordinates with ``Σ Δ_i ≤ Δ₁``: ``(1 + D·2^{-49} B')/λ'``. The noise is calibrated so that
  this sum is ε (the per-coordinate :func:`snapping_mechanism` counts the slack once, which is
  right for one coordinate and short by ``(D − 1)·2^{-49}B'/λ'`` for a vector).

  Args:
    key: PRNG key.
    value: float array (any shape; ``D`` = its size), the exact statistic.
    l1_sensitivity: ``Δ₁ > 0``, the ℓ1-sensitivity of the whole array.
    epsilon: ε > 0, the guarantee of the whole release.
    bound: public clamp ``B`` on every coordinate (it should cover the statistic's range; a
      value beyond it is clamped, which is part of the mechanism).

  Returns:
    As :func:`snapping_mechanism` (eagerly float64 NumPy; traced, a ``pure_callback``).

  Raises:
    TypeError / ValueError: as :func:`snapping_mechanism`; also when the calibrated noise
    cannot satisfy ``λ < B < 2^46 λ`` (choose a larger ``bound``).

  References:
    Mironov (2012), Thm 1; docs/algorithms.md §1.10.
  """
  l1_sensitivity = v.check_positive(l1_sensitivity, "l1_sensitivity")
  epsilon = v.check_epsilon(epsilon)
  bound = v.check_positive(bound, "bound")
  size = int(np.prod(np.shape(value)))
  slack = 2.0**-49 * bound / l1_sensitivity
  per_call = epsilon * (1.0 + slack) / (1.0 + max(size, 1) * slack)
  return snapping_mechanism(key, value, sensitivity=l1_sensitivity, epsilon=per_call, bound=bound)
