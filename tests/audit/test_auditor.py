"""The auditor itself: it must be able to fail (negative controls) and to pass correct mechanisms.

Each negative control is a deliberately broken mechanism that the auditor must flag with
ε_empirical > ε_claimed; the matching correct mechanism must pass on the same neighbours.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import audit
from dpjax.mechanisms import exact as exact_lib
from dpjax.mechanisms import histogram as hist_lib
from dpjax.mechanisms.gap_max import gap_max_core, gap_max_parameters

pytestmark = pytest.mark.audit


def _laplace(scale):
  return lambda key, x: x + scale * jax.random.laplace(key, ())


def test_flags_laplace_with_half_the_noise(audit_trials):
  trials = audit_trials(5_000, 100_000)
  broken = audit.audit(jax.random.key(0), _laplace(0.5), 0.0, 1.0, delta=0.0,
                       epsilon_claimed=1.0, trials=trials)
  assert not broken.passed and broken.epsilon_lower_bound > 1.0, broken
  correct = audit.audit(jax.random.key(1), _laplace(1.0), 0.0, 1.0, delta=0.0,
                        epsilon_claimed=1.0, trials=trials)
  assert correct.passed, correct
  assert correct.epsilon_lower_bound > 0.3            # the auditor sees most of the true ε


def _histogram_released(threshold_on: bool):
  """A singleton bin [9] in X that X' replaces by a copy of the popular bin [0]."""
  eps, delta = 1.0, 1e-6
  num, den = exact_lib.rational_scale(2.0 / eps)
  tau = hist_lib.histogram_threshold(eps, delta) if threshold_on else -2**30

  def mechanism(key, items):
    bins, counts, released = hist_lib._stable_histogram(
        key, items, jnp.uint32(num), jnp.uint32(den), jnp.int32(tau), "pairwise")
    return jnp.any(released & jnp.all(bins == 9, axis=1))
  return mechanism


def _broken_flagged_correct_passes(make_mechanism, X, X_prime, trials, seed):
  """The control without its safeguard is flagged; with it, it passes (δ = 1e-6, ε = 1)."""
  for safeguard, key in ((False, seed), (True, seed + 1)):
    report = audit.audit(jax.random.key(key), make_mechanism(safeguard), X, X_prime,
                         delta=1e-6, epsilon_claimed=1.0, trials=trials)
    assert report.passed == safeguard, report


def test_flags_a_histogram_without_threshold(audit_trials):
  X = jnp.array([[0]] * 30 + [[9]], jnp.int32)
  X_prime = jnp.array([[0]] * 31, jnp.int32)
  _broken_flagged_correct_passes(_histogram_released, X, X_prime, audit_trials(200, 10_000), 2)


def _gap_max(threshold_on: bool):
  params = gap_max_parameters(1.0, 1e-6)

  def mechanism(key, scores):
    if not threshold_on:                   # plain argmax: what GAP-MAX is NOT
      return jnp.argmax(scores).astype(jnp.int32)
    res = gap_max_core(key, scores, params)
    return jnp.where(res.ok, res.index, -1)
  return mechanism


def test_flags_gap_max_without_threshold(audit_trials):
  X = jnp.array([50.0, 50.0, 3.0])          # tied top candidates
  X_prime = jnp.array([49.0, 50.0, 3.0])    # one score moved by its sensitivity
  _broken_flagged_correct_passes(_gap_max, X, X_prime, audit_trials(500, 20_000), 4)


def test_lower_bound_arithmetic_on_known_counts():
  # 1000 of 1000 vs 0 of 1000: p ≥ ~0.99, p' ≤ ~0.005 → a large bound; identical samples → 0.
  a = np.ones(1_250, bool); b = np.zeros(1_250, bool)
  eps, event, _, counts = audit.epsilon_lower_bound(a, b, delta=0.0)
  assert eps > 4.0 and counts == (1000, 0)
  eps_same, *_ = audit.epsilon_lower_bound(a, a.copy(), delta=0.0)
  assert eps_same == 0.0


def test_bad_arguments():
  with pytest.raises(ValueError, match="trials"):
    audit.audit(jax.random.key(0), _laplace(1.0), 0.0, 1.0, delta=0.0, trials=5)
  with pytest.raises(ValueError, match="scalar"):
    audit.audit(jax.random.key(0), lambda k, x: jnp.zeros(2) + x, 0.0, 1.0, delta=0.0,
                trials=50)
  with pytest.raises(TypeError, match="key"):
    audit.audit(0, _laplace(1.0), 0.0, 1.0, delta=0.0)
  with pytest.raises(ValueError, match="batch_size"):
    audit.audit(jax.random.key(0), _laplace(1.0), 0.0, 1.0, delta=0.0, trials=50, batch_size=0)


def test_sample_outputs_per_key_whatever_the_batching():
  """The compiled batched path (any batch size, a remainder batch included) and the Python loop
  give each key the same output."""
  key, mechanism = jax.random.key(4), _laplace(1.0)
  loop = audit.sample_outputs(key, mechanism, 0.5, 23, vectorized=False)
  assert loop.shape == (23,) and len(np.unique(loop)) == 23
  for batch_size in (5, 23, 16_384):
    np.testing.assert_allclose(audit.sample_outputs(key, mechanism, 0.5, 23,
                                                    batch_size=batch_size), loop, rtol=1e-6)
  report = audit.audit(key, mechanism, 0.0, 1.0, delta=0.0, trials=40, batch_size=7,
                       epsilon_claimed=1.0)
  assert report.trials == 40
