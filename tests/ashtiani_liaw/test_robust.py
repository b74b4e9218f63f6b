"""Robust private learners ([AL22] §6–7, docs/algorithms.md §3.7) under a corrupted fraction."""

import jax
import numpy as np
import pytest
from dp_accounting import NeighboringRelation

from dpjax import metrics
from dpjax.ashtiani_liaw import al_covariance, ppme_mean
from dpjax.ashtiani_liaw.robust import robust_covariance, robust_mean

EPS, DELTA, ETA = 20.0, 1e-6, 0.1


def _corrupt(rng, X, fraction, point):
  n = X.shape[0]
  bad = rng.choice(n, int(fraction * n), replace=False)
  X = X.copy()
  X[bad] = point
  return X


@pytest.mark.parametrize("seed", [
    0, pytest.param(1, marks=pytest.mark.slow(reason="a second seed; the default run checks 0"))])
def test_robust_mean_resists_a_far_cluster_that_biases_ppme(seed):
  rng = np.random.default_rng(seed)
  d, k, m = 5, 151, 400                                  # k = min_groups_for_test: a sure pass
  mu = rng.normal(size=d) * 1e3                          # unbounded mean
  X = mu + rng.normal(size=(k * m, d))
  direction = np.ones(d) / np.sqrt(d)
  X = _corrupt(rng, X, ETA, mu + 10 * np.sqrt(d) * direction)
  kwargs = dict(epsilon=EPS, delta=DELTA, num_groups=k, radius=1.0)
  plain = ppme_mean(jax.random.key(seed), X, **kwargs)
  robust = robust_mean(jax.random.key(seed), X, corruption=ETA, **kwargs)
  assert robust.ok and robust.neighboring == NeighboringRelation.REPLACE_ONE
  err_robust = np.linalg.norm(robust.estimate - mu)
  # Filtering rate O(η sqrt(ln 1/η)) + sqrt(d/m) + the mask: well below the 1.0 radius.
  assert err_robust < 0.5, err_robust
  if bool(plain.ok):                                     # the plain mean is pulled ≈ η·10√d
    assert np.linalg.norm(plain.estimate - mu) > 3 * err_robust
  assert robust.info["corruption"] == ETA


@pytest.mark.slow(reason="robust_covariance end to end; the default run checks robust_mean and "
                         "the corruption check")
def test_robust_covariance_resists_outliers_along_a_small_eigenvector():
  rng = np.random.default_rng(2)
  d = 3
  U, _ = np.linalg.qr(rng.normal(size=(d, d)))
  ev = np.array([1e-2, 1.0, 1e2])
  Sigma = U @ np.diag(ev) @ U.T
  kwargs = dict(epsilon=EPS, delta=DELTA, min_group_size=2000, num_groups=300)
  n = 300 * 2000
  X = rng.normal(size=(n, d)) * np.sqrt(ev) @ U.T
  small = U[:, 0] * np.sqrt(ev[0])                      # the hardest direction for covariance
  X = _corrupt(rng, X, 0.05, 6.0 * small)
  plain = al_covariance(jax.random.key(3), X, **kwargs)
  robust = robust_covariance(jax.random.key(3), X, corruption=0.05, **kwargs)
  assert robust.ok
  err_robust = metrics.covariance_error(robust.estimate, Sigma)
  err_plain = (metrics.covariance_error(plain.estimate, Sigma) if bool(plain.ok) else np.inf)
  assert err_robust < err_plain, (err_robust, err_plain)
  # The masked preconditioner's guarantee: a constant factor (mask concentration + candidates).
  assert err_robust <= (1 + robust.info["radius"]) * (1 + robust.info["mask_accuracy"]) - 1


@pytest.mark.parametrize("bad", [-0.1, 0.5, float("nan")])
def test_robust_learners_reject_bad_corruption(bad):
  X = np.random.default_rng(4).normal(size=(1000, 3))
  with pytest.raises(ValueError, match="corruption"):
    robust_mean(jax.random.key(0), X, epsilon=1.0, delta=1e-6, corruption=bad, num_groups=50,
                radius=1.0)
  with pytest.raises(ValueError, match="corruption"):
    robust_covariance(jax.random.key(0), X, epsilon=1.0, delta=1e-6, corruption=bad)
