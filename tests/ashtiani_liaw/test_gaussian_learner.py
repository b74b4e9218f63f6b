"""learn_covariance (AL + CoinPress) and learn_gaussian (docs/algorithms.md §3.5–3.6) on model data."""

import jax
import numpy as np
import pytest
from dp_accounting import NeighboringRelation

from dpjax import metrics
from dpjax.ashtiani_liaw import (covariance_calibration, gaussian_batch_sizes, learn_covariance,
                              learn_covariance_plan, learn_covariance_required_n, learn_gaussian)
from dpjax.ashtiani_liaw.calibration import _candidate_accuracy, simulated_candidate_accuracy
from dpjax.ashtiani_liaw.covariance import REFINE_ACCURACY
from dpjax.coinpress import covariance_required_n

EPS, DELTA = 20.0, 1e-6


def _sigma(rng, d, rank, lo=-4.0, hi=4.0):
  U, _ = np.linalg.qr(rng.normal(size=(d, d)))
  ev = np.zeros(d)
  ev[:rank] = 10.0 ** np.linspace(lo, hi, rank)
  return U, ev


def _rows(rng, n, U, ev, mu):
  return mu + (rng.normal(size=(n, U.shape[0])) * np.sqrt(ev)) @ U.T


@pytest.fixture(scope="module")
def d3_calibration():
  """The AL step's calibration at d = 3 (EPS, DELTA): its group-size simulation is most of the
  cost of the tests that plan or run learn_covariance there, so they share it."""
  return covariance_calibration(3, EPS, DELTA, eta_accuracy=None)


@pytest.fixture(scope="module")
def d3_required_n():
  return learn_covariance_required_n(3, EPS, DELTA)


@pytest.fixture(scope="module")
def singular_gaussian():
  rng = np.random.default_rng(0)
  d, r = 4, 2
  U, ev = _sigma(rng, d, r)
  mu = rng.normal(size=d) * 1e6                         # unbounded mean
  small = dict(min_group_size=500)                      # utility knob only (keeps the test fast)
  need = 4 * covariance_calibration(r, EPS, DELTA, eta_accuracy=0.5, **small).required_n
  n = int(need / (2 / 3) * 1.05) + 60_000
  X = _rows(rng, n, U, ev, mu)
  return X, U, ev, mu, r, learn_gaussian(jax.random.key(1), X, epsilon=EPS, delta=DELTA,
                                         covariance_kwargs=small)


@pytest.mark.slow(reason="accuracy on a rank-2 Gaussian in R^4, ‖μ‖ ≈ 1e6; the default run "
                         "learns a full-rank one")
def test_learn_gaussian_recovers_a_singular_gaussian_with_a_huge_mean(singular_gaussian):
  X, U, ev, mu, r, res = singular_gaussian
  assert res.ok and res.failed_step_name is None and int(res.released["rank"]) == r
  assert res.neighboring == NeighboringRelation.REPLACE_ONE and res.epsilon == EPS and res.delta == DELTA
  Ur, Sr = U[:, :r], np.diag(ev[:r])
  cov_err = metrics.covariance_error(Ur.T @ res.covariance @ Ur, Sr)
  mean_err = metrics.mahalanobis_error(Ur.T @ res.mean, Ur.T @ mu, Sr)
  # Released covariance lives in the released subspace: nothing outside range(Σ) beyond the
  # snapping grid of the subspace step.
  outside = np.linalg.norm(U[:, r:].T @ res.covariance @ U[:, r:])
  assert cov_err < 0.05, cov_err
  assert mean_err < 0.05, mean_err
  assert outside <= 1e-3 * ev.max()
  tv = metrics.gaussian_tv(jax.random.key(2), Ur.T @ mu, Sr, Ur.T @ res.mean,
                           Ur.T @ res.covariance @ Ur, num_samples=20_000)
  assert tv["tv"] < 0.05 and tv["pinsker"] < 0.1, tv
  # The mean outside the subspace, relative to the scale of the data (‖μ‖ ≈ 1e6).
  assert np.linalg.norm(U[:, r:].T @ (res.mean - mu)) <= 1e-6 * np.linalg.norm(mu)


@pytest.mark.slow(reason="a failure in the covariance step (Cauchy rows); the default run checks "
                         "the subspace step's")
def test_learn_gaussian_names_the_failed_step_on_heavy_tails():
  rng = np.random.default_rng(3)
  d = 3
  small = dict(min_group_size=50)
  need = 4 * covariance_calibration(d, EPS, DELTA, eta_accuracy=0.5, **small).required_n
  n = int(need / (2 / 3) * 1.05) + 60_000
  X = rng.standard_cauchy(size=(n, d))                  # group covariances scatter wildly
  res = learn_gaussian(jax.random.key(4), X, epsilon=EPS, delta=DELTA, covariance_kwargs=small)
  assert not res.ok and res.failed_step_name == "covariance"
  assert np.all(res.mean == 0) and np.all(res.covariance == 0)


def test_learn_gaussian_subspace_bottom_on_disagreeing_groups():
  # Sparse rows: about half the subspace step's groups see only zeros, the rest a line.
  d = 3
  n1, n2, n3, n4 = gaussian_batch_sizes(200_000, d, epsilon=EPS, delta=DELTA)
  X = np.zeros((200_000, d))
  k = 4 * 3                                             # a handful of non-zero rows
  X[np.arange(0, n1, n1 // k)[:k]] = np.array([1.0, 2.0, 3.0])
  res = learn_gaussian(jax.random.key(5), X, epsilon=EPS, delta=DELTA)
  assert not res.ok and res.failed_step_name == "subspace"


@pytest.mark.slow(reason="the refinement's accuracy at the required n (κ = 1e12); the default run "
                         "checks the plan")
def test_learn_covariance_refinement_beats_the_preconditioner():
  """At exactly learn_covariance_required_n (the AL step's rows plus CoinPress's minimum) on a
  condition number of 1e12: the refinement meets its target and beats the preconditioner."""
  rng = np.random.default_rng(6)
  d = 3
  U, ev = _sigma(rng, d, d, -6.0, 6.0)                  # condition number 1e12
  n = learn_covariance_required_n(d, EPS, DELTA)
  plan = learn_covariance_plan(n, d, epsilon=EPS, delta=DELTA)
  X = _rows(rng, n, U, ev, 0.0)
  Sigma = U @ np.diag(ev) @ U.T
  # Same key and rows as the AL step inside the refined call: exactly its preconditioner.
  coarse = learn_covariance(jax.random.key(7), X[:plan.coarse_rows], epsilon=EPS, delta=DELTA,
                            refine=False)
  again = learn_covariance(jax.random.key(7), X[:plan.coarse_rows], epsilon=EPS, delta=DELTA,
                           refine=False)
  np.testing.assert_array_equal(coarse.estimate, again.estimate)       # fixed key: same output
  fine = learn_covariance(jax.random.key(7), X, epsilon=EPS, delta=DELTA)
  assert coarse.ok and fine.ok and fine.info["refine"]
  assert fine.info["refine_rows"] == fine.info["refine_min_rows"] == n - plan.coarse_rows
  e_coarse = metrics.covariance_error(coarse.estimate, Sigma)
  e_fine = metrics.covariance_error(fine.estimate, Sigma)
  assert e_coarse <= fine.info["preconditioner_factor"] - 1.0           # Σ/K ⪯ Σ̃ ⪯ KΣ
  assert e_fine < REFINE_ACCURACY and e_fine < e_coarse / 3, (e_coarse, e_fine)
  np.testing.assert_allclose(fine.estimate, fine.estimate.T)
  assert np.linalg.eigvalsh(fine.estimate)[0] > 0


def test_learn_covariance_default_split_gives_the_al_step_its_required_rows(d3_calibration,
                                                                          d3_required_n):
  d, n, cal = 3, 10**7, d3_calibration
  plan = learn_covariance_plan(n, d, epsilon=EPS, delta=DELTA)
  assert plan.coarse_rows == cal.required_n and plan.refine_rows == n - cal.required_n
  assert plan.al.calibration == cal._replace(required_n=cal.required_n)
  K = plan.preconditioner_factor
  assert plan.refine_min_rows == covariance_required_n(d, kappa=K * K, epsilon=EPS, delta=DELTA,
                                                       accuracy=REFINE_ACCURACY)
  total = d3_required_n
  assert total == cal.required_n + plan.refine_min_rows
  assert learn_covariance_required_n(d, EPS, DELTA, unknown_mean=True) == (
      2 * cal.required_n + 2 * plan.refine_min_rows)
  assert learn_covariance_plan(total, d, epsilon=EPS, delta=DELTA).refine_rows == (
      plan.refine_min_rows)
  # The user's split instead: a fixed number or a share of the rows for the AL step.
  assert learn_covariance_plan(n, d, epsilon=EPS, delta=DELTA,
                               coarse_rows=2 * cal.required_n).coarse_rows == 2 * cal.required_n
  wide = learn_covariance_plan(n, d, epsilon=EPS, delta=DELTA, coarse_fraction=0.5)
  assert wide.coarse_rows == n // 2
  no_refine = learn_covariance_plan(n, d, epsilon=EPS, delta=DELTA, refine=False)
  assert (no_refine.coarse_rows, no_refine.refine_rows) == (n, 0)
  # K = (1 + c)(1 + α) at the AL step's actual group size: more rows per group, smaller K.
  assert 1.0 + cal.mask_accuracy < wide.preconditioner_factor < K


@pytest.mark.parametrize("bad, match", [
    (dict(coarse_rows=10, coarse_fraction=0.5), "at most one"),
    (dict(coarse_rows=10**7), "leaves no rows"),
    (dict(coarse_fraction=1.0), "coarse_fraction"),
    (dict(refine=False, coarse_rows=10), "refine=False"),
    (dict(refine_accuracy=0.0), "refine_accuracy")])
def test_learn_covariance_plan_rejects_bad_splits(bad, match):
  with pytest.raises(ValueError, match=match):
    learn_covariance_plan(10**7, 3, epsilon=EPS, delta=DELTA, **bad)


def test_learn_covariance_raises_with_the_required_n(d3_calibration, d3_required_n):
  """Rows enough for the AL step but not for the refinement: the message gives the total."""
  total, coarse = d3_required_n, d3_calibration.required_n
  X = np.random.default_rng(8).normal(size=(coarse + 10, 3))
  with pytest.raises(ValueError, match=rf"learn_covariance needs n >= {total} rows for d=3.*"
                                       rf"{coarse} for its AL step.*got n={coarse + 10} "
                                       r"\(10 left for the refinement\)"):
    learn_covariance(jax.random.key(0), X, epsilon=EPS, delta=DELTA)
  # refine_accuracy=None: any two refinement rows do.
  res = learn_covariance(jax.random.key(0), X, epsilon=EPS, delta=DELTA, refine_accuracy=None)
  assert res.info["refine_rows"] == 10 and res.info["refine_min_rows"] == 0


@pytest.mark.parametrize("bad, match", [
    (dict(epsilon=0.0), "epsilon"), (dict(delta=0.7), "delta"),
    (dict(batch_sizes=(10, 10, 10)), "batch_sizes"), (dict(beta=0.0), "beta")])
def test_learn_gaussian_rejects_bad_arguments(bad, match):
  X = np.random.default_rng(9).normal(size=(400_000, 3))
  kwargs = dict(epsilon=EPS, delta=DELTA) | bad
  with pytest.raises(ValueError, match=match):
    learn_gaussian(jax.random.key(0), X, **kwargs)


def test_learn_gaussian_rejects_nan_and_too_few_rows():
  X = np.ones((1000, 3))
  X[0, 0] = np.nan
  with pytest.raises(ValueError, match="NaN"):
    learn_gaussian(jax.random.key(0), X, epsilon=EPS, delta=DELTA)
  with pytest.raises(ValueError, match="rows"):
    learn_gaussian(jax.random.key(0), np.ones((50, 3)), epsilon=EPS, delta=DELTA)


def test_learn_gaussian_on_all_zero_rows():
  """Before: ZeroDivisionError from the analytic Gaussian calibration. All-zero rows have rank 0
  (steps 2–3 are skipped) and step 4's released scale S ≈ 2^-1016 made PPME's radius 2^-40·S·√d
  subnormal; its masking σ was then calibrated for a subnormal sensitivity."""
  n, d = 12_000, 3
  res = learn_gaussian(jax.random.key(0), np.zeros((n, d)), epsilon=EPS, delta=DELTA)
  if res.ok:
    assert int(res.released["rank"]) == 0 and res.failed_step_name is None
    assert np.all(np.isfinite(res.mean)) and np.max(np.abs(res.mean)) < 1e-100
    np.testing.assert_array_equal(res.covariance, np.zeros((d, d)))
  else:
    assert res.failed_step_name in ("subspace", "orthogonal_mean")


def test_learn_gaussian_mean_far_out_along_a_thin_direction(d3_required_n):
  """‖μ‖ = 1e9 along an eigenvalue of 1e-6: a whitened mean of 1e12. Step 3's PPME clamped its
  float-safe release at ≈ 2^40·γ and answered ok=True with a Mahalanobis error of 8·10¹¹ until
  its grid was sized by the released scale of the rows."""
  d, need = 3, d3_required_n                  # d = 3: the calibration the other tests use
  n = next(m for m in range(3 * need, 10**9, 1000)
           if gaussian_batch_sizes(m, d, epsilon=EPS, delta=DELTA)[1] // 2 >= need)
  rng = np.random.default_rng(0)
  U, _ = np.linalg.qr(rng.standard_normal((d, d)))
  ev = np.array([1e-6, 1.0, 1.0])
  mu = 1e9 * U[:, 0]
  res = learn_gaussian(jax.random.key(1), _rows(rng, n, U, ev, mu), epsilon=EPS, delta=DELTA)
  assert res.ok
  assert metrics.mahalanobis_error(res.mean, mu, (U * ev) @ U.T) < 0.1


def test_preconditioner_factor_is_finite_at_groups_of_a_few_rows():
  """Groups of 12 rows (a user's min_group_size): the Gaussian bound on c is infinite, so c is
  simulated (the worst of 100 public replicates of k Wishart candidates) and K stays finite."""
  plan = learn_covariance_plan(10**6, 3, epsilon=1000.0, delta=1e-5, min_group_size=12,
                               coarse_rows=504)
  cal = plan.al.calibration
  assert cal.candidate_accuracy == np.inf
  assert 1.0 + cal.mask_accuracy < plan.preconditioner_factor < 1e3
  # Where the Gaussian bound is finite (200 rows), the simulated worst case lies below it (same
  # d and k as above: the simulation's program is compiled once).
  k = cal.num_groups
  assert simulated_candidate_accuracy(3, 200, k) < _candidate_accuracy(3, 200, k, cal.beta)
