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


@pytest.mark.parametrize("theta", [1e-6, 1e-5, 1e-3, 0.7, 1.5])
def test_projection_distance_is_accurate_at_small_angles_in_float32(theta):
  """sin θ to working precision, not only above √(2·eps) ≈ 3·10⁻⁴ (where √(1 − cos²θ) stops; the
  float32 basis itself is orthonormal to ~10⁻⁷):
  two float32 planes in R⁶ at principal angles (θ/3, θ), and a zero basis (a ⊥ result) at 1."""
  # Built in NumPy (float32 throughout): no JAX program per operation and angle.
  Q = np.linalg.qr(np.random.default_rng(1).standard_normal((6, 6)))[0].astype(np.float32)
  V = Q[:, :2]
  c, s = np.float32([np.cos(theta / 3), np.cos(theta)]), np.float32([np.sin(theta / 3),
                                                                      np.sin(theta)])
  W = np.stack([c[0] * Q[:, 0] + s[0] * Q[:, 2], c[1] * Q[:, 1] + s[1] * Q[:, 3]], axis=1)
  assert V.dtype == W.dtype == np.float32
  np.testing.assert_allclose(float(metrics.projection_distance(V, W)), np.sin(theta), rtol=2e-2,
                             atol=3e-7)
  np.testing.assert_allclose(np.asarray(linalg.principal_angles(W, V)), [theta / 3, theta],
                             rtol=2e-2, atol=3e-7)
  assert float(metrics.projection_distance(np.zeros_like(V), W)) == 1.0


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


def test_covariance_and_mahalanobis_errors_are_affine_invariant():
  rng = np.random.default_rng(0)
  d = 4
  A = rng.normal(size=(d, d))
  Sigma = A @ A.T + 0.1 * np.eye(d)
  E = rng.normal(size=(d, d)) * 0.05
  Sigma_hat = Sigma + (E + E.T) / 2
  T = rng.normal(size=(d, d)) * np.array([10.0, 1.0, 0.1, 1.0])      # a badly scaled map
  for ord_ in (2, "fro"):
    e1 = metrics.covariance_error(Sigma_hat, Sigma, ord=ord_)
    e2 = metrics.covariance_error(T @ Sigma_hat @ T.T, T @ Sigma @ T.T, ord=ord_)
    assert e1 == pytest.approx(e2, rel=1e-6)
  mu, mu_hat = rng.normal(size=d), rng.normal(size=d)
  assert metrics.mahalanobis_error(mu_hat, mu, Sigma) == pytest.approx(
      metrics.mahalanobis_error(T @ mu_hat, T @ mu, T @ Sigma @ T.T), rel=1e-6)
  assert metrics.covariance_error(Sigma, Sigma) == pytest.approx(0.0, abs=1e-12)


def test_gaussian_kl_and_tv_match_closed_forms():
  # Equal covariances: KL = ½‖Σ^{-1/2}Δμ‖², TV = 2Φ(‖Σ^{-1/2}Δμ‖/2) − 1.
  from scipy import stats
  Sigma = np.diag([4.0, 1.0, 0.25])
  mu1, mu2 = np.zeros(3), np.array([1.0, 0.0, 0.0])
  maha = 0.5
  assert metrics.gaussian_kl(mu1, Sigma, mu2, Sigma) == pytest.approx(0.5 * maha**2)
  out = metrics.gaussian_tv(jax.random.key(0), mu1, Sigma, mu2, Sigma, num_samples=200_000)
  exact = 2 * stats.norm.cdf(maha / 2) - 1
  assert abs(out["tv"] - exact) < 5 * out["stderr"] + 1e-3
  assert out["tv"] <= out["pinsker"] + 5 * out["stderr"]
  same = metrics.gaussian_tv(jax.random.key(1), mu1, Sigma, mu1, Sigma, num_samples=1000)
  assert same["tv"] == 0.0 and same["pinsker"] == 0.0
