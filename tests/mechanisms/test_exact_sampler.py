"""The exact (integer-arithmetic) discrete Laplace sampler of Canonne, Kamath & Steinke."""

import math

import jax
import numpy as np
import pytest
from scipy import stats

from dpjax.mechanisms import discrete, exact

# Jitted once per scale (the scale is static): eagerly every call retraced the loop and compiled it
# again.
_exact = jax.jit(exact.exact_discrete_laplace, static_argnums=(1, 2, 3))


@pytest.mark.parametrize("scale", [
    0.3, 7.5,
    pytest.param(2.0, marks=pytest.mark.slow(reason="a third scale, 2.0; the default run checks "
                                                    "0.3 and 7.5"))])
def test_exact_sampler_matches_the_pmf(scale):
  num, den = exact.rational_scale(scale)
  assert num / den >= scale and num / den - scale <= 1 / den   # never less noise
  z = np.asarray(_exact(jax.random.key(0), (20_000,), num, den))
  assert z.dtype == np.int32
  p = math.exp(-den / num)
  support = np.arange(-40, 41)
  probs = (1 - p) / (1 + p) * p ** np.abs(support)
  tail = p**41 / (1 + p)
  probs[0] += tail
  probs[-1] += tail
  observed = np.array([np.sum(np.clip(z, -40, 40) == s) for s in support])
  keep = probs * z.size >= 5                                      # chi-square validity
  expected = probs[keep] / probs[keep].sum() * observed[keep].sum()
  assert stats.chisquare(observed[keep], expected).pvalue > 1e-3


def test_exact_is_the_default_and_fast_path_agrees_in_law():
  a = np.asarray(discrete.discrete_laplace(jax.random.key(1), (20_000,), scale=3.0))
  b = np.asarray(discrete.discrete_laplace(jax.random.key(1), (20_000,), scale=3.0,
                                           exact=False))
  assert not np.array_equal(a, b)                                 # different samplers
  assert stats.ks_2samp(a, b).pvalue > 1e-3


def test_exact_sampler_is_deterministic_per_key():
  num, den = exact.rational_scale(2.0)
  a = _exact(jax.random.key(5), (100,), num, den)
  b = _exact(jax.random.key(5), (100,), num, den)
  c = _exact(jax.random.key(6), (100,), num, den)
  assert np.array_equal(a, b) and not np.array_equal(a, c)
