"""The exponential mechanism over a finite candidate set (ALGORITHMS.md §1.7)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpjax import _validation as v


def exponential_mechanism(key: jax.Array, scores, *, sensitivity: float, epsilon: float,
                          monotone: bool = False) -> jax.Array:
  """Samples index y with probability ``∝ exp(ε u(y) / (2Δu))`` by Gumbel-max (exact).

  Guarantee: ε-DP under the caller's neighbouring relation when each score has sensitivity
  ``Δu``; with ``monotone=True`` (all scores move in the same direction between neighbours) the
  factor 2 is dropped [McSherry–Talwar 2007].

  Args:
    key: PRNG key.
    scores: ``(C,)`` finite real scores of the candidates (data-independent candidate order).
    sensitivity: Δu > 0.
    epsilon: ε > 0.
    monotone: see above.

  Returns:
    int32 scalar index.
  """
  v.check_key(key)
  epsilon = v.check_epsilon(epsilon)
  sensitivity = v.check_positive(sensitivity, "sensitivity")
  scores = jnp.asarray(scores)
  if scores.ndim != 1 or scores.shape[0] == 0:
    raise ValueError(f"scores must have shape (C,) with C >= 1, got {tuple(scores.shape)}.")
  if not bool(jnp.all(jnp.isfinite(scores))):
    raise ValueError("scores contain NaN or infinite entries.")
  factor = epsilon / (sensitivity if monotone else 2.0 * sensitivity)
  return _gumbel_max(key, scores.astype(jnp.result_type(float)), factor)


@jax.jit
def _gumbel_max(key, scores, factor):
  return jnp.argmax(factor * scores + jax.random.gumbel(key, scores.shape)).astype(jnp.int32)
