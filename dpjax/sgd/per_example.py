"""Per-example gradients and their clipping (docs/algorithms.md §6.1).

The clipping map ``g ↦ ḡ = g / max(1, ‖g‖₂/C)`` uses the global ℓ2 norm over the whole gradient
pytree of one example. It is what bounds DP-SGD's sensitivity, so it must be bounded for EVERY
input, including the pathological ones:

=========================================  ==================================================
per-example gradient ``g``                 clipped ``ḡ``
=========================================  ==================================================
``‖g‖ ≤ C``                                 ``g`` unchanged
``‖g‖ > C`` (finite)                        ``g · C/‖g‖`` (norm C); no overflow even when
                                            ``‖g‖²`` exceeds the float range (norm computed
                                            on ``g / max|g|``)
``g = 0``                                   ``0`` (no 0/0)
any NaN or ±inf entry                       ``0`` for the whole example (a NaN would otherwise
                                            poison the sum and reveal the example)
=========================================  ==================================================

so ``‖ḡ‖ ≤ C`` always, and the sum over a batch has ℓ2-sensitivity C under add/remove-one.

Normalised ("automatic") clipping, ``clipping="normalize"``: ``ḡ = C·g/(‖g‖ + γ)`` with a
stability constant γ > 0 (Bu et al., "Automatic Clipping", NeurIPS 2023, AUTO-S; Yang et al.,
DP-NSGD, 2022). Every example gets about the same weight C, so C only scales the learning rate
and needs no tuning; ``‖ḡ‖ = C‖g‖/(‖g‖ + γ) < C`` for every finite g, and the non-finite rows of
the table above become 0 as well, so the sensitivity is the same C.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import linalg


def per_example_grads(loss_fn: Callable) -> Callable:
  """``fn(params, batch)`` → the gradient of ``loss_fn`` for every example (``vmap`` of ``grad``).

  Not private by itself: per-example gradients are the private quantities DP-SGD clips and
  noises. Prefer :func:`clipped_grad_sum`, which never materialises them.

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar`` for ONE example (a pytree of arrays without
      a batch axis).

  Returns:
    A jittable function of ``(params, batch)``, ``batch`` a pytree whose leaves share a leading
    axis B, returning a pytree like ``params`` whose leaves carry a leading axis B (same dtypes).
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  return jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))


def _tree_norm(tree) -> jax.Array:
  """Global ℓ2 norm of one example's pytree, without overflow; non-finite if any entry is."""
  leaves = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
  if not leaves:
    return jnp.zeros(())
  amax = jnp.max(jnp.stack([jnp.max(jnp.abs(x), initial=0) for x in leaves]))
  scale = jnp.where((amax > 0) & jnp.isfinite(amax), amax, jnp.ones_like(amax))
  total = sum(jnp.sum(jnp.square(x / scale.astype(x.dtype))) for x in leaves)
  return scale * jnp.sqrt(total)


CLIPPINGS = ("clip", "normalize")
DEFAULT_STABILITY = 0.01


def _clip_one(tree, clip_norm: float, clipping: str = "clip",
              stability: float = DEFAULT_STABILITY):
  """Clips one example's pytree (see the module's edge-case table)."""
  norm = _tree_norm(tree)
  finite = jnp.isfinite(norm)
  if clipping == "normalize":
    # C / (‖g‖ + γ): the term's norm C‖g‖/(‖g‖ + γ) is < C; a zero gradient stays zero.
    factor = jnp.where(finite, clip_norm / (norm + stability), 0.0)
  else:
    # C / max(‖g‖, C): 1 below the bound; a zero gradient stays zero (no 0/0).
    factor = jnp.where(finite, clip_norm / jnp.maximum(norm, clip_norm), 0.0)
  return jax.tree_util.tree_map(
      lambda x: jnp.where(finite, x * factor.astype(x.dtype), jnp.zeros_like(x)), tree)


def _check_batched(grads, name: str) -> int:
  leaves = jax.tree_util.tree_leaves(grads)
  if not leaves:
    raise ValueError(f"{name} must be a non-empty pytree of arrays.")
  sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
  if None in sizes or len(sizes) != 1:
    raise ValueError(f"all leaves of {name} must share a leading batch axis, got leading sizes "
                     f"{sorted(str(s) for s in sizes)}.")
  return sizes.pop()


def global_norms(grads) -> jax.Array:
  """``(B,)`` global ℓ2 norms of per-example gradients (all leaves of one example together).

  Args:
    grads: pytree whose leaves share a leading batch axis B.

  Returns:
    ``(B,)`` array in the leaves' (promoted) float dtype; NaN/inf for examples with non-finite
    entries. Private values: a diagnostic, not for release.

  Raises:
    ValueError: empty pytree or leaves without a shared leading axis.
  """
  _check_batched(grads, "grads")
  return jax.vmap(_tree_norm)(grads)


def clip_per_example(grads, clip_norm: float, *, clipping: str = "clip",
                     stability: float = DEFAULT_STABILITY):
  """Scales each example's gradient to global ℓ2 norm ≤ C: ``ḡ = g / max(1, ‖g‖/C)``.

  Edge cases (module table): within the bound unchanged; a zero gradient stays zero; an
  example with any NaN/inf entry becomes zero. Hence ``‖ḡ_i‖ ≤ C`` for every input.

  Args:
    grads: pytree of per-example gradients, leaves with a leading batch axis B.
    clip_norm: C > 0 (finite).
    clipping: "clip" (above) or "normalize": ``ḡ = C·g/(‖g‖ + γ)`` (module docstring).
    stability: γ > 0 of "normalize", in gradient-norm units (default 0.01, Bu et al.).

  Returns:
    A pytree like ``grads`` (same shapes and dtypes).

  Raises:
    ValueError: C ≤ 0 or not finite; γ ≤ 0; an unknown ``clipping``; leaves without a shared
      leading axis.
  """
  clip_norm = v.check_positive(clip_norm, "clip_norm")
  clipping, stability = check_clipping(clipping, stability)
  _check_batched(grads, "grads")
  return jax.vmap(lambda g: _clip_one(g, clip_norm, clipping, stability))(grads)


def check_clipping(clipping: str, stability: float) -> tuple[str, float]:
  """Validates ``clipping`` ∈ :data:`CLIPPINGS` and γ > 0 (finite); returns them."""
  v.check_choice(clipping, "clipping", CLIPPINGS)
  return clipping, v.check_positive(stability, "stability")


@dataclasses.dataclass(frozen=True)
class ClippedGradSum:
  """A clipped-gradient sum that carries its ℓ2 bound (a sensitivity-bearing callable).

  Field names follow ``jax_privacy.clipping.BoundedSensitivityCallable`` so either library's
  object can drive the other's noise: ``fun(params, batch, mask)`` is the sum,
  ``l2_norm_bound`` = C bounds every term.
  """
  fun: Callable
  l2_norm_bound: float
  has_aux: bool = False

  def __call__(self, *args, **kwargs):
    return self.fun(*args, **kwargs)

  def sensitivity(self, neighbouring: NeighboringRelation = (
      NeighboringRelation.ADD_OR_REMOVE_ONE)) -> float:
    """ℓ2-sensitivity of the sum: C under add/remove-one, 2C under replace-one."""
    if neighbouring == NeighboringRelation.ADD_OR_REMOVE_ONE:
      return self.l2_norm_bound
    if neighbouring == NeighboringRelation.REPLACE_ONE:
      return 2.0 * self.l2_norm_bound
    raise ValueError(f"unsupported neighbouring relation {neighbouring!r}.")


def clipped_grad_sum(loss_fn: Callable, *, clip_norm: float,
                     pre_clipping_transform: Callable | None = None, clipping: str = "clip",
                     stability: float = DEFAULT_STABILITY) -> ClippedGradSum:
  """``fn(params, batch, mask)`` = ``Σ_i mask_i · clip_C(T(∇ loss_fn(params, example_i)))``.

  The sum of clipped per-example gradients, fused in one jittable function: ``vmap`` of
  grad → optional transform T → clip, then the masked sum. Per-example values and the realised
  batch size are never returned (both are private).

  Privacy: every term has ℓ2 norm ≤ C whatever the example (module edge-case table), so the
  sum has ℓ2-sensitivity C under add/remove-one (one example adds or removes one term), which
  is what the Gaussian noise of :mod:`dpjax.sgd.transforms` is calibrated to. Divide by a public
  expected batch size after adding noise, never by ``sum(mask)``.

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar`` for one example.
    clip_norm: C > 0.
    pre_clipping_transform: optional map of ONE example's gradient pytree to another pytree
      (e.g. a projection ``g ↦ Vᵀ ravel(g)``: "clip after projecting"), applied before
      clipping. It must not look at other examples (it is vmapped).
    clipping: "clip" (``g / max(1, ‖g‖/C)``) or "normalize" (``C·g/(‖g‖ + γ)``, automatic
      clipping; module docstring). Both bound every term by C.
    stability: γ > 0 of "normalize" (default 0.01).

  Returns:
    A :class:`ClippedGradSum` ``fn(params, batch, mask)`` carrying ``fn.l2_norm_bound = C``
    (pass it to :func:`dpjax.sgd.dp_sgd_privatizer`, which reads C from it): ``batch`` a
    pytree with leading axis B, ``mask`` ``(B,)`` with 1
    (True) for real, sampled examples and 0 (False) for padding; returns a pytree like
    ``params`` (or like the transform's output), in the gradients' dtypes.

  Raises:
    ValueError: C ≤ 0 or not finite; γ ≤ 0; an unknown ``clipping``.
    TypeError: ``loss_fn`` or ``pre_clipping_transform`` not callable.

  References:
    Abadi et al., "Deep Learning with Differential Privacy", CCS 2016; the fused design follows
    ``jax_privacy.clipped_grad`` (sum of clipped gradients, normalised by a public size);
    Bu et al., "Automatic Clipping: Differentially Private Deep Learning Made Easier and
    Stronger", NeurIPS 2023 (``clipping="normalize"``).
  """
  clip_norm = v.check_positive(clip_norm, "clip_norm")
  clipping, stability = check_clipping(clipping, stability)
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  if pre_clipping_transform is not None and not callable(pre_clipping_transform):
    raise TypeError("pre_clipping_transform must be callable or None, got "
                    f"{type(pre_clipping_transform).__name__}.")
  grad_fn = jax.grad(loss_fn)

  def one(params, example):
    g = grad_fn(params, example)
    if pre_clipping_transform is not None:
      g = pre_clipping_transform(g)
    return _clip_one(g, clip_norm, clipping, stability)

  def fn(params, batch, mask):
    grads = jax.vmap(one, in_axes=(None, 0))(params, batch)
    return jax.tree_util.tree_map(
        lambda g: jnp.tensordot(jnp.asarray(mask).astype(g.dtype), g, axes=1,
                                precision=linalg.HIGHEST), grads)

  return ClippedGradSum(fn, clip_norm)
