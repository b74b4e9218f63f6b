"""Per-layer gradient subspaces: a pytree of bases, one per weight matrix, noise only in their
span (docs/algorithms.md §6.4).

A dense layer's per-example gradient is rank one, ``x δᵀ`` for a kernel ``(in, out)`` applied as
``x @ W``: its column space lies in the span of the layer's inputs. A basis ``U_ℓ (a_ℓ, r_ℓ)``
per weight matrix (its first axis, a_ℓ = in) keeps that structure, where one flattened (p, k)
basis throws it away: the noise lives in ``Σ_ℓ r_ℓ b_ℓ`` coordinates (b_ℓ = the product of the
other axes) instead of p. A :class:`TwoSidedBasis` ``(U_ℓ, V_ℓ)`` adds an output-side factor
``V_ℓ (b_ℓ, r'_ℓ)``: the leaf's coefficients are ``U_ℓᵀ G_ℓ V_ℓ`` (``r_ℓ r'_ℓ`` coordinates).

References:
  Yu et al., "Large Scale Private Learning via Low-rank Reparametrization" (RGP), ICML 2021
  (per-layer low-rank gradient carriers from the update history); Zhou, Wu & Banerjee, PDP-SGD,
  ICLR 2021 (the noisy gradient projected on a subspace).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax import _validation as v
from dpjax import linalg
from dpjax.sgd import per_example, transforms


class LayerSubspaceNoiseState(NamedTuple):
  """State of :func:`layer_subspace_noise`.

  Attributes:
    key: PRNG key, split at every update (never reused; :func:`update_layer_bases` keeps it).
    bases: pytree like the params with ``None`` (full noise), an ``(a, r)`` basis or a
      :class:`TwoSidedBasis` per leaf.
    base_std: float32 scalar ``σ·C`` (rounded up).
    noise_std: float32 scalar ``σ·C·max(1, max_ℓ ν̂_ℓ)`` (rounded up), the std in every released
      coordinate.
  """
  key: jax.Array
  bases: Any
  base_std: jax.Array
  noise_std: jax.Array


class TwoSidedBasis(NamedTuple):
  """Left and right factors of one weight leaf's subspace, the leaf read as a matrix ``(a, b)``
  (first axis by the rest): coefficients ``Uᵀ G V`` ``(r, r')``, lifted back as ``U c Vᵀ``.

  Attributes:
    left: ``U (a, r)``, orthonormal (or zero, under a rank rule) columns: the input side.
    right: ``V (b, r')``, likewise: the output side.
  """
  left: Any
  right: Any


def _is_basis(x):
  """A leaf of a bases pytree: None, or a TwoSidedBasis taken whole (not as two leaves)."""
  return x is None or isinstance(x, TwoSidedBasis)


def _embed(G, basis):
  """``Uᵀ G`` (one-sided) or ``Uᵀ G V`` (two-sided) of a matrix G, in G's dtype."""
  if isinstance(basis, TwoSidedBasis):
    return linalg.matmul(linalg.matmul(basis.left.astype(G.dtype).T, G),
                         basis.right.astype(G.dtype))
  return linalg.matmul(basis.astype(G.dtype).T, G)


def _lift(c, basis):
  """``U c`` (one-sided) or ``U c Vᵀ`` (two-sided): coefficients back to the matrix."""
  if isinstance(basis, TwoSidedBasis):
    return linalg.matmul(linalg.matmul(basis.left.astype(c.dtype), c),
                         basis.right.astype(c.dtype).T)
  return linalg.matmul(basis.astype(c.dtype), c)


def _basis_bound(basis) -> float:
  """An upper bound on the spectral norm of ``G ↦ Uᵀ G [V]`` (Frobenius to Frobenius):
  ``‖U‖₂`` or ``‖U‖₂‖V‖₂`` (``‖UᵀGV‖_F ≤ ‖U‖₂‖G‖_F‖V‖₂``)."""
  if isinstance(basis, TwoSidedBasis):
    return transforms.basis_norm_bound(basis.left) * transforms.basis_norm_bound(basis.right)
  return transforms.basis_norm_bound(basis)


def _is_full(basis) -> bool:
  """Whether the basis spans its whole leaf (square factors: no residual)."""
  sides = basis if isinstance(basis, TwoSidedBasis) else (basis,)
  return all(b.shape[1] >= b.shape[0] for b in sides)


def _check_noise(clip_norm, noise_multiplier, expected_batch_size, key):
  v.check_key(key)
  return (v.check_positive(clip_norm, "clip_norm"),
          v.check_positive(noise_multiplier, "noise_multiplier", allow_zero=True),
          v.check_positive(expected_batch_size, "expected_batch_size"))


def check_layer_bases(bases, params, *, tol: float = 1e-3):
  """Validates a pytree of per-layer bases against ``params`` (host side).

  ``bases`` has the structure of ``params`` with ``None`` where a leaf is not projected; a
  projected leaf of shape ``(a, ...)`` needs an ``(a, r)`` basis, or a :class:`TwoSidedBasis`
  of an ``(a, r)`` left and a ``(b, r')`` right factor (b = the product of the other axes),
  each with orthonormal or zero columns (:func:`dpjax.sgd.transforms.check_basis` with
  ``partial=True``, spectral tolerance ``tol``; a zero column is a direction left out, as
  :func:`trajectory_bases`' rank rule does).

  Returns:
    The bases with arrays as ``jax.Array``.

  Raises:
    ValueError: another tree structure, no projected leaf, a basis whose row count is not the
      leaf's first axis, a leaf with fewer than two axes given a basis, or as ``check_basis``.
    TypeError: as ``check_basis``.
  """
  leaves = jax.tree_util.tree_leaves(bases, is_leaf=_is_basis)
  placeholders = jax.tree_util.tree_map(lambda _: 0, bases, is_leaf=_is_basis)
  if jax.tree_util.tree_structure(placeholders) != jax.tree_util.tree_structure(params):
    raise ValueError("bases must have the structure of the params, with None for the leaves "
                     "that are not projected.")
  if all(b is None for b in leaves):
    raise ValueError("bases has no projected leaf; use dp_gaussian_noise for full noise.")

  def check(basis, leaf):
    if basis is None:
      return None
    if jnp.ndim(leaf) < 2:
      raise ValueError(f"a basis was given for a leaf of shape {jnp.shape(leaf)}: only leaves "
                       "with at least two axes (weight matrices) are projected.")
    shape = jnp.shape(leaf)
    if isinstance(basis, TwoSidedBasis):
      return TwoSidedBasis(_check_side(basis.left, shape, shape[0], "left", tol),
                           _check_side(basis.right, shape, math.prod(shape[1:]), "right", tol))
    return _check_side(basis, shape, shape[0], "", tol)

  return jax.tree_util.tree_map(check, bases, params, is_leaf=_is_basis)


def _check_side(basis, shape, rows, side, tol):
  basis = transforms.check_basis(basis, f"{side} basis".strip(), tol=tol, partial=True)
  if basis.shape[0] != rows:
    what = ("the product of the leaf's other axes" if side == "right"
            else "the leaf's first, input-side axis")
    raise ValueError(f"a {side + ' ' if side else ''}basis for a leaf of shape {shape} must "
                     f"have {rows} rows ({what}), got {tuple(basis.shape)}.")
  return basis


def layer_noise_std(base_std: float, bases) -> np.float32:
  """``σC·max(1, max_ℓ ν̂_ℓ)`` in float32 rounded up: the released map is block diagonal, so its
  spectral norm is the largest block's (identity blocks count 1; a two-sided block
  ``ν̂(U_ℓ)·ν̂(V_ℓ)``)."""
  bounds = [_basis_bound(b)
            for b in jax.tree_util.tree_leaves(bases, is_leaf=_is_basis) if b is not None]
  return transforms.round_up_float32(float(base_std) * max([1.0] + bounds))


def layer_subspace_noise(bases, *, clip_norm: float, noise_multiplier: float,
                         expected_batch_size: float, key: jax.Array,
                         tol: float = 1e-3) -> optax.GradientTransformation:
  """Noise in per-layer subspaces: ``W_ℓ ↦ U_ℓ (U_ℓᵀ S_ℓ + N(0, s²)) / L``, or with a
  :class:`TwoSidedBasis` ``W_ℓ ↦ U_ℓ (U_ℓᵀ S_ℓ V_ℓ + N(0, s²)) V_ℓᵀ / L``.

  ``S`` is the sum of per-example gradients clipped to global ℓ2 norm C (over all leaves;
  :func:`dpjax.sgd.clipped_grad_sum`). A leaf with a basis ``U_ℓ (a, r)`` is read as the
  matrix ``S_ℓ (a, b)`` (first axis by the rest) and only its ``r × b`` coefficients
  ``U_ℓᵀ S_ℓ`` get noise (``r × r'`` coefficients ``U_ℓᵀ S_ℓ V_ℓ`` with a right factor
  ``V_ℓ (b, r')``); a leaf with ``None`` gets noise in all its coordinates, as in
  :func:`dpjax.sgd.dp_gaussian_noise`.

  Privacy: under add/remove-one, one step releases ``M S + N(0, s² I)`` with M the block-diagonal
  map ``(U_ℓᵀ S_ℓ [V_ℓ])_ℓ`` (identity blocks for unprojected leaves),
  ``‖M‖₂ = max(1, max_ℓ ‖U_ℓ‖₂[‖V_ℓ‖₂])`` (Frobenius to Frobenius:
  ``‖UᵀSV‖_F ≤ ‖U‖₂‖S‖_F‖V‖₂``), so the release has ℓ2-sensitivity ``≤ C·ν`` with
  ``ν = max(1, max_ℓ ν̂_ℓ)`` (:func:`dpjax.sgd.transforms.basis_norm_bound`, multiplied over the
  two factors of a two-sided basis) and ``s = σCν``: the
  Gaussian mechanism with noise multiplier σ, accounted exactly as DP-SGD
  (:func:`dpjax.accounting.dpsgd_event`). Mapping back by ``U_ℓ`` and dividing by L are
  post-processing. The bases must be public, DP releases whose cost is composed in, or
  functions of earlier releases of this run (e.g. :func:`trajectory_bases`, free by
  post-processing); bases computed non-privately from the training data void the guarantee.

  With every leaf given an identity basis the update equals :func:`dp_gaussian_noise`'s with the
  same key (same draws).

  Args:
    bases: pytree like the params; ``None``, an ``(a, r)`` float array with orthonormal
      columns (``a`` = the leaf's first axis; ``1 ≤ r ≤ a``) or a :class:`TwoSidedBasis`
      ``(U (a, r), V (b, r'))`` per leaf (b = the product of the other axes).
    clip_norm: C > 0.
    noise_multiplier: σ ≥ 0.
    expected_batch_size: L > 0, the public expected batch size.
    key: PRNG key, kept in the state and split at every update.
    tol: accepted ``‖UᵀU − I‖₂`` per basis factor (a usability check; privacy holds for any
      accepted basis through ν).

  Returns:
    An ``optax.GradientTransformation`` (state :class:`LayerSubspaceNoiseState`); the bases are
    checked against the params at ``init``; :func:`update_layer_bases` swaps in new ones.

  Raises:
    ValueError: as :func:`check_layer_bases` (at ``init``), and as
      :func:`dpjax.sgd.dp_gaussian_noise`.
    TypeError: as :func:`dpjax.sgd.dp_gaussian_noise`.

  References:
    Yu et al., RGP, ICML 2021; Zhou, Wu & Banerjee, PDP-SGD, ICLR 2021.
  """
  clip_norm, sigma, batch = _check_noise(clip_norm, noise_multiplier, expected_batch_size, key)
  base_std = transforms.round_up_float32(sigma * clip_norm)
  tol = v.check_positive(tol, "tol")

  def init_fn(params):
    checked = check_layer_bases(bases, params, tol=tol)
    return LayerSubspaceNoiseState(key, checked, jnp.asarray(base_std, jnp.float32),
                                   jnp.asarray(layer_noise_std(base_std, checked), jnp.float32))

  return optax.GradientTransformation(init_fn, _layer_update(batch))


def _layer_update(batch):
  def update_fn(updates, state, params=None):
    del params
    next_key, noise_key = jax.random.split(state.key)
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    bases = treedef.flatten_up_to(state.bases)
    keys = jax.random.split(noise_key, len(leaves))
    out = []
    for g, U, k in zip(leaves, bases, keys):
      if U is None:
        std = state.noise_std.astype(g.dtype)
        out.append((g + std * jax.random.normal(k, g.shape, g.dtype)) / jnp.asarray(batch, g.dtype))
        continue
      # The coefficients are computed with U as stored (at least float32), as in
      # subspace_dp_gaussian_noise: ν̂ covers U's own values, not a 16-bit rounding of them.
      dtype = functools.reduce(jnp.promote_types, [x.dtype for x in jax.tree_util.tree_leaves(U)],
                               jnp.promote_types(g.dtype, jnp.float32))
      G = g.reshape(g.shape[0], -1).astype(dtype)
      coefficients = _embed(G, U)
      noise = jax.random.normal(k, coefficients.shape, dtype)
      coefficients = coefficients + state.noise_std.astype(dtype) * noise
      out.append((_lift(coefficients, U) / jnp.asarray(batch, dtype))
                 .reshape(g.shape).astype(g.dtype))
    return jax.tree_util.tree_unflatten(treedef, out), state._replace(key=next_key)

  return update_fn


def update_layer_bases(opt_state, bases, *, tol: float = 1e-3):
  """Swaps new per-layer bases into every :class:`LayerSubspaceNoiseState` of ``opt_state``.

  The key stream is kept; the noise std is recomputed for the new bases. The new bases must have
  the current ones' shapes and ``None`` pattern, so the compiled update is reused. Host side.

  Raises:
    ValueError: no :class:`LayerSubspaceNoiseState` in ``opt_state``; another structure or shape;
      as :func:`dpjax.sgd.transforms.check_basis`.
  """
  def swap(state):
    old = jax.tree_util.tree_structure(state.bases, is_leaf=_is_basis)
    if jax.tree_util.tree_structure(bases, is_leaf=_is_basis) != old:
      raise ValueError("the new bases must have the current structure and None pattern.")

    def check_side(new, cur):
      new = transforms.check_basis(new, tol=tol, partial=True)
      if new.shape != cur.shape:
        raise ValueError(f"a new basis must have the current shape {tuple(cur.shape)}, got "
                         f"{tuple(new.shape)}.")
      return new.astype(cur.dtype)

    def check(new, cur):
      if (new is None) != (cur is None) or (isinstance(new, TwoSidedBasis)
                                            != isinstance(cur, TwoSidedBasis)):
        raise ValueError("the new bases must have the current None pattern and kinds "
                         "(one- or two-sided).")
      if new is None:
        return None
      if isinstance(new, TwoSidedBasis):
        return TwoSidedBasis(check_side(new.left, cur.left), check_side(new.right, cur.right))
      return check_side(new, cur)

    checked = jax.tree_util.tree_map(check, bases, state.bases, is_leaf=_is_basis)
    std = layer_noise_std(float(state.base_std), checked)
    return state._replace(bases=checked, noise_std=jnp.asarray(std, jnp.float32))

  return transforms.map_states(opt_state, LayerSubspaceNoiseState, swap, "layer_subspace_noise")


def trajectory_bases(released, rank: int, *, min_dim: int = 2, noise_std=None,
                     edge_scale: float = 1.0, two_sided: bool = False):
  """Per-layer bases from RELEASED updates: the top-``rank`` left singular vectors of each
  weight matrix of ``released`` (e.g. an average of past privatised updates); with
  ``two_sided`` a :class:`TwoSidedBasis` of the top-``rank`` left and right singular vectors.

  Rank rule (``noise_std`` given): a matrix ``G (a, b)`` of pure noise with i.i.d. entries of
  std s has its largest singular value near the bulk edge ``s(√a + √b)`` (Marchenko–Pastur;
  Gavish & Donoho, IEEE Trans. Inf. Theory 2014), so a singular direction at or below
  ``edge_scale · s(√a + √b)`` is indistinguishable from the noise: its column is set to zero.
  The effective rank is the number of nonzero columns (shapes stay static, so this runs under
  ``jit``); a basis with zero columns is a partial isometry, which every transform of this
  module accepts: ``UUᵀ`` is still an orthogonal projector and ``‖U‖₂ ≤ 1``, so the clip norms
  and sensitivities are unchanged. ``s`` must be a public number (the noise law of the releases,
  e.g. ``σC/L`` times :func:`dpjax.sgd.filtered_noise_std`'s factor); where the noise is not
  isotropic, pass its largest per-entry std (fewer directions are kept).

  Privacy: a function of released quantities and public numbers only, so it is post-processing
  and costs nothing; pass it nothing computed from per-example or clipped gradients.

  Args:
    released: pytree of released (noisy) updates, shaped like the params.
    rank: r ≥ 1; a leaf with at least two axes, first axis ``a ≥ max(min_dim, rank + 1)`` and
      ``b ≥ min_dim`` (b = product of the other axes) gets an ``(a, r)`` basis; others ``None``.
    min_dim: smallest side of a projected matrix.
    noise_std: None (keep all r columns) or the per-entry noise std s ≥ 0 of ``released``'s
      matrices (float or traced scalar, same units as ``released``).
    edge_scale: multiplies the edge (> 0; PROPOSED 1).
    two_sided: also the right factor ``V (b, min(rank, b))`` (the rank rule zeroes the same
      directions on both sides).

  Returns:
    A pytree of bases for :func:`layer_subspace_noise` / :func:`embedding_residual_noise`
    (orthonormal or, under the rank rule, zero columns; canonical signs).

  Raises:
    ValueError: ``rank < 1``; no leaf qualifies; a concrete ``noise_std < 0``; ``edge_scale ≤ 0``.
  """
  rank = v.check_int(rank, "rank", low=1)
  min_dim = v.check_int(min_dim, "min_dim", low=1)
  edge_scale = v.check_positive(edge_scale, "edge_scale")
  if noise_std is not None and not v.is_traced(noise_std):
    if not float(noise_std) >= 0:
      raise ValueError(f"noise_std must be >= 0, got {noise_std}.")

  def basis(g):
    g = jnp.asarray(g)
    if g.ndim < 2 or g.shape[0] < max(min_dim, rank + 1) or math.prod(g.shape[1:]) < min_dim:
      return None
    G = g.reshape(g.shape[0], -1).astype(jnp.promote_types(g.dtype, jnp.float32))
    k = min(rank, G.shape[1])
    U = linalg.top_k_right_singular_vectors(G.T, k)
    V = linalg.top_k_right_singular_vectors(G, k) if two_sided else None
    if noise_std is not None:
      a, b = G.shape
      singular_values = jnp.linalg.norm(linalg.matmul(G.T, U), axis=0)
      edge = edge_scale * jnp.asarray(noise_std, G.dtype) * (math.sqrt(a) + math.sqrt(b))
      keep = (singular_values > edge).astype(U.dtype)
      U = U * keep
      # Both factors list the singular values in decreasing order: the same kept directions.
      V = None if V is None else V * keep
    return U if V is None else TwoSidedBasis(U, V)

  bases = jax.tree_util.tree_map(basis, released)
  if all(b is None for b in jax.tree_util.tree_leaves(bases, is_leaf=_is_basis)):
    raise ValueError("no leaf of released is a matrix large enough to project.")
  return bases


# ------------------------------------------------------- projection BEFORE clipping (GEP style)


class EmbeddingResidualState(NamedTuple):
  """State of :func:`embedding_residual_noise`: the key (split every update) and the bases."""
  key: jax.Array
  bases: Any


def _split(g, U, embedding_clip, residual_clip):
  """One example's leaf → (embedding/C_e, residual/C_ρ); unprojected leaves have no residual."""
  if U is None:
    return g / embedding_clip, jnp.zeros((0,), g.dtype)
  dtype = jnp.promote_types(g.dtype, jnp.float32)
  G = g.reshape(g.shape[0], -1).astype(dtype)
  e = _embed(G, U)
  return e / embedding_clip, ((G - _lift(e, U)) / residual_clip).reshape(g.shape)


def embedding_residual_grad_sum(loss_fn, *, embedding_clip: float, residual_clip: float,
                                joint: bool = True, clipping: str = "clip",
                                stability: float = per_example.DEFAULT_STABILITY
                                ) -> per_example.ClippedGradSum:
  """``fn(params, batch, mask, bases)``: per-example gradients split by per-layer bases BEFORE
  clipping, into an embedding and a residual, jointly clipped in a weighted norm, then summed.

  For one example with gradient leaves ``G_ℓ (a, b)`` and bases ``U_ℓ (a, r)``: the embedding
  ``e_ℓ = U_ℓᵀ G_ℓ`` (r × b; the whole leaf where the basis is ``None``) and the residual
  ``ρ_ℓ = G_ℓ − U_ℓ e_ℓ``; with a :class:`TwoSidedBasis` ``e_ℓ = U_ℓᵀ G_ℓ V_ℓ`` (r × r') and
  ``ρ_ℓ = G_ℓ − U_ℓ e_ℓ V_ℓᵀ``. The pair is scaled to ``u = (e / C_e, ρ / C_ρ)``; ``joint=True``
  clips ``‖u‖₂ ≤ 1`` (bound Δ = 1), ``joint=False`` clips each part to norm 1 on its own (GEP;
  bound Δ = √2) (``clipping="clip"``, or "normalize"; the edge cases of
  :func:`dpjax.sgd.clip_per_example`: non-finite examples contribute 0), so every term has
  norm ≤ Δ in the scaled units whatever the bases are.

  Privacy: the masked sum of the clipped ``u`` has ℓ2-sensitivity Δ (``fn.l2_norm_bound``)
  under add/remove-one, so :func:`embedding_residual_noise` with ``l2_norm_bound=Δ`` (noise
  ``N(0, σ²Δ²)`` on every coordinate of the scaled sums) is the Gaussian mechanism with noise
  multiplier σ, accounted exactly as DP-SGD. In the original units the embedding gets noise
  ``σΔC_e`` and the residual ``σΔC_ρ`` (Yu et al.'s GEP). The bases must not depend on the
  private data except through DP releases (e.g. :func:`trajectory_bases`).

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar`` for one example.
    embedding_clip, residual_clip: ``C_e > 0`` and ``C_ρ > 0``.
    joint: one clip of the scaled pair (True, Δ = 1) or one per part (False, Δ = √2).
    clipping, stability: as :func:`dpjax.sgd.clipped_grad_sum`.

  Returns:
    A :class:`dpjax.sgd.ClippedGradSum` ``fn(params, batch, mask, bases) -> {"embedding": tree,
    "residual": tree}`` in scaled units, carrying ``l2_norm_bound = Δ``: the embedding tree has
    ``(r, b)`` (two-sided: ``(r, r')``) coefficient leaves where a basis is given and the leaf
    itself elsewhere; the residual tree has the leaf's shape where a basis is
    given and empty ``(0,)`` leaves elsewhere. ``bases`` is an argument (not baked into the
    compiled program), as in :func:`layer_subspace_noise`.

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

  return per_example.ClippedGradSum(fn, 1.0 if joint else math.sqrt(2.0))


def embedding_residual_noise(bases, *, embedding_clip: float, residual_clip: float,
                             noise_multiplier: float, expected_batch_size: float,
                             key: jax.Array,
                             l2_norm_bound: float = 1.0) -> optax.GradientTransformation:
  """Noise for :func:`embedding_residual_grad_sum`'s sums, then back to the params' shape:
  ``g̃_ℓ = (C_e U_ℓ (ē_ℓ + N(0, σ²Δ²)) + C_ρ (ρ̄_ℓ + N(0, σ²Δ²))) / L`` (two-sided bases:
  ``C_e U_ℓ (ē_ℓ + N(0, σ²Δ²)) V_ℓᵀ``).

  ``ē, ρ̄`` are the scaled sums (per-example scaled norm ≤ Δ = the grad sum's
  ``l2_norm_bound``). Privacy: add/remove-one moves the pair of sums by ≤ Δ in ℓ2, and every
  released coordinate gets ``N(0, σ²Δ²)``: the Gaussian mechanism with noise multiplier σ (one DP-SGD step; accounted by
  :func:`dpjax.accounting.dpsgd_event` with the same σ, q, T). Mapping back and dividing by the
  public L are post-processing. A leaf whose basis spans it (``r = a``) has no residual and
  releases none; with identity bases everywhere and ``C_e = C`` the step is
  :func:`dp_gaussian_noise`'s, draw for draw (tested).

  Args:
    bases: pytree like the params, ``None``, an ``(a, r)`` orthonormal basis or a
      :class:`TwoSidedBasis` per leaf (checked at ``init`` by :func:`check_layer_bases`); held
      in the state.
    embedding_clip, residual_clip: ``C_e, C_ρ > 0``, as given to the grad sum.
    noise_multiplier: σ ≥ 0.
    expected_batch_size: L > 0.
    key: PRNG key, kept in the state and split every update.
    l2_norm_bound: Δ, from the grad sum (``fn.l2_norm_bound``: 1 joint, √2 per part).

  Returns:
    An ``optax.GradientTransformation`` mapping ``{"embedding", "residual"}`` sums to a pytree
    like the params (state :class:`EmbeddingResidualState`).

  Raises:
    ValueError / TypeError: as :func:`layer_subspace_noise` and for the clip norms.
  """
  _, sigma, batch = _check_noise(1.0, noise_multiplier, expected_batch_size, key)
  c_e = v.check_positive(embedding_clip, "embedding_clip")
  c_r = v.check_positive(residual_clip, "residual_clip")
  std = transforms.round_up_float32(sigma * v.check_positive(l2_norm_bound, "l2_norm_bound"))

  def init_fn(params):
    return EmbeddingResidualState(key, check_layer_bases(bases, params))

  def update_fn(updates, state, params=None):
    del params
    # One split into named streams (issue 34 §2): the next state's key, the embedding's and the
    # residual's noise. With JAX's partitionable threefry (the default) split(k, 3)[:2] is
    # split(k, 2), so the embedding draws are dp_gaussian_noise's (identity bases: the same).
    next_key, noise_key, residual_key = jax.random.split(state.key, 3)
    emb, treedef = jax.tree_util.tree_flatten(updates["embedding"])
    res = treedef.flatten_up_to(updates["residual"])
    Us = treedef.flatten_up_to(state.bases)
    keys = jax.random.split(noise_key, len(emb))
    residual_keys = jax.random.split(residual_key, len(emb))
    out = []
    for e, r, U, k, k_r in zip(emb, res, Us, keys, residual_keys):
      dtype = jnp.promote_types(e.dtype, jnp.float32)
      noisy_e = e.astype(dtype) + std * jax.random.normal(k, e.shape, dtype)
      if U is None:
        out.append((c_e * noisy_e / batch).astype(e.dtype))
        continue
      back = (c_e * _lift(noisy_e, U)).reshape(r.shape)
      if not _is_full(U):                    # a full basis leaves no residual: nothing to release
        back = back + c_r * (r.astype(dtype) + std * jax.random.normal(k_r, r.shape, dtype))
      out.append((back / batch).astype(r.dtype))
    return jax.tree_util.tree_unflatten(treedef, out), state._replace(key=next_key)

  return optax.GradientTransformation(init_fn, update_fn)
