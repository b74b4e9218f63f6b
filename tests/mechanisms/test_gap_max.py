"""Thresholded GAP-MAX (docs/algorithms.md §1.6)."""

import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import mechanisms as M
from dpjax.mechanisms.gap_max import integer_gap_max_bound
from dpjax.metrics import clopper_pearson


TRIALS = 4_000       # one batch size: the batched programs compile once per scores shape and kind


def _run(scores, epsilon, delta, seed):
  keys = jax.random.split(jax.random.key(seed), TRIALS)
  return jax.vmap(lambda k: M.gap_max(k, scores, epsilon=epsilon, delta=delta))(keys)


def _pass_probability(grid_gap, params):
  """Exact ``P[g + Z ≥ K]`` for the discrete truncated Laplace Z of ``params``."""
  K, p = params.bound, math.exp(-params.scale_den / params.scale_num)
  z = np.arange(-K, K + 1)
  pmf = p ** np.abs(z.astype(np.float64))
  return float(pmf[z >= K - grid_gap].sum() / pmf.sum())


@pytest.mark.parametrize("eps,delta,S", [(1.0, 1e-6, 1), (0.5, 1e-9, 1), (1.0, 0.1, 4),
                                         (2.0, 1e-4, 16), (1.0, 0.9, 1), (1.0, 0.7, 8)])
def test_bound_is_the_smallest_that_keeps_the_shifted_mass_below_delta(eps, delta, S):
  K, num, den = integer_gap_max_bound(eps, delta, S)
  assert num / den >= 2 * S / eps and num / den - 2 * S / eps < 2.0**-10
  p = math.exp(-den / num)

  def tail(k):                                   # P[Z ≥ k − 2S + 1] for Z on {−k..k}
    z = np.arange(-k, k + 1)
    pmf = p ** np.abs(z.astype(np.float64))
    return pmf[z >= k - 2 * S + 1].sum() / pmf.sum()
  assert tail(K) <= delta and (K == 1 or tail(K - 1) > delta)


def test_parameters_grid_and_sure_gap():
  assert integer_gap_max_bound(1.0, 1e-6)[0] == 27          # Δ = 2 on the gap, as TLap(2, 1, 1e-6)
  ints = M.gap_max_parameters(1.0, 1e-6, integer_scores=True)
  assert ints.resolution == 1.0 and ints.sensitivity == 1 and ints.sure_gap == 2 * 27 + 2
  floats = M.gap_max_parameters(1.0, 1e-6)
  assert floats.resolution == 2.0**-10 and floats.sensitivity == 1024
  # Close to the real-valued analysis: a sure release above u1 − u2 = 2A ≈ 54.65 with
  # TLap(2, ε, δ) noise; the grid and the scale rounding cost about one more unit.
  A = 2 * math.log(1 + math.expm1(1.0) / 2e-6)
  assert 2 * A < floats.sure_gap < 2 * A + 1.1
  small = M.gap_max_parameters(0.01, 1e-6)
  assert small.resolution == 2.0**-6 and 2 * small.sensitivity / 0.01 <= 2.0**14


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_clear_winner_is_always_returned(dtype):
  need = M.gap_max_parameters(1.0, 1e-6, integer_scores=dtype == jnp.int32).sure_gap
  scores = jnp.array([3, math.ceil(need) + 5, 1], dtype)
  out = _run(scores, 1.0, 1e-6, 0)
  assert out.ok.dtype == jnp.bool_ and out.index.dtype == jnp.int32
  assert out.index.shape == (TRIALS,)
  assert bool(jnp.all(out.ok)) and bool(jnp.all(out.index == 1))


@pytest.mark.parametrize("scores,gap", [([50.0, 50.0, 3.0], 0.0), ([52.0, 50.0, 3.0], 1.0),
                                        ([52.3, 50.0, 3.0], 1.3)])
def test_near_ties_answer_with_probability_at_most_delta(scores, gap):
  """g ≤ 1 is the case where the argmax can differ between neighbours: P[ok] must be ≤ δ
  (the worst case of the proof is g = 1, i.e. S grid steps); float scores go through the grid."""
  eps, delta, n = 1.0, 0.1, TRIALS
  params = M.gap_max_parameters(eps, delta)
  out = _run(jnp.array(scores), eps, delta, 1)
  hits = int(out.ok.sum())
  grid_gap = max(0, math.floor(scores[0] / params.resolution)
                 - math.floor(scores[1] / params.resolution) - params.sensitivity)
  exact = _pass_probability(grid_gap, params)
  if gap <= 1.0:
    assert exact <= delta * (1 + 1e-12)
  low, high = clopper_pearson(hits, n, 0.999)
  assert low <= exact <= high
  assert bool(jnp.all(jnp.where(out.ok, out.index == 0, out.index == 0)))   # 0 on ⊥ too


def test_integer_scores_near_tie_with_exact_integer_noise():
  eps, delta, n = 1.0, 0.1, TRIALS
  K, num, den = integer_gap_max_bound(eps, delta)
  p = math.exp(-den / num)
  total = sum(p ** abs(z) for z in range(-K, K + 1))
  exact = sum(p**z for z in (K - 1, K)) / total      # P[1 + Z ≥ K] = P[Z ≥ K − 1]
  assert exact <= delta < sum(p**z for z in (K - 2, K - 1, K)) / total   # K is the smallest
  out = _run(jnp.array([52, 50, 3]), eps, delta, 2)   # g = 1
  low, high = clopper_pearson(int(out.ok.sum()), n, 0.999)
  assert low <= exact <= high


def test_float_scores_are_floored_to_the_public_grid(monkeypatch):
  """The decision sees only ``⌊score/h⌋``: the integers handed to the exact core are the floors,
  so offsets inside one grid cell (up to 0.99 h, on either side of 0) change nothing, and one
  more step moves the integer by one. (Rounding, or no flooring, changes the integers.)"""
  module = importlib.import_module("dpjax.mechanisms.gap_max")   # the package exports the function
  seen = []
  real = module._integer_gap_max

  def spy(key, scores, *args):
    seen.append(np.asarray(scores))
    return real(key, scores, *args)

  monkeypatch.setattr(module, "_integer_gap_max", spy)
  params = M.gap_max_parameters(1.0, 0.1)
  h = params.resolution
  base = np.array([60.0, 2.0, 1.0, -3.0])
  floors = (base / h).astype(np.int64)                    # exact: h is a power of two
  for offsets in ([0.0, 0.49, 0.51, 0.99], [0.99, 0.0, 0.75, 0.25]):
    M.gap_max(jax.random.key(0), jnp.asarray(base + h * np.array(offsets), jnp.float32),
              epsilon=1.0, delta=0.1)
    np.testing.assert_array_equal(seen[-1], floors)
  M.gap_max(jax.random.key(0), jnp.asarray(base + h * np.array([1.0, 0.0, 2.0, -0.01]),
                                           jnp.float32), epsilon=1.0, delta=0.1)
  np.testing.assert_array_equal(seen[-1], floors + np.array([1, 0, 2, -1]))
  huge = M.gap_max(jax.random.key(0), jnp.array([1e12, 1e11, 0.0, -1e12]), epsilon=1.0,
                  delta=0.1)
  np.testing.assert_array_equal(seen[-1], [2**29, 2**29, 0, -(2**29)])   # clamped, no overflow
  assert huge.ok.dtype == jnp.bool_


def test_ties_go_to_the_lowest_index():
  out = _run(jnp.array([1, 7, 7]), 1.0, 0.5, 3)     # δ large: ok in ~12% of the trials
  assert int(out.ok.sum()) > 50 and bool(jnp.all(jnp.where(out.ok, out.index == 1, True)))


def test_single_candidate():
  # Batched like the other tests (one program per shape: float and integer scores share it).
  for scores in (jnp.array([1000.0]), jnp.array([1000])):
    out = _run(scores, 1.0, 1e-6, 4)
    assert bool(jnp.all(out.ok)) and bool(jnp.all(out.index == 0))
  zero = _run(jnp.array([0.0]), 1.0, 1e-6, 5)
  assert not bool(jnp.any(zero.ok)) and bool(jnp.all(zero.index == 0))


def test_key_hygiene():
  scores = jnp.array([10.0, 2.0, 0.0])
  a = _run(scores, 1.0, 0.1, 6).ok
  assert jnp.array_equal(a, _run(scores, 1.0, 0.1, 6).ok)
  assert not jnp.array_equal(a, _run(scores, 1.0, 0.1, 7).ok)


@pytest.mark.parametrize("scores,kw,exc,match", [
    (jnp.ones((2, 2)), {}, ValueError, "scores"),
    (jnp.ones((0,)), {}, ValueError, "scores"),
    (jnp.array([True, False]), {}, TypeError, "scores"),
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
