"""The stability-based histogram (docs/algorithms.md §1.5)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import NeighboringRelation
from scipy import stats

from dpjax import mechanisms as M
from dpjax.mechanisms import discrete, histogram
from dpjax.metrics import clopper_pearson


def _singleton_pass_probability(epsilon, delta, neighboring):
  """Exact probability that a bin holding one item is released."""
  tau = M.histogram_threshold(epsilon, delta, neighboring=neighboring)
  sens = 2 if neighboring == NeighboringRelation.REPLACE_ONE else 1
  return discrete.discrete_laplace_tail(int(tau) - 1, discrete.effective_scale(sens / epsilon))


def test_thresholds_follow_the_formulas():
  d = 1e-6
  p = math.exp(-1 / 2)
  assert M.histogram_threshold(1.0, d) == 1 + math.ceil(2 * math.log(1 / (d * (1 + p))))
  p = math.exp(-1)
  assert M.histogram_threshold(1.0, d, neighboring=NeighboringRelation.ADD_OR_REMOVE_ONE) == 1 + math.ceil(
      math.log(1 / (d * (1 + p))))
  assert isinstance(M.histogram_threshold(1.0, d), float)


@pytest.mark.parametrize("epsilon", [0.1, 0.3, 1.0, 2.5])
@pytest.mark.parametrize("delta", [1e-9, 1e-5, 0.05])
@pytest.mark.parametrize("neighboring", [NeighboringRelation.REPLACE_ONE, NeighboringRelation.ADD_OR_REMOVE_ONE])
def test_singleton_passes_with_probability_at_most_and_close_to_delta(epsilon, delta,
                                                                      neighboring):
  dis = _singleton_pass_probability(epsilon, delta, neighboring)
  p = math.exp(-1 / discrete.effective_scale((2 if neighboring == NeighboringRelation.REPLACE_ONE else 1)
                                             / epsilon))
  assert p * delta < dis <= delta                 # τ is the smallest integer threshold that works


TRIALS = 2_000                                       # one batch size: compiled programs are reused
SINGLETONS = jnp.arange(4, dtype=jnp.int32)[:, None] * 1000     # four singleton bins


def _released_per_trial(seed, items, **kwargs):
  keys = jax.random.split(jax.random.key(seed), TRIALS)
  return jax.vmap(lambda k: M.stable_histogram(k, items, epsilon=1.0, **kwargs))(keys)


@pytest.mark.parametrize("neighboring", [NeighboringRelation.REPLACE_ONE, NeighboringRelation.ADD_OR_REMOVE_ONE])
def test_singleton_release_frequency_matches_the_exact_probability(neighboring):
  eps, delta = 1.0, 0.05
  hist = _released_per_trial(0, SINGLETONS, delta=delta, neighboring=neighboring)
  hits, n = int(hist.released.sum()), 4 * TRIALS
  exact = _singleton_pass_probability(eps, delta, neighboring)
  low, high = clopper_pearson(hits, n, 0.999)
  assert low <= exact <= high and exact <= delta


@pytest.mark.slow(reason="a popular bin beside bins below τ; the default run checks singletons "
                         "and the release order")
def test_popular_bin_is_released_first_and_small_bins_stay_hidden():
  items = jnp.array([[1, 2]] * 80 + [[5, 5]] * 3 + [[7, 0]], jnp.int32)
  keys = jax.random.split(jax.random.key(1), 50)
  hist = jax.vmap(lambda k: M.stable_histogram(k, items, epsilon=1.0, delta=1e-6))(keys)
  ok, bin_key, count = M.top_bin(jax.tree_util.tree_map(lambda x: x[0], hist))
  assert bool(ok) and bin_key.tolist() == [1, 2] and abs(int(count) - 80) < 20
  assert bool(jnp.all(hist.released[:, 0])) and bool(jnp.all(hist.bins[:, 0] == jnp.array([1, 2])))
  assert bool(jnp.all(hist.released.sum(axis=1) == 1))          # 3 items never clear τ = 28
  assert bool(jnp.all(hist.bins[:, 1:] == 0)) and bool(jnp.all(hist.noisy_counts[:, 1:] == 0))


def test_nothing_released_gives_placeholders():
  hist = _released_per_trial(2, SINGLETONS, delta=1e-9)
  assert not bool(jnp.any(hist.released))
  ok, bin_key, count = M.top_bin(jax.tree_util.tree_map(lambda x: x[0], hist))
  assert not bool(ok) and bin_key.tolist() == [0] and int(count) == 0
  assert hist.bins.shape == (TRIALS, 4, 1) and hist.bins.dtype == jnp.int32
  assert hist.noisy_counts.dtype == jnp.int32 and hist.released.dtype == jnp.bool_
  assert bool(jnp.all(hist.bins == 0)) and bool(jnp.all(hist.noisy_counts == 0))


def test_one_noise_draw_per_bin_not_per_item():
  """With all t items equal, one row is released and its count is t plus ONE noise draw."""
  t, eps = 24, 1.0
  hist = _released_per_trial(3, jnp.full((t, 1), 9, jnp.int32), delta=0.3)
  assert bool(jnp.all(hist.released.sum(axis=1) == 1)) and bool(jnp.all(hist.released[:, 0]))
  assert bool(jnp.all(hist.bins[:, 0, 0] == 9))
  noise_draws = np.asarray(hist.noisy_counts[:, 0], np.float64) - t
  p = math.exp(-eps / 2)
  one_draw_var = 2 * p / (1 - p) ** 2                      # ≈ 7.9; t draws would be 24× that
  support = np.arange(-12, 13)
  probs = (1 - p) / (1 + p) * p ** np.abs(support)
  probs[0] = probs[-1] = p**12 / (1 + p)
  observed = np.bincount(np.clip(noise_draws.astype(int), -12, 12) + 12, minlength=25)
  assert stats.chisquare(observed, probs * TRIALS).pvalue > 1e-3
  assert 0.8 < noise_draws.var() / one_draw_var < 1.2


def test_laplace_noise_option_is_refused_with_the_reason():
  """Regression (issue 10 §1): float32 Laplace counts leaked through floating point."""
  for call in (lambda: M.histogram_threshold(1.0, 1e-6, noise="laplace"),
               lambda: M.stable_histogram(jax.random.key(0), jnp.ones((3, 1), jnp.int32),
                                          epsilon=1.0, delta=1e-6, noise="laplace")):
    with pytest.raises(ValueError, match="floating|float32"):
      call()


def _items_with_duplicates(key, t, d, high):
  a = jax.random.randint(key, (t // 2, d), 0, high).astype(jnp.int32)
  return jnp.concatenate([a, a[: t - t // 2][::-1]])


MIXED = jnp.concatenate([_items_with_duplicates(jax.random.key(5), 90, 4, 3),
                         jnp.tile(jnp.array([[0, 1, 2, 0]], jnp.int32), (30, 1))])


@pytest.mark.slow(reason="both groupings and auto give one histogram; each is checked against "
                         "numpy.unique by default")
def test_pairwise_and_hash_grouping_agree():
  key = jax.random.key(4)
  a = M.stable_histogram(key, MIXED, epsilon=1.0, delta=1e-2, grouping="pairwise")
  b = M.stable_histogram(key, MIXED, epsilon=1.0, delta=1e-2, grouping="hash")
  c = M.stable_histogram(key, MIXED, epsilon=1.0, delta=1e-2)                  # auto
  for x in (b, c):
    assert all(jnp.array_equal(u, w) for u, w in zip(a[:3], x[:3]))
  assert int(a.released.sum()) >= 1 and a.bins[0].tolist() == [0, 1, 2, 0]


def test_grouping_matches_numpy_unique_including_chunked_and_adversarial_keys(monkeypatch):
  # Keys that differ by large powers of two (a plain linear hash mod 2^32 would be weak there),
  # int32 extremes, and many duplicates; chunking over D forced by tiny limits.
  base = np.array([[0, 0, 0, 0, 0, 0, 0], [2**31 - 1, 0, 0, 0, 0, 0, 0],
                   [-(2**31), 0, 0, 0, 0, 0, 0], [0, 2**30, 0, 0, 0, 0, 2**30],
                   [0, 0, 0, 0, 0, 0, 2**31 - 2**16], [1 << 24, 1 << 25, 0, 0, 0, 0, 0],
                   [0, 0, 0, 0, 0, 0, 1]], np.int32)
  rng = np.random.default_rng(0)
  items = base[rng.integers(0, len(base), 37)]
  monkeypatch.setattr(histogram, "_PAIRWISE_LIMIT", 37 * 37 * 3)
  monkeypatch.setattr(histogram, "_CHUNK_ELEMENTS", 37 * 2 * 2)
  _, first_index, counts = np.unique(items, axis=0, return_index=True, return_counts=True)
  expected_group = {tuple(items[i]): i for i in sorted(first_index)}
  for grouping in ("pairwise", "hash"):
    group_fn = (histogram._group_pairwise if grouping == "pairwise" else
                lambda x: histogram._group_hash(jax.random.key(6), x))
    group = np.asarray(jax.jit(group_fn)(jnp.asarray(items)))
    assert [group[i] for i in range(len(items))] == [expected_group[tuple(r)] for r in items]
  hist = M.stable_histogram(jax.random.key(7), items, epsilon=1.0, delta=0.4, grouping="hash")
  released = np.asarray(hist.bins)[np.asarray(hist.released)]
  assert len({tuple(r) for r in released}) == len(released)        # no bin released twice
  assert {tuple(r) for r in released} <= set(expected_group)


@pytest.mark.slow(reason="auto choosing hash on wide items; the default run asks for hash by "
                         "name")
def test_hash_grouping_on_wide_items_via_auto():
  t, d = 40, 40_000                                   # t·t·D = 6.4e7 > 5e7: "auto" hashes
  items = jnp.zeros((t, d), jnp.int32).at[::2, -1].set(1)
  hist = M.stable_histogram(jax.random.key(8), items, epsilon=2.0, delta=1e-3)
  assert int(hist.released.sum()) == 2
  last = sorted(int(x) for x in hist.bins[:2, -1])
  assert last == [0, 1] and bool(jnp.all(hist.bins[:2, :-1] == 0))


def test_released_rows_sorted_and_ties_broken_by_fresh_randomness():
  items = jnp.array([[1]] * 12 + [[2]] * 12, jnp.int32)
  for data in (items, items[::-1]):
    hist = _released_per_trial(9, data, delta=0.3)
    counts, released = np.asarray(hist.noisy_counts), np.asarray(hist.released)
    both = released[:, 0] & released[:, 1]
    assert both.mean() > 0.98 and np.all(counts[both, 0] >= counts[both, 1])
    tied = both & (counts[:, 0] == counts[:, 1])
    first_is_one = int(np.sum(np.asarray(hist.bins[:, 0, 0])[tied] == 1))
    low, high = clopper_pearson(first_is_one, int(tied.sum()), 0.999)
    assert tied.sum() > 150 and low <= 0.5 <= high       # not the position of the first item


def test_deterministic_and_jittable():
  f = jax.jit(lambda k: M.stable_histogram(k, MIXED, epsilon=1.0, delta=1e-2).noisy_counts)
  assert jnp.array_equal(f(jax.random.key(10)), f(jax.random.key(10)))
  a = M.stable_histogram(jax.random.key(10), MIXED, epsilon=1.0, delta=1e-2)
  assert jnp.array_equal(a.noisy_counts, f(jax.random.key(10)))
  b = M.stable_histogram(jax.random.key(10), MIXED, epsilon=1.0, delta=1e-2)
  assert all(jnp.array_equal(u, w) for u, w in zip(a[:3], b[:3]))
  c = M.stable_histogram(jax.random.key(11), MIXED, epsilon=1.0, delta=1e-2)
  assert not jnp.array_equal(a.noisy_counts, c.noisy_counts)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(items=jnp.ones((3, 2))), TypeError, "items"),
    (dict(items=jnp.ones((3, 2), jnp.bool_)), TypeError, "items"),
    (dict(items=jnp.ones((3,), jnp.int32)), ValueError, "items"),
    (dict(items=jnp.ones((0, 2), jnp.int32)), ValueError, "items"),
    (dict(epsilon=0.0), ValueError, "epsilon"),
    (dict(epsilon=float("nan")), ValueError, "epsilon"),
    (dict(delta=2.0), ValueError, "delta"),
    (dict(delta=0.0), ValueError, "delta"),
    (dict(neighboring="replace_one"), TypeError, "neighboring"),
    (dict(neighboring=NeighboringRelation.REPLACE_SPECIAL), ValueError, "neighboring"),
    (dict(noise="gauss"), ValueError, "noise"),
    (dict(grouping="sort"), ValueError, "grouping"),
    (dict(key=0), TypeError, "key"),
])
def test_bad_inputs(kwargs, exc, match):
  args = dict(key=jax.random.key(0), items=jnp.ones((3, 2), jnp.int32), epsilon=1.0,
              delta=1e-3) | kwargs
  with pytest.raises(exc, match=match):
    M.stable_histogram(args.pop("key"), args.pop("items"), **args)
