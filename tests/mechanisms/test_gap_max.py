"""Thresholded GAP-MAX (ALGORITHMS.md §1.6)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import mechanisms as M
from dpjax.mechanisms.gap_max import integer_gap_max_bound
from dpjax.metrics import clopper_pearson


def _run(scores, epsilon, delta, n, seed):
  keys = jax.random.split(jax.random.key(seed), n)
  return jax.vmap(lambda k: M.gap_max(k, scores, epsilon=epsilon, delta=delta))(keys)


def _float_pass_probability(gap, epsilon, delta):
  """Exact ``P[g + Z > A − 1]`` for ``Z ~ TLap(2, ε, δ)`` and ``0 ≤ g ≤ 1``."""
  p = M.truncated_laplace_params(2.0, epsilon, delta)
  x = p.bound - 1.0 - gap
  return p.density * p.scale * (math.exp(-x / p.scale) - math.exp(-p.bound / p.scale))


def test_threshold_is_a_minus_one():
  for eps, delta in [(1.0, 1e-6), (0.2, 1e-9), (5.0, 0.1)]:
    A = (2 / eps) * math.log(1 + math.expm1(eps) / (2 * delta))
    assert math.isclose(M.gap_max_threshold(eps, delta), A - 1, rel_tol=1e-12)
  assert math.isclose(M.gap_max_threshold(1.0, 1e-6), 27.3274 - 1, abs_tol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_clear_winner_is_always_returned(dtype):
  if dtype == jnp.float32:
    need = 2 * (M.gap_max_threshold(1.0, 1e-6) + 1) - 1      # g > 2A − 1 ⇒ always released
  else:
    need = 2 * integer_gap_max_bound(1.0, 1e-6)[0]           # g ≥ 2K ⇒ always released
  scores = jnp.array([3, math.ceil(need) + 5, 1], dtype)
  out = _run(scores, 1.0, 1e-6, 500, 0)
  assert out.ok.dtype == jnp.bool_ and out.index.dtype == jnp.int32 and out.index.shape == (500,)
  assert bool(jnp.all(out.ok)) and bool(jnp.all(out.index == 1))


@pytest.mark.parametrize("scores,gap", [([50.0, 50.0, 3.0], 0.0), ([52.0, 50.0, 3.0], 1.0)])
def test_near_ties_answer_with_probability_at_most_delta(scores, gap):
  """g ≤ 1 is the case where the argmax can differ between neighbours: P[ok] must be ≤ δ,
  with equality at g = 1 (the worst case of the proof)."""
  eps, delta, n = 1.0, 0.1, 4_000
  out = _run(jnp.array(scores), eps, delta, n, 1)
  hits = int(out.ok.sum())
  exact = _float_pass_probability(gap, eps, delta)
  assert exact <= delta * (1 + 1e-12)
  if gap == 1.0:
    assert math.isclose(exact, delta, rel_tol=1e-9)
  low, high = clopper_pearson(hits, n, 0.999)
  assert low <= exact <= high
  assert bool(jnp.all(jnp.where(out.ok, out.index == 0, out.index == 0)))   # 0 on ⊥ too


def test_integer_scores_near_tie_with_exact_integer_noise():
  eps, delta, n = 1.0, 0.1, 3_000
  K, num, den = integer_gap_max_bound(eps, delta)
  p = math.exp(-den / num)
  total = sum(p ** abs(z) for z in range(-K, K + 1))
  exact = sum(p**z for z in (K - 1, K)) / total      # P[1 + Z ≥ K] = P[Z ≥ K − 1]
  assert exact <= delta < sum(p**z for z in (K - 2, K - 1, K)) / total   # K is the smallest
  out = _run(jnp.array([52, 50, 3]), eps, delta, n, 2)   # g = 1
  low, high = clopper_pearson(int(out.ok.sum()), n, 0.999)
  assert low <= exact <= high


def test_ties_go_to_the_lowest_index():
  out = _run(jnp.array([1.0, 7.0, 7.0]), 1.0, 0.9, 500, 3)     # δ large: ⊥ is rare enough
  assert int(out.ok.sum()) > 50 and bool(jnp.all(jnp.where(out.ok, out.index == 1, True)))


def test_single_candidate():
  assert bool(M.gap_max(jax.random.key(4), jnp.array([1000.0]), epsilon=1.0, delta=1e-6).ok)
  out = M.gap_max(jax.random.key(4), jnp.array([1000]), epsilon=1.0, delta=1e-6)
  assert bool(out.ok) and int(out.index) == 0
  zero = _run(jnp.array([0.0]), 1.0, 1e-6, 200, 5)
  assert not bool(jnp.any(zero.ok)) and bool(jnp.all(zero.index == 0))


def test_key_hygiene():
  scores = jnp.array([10.0, 2.0])
  a = _run(scores, 1.0, 0.1, 64, 6).ok
  assert jnp.array_equal(a, _run(scores, 1.0, 0.1, 64, 6).ok)
  assert not jnp.array_equal(a, _run(scores, 1.0, 0.1, 64, 7).ok)


@pytest.mark.parametrize("scores,kw,exc,match", [
    (jnp.array([1.0, jnp.nan]), {}, ValueError, "scores"),
    (jnp.array([1.0, jnp.inf]), {}, ValueError, "scores"),
    (jnp.ones((2, 2)), {}, ValueError, "scores"),
    (jnp.ones((0,)), {}, ValueError, "scores"),
    (jnp.array([True, False]), {}, TypeError, "scores"),
    (np.array([2**40, 0], np.int64), {}, ValueError, "scores"),
    (jnp.ones(3), dict(epsilon=0.0), ValueError, "epsilon"),
    (jnp.ones(3), dict(epsilon=float("nan")), ValueError, "epsilon"),
    (jnp.ones(3), dict(delta=0.0), ValueError, "delta"),
    (jnp.ones(3), dict(delta=1.0), ValueError, "delta"),
    (jnp.ones(3), dict(key=5), TypeError, "key"),
])
def test_bad_inputs(scores, kw, exc, match):
  args = {"key": jax.random.key(0), "epsilon": 1.0, "delta": 1e-3} | kw
  with pytest.raises(exc, match=match):
    M.gap_max(args.pop("key"), scores, **args)
