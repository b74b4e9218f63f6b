"""The stability-based histogram (ALGORITHMS.md §1.5)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import mechanisms as M
from dpjax.metrics import clopper_pearson


def test_thresholds_match_the_spec():
  assert math.isclose(M.histogram_threshold(1.0, 1e-6, noise="laplace"),
                      1 + 2 * math.log(1 / 2e-6))
  assert math.isclose(M.histogram_threshold(1.0, 1e-6, neighbouring="add_remove", noise="laplace"),
                      1 + math.log(1 / 2e-6))
  p = math.exp(-0.5)
  assert M.histogram_threshold(1.0, 1e-6) == 1 + math.ceil(2 * math.log(1 / (1e-6 * (1 + p))))


@pytest.mark.parametrize("noise,neighbouring", [("discrete", "replace_one"),
                                                ("laplace", "replace_one"),
                                                ("discrete", "add_remove")])
def test_singleton_bin_release_rate_is_at_most_delta(noise, neighbouring):
  """A bin holding one item (the one a neighbour removes) is released w.p. ≤ δ."""
  delta, eps = 0.05, 1.0
  items = jnp.arange(4, dtype=jnp.int32)[:, None]          # four singleton bins
  keys = jax.random.split(jax.random.key(0), 4_000)
  released = jax.vmap(lambda k: M.stable_histogram(k, items, epsilon=eps, delta=delta,
                                                   noise=noise, neighbouring=neighbouring
                                                   ).released.sum())(keys)
  rate = float(released.sum()) / (4 * 4_000)
  low, _ = clopper_pearson(int(released.sum()), 4 * 4_000, 0.999)
  assert low <= delta                                       # not significantly above δ
  assert rate > delta / 10                                  # and the threshold is not silly-high


def test_popular_bin_released_first_with_its_key():
  items = jnp.array([[1, 2]] * 30 + [[5, 5]] * 3 + [[7, 0]], jnp.int32)
  hist = M.stable_histogram(jax.random.key(1), items, epsilon=1.0, delta=1e-6)
  ok, bin_key, count = M.top_bin(hist)
  assert bool(ok) and bin_key.tolist() == [1, 2] and abs(int(count) - 30) < 15
  assert int(hist.released.sum()) == 1                      # small bins stay hidden
  assert jnp.all(hist.bins[1:] == 0) and jnp.all(hist.noisy_counts[1:] == 0)


def test_one_noise_draw_per_bin_not_per_item():
  """With all t items equal, the noisy count is t plus ONE discrete-Laplace draw."""
  t, eps = 50, 1.0
  items = jnp.zeros((t, 3), jnp.int32)
  keys = jax.random.split(jax.random.key(2), 3_000)
  hist = jax.vmap(lambda k: M.stable_histogram(k, items, epsilon=eps, delta=1e-6))(keys)
  assert bool(jnp.all(hist.released.sum(axis=1) == 1))
  noise = np.asarray(hist.noisy_counts[:, 0], np.float64) - t
  p = math.exp(-eps / 2)
  one_draw_var = 2 * p / (1 - p) ** 2                       # ≈ 7.9; t draws would be 50× that
  assert 0.85 * one_draw_var < noise.var() < 1.15 * one_draw_var


def test_pairwise_and_hash_grouping_agree():
  key = jax.random.key(3)
  items = jax.random.randint(jax.random.key(4), (60, 5), 0, 2).astype(jnp.int32)
  items = jnp.concatenate([items, jnp.tile(items[:1], (40, 1))])
  a = M.stable_histogram(key, items, epsilon=1.0, delta=1e-3, grouping="pairwise")
  b = M.stable_histogram(key, items, epsilon=1.0, delta=1e-3, grouping="hash")
  assert jnp.array_equal(a.bins, b.bins) and jnp.array_equal(a.noisy_counts, b.noisy_counts)


def test_deterministic_and_jittable():
  items = jnp.array([[1], [1], [2]] * 20, jnp.int32)
  f = jax.jit(lambda k: M.stable_histogram(k, items, epsilon=1.0, delta=1e-3).noisy_counts)
  assert jnp.array_equal(f(jax.random.key(5)), f(jax.random.key(5)))
  a = M.stable_histogram(jax.random.key(5), items, epsilon=1.0, delta=1e-3)
  assert jnp.array_equal(a.noisy_counts, f(jax.random.key(5)))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(items=jnp.ones((3, 2))), TypeError, "integer"),
    (dict(items=jnp.ones((3,), jnp.int32)), ValueError, "shape"),
    (dict(epsilon=0.0), ValueError, "epsilon"),
    (dict(delta=2.0), ValueError, "delta"),
    (dict(neighbouring="swap"), ValueError, "neighbouring"),
    (dict(noise="gauss"), ValueError, "noise"),
    (dict(grouping="sort"), ValueError, "grouping"),
])
def test_bad_inputs(kwargs, exc, match):
  args = dict(items=jnp.ones((3, 2), jnp.int32), epsilon=1.0, delta=1e-3) | kwargs
  with pytest.raises(exc, match=match):
    M.stable_histogram(jax.random.key(0), **args)
