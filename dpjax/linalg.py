"""Batched linear algebra for subspace learning: top-k subspaces, projections, principal angles.

Everything here is non-private post-processing or a building block of a private mechanism; no
function in this module releases anything by itself. All functions are pure, jittable and work in
the input's dtype (float32 by default, float64 when the user enables x64).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("k",))
def top_k_right_singular_vectors(X: jax.Array, k: int) -> jax.Array:
  """Top-k right singular vectors of one block, i.e. the top-k eigenvectors of ``XᵀX``.

  Uses the Gram trick when the block has fewer rows than columns: the eigenvectors ``U`` of the
  ``(m, m)`` Gram matrix ``X Xᵀ`` give ``V = Xᵀ U Λ^{-1/2}``, so the cost is ``O(m² d)`` instead
  of ``O(d³)``. Otherwise it takes ``eigh`` of the ``(d, d)`` matrix ``XᵀX``. Zero rows (used as
  padding) do not change the result.

  Args:
    X: ``(m, d)`` float array; rows are individuals.
    k: number of singular vectors, ``1 <= k <= min(m, d)`` (static).

  Returns:
    ``(d, k)`` array with orthonormal columns, ordered by decreasing singular value. If ``X`` has
    rank ``r < k``, the trailing ``k - r`` columns are completed to an orthonormal set by QR (they
    carry no information about ``X``).
  """
  m, d = X.shape
  if m < d:
    gram = X @ X.T
    evals, evecs = jnp.linalg.eigh(gram)
    top = evecs[:, ::-1][:, :k]                       # (m, k)
    V = X.T @ top                                     # (d, k), column norms = singular values
    norms = jnp.linalg.norm(V, axis=0, keepdims=True)
    tiny = jnp.finfo(X.dtype).tiny ** 0.5
    V = V / jnp.maximum(norms, tiny)
  else:
    evals, evecs = jnp.linalg.eigh(X.T @ X)
    V = evecs[:, ::-1][:, :k]
  # Re-orthonormalise: the Gram route squares the condition number, and degenerate blocks give
  # zero columns. QR keeps the span of the informative columns and fixes the signs canonically.
  Q, R = jnp.linalg.qr(V)
  signs = jnp.where(jnp.diagonal(R) < 0, -1.0, 1.0).astype(X.dtype)
  return Q * signs[None, :]


def batched_top_k_subspaces(blocks: jax.Array, k: int) -> jax.Array:
  """Top-k right singular subspaces of a stack of blocks, ``vmap``-ed.

  Args:
    blocks: ``(t, m, d)`` float array: t blocks of m rows each.
    k: subspace dimension (static).

  Returns:
    ``(t, d, k)`` orthonormal bases.
  """
  return jax.vmap(top_k_right_singular_vectors, in_axes=(0, None))(blocks, k)


def project_points(points: jax.Array, bases: jax.Array) -> jax.Array:
  """Projects ``q`` points through ``t`` subspaces: ``out[j, i] = V_j V_jᵀ p_i``.

  Computes the ``(t, q, k)`` coefficients first (cheap), then maps back.

  Args:
    points: ``(q, d)``.
    bases: ``(t, d, k)`` orthonormal bases.

  Returns:
    ``(t, q, d)`` projected points.
  """
  coefficients = jnp.einsum("qd,tdk->tqk", points, bases)
  return jnp.einsum("tqk,tdk->tqd", coefficients, bases)


def principal_angles(V1: jax.Array, V2: jax.Array) -> jax.Array:
  """Principal angles (radians, ascending) between ``span(V1)`` and ``span(V2)``.

  Args:
    V1: ``(d, k1)`` with orthonormal columns.
    V2: ``(d, k2)`` with orthonormal columns.

  Returns:
    ``(min(k1, k2),)`` angles in ``[0, π/2]``.
  """
  s = jnp.linalg.svd(V1.T @ V2, compute_uv=False)
  return jnp.arccos(jnp.clip(s, 0.0, 1.0))  # s descending, so angles ascend


def orthonormal_basis(key: jax.Array, d: int, k: int, dtype=None) -> jax.Array:
  """A Haar-random ``(d, k)`` orthonormal basis (QR of a Gaussian matrix, signs fixed)."""
  G = jax.random.normal(key, (d, k), dtype=dtype or jnp.result_type(float))
  Q, R = jnp.linalg.qr(G)
  return Q * jnp.where(jnp.diagonal(R) < 0, -1.0, 1.0).astype(Q.dtype)[None, :]
