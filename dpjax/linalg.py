"""Batched linear algebra for subspace learning: top-k subspaces, projections, principal angles.

Everything here is non-private post-processing or a building block of a private mechanism; no
function in this module releases anything by itself. All functions are pure, jittable and work in
the input's dtype (float32 by default, float64 when the user enables x64).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

__all__ = ["batched_top_k_subspaces", "map_blocks", "matmul", "orthonormal_basis",
           "principal_angles", "project_points", "top_k_right_singular_vectors"]

TOP_K_METHODS = ("exact", "subspace_iteration")
# PROPOSED defaults of the subspace iteration (overridable).
DEFAULT_OVERSAMPLING = 8
DEFAULT_MAX_ITERATIONS = 100
DEFAULT_TOL = 1e-6
# float32 products on GPUs/TPUs default to TF32/bfloat16 passes (relative error ~1e-3): that
# would set the subspaces' rounding floor there, and would loosen every bound a privacy argument
# reads off a product (a clipped sum's norm, a projection's). dpjax's own products ask for full
# precision; a user's model keeps the precision its author chose.
HIGHEST = jax.lax.Precision.HIGHEST


def matmul(a, b):
  """``a @ b`` at full precision on every backend (no TF32/bfloat16 passes on GPUs/TPUs)."""
  return jnp.matmul(a, b, precision=HIGHEST)


def subspace_iteration_tolerance(tol: float, d: int, k: int, dtype) -> float:
  """The stopping tolerance the subspace iteration uses: ``max(tol, eps·√(d k))``.

  ``‖W_k − V_k V_kᵀ W_k‖_F`` cannot fall much below the rounding error of a ``(d, k)`` basis,
  about ``eps·√(d k)`` (measured floors in float32 at d = 1000, k = 5: 0.6e-6 with XLA's matmul,
  1.3–1.9e-6 with OpenBLAS through NumPy, against ``eps·√(d k)`` = 8.4e-6), so a tolerance below
  it would spin to ``max_iterations`` depending on the BLAS. In float64 the floor is ~1e-13 and
  ``tol`` decides.
  """
  return max(float(tol), float(jnp.finfo(dtype).eps) * math.sqrt(d * k))


@functools.partial(jax.jit, static_argnames=("k", "method", "oversampling", "max_iterations"))
def top_k_right_singular_vectors(X: jax.Array, k: int, *, method: str = "exact",
                                 oversampling: int = DEFAULT_OVERSAMPLING,
                                 max_iterations: int = DEFAULT_MAX_ITERATIONS,
                                 tol: float = DEFAULT_TOL) -> jax.Array:
  """Top-k right singular vectors of one block, i.e. the top-k eigenvectors of ``XᵀX``.

  Uses the Gram trick when the block has fewer rows than columns: the eigenvectors ``U`` of the
  ``(m, m)`` Gram matrix ``X Xᵀ`` give ``V = Xᵀ U Λ^{-1/2}``, so the cost is ``O(m² d)`` instead
  of ``O(d³)``. Otherwise it takes ``eigh`` of the ``(d, d)`` matrix ``XᵀX``. Zero rows (used as
  padding) do not change the result.

  Scale safety: the block is first divided by the power of two ``2^e`` with ``max |X_ij| = f·2^e``,
  ``f ∈ [1/2, 1)`` (exact, and the subspace does not change when the whole block is scaled), so
  its largest entry lies in ``[1/2, 1)`` and neither the Gram matrix nor the norms can overflow
  or underflow, whatever the scale of ``X`` (e.g. float32 rows of size 1e±25). ``X·2^j`` gives
  bit-identical output to ``X``. The power of two depends on this block alone: under ``vmap``
  each block is scaled by its own.

  Edge cases: an all-zero block (or one whose entries are all subnormal, which XLA on CPU flushes
  to zero) gives a fixed canonical orthonormal basis, never NaN.

  ``method="subspace_iteration"``: blocked (orthogonal) subspace iteration on the implicit
  operator ``V ↦ Xᵀ(X V)`` with ``r = min(k + oversampling, d)`` columns, QR each iteration,
  from a fixed public start (a Gaussian matrix from ``jax.random.key(0)``: it depends on neither
  the data nor other blocks), until the leading k columns move less than ``tol`` in Frobenius
  norm (``‖W_k − V_k V_kᵀ W_k‖_F``, which bounds the sines of the principal angles between
  successive iterates; ``tol`` is raised to the dtype's rounding floor, see
  :func:`subspace_iteration_tolerance`) or after ``max_iterations``; then a Rayleigh–Ritz step
  (SVD of the ``(m, r)`` matrix ``X V``) orders the vectors. Each iteration costs ``4·m·d·r``
  flops instead of forming and fully decomposing a ``min(m, d)``-sized matrix (all products at
  full float32 precision, also on GPUs/TPUs); the error after t iterations decays
  like ``(σ_{r+1}/σ_k)^{2t}`` (Golub & Van Loan, §8.2.4; Halko, Martinsson & Tropp, SIAM Review
  2011, Alg. 4.4). The output is still a function of ``X`` alone (under ``vmap`` a converged
  block keeps its value while others iterate).

  Args:
    X: ``(m, d)`` float array; rows are individuals.
    k: number of singular vectors, ``1 <= k <= min(m, d)`` (static).
    method: "exact" (eigh, above) or "subspace_iteration" (static).
    oversampling, max_iterations, tol: the iteration's parameters (PROPOSED 8, 100, 1e-6).

  Returns:
    ``(d, k)`` array with orthonormal columns, ordered by decreasing singular value, each
    column's sign fixed by :func:`canonical_signs` (so both methods agree vector by vector
    where the singular values are distinct, not only in span). If ``X`` has
    rank ``r < k``, the trailing ``k - r`` columns are completed to an orthonormal set by QR (they
    carry no information about ``X``).
  """
  if method not in TOP_K_METHODS:
    raise ValueError(f"method must be one of {TOP_K_METHODS}, got {method!r}.")
  m, d = X.shape
  X = _normalise_scale(X)
  if method == "subspace_iteration":
    V = _subspace_iteration(X, k, oversampling, max_iterations, tol)
  elif m < d:
    gram = matmul(X, X.T)
    evals, evecs = jnp.linalg.eigh(gram)
    top = evecs[:, ::-1][:, :k]                       # (m, k)
    V = matmul(X.T, top)                              # (d, k), column norms = singular values
    norms = jnp.linalg.norm(V, axis=0, keepdims=True)
    tiny = jnp.finfo(X.dtype).tiny ** 0.5
    V = V / jnp.maximum(norms, tiny)
  else:
    evals, evecs = jnp.linalg.eigh(matmul(X.T, X))
    V = evecs[:, ::-1][:, :k]
  # Re-orthonormalise: the Gram route squares the condition number, and degenerate blocks give
  # zero columns. QR keeps the span of the informative columns.
  Q, _ = jnp.linalg.qr(V)
  return canonical_signs(Q)


def canonical_signs(V: jax.Array) -> jax.Array:
  """``V (..., d, k)`` with each column's sign flipped so that its largest-magnitude entry is
  positive (the first such entry on ties; as scikit-learn's ``svd_flip``): eigensolvers and SVDs
  return each singular vector up to a sign that depends on the solver, so this makes the output
  the same whichever solver or backend computed it. Negation is exact, so a projection
  ``V Vᵀ`` is unchanged bit for bit. Traceable."""
  top = jnp.argmax(jnp.abs(V), axis=-2, keepdims=True)
  signs = jnp.where(jnp.take_along_axis(V, top, axis=-2) < 0, -1, 1).astype(V.dtype)
  return V * signs


def _subspace_iteration(X, k, oversampling, max_iterations, tol):
  """``(d, k)`` approximate top-k right singular vectors (see the caller's docstring)."""
  m, d = X.shape
  r = min(k + oversampling, d)
  V0, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(0), (d, r), X.dtype))
  tol = jnp.maximum(tol, subspace_iteration_tolerance(0.0, d, k, X.dtype))  # tol may be traced

  def body(state):
    i, V, _ = state
    W, _ = jnp.linalg.qr(matmul(X.T, matmul(X, V)))
    Vk, Wk = V[:, :k], W[:, :k]
    moved = jnp.linalg.norm(Wk - matmul(Vk, matmul(Vk.T, Wk)))
    return i + 1, W, moved

  def cond(state):
    i, _, moved = state
    return (i < max_iterations) & ~(moved <= tol)      # NaN keeps iterating up to the cap

  # An exact 0 typed like X (an empty sum, whatever X holds): under shard_map X differs per
  # device and so does the carry after one step, so the public start must be typed that way too.
  zero = jnp.sum(X[:0])
  start = (jnp.int32(0), V0 + zero, jnp.asarray(jnp.inf, X.dtype) + zero)
  _, V, _ = jax.lax.while_loop(cond, body, start)
  _, _, Rt = jnp.linalg.svd(matmul(X, V), full_matrices=False)    # Rayleigh–Ritz
  return matmul(V, Rt[:k].T)


def _normalise_scale(X: jax.Array) -> jax.Array:
  """``X / 2^e`` with ``max |X_ij| = f·2^e``, ``f ∈ [1/2, 1)``: exact, so the largest entry lands in
  ``[1/2, 1)``. A zero block is returned unchanged (``frexp(0)`` gives ``e = 0``)."""
  _, e = jnp.frexp(jnp.max(jnp.abs(X)))
  return times_power_of_two(X, -e)


def times_power_of_two(x: jax.Array, n: jax.Array) -> jax.Array:
  """``x · 2^n`` for an integer ``n`` (broadcast), exact unless the result under- or overflows.

  The factor is applied as two halves ``2^⌊n/2⌋ · 2^{n − ⌊n/2⌋}`` of the same sign, so a shift
  by up to twice the exponent range needs no intermediate subnormal or infinite factor (XLA on
  CPU flushes subnormals to zero). A result beyond the dtype's range becomes ``±inf`` or 0.
  """
  n = jnp.asarray(n, jnp.int32)
  half = n // 2
  one = jnp.ones((), x.dtype)
  return x * jnp.ldexp(one, half) * jnp.ldexp(one, n - half)


# Batching policy (issue 11 §4). A private mechanism that decomposes one block per group (DPASE's
# subsets, Ashtiani–Liaw's groups, PPME's candidates) needs block i's output to depend on block i
# alone, bit for bit: otherwise one individual's row could move another group's output at
# rounding level. ``tests/test_batching.py`` checks, for every batched decomposition the library
# uses, that changing one block leaves every other block's output bitwise unchanged. It passes on
# the CPU (XLA runs one LAPACK call per matrix), so there blocks are batched with ``vmap``;
# on the backends it has not been run on, :func:`map_blocks` keeps one call per block
# (``lax.map``), since batched GPU/TPU solvers (e.g. Jacobi eigensolvers) may iterate until every
# batch member converges.
VERIFIED_BATCHING_BACKENDS = ("cpu",)


def map_blocks(fn, blocks, *, batch_size: int | None = None):
  """``fn`` over the leading axis of ``blocks``: ``vmap`` where block independence is verified
  (:data:`VERIFIED_BATCHING_BACKENDS`), else ``lax.map`` (one call per block).

  Args:
    fn: ``block -> pytree`` (traceable).
    blocks: pytree of arrays with a shared leading axis.
    batch_size: on a verified backend, ``vmap`` over chunks of this many blocks at a time
      (``lax.map(..., batch_size=)``), so that the intermediates of only one chunk are live;
      None vmaps over all blocks at once. Static.

  Returns:
    The stacked outputs, identical in value to ``[fn(b) for b in blocks]`` up to rounding, and
    with block i's output a function of block i alone.
  """
  if jax.default_backend() in VERIFIED_BATCHING_BACKENDS:
    if batch_size is None:
      return jax.vmap(fn)(blocks)
    return jax.lax.map(fn, blocks, batch_size=batch_size)
  return jax.lax.map(fn, blocks)


def batched_top_k_subspaces(blocks: jax.Array, k: int, *, method: str = "exact") -> jax.Array:
  """Top-k right singular subspaces of a stack of blocks, batched by :func:`map_blocks`.

  Args:
    blocks: ``(t, m, d)`` float array: t blocks of m rows each.
    k: subspace dimension (static).
    method: :data:`TOP_K_METHODS` entry (static; see :func:`top_k_right_singular_vectors`).

  Returns:
    ``(t, d, k)`` orthonormal bases.
  """
  return map_blocks(lambda b: top_k_right_singular_vectors(b, k, method=method), blocks)


# Bytes of gathered rows live at once in :func:`gathered_top_k_subspaces` (PROPOSED).
GATHER_CHUNK_BYTES = 1 << 26


def gathered_top_k_subspaces(X: jax.Array, index: jax.Array, k: int, *,
                             method: str = "exact",
                             max_iterations: int = DEFAULT_MAX_ITERATIONS) -> jax.Array:
  """Top-k right singular subspaces of the row subsets ``X[index[j]]``, gathered chunk by chunk.

  Equal to ``batched_top_k_subspaces(X[index], k)`` (an index ``>= n`` selects a zero row, which
  does not change a subspace: padding), but the ``(t, m, d)`` stack of subsets is never
  materialised: :func:`map_blocks` runs over chunks of ``B`` subsets, ``B`` chosen from the
  shapes so that about :data:`GATHER_CHUNK_BYTES` of gathered rows are live at once, and each
  chunk gathers its own rows. Peak extra memory is therefore about that budget (plus each
  subset's ``min(m, d)``-sized work matrices) instead of a second copy of ``X``.

  Args:
    X: ``(n, d)`` float array; rows are individuals.
    index: ``(t, m)`` integer row indices; entries ``>= n`` stand for zero rows.
    k: subspace dimension (static).
    method: :data:`TOP_K_METHODS` entry (static).
    max_iterations: the subspace iteration's cap (static).

  Returns:
    ``(t, d, k)`` orthonormal bases; subset j's basis is a function of the rows ``X[index[j]]``
    alone (the batching policy above).
  """
  return top_k_subspaces_of_rows(lambda rows: X.at[rows].get(mode="fill", fill_value=0), index,
                                 X.shape[1], k, dtype=X.dtype, method=method,
                                 max_iterations=max_iterations)


def top_k_subspaces_of_rows(gather, index: jax.Array, d: int, k: int, *, dtype,
                            method: str = "exact",
                            max_iterations: int = DEFAULT_MAX_ITERATIONS) -> jax.Array:
  """:func:`gathered_top_k_subspaces` for rows that are computed, not stored.

  ``gather(rows (m,)) -> (m, d)`` makes the rows of one subset on demand (e.g. per-example
  gradients; an index ``>= n`` must give a zero row), so the whole ``(n, d)`` matrix never exists:
  about :data:`GATHER_CHUNK_BYTES` of rows are live at once.

  Args:
    gather: traceable ``(m,) int -> (m, d)`` in ``dtype``; row i a function of ``rows[i]`` only.
    index: ``(t, m)`` integer row indices.
    d, k: row dimension and subspace dimension (static).
    dtype: the rows' dtype (sets the chunk size).
    method, max_iterations: as in :func:`gathered_top_k_subspaces`.

  Returns:
    ``(t, d, k)`` orthonormal bases; subset j's basis is a function of ``gather(index[j])``.
  """
  t, m = index.shape
  batch = max(1, min(t, GATHER_CHUNK_BYTES // max(1, m * d * jnp.dtype(dtype).itemsize)))

  def one(rows):
    return top_k_right_singular_vectors(gather(rows), k, method=method,
                                        max_iterations=max_iterations)

  return map_blocks(one, index, batch_size=None if batch >= t else batch)


def project_points(points: jax.Array, bases: jax.Array) -> jax.Array:
  """Projects ``q`` points through ``t`` subspaces: ``out[j, i] = V_j V_jᵀ p_i``.

  Computes the ``(t, q, k)`` coefficients first (cheap), then maps back.

  Args:
    points: ``(q, d)``.
    bases: ``(t, d, k)`` orthonormal bases.

  Returns:
    ``(t, q, d)`` projected points.
  """
  coefficients = jnp.einsum("qd,tdk->tqk", points, bases, precision=HIGHEST)
  return jnp.einsum("tqk,tdk->tqd", coefficients, bases, precision=HIGHEST)


def principal_angles(V1: jax.Array, V2: jax.Array) -> jax.Array:
  """Principal angles (radians, ascending) between ``span(V1)`` and ``span(V2)``.

  Small angles come from their sines, large ones from their cosines (Knyazev & Argentati, SIAM J.
  Sci. Comput. 23(6), 2002, Algorithm 3.1): ``arccos`` of a cosine near 1 only resolves angles
  above ``√(2·eps)`` (3·10⁻⁴ in float32), while the singular values of the residual
  ``V1 − V2 V2ᵀ V1`` give the sines to working precision. Angle i uses its sine where
  ``cos²θ_i ≥ ½``, its cosine otherwise, so a zero basis (a ⊥ result) is at angle π/2.

  Args:
    V1: ``(d, k1)`` with orthonormal columns.
    V2: ``(d, k2)`` with orthonormal columns.

  Returns:
    ``(min(k1, k2),)`` angles in ``[0, π/2]``.
  """
  if V1.shape[1] > V2.shape[1]:
    V1, V2 = V2, V1                 # the residual of the smaller basis has the min(k1, k2) sines
  cos = jnp.clip(jnp.linalg.svd(matmul(V1.T, V2), compute_uv=False), 0.0, 1.0)   # descending
  residual = V1 - matmul(V2, matmul(V2.T, V1))
  sin = jnp.clip(jnp.linalg.svd(residual, compute_uv=False)[::-1], 0.0, 1.0)      # ascending
  return jnp.where(cos**2 >= 0.5, jnp.arcsin(sin), jnp.arccos(cos))


def orthonormal_basis(key: jax.Array, d: int, k: int, dtype=None) -> jax.Array:
  """A Haar-random ``(d, k)`` orthonormal basis (QR of a Gaussian matrix, signs fixed)."""
  G = jax.random.normal(key, (d, k), dtype=dtype or jnp.result_type(float))
  Q, R = jnp.linalg.qr(G)
  return Q * jnp.where(jnp.diagonal(R) < 0, -1.0, 1.0).astype(Q.dtype)[None, :]


@jax.jit
def symmetrize(S: jax.Array) -> jax.Array:
  """An exactly symmetric copy of a matrix that is symmetric up to rounding (last two axes).

  The lower triangle (diagonal included) is mirrored onto the upper one: a select, with no
  arithmetic. Call it on a computed array (outside ``jit``; it is jitted on its own), as the
  public estimators do on their outputs: inside a larger jitted program XLA fuses it with the
  ops that produce S and may evaluate the same entry differently at the two mirrored positions
  (LLVM contracts ``a·r + b·r`` into fused multiply-adds per access path; neither averaging nor
  an ``optimization_barrier`` survives that), so only a materialised input makes the result
  symmetric bit for bit.

  Args:
    S: ``(..., d, d)`` float array, symmetric up to rounding (e.g. a second moment or a
      congruence ``A Σ Aᵀ``).

  Returns:
    An exactly symmetric array of the same shape and dtype.
  """
  lower = jnp.tril(jnp.ones(S.shape[-2:], bool))
  return jnp.where(lower, S, jnp.swapaxes(S, -1, -2))
