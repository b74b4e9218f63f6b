"""Unvalidated, traceable noise samplers shared by mechanisms and learners.

The public, validating samplers are :func:`dpjax.mechanisms.truncated_laplace` and
:func:`dpjax.mechanisms.l2_laplace_noise`; these are their cores, for callers that validated (and
computed the constants) on the host already. Same key, same draws as the public samplers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def truncated_laplace_sample(key, shape, scale, bound, dtype):
  """``TLap`` samples of ``shape`` in ``dtype`` by inverse CDF, clamped to ``[−A, A]``.

  ``|Z| = −λ ln(1 − U(1 − e^{−A/λ}))`` with ``U ~ U(0, 1)`` and an independent fair sign; the key
  splits into ``(sign, uniform)``. ``scale`` (λ) and ``bound`` (A) are Python floats from
  :func:`dpjax.mechanisms.truncated_laplace_params`; nothing is validated. Traceable.
  """
  k_sign, k_u = jax.random.split(key)
  u = jax.random.uniform(k_u, shape, dtype)
  mass = -jnp.expm1(-jnp.asarray(bound / scale, dtype))     # 1 − e^{−A/λ}, no cancellation
  magnitude = -scale * jnp.log1p(-u * mass)
  sign = jnp.where(jax.random.bernoulli(k_sign, 0.5, shape), 1.0, -1.0).astype(dtype)
  return jnp.clip(sign * magnitude, -bound, bound).astype(dtype)


@functools.partial(jax.jit, static_argnames=("d", "dtype"))
def l2_laplace_sample(key, beta, *, d, dtype):
  """A ``(d,)`` vector with density ``∝ exp(−β‖b‖₂)`` in ``dtype``: ``b = r·g/‖g‖`` with
  ``g ~ N(0, I_d)`` and ``r = (E_1 + … + E_d)/β ~ Gamma(d, 1/β)``; the key splits into
  ``(direction, norm)``. ``beta`` may be traced; nothing is validated. Jitted (``d`` and ``dtype``
  static)."""
  k_direction, k_norm = jax.random.split(key)
  g = jax.random.normal(k_direction, (d,), dtype)
  # ‖g‖ = 0 has probability 0 (it would need d exact zeros); the guard only avoids 0/0.
  u = g / jnp.maximum(jnp.sqrt(jnp.sum(g * g)), jnp.finfo(dtype).tiny)
  r = jnp.sum(jax.random.exponential(k_norm, (d,), dtype)) / beta      # ~ Gamma(d, 1/β)
  return (r * u).astype(dtype)
