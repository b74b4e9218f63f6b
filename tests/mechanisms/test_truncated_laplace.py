"""Truncated Laplace TLap(Δ, ε, δ) (docs/algorithms.md §1.3): constants, δ identity, sampler law."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpjax import mechanisms as M
from dpjax.metrics import clopper_pearson

N = 20_000


def _tail_beyond(params, x):
  """Exact ``P[Z > x]`` for ``0 ≤ x ≤ A``."""
  return params.density * params.scale * (math.exp(-x / params.scale)
                                          - math.exp(-params.bound / params.scale))


def _cdf(scale, bound):
  """CDF of ``B e^{−|x|/scale}`` on ``[−bound, bound]``."""
  mass = 1 - math.exp(-bound / scale)
  def cdf(x):
    x = np.clip(x, -bound, bound)
    return 0.5 + np.sign(x) * (1 - np.exp(-np.abs(x) / scale)) / (2 * mass)
  return cdf


def _assert_law(samples, params):
  """KS accepts the right scale and rejects 2/3 and 3/2 of it (same support)."""
  samples = np.asarray(samples, np.float64)
  def p(scale):
    return stats.kstest(samples, _cdf(scale, params.bound)).pvalue
  assert p(params.scale) > 1e-3
  assert p(params.scale * 2 / 3) < 1e-6 and p(params.scale * 3 / 2) < 1e-6


def _variance(params):
  lam, A = params.scale, params.bound
  return 2 * lam**2 - (A**2 + 2 * A * lam) * math.exp(-A / lam) / (-math.expm1(-A / lam))


def test_sanity_values():
  p = M.truncated_laplace_params(2.0, 1.0, 1e-6)
  assert isinstance(p, M.TruncatedLaplaceParams)
  assert round(p.bound, 4) == 27.3274 and round(p.density, 7) == 0.2500003
  assert p.scale == 2.0


@pytest.mark.parametrize("sens,eps,delta", [(2.0, 1.0, 1e-6), (1.0, 0.1, 1e-9), (0.5, 5.0, 0.3),
                                            (3.0, 20.0, 1e-12), (1.0, 1e-4, 1e-5)])
def test_constants_are_exact(sens, eps, delta):
  p = M.truncated_laplace_params(sens, eps, delta)
  assert math.isclose(p.bound, (sens / eps) * math.log(1 + math.expm1(eps) / (2 * delta)),
                      rel_tol=1e-12)
  # B normalises the density, and its closed form agrees with 1/(2λ(1 − e^{−A/λ})).
  assert math.isclose(p.density, 1 / (2 * p.scale * -math.expm1(-p.bound / p.scale)),
                      rel_tol=1e-10)
  # The identity behind the guarantee: P[Z > A − Δ] = δ exactly.
  assert math.isclose(_tail_beyond(p, p.bound - sens), delta, rel_tol=1e-9)


def test_huge_epsilon_stays_finite():
  p = M.truncated_laplace_params(1.0, 800.0, 1e-6)
  assert all(math.isfinite(x) and x > 0 for x in p)
  assert math.isclose(p.bound, (800.0 - math.log(2e-6)) / 800.0, rel_tol=1e-12)


def test_sampler_law_support_moments_and_edge_mass_float32():
  sens, eps, delta = 1.0, 1.0, 0.05                 # a short support so truncation is visible
  p = M.truncated_laplace_params(sens, eps, delta)
  z = M.truncated_laplace(jax.random.key(0), (N,), sensitivity=sens, epsilon=eps, delta=delta)
  assert z.shape == (N,) and z.dtype == jnp.float32
  z = np.asarray(z, np.float64)
  assert np.all(np.abs(z) <= p.bound)
  _assert_law(z, p)
  var = _variance(p)
  assert abs(z.mean()) < 4 * math.sqrt(var / N)
  assert abs(z.var() / var - 1) < 0.05
  # The mass that a shift by Δ pushes out of the support is δ, on the samples too.
  hits = int(np.sum(z > p.bound - sens))
  low, high = clopper_pearson(hits, N, 0.999)
  assert low <= delta <= high


def test_sampler_float64_and_small_delta_support():
  with jax.enable_x64(True):
    p = M.truncated_laplace_params(2.0, 1.0, 1e-3)
    z = M.truncated_laplace(jax.random.key(1), (N,), sensitivity=2.0, epsilon=1.0, delta=1e-3,
                            dtype=jnp.float64)
    assert z.dtype == jnp.float64
    assert bool(jnp.all(jnp.abs(z) <= p.bound))
    _assert_law(z, p)
  p = M.truncated_laplace_params(2.0, 1.0, 1e-6)
  z = M.truncated_laplace(jax.random.key(2), (N,), sensitivity=2.0, epsilon=1.0, delta=1e-6)
  assert bool(jnp.all(jnp.abs(z) <= p.bound))


def test_raw_mechanism_keeps_dtype_and_adds_bounded_noise():
  p = M.truncated_laplace_params(1.0, 1.0, 0.05)
  value = jnp.full((N,), 5.0)
  out = M.truncated_laplace_mechanism(jax.random.key(3), value, sensitivity=1.0, epsilon=1.0,
                                      delta=0.05, secure=False)
  assert out.shape == value.shape and out.dtype == jnp.float32
  _assert_law(out - value, p)
  with jax.enable_x64(True):
    out = M.truncated_laplace_mechanism(jax.random.key(3), jnp.zeros(3, jnp.float64),
                                        sensitivity=1.0, epsilon=1.0, delta=0.05, secure=False)
    assert out.dtype == jnp.float64


def test_secure_mechanism_is_on_its_grid_with_the_discrete_law():
  """Default release: multiples of the public ℓ1 grid Λ, noise P(z) ∝ e^{−|z|/t} on {−K..K} in
  grid steps with t = ⌈Δ_Λ/ε⌉ and K the smallest bound leaving ≤ δ outside for a shift D."""
  eps, delta = 1.0, 0.05
  value = np.full(N, 5.0 + 1 / 3)
  out = M.truncated_laplace_mechanism(jax.random.key(3), value, sensitivity=1.0, epsilon=eps,
                                      delta=delta)
  grid = M.discretization(1.0, N, norm=1)
  assert isinstance(out, np.ndarray) and out.dtype == np.float64 and out.shape == (N,)
  steps = out / grid.grid
  assert np.all(steps == np.round(steps))
  noise = (steps - np.round(value / grid.grid)).astype(np.int64)
  t = math.ceil(grid.grid_sensitivity / eps)
  K = M.discrete_truncated_laplace_bound(t, math.floor(grid.grid_sensitivity),
                                                            delta)
  assert np.abs(noise).max() <= K
  # In the original units the law is close to the continuous TLap(Δ, ε, δ).
  p = M.truncated_laplace_params(1.0, eps, delta)
  assert abs(K * grid.grid - p.bound) < 0.05 * p.bound
  _assert_law(noise * grid.grid, p._replace(scale=t * grid.grid, bound=K * grid.grid))


@pytest.mark.parametrize("scale,shift,delta", [(2, 2, 1e-6), (1024, 1000, 1e-3), (3, 1, 0.4)])
def test_discrete_truncated_laplace_bound_is_the_smallest(scale, shift, delta):
  K = M.discrete_truncated_laplace_bound(scale, shift, delta)
  p = math.exp(-1.0 / scale)

  def tail(k):
    z = np.arange(-k, k + 1)
    pmf = p ** np.abs(z.astype(np.float64))
    return pmf[z >= k - shift + 1].sum() / pmf.sum()
  assert tail(K) <= delta and (K == 1 or tail(K - 1) > delta)


def test_key_hygiene_and_jit():
  draw = jax.jit(lambda k: M.truncated_laplace(k, (6,), sensitivity=1.0, epsilon=1.0,
                                               delta=1e-5))
  a = draw(jax.random.key(4))
  assert jnp.array_equal(a, draw(jax.random.key(4)))
  assert jnp.array_equal(a, M.truncated_laplace(jax.random.key(4), (6,), sensitivity=1.0,
                                                epsilon=1.0, delta=1e-5))
  assert not jnp.array_equal(a, draw(jax.random.key(5)))


KEY = jax.random.key(0)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: M.truncated_laplace_params(1.0, -1.0, 1e-5), ValueError, "epsilon"),
    (lambda: M.truncated_laplace_params(1.0, float("nan"), 1e-5), ValueError, "epsilon"),
    (lambda: M.truncated_laplace_params(1.0, 1.0, 1.0), ValueError, "delta"),
    (lambda: M.truncated_laplace_params(1.0, 1.0, 0.0), ValueError, "delta"),
    (lambda: M.truncated_laplace_params(0.0, 1.0, 1e-5), ValueError, "sensitivity"),
    (lambda: M.truncated_laplace(KEY, (2,), sensitivity=1.0, epsilon=1.0, delta=-0.1),
     ValueError, "delta"),
    (lambda: M.truncated_laplace(KEY, (2,), sensitivity=1.0, epsilon=1.0, delta=1e-5,
                                 dtype=jnp.int32), TypeError, "dtype"),
    (lambda: M.truncated_laplace(KEY, "abc", sensitivity=1.0, epsilon=1.0, delta=1e-5),
     TypeError, "shape"),
    (lambda: M.truncated_laplace(3, (2,), sensitivity=1.0, epsilon=1.0, delta=1e-5),
     TypeError, "key"),
    (lambda: M.truncated_laplace_mechanism(KEY, jnp.arange(2), sensitivity=1.0, epsilon=1.0,
                                           delta=1e-5), TypeError, "value"),
])
def test_bad_inputs_raise_naming_the_argument(call, exc, match):
  with pytest.raises(exc, match=match):
    call()
