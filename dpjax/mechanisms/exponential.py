"""The exponential mechanism over a finite candidate set (docs/algorithms.md §1.7)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpjax import _validation as v

__all__ = ["exponential_mechanism"]


def exponential_mechanism(key: jax.Array, scores, *, sensitivity: float, epsilon: float,
                          monotone: bool = False) -> jax.Array:
  """Samples index y with probability ``∝ exp(ε u(y)/(2Δu))`` by Gumbel-max (exact in law).

  ``argmax_y (ε u(y)/(2Δu) + G_y)`` with ``G_y ~ Gumbel(0, 1)`` i.i.d. has exactly the softmax
  law in real arithmetic; the scores are shifted by their maximum first (which changes nothing in
  law) so large scores keep their float precision.

  Floating point (docs/algorithms.md §1.10), a caveat this sampler does not remove: the Gumbel noise
  comes from uniforms of the working dtype. In float32 they are multiples of 2^-23, so the noise
  is cut to about [−4.5, 15.9] and a candidate whose scaled score is ≳ 20 below the best is never
  output (probability 0 instead of ≈ e^{−20}); the output law is within total variation about
  C·2^-22 of the exact one (C·2^-51 in float64 with x64 enabled). The release is an index, so no
  float value leaks, but the guarantee is (ε, δ)-DP with δ of that order rather than pure ε-DP.

  Guarantee: ε-DP (in real arithmetic; see the floating-point note) under the caller's
  neighboring relation when each candidate's score has sensitivity ``Δu`` under it (the
  normaliser moves by at most ``e^{ε/2}`` and the numerator by
  at most ``e^{ε/2}``). With ``monotone=True`` (on every neighboring pair all scores move in the
  same direction) the factor 2 is dropped [McSherry–Talwar 2007]. The candidate list must be
  data-independent (fixed order; the index is the output).

  Args:
    key: JAX PRNG key.
    scores: ``(C,)`` real (or integer) scores, C ≥ 1. NaN/inf scores are replaced by 0 (a fixed
      map: raising would branch on private data).
    sensitivity: ``Δu > 0``.
    epsilon: ``ε > 0``.
    monotone: see above.

  Returns:
    int32 scalar index in ``[0, C)``. Traceable in ``key`` and ``scores``.

  Raises:
    TypeError: non-key ``key``, non-numeric or bool ``scores``.
    ValueError: ``scores`` not of shape (C,), C ≥ 1; bad ε or Δu.

  References:
    docs/algorithms.md §1.7; McSherry & Talwar, "Mechanism design via differential privacy",
    FOCS 2007.
  """
  v.check_key(key)
  epsilon = v.check_epsilon(epsilon)
  sensitivity = v.check_positive(sensitivity, "sensitivity")
  scores = v.sanitise_value(jnp.asarray(v.check_scores(scores)).astype(jnp.result_type(float)))
  factor = epsilon / (sensitivity if monotone else 2.0 * sensitivity)
  return _gumbel_max(key, scores, factor)


@jax.jit
def _gumbel_max(key, scores, factor):
  """Jitted core: ``argmax(factor·(scores − max) + Gumbel)`` as int32."""
  logits = factor * (scores - jnp.max(scores))
  gumbel = jax.random.gumbel(key, scores.shape, scores.dtype)
  return jnp.argmax(logits + gumbel).astype(jnp.int32)
