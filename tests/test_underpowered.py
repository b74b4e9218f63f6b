"""Every learner treats an underpowered call the same way (issue 53): a
:class:`dpjax.UnderpoweredWarning` (or a refusal) that quotes the rows needed, exactly when n is
below its ``*_required_n`` helper's number, and that helper's number is computed from the same
noise the call adds."""

import re
import warnings

import jax
import numpy as np
import pytest

import dpjax
from dpjax import classic, subspace
from dpjax.estimators import PrivatePCA

D, K, EPS, DELTA = 12, 2, 2.0, 1e-6


def _unit_rows(n, d=D, seed=0):
  X = np.random.default_rng(seed).normal(size=(n, d)) * np.linspace(3, 0.3, d)
  return X / np.linalg.norm(X, axis=1, keepdims=True).max()


def _quoted(message):
  return [int(x.replace(",", "")) for x in re.findall(r"n ≥ ([\d,]+) rows", message)]


def _warns_exactly_below(call, need):
  """``call(n)`` warns at n = need − 1 (quoting need) and not at n = need."""
  with pytest.warns(dpjax.UnderpoweredWarning) as caught:
    call(need - 1)
  assert _quoted(str(caught[0].message)) == [need], str(caught[0].message)
  assert caught[0].filename == __file__, caught[0].filename     # points at the user's call
  with warnings.catch_warnings():
    warnings.simplefilter("error", dpjax.UnderpoweredWarning)
    call(need)


# --- private PCA: Analyze Gauss, MOD-SuLQ, PPCA ------------------------------------------------

PCA_CASES = {
    "analyze_gauss": (
        lambda n: subspace.analyze_gauss(jax.random.key(0), _unit_rows(n), epsilon=EPS,
                                         delta=DELTA, k=K, clip_norm=1.0),
        lambda: subspace.analyze_gauss_required_n(D, K, epsilon=EPS, delta=DELTA)),
    "analyze_gauss(secure=False, add/remove-one)": (
        lambda n: subspace.analyze_gauss(
            jax.random.key(0), _unit_rows(n), epsilon=EPS, delta=DELTA, k=K, clip_norm=1.0,
            secure=False, neighboring=dpjax.accounting.NeighboringRelation.ADD_OR_REMOVE_ONE),
        lambda: subspace.analyze_gauss_required_n(
            D, K, epsilon=EPS, delta=DELTA, secure=False,
            neighboring=dpjax.accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)),
    "mod_sulq": (
        lambda n: classic.mod_sulq(jax.random.key(0), _unit_rows(n), epsilon=20.0, delta=DELTA,
                                   k=K),
        lambda: classic.mod_sulq_required_n(D, K, epsilon=20.0, delta=DELTA)),
    "ppca": (
        lambda n: classic.ppca(jax.random.key(0), _unit_rows(n), epsilon=EPS, k=1),
        lambda: classic.ppca_required_n(D, 1, epsilon=EPS)),
}


@pytest.mark.parametrize("name", sorted(PCA_CASES))
def test_private_pca_warns_exactly_below_its_helpers_rows(name):
  call, need = PCA_CASES[name]
  _warns_exactly_below(call, need())


@pytest.mark.filterwarnings("ignore::dpjax.results.UnderpoweredWarning")   # 50 rows are too few
def test_pca_helpers_use_the_noise_the_call_adds():
  """The helper's number is ⌈4kσ√d/accuracy⌉ with σ the std the call reports (units of the
  bound squared), for each release option; MOD-SuLQ's larger β asks for more rows."""
  X = _unit_rows(50)
  for secure in (True, False):
    r = subspace.analyze_gauss(jax.random.key(0), X, epsilon=EPS, delta=DELTA, k=K,
                               clip_norm=1.0, secure=secure)
    for accuracy in (0.5, 0.1, 0.01):
      expected = int(np.ceil(4 * K * r.info["unit_sigma"] * np.sqrt(D) / accuracy))
      got = subspace.analyze_gauss_required_n(D, K, epsilon=EPS, delta=DELTA, secure=secure,
                                              accuracy=accuracy)
      assert abs(got - expected) <= 1, (secure, accuracy, got, expected)
    m = classic.mod_sulq(jax.random.key(0), X, epsilon=EPS, delta=DELTA, k=K, secure=secure)
    expected = int(np.ceil(4 * K * m.info["sigma"] * 50 * np.sqrt(D) / 0.1))
    got = classic.mod_sulq_required_n(D, K, epsilon=EPS, delta=DELTA, secure=secure)
    assert abs(got - expected) <= 1 and got > 3 * subspace.analyze_gauss_required_n(
        D, K, epsilon=EPS, delta=DELTA, secure=secure)
  assert classic.ppca_required_n(D, K, epsilon=EPS, accuracy=0.1) == int(
      np.ceil(K * (D - K) / EPS / 0.1))
  assert classic.ppca_required_n(D, D, epsilon=EPS) == 1          # every basis is the best one
  with pytest.raises(ValueError, match="accuracy"):
    classic.ppca_required_n(D, K, epsilon=EPS, accuracy=0.0)


def test_breast_cancer_warns_for_the_weak_release_and_not_the_default():
  """Issue 53's case: MOD-SuLQ captured 0.044 of breast_cancer's energy at k = 2, ε = 10 (the
  best basis 0.632) in silence. It now warns with mod_sulq_required_n's figure; the default
  release (Analyze Gauss, 0.609) does not."""
  from sklearn.datasets import load_breast_cancer
  X = load_breast_cancer().data
  X = (X - X.mean(0)) / X.std(0)
  X = np.clip(X, -3, 3) / (3 * np.sqrt(X.shape[1]))
  need = classic.mod_sulq_required_n(30, 2, epsilon=10.0, delta=1e-6)
  assert need > X.shape[0]
  with pytest.warns(dpjax.UnderpoweredWarning, match=f"n ≥ {need:,} rows") as caught:
    PrivatePCA(n_components=2, epsilon=10.0, delta=1e-6, data_norm=1.0, method="sulq",
               random_state=0).fit(X)
  assert caught[0].filename == __file__
  with warnings.catch_warnings():
    warnings.simplefilter("error", dpjax.UnderpoweredWarning)
    PrivatePCA(n_components=2, epsilon=10.0, delta=1e-6, data_norm=1.0, random_state=0).fit(X)


# --- private ERM: output and objective perturbation, one-vs-rest ------------------------------

def _labelled(n, d=D):
  X = _unit_rows(n, d)
  return X, np.where(X @ np.linspace(1, -1, d) > 0, 1, -1)


ERM_CASES = {
    "output": (
        lambda n: classic.output_perturbation(jax.random.key(0), *_labelled(n), epsilon=0.5),
        lambda: classic.erm_required_n(D, epsilon=0.5, method="output")),
    "objective(huber, given Λ)": (
        lambda n: classic.objective_perturbation(jax.random.key(0), *_labelled(n), epsilon=0.5,
                                                 loss="huber", regularization=0.05),
        lambda: classic.erm_required_n(D, epsilon=0.5, loss="huber", regularization=0.05)),
    "one_vs_rest": (
        lambda n: classic.one_vs_rest(jax.random.key(0), _unit_rows(n), np.arange(n) % 3,
                                      classes=[0, 1, 2], epsilon=1.5),
        lambda: classic.erm_required_n(D, epsilon=0.5)),
}


@pytest.mark.parametrize("name", sorted(ERM_CASES))
def test_private_erm_warns_exactly_below_its_helpers_rows(name):
  call, need = ERM_CASES[name]
  _warns_exactly_below(call, need())


def test_erm_helper_is_the_noise_against_the_largest_minimiser():
  """At the helper's n the noise's mean move equals ``accuracy·sqrt(2 ln 2/Λ)`` (output: d/β,
  β = ε/Δ₂, read from the call's public parameters) to within one row's change."""
  for accuracy in (1.0, 0.3):
    n = classic.erm_required_n(D, epsilon=0.5, method="output", accuracy=accuracy)
    for m, side in ((n, 1), (n - 1, -1)):
      params, info = classic.erm.erm_parameters(m, D, epsilon=0.5, method="output",
                                                release="raw")
      ratio = (D / info["beta"]) / np.sqrt(2 * np.log(2) / params.regularization)
      assert (ratio <= accuracy) if side == 1 else (ratio > accuracy), (m, ratio)
  with pytest.raises(ValueError, match="accuracy"):
    classic.erm_required_n(D, epsilon=0.5, accuracy=-1.0)


# --- DPESE ------------------------------------------------------------------------------------

def _in_a_plane(n, d=6, k=2, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.integers(-5, 6, size=(n, k)) @ rng.integers(-3, 4, size=(k, d))).astype(np.float64)


def test_dpese_warns_exactly_below_its_helpers_rows_and_releases_surely_at_it():
  need = subspace.dpese_required_n(2, epsilon=2.0, delta=1e-6)
  _warns_exactly_below(lambda n: subspace.dpese(jax.random.key(0), _in_a_plane(n), epsilon=2.0,
                                                delta=1e-6, k=2), need)
  oks = [bool(subspace.dpese(jax.random.key(s), _in_a_plane(need, seed=s), epsilon=2.0,
                             delta=1e-6, k=2).ok) for s in range(5)]
  assert all(oks)                                  # the sure gap: released on every key
  from dpjax.mechanisms.gap_max import gap_max_parameters
  params = gap_max_parameters(2.0, 1e-6 / 1.1, integer_scores=True)
  assert need == params.sure_gap                   # integer scores: h = 1
  assert subspace.dpese_required_n(2, epsilon=2.0, delta=1e-6, outliers=3) == need + 6 + 1


# --- Ashtiani–Liaw Gaussian learner -----------------------------------------------------------

def test_learn_gaussian_refuses_exactly_below_its_helpers_rows():
  """The up-front refusal quotes learn_gaussian_required_n(rank=0), the rows steps 1, 3 and 4
  need; a larger rank needs more (step 2's learn_covariance on the pair differences)."""
  from dpjax.ashtiani_liaw import learn_gaussian, learn_gaussian_required_n
  need = learn_gaussian_required_n(2, epsilon=1.0, delta=1e-6, rank=0)
  X = np.random.default_rng(0).normal(size=(need - 1, 2))
  with pytest.raises(ValueError, match=f"n ≥ {need:,} rows"):
    learn_gaussian(jax.random.key(0), X, epsilon=1.0, delta=1e-6)
  sizes = dpjax.ashtiani_liaw.gaussian_batch_sizes(need, 2, epsilon=1.0, delta=1e-6)
  assert sum(sizes) == need
  one = learn_gaussian_required_n(2, epsilon=1.0, delta=1e-6, rank=1)
  pairs = dpjax.ashtiani_liaw.learn_covariance_required_n(1, 1.0, 1e-6)
  assert one > need and dpjax.ashtiani_liaw.gaussian_batch_sizes(
      one, 2, epsilon=1.0, delta=1e-6)[1] // 2 >= pairs
  assert dpjax.ashtiani_liaw.gaussian_batch_sizes(
      one - 1, 2, epsilon=1.0, delta=1e-6)[1] // 2 < pairs


@pytest.mark.slow(reason="runs the four-step learner on 57,000 rows (about 10 s)")
def test_learn_gaussian_step_two_bottom_quotes_the_rows_for_the_released_rank():
  from dpjax.ashtiani_liaw import learn_gaussian, learn_gaussian_required_n
  need = learn_gaussian_required_n(3, epsilon=1.0, delta=1e-6, rank=0)
  X = np.random.default_rng(0).normal(size=(need, 3)) @ np.diag([1.0, 2.0, 0.0]) + 5
  with pytest.warns(dpjax.UnderpoweredWarning, match="step 2 answers ⊥") as caught:
    r = learn_gaussian(jax.random.key(0), X, epsilon=1.0, delta=1e-6)
  assert not bool(r.ok) and r.failed_step_name == "covariance"
  rank = int(r.released["rank"])
  assert _quoted(str(caught[0].message))[-1] == learn_gaussian_required_n(
      3, epsilon=1.0, delta=1e-6, rank=rank)
  assert caught[0].filename == __file__


# --- He–Vershynin–Zhu synthetic data ----------------------------------------------------------

@pytest.mark.parametrize("dim", [None, 1])
def test_synthetic_data_warns_exactly_below_its_helpers_rows(dim):
  from dpjax.synthetic import low_dimensional_synthetic_data, synthetic_required_n
  need = synthetic_required_n(3, epsilon=1.0, dim=dim)
  rng = np.random.default_rng(0)

  def call(n):
    X = np.clip(0.5 + 0.2 * rng.normal(size=(n, 1)) * [1.0, 0.5, 0.1], 0, 1)
    return low_dimensional_synthetic_data(jax.random.key(0), X, epsilon=1.0, dim=dim)
  _warns_exactly_below(call, need)
  assert synthetic_required_n(3, epsilon=1.0, accuracy=0.3) > need
  assert synthetic_required_n(3, epsilon=4.0) < need


def test_wine_synthetic_data_is_told_the_rows_it_needs():
  from sklearn.datasets import load_wine
  X = load_wine().data
  X = (X - X.min(0)) / (X.max(0) - X.min(0))      # the study's scaling (not private)
  need = dpjax.synthetic.synthetic_required_n(13, epsilon=1.0)
  with pytest.warns(dpjax.UnderpoweredWarning, match=f"n ≥ {need:,} rows"):
    dpjax.synthetic.low_dimensional_synthetic_data(jax.random.key(0), X, epsilon=1.0)


# --- DPASE's γ ----------------------------------------------------------------------------------

def test_dpase_max_gamma_is_dpase_required_n_turned_around():
  for n, d, k in ((20_000, 50, 2), (5_000, 10, 1), (100_000, 784, 10)):
    g = subspace.dpase_max_gamma(n, d, k, epsilon=1.0, delta=1e-6)
    assert 0 < g < 0.5
    assert subspace.dpase_required_n(d, k, epsilon=1.0, delta=1e-6, gamma=0.999 * g) <= n
    assert subspace.dpase_required_n(d, k, epsilon=1.0, delta=1e-6, gamma=1.001 * g) > n
  assert subspace.dpase_max_gamma(100, 50, 2, epsilon=1.0, delta=1e-6) is None


def test_dpase_without_gamma_says_what_gamma_is_and_which_the_rows_could_support():
  """A statistician who does not know γ is told what it is, how to get it, and the largest γ
  the agreement bound allows at their n."""
  n, d, k = 6_000, 20, 2
  X, _ = dpjax.data.approximate_subspace_data(jax.random.key(0), n, d, k, gamma=1e-4)
  largest = subspace.dpase_max_gamma(n, d, k, epsilon=2.0, delta=1e-6)
  with pytest.raises(ValueError, match=rf"sqrt\(λ_{{k\+1}}/λ_k\).*gamma < {largest:.3g}"):
    subspace.dpase(jax.random.key(1), X, epsilon=2.0, delta=1e-6, k=k)
  with pytest.raises(ValueError, match="for no gamma"):
    subspace.dpase(jax.random.key(1), X[:200], epsilon=2.0, delta=1e-6, k=k)


def test_dp_sgds_input_projection_does_not_warn_about_captured_energy():
  """private_input_basis feeds a model judged by accuracy (DP-PCA before DP-SGD at a small ε_s):
  Analyze Gauss's captured-energy warning is not its criterion, so it stays silent there."""
  X = _unit_rows(300)
  assert 300 < subspace.analyze_gauss_required_n(D, 6, epsilon=0.3, delta=1e-6)
  with warnings.catch_warnings():
    warnings.simplefilter("error", dpjax.UnderpoweredWarning)
    r = dpjax.sgd.private_input_basis(jax.random.key(0), X, 6, epsilon=0.3, delta=1e-6,
                                      clip_norm=1.0)
  assert r.basis.shape == (D, 6)


def test_dpaseb_restates_its_blocks_warning_in_the_users_rows():
  """Each block's DPASE would quote rows per block; DPASEB warns once, in the user's n: T
  blocks times dpase_required_n, at the user's line."""
  n, d, k, gamma = 4_000, 10, 1, 0.2
  X, _ = dpjax.data.approximate_subspace_data(jax.random.key(0), n, d, k, gamma=gamma)
  with pytest.warns(dpjax.UnderpoweredWarning) as caught:
    r = subspace.dpaseb(jax.random.key(1), X, epsilon=1.0, delta=1e-6, k=k, alpha=0.3,
                        gamma=gamma, num_blocks=4)
  assert len(caught) == 1, [str(w.message) for w in caught]
  per_block = subspace.dpase_required_n(d, k, epsilon=1.0, delta=1e-6, gamma=gamma)
  assert f"{4 * per_block:,} rows" in str(caught[0].message)
  assert caught[0].filename == __file__ and "DPASEB" in str(caught[0].message)
  assert r.basis.shape == (d, k)
