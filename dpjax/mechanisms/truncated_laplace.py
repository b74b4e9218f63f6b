"""The truncated Laplace mechanism ``TLap(Δ, ε, δ)`` (Geng et al. 2020; ALGORITHMS.md §1.3)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dpjax import _validation as v
from dpjax.mechanisms.laplace import check_float_dtype, check_float_value, check_shape


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
    ALGORITHMS.md §1.3; Geng, Ding, Guo & Kumar, "Tight analysis of privacy and utility tradeoff
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


def truncated_laplace(key: jax.Array, shape=(), *, sensitivity: float, epsilon: float,
                      delta: float, dtype=None) -> jax.Array:
  """Samples ``TLap(Δ, ε, δ)`` by inverse CDF, clamped to ``[−A, A]``.

  ``|Z| = −λ ln(1 − U(1 − e^{−A/λ}))`` with ``U ~ U(0, 1)`` and an independent fair sign, in
  ``dtype``. The clamp keeps every sample inside the support even after rounding, which is what
  the privacy proof uses (ALGORITHMS.md §1.10 rule 4). Mean 0, variance
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
    ALGORITHMS.md §1.3; [GDGK20].
  """
  v.check_key(key)
  shape = check_shape(shape)
  params = truncated_laplace_params(sensitivity, epsilon, delta)
  dtype = check_float_dtype(dtype)
  return _truncated_laplace(key, shape, params.scale, params.bound, dtype)


def _truncated_laplace(key, shape, scale, bound, dtype):
  """Unvalidated, traceable core of :func:`truncated_laplace` (``scale``, ``bound`` floats)."""
  k_sign, k_u = jax.random.split(key)
  u = jax.random.uniform(k_u, shape, dtype)
  mass = -jnp.expm1(-jnp.asarray(bound / scale, dtype))     # 1 − e^{−A/λ}, no cancellation
  magnitude = -scale * jnp.log1p(-u * mass)
  sign = jnp.where(jax.random.bernoulli(k_sign, 0.5, shape), 1.0, -1.0).astype(dtype)
  return jnp.clip(sign * magnitude, -bound, bound).astype(dtype)


def truncated_laplace_mechanism(key: jax.Array, value, *, sensitivity: float, epsilon: float,
                                delta: float) -> jax.Array:
  """Releases ``value + TLap(Δ, ε, δ)``, independent noise per coordinate, in ``value``'s dtype.

  Guarantee: (ε, δ)-DP under the caller's neighbouring relation for a statistic of
  ℓ1-sensitivity Δ under it: inside the common support the density ratio is ≤ e^ε, and the mass
  outside it is ≤ δ (exactly δ for a scalar shift by Δ; for a vector shift ``‖s‖₁ ≤ Δ`` by
  superadditivity of ``e^x − 1``) (ALGORITHMS.md §1.3, [GDGK20]). Floating-point caveat §1.10.

  Args:
    key: JAX PRNG key.
    value: float array of any shape.
    sensitivity: ``Δ > 0``.
    epsilon: ``ε > 0``.
    delta: ``δ ∈ (0, 1)``.

  Returns:
    JAX array with ``value``'s shape and dtype.

  Raises:
    TypeError: ``value`` is not a float array, ``key`` is not a key.
    ValueError: NaN/inf in ``value``, or bad Δ, ε, δ.

  References:
    ALGORITHMS.md §1.3; [GDGK20].
  """
  v.check_key(key)
  value = check_float_value(value)
  params = truncated_laplace_params(sensitivity, epsilon, delta)
  return value + _truncated_laplace(key, value.shape, params.scale, params.bound, value.dtype)
