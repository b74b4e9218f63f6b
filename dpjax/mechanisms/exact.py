"""Exact integer samplers (Canonne, Kamath & Steinke 2020), in JAX with integer arithmetic only.

The discrete Laplace sampler here uses no floating point at all: Bernoulli(exp(−γ)) for rational
γ ∈ [0, 1] by von Neumann's series trick, uniform integers by rejection from 32-bit words, and
geometric variables built from those (CKS 2020, Algorithms 1 and 2). Its output distribution is
exactly ``P(Z = z) ∝ exp(−|z|·den/num)``, so integer statistics released with it have no
floating-point side channel (docs/algorithms.md §1.10 rule 1). Loops are ``lax.while_loop``s;
everything is jittable and ``vmap``-able (all lanes run until the slowest finishes).
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Building blocks of dpjax.mechanisms.discrete and .histogram (and PMM/PSMM): no public names.
# Users draw exact integer noise with dpjax.mechanisms.discrete_laplace / discrete_gaussian.
__all__: list[str] = []

_DENOMINATOR = 1 << 10          # scales are rounded UP to a multiple of 2^-10 (never less noise)


def rational_scale(scale: float) -> tuple[int, int]:
  """``(num, den)`` with ``num/den ≥ scale``, ``den = 2^10``: the exact sampler's scale.

  Rounding the scale up only adds noise, so a mechanism calibrated for ``scale`` keeps its
  guarantee.
  """
  num = math.ceil(Fraction(scale) * _DENOMINATOR)
  return max(num, 1), _DENOMINATOR


_DONE = 4


def _discrete_laplace_one(key, num: int, den: int):
  """One exact draw with ``P(z) ∝ exp(−|z| den/num)`` (CKS 2020, Algorithms 1 and 2).

  Written as ONE state machine that consumes one 32-bit word per iteration, so that under
  ``vmap`` all lanes advance together (nested loops would multiply their worst cases):

  * phase 0: ``u ~ U{0..num−1}``;
  * phase 1: Bernoulli(exp(−u/num)) by von Neumann's trick (accept ``U{0..num·k−1} < u``
    increments k; the result is "k odd"); failure restarts at phase 0;
  * phase 2: ``v`` = successes of Bernoulli(exp(−1)) (same trick with ``U{0..k−1} < 1``) before
    the first failure, so ``x = u + num·v ~ Geometric(1 − e^{−1/num})``;
  * phase 3: ``y = ⌊x/den⌋ ~ Geometric(1 − e^{−den/num})`` and a fair sign; ``(−, 0)`` restarts.

  Uniform integers come from rejection on 32-bit words (a rejected word leaves the state as is).
  """
  numu = jnp.uint32(num)

  def body(state):
    key, phase, u, k, v, z = state
    key, sub = jax.random.split(key)
    word = jax.random.bits(sub, (), jnp.uint32)
    n = jnp.where(phase == 0, numu, jnp.where(phase == 1, numu * k,
                                               jnp.where(phase == 2, k, jnp.uint32(2))))
    valid = word < (jnp.uint32(0xFFFFFFFF) // n) * n
    r = word % n
    odd = k % 2 == 1
    # phase 0 -> 1
    p0 = (jnp.uint32(1), r, jnp.uint32(1), v, z)
    # phase 1: Bernoulli(exp(−u/num))
    step1 = r < u
    p1 = (jnp.where(step1, 1, jnp.where(odd, 2, 0)).astype(jnp.uint32), u,
          jnp.where(step1, k + 1, 1).astype(jnp.uint32), jnp.uint32(0), z)
    # phase 2: Geometric via Bernoulli(exp(−1))
    step2 = r == 0
    p2 = (jnp.where(step2 | odd, 2, 3).astype(jnp.uint32), u,
          jnp.where(step2, k + 1, 1).astype(jnp.uint32),
          jnp.where(~step2 & odd, v + 1, v).astype(jnp.uint32), z)
    # phase 3: fold to the target scale and pick a sign
    y = ((u + numu * v) // jnp.uint32(den)).astype(jnp.int32)
    negative = r == 1
    restart = negative & (y == 0)
    p3 = (jnp.where(restart, 0, _DONE).astype(jnp.uint32), u, k, v,
          jnp.where(negative, -y, y))
    options = (p0, p1, p2, p3)
    new = tuple(
        jnp.select([phase == i for i in range(4)], [o[j] for o in options], default=old)
        for j, old in enumerate((phase, u, k, v, z)))
    new = tuple(jnp.where(valid, n_, o) for n_, o in zip(new, (phase, u, k, v, z)))
    return (key,) + new

  def cond(state):
    return state[1] != _DONE

  init = (key, jnp.uint32(0), jnp.uint32(0), jnp.uint32(1), jnp.uint32(0), jnp.int32(0))
  return lax.while_loop(cond, body, init)[5]


def exact_discrete_laplace(key: jax.Array, shape, num: int, den: int) -> jax.Array:
  """``shape`` independent exact discrete Laplace draws of scale ``num/den`` (int32).

  Args:
    key: PRNG key.
    shape: output shape (static).
    num, den: positive ints (Python or traced), the scale as a fraction; ``num < 2^31/64``.
      ``num`` may also be an integer array broadcastable to ``shape`` (one scale per draw, all
      drawn by one sampler loop: e.g. every level of a hierarchical histogram at once).
  """
  size = math.prod(shape)
  keys = jax.random.split(key, max(size, 1))[:size]
  if np.ndim(num) == 0:
    draws = jax.vmap(lambda k: _discrete_laplace_one(k, num, den))(keys)
  else:
    nums = jnp.broadcast_to(jnp.asarray(num, jnp.uint32), shape).reshape(-1)
    draws = jax.vmap(lambda k, m: _discrete_laplace_one(k, m, den))(keys, nums)
  return draws.reshape(shape)


def exact_truncated_discrete_laplace(key: jax.Array, shape, num: int, den: int,
                                     bound: int) -> jax.Array:
  """Exact draws of ``P(z) ∝ exp(−|z| den/num)`` on ``{−bound, …, bound}`` (rejection)."""
  def one(key):
    def cond(state):
      return jnp.abs(state[1]) > bound

    def body(state):
      key, _ = state
      key, sub = jax.random.split(key)
      return key, _discrete_laplace_one(sub, num, den)

    key, sub = jax.random.split(key)
    return lax.while_loop(cond, body, (key, _discrete_laplace_one(sub, num, den)))[1]

  size = math.prod(shape)
  keys = jax.random.split(key, max(size, 1))[:size]
  return jax.vmap(one)(keys).reshape(shape)
