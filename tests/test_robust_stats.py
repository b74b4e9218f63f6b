"""Non-private robust estimators (docs/algorithms.md §3.7): accuracy on clean and η-corrupted Gaussian
samples, affine equivariance, vmap/jit, determinism, dtypes and input errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.robust_stats import (FilterInfo, coordinatewise_median, filtered_covariance,
                                        filtered_mean, trimmed_covariance)

ETA = 0.1
SEEDS = range(3)       # datasets per accuracy test (the bounds hold on every one; 5 before)
MEAN_N, MEAN_D = 2000, 10
COV_N, COV_D = 2000, 6


def _mean_sample(seed, kind="clean", n=MEAN_N, d=MEAN_D, eta=ETA):
  """η-corrupted N(μ, I): the first ⌊ηn⌋ rows are replaced according to ``kind``."""
  rng = np.random.default_rng(seed)
  mu = 3.0 * rng.standard_normal(d)
  X = mu + rng.standard_normal((n, d))
  m = int(eta * n)
  u = rng.standard_normal(d)
  u /= np.linalg.norm(u)
  if kind == "far":              # one far cluster, 10·sqrt(d) away
    X[:m] = mu + 10.0 * math.sqrt(d) * u
  elif kind == "subtle":         # at the inliers' typical distance sqrt(d), all on one side
    X[:m] = mu + math.sqrt(d) * u
  elif kind == "diagonal":       # every coordinate shifted by 2 (fools coordinate-wise medians)
    X[:m] = mu + 2.0
  return X.astype(np.float32), mu


def _cov_sample(seed, kind="clean", n=COV_N, d=COV_D, eta=ETA, sigmas=6.0):
  """η-corrupted N(0, Σ), Σ of condition number 100 in a random basis."""
  rng = np.random.default_rng(seed)
  Q, _ = np.linalg.qr(rng.standard_normal((d, d)))
  evals = np.logspace(0.0, 2.0, d)
  Sigma = (Q * evals) @ Q.T
  Z = rng.standard_normal((n, d))
  m = int(eta * n)
  # Rows x = Σ^{1/2} z: z = s·u_min puts x at Mahalanobis distance s along Σ's eigenvector u_min.
  if kind == "small_eigvec":     # ± `sigmas` standard deviations along Σ's smallest eigenvector
    Z[:m] = sigmas * Q[:, 0] * rng.choice([-1.0, 1.0], m)[:, None]
  elif kind == "far":            # one far cluster along the largest eigenvector
    Z[:m] = 10.0 * math.sqrt(d) * Q[:, -1]
  X = Z @ ((Q * np.sqrt(evals)) @ Q.T)
  return X.astype(np.float32), Sigma


def _rel_error(S_hat, Sigma):
  """‖Σ^{-1/2} Σ̂ Σ^{-1/2} − I‖_F."""
  e, U = np.linalg.eigh(Sigma)
  W = (U / np.sqrt(e)) @ U.T
  return float(np.linalg.norm(W @ np.asarray(S_hat, np.float64) @ W - np.eye(len(e))))


def _err(mu_hat, mu):
  return float(np.linalg.norm(np.asarray(mu_hat, np.float64) - mu))


# ------------------------------------------------------------------------------------------------
# Robust mean.


def test_mean_on_clean_data_matches_the_empirical_mean():
  for seed in SEEDS:
    X, mu = _mean_sample(seed)
    est, info = filtered_mean(X, corruption=ETA, return_info=True)
    assert _err(est, mu) <= 1.1 * _err(X.mean(0), mu) + 0.01, seed
    assert bool(info.certified) and float(jnp.mean(info.weights)) > 0.99


def test_mean_far_cluster():
  bound = ETA * math.sqrt(math.log(1 / ETA)) + 2 * math.sqrt(MEAN_D / MEAN_N)   # ≈ 0.29
  for seed in SEEDS:
    X, mu = _mean_sample(seed, "far")
    assert _err(X.mean(0), mu) >= 0.9 * ETA * 10 * math.sqrt(MEAN_D)          # ≈ η·distance
    est, info = filtered_mean(X, corruption=ETA, return_info=True)
    assert _err(est, mu) <= bound, seed
    w = np.asarray(info.weights)
    m = int(ETA * MEAN_N)
    assert w[:m].max() < 0.05 and w[m:].mean() > 0.95 and bool(info.certified)


def test_mean_subtle_shift_beats_empirical_and_norm_pruning():
  m = int(ETA * MEAN_N)
  for seed in SEEDS:
    X, mu = _mean_sample(seed, "subtle")
    emp = _err(X.mean(0), mu)
    assert emp >= 0.25                                                         # ≈ η sqrt(d)
    # Norm-based pruning (drop the η n rows farthest from the coordinate-wise median) keeps the
    # outliers: they sit at the inliers' typical distance.
    dist = np.linalg.norm(X - np.median(X, axis=0), axis=1)
    kept = np.argsort(dist)[: MEAN_N - m]
    assert np.mean(kept < m) > 0.9 * ETA
    assert _err(X[kept].mean(0), mu) >= 0.8 * emp
    assert _err(filtered_mean(X, corruption=ETA), mu) <= 0.6 * emp, seed


def test_coordinatewise_median_is_only_a_stand_in():
  for seed in range(3):
    X, mu = _mean_sample(seed, "diagonal")
    med = coordinatewise_median(X)
    np.testing.assert_allclose(np.asarray(med), np.median(X, axis=0), rtol=1e-6)
    # Every coordinate's median moves by Θ(η): error Θ(η sqrt(d)), while the filter is unmoved.
    assert _err(med, mu) >= 2 * _err(filtered_mean(X, corruption=ETA), mu), seed


# ------------------------------------------------------------------------------------------------
# Robust covariance.


def test_covariance_on_clean_data_matches_the_empirical_covariance():
  for seed in SEEDS:
    X, Sigma = _cov_sample(seed)
    emp = _rel_error(X.T @ X / COV_N, Sigma)
    assert _rel_error(filtered_covariance(X, corruption=ETA), Sigma) <= 1.1 * emp + 0.02, seed
    assert _rel_error(trimmed_covariance(X, corruption=ETA), Sigma) <= 1.3 * emp + 0.05, seed


@pytest.mark.parametrize("kind", ["small_eigvec", "far"])
def test_covariance_under_corruption(kind):
  bound = ETA * math.log(1 / ETA) + COV_D / math.sqrt(COV_N)                  # ≈ 0.36
  m = int(ETA * COV_N)
  for seed in SEEDS:
    X, Sigma = _cov_sample(seed, kind)
    if kind == "small_eigvec":   # the outliers have small norms: norm-based pruning keeps them
      norms = np.linalg.norm(X, axis=1)
      assert norms[:m].max() < np.median(norms[m:])
    emp = _rel_error(X.T @ X / COV_N, Sigma)
    est, info = filtered_covariance(X, corruption=ETA, return_info=True)
    err = _rel_error(est, Sigma)
    assert err <= bound and err <= 0.2 * emp, (seed, err, emp)
    assert bool(info.certified)


def test_trimmed_covariance_is_only_a_stand_in():
  for seed in range(3):
    X, Sigma = _cov_sample(seed, "far")
    assert _rel_error(trimmed_covariance(X, corruption=ETA), Sigma) <= 0.4   # gross outliers: ok
    # Outliers 3 standard deviations out along Σ's smallest eigenvector survive the trimming.
    X, Sigma = _cov_sample(seed, "small_eigvec", sigmas=3.0)
    trimmed = _rel_error(trimmed_covariance(X, corruption=ETA), Sigma)
    assert trimmed >= 2 * _rel_error(filtered_covariance(X, corruption=ETA), Sigma), seed


def test_covariance_is_affine_equivariant():
  with jax.enable_x64(True):
    X, _ = _cov_sample(7, "small_eigvec")
    X = X.astype(np.float64)
    B = np.random.default_rng(8).standard_normal((COV_D, COV_D)) + 3 * np.eye(COV_D)
    S, info = filtered_covariance(X, corruption=ETA, return_info=True)
    SB = filtered_covariance(X @ B.T, corruption=ETA)
    assert int(info.steps) >= 1                                 # the filter did act
    np.testing.assert_allclose(np.asarray(SB), B @ np.asarray(S) @ B.T, rtol=1e-7,
                               atol=1e-9 * np.abs(B @ np.asarray(S) @ B.T).max())


def test_covariance_output_is_symmetric_psd():
  for kind in ["clean", "small_eigvec", "far"]:
    X, _ = _cov_sample(3, kind)
    for S in (filtered_covariance(X, corruption=ETA), trimmed_covariance(X, corruption=ETA)):
      S = np.asarray(S)
      assert np.array_equal(S, S.T)
      assert np.linalg.eigvalsh(S.astype(np.float64)).min() >= -1e-6 * np.abs(S).max()


def test_zero_corruption_gives_the_empirical_estimates():
  X, _ = _mean_sample(0, "far")
  np.testing.assert_allclose(np.asarray(filtered_mean(X, corruption=0.0)), X.mean(0), rtol=1e-5)
  X, _ = _cov_sample(0, "far")
  for S in (filtered_covariance(X, corruption=0.0), trimmed_covariance(X, corruption=0.0)):
    np.testing.assert_allclose(np.asarray(S), X.T @ X / COV_N, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# Batching, jit, determinism, dtypes.


# All shapes below are the ones used above, (2000, 10) for means and (2000, 6) for covariances,
# so that eager calls reuse compiled code: the file must stay fast.


def _mean_groups(k=3):
  return np.stack([_mean_sample(s, "far")[0] for s in range(k)])


def _cov_groups(k=3):
  return np.stack([_cov_sample(s, "far")[0] for s in range(k)])


def test_jit_of_vmap_over_groups_matches_per_group_calls():
  groups, cgroups = _mean_groups(), _cov_groups()
  k, m, d = groups.shape
  mean_fn = jax.jit(jax.vmap(lambda D: filtered_mean(D, corruption=ETA, return_info=True)))
  means, info = mean_fn(groups)
  covs, cinfo = jax.jit(jax.vmap(
      lambda D: filtered_covariance(D, corruption=ETA, return_info=True)))(cgroups)
  meds = jax.jit(jax.vmap(coordinatewise_median))(groups)
  # The stand-in is only traced (shapes), to keep this file fast.
  trims = jax.eval_shape(jax.vmap(lambda D: trimmed_covariance(D, corruption=ETA)), cgroups)
  assert means.shape == (k, d) and meds.shape == (k, d)
  assert covs.shape == (k, COV_D, COV_D) and trims.shape == (k, COV_D, COV_D)
  assert isinstance(info, FilterInfo) and info.weights.shape == (k, m)
  assert info.certified.shape == (k,) and bool(jnp.all(info.certified & cinfo.certified))
  for i in range(k):
    np.testing.assert_allclose(means[i], filtered_mean(groups[i], corruption=ETA), rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_allclose(covs[i], filtered_covariance(cgroups[i], corruption=ETA),
                               rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(meds[i], coordinatewise_median(groups[i]), rtol=1e-6)


def test_determinism():
  X, _ = _mean_sample(1, "subtle")
  assert np.array_equal(np.asarray(filtered_mean(X, corruption=ETA)),
                        np.asarray(filtered_mean(X, corruption=ETA)))
  X, _ = _cov_sample(1, "small_eigvec")
  assert np.array_equal(np.asarray(filtered_covariance(X, corruption=ETA)),
                        np.asarray(filtered_covariance(X, corruption=ETA)))


@pytest.mark.slow(reason="output dtypes (float32, int input, float64 traced); the default run "
                         "checks values")
def test_dtypes_are_preserved():
  Xm, _ = _mean_sample(2, "far")
  Xc, _ = _cov_sample(2, "far")
  cases = [(lambda A: filtered_mean(A, corruption=ETA), Xm),
           (coordinatewise_median, Xm),
           (lambda A: filtered_covariance(A, corruption=ETA), Xc),
           (lambda A: trimmed_covariance(A, corruption=ETA), Xc)]
  for fn, X in cases:
    assert fn(X).dtype == jnp.float32
    assert fn(np.rint(X).astype(np.int32)).dtype == jnp.float32          # ints -> default float
  _, info = filtered_covariance(Xc, corruption=ETA, return_info=True)
  assert info.weights.dtype == jnp.float32
  # float64 is traced only (compiling all four again is slow); the equivariance test above runs
  # filtered_covariance in float64.
  with jax.enable_x64(True):
    for fn, X in cases:
      assert jax.eval_shape(fn, X.astype(np.float64)).dtype == jnp.float64


# ------------------------------------------------------------------------------------------------
# Errors.


def test_input_errors():
  X, _ = _cov_sample(0)
  bad = X.copy()
  bad[3, 1] = np.nan
  for fn in (filtered_mean, filtered_covariance, trimmed_covariance):
    with pytest.raises(ValueError, match="NaN or infinite"):
      fn(bad, corruption=ETA)
    with pytest.raises(ValueError, match="NaN or infinite"):
      fn(np.where(np.isnan(bad), np.inf, bad), corruption=ETA)
    with pytest.raises(ValueError, match="2 dimensions"):
      fn(X[0], corruption=ETA)
    with pytest.raises(ValueError, match="2 dimensions"):
      fn(X[None], corruption=ETA)
    for eta in (-0.1, 0.5, 0.7, float("nan"), float("inf")):
      with pytest.raises(ValueError, match="corruption"):
        fn(X, corruption=eta)
    for eta in (True, "0.1", None):
      with pytest.raises(TypeError, match="corruption"):
        fn(X, corruption=eta)
    with pytest.raises(ValueError, match="iterations"):
      fn(X, corruption=ETA, iterations=-1)
    with pytest.raises(TypeError, match="iterations"):
      fn(X, corruption=ETA, iterations=2.5)
  with pytest.raises(ValueError, match="NaN or infinite"):
    coordinatewise_median(bad)
  with pytest.raises(TypeError, match="floating dtype"):
    coordinatewise_median(X > 0)
  with pytest.raises(ValueError, match="stop_constant"):
    filtered_mean(X, corruption=ETA, stop_constant=-1.0)
  with pytest.raises(ValueError, match="score_threshold"):
    filtered_covariance(X, corruption=ETA, score_threshold=-1.0)
  # Under tracing the shape is still checked (values are not available there).
  with pytest.raises(ValueError, match="2 dimensions"):
    jax.jit(lambda A: filtered_mean(A, corruption=ETA))(X[None])
