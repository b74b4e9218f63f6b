"""The Ashtiani–Liaw exact subspace learner (docs/algorithms.md §3.3): exact recovery of range(Σ),
the threshold edge, ⊥ cases, robustness, determinism and clear errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import NeighboringRelation

from dpjax import metrics
from dpjax.results import UnderpoweredWarning
from dpjax.mechanisms import truncated_laplace_survival
from dpjax.ashtiani_liaw import al_subspace, al_subspace_parameters, released_basis
from dpjax.ashtiani_liaw.exact_subspace import al_subspace_core

EPS, DELTA = 1.0, 1e-6
N, D = 2000, 10                  # one shape for most tests (default k = 200 groups of 10 rows)


def _gaussian(seed, r, spread=0.0, n=N, d=D):
  """Rows of N(0, Σ), Σ = U diag(λ) Uᵀ of rank r with λ log-spaced in [10^-spread, 10^spread]."""
  rng = np.random.default_rng(seed)
  U = np.linalg.qr(rng.standard_normal((d, r)))[0]
  lam = np.logspace(-spread, spread, r)
  return (rng.standard_normal((n, r)) * np.sqrt(lam)) @ U.T, U


def _distance(basis, U):
  with jax.enable_x64(True):
    return float(metrics.projection_distance(jnp.asarray(np.asarray(basis, np.float64)),
                                             jnp.asarray(U, jnp.float64)))


def _recovered(res, U):
  basis = released_basis(res)
  return (bool(res.ok) and res.basis.shape == (U.shape[0],) * 2 and basis.shape == U.shape
          and int(res.released["rank"]) == U.shape[1]
          and _distance(basis, U) <= U.shape[0] * res.info["snap_scale"])


@pytest.mark.parametrize("seed,r,spread", [
    (0, 1, 0.0), (2, 6, 1.0), (4, 4, 4.0),
    pytest.param(1, 3, 0.0, marks=pytest.mark.slow(reason="r = 3, equal eigenvalues; the default "
                                                          "run recovers r = 1, 6 and 4")),
    pytest.param(3, 9, 0.0, marks=pytest.mark.slow(reason="r = 9 = d − 1, the largest proper rank; "
                                                          "the default run recovers r ≤ 6")),
    pytest.param(5, 7, 4.0, marks=pytest.mark.slow(reason="a second spread-4 range (r = 7); the "
                                                          "default run checks spread 4 at r = 4"))])
def test_exact_recovery_of_the_range(seed, r, spread):
  """spread 4: nonzero eigenvalues span 1e-4..1e4 (condition number 1e8 within the range)."""
  X, U = _gaussian(seed, r, spread)
  res = al_subspace(jax.random.key(seed), X, epsilon=EPS, delta=DELTA)
  assert _recovered(res, U), (seed, r, res.info, _distance(res.basis, U) if res.ok else None)
  assert res.neighboring == NeighboringRelation.REPLACE_ONE and res.epsilon == EPS and res.delta == DELTA
  assert res.basis.dtype == jnp.result_type(float)
  basis = released_basis(res)
  np.testing.assert_allclose(basis.T @ basis, np.eye(r), atol=1e-6)
  assert np.all(np.asarray(res.basis)[:, r:] == 0)                 # static (d, d): zeros after r
  k = res.info["num_groups"]
  assert k == max(res.info["min_groups"], min(N // D, 4 * res.info["min_groups"]))
  assert res.info["group_size"] == N // k >= D


def test_float32_input_and_integer_input():
  X, U = _gaussian(6, 3)
  res = al_subspace(jax.random.key(6), jnp.asarray(X, jnp.float32), epsilon=EPS, delta=DELTA)
  assert res.info["rank_tol"] == 1e-5 and res.info["snap_scale"] == pytest.approx(1e-3)
  assert _recovered(res, U)
  # Integer rows in span{(1, 1, 0, ...), (0, 1, −1, 0, ...)}: used exactly.
  rng = np.random.default_rng(7)
  coef = rng.integers(-5, 6, (N, 2))
  B = np.zeros((2, D), np.int64)
  B[0, :2] = 1
  B[1, 1:3] = (1, -1)
  res = al_subspace(jax.random.key(7), coef @ B, epsilon=EPS, delta=DELTA)
  assert _recovered(res, np.linalg.qr(B.T.astype(float))[0])


def test_full_rank_data_release_the_whole_space():
  """Full rank: every group's projection is I, so they agree and the answer is R^d (correct:
  range(Σ) = R^d)."""
  X = np.random.default_rng(8).standard_normal((N, D))
  res = al_subspace(jax.random.key(8), X, epsilon=EPS, delta=DELTA)
  assert _recovered(res, np.eye(D))


def test_zero_data_release_the_zero_subspace():
  res = al_subspace(jax.random.key(9), np.zeros((N, D)), epsilon=EPS, delta=DELTA)
  assert bool(res.ok) and int(res.released["rank"]) == 0 and np.all(np.asarray(res.basis) == 0)


def test_bottom_when_groups_disagree():
  # Scattered rows, each along a random coordinate axis: a group of 10 spans the axes it happens
  # to hold, a random subset, so groups disagree (c* is small) and the answer is ⊥.
  rng = np.random.default_rng(10)
  X = np.zeros((N, D))
  X[np.arange(N), rng.integers(0, D, N)] = rng.standard_normal(N)
  res = al_subspace(jax.random.key(10), X, epsilon=EPS, delta=DELTA)
  assert not bool(res.ok) and int(res.released["rank"]) == 0
  assert jnp.all(res.basis == 0)
  # Rank-3 data with outliers in most groups: spoiled groups span distinct 4- or 5-dim spaces.
  X, _ = _gaussian(11, 3)
  X[:400] = np.random.default_rng(12).standard_normal((400, D)) * 10
  oks = [bool(al_subspace(jax.random.key(s), X, epsilon=EPS, delta=DELTA).ok) for s in range(3)]
  assert not any(oks)


def test_outliers_in_fewer_than_the_tolerated_groups_still_recover():
  X, U = _gaussian(13, 3)
  info = al_subspace_parameters(N, D, epsilon=EPS, delta=DELTA)
  tolerated = info.num_groups - info.sure_pass_count
  assert tolerated > 0
  # Each outlier row spoils at most one group, whatever the permutation: a sure pass.
  X[-tolerated:] = np.random.default_rng(14).standard_normal((tolerated, D)) * 1e3
  for s in range(3):
    res = al_subspace(jax.random.key(20 + s), X, epsilon=EPS, delta=DELTA)
    assert _recovered(res, U), (s, res.info)
    assert res.info["outlier_groups_tolerated"] == tolerated


def _line_data(agree, k, d=3, seed=0):
  """k rows = k groups of one row: ``agree`` on the line e0 (different lengths), the others in
  distinct generic directions (each its own group of size 1). c* = agree for every permutation."""
  rng = np.random.default_rng(seed)
  X = rng.standard_normal((k, d))
  X[:agree] = 0.0
  X[:agree, 0] = rng.uniform(0.5, 3.0, agree) * rng.choice([-1.0, 1.0], agree)
  return X


def test_threshold_edge():
  """Groups of one row (k = n = 61, d = 3), so c* is the number of rows on the line e0 for every
  permutation. c* ≤ ⌊k/2⌋ + 1 gives ⊥ surely; ⌊k/2⌋ + 2 passes with probability δ/1.1 (≈ never);
  c* ≥ sure_pass_count passes surely with the agreed line; c* ≈ ⌊k/2⌋ + 1 + A about half the time.
  """
  k, trials = 61, 100
  params = al_subspace_parameters(k, 3, epsilon=EPS, delta=DELTA, num_groups=k)
  assert params.majority == 31 and params.group_size == 1
  assert params.sure_pass_count == 31 + math.floor(2 * params.tlap_bound) + 1

  # The trials of a layout in one traced call (al_subspace is traceable with x64 on, with the
  # eager call's result per key: test_tracing): one compile instead of 600 eager calls.
  batched = jax.jit(jax.vmap(lambda key, X: al_subspace(key, X, epsilon=EPS, delta=DELTA,
                                                        num_groups=k), in_axes=(0, None)))
  keys = jnp.stack([jax.random.key(s) for s in range(trials)])

  def runs(agree):
    with jax.enable_x64(True):
      out = jax.tree.map(np.asarray, batched(keys, jnp.asarray(_line_data(agree, k))))
    return [jax.tree.map(lambda a: a[i], out) for i in range(trials)]

  for agree in (0, 1, params.majority, params.majority + 1):
    out = runs(agree)
    assert not any(bool(r.ok) for r in out), agree
    assert all(np.all(np.asarray(r.basis) == 0) and int(r.released["rank"]) == 0
               for r in out)                               # ⊥ carries nothing
  out = runs(params.sure_pass_count)
  assert all(_recovered(r, np.eye(3)[:, :1]) for r in out)
  rate = np.mean([bool(r.ok) for r in runs(params.majority + round(params.tlap_bound))])
  assert 0.2 < rate < 0.8                                  # P[Z > A − round(A)] ≈ 1/2
  # The traceable core decides the same way and releases zeros on ⊥.
  with jax.enable_x64(True):
    ok, proj = al_subspace_core(jax.random.key(0), jnp.asarray(_line_data(31, k)), params)
    assert not bool(ok) and np.all(np.asarray(proj) == 0)


def test_determinism_and_key_dependence():
  X, U = _gaussian(15, 2)
  a = al_subspace(jax.random.key(40), X, epsilon=EPS, delta=DELTA)
  b = al_subspace(jax.random.key(40), X, epsilon=EPS, delta=DELTA)
  c = al_subspace(jax.random.key(41), X, epsilon=EPS, delta=DELTA)
  np.testing.assert_array_equal(np.asarray(a.basis), np.asarray(b.basis))
  assert a.info == b.info
  assert _recovered(c, U) and not np.array_equal(np.asarray(a.projection),
                                                 np.asarray(c.projection))  # new offset ω


def test_default_parameters():
  p = al_subspace_parameters(N, D, epsilon=EPS, delta=DELTA)
  a = math.log1p(math.expm1(EPS) / (2 * DELTA / 1.1)) / EPS
  assert p.tlap_bound == pytest.approx(a) and p.min_groups == math.ceil(4 * a) + 3
  assert p.tlap_delta == pytest.approx(DELTA / 1.1)
  # Unanimous groups pass surely at k_min: ⌈k/2⌉ > 2A + 1.
  assert math.ceil(p.min_groups / 2) > 2 * p.tlap_bound + 1
  assert p.threshold == pytest.approx(p.num_groups // 2 + 1 + a)
  e_f = 100 * D * 2.0**-53
  assert p.snap_scale == pytest.approx(min(10 * D * e_f / (DELTA / 11), 0.01 / D))
  assert al_subspace_parameters(10**6, 100, epsilon=EPS, delta=DELTA).snap_scale == 1e-4  # cap


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(X=np.full((N, D), np.nan)), ValueError, "NaN"),
    (dict(X=np.full((N, D), np.inf)), ValueError, "infinite"),
    (dict(X=np.ones((N, D, 1))), ValueError, "2 dimensions"),
    (dict(X=np.ones(N)), ValueError, "2 dimensions"),
    (dict(X=np.ones((N, D)), epsilon=0.0), ValueError, "epsilon"),
    (dict(X=np.ones((N, D)), epsilon=-1.0), ValueError, "epsilon"),
    (dict(X=np.ones((N, D)), delta=0.5), ValueError, "delta"),
    (dict(X=np.ones((N, D)), delta=0.0), ValueError, "delta"),
    (dict(X=np.ones((100, D))), ValueError, "n too small: needs at least 590 rows"),
    (dict(X=np.ones((N, D)), num_groups=2), ValueError, "num_groups"),
    (dict(X=np.ones((N, D)), num_groups=N + 1), ValueError, "num_groups"),
    (dict(X=np.ones((N, D)), num_groups=10.0), TypeError, "num_groups"),
    (dict(X=np.ones((N, D)), rank_tol=1.0), ValueError, "rank_tol"),
    (dict(X=np.ones((N, D)), snap_scale=0.5), ValueError, "snap_scale"),
    (dict(X=np.ones((N, D)), snap_scale=0.0), ValueError, "snap_scale"),
    (dict(X=np.ones((N, D)), key=0), TypeError, "key"),
])
def test_clear_errors(kwargs, exc, match):
  args = dict(key=jax.random.key(0), epsilon=EPS, delta=DELTA)
  args.update(kwargs)
  X = args.pop("X")
  key = args.pop("key")
  with pytest.raises(exc, match=match):
    al_subspace(key, X, **args)


@pytest.mark.slow(reason="the warned pass probability vs the empirical rate; the threshold "
                         "tests run by default")
def test_small_num_groups_refused_or_warned_with_the_true_pass_probability():
  """Issue 10 §6: k ≤ 4 is refused (unanimous groups pass with probability δ/1.1); below the
  sure-pass k the warning's probability is what unanimous groups (c* = k) actually achieve."""
  with pytest.raises(ValueError, match="num_groups=4"):
    al_subspace_parameters(4, 3, epsilon=EPS, delta=DELTA, num_groups=4)
  k, trials = 30, 2000
  with pytest.warns(UnderpoweredWarning, match="num_groups=30 < min_groups"):
    params = al_subspace_parameters(k, 3, epsilon=EPS, delta=DELTA, num_groups=k)
  best = truncated_laplace_survival(
      params.threshold - k, 1.0 / params.tlap_epsilon, params.tlap_bound)
  X = _line_data(k, k)                                    # every group of one row on e0: c* = k
  with jax.enable_x64(True):
    oks = jax.vmap(lambda key: al_subspace_core(key, jnp.asarray(X), params)[0])(
        jax.random.split(jax.random.key(1), trials))
  rate = float(np.mean(np.asarray(oks)))
  assert 0.05 < best < 0.95
  assert abs(rate - best) < 4.5 * math.sqrt(best * (1 - best) / trials), (rate, best)
