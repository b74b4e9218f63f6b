"""Gradient embedding perturbation (GEP): per-example gradients split by per-layer bases BEFORE
clipping into an embedding and a residual (docs/algorithms.md §6.4).

Yu, Zhang, Chen & Liu (ICLR 2021). The split is linear and per example, so clipping the pair
bounds the sum's sensitivity whatever the bases: the noise of :func:`dpjax.sgd.dp_noise` built
from this grad sum reads that bound and the two clip norms from it, and lifts the embedding back
with the bases held in its state.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from dpjax import _validation as v
from dpjax import linalg
from dpjax.sgd import bases as bases_lib
from dpjax.sgd import per_example

__all__ = ["EmbeddingResidualGradSum", "embedding_residual_grad_sum", "sum_shapes"]


@dataclasses.dataclass(frozen=True)
class EmbeddingResidualGradSum(per_example.ClippedGradSum):
  """GEP's clipped-gradient sum: ``fun(params, batch, mask, bases) -> {"embedding", "residual"}``
  in scaled units, carrying its bound Δ (``l2_norm_bound``: 1 joint, √2 per part) and the clip
  norms the noise lifts by.

  Attributes:
    embedding_clip, residual_clip: ``C_e``, ``C_ρ``.
    joint: one clip of the scaled pair (Δ = 1) or one per part (Δ = √2).
  """
  embedding_clip: float = 1.0
  residual_clip: float = 1.0
  joint: bool = True


def _split(g, U, embedding_clip, residual_clip):
  """One example's leaf → (embedding/C_e, residual/C_ρ); unprojected leaves have no residual."""
  if U is None:
    return g / embedding_clip, jnp.zeros((0,), g.dtype)
  dtype = jnp.promote_types(g.dtype, jnp.float32)
  G = g.reshape(g.shape[0], -1).astype(dtype)
  e = bases_lib.embed(G, U)
  return e / embedding_clip, ((G - bases_lib.lift(e, U)) / residual_clip).reshape(g.shape)


def embedding_residual_grad_sum(loss_fn, *, embedding_clip: float, residual_clip: float,
                                joint: bool = True, clipping: str = "clip",
                                stability: float = per_example.DEFAULT_STABILITY
                                ) -> EmbeddingResidualGradSum:
  """``fn(params, batch, mask, bases)``: per-example gradients split by per-layer bases BEFORE
  clipping, into an embedding and a residual, jointly clipped in a weighted norm, then summed.

  For one example with gradient leaves ``G_ℓ (a, b)`` and bases ``U_ℓ (a, r)``: the embedding
  ``e_ℓ = U_ℓᵀ G_ℓ`` (r × b; the whole leaf where the basis is ``None``) and the residual
  ``ρ_ℓ = G_ℓ − U_ℓ e_ℓ``; with a :class:`TwoSidedBasis` ``e_ℓ = U_ℓᵀ G_ℓ V_ℓ`` (r × r') and
  ``ρ_ℓ = G_ℓ − U_ℓ e_ℓ V_ℓᵀ``. The pair is scaled to ``u = (e / C_e, ρ / C_ρ)``; ``joint=True``
  clips ``‖u‖₂ ≤ 1`` (bound Δ = 1), ``joint=False`` clips each part to norm 1 on its own (GEP;
  bound Δ = √2) (``clipping="clip"``, or "normalize"; the edge cases of
  :func:`dpjax.sgd.per_example.clip_per_example`: non-finite examples contribute 0), so every term has
  norm ≤ Δ in the scaled units whatever the bases are.

  Privacy: the masked sum of the clipped ``u`` has ℓ2-sensitivity Δ (``fn.l2_norm_bound``)
  under add/remove-one, so :func:`dpjax.sgd.dp_noise` built from this function (it reads Δ and
  the clip norms from it; noise ``N(0, σ²Δ²)`` on every coordinate of the scaled sums) is the
  Gaussian mechanism with noise multiplier σ, accounted exactly as DP-SGD. In the original units the embedding gets noise
  ``σΔC_e`` and the residual ``σΔC_ρ`` (Yu et al.'s GEP). The bases must not depend on the
  private data except through DP releases (e.g. :func:`trajectory_bases`).

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar`` for one example.
    embedding_clip, residual_clip: ``C_e > 0`` and ``C_ρ > 0``.
    joint: one clip of the scaled pair (True, Δ = 1) or one per part (False, Δ = √2).
    clipping, stability: as :func:`dpjax.sgd.clipped_grad_sum`.

  Returns:
    An :class:`EmbeddingResidualGradSum` ``fn(params, batch, mask, bases) -> {"embedding": tree,
    "residual": tree}`` in scaled units, carrying ``l2_norm_bound = Δ``: the embedding tree has
    ``(r, b)`` (two-sided: ``(r, r')``) coefficient leaves where a basis is given and the leaf
    itself elsewhere; the residual tree has the leaf's shape where a basis is
    given and empty ``(0,)`` leaves elsewhere. ``bases`` is an argument (not baked into the
    compiled program), as in :func:`dpjax.sgd.dp_noise`'s state (the plan passes the noise
    state's bases, so the split and the lift use the same ones).

  Raises:
    ValueError: a clip norm ≤ 0 or not finite; as :func:`dpjax.sgd.clipped_grad_sum`.
    TypeError: ``loss_fn`` not callable.

  References:
    Yu, Zhang, Chen & Liu, "Do not Let Privacy Overbill Utility: Gradient Embedding
    Perturbation for Private Learning" (GEP), ICLR 2021.
  """
  embedding_clip = v.check_positive(embedding_clip, "embedding_clip")
  residual_clip = v.check_positive(residual_clip, "residual_clip")
  clipping, stability = per_example.check_clipping(clipping, stability)
  grads_fn = per_example.per_example_grads(loss_fn)

  def fn(params, batch, mask, bases):
    grads = grads_fn(params, batch)
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    bases_flat = treedef.flatten_up_to(bases)
    pairs = [jax.vmap(lambda g, U=U: _split(g, U, embedding_clip, residual_clip))(g)
             for g, U in zip(leaves, bases_flat)]
    scaled = {"embedding": treedef.unflatten([e for e, _ in pairs]),
              "residual": treedef.unflatten([r for _, r in pairs])}
    if joint:
      clipped = per_example.clip_per_example(scaled, 1.0, clipping=clipping,
                                             stability=stability)
    else:
      clipped = {part: per_example.clip_per_example(tree, 1.0, clipping=clipping,
                                                    stability=stability)
                 for part, tree in scaled.items()}
    weights = jnp.asarray(mask)
    return jax.tree_util.tree_map(
        lambda x: jnp.tensordot(weights.astype(x.dtype), x, axes=1, precision=linalg.HIGHEST),
        clipped)

  return EmbeddingResidualGradSum(fn, 1.0 if joint else math.sqrt(2.0),
                                   embedding_clip=embedding_clip, residual_clip=residual_clip,
                                   joint=bool(joint))


def sum_shapes(params, bases):
  """The structure of GEP's grad sum for ``params`` and ``bases``: ``{"embedding", "residual"}``
  trees of ``jax.ShapeDtypeStruct`` (what :func:`dpjax.sgd.dp_noise` releases)."""
  def one_example(params):
    leaves, treedef = jax.tree_util.tree_flatten(params)
    pairs = [_split(g, U, 1.0, 1.0) for g, U in zip(leaves, treedef.flatten_up_to(bases))]
    return {"embedding": treedef.unflatten([e for e, _ in pairs]),
            "residual": treedef.unflatten([r for _, r in pairs])}
  return jax.eval_shape(one_example, params)
