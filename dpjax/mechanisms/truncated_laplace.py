"""The truncated Laplace mechanism ``TLap(Δ, ε, δ)`` (Geng et al. 2020; ALGORITHMS.md §1.3)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dpjax import _validation as v


class TruncatedLaplaceParams(NamedTuple):
  """Density ``B e^{−|x|/λ}`` on ``[−A, A]``: ``scale`` λ, ``bound`` A, ``density`` B."""
  scale: float
  bound: float
  density: float


def truncated_laplace_params(sensitivity: float, epsilon: float,
                             delta: float) -> TruncatedLaplaceParams:
  """The exact constants of ``TLap(Δ, ε, δ)``, computed on the host in float64.

  ``λ = Δ/ε``, ``A = (Δ/ε) ln(1 + (e^ε − 1)/(2δ))``, ``B = (ε/(2Δ))(1 + 2δ/(e^ε − 1))``.
  With this A, a shift by Δ leaves exactly δ of the mass outside the common support:
  ``P[Z > A − Δ] = δ``. Sanity value: Δ = 2, ε = 1, δ = 1e-6 gives A = 27.3274, B = 0.2500003.

  Raises:
    ValueError: Δ ≤ 0, ε ≤ 0 or δ ∉ (0, 1).
  """
  sensitivity = v.check_positive(sensitivity, "sensitivity")
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  scale = sensitivity / epsilon
  em1 = math.expm1(epsilon)
  bound = scale * math.log1p(em1 / (2.0 * delta))
  density = (epsilon / (2.0 * sensitivity)) * (1.0 + 2.0 * delta / em1)
  return TruncatedLaplaceParams(scale, bound, density)


def truncated_laplace(key: jax.Array, shape=(), *, sensitivity: float, epsilon: float,
                      delta: float, dtype=None) -> jax.Array:
  """Samples ``TLap(Δ, ε, δ)`` by inverse CDF, clamped to ``[−A, A]``.

  ``|Z| = −λ ln(1 − U(1 − e^{−A/λ}))`` with ``U ~ U(0, 1)`` and a uniform sign. The clamp keeps
  every sample in the support, which is what the privacy proof uses (§1.10 rule 4).

  Args:
    key: PRNG key.
    shape: output shape.
    sensitivity, epsilon, delta: the mechanism's Δ > 0, ε > 0, δ ∈ (0, 1).
    dtype: float dtype (default: JAX's default float).

  Returns:
    Float array of ``shape`` with values in ``[−A, A]``.
  """
  v.check_key(key)
  params = truncated_laplace_params(sensitivity, epsilon, delta)
  dtype = dtype or jnp.result_type(float)
  return _truncated_laplace(key, tuple(shape), params.scale, params.bound, dtype)


def _truncated_laplace(key, shape, scale, bound, dtype):
  """Unvalidated, traceable core of :func:`truncated_laplace`."""
  k_sign, k_u = jax.random.split(key)
  u = jax.random.uniform(k_u, shape, dtype)
  mass = -jnp.expm1(-jnp.asarray(bound, dtype) / scale)   # 1 − e^{−A/λ}
  magnitude = -scale * jnp.log1p(-u * mass)
  sign = jnp.where(jax.random.bernoulli(k_sign, 0.5, shape), 1.0, -1.0).astype(dtype)
  return jnp.clip(sign * magnitude, -bound, bound).astype(dtype)


def truncated_laplace_mechanism(key: jax.Array, value, *, sensitivity: float, epsilon: float,
                                delta: float) -> jax.Array:
  """Releases ``value + TLap(Δ, ε, δ)`` (independent noise per coordinate).

  Guarantee: (ε, δ)-DP for a statistic of ℓ1-sensitivity Δ under the caller's neighbouring
  relation: inside the common support the density ratio is ≤ e^ε, and the mass outside it is
  ≤ δ (ALGORITHMS.md §1.3, [GDGK20]).

  Raises:
    TypeError: ``value`` is not a float array.
    ValueError: NaN/inf in ``value``, or bad Δ, ε, δ.
  """
  v.check_key(key)
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(f"value must be a float array, got dtype={value.dtype}.")
  if not bool(jnp.all(jnp.isfinite(value))):
    raise ValueError("value contains NaN or infinite entries.")
  params = truncated_laplace_params(sensitivity, epsilon, delta)
  return value + _truncated_laplace(key, value.shape, params.scale, params.bound, value.dtype)
