"""The truncated Laplace mechanism ``TLap(Δ, ε, δ)`` (Geng et al. 2020; docs/algorithms.md §1.3)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import numpy as np

from dpjax import _validation as v
from dpjax._core.noise import truncated_laplace_sample
from dpjax._host import host_call
from dpjax.mechanisms import discrete
from dpjax.mechanisms.grid import discretization

__all__ = ["TruncatedLaplaceParams", "truncated_laplace", "truncated_laplace_mechanism",
           "truncated_laplace_params"]


class TruncatedLaplaceParams(NamedTuple):
  """Density ``B e^{−|x|/λ}`` on ``[−A, A]`` (0 outside), as Python floats.

  Attributes:
    scale: λ = Δ/ε.
    bound: A = (Δ/ε) ln(1 + (e^ε − 1)/(2δ)).
    density: B = (ε/(2Δ)) (1 + 2δ/(e^ε − 1)), the density at 0.
  """
  scale: float
  bound: float
  density: float


def truncated_laplace_params(sensitivity: float, epsilon: float,
                             delta: float) -> TruncatedLaplaceParams:
  """The exact constants of ``TLap(Δ, ε, δ)``, computed on the host in float64.

  ``λ = Δ/ε``, ``A = (Δ/ε) ln(1 + (e^ε − 1)/(2δ))``, ``B = 1/(2λ(1 − e^{−A/λ}))
  = (ε/(2Δ))(1 + 2δ/(e^ε − 1))``. With this A a shift by Δ leaves exactly δ of the mass outside
  the common support: ``P[Z > A − Δ] = Bλ e^{−A/λ}(e^ε − 1) = δ``. Uses ``log1p``/``expm1``
  (and a log-space form for ε > 700, where ``e^ε`` overflows).

  Sanity value: Δ = 2, ε = 1, δ = 1e-6 gives A = 27.3274, B = 0.2500003.

  Args:
    sensitivity: ``Δ > 0`` (ℓ1-sensitivity of the statistic the noise protects).
    epsilon: ``ε > 0``.
    delta: ``δ ∈ (0, 1)``.

  Returns:
    :class:`TruncatedLaplaceParams` ``(scale λ, bound A, density B)``.

  Raises:
    ValueError: Δ ≤ 0, ε ≤ 0, δ ∉ (0, 1), or any of them NaN/inf.
    TypeError: a non-real argument.

  References:
    docs/algorithms.md §1.3; Geng, Ding, Guo & Kumar, "Tight analysis of privacy and utility tradeoff
    in approximate differential privacy", AISTATS 2020.
  """
  sensitivity = v.check_positive(sensitivity, "sensitivity")
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  scale = sensitivity / epsilon
  if epsilon <= 700.0:
    em1 = math.expm1(epsilon)
    log_ratio = math.log1p(em1 / (2.0 * delta))            # A/λ
    density = (epsilon / (2.0 * sensitivity)) * (1.0 + 2.0 * delta / em1)
  else:                                                     # e^ε overflows: stay in log space
    log_ratio = epsilon - math.log(2.0 * delta) + math.log1p((2.0 * delta - 1.0)
                                                             * math.exp(-epsilon))
    density = epsilon / (2.0 * sensitivity)
  return TruncatedLaplaceParams(scale, scale * log_ratio, density)


def truncated_laplace_survival(x: float, scale: float, bound: float) -> float:
  """``P[Z > x]`` for ``Z ~ TLap``: density ``B e^{−|z|/λ}`` on ``[−A, A]`` (host, float64).

  With ``B = 1/(2λ(1 − e^{−A/λ}))``: for ``0 ≤ x < A``,
  ``P[Z > x] = e^{−x/λ}(1 − e^{−(A − x)/λ}) / (2(1 − e^{−A/λ}))`` (``expm1`` forms, no overflow
  for any ε); ``1 − P[Z > −x]`` for ``x < 0``; 0 for ``x ≥ A`` and 1 for ``x ≤ −A``. For
  ``TLap(Δ, ε, δ)`` (:func:`dpjax.mechanisms.truncated_laplace_params`) ``P[Z > A − Δ] = δ``.
  Used to tell, from public parameters alone, how likely a noisy threshold test can pass.

  Args:
    x: the level.
    scale: λ > 0.
    bound: A > 0.

  Returns:
    The probability, a float in ``[0, 1]``.
  """
  if x >= bound:
    return 0.0
  if x <= -bound:
    return 1.0
  if x < 0.0:
    return 1.0 - truncated_laplace_survival(-x, scale, bound)
  return (math.exp(-x / scale) * -math.expm1(-(bound - x) / scale)
          / (2.0 * -math.expm1(-bound / scale)))


def truncated_laplace(key: jax.Array, shape=(), *, sensitivity: float, epsilon: float,
                      delta: float, dtype=None) -> jax.Array:
  """Samples ``TLap(Δ, ε, δ)`` by inverse CDF, clamped to ``[−A, A]``.

  ``|Z| = −λ ln(1 − U(1 − e^{−A/λ}))`` with ``U ~ U(0, 1)`` and an independent fair sign, in
  ``dtype``. The clamp keeps every sample inside the support even after rounding, which is what
  the privacy proof uses (docs/algorithms.md §1.10 rule 4). Mean 0, variance
  ``2λ² − (A² + 2Aλ) e^{−A/λ}/(1 − e^{−A/λ})``.

  Args:
    key: JAX PRNG key.
    shape: output shape, a tuple of non-negative ints.
    sensitivity: ``Δ > 0``.
    epsilon: ``ε > 0``.
    delta: ``δ ∈ (0, 1)``.
    dtype: float dtype (default: JAX's default float).

  Returns:
    Array of ``shape`` and ``dtype`` with every value in ``[−A, A]``.

  Raises:
    TypeError: non-key ``key``, bad ``shape``, non-float ``dtype``.
    ValueError: bad Δ, ε, δ.

  References:
    docs/algorithms.md §1.3; [GDGK20].
  """
  v.check_key(key)
  shape = v.check_shape(shape)
  params = truncated_laplace_params(sensitivity, epsilon, delta)
  dtype = v.check_float_dtype(dtype)
  return truncated_laplace_sample(key, shape, params.scale, params.bound, dtype)


def discrete_truncated_laplace_bound(scale, shift: int, delta: float) -> int:
  """The support bound K of the discrete truncated Laplace for a shift of at most ``shift`` steps.

  Noise ``P(Z = z) ∝ e^{−|z|/b}`` on ``{−K, …, K}`` (b = ``scale``, a rational or float > 0);
  K is the smallest integer ≥ 1 with ``P[Z ≥ K − shift + 1] ≤ δ``: an integer statistic that moves
  by at most ``shift`` (in ℓ1 over coordinates with independent noise) leaves at most δ of the
  output mass outside the common support. Inside it the probability ratio is
  ``e^{shift/b}`` at most. The ℓ1 case follows because ``a ↦ P[Z ≥ K − a + 1] ∝ e^{a/b} − 1`` is
  superadditive (docs/algorithms.md §1.3, §1.4 PROPOSED). Host, float64 (the tail sums in closed form).

  Args:
    scale: b > 0 (a ``Fraction``, int or float).
    shift: the largest integer shift, ≥ 1.
    delta: δ ∈ (0, 1).

  Returns:
    K as a Python int.

  References:
    Geng, Ding, Guo & Kumar, "Tight analysis of privacy and utility tradeoff in approximate
    differential privacy", AISTATS 2020 (the continuous truncated Laplace); the discrete
    variant is PROPOSED in docs/algorithms.md §1.4.
  """
  delta = v.check_delta(delta)
  shift = v.check_int(shift, "shift", low=1)
  log_p = -1.0 / float(scale)

  def power(x):                                # p^x, p = e^{−1/b}
    return math.exp(x * log_p)

  def tail(K):                                 # P[Z ≥ K − shift + 1] for Z on {−K, …, K}
    lo = max(K - shift + 1, -K)
    if lo >= 0:
      upper = power(lo) - power(K + 1)                                  # (1 − p)·Σ_{lo}^{K} p^z
    else:
      upper = (power(1) - power(1 - lo)) + (1.0 - power(K + 1))
    return upper / ((1.0 + power(1)) - 2.0 * power(K + 1))             # / (1 − p)·Σ_{|z|≤K}

  # tail(K) decreases in K: double until it fits, then bisect (scales reach 2^25 steps).
  hi = 1
  while tail(hi) > delta:
    hi *= 2
  lo = hi // 2                     # tail(lo) > δ, or lo = 0
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if tail(mid) <= delta else (mid, hi)
  return hi


def truncated_laplace_mechanism(key: jax.Array, value, *, sensitivity: float, epsilon: float,
                                delta: float, secure: bool = True, bound: float | None = None):
  """Releases ``value + TLap(Δ, ε, δ)``, independent noise per coordinate; float-safe by default.

  Guarantee: (ε, δ)-DP under the caller's neighboring relation for a statistic of
  ℓ1-sensitivity Δ under it: inside the common support the density ratio is ≤ e^ε, and the mass
  outside it is ≤ δ (exactly δ for a scalar shift by Δ; for a vector shift ``‖s‖₁ ≤ Δ`` by
  superadditivity of ``e^x − 1``) (docs/algorithms.md §1.3, [GDGK20]).

  * ``secure=True`` (default, for released statistics): the value is clamped to ``[−B, B]``
    and rounded to the public power-of-two grid Λ of :func:`dpjax.mechanisms.discretization`
    (ℓ1: the shift in grid steps is at most ``D = ⌊Δ/Λ + p⌋ ≤ (1 + 2^-10)Δ/Λ``), and exact
    integer noise ``P(z) ∝ e^{−|z|/t}`` on ``{−K, …, K}`` is added with ``t = ⌈Δ_Λ/ε⌉`` and K
    from :func:`discrete_truncated_laplace_bound` (shift D): the same argument on ℤ, so
    (ε, δ)-DP, and every output is a multiple of Λ whatever the value (docs/algorithms.md §1.10;
    sampled on the host with Python integers, Canonne–Kamath–Steinke's discrete Laplace plus
    rejection). Output float64 NumPy.
  * ``secure=False``: continuous TLap noise sampled in ``value``'s dtype by inverse CDF
    (jittable). (ε, δ)-DP in real arithmetic only: the float values ``f + Z`` can reach depend on
    ``f`` (Mironov 2012), and float32 uniforms resolve the tail only to about 2^-23.

  Args:
    key: JAX PRNG key.
    value: float array of any shape.
    sensitivity: ``Δ > 0``.
    epsilon: ``ε > 0``.
    delta: ``δ ∈ (0, 1)``.
    secure: float-safe discrete release (default) or raw float noise.
    bound: public clamp B for the secure release (default ``2^50 Λ``).

  Returns:
    ``secure=True``: eagerly a float64 NumPy array shaped like ``value`` (exact multiples of
    ``discretization(Δ, value.size, norm=1).grid`` whatever JAX's x64 flag); traced (the host
    computation as a ``jax.pure_callback``, same output per key) a JAX array of the default
    float dtype. ``secure=False``: a JAX array with ``value``'s shape and dtype. NaN/inf
    entries of ``value`` are replaced by 0 first (a fixed map, not a data-dependent error).

  Raises:
    TypeError: ``value`` is not a float array, ``key`` is not a key.
    ValueError: bad Δ, ε, δ, B.

  References:
    docs/algorithms.md §1.3, §1.10; [GDGK20]; Canonne, Kamath & Steinke (2020).
  """
  v.check_key(key)
  if secure:
    value = v.check_float_array(value)
    epsilon, delta = v.check_epsilon(epsilon), v.check_delta(delta)
    grid = discretization(sensitivity, max(value.size, 1), bound, norm=1)
    shift = math.floor(grid.grid_sensitivity)
    scale = math.ceil(grid.grid_sensitivity / epsilon)
    K = discrete_truncated_laplace_bound(scale, shift, delta)

    def release(rng, value):
      index = grid.round(v.sanitise_host_value(value))
      noise = discrete.truncated_discrete_laplace_host(rng, (index.size,), scale, K)
      return grid.release(index + noise, value.shape)

    return host_call(release, jax.ShapeDtypeStruct(value.shape, np.float64), key, value)
  value = v.sanitise_value(value)
  params = truncated_laplace_params(sensitivity, epsilon, delta)
  return value + truncated_laplace_sample(key, value.shape, params.scale, params.bound,
                                         value.dtype)
