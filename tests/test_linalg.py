"""Tests for dpjax.linalg: batched top-k subspaces, projections, principal angles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import linalg


def _numpy_top_k(X, k):
  _, _, vt = np.linalg.svd(np.asarray(X, dtype=np.float64), full_matrices=False)
  return vt[:k].T


def _span_distance(A, B):
  A, B = np.asarray(A, np.float64), np.asarray(B, np.float64)
  return np.linalg.norm(A @ A.T - B @ B.T, 2)


@pytest.mark.parametrize("m,d", [(8, 30), (40, 12)])  # Gram route (m < d) and eigh route
def test_top_k_matches_numpy_svd(m, d):
  X = jax.random.normal(jax.random.key(0), (m, d)) * jnp.linspace(3.0, 0.1, d)
  V = linalg.top_k_right_singular_vectors(X, 3)
  assert V.shape == (d, 3) and V.dtype == X.dtype
  np.testing.assert_allclose(np.asarray(V.T @ V), np.eye(3), atol=1e-5)
  assert _span_distance(V, _numpy_top_k(X, 3)) < 1e-3


def test_zero_padding_rows_do_not_change_the_subspace():
  X = jax.random.normal(jax.random.key(1), (10, 50))
  padded = jnp.concatenate([X, jnp.zeros((5, 50))])
  a = linalg.top_k_right_singular_vectors(X, 2)
  b = linalg.top_k_right_singular_vectors(padded, 2)
  assert _span_distance(a, b) < 1e-4


def test_batched_equals_loop():
  blocks = jax.random.normal(jax.random.key(2), (6, 7, 20))
  batched = linalg.batched_top_k_subspaces(blocks, 2)
  assert batched.shape == (6, 20, 2)
  for j in range(6):
    single = linalg.top_k_right_singular_vectors(blocks[j], 2)
    np.testing.assert_allclose(np.asarray(batched[j]), np.asarray(single), atol=1e-5)


def test_rank_deficient_block_still_orthonormal():
  X = jnp.outer(jnp.arange(1.0, 6.0), jnp.ones(9))   # rank 1, ask for 3
  V = linalg.top_k_right_singular_vectors(X, 3)
  np.testing.assert_allclose(np.asarray(V.T @ V), np.eye(3), atol=1e-5)
  assert abs(float(jnp.abs(V[:, 0] @ jnp.ones(9))) - 3.0) < 1e-4   # leading direction is 1/3


def test_project_points_is_projection():
  key_b, key_p = jax.random.split(jax.random.key(3))
  bases = jax.vmap(lambda kk: linalg.orthonormal_basis(kk, 15, 3))(jax.random.split(key_b, 4))
  P = jax.random.normal(key_p, (5, 15))
  out = linalg.project_points(P, bases)
  assert out.shape == (4, 5, 15)
  expected = jnp.einsum("tdk,tek,qe->tqd", bases, bases, P)
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-5)


def test_principal_angles_known_case():
  e = jnp.eye(4)
  theta = 0.3
  V1 = e[:, :2]
  V2 = jnp.stack([e[:, 0], jnp.cos(theta) * e[:, 1] + jnp.sin(theta) * e[:, 2]], axis=1)
  np.testing.assert_allclose(np.asarray(linalg.principal_angles(V1, V2)), [0.0, theta],
                             atol=1e-3)


def test_orthonormal_basis_float64():
  with jax.enable_x64(True):
    V = linalg.orthonormal_basis(jax.random.key(0), 30, 4, jnp.float64)
    assert V.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(V.T @ V), np.eye(4), atol=1e-12)
