"""Tests for dpjax.data: the paper's model generators and the bundled real data."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import data, metrics


def test_approximate_subspace_data_has_the_stated_covariance():
  X, model = data.approximate_subspace_data(jax.random.key(0), 40_000, 12, 2, gamma=0.2)
  assert X.shape == (40_000, 12) and model.basis.shape == (12, 2)
  cov = np.asarray(X.T @ X, np.float64) / X.shape[0]
  evals = np.sort(np.linalg.eigvalsh(cov))[::-1]
  assert 0.9 < evals[1] < 1.1                       # λ_k normalised to 1
  assert evals[0] <= 2.1
  np.testing.assert_allclose(evals[2:], 0.04, rtol=0.15)   # the tail is γ²
  assert float(metrics.projection_distance(jnp.asarray(np.linalg.eigh(cov)[1][:, -2:],
                                                       jnp.float32), model.basis)) < 0.05


def test_generators_are_deterministic_and_validate():
  # The shape of the test above: its (eagerly compiled) operations are reused.
  a, _ = data.approximate_subspace_data(jax.random.key(1), 40_000, 12, 2, gamma=0.1)
  b, _ = data.approximate_subspace_data(jax.random.key(1), 40_000, 12, 2, gamma=0.1)
  c, _ = data.approximate_subspace_data(jax.random.key(2), 40_000, 12, 2, gamma=0.1)
  assert jnp.array_equal(a, b) and not jnp.array_equal(a, c)
  with pytest.raises(ValueError, match="gamma"):
    data.approximate_subspace_data(jax.random.key(1), 5, 4, 2, gamma=1.5)
  with pytest.raises(ValueError, match="k"):
    data.approximate_subspace_data(jax.random.key(1), 5, 4, 5, gamma=0.1)
  with pytest.raises(TypeError, match="key"):
    data.approximate_subspace_data(0, 5, 4, 2, gamma=0.1)


def test_exact_subspace_data_inliers_lie_in_the_subspace():
  X, B = data.exact_subspace_data(jax.random.key(2), 30, 8, 3, num_outliers=4)
  residual = X - (X @ B) @ B.T
  norms = np.linalg.norm(np.asarray(residual), axis=1)
  assert np.all(norms[:26] < 1e-4) and np.all(norms[26:] > 1e-2)


def test_load_digits_split_and_scaling():
  ds = data.load_digits()
  assert ds.X_train.shape[1] == 64 and ds.num_classes == 10
  assert ds.X_train.shape[0] + ds.X_test.shape[0] == 1797
  assert abs(ds.X_test.shape[0] - 0.2 * 1797) <= 1
  assert ds.X_train.min() >= 0.0 and ds.X_train.max() <= 1.0
  again = data.load_digits()
  assert np.array_equal(ds.y_test, again.y_test)


def test_load_npz_round_trip_and_errors(tmp_path):
  path = tmp_path / "d.npz"
  np.savez(path, X=np.random.default_rng(0).random((50, 3)), y=np.arange(50) % 2)
  ds = data.load_npz(str(path))
  assert ds.X_train.shape[1] == 3 and ds.num_classes == 2
  bad = tmp_path / "bad.npz"
  np.savez(bad, X=np.full((5, 2), np.nan), y=np.zeros(5, int))
  with pytest.raises(ValueError, match="NaN"):
    data.load_npz(str(bad))
