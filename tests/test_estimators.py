"""dpjax.estimators: scikit-learn's estimator checks (those that apply to a randomised private
estimator), the fitted attributes, determinism per seed, the privacy-leak warnings, no mutation of
the caller's arrays, and clear errors."""

import warnings

import numpy as np
import pytest
from sklearn.utils.estimator_checks import parametrize_with_checks

from dpjax.estimators import PrivacyLeakWarning, PrivateLogisticRegression, PrivatePCA

# Checks that cannot hold for these estimators, and why.
_PCA_XFAIL = {}
_LR_XFAIL = {
    "check_non_transformer_estimators_n_iter":
        "the optimiser's iteration count is a function of the data, not covered by the DP "
        "guarantee, so it is not exposed as n_iter_",
}


def _expected_failed(estimator):
  return _LR_XFAIL if isinstance(estimator, PrivateLogisticRegression) else _PCA_XFAIL


@pytest.mark.filterwarnings("ignore::dpjax.estimators.PrivacyLeakWarning")
@pytest.mark.slow(reason="scikit-learn's estimator checks (about a hundred fits); test_fit_* run "
                         "by default")
@parametrize_with_checks([PrivatePCA(n_components=1, random_state=0, data_norm="from_data"),
                          PrivatePCA(n_components=1, method="ppca", random_state=0,
                                     data_norm="from_data"),
                          PrivateLogisticRegression(random_state=0, data_norm="from_data")],
                         expected_failed_checks=_expected_failed)
def test_sklearn_estimator_checks(estimator, check):
  check(estimator)


def _digits_like(n=300, d=8, seed=0):
  rng = np.random.default_rng(seed)
  X = rng.normal(size=(n, d)) * np.linspace(2.0, 0.2, d)
  X /= np.linalg.norm(X, axis=1, keepdims=True).max()          # test data: norm ≤ 1
  y = (X[:, 0] + 0.3 * X[:, 1] > 0).astype(int)
  return X, y


@pytest.mark.parametrize("method", ["sulq", "ppca", "analyze_gauss"])
def test_fit_private_pca(method):
  X, _ = _digits_like()
  X_copy = X.copy()
  est = PrivatePCA(n_components=2, epsilon=50.0, method=method, data_norm=1.0, random_state=3)
  Z = est.fit(X).transform(X)
  np.testing.assert_array_equal(X, X_copy)                      # the caller's array untouched
  assert est.components_.shape == (2, 8) and Z.shape == (300, 2) and est.ok_
  np.testing.assert_allclose(est.components_ @ est.components_.T, np.eye(2), atol=1e-5)
  # The top direction e1 lies in the private subspace at a large ε (a statement about the
  # subspace: ppca's basis is Haar within it, its columns in no order).
  assert np.linalg.norm(est.components_[:, 0]) > 0.9
  assert est.result_.epsilon == 50.0
  again = PrivatePCA(n_components=2, epsilon=50.0, method=method, data_norm=1.0,
                     random_state=3).fit(X)
  np.testing.assert_array_equal(again.components_, est.components_)     # same seed, same fit
  np.testing.assert_allclose(est.inverse_transform(Z).shape, X.shape)


@pytest.mark.slow(reason="LR's accuracy, determinism and multiclass fit; the default run fits "
                         "binary LR")
def test_fit_private_logistic_regression_binary_and_multiclass():
  X, y = _digits_like(n=2000)
  X_copy = X.copy()
  est = PrivateLogisticRegression(epsilon=5.0, data_norm=1.0, classes=[0, 1], random_state=1)
  assert est.fit(X, y).score(X, y) > 0.85
  np.testing.assert_array_equal(X, X_copy)
  assert est.coef_.shape == (1, 8) and est.intercept_.shape == (1,)
  assert est.predict_proba(X[:5]).shape == (5, 2)
  same = PrivateLogisticRegression(epsilon=5.0, data_norm=1.0, classes=[0, 1], random_state=1)
  np.testing.assert_array_equal(same.fit(X, y).coef_, est.coef_)
  labels = np.digitize(X[:, 0], [-0.1, 0.1])                      # three classes
  multi = PrivateLogisticRegression(epsilon=5.0, method="output", data_norm=1.0,
                                    classes=[0, 1, 2], random_state=1).fit(X, labels)
  assert multi.coef_.shape == (3, 8) and set(multi.predict(X)) <= {0, 1, 2}
  assert multi.result_.epsilon == 5.0


def test_a_missing_data_norm_is_refused_and_reading_it_off_the_data_is_an_opt_in():
  """Issue 53: without data_norm the fit used to read the bound off the data (not private) with
  only a warning; now it refuses and says how to choose one, and the non-private bound needs
  data_norm="from_data", which warns."""
  X, y = _digits_like(n=200)
  for estimator in (PrivatePCA(n_components=1, random_state=0),
                    PrivateLogisticRegression(random_state=0, classes=[0, 1])):
    with pytest.raises(ValueError, match="WITHOUT looking at the data"):
      estimator.fit(X, y)
  with pytest.warns(PrivacyLeakWarning, match="from_data"):
    PrivatePCA(n_components=1, random_state=0, data_norm="from_data").fit(X * 3)
  with pytest.warns(PrivacyLeakWarning):
    PrivateLogisticRegression(random_state=0, data_norm="from_data").fit(X, y)
  for bad in ("max", -1.0, float("nan")):
    with pytest.raises(ValueError, match="data_norm"):
      PrivatePCA(n_components=1, data_norm=bad).fit(X)
  PrivatePCA(n_components=1, method="dpase", random_state=0, epsilon=5.0).fit(X)  # needs none
  with warnings.catch_warnings():
    warnings.simplefilter("error", PrivacyLeakWarning)
    PrivateLogisticRegression(data_norm=1.0, classes=[0, 1], random_state=0).fit(X, y)


def test_bad_arguments_raise_clear_errors():
  X, y = _digits_like(n=200)
  with pytest.raises(ValueError, match="method"):
    PrivatePCA(method="svd", data_norm=1.0).fit(X)
  with pytest.raises(ValueError, match="not in classes"):
    PrivateLogisticRegression(data_norm=1.0, classes=[0, 2]).fit(X, y)
  with pytest.raises(ValueError, match="epsilon"):
    PrivateLogisticRegression(epsilon=-1.0, data_norm=1.0, classes=[0, 1]).fit(X, y)
  with pytest.raises(TypeError, match="random_state"):
    PrivatePCA(random_state="seed", data_norm=1.0).fit(X)


def test_rows_above_the_public_bound_are_clipped_not_rescaled():
  """A row far above data_norm is clipped to it (a fixed per-row map): the fit equals the fit on
  the explicitly clipped data, whatever the row's size."""
  X, _ = _digits_like(n=200)
  big = X.copy()
  big[0] = X[0] / np.linalg.norm(X[0]) * 1e6
  clipped = X.copy()
  clipped[0] = X[0] / np.linalg.norm(X[0])
  a = PrivatePCA(n_components=1, data_norm=1.0, random_state=0).fit(big)
  b = PrivatePCA(n_components=1, data_norm=1.0, random_state=0).fit(clipped)
  np.testing.assert_allclose(a.components_, b.components_, atol=1e-6)


@pytest.mark.parametrize("method", ["output", "objective"])
def test_logistic_regression_passes_the_release_through(method):
  """``release`` reaches the learner: the default coefficients lie on the public grid (integer
  multiples of ``info["grid"]/data_norm``; data_norm = 1 here, so exactly), ``"raw"`` gives the
  float64 value of the same key, close to it (the exact bound is tested in
  tests/classic/test_erm.py), and a bad value raises naming the argument."""
  X, y = _digits_like(n=200)
  grid = PrivateLogisticRegression(epsilon=5.0, method=method, data_norm=1.0, classes=[0, 1],
                                   random_state=2).fit(X, y)
  raw = PrivateLogisticRegression(epsilon=5.0, method=method, data_norm=1.0, classes=[0, 1],
                                  random_state=2, release="raw").fit(X, y)
  assert grid.result_.info["release"] == "grid" and raw.result_.info["release"] == "raw"
  step = grid.result_.info["grid"]
  scaled = grid.coef_ / step
  np.testing.assert_array_equal(scaled, np.round(scaled))
  assert not np.array_equal(raw.coef_ / step, np.round(raw.coef_ / step))
  np.testing.assert_allclose(grid.coef_, raw.coef_, atol=0.01)
  with pytest.raises(ValueError, match="release"):
    PrivateLogisticRegression(data_norm=1.0, classes=[0, 1], release="bits").fit(X, y)


def test_the_default_pca_is_the_stronger_release():
  """Issue 53: PrivatePCA() used MOD-SuLQ, whose captured energy at k = 2 on breast_cancer at
  ε = 10 was 0.04 against Analyze Gauss's 0.61 (non-private 0.63). The default is now Analyze
  Gauss. The rows are standardised and scaled to norm ≤ 1 with a bound from the public feature
  count (√30), so data_norm = 1 is public for the test."""
  from sklearn.datasets import load_breast_cancer
  X = load_breast_cancer().data
  X = (X - X.mean(0)) / X.std(0)                   # the test's preprocessing, not the subject
  X = np.clip(X, -3, 3) / (3 * np.sqrt(X.shape[1]))
  top = np.linalg.svd(X, full_matrices=False)[2][:2]

  def energy(components):
    return float(np.sum((X @ components.T) ** 2) / np.sum(X ** 2))
  default = PrivatePCA(n_components=2, epsilon=10.0, delta=1e-6, data_norm=1.0, random_state=0)
  assert default.method == "analyze_gauss"
  sulq = PrivatePCA(n_components=2, epsilon=10.0, delta=1e-6, data_norm=1.0, method="sulq",
                    random_state=0)
  got, weak, best = energy(default.fit(X).components_), energy(sulq.fit(X).components_), energy(top)
  assert got > 0.8 * best and got > 2 * weak, (got, weak, best)


def test_a_statistician_on_wine_is_told_the_rows_each_learner_needs():
  """Issue 53's statistician: scikit-learn's wine (178 rows, d = 13). CoinPress used to return
  a 47×-wrong covariance in silence; now it warns with covariance_required_n's figures.
  learn_covariance refused with a lower bound 140× below al_covariance's required_n and said
  neither was its own; now it quotes learn_covariance_required_n, the same number the helper
  returns. DPASE said "more rows help"; now it quotes dpase_required_n."""
  import re
  import jax
  import dpjax
  from sklearn.datasets import load_wine
  X = load_wine().data
  X = (X - X.mean(0)) / X.std(0)
  with pytest.warns(dpjax.UnderpoweredWarning, match="coinpress_covariance") as caught:
    dpjax.coinpress.coinpress_covariance(jax.random.key(0), X, epsilon=1.0, delta=1e-6,
                                         kappa=100.0)
  message = str(caught[0].message)
  figures = [int(x.replace(",", "")) for x in re.findall(r"n ≥ ([\d,]+)", message)]
  assert figures == [dpjax.coinpress.covariance_required_n(13, kappa=100.0, epsilon=1.0,
                                                           delta=1e-6, accuracy=a)
                     for a in (1.0, 0.1)]
  assert caught[0].filename == __file__
  need = dpjax.ashtiani_liaw.learn_covariance_required_n(13, 1.0, 1e-6)
  with pytest.raises(ValueError, match=f"n >= {need:,} rows"):
    dpjax.ashtiani_liaw.learn_covariance(jax.random.key(0), X, epsilon=1.0, delta=1e-6)
  rows = dpjax.subspace.dpase_required_n(13, 2, epsilon=1.0, delta=1e-6, gamma=0.3)
  with pytest.warns(dpjax.UnderpoweredWarning, match=f"n ≥ {rows:,} rows"):
    dpjax.subspace.dpase(jax.random.key(1), X, epsilon=1.0, delta=1e-6, k=2, gamma=0.3)
  assert dpjax.subspace.dpase_required_n(13, 2, epsilon=1.0, delta=1e-6, gamma=0.6) is None


def test_coinpress_mean_warns_exactly_below_its_helpers_rows():
  """The warning fires exactly when n is below mean_required_n(accuracy = radius/2), and quotes
  that number."""
  import jax
  import dpjax
  need = dpjax.coinpress.mean_required_n(13, radius=50.0, epsilon=1.0, delta=1e-6, accuracy=25.0)
  X = np.random.default_rng(0).normal(size=(need, 13)) + 3
  kwargs = dict(epsilon=1.0, delta=1e-6, center=np.zeros(13), radius=50.0)
  with warnings.catch_warnings():
    warnings.simplefilter("error", dpjax.UnderpoweredWarning)
    dpjax.coinpress.coinpress_mean(jax.random.key(0), X, **kwargs)
  with pytest.warns(dpjax.UnderpoweredWarning, match=f"n ≥ {need:,} rows"):
    dpjax.coinpress.coinpress_mean(jax.random.key(0), X[:need - 1], **kwargs)
