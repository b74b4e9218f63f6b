"""Per-example gradients and their clipping (ALGORITHMS.md §6.1)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from dpjax import _validation as v


def per_example_grads(loss_fn: Callable) -> Callable:
  """``fn(params, batch)`` → the gradient of ``loss_fn`` for every example (``vmap`` of ``grad``).

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar`` for ONE example (a pytree of arrays without
      a batch axis).

  Returns:
    A function of ``(params, batch)``, ``batch`` a pytree with leading axis B, returning a pytree
    like ``params`` whose leaves carry a leading axis B.
  """
  return jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))


def global_norms(grads) -> jax.Array:
  """``(B,)`` global ℓ2 norms of per-example gradients (all leaves of one example together)."""
  squares = [jnp.sum(jnp.reshape(g, (g.shape[0], -1)) ** 2, axis=1)
             for g in jax.tree_util.tree_leaves(grads)]
  return jnp.sqrt(sum(squares))


def _clip_factor(norm, clip_norm):
  # C / max(‖g‖, C): 1 below the bound, and a zero gradient stays zero (no 0/0).
  return clip_norm / jnp.maximum(norm, clip_norm)


def clip_per_example(grads, clip_norm: float):
  """Scales each example's gradient to global ℓ2 norm ≤ C: ``ḡ = g / max(1, ‖g‖/C)``.

  Edge cases: a zero gradient stays zero; gradients already within the bound are unchanged.
  """
  clip_norm = v.check_positive(clip_norm, "clip_norm")
  factor = _clip_factor(global_norms(grads), clip_norm)
  return jax.tree_util.tree_map(
      lambda g: g * factor.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype), grads)


def clipped_grad_sum(loss_fn: Callable, *, clip_norm: float,
                     pre_clipping_transform: Callable | None = None) -> Callable:
  """``fn(params, batch, mask)`` = ``Σ_i mask_i · clip_C(T(∇ loss_fn(params, example_i)))``.

  The sum of clipped per-example gradients, fused in one jittable function (per-example values
  are never returned). Its ℓ2-sensitivity is C under add/remove-one: one example contributes one
  term of norm ≤ C. Divide by a public expected batch size after adding noise (see
  :mod:`dpjax.sgd.transforms`).

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar`` for one example.
    clip_norm: C > 0.
    pre_clipping_transform: optional map of one example's gradient pytree to another pytree
      (e.g. a projection onto a subspace: "clip after projecting"), applied before clipping.

  Returns:
    ``fn(params, batch, mask)``: ``batch`` a pytree with leading axis B, ``mask`` ``(B,)`` with 1
    for real (sampled) examples and 0 for padding; returns a pytree like ``params`` (or like the
    transform's output).
  """
  clip_norm = v.check_positive(clip_norm, "clip_norm")
  grad_fn = jax.grad(loss_fn)

  def one(params, example):
    g = grad_fn(params, example)
    if pre_clipping_transform is not None:
      g = pre_clipping_transform(g)
    norm = jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree_util.tree_leaves(g)))
    factor = _clip_factor(norm, clip_norm)
    return jax.tree_util.tree_map(lambda x: x * factor.astype(x.dtype), g)

  def fn(params, batch, mask):
    grads = jax.vmap(one, in_axes=(None, 0))(params, batch)
    return jax.tree_util.tree_map(
        lambda g: jnp.tensordot(mask.astype(g.dtype), g, axes=1), grads)

  return fn
