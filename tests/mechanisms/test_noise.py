"""Noise samplers: the right distribution at the right scale (KS / chi-square tests).

Each sampler is checked against its exact CDF: the right scale is accepted, and 2/3 and 3/2 of it
are rejected, so a wrong scale cannot pass.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpjax import mechanisms as M

N_SAMPLES = 20_000


def _ks_p(samples, cdf):
  return stats.kstest(np.asarray(samples, np.float64), cdf).pvalue


def _assert_scale_is_right(samples, make_cdf, scale):
  assert _ks_p(samples, make_cdf(scale)) > 1e-3
  assert _ks_p(samples, make_cdf(scale * 2 / 3)) < 1e-6
  assert _ks_p(samples, make_cdf(scale * 3 / 2)) < 1e-6


def test_laplace_noise_scale():
  b = M.laplace_scale(sensitivity=2.0, epsilon=0.5)
  assert b == 4.0
  samples = M.laplace_noise(jax.random.key(0), (N_SAMPLES,), scale=b)
  _assert_scale_is_right(samples, lambda s: stats.laplace(scale=s).cdf, b)


def test_laplace_mechanism_adds_noise_around_value_float64():
  with jax.enable_x64(True):
    value = jnp.full((N_SAMPLES,), 3.0, jnp.float64)
    out = M.laplace_mechanism(jax.random.key(1), value, sensitivity=1.0, epsilon=2.0,
                              secure=False)
    assert out.dtype == jnp.float64
    _assert_scale_is_right(out - 3.0, lambda s: stats.laplace(scale=s).cdf, 0.5)


def test_gaussian_mechanism_uses_analytic_sigma():
  sigma = M.analytic_gaussian_sigma(1.0, 1e-5, 1.0)
  out = M.gaussian_mechanism(jax.random.key(2), jnp.zeros(N_SAMPLES), sensitivity=1.0,
                             epsilon=1.0, delta=1e-5)
  _assert_scale_is_right(out, lambda s: stats.norm(scale=s).cdf, sigma)


def test_analytic_sigma_meets_balle_wang_condition_exactly():
  for eps, delta, sens in [(0.5, 1e-5, 1.0), (1.0, 1e-6, 2.0), (8.0, 1e-5, 1.0)]:
    sigma = M.analytic_gaussian_sigma(eps, delta, sens)
    def bw_delta(s):
      a, b = sens / (2 * s), eps * s / sens
      return stats.norm.cdf(a - b) - math.exp(eps) * stats.norm.cdf(-a - b)
    assert bw_delta(sigma) <= delta * (1 + 1e-9)
    assert bw_delta(sigma * 0.999) > delta         # the smallest such σ
    if eps < 1:
      assert sigma < M.classic_gaussian_sigma(eps, delta, sens)


def test_classic_gaussian_refuses_epsilon_at_least_one():
  with pytest.raises(ValueError, match="epsilon < 1"):
    M.classic_gaussian_sigma(1.0, 1e-5)
  with pytest.raises(ValueError, match="epsilon < 1"):
    M.gaussian_mechanism(jax.random.key(0), jnp.zeros(3), sensitivity=1.0, epsilon=2.0,
                         delta=1e-5, calibration="classic")


def test_truncated_laplace_constants_and_support():
  p = M.truncated_laplace_params(2.0, 1.0, 1e-6)
  assert round(p.bound, 4) == 27.3274 and abs(p.density - 0.2500003) < 1e-7
  # The mass beyond A − Δ is exactly δ: P[Z > A − Δ] = Bλ(e^{−(A−Δ)/λ} − e^{−A/λ}).
  tail = p.density * p.scale * (math.exp(-(p.bound - 2.0) / p.scale) - math.exp(-p.bound / p.scale))
  assert math.isclose(tail, 1e-6, rel_tol=1e-6)
  # The density integrates to one.
  assert math.isclose(2 * p.density * p.scale * (1 - math.exp(-p.bound / p.scale)), 1.0,
                      rel_tol=1e-12)


def test_truncated_laplace_sampler_distribution():
  delta = 0.05                                            # a short support to see truncation
  p = M.truncated_laplace_params(1.0, 1.0, delta)
  samples = np.asarray(M.truncated_laplace(jax.random.key(3), (N_SAMPLES,), sensitivity=1.0,
                                           epsilon=1.0, delta=delta))
  assert np.all(np.abs(samples) <= p.bound)

  def make_cdf(scale):
    bound = p.bound
    mass = 1 - math.exp(-bound / scale)
    def cdf(x):
      x = np.clip(x, -bound, bound)
      half = (1 - np.exp(-np.abs(x) / scale)) / (2 * mass)
      return 0.5 + np.sign(x) * half
    return cdf
  _assert_scale_is_right(samples, make_cdf, p.scale)


def test_truncated_laplace_float64_and_mechanism():
  with jax.enable_x64(True):
    z = M.truncated_laplace(jax.random.key(4), (100,), sensitivity=2.0, epsilon=1.0, delta=1e-6,
                            dtype=jnp.float64)
    assert z.dtype == jnp.float64
  out = M.truncated_laplace_mechanism(jax.random.key(5), jnp.ones(10), sensitivity=1.0,
                                      epsilon=1.0, delta=1e-6)
  assert out.shape == (10,)


def test_discrete_laplace_pmf():
  scale = 2.0
  z = np.asarray(M.discrete_laplace(jax.random.key(6), (N_SAMPLES,), scale=scale))
  assert z.dtype == np.int32

  def chi2_p(s):
    p = math.exp(-1 / s)
    support = np.arange(-12, 13)
    probs = (1 - p) / (1 + p) * p ** np.abs(support)
    probs[0] += (p**13 / (1 + p)) ; probs[-1] += p**13 / (1 + p)
    observed = np.array([np.sum(np.clip(z, -12, 12) == k) for k in support])
    return stats.chisquare(observed, probs / probs.sum() * observed.sum()).pvalue
  assert chi2_p(scale) > 1e-3
  assert chi2_p(scale * 2 / 3) < 1e-6 and chi2_p(scale * 3 / 2) < 1e-6
  assert math.isclose(M.discrete_laplace_tail(3, scale), math.exp(-1.5) / (1 + math.exp(-0.5)))


def test_discrete_laplace_mechanism_keeps_integers():
  out = M.discrete_laplace_mechanism(jax.random.key(7), jnp.arange(5), sensitivity=1, epsilon=1.0)
  assert out.dtype == jnp.int32
  with pytest.raises(TypeError, match="integer"):
    M.discrete_laplace_mechanism(jax.random.key(7), jnp.ones(3), sensitivity=1, epsilon=1.0)


def test_exponential_mechanism_frequencies_match_softmax():
  scores = jnp.array([0.0, 1.0, 2.0, 4.0])
  keys = jax.random.split(jax.random.key(8), 8_000)
  picks = np.asarray(jax.vmap(lambda k: M.exponential.__dict__["_gumbel_max"](
      k, scores, 0.5))(keys))
  probs = np.exp(0.5 * np.asarray(scores, np.float64)); probs /= probs.sum()
  observed = np.bincount(picks, minlength=4)
  assert stats.chisquare(observed, probs * observed.sum()).pvalue > 1e-3
  assert int(M.exponential_mechanism(jax.random.key(9), scores, sensitivity=1.0, epsilon=1.0)) in range(4)


@pytest.mark.parametrize("sampler", ["laplace", "gaussian", "tlap", "dlap"])
def test_same_key_same_noise_different_key_different_noise(sampler):
  draw = {
      "laplace": lambda k: M.laplace_noise(k, (5,), scale=1.0),
      "gaussian": lambda k: M.gaussian_noise(k, (5,), sigma=1.0),
      "tlap": lambda k: M.truncated_laplace(k, (5,), sensitivity=1.0, epsilon=1.0, delta=1e-5),
      "dlap": lambda k: M.discrete_laplace(k, (50,), scale=3.0),
  }[sampler]
  assert jnp.array_equal(draw(jax.random.key(0)), draw(jax.random.key(0)))
  assert not jnp.array_equal(draw(jax.random.key(0)), draw(jax.random.key(1)))


@pytest.mark.parametrize("call,exc,match", [
    (lambda: M.laplace_mechanism(jax.random.key(0), jnp.ones(2), sensitivity=1.0, epsilon=0.0), ValueError, "epsilon"),
    (lambda: M.laplace_mechanism(jax.random.key(0), jnp.ones(2), sensitivity=1.0, epsilon=float("nan")), ValueError, "epsilon"),
    (lambda: M.laplace_mechanism(jax.random.key(0), jnp.array([1.0, jnp.nan]), sensitivity=1.0, epsilon=1.0), ValueError, "NaN"),
    (lambda: M.laplace_mechanism(jax.random.key(0), jnp.ones(2), sensitivity=-1.0, epsilon=1.0), ValueError, "sensitivity"),
    (lambda: M.laplace_mechanism(7, jnp.ones(2), sensitivity=1.0, epsilon=1.0), TypeError, "key"),
    (lambda: M.gaussian_mechanism(jax.random.key(0), jnp.ones(2), sensitivity=1.0, epsilon=1.0, delta=1.5), ValueError, "delta"),
    (lambda: M.gaussian_mechanism(jax.random.key(0), jnp.ones(2), sensitivity=1.0, epsilon=1.0, delta=0.0), ValueError, "delta"),
    (lambda: M.truncated_laplace_params(1.0, -1.0, 1e-5), ValueError, "epsilon"),
    (lambda: M.truncated_laplace_params(1.0, 1.0, 1.0), ValueError, "delta"),
    (lambda: M.discrete_laplace(jax.random.key(0), (3,), scale=0.0), ValueError, "scale"),
    (lambda: M.exponential_mechanism(jax.random.key(0), jnp.ones((2, 2)), sensitivity=1.0, epsilon=1.0), ValueError, "scores"),
])
def test_bad_inputs_raise_clear_errors(call, exc, match):
  with pytest.raises(exc, match=match):
    call()
