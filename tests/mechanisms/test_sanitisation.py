"""Computed private statistics are sanitised, never checked with a data-dependent error.

Raising on a NaN in a value about to be released would branch on private data outside any DP
mechanism, so every release maps NaN/inf entries to 0 (integer scores and bin keys are clamped to
the sampler's range) — fixed public maps. Each test pins the map: the release of the raw value
equals the release of the sanitised value with the same key, and no exception is raised.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import mechanisms as M

KEY = jax.random.key(3)
RAW = np.array([1.5, np.nan, -np.inf, np.inf, -2.0])
CLEAN = np.array([1.5, 0.0, 0.0, 0.0, -2.0])

RELEASES = {
    "gaussian": lambda key, x: M.gaussian_mechanism(key, x, sensitivity=1.0, epsilon=1.0,
                                                    delta=1e-5),
    "gaussian_raw": lambda key, x: M.gaussian_mechanism(key, x, sensitivity=1.0, epsilon=1.0,
                                                        delta=1e-5, secure=False),
    "discretized_gaussian": lambda key, x: M.discretized_gaussian_mechanism(
        key, x, sensitivity=1.0, noise_multiplier=2.0),
    "laplace": lambda key, x: M.laplace_mechanism(key, x, sensitivity=1.0, epsilon=1.0),
    "laplace_raw": lambda key, x: M.laplace_mechanism(key, x, sensitivity=1.0, epsilon=1.0,
                                                      secure=False),
    "truncated_laplace": lambda key, x: M.truncated_laplace_mechanism(
        key, x, sensitivity=1.0, epsilon=1.0, delta=1e-5),
    "truncated_laplace_raw": lambda key, x: M.truncated_laplace_mechanism(
        key, x, sensitivity=1.0, epsilon=1.0, delta=1e-5, secure=False),
    "snapping": lambda key, x: M.snapping_mechanism(key, x, sensitivity=1.0, epsilon=1.0),
}


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_non_finite_entries_are_released_as_zeros(name):
  release = RELEASES[name]
  raw = np.asarray(release(KEY, jnp.asarray(RAW, jnp.float32)))
  clean = np.asarray(release(KEY, jnp.asarray(CLEAN, jnp.float32)))
  assert np.all(np.isfinite(raw))
  np.testing.assert_array_equal(raw, clean)


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_the_sanitised_release_is_the_same_under_jit(name):
  release = RELEASES[name]
  eager = np.asarray(release(KEY, jnp.asarray(RAW, jnp.float32)), np.float32)
  traced = np.asarray(jax.jit(release)(KEY, jnp.asarray(RAW, jnp.float32)))
  np.testing.assert_allclose(traced, eager, rtol=1e-6)


def test_exponential_mechanism_scores_nan_as_zero():
  keys = jax.random.split(KEY, 64)
  pick = jax.vmap(lambda k, s: M.exponential_mechanism(k, s, sensitivity=1.0, epsilon=1.0),
                  in_axes=(0, None))
  raw = pick(keys, jnp.array([3.0, jnp.nan, -jnp.inf]))
  clean = pick(keys, jnp.array([3.0, 0.0, 0.0]))
  np.testing.assert_array_equal(raw, clean)


def test_gap_max_sanitises_float_scores_and_clamps_integer_scores():
  raw = M.gap_max(KEY, jnp.array([40.0, jnp.nan, jnp.inf]), epsilon=1.0, delta=1e-6)
  clean = M.gap_max(KEY, jnp.array([40.0, 0.0, 0.0]), epsilon=1.0, delta=1e-6)
  assert (bool(raw.ok), int(raw.index)) == (bool(clean.ok), int(clean.index))
  # Three candidates, as above: the integer core's program (float scores are floored to
  # integers first) is shared.
  big = M.gap_max(KEY, np.array([2**40, 0, 0], np.int64), epsilon=1.0, delta=1e-6)
  clamped = M.gap_max(KEY, np.array([2**29, 0, 0], np.int64), epsilon=1.0, delta=1e-6)
  assert (bool(big.ok), int(big.index)) == (bool(clamped.ok), int(clamped.index)) == (True, 0)


def test_histogram_clamps_bin_keys_to_int32():
  items = np.array([[2**40], [2**40], [-(2**40)], [5]], np.int64)
  clamped = np.clip(items, -(2**31), 2**31 - 1)
  a = M.stable_histogram(KEY, items, epsilon=1.0, delta=0.3)
  b = M.stable_histogram(KEY, clamped, epsilon=1.0, delta=0.3)
  for u, w in zip(a[:3], b[:3]):
    np.testing.assert_array_equal(u, w)
