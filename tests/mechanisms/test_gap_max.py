"""Thresholded GAP-MAX (ALGORITHMS.md §1.6)."""

import jax
import jax.numpy as jnp
import pytest

from dpjax import mechanisms as M
from dpjax.metrics import clopper_pearson


def test_clear_winner_is_always_returned():
  A = M.gap_max_threshold(1.0, 1e-6) + 1
  scores = jnp.array([3.0, 2.0 * A + 5.0, 1.0])
  keys = jax.random.split(jax.random.key(0), 500)
  out = jax.vmap(lambda k: M.gap_max(k, scores, epsilon=1.0, delta=1e-6))(keys)
  assert bool(jnp.all(out.ok)) and bool(jnp.all(out.index == 1))


def test_tied_top_candidates_answer_with_probability_at_most_delta():
  delta = 0.1
  scores = jnp.array([50.0, 50.0, 3.0])
  keys = jax.random.split(jax.random.key(1), 4_000)
  out = jax.vmap(lambda k: M.gap_max(k, scores, epsilon=1.0, delta=delta))(keys)
  hits = int(out.ok.sum())
  assert clopper_pearson(hits, 4_000, 0.999)[0] <= delta
  assert bool(jnp.all(jnp.where(out.ok, out.index == 0, out.index == 0)))  # placeholder 0 on ⊥


def test_single_candidate_and_integer_scores():
  out = M.gap_max(jax.random.key(2), jnp.array([1000]), epsilon=1.0, delta=1e-6)
  assert bool(out.ok) and int(out.index) == 0
  out = M.gap_max(jax.random.key(2), jnp.array([0]), epsilon=1.0, delta=1e-6)
  assert not bool(out.ok)


@pytest.mark.parametrize("scores,kw,exc,match", [
    (jnp.array([1.0, jnp.nan]), {}, ValueError, "NaN"),
    (jnp.ones((2, 2)), {}, ValueError, "scores"),
    (jnp.ones(3), dict(epsilon=0.0), ValueError, "epsilon"),
    (jnp.ones(3), dict(delta=0.0), ValueError, "delta"),
])
def test_bad_inputs(scores, kw, exc, match):
  with pytest.raises(exc, match=match):
    M.gap_max(jax.random.key(0), scores, **({"epsilon": 1.0, "delta": 1e-3} | kw))


def test_integer_scores_use_exact_integer_noise_with_the_stated_tail():
  import math

  from dpjax.mechanisms.gap_max import integer_gap_max_bound
  K, num, den = integer_gap_max_bound(1.0, 1e-6)
  p = math.exp(-den / num)
  total = sum(p ** abs(z) for z in range(-K, K + 1))
  assert sum(p**z for z in (K - 1, K)) / total <= 1e-6           # P[Z ≥ K − 1] ≤ δ
  assert sum(p**z for z in (K - 2, K - 1, K)) / total > 1e-6     # and K is the smallest
  # A clear integer winner is always returned; a tie almost never.
  keys = jax.random.split(jax.random.key(3), 300)
  clear = jax.vmap(lambda k: M.gap_max(k, jnp.array([2 * K + 3, 0, 1]), epsilon=1.0,
                                       delta=1e-6))(keys)
  assert bool(jnp.all(clear.ok)) and bool(jnp.all(clear.index == 0))
  tie = jax.vmap(lambda k: M.gap_max(k, jnp.array([40, 40, 1]), epsilon=1.0,
                                     delta=1e-6))(keys)
  assert not bool(jnp.any(tie.ok))
