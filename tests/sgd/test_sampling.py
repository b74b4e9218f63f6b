"""Poisson sampling laid out in padded micro-batches, never truncated (docs/algorithms.md §6.1)."""

import math

import jax
import numpy as np
import pytest
from scipy import stats

from dpjax.sgd import sampling


def test_poisson_mask_shape_dtype_and_determinism():
  mask = sampling.poisson_mask(jax.random.key(0), 500, 0.3)
  assert mask.shape == (500,) and mask.dtype == bool
  assert np.array_equal(mask, sampling.poisson_mask(jax.random.key(0), 500, 0.3))
  assert not np.array_equal(mask, sampling.poisson_mask(jax.random.key(1), 500, 0.3))
  assert bool(sampling.poisson_mask(jax.random.key(2), 50, 1.0).all())   # q = 1: everyone


def test_inclusion_rate_is_q_for_every_example():
  n, q, trials = 200, 0.1, 400
  keys = jax.random.split(jax.random.key(3), trials)
  # The same draws as one call per key, in one program (400 calls cost ~2 s of dispatch).
  draws = np.asarray(jax.jit(jax.vmap(lambda k: sampling.poisson_mask(k, n, q)))(keys))
  total = int(draws.sum())
  ci = stats.binomtest(total, n * trials).proportion_ci(0.999)
  assert ci.low <= q <= ci.high
  # Independent across examples and steps: per-example counts are Binomial(trials, q).
  per_example = draws.sum(0)
  chi2 = np.sum((per_example - trials * q) ** 2 / (trials * q * (1 - q)))
  assert stats.chi2.sf(chi2, n) > 1e-3


@pytest.mark.parametrize("n,q,b", [(1_000, 0.05, 16), (300, 0.5, 64), (50, 0.02, 8),
                                   (40, 1.0, 7)])
def test_microbatches_are_never_truncated(n, q, b):
  for i in range(40):
    key = jax.random.key(i)
    idx, mask = sampling.poisson_microbatches(key, n, q, b)
    chosen = np.flatnonzero(np.asarray(sampling.poisson_mask(key, n, q)))
    assert idx.dtype == np.int32 and mask.dtype == bool
    assert idx.shape == mask.shape == (max(1, math.ceil(chosen.size / b)), b)
    assert int(mask.sum()) == chosen.size                     # nobody dropped
    np.testing.assert_array_equal(idx[mask], chosen)           # each sampled example once
    assert np.all(idx[~mask] == 0)                             # padding points to example 0


def test_an_overflowing_sample_gets_more_microbatches():
  sizes = {sampling.poisson_microbatches(jax.random.key(i), 2_000, 0.05, 100)[0].shape[0]
           for i in range(30)}
  assert {1, 2} <= sizes                  # E|sample| = 100: some steps need a second batch


def test_empty_sample_gives_one_fully_padded_microbatch():
  # q tiny: with this key nobody is drawn; M is still 1 (a static shape), all padding.
  for i in range(20):
    idx, mask = sampling.poisson_microbatches(jax.random.key(i), 5, 1e-6, 4)
    if not mask.any():
      assert idx.shape == (1, 4) and np.all(idx == 0)
      return
  pytest.fail("expected an empty sample")


@pytest.mark.parametrize("call,exc,match", [
    (lambda: sampling.poisson_mask(jax.random.key(0), 10, 0.0), ValueError, "sampling_prob"),
    (lambda: sampling.poisson_mask(jax.random.key(0), 10, 1.5), ValueError, "sampling_prob"),
    (lambda: sampling.poisson_mask(jax.random.key(0), 0, 0.5), ValueError, "num_examples"),
    (lambda: sampling.poisson_mask(jax.random.key(0), 10.0, 0.5), TypeError, "num_examples"),
    (lambda: sampling.poisson_mask(7, 10, 0.5), TypeError, "key"),
    (lambda: sampling.poisson_microbatches(jax.random.key(0), 10, 0.5, 0), ValueError,
     "microbatch_size"),
])
def test_bad_inputs(call, exc, match):
  with pytest.raises(exc, match=match):
    call()
