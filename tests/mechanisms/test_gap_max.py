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
