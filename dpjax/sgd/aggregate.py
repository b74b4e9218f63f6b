"""An optax-compatible DP aggregate: ``optax.contrib.differentially_private_aggregate``'s drop-in.

For code written against optax's transform (per-example gradients in, a noisy mean out), with
dpjax's pieces underneath: the float-safe per-example clip
(:func:`dpjax.sgd.per_example.clip_per_example`: every term ≤ C in every dtype), their sum, and
:func:`dpjax.sgd.dp_noise`'s full release (std σC, rounded up, drawn in at least float32).
"""

from __future__ import annotations

import warnings

import jax
import optax

from dpjax import _validation as v
from dpjax.sgd import noise, per_example

__all__ = ["dp_aggregate"]


def dp_aggregate(l2_norm_clip: float, noise_multiplier: float, key: jax.Array | int | None = None,
                 *, seed: int | None = None) -> optax.GradientTransformation:
  """Per-example clipping, sum and Gaussian noise as one optax transform (optax's argument names).

  Usage (as ``optax.contrib.differentially_private_aggregate``; its first in a chain)::

      tx = optax.chain(dpjax.sgd.dp_aggregate(l2_norm_clip=1.0, noise_multiplier=1.1,
                                              key=jax.random.key(0)), optax.sgd(0.1))
      grads = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, batch)   # (B, ...) leaves
      updates, state = tx.update(grads, state, params)

  ``update(grads)`` takes per-example gradients, every leaf with a leading batch axis B, and
  returns ``(Σ_i clip_C(g_i) + N(0, σ²C² I)) / B``, the same release as optax's (one global ℓ2
  clip per example, noise of std σC per coordinate, the mean over the batch), with dpjax's
  float-safe clip (a term's norm is ≤ C for every input and dtype; kept gradients bit for bit;
  non-finite examples contribute 0) and noise (the std rounded up, drawn in at least float32).
  The key lives in the state and is split at every update.

  Privacy: each update is the Gaussian mechanism on a sum of ℓ2-sensitivity C under
  add/remove-one of one example, noise multiplier σ. Over T updates with Poisson sampling at
  rate q it is :func:`dpjax.accounting.dpsgd_event` ``(σ, q, T)`` — but this transform does not
  sample: the accounting is yours (:func:`dpjax.sgd.dp_sgd_plan` owns the sampling, the keys and
  the accountant, and is the recommended path). Dividing by the realised B, as optax does, is
  post-processing only when B is public (a fixed batch); under Poisson sampling divide by the
  expected batch size instead (:func:`dpjax.sgd.dp_noise`).

  Args:
    l2_norm_clip: C > 0, the per-example clip norm.
    noise_multiplier: σ ≥ 0 (noise std σC; 0: no privacy, for tests).
    key: PRNG key (a typed or raw key, or an int seed); None: ``key(0)`` with a warning, as
      optax.
    seed: deprecated spelling of an int ``key`` (optax's).

  Returns:
    An ``optax.GradientTransformation``; its state is :class:`dpjax.sgd.noise.NoiseState`.

  Raises:
    ValueError: C ≤ 0 or not finite, σ < 0, both ``key`` and ``seed``; at update, leaves without
      a shared leading batch axis (e.g. gradients already averaged).

  References:
    Abadi et al., "Deep Learning with Differential Privacy", CCS 2016; optax's
    ``differentially_private_aggregate``.
  """
  clip_norm = v.check_positive(l2_norm_clip, "l2_norm_clip")
  sigma = v.check_positive(noise_multiplier, "noise_multiplier", allow_zero=True)
  if seed is not None:
    if key is not None:
      raise ValueError("give key or its deprecated spelling seed, not both.")
    key = seed
  if key is None:
    warnings.warn("dp_aggregate without a key uses jax.random.key(0); pass a fresh key per "
                  "training run.", stacklevel=2)
    key = 0
  key = v.check_key(jax.random.key(key) if isinstance(key, int) else key)
  # The noise reads Δ from a sensitivity-bearing callable: the clipped sum below, bound C.
  bound = per_example.ClippedGradSum(_per_example_sum, clip_norm)

  def noise_for(batch_size: float) -> optax.GradientTransformation:
    return noise.dp_noise(bound, noise_multiplier=sigma, expected_batch_size=batch_size,
                          key=key)

  def init_fn(params):
    return noise_for(1.0).init(params)

  def update_fn(updates, state, params=None):
    size = per_example.batch_size(updates, "updates")     # raises without a batch axis
    summed = _per_example_sum(updates, clip_norm)
    return noise_for(float(size)).update(summed, state, params)

  return optax.GradientTransformation(init_fn, update_fn)


def _per_example_sum(grads, clip_norm: float):
  """``Σ_i clip_C(g_i)`` over the leading axis of per-example gradients."""
  clipped = per_example.clip_per_example(grads, clip_norm)
  return jax.tree_util.tree_map(lambda g: g.sum(axis=0, dtype=g.dtype), clipped)
