"""Discrete (integer) Laplace noise (ALGORITHMS.md §1.4).

Counts and integer scores get integer noise (§1.10 rule 1): an integer-valued statistic plus an
integer sample has a support that does not depend on the statistic's value, so the
floating-point attacks on real-valued Laplace noise do not apply.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dpjax import _validation as v
from dpjax.mechanisms import exact as exact_lib


def discrete_laplace(key: jax.Array, shape=(), *, scale: float, exact: bool = True) -> jax.Array:
  """Samples the discrete Laplace distribution ``P(Z = z) = (1−p)/(1+p) · p^{|z|}``, ``p = e^{−1/scale}``.

  ``exact=True`` (default): Canonne–Kamath–Steinke's sampler with integer arithmetic only
  (:mod:`dpjax.mechanisms.exact`), at the scale rounded UP to a multiple of 2^-10 (never less
  noise). ``exact=False``: the difference of two geometric variables drawn with floating-point
  logarithms (Inusah & Kozubowski 2006) — faster, but its probabilities are only approximately
  right. Mean 0, variance ``2p/(1−p)²``.

  Args:
    key: PRNG key.
    shape: output shape.
    scale: ``σ > 0``; the mechanism for an integer statistic of ℓ1-sensitivity Δ uses
      ``scale = Δ/ε``.

  Returns:
    int32 array of ``shape``.

  References:
    ALGORITHMS.md §1.4; He, Vershynin & Zhu, Def. 2.4.
  """
  v.check_key(key)
  scale = v.check_positive(scale, "scale")
  return _discrete_laplace(key, tuple(shape), scale, exact)


def _discrete_laplace(key, shape, scale: float, exact: bool = True):
  """Unvalidated, traceable core of :func:`discrete_laplace` (``scale`` a Python float)."""
  if exact:
    num, den = exact_lib.rational_scale(scale)
    return exact_lib.exact_discrete_laplace(key, shape, num, den)
  p_stop = -jnp.expm1(-1.0 / jnp.asarray(scale, jnp.float32))   # 1 − p, no cancellation
  k1, k2 = jax.random.split(key)
  g1 = jax.random.geometric(k1, p_stop, shape, dtype=jnp.int32)   # counts trials: ≥ 1
  g2 = jax.random.geometric(k2, p_stop, shape, dtype=jnp.int32)
  return (g1 - g2).astype(jnp.int32)


def discrete_laplace_mechanism(key: jax.Array, value, *, sensitivity: int,
                               epsilon: float) -> jax.Array:
  """Releases an integer statistic with discrete Laplace noise of scale ``Δ/ε``.

  Guarantee: ε-DP for any neighbouring relation under which the integer statistic ``value`` has
  ℓ1-sensitivity ``sensitivity`` — neighbouring probabilities differ by a factor ``p^{−|Δz|}``
  and ``Σ|Δz| ≤ Δ`` (ALGORITHMS.md §1.4). The noise is sampled exactly (integer arithmetic).

  Args:
    key: PRNG key.
    value: integer array (any shape).
    sensitivity: ℓ1-sensitivity Δ (integer ≥ 1).
    epsilon: ε > 0.

  Returns:
    int32 array like ``value``.

  Raises:
    TypeError: ``value`` is not an integer array, or ``key`` is not a key.
    ValueError: ε ≤ 0 or Δ < 1.
  """
  v.check_key(key)
  epsilon = v.check_epsilon(epsilon)
  sensitivity = v.check_int(sensitivity, "sensitivity", low=1)
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.integer):
    raise TypeError(f"value must be an integer array, got dtype={value.dtype}.")
  return value.astype(jnp.int32) + _discrete_laplace(key, value.shape, sensitivity / epsilon)


def discrete_laplace_tail(z: int, scale: float) -> float:
  """``P[Z ≥ z] = p^z / (1 + p)`` for integer ``z ≥ 1`` (host, float64)."""
  z = v.check_int(z, "z", low=1)
  scale = v.check_positive(scale, "scale")
  p = math.exp(-1.0 / scale)
  return p**z / (1.0 + p)
