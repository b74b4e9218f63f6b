"""The exponential mechanism by Gumbel-max (docs/algorithms.md §1.7)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpjax import mechanisms as M

SCORES = jnp.array([0.0, 1.0, 2.0, 4.0])
N = 8_000


def _picks(scores, seed, **kw):
  keys = jax.random.split(jax.random.key(seed), N)
  return np.asarray(jax.vmap(lambda k: M.exponential_mechanism(k, scores, **kw))(keys))


def _chi2_p(picks, scores, factor):
  probs = np.exp(factor * np.asarray(scores, np.float64))
  probs /= probs.sum()
  return stats.chisquare(np.bincount(picks, minlength=len(probs)), probs * picks.size).pvalue


@pytest.mark.parametrize("monotone,factor", [(False, 0.5), (True, 1.0)])
def test_frequencies_match_the_softmax(monotone, factor):
  picks = _picks(SCORES, 0, sensitivity=2.0, epsilon=2.0 * factor * (1 if monotone else 2),
                 monotone=monotone)
  assert _chi2_p(picks, SCORES, factor) > 1e-3
  assert _chi2_p(picks, SCORES, 2 * factor) < 1e-6 and _chi2_p(picks, SCORES, factor / 2) < 1e-6


def test_large_offset_and_integer_scores_keep_the_law():
  picks = _picks(SCORES.astype(jnp.int32) + 100_000, 1, sensitivity=1.0, epsilon=1.0)
  assert _chi2_p(picks, SCORES, 0.5) > 1e-3


def test_output_type_and_key_hygiene():
  out = M.exponential_mechanism(jax.random.key(2), SCORES, sensitivity=1.0, epsilon=1.0)
  assert out.dtype == jnp.int32 and out.shape == () and 0 <= int(out) < 4
  a, b = _picks(SCORES, 3, sensitivity=1.0, epsilon=1.0), _picks(SCORES, 3, sensitivity=1.0,
                                                                  epsilon=1.0)
  assert np.array_equal(a, b)
  assert not np.array_equal(a, _picks(SCORES, 4, sensitivity=1.0, epsilon=1.0))
  one = M.exponential_mechanism(jax.random.key(5), jnp.array([3.0]), sensitivity=1.0, epsilon=1.0)
  assert int(one) == 0


KEY = jax.random.key(0)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: M.exponential_mechanism(KEY, jnp.ones((2, 2)), sensitivity=1.0, epsilon=1.0),
     ValueError, "scores"),
    (lambda: M.exponential_mechanism(KEY, jnp.ones((0,)), sensitivity=1.0, epsilon=1.0),
     ValueError, "scores"),
    (lambda: M.exponential_mechanism(KEY, jnp.array([True]), sensitivity=1.0, epsilon=1.0),
     TypeError, "scores"),
    (lambda: M.exponential_mechanism(KEY, SCORES, sensitivity=0.0, epsilon=1.0), ValueError,
     "sensitivity"),
    (lambda: M.exponential_mechanism(KEY, SCORES, sensitivity=1.0, epsilon=-1.0), ValueError,
     "epsilon"),
    (lambda: M.exponential_mechanism(KEY, SCORES, sensitivity=1.0, epsilon=float("nan")),
     ValueError, "epsilon"),
    (lambda: M.exponential_mechanism([1, 2], SCORES, sensitivity=1.0, epsilon=1.0), TypeError,
     "key"),
])
def test_bad_inputs(call, exc, match):
  with pytest.raises(exc, match=match):
    call()
