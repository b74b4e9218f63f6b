"""Subspace bases for DP-SGD's noise: their checks, their norm bounds, and the free trajectory
source (docs/algorithms.md §6.2, §6.4).

Two kinds, one meaning each:

* a flat ``basis`` ``V (p, k)`` of the flattened parameters (orthonormal columns): the noise
  lives in ``span(V)`` (PDP-SGD; :func:`check_basis`);
* per-layer ``bases``: a pytree like the params with ``None`` (full noise), an ``(a, r)`` basis
  of a weight leaf's first, input-side axis, or a :class:`TwoSidedBasis` ``(U (a, r), V (b, r'))``
  per leaf (:func:`check_layer_bases`). A dense layer's per-example gradient is rank one,
  ``x δᵀ`` for a kernel ``(in, out)`` applied as ``x @ W``: its column space lies in the span of
  the layer's inputs, so a basis per weight matrix keeps that structure.

Privacy does not rest on orthonormality (a usability check): the noise transform
(:func:`dpjax.sgd.dp_noise`) scales its noise by ``ν = max(1, ν̂)`` with ν̂ a float64 upper
bound on the release map's spectral norm (:func:`basis_norm_bound`, :func:`bases_norm_bound`),
so any accepted basis keeps the guarantee. A basis must be public, a DP release whose cost is
composed in, or a function of this run's releases (:func:`trajectory_bases`: post-processing).

References:
  Zhou, Wu & Banerjee, PDP-SGD, ICLR 2021; Yu et al., RGP, ICML 2021; Yu et al., GEP, ICLR 2021.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import _validation as v
from dpjax import linalg

__all__ = ["TwoSidedBasis", "basis_norm_bound", "bases_like", "bases_norm_bound", "check_basis",
           "check_layer_bases", "trajectory_bases"]


class TwoSidedBasis(NamedTuple):
  """Left and right factors of one weight leaf's subspace, the leaf read as a matrix ``(a, b)``
  (first axis by the rest): coefficients ``Uᵀ G V`` ``(r, r')``, lifted back as ``U c Vᵀ``.

  Attributes:
    left: ``U (a, r)``, orthonormal (or zero, under a rank rule) columns: the input side.
    right: ``V (b, r')``, likewise: the output side.
  """
  left: Any
  right: Any


def is_basis(x):
  """A leaf of a bases pytree: None, or a TwoSidedBasis taken whole (not as two leaves)."""
  return x is None or isinstance(x, TwoSidedBasis)


def embed(G, basis):
  """``Uᵀ G`` (one-sided) or ``Uᵀ G V`` (two-sided) of a matrix G, in G's dtype."""
  if isinstance(basis, TwoSidedBasis):
    return linalg.matmul(linalg.matmul(basis.left.astype(G.dtype).T, G),
                         basis.right.astype(G.dtype))
  return linalg.matmul(basis.astype(G.dtype).T, G)


def lift(c, basis):
  """``U c`` (one-sided) or ``U c Vᵀ`` (two-sided): coefficients back to the matrix."""
  if isinstance(basis, TwoSidedBasis):
    return linalg.matmul(linalg.matmul(basis.left.astype(c.dtype), c),
                         basis.right.astype(c.dtype).T)
  return linalg.matmul(basis.astype(c.dtype), c)


def leaf_bound(basis) -> float:
  """An upper bound on the spectral norm of ``G ↦ Uᵀ G [V]`` (Frobenius to Frobenius):
  ``‖U‖₂`` or ``‖U‖₂‖V‖₂`` (``‖UᵀGV‖_F ≤ ‖U‖₂‖G‖_F‖V‖₂``)."""
  if isinstance(basis, TwoSidedBasis):
    return basis_norm_bound(basis.left) * basis_norm_bound(basis.right)
  return basis_norm_bound(basis)


def is_full(basis) -> bool:
  """Whether the basis spans its whole leaf (square factors: no residual)."""
  sides = basis if isinstance(basis, TwoSidedBasis) else (basis,)
  return all(b.shape[1] >= b.shape[0] for b in sides)


def check_basis(basis, name: str = "basis", *, tol: float = 1e-3,
                partial: bool = False) -> jax.Array:
  """Validates a ``(p, k)`` basis with orthonormal columns on the host; returns it as an array.

  The orthonormality check is spectral, ``‖VᵀV − I‖₂ ≤ tol`` (float64), and serves usability
  only; :func:`dpjax.sgd.dp_noise` keeps privacy for any accepted V by scaling its noise with
  :func:`basis_norm_bound`. With ``partial=True`` a partial isometry is accepted too (columns
  orthonormal or zero, as :func:`dpjax.sgd.trajectory_bases` returns under its rank rule): every
  eigenvalue of ``VᵀV`` within ``tol`` of 0 or 1, so ``VVᵀ`` is (up to ``tol``) an orthogonal
  projector and ``‖V‖₂ ≤ 1 + tol``.

  Raises:
    ValueError: not 2-D, ``k ∉ [1, p]``, non-finite entries, or ``‖VᵀV − I‖₂ > tol`` (with
      ``partial``: an eigenvalue of ``VᵀV`` farther than ``tol`` from both 0 and 1).
    TypeError: not a float array.
  """
  try:
    basis = jnp.asarray(basis)
  except TypeError as exc:
    raise TypeError(f"{name} must be a (p, k) float array, got {type(basis).__name__}.") from exc
  if basis.ndim != 2 or basis.shape[1] == 0 or basis.shape[1] > basis.shape[0]:
    raise ValueError(f"{name} must have shape (p, k) with 1 <= k <= p, got "
                     f"{tuple(basis.shape)}.")
  if not jnp.issubdtype(basis.dtype, jnp.floating):
    raise TypeError(f"{name} must be a float array, got dtype={basis.dtype}.")
  tol = v.check_positive(tol, "tol")
  b = np.asarray(basis, np.float64)
  if not np.all(np.isfinite(b)):
    raise ValueError(f"{name} contains NaN or infinite entries.")
  eigenvalues = np.linalg.eigvalsh(_gram(b))
  if partial:
    err = float(np.max(np.minimum(np.abs(eigenvalues), np.abs(eigenvalues - 1.0))))
    if err > tol:
      raise ValueError(f"{name} must have orthonormal or zero columns (every eigenvalue of VᵀV "
                       f"within {tol} of 0 or 1), got one {err:.3g} away.")
    return basis
  err = float(np.max(np.abs(eigenvalues - 1.0)))
  if err > tol:
    raise ValueError(f"{name} must have orthonormal columns (‖VᵀV − I‖₂ <= {tol}), got "
                     f"‖VᵀV − I‖₂ = {err:.3g}.")
  return basis


def _gram(b: np.ndarray) -> np.ndarray:
  gram = b.T @ b
  return 0.5 * (gram + gram.T)


def basis_norm_bound(basis) -> float:
  """An upper bound on the spectral norm ``‖V‖₂`` of a ``(p, k)`` basis (host, float64).

  ``λ_max(VᵀV)`` in float64, plus margins for the rounding of the Gram product
  (``(p + 10k)·2^-53·tr(VᵀV)``, which bounds ``‖ΔG‖₂ ≤ ‖ΔG‖_F`` and the eigensolver's error), then
  a factor ``1 + 2^-24·√k`` that covers casting V to float32 (each entry moves by ≤ 2^-24
  relative, so ``‖ΔV‖₂ ≤ 2^-24‖V‖_F ≤ 2^-24√k‖V‖₂``). :func:`dpjax.sgd.dp_noise` scales its
  noise by ``max(1, bound)``, so ``‖Vᵀx‖ ≤ bound·‖x‖`` is what its privacy rests on.

  Args:
    basis: ``(p, k)`` real array.

  Returns:
    The bound as a Python float (about 1 for an orthonormal basis).
  """
  b = np.asarray(basis, np.float64)
  p, k = b.shape
  gram = _gram(b)
  top = float(np.linalg.eigvalsh(gram)[-1])
  top += (p + 10 * k) * 2.0**-53 * float(np.trace(gram))
  return math.sqrt(max(top, 0.0)) * (1.0 + 2.0**-24 * math.sqrt(k))


def check_layer_bases(bases, params, *, tol: float = 1e-3):
  """Validates a pytree of per-layer bases against ``params`` (host side).

  ``bases`` has the structure of ``params`` with ``None`` where a leaf is not projected; a
  projected leaf of shape ``(a, ...)`` needs an ``(a, r)`` basis, or a :class:`TwoSidedBasis`
  of an ``(a, r)`` left and a ``(b, r')`` right factor (b = the product of the other axes),
  each with orthonormal or zero columns (:func:`check_basis` with
  ``partial=True``, spectral tolerance ``tol``; a zero column is a direction left out, as
  :func:`trajectory_bases`' rank rule does).

  Returns:
    The bases with arrays as ``jax.Array``.

  Raises:
    ValueError: another tree structure, no projected leaf, a basis whose row count is not the
      leaf's first axis, a leaf with fewer than two axes given a basis, or as ``check_basis``.
    TypeError: as ``check_basis``.
  """
  # Read up to the params' structure: a None in the params (an Equinox model's non-array
  # fields after eqx.partition) is an empty subtree there and must be None in the bases too.
  treedef = jax.tree_util.tree_structure(params)
  try:
    leaves = treedef.flatten_up_to(bases)
  except (ValueError, TypeError) as e:
    raise ValueError("bases must have the structure of the params, with None for the leaves "
                     "that are not projected.") from e
  if not all(is_basis(b) or hasattr(b, "shape") or isinstance(b, (list, np.ndarray))
             for b in leaves):
    raise ValueError("bases must have the structure of the params, with None for the leaves "
                     "that are not projected.")
  if all(b is None for b in leaves):
    raise ValueError("bases has no projected leaf; pass no bases for full noise. (A select "
                     "that tests w.shape[0] against the input size matches no (out, in) kernel: "
                     "Equinox and PyTorch-style layers store (out, in); use "
                     "bases_like(params, select, layout='out_in') with w.shape[-1].)")

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

  return treedef.unflatten([check(b, leaf) for b, leaf in
                            zip(leaves, treedef.flatten_up_to(params))])


def _check_side(basis, shape, rows, side, tol):
  basis = check_basis(basis, f"{side} basis".strip(), tol=tol, partial=True)
  if basis.shape[0] != rows:
    what = ("the product of the leaf's other axes" if side == "right"
            else "the leaf's first, input-side axis")
    hint = ""
    if not side and len(shape) == 2 and basis.shape[0] == shape[1]:
      hint = (f" This leaf looks like an (out, in) kernel (Equinox, PyTorch-style): project its "
              f"input side with TwoSidedBasis(jnp.eye({shape[0]}), U), or build the bases with "
              "bases_like(params, select, layout='out_in'), which does that.")
    raise ValueError(f"a {side + ' ' if side else ''}basis for a leaf of shape {shape} must "
                     f"have {rows} rows ({what}), got {tuple(basis.shape)}.{hint}")
  return basis


def bases_norm_bound(bases) -> float:
  """``max(1, max_ℓ ν̂_ℓ)``: a bound on the spectral norm of the per-layer release map, which is
  block diagonal (identity blocks for leaves without a basis count 1; a two-sided block
  ``ν̂(U_ℓ)·ν̂(V_ℓ)``; host, float64)."""
  bounds = [leaf_bound(b) for b in jax.tree_util.tree_leaves(bases, is_leaf=is_basis)
            if b is not None]
  return max([1.0] + bounds)


def bases_like(params, select, *, layout: str = "in_out") -> Any:
  """A per-layer bases pytree: ``select(path, leaf)`` for every leaf of ``params`` (a basis, a
  :class:`TwoSidedBasis` or None), e.g. the first kernel's input basis::

      bases = bases_like(params, lambda path, w: U if "Dense_0" in jax.tree_util.keystr(path)
                         and w.ndim == 2 else None)

  Kernels stored ``(out, in)`` (Equinox's ``eqx.nn.Linear``, PyTorch-style)::

      bases = bases_like(model_params, lambda _, w: U if w.ndim == 2 and w.shape[-1] == 784
                         else None, layout="out_in")

  ``layout="out_in"`` turns each plain basis ``U (in, k)`` that ``select`` returns for a 2-D
  leaf into ``TwoSidedBasis(I_out, U)``: the noise then lives in ``out × k`` coefficients of the
  leaf's input side, as ``U`` does on an ``(in, out)`` kernel (docs/algorithms.md §6.0).

  Works on any params pytree (dicts, Flax NNX ``nnx.State``, Linen, Equinox arrays); no other
  check here: the noise checks the result against the params (:func:`check_layer_bases`).

  Raises:
    TypeError: ``select`` not callable.
    ValueError: an unknown ``layout``; with ``"out_in"``, a plain basis for a leaf that is not
      2-D.
  """
  if not callable(select):
    raise TypeError(f"select must be callable (path, leaf) -> basis or None, got "
                    f"{type(select).__name__}.")
  if layout not in ("in_out", "out_in"):
    raise ValueError(f"layout must be 'in_out' (Flax, dpjax.sgd.dense) or 'out_in' (Equinox, "
                     f"PyTorch-style), got {layout!r}.")

  def pick(path, leaf):
    basis = select(path, leaf)
    if layout == "in_out" or basis is None or isinstance(basis, TwoSidedBasis):
      return basis
    if jnp.ndim(leaf) != 2:
      raise ValueError(f"layout='out_in' projects the input (last) axis of 2-D kernels; "
                       f"{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}.")
    return TwoSidedBasis(jnp.eye(jnp.shape(leaf)[0], dtype=jnp.float32), basis)

  return jax.tree_util.tree_map_with_path(pick, params)


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
  e.g. ``σC/L`` times :func:`dpjax.sgd.denoise.filtered_noise_std`'s factor); where the noise is not
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
    A pytree of bases for :func:`dpjax.sgd.dp_noise` (and GEP's :func:`dpjax.sgd.embedding_residual_grad_sum`)
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
  if all(b is None for b in jax.tree_util.tree_leaves(bases, is_leaf=is_basis)):
    raise ValueError("no leaf of released is a matrix large enough to project.")
  return bases
