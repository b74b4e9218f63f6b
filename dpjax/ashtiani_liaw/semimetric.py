"""The affine-invariant semimetric on positive definite matrices and batched closeness tests.

``dist(A, B) = max{‖A^{-1/2} B A^{-1/2} − I‖, ‖B^{-1/2} A B^{-1/2} − I‖}`` ([AL22] Lemma 3.2,
eq. (5.1); docs/algorithms.md §3.1) equals ``max_λ max(|λ − 1|, |1/λ − 1|)`` over the eigenvalues λ
of ``A^{-1}B``, so

    dist(A, B) ≤ r   ⟺   every eigenvalue of A^{-1}B lies in [1/(1+r), 1+r]
                     ⟺   B/(1+r) ⪯ A ⪯ (1+r)B ,

and it is affine invariant: ``dist(TATᵀ, TBTᵀ) = dist(A, B)`` for invertible T. A singular (or
non-finite) argument is at distance +∞ from everything, itself included.

Predicate semantics (what PPME's privacy proof uses). :func:`closeness_matrix` and
:func:`neighbour_counts` decide ``close(i, j)`` from the pair ``(Y_i, Y_j)`` alone, by two Cholesky
factorisations:

    close(i, j)  ⟺  Y_j − Y_i/(1+r) ≻ 0  and  (1+r)·Y_i − Y_j ≻ 0      (all pivots > 0).

Because ``Y_i − Y_j/(1+r) = ((1+r)Y_i − Y_j)/(1+r)``, the two matrices for (j, i) are positive
multiples of those for (i, j): the test is symmetric in exact arithmetic, and the code evaluates
each pair i < j once and uses the answer for both orders. Both conditions imply that Y_i and Y_j
are positive definite, so a singular candidate is close to nothing (itself included); the
diagonal is ``True`` for every positive definite candidate. In exact arithmetic
``close(i, j) ⟺ dist(Y_i, Y_j) < r`` (the boundary has measure zero); in floating point
Cholesky is backward stable, so the predicate is the exact one for inputs perturbed by about
``d·u`` relative to ``‖Y‖`` (u the unit roundoff), i.e. by up to ``κ·d·u`` after whitening an
ill-conditioned candidate; PPME absorbs this by calibrating γ with ``r(1 + radius_margin)``
(default 1e-2, ``populous_mean.DEFAULT_RADIUS_MARGIN``; the spec's 1e-6 is too small). Nothing else
about the candidates enters the predicate, which is what keeps one group's change from moving any
other pair's answer.

All functions are pure and jittable; they compute in the input's dtype (use float64 for
ill-conditioned candidates).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def psd_distance(A: jax.Array, B: jax.Array) -> jax.Array:
  """``dist(A, B)`` of [AL22] eq. (5.1) for symmetric positive definite A, B.

  Args:
    A, B: ``(d, d)`` symmetric float arrays (batch with ``jax.vmap``).

  Returns:
    Scalar in A's dtype: ``max_λ max(|λ − 1|, |1/λ − 1|)`` over the eigenvalues of ``A^{-1}B``;
    ``+inf`` when A or B is not (numerically) positive definite.

  References:
    [AL22] Lemma 3.2; docs/algorithms.md §3.1.
  """
  ev, ok = _whitened_eigenvalues(_inverse_cholesky(A), B)
  ok = ok & _is_positive_definite(A) & _is_positive_definite(B)   # both: dist is symmetric
  lo, hi = ev[0], ev[-1]
  dist = jnp.maximum(hi - 1.0, 1.0 / lo - 1.0)      # ≥ |λ − 1| and |1/λ − 1| for all λ ∈ [lo, hi]
  return jnp.where(ok & (lo > 0), dist, jnp.inf)


def closeness_matrix(Y: jax.Array, radius: float, *, block_size: int | None = None) -> jax.Array:
  """The k×k boolean matrix ``close(i, j) ⟺ dist(Y_i, Y_j) ≤ radius`` (module predicate).

  Pairs are evaluated in tiles, two batched Cholesky success tests per pair (module docstring),
  with the batch axes last so that the factorisations vectorise (no whitening, no eigensolver:
  about ``2d³/3`` flops per pair); memory ``O(block_size² d²)``.

  Args:
    Y: ``(k, d, d)`` symmetric candidates.
    radius: closeness radius ``r ≥ 0`` (Python float).
    block_size: pairs are evaluated in ``block_size × block_size`` tiles (default: 128 for
      d ≤ 12, else 64; measured fastest on CPU).

  Returns:
    ``(k, k)`` bool, symmetric.
  """
  k = Y.shape[0]
  block_size = _default_block(Y, block_size)
  tiles, pad, tile_close = _tile_predicate(Y, radius, block_size)
  close = jax.lax.map(lambda t: tile_close(t)[2], jnp.asarray(tiles))   # (T, B, B), tiles I ≤ J
  rows = (tiles[:, 0, None, None] * block_size + np.arange(block_size)[None, :, None])
  cols = (tiles[:, 1, None, None] * block_size + np.arange(block_size)[None, None, :])
  rows, cols = np.broadcast_to(rows, close.shape), np.broadcast_to(cols, close.shape)
  upper = (rows <= cols) & (cols < k)
  full = jnp.zeros((k + pad, k + pad), bool).at[rows, cols].set(close & upper)
  full = full[:k, :k]
  return full | full.T


def neighbour_counts(Y: jax.Array, radius: float, *, block_size: int | None = None) -> jax.Array:
  """``N_i = |{j : close(i, j)}|`` (j = i included) without materialising the k×k matrix.

  Same predicate as :func:`closeness_matrix`; tiles are scanned and their row and column sums
  accumulated, so memory is ``O(k + block_size² d²)``: this is PPME's ``k²`` step.

  Args:
    Y: ``(k, d, d)`` symmetric candidates.
    radius: closeness radius ``r ≥ 0``.
    block_size: tile size (default as in :func:`closeness_matrix`).

  Returns:
    ``(k,)`` int32 counts.
  """
  k = Y.shape[0]
  block_size = _default_block(Y, block_size)
  tiles, pad, tile_close = _tile_predicate(Y, radius, block_size)
  idx = jnp.arange(block_size)

  def body(counts, tile):
    I, J = tile[0], tile[1]
    sl_i, sl_j, c = tile_close(tile)
    valid = (sl_i[:, None] < k) & (sl_j[None, :] < k)
    # Diagonal tiles: count pairs i < j once in each direction and i = j once.
    c = c & valid & ((I != J) | (idx[:, None] <= idx[None, :]))
    off = c & (sl_i[:, None] != sl_j[None, :])
    counts = counts.at[sl_i].add(jnp.sum(c, axis=1, dtype=jnp.int32))
    counts = counts.at[sl_j].add(jnp.sum(off, axis=0, dtype=jnp.int32))
    return counts, None

  counts, _ = jax.lax.scan(body, jnp.zeros(k + pad, jnp.int32), jnp.asarray(tiles))
  return counts[:k]


def euclidean_neighbour_counts(Y: jax.Array, radius: float, *,
                               block_size: int = 1024) -> jax.Array:
  """``N_i = |{j : ‖Y_i − Y_j‖₂ ≤ radius}|`` (j = i included), in row blocks of the k×k matrix.

  Args:
    Y: ``(k, p)`` candidates (flatten matrices first).
    radius: ``r ≥ 0``.
    block_size: rows per block (capped so that a block holds at most ~2^24 differences).

  Returns:
    ``(k,)`` int32 counts.
  """
  k, p = Y.shape
  # Exact differences, not the Gram expansion ‖a‖² + ‖b‖² − 2a·b: that cancels catastrophically
  # when ‖Y_i‖ ≫ radius (unbounded means), declaring far-apart candidates close. Memory is
  # O(block_size·k·p), so the block is capped at ~2^24 elements (results do not depend on it).
  block_size = max(1, min(int(block_size), k, 2**24 // max(1, k * p)))
  pad = (-k) % block_size
  Yp = _pad(Y, pad)

  def row_block(start):
    rows = jax.lax.dynamic_slice_in_dim(Yp, start, block_size)
    d2 = jnp.sum(jnp.square(rows[:, None, :] - Y[None, :, :]), axis=-1)
    return jnp.sum(d2 <= radius * radius, axis=1, dtype=jnp.int32)

  counts = jax.lax.map(row_block, jnp.arange(0, k + pad, block_size))
  return counts.reshape(-1)[:k]


def _default_block(Y, block_size):
  if block_size is None:
    block_size = 128 if Y.shape[-1] <= 12 else 64
  return min(int(block_size), max(1, Y.shape[0]))


def _tiles(k: int, block_size: int) -> tuple[np.ndarray, int]:
  """Upper-triangular tile pairs ``(I, J), I ≤ J`` and the padding that makes k a multiple."""
  num = -(-k // block_size)
  I, J = np.triu_indices(num)
  return np.stack([I, J], axis=1).astype(np.int32), num * block_size - k


def _pad(a: jax.Array, pad: int) -> jax.Array:
  if pad == 0:
    return a
  if a.ndim == 3:                       # pad matrices with identities, keeping them well-formed
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), (pad,) + a.shape[1:])
    return jnp.concatenate([a, eye])
  return jnp.concatenate([a, jnp.zeros((pad,) + a.shape[1:], a.dtype)])


def _tile_predicate(Y, radius, block_size):
  """Tiles, padding, and ``tile -> (rows, cols, close)``."""
  k = Y.shape[0]
  tiles, pad = _tiles(k, block_size)
  Yp = _pad(Y, pad)
  lo, hi = 1.0 / (1.0 + radius), 1.0 + radius
  index = jnp.arange(k + pad)

  def tile_close(tile):
    i = jax.lax.dynamic_slice_in_dim(index, tile[0] * block_size, block_size)
    j = jax.lax.dynamic_slice_in_dim(index, tile[1] * block_size, block_size)
    return i, j, _block(Yp[i], Yp[j], lo, hi)

  return tiles, pad, tile_close


# Up to this d the Cholesky test is an unrolled vector program with the batch axes last (it
# compiles in O(d²) operations); above it, one batched library Cholesky is faster (measured on
# CPU: at d = 16 equal, at d = 30 1.5× faster, at d ≤ 10 2–3× slower).
_UNROLL_MAX_D = 12


def _block(Y_i, Y_j, lo, hi):
  """``close`` for every (i, j) of a tile: ``Y_j − lo·Y_i ≻ 0`` and ``hi·Y_i − Y_j ≻ 0``.

  Each of the ``B²`` matrices is factorised on its own, so a pair's answer depends on
  ``(Y_i, Y_j)`` alone, never on the tile it is in.
  """
  if Y_i.shape[-1] <= _UNROLL_MAX_D:
    Yi = jnp.transpose(Y_i, (1, 2, 0))[:, :, :, None]          # (d, d, B, 1): batch axes last
    Yj = jnp.transpose(Y_j, (1, 2, 0))[:, :, None, :]          # (d, d, 1, B)
    return (_unrolled_cholesky_succeeds(Yj - lo * Yi)
            & _unrolled_cholesky_succeeds(hi * Yi - Yj))
  Yi, Yj = Y_i[:, None], Y_j[None, :]                            # (B, 1, d, d), (1, B, d, d)
  return _cholesky_succeeds(Yj - lo * Yi) & _cholesky_succeeds(hi * Yi - Yj)


def _cholesky_succeeds(A: jax.Array) -> jax.Array:
  """Whether each matrix of a batch ``(..., d, d)`` is (numerically) positive definite.

  Reads the lower triangle only. Success ⟺ every pivot of the unpivoted Cholesky factorisation
  is finite and > 0 (NaN or inf input fails); each matrix is factorised on its own.

  * ``d > 12``: one batched library Cholesky (LAPACK ``potrf`` per matrix on the CPU); a failed
    factorisation comes back as NaNs, so success ⟺ the factor's diagonal is finite and > 0.
  * ``d ≤ 12``: :func:`_unrolled_cholesky_succeeds` on the batch moved last.
  """
  d = A.shape[-1]
  if d <= _UNROLL_MAX_D:
    return _unrolled_cholesky_succeeds(jnp.moveaxis(A, (-2, -1), (0, 1)))
  L = jax.lax.linalg.cholesky(A, symmetrize_input=False)
  diag = jnp.diagonal(L, axis1=-2, axis2=-1)
  return jnp.all(jnp.isfinite(diag) & (diag > 0), axis=-1)


def _unrolled_cholesky_succeeds(A: jax.Array) -> jax.Array:
  """:func:`_cholesky_succeeds` for a batch ``(d, d, ...)`` with the batch axes last.

  An unblocked Cholesky on the lower triangle written with batch-wide vector operations (the
  loops over the d columns are unrolled at trace time and the batch axes are last, so every
  update is a contiguous SIMD operation): thousands of small factorisations run 2–3× faster than
  one LAPACK call each.
  """
  d = A.shape[0]
  cols = []                                   # cols[j]: rows j..d−1 of column j of L
  ok = jnp.ones(A.shape[2:], bool)
  for j in range(d):
    c = A[j:, j]
    for col in cols:
      tail = col[col.shape[0] - (d - j):]
      c = c - tail * tail[0:1]
    pivot = c[0]
    ok = ok & (pivot > 0) & (pivot < jnp.inf)
    cols.append(c / jnp.sqrt(jnp.where(pivot > 0, pivot, 1.0)))
  return ok


def _is_positive_definite(A: jax.Array) -> jax.Array:
  L = jnp.linalg.cholesky((A + A.T) / 2)
  return jnp.all(jnp.isfinite(L)) & jnp.all(jnp.diagonal(L) > 0)


def _inverse_cholesky(A: jax.Array) -> jax.Array:
  """``L^{-1}`` for ``A = L Lᵀ`` (identity-safe: a failed factorisation gives NaNs, caught later)."""
  L = jnp.linalg.cholesky((A + A.T) / 2)
  eye = jnp.eye(A.shape[-1], dtype=A.dtype)
  return jax.scipy.linalg.solve_triangular(L, eye, lower=True)


def _whitened_eigenvalues(Linv: jax.Array, B: jax.Array):
  M = Linv @ B @ Linv.T
  ev = jnp.linalg.eigvalsh((M + M.T) / 2)
  return ev, jnp.all(jnp.isfinite(ev))
