"""Tests for dpjax.metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpjax import linalg, metrics


def test_projection_distance_equals_operator_norm():
  k1, k2 = jax.random.split(jax.random.key(0))
  A = linalg.orthonormal_basis(k1, 12, 3)
  B = linalg.orthonormal_basis(k2, 12, 3)
  expected = np.linalg.norm(np.asarray(A @ A.T - B @ B.T, np.float64), 2)
  assert abs(float(metrics.projection_distance(A, B)) - expected) < 1e-4
  assert float(metrics.projection_distance(A, A)) < 1e-3
  assert float(metrics.projection_distance(A, A @ jnp.array([[0., 1, 0], [1, 0, 0], [0, 0, 1]]))) < 1e-3


def test_projection_distance_rank_mismatch_and_shape_error():
  A = jnp.eye(5)[:, :2]
  assert float(metrics.projection_distance(A, jnp.eye(5)[:, :3])) == 1.0
  with pytest.raises(ValueError, match="same number of rows"):
    metrics.projection_distance(A, jnp.eye(4)[:, :2])


def test_captured_energy():
  V = jnp.eye(4)[:, :1]
  G = jnp.array([[3.0, 4.0, 0.0, 0.0]])
  assert abs(float(metrics.captured_energy(V, G)) - 9 / 25) < 1e-6


def test_clopper_pearson_matches_scipy_binomtest():
  low, high = metrics.clopper_pearson(7, 20)
  ci = stats.binomtest(7, 20).proportion_ci(0.95, method="exact")
  assert abs(low - ci.low) < 1e-9 and abs(high - ci.high) < 1e-9
  assert metrics.clopper_pearson(0, 10)[0] == 0.0 and metrics.clopper_pearson(10, 10)[1] == 1.0
  with pytest.raises(ValueError, match="successes"):
    metrics.clopper_pearson(11, 10)


def test_success_rate_counts_bottom_as_failure():
  out = metrics.success_rate([0.01, np.inf, 0.5, 0.05], alpha=0.1)
  assert out["rate"] == 0.5 and out["trials"] == 4 and out["low"] < 0.5 < out["high"]
