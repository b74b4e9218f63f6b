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

__all__ = ["closeness_matrix", "neighbour_counts", "psd_distance"]


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


def closeness_matrix(Y: jax.Array, radius: float, *, chunk_size: int | None = None) -> jax.Array:
  """The k×k boolean matrix ``close(i, j) ⟺ dist(Y_i, Y_j) ≤ radius`` (module predicate).

  Each pair ``i ≤ j`` is evaluated once (:func:`_scan_pairs`): the first Cholesky test on every
  pair, the second only on the pairs that passed the first (a failed test decides the pair), in
  batched factorisations of ``chunk_size`` pairs; about ``2d³/3`` flops per factorisation, no
  whitening and no eigensolver. Memory ``O(k² + chunk_size·d²)``.

  Args:
    Y: ``(k, d, d)`` symmetric candidates.
    radius: closeness radius ``r ≥ 0``.
    chunk_size: pairs per batched factorisation (default :func:`_default_chunk`); the answer does
      not depend on it.

  Returns:
    ``(k, k)`` bool, symmetric.
  """
  k = Y.shape[0]

  def scatter(close, a, b, ok):
    return close.at[a, b].set(ok, mode="drop").at[b, a].set(ok, mode="drop")

  return _scan_pairs(Y, radius, chunk_size, jnp.zeros((k, k), bool), scatter)


def neighbour_counts(Y: jax.Array, radius: float, *, chunk_size: int | None = None) -> jax.Array:
  """``N_i = |{j : close(i, j)}|`` (j = i included) without materialising the k×k matrix.

  Same predicate and pair schedule as :func:`closeness_matrix`; each pair's answer is added to
  both counts, so memory is ``O(k + chunk_size·d²)``: this is PPME's ``k²`` step.

  Args:
    Y: ``(k, d, d)`` symmetric candidates.
    radius: closeness radius ``r ≥ 0``.
    chunk_size: pairs per batched factorisation (default as in :func:`closeness_matrix`).

  Returns:
    ``(k,)`` int32 counts.
  """
  k = Y.shape[0]

  def count(counts, a, b, ok):
    counts = counts.at[a].add(ok.astype(jnp.int32), mode="drop")
    return counts.at[b].add((ok & (a != b)).astype(jnp.int32), mode="drop")

  return _scan_pairs(Y, radius, chunk_size, jnp.zeros(k, jnp.int32), count)


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
  Yp = jnp.concatenate([Y, jnp.zeros((pad, p), Y.dtype)])

  def row_block(start):
    rows = jax.lax.dynamic_slice_in_dim(Yp, start, block_size)
    d2 = jnp.sum(jnp.square(rows[:, None, :] - Y[None, :, :]), axis=-1)
    return jnp.sum(d2 <= radius * radius, axis=1, dtype=jnp.int32)

  counts = jax.lax.map(row_block, jnp.arange(0, k + pad, block_size))
  return counts.reshape(-1)[:k]


def _default_chunk(d: int) -> int:
  """Pairs per batched factorisation: 4096 for the unrolled kernel (d ≤ 12, vector width), else
  256 (one LAPACK call per matrix; the chunk only bounds the memory of the differences)."""
  return 4096 if d <= _UNROLL_MAX_D else 256


# Pairs handled per step of the outer scan (a multiple of the chunk): bounds the index arrays.
_CHUNKS_PER_STEP = 64


def _scan_pairs(Y, radius, chunk_size, init, accumulate):
  """Evaluates ``close(a, b)`` for every pair ``a ≤ b`` once and folds the answers into ``init``.

  The ``P = k(k+1)/2`` pairs are numbered in lower-triangular order (pair ``p`` is
  ``(a, b) = (p − b(b+1)/2, b)``) and scanned in steps of ``S`` pairs. Within a step, the first
  test ``Y_b − lo·Y_a ≻ 0`` runs on every pair in chunks; the pairs that passed are compacted
  to the front and the second test ``hi·Y_a − Y_b ≻ 0`` runs on them only, chunk by chunk, in a
  ``while_loop`` (the short-circuit: a pair that failed the first test is decided). Each matrix
  is factorised on its own (``tests/test_batching.py``), so a pair's answer depends on
  ``(Y_a, Y_b)`` alone, never on the chunk it lands in; only the run time depends on the data.

  Args:
    accumulate: ``(carry, a (S,), b (S,), ok (S,) bool) -> carry``; padding pairs come with the
      out-of-range index ``a = b = k`` and ``ok = False`` (scatter with ``mode="drop"``).
  """
  k, d = Y.shape[0], Y.shape[-1]
  if k >= 2**16:
    raise ValueError(f"at most 65535 candidates (int32 pair indices), got k={k}.")
  num_pairs = k * (k + 1) // 2
  chunk = max(1, min(int(chunk_size or _default_chunk(d)), num_pairs))
  chunks = -(-num_pairs // chunk)
  step = chunk * min(chunks, _CHUNKS_PER_STEP)
  steps = -(-num_pairs // step)
  offsets = jnp.asarray(np.arange(k) * (np.arange(k) + 1) // 2, jnp.int32)
  lo, hi = 1.0 / (1.0 + radius), 1.0 + radius

  def first_test(ab):
    return _cholesky_succeeds(Y[ab[1]] - lo * Y[ab[0]])

  def second_test(ab):
    return _cholesky_succeeds(hi * Y[ab[0]] - Y[ab[1]])

  def body(carry, s):
    p = s * step + jnp.arange(step, dtype=jnp.int32)
    valid = p < num_pairs
    b = jnp.searchsorted(offsets, jnp.where(valid, p, 0), side="right").astype(jnp.int32) - 1
    a = jnp.where(valid, p - offsets[b], 0)
    ab = jnp.stack([a, b]).reshape(2, -1, chunk).transpose(1, 0, 2)       # (step/chunk, 2, C)
    if d <= _UNROLL_MAX_D:              # vector kernel: a skipped test would save no time
      ok = jax.lax.map(lambda x: first_test(x) & second_test(x), ab).reshape(step) & valid
      return accumulate(carry, jnp.where(valid, a, k), jnp.where(valid, b, k), ok), None
    passed = jax.lax.map(first_test, ab).reshape(step) & valid
    survivors = jnp.sum(passed, dtype=jnp.int32)
    order = jnp.nonzero(passed, size=step, fill_value=0)[0].astype(jnp.int32)

    def more(state):
      return state[0] * chunk < survivors

    def second(state):
      c, out = state
      idx = jax.lax.dynamic_slice_in_dim(order, c * chunk, chunk)
      return c + 1, jax.lax.dynamic_update_slice_in_dim(
          out, second_test(jnp.stack([a[idx], b[idx]])), c * chunk, 0)

    _, both = jax.lax.while_loop(more, second, (jnp.int32(0), jnp.zeros(step, bool)))
    target = jnp.where(jnp.arange(step) < survivors, order, step)
    ok = jnp.zeros(step, bool).at[target].set(both, mode="drop")
    a, b = jnp.where(valid, a, k), jnp.where(valid, b, k)
    return accumulate(carry, a, b, ok), None

  return jax.lax.scan(body, init, jnp.arange(steps, dtype=jnp.int32))[0]


# Up to this d the Cholesky test is an unrolled vector program with the batch axes last (it
# compiles in O(d²) operations); above it, one batched library Cholesky is faster (measured on
# CPU: at d = 16 equal, at d = 30 1.5× faster, at d ≤ 10 2–3× slower).
_UNROLL_MAX_D = 12


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
