"""Mironov's snapping mechanism (docs/algorithms.md §1.10)."""

import math

import jax
import numpy as np
import pytest
from scipy import stats

from dpjax import mechanisms as M
from dpjax.mechanisms import snapping


def test_parameters_meet_mironovs_bound_exactly():
  lam, grid, bound = M.snapping_parameters(2.0, 0.5, bound=1e4)
  lam1, b1 = lam / 2.0, bound / 2.0                          # sensitivity-1 units
  assert math.isclose(1 / lam1 + 2.0**-49 * b1 / lam1, 0.5, rel_tol=1e-12)
  assert grid >= lam and math.log2(grid / 2.0).is_integer()  # Λ = Δ·2^⌈log2 λ'⌉
  with pytest.raises(ValueError, match="bound"):
    M.snapping_parameters(1.0, 1.0, bound=0.5)               # needs λ < B


def test_outputs_live_on_one_public_grid_whatever_the_input():
  """The reachable set does not depend on the input: multiples of Λ inside [−B, B].

  Mironov's attack reads the input off the low-order bits of raw float outputs; here the low
  bits of every output are those of some k·Λ, for both neighboring inputs alike.
  """
  lam, grid, bound = M.snapping_parameters(1.0, 1.0, bound=1e3)
  outs = []
  for x in (0.0, 1.0 / 3.0):
    out = M.snapping_mechanism(jax.random.key(0), np.full(5_000, x), sensitivity=1.0,
                               epsilon=1.0, bound=1e3)
    assert out.dtype == np.float64
    assert np.all(np.abs(out) <= bound)
    assert np.all(out / grid == np.round(out / grid))        # exact multiples of Λ
    outs.append(set(np.unique(out)))
  assert len(outs[0] & outs[1]) >= 0.8 * min(len(outs[0]), len(outs[1]))   # shared support


def test_clamping_to_the_public_bound():
  out = M.snapping_mechanism(jax.random.key(1), np.array([1e9, -1e9]), sensitivity=1.0,
                             epsilon=1.0, bound=100.0)
  assert np.all(np.abs(out) <= 100.0)


def test_uniform_doubles_are_uniform_and_reach_small_values():
  u = snapping._uniform_doubles(np.random.default_rng(2), 50_000)
  assert np.all((u > 0) & (u <= 1))
  assert stats.kstest(u, "uniform").pvalue > 1e-3
  assert stats.kstest(-np.log(u), "expon").pvalue > 1e-3


def test_laplace_mechanism_snaps_by_default_and_noise_has_laplace_scale():
  out = M.laplace_mechanism(jax.random.key(3), np.zeros(40_000), sensitivity=1.0, epsilon=0.05)
  lam, grid, _ = M.snapping_parameters(1.0, 0.05)
  assert np.all(out / grid == np.round(out / grid))
  # Rounding to Λ ≤ 2λ barely changes a Laplace(λ) at this scale: compare variances.
  assert abs(out.var() / (2 * lam**2) - 1) < 0.1


def test_bad_inputs():
  with pytest.raises(TypeError, match="float"):
    M.snapping_mechanism(jax.random.key(0), np.array([1]), sensitivity=1.0, epsilon=1.0)
  with pytest.raises(ValueError, match="epsilon"):
    M.snapping_mechanism(jax.random.key(0), np.array([1.0]), sensitivity=1.0, epsilon=0.0)
