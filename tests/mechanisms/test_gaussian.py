"""The Gaussian mechanism (docs/algorithms.md §1.2): analytic and classic calibrations, sampler law."""

import math
import random
from fractions import Fraction

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpjax import accounting
from dpjax import mechanisms as M
from dpjax.mechanisms import discrete, gaussian

N = 20_000
CASES = [(0.1, 1e-5, 1.0), (0.5, 1e-5, 1.0), (0.9, 1e-12, 3.0), (1.0, 1e-6, 2.0),
         (4.0, 1e-8, 1.0), (10.0, 1e-5, 0.5), (0.01, 0.3, 1.0)]


def _bw_delta(sigma, eps, delta_sens):
  """Balle–Wang's exact δ(σ) with SciPy (log-space for the second term)."""
  a, b = delta_sens / (2 * sigma), eps * sigma / delta_sens
  return stats.norm.cdf(a - b) - math.exp(eps + stats.norm.logcdf(-a - b))


def _assert_scale_is_right(samples, sigma):
  samples = np.asarray(samples, np.float64)
  def p(s):
    return stats.kstest(samples, stats.norm(scale=s).cdf).pvalue
  assert p(sigma) > 1e-3
  assert p(sigma * 2 / 3) < 1e-6 and p(sigma * 3 / 2) < 1e-6


@pytest.mark.parametrize("eps,delta,sens", CASES)
def test_analytic_sigma_is_the_smallest_sigma_meeting_balle_wang(eps, delta, sens):
  sigma = M.analytic_gaussian_sigma(eps, delta, sens)
  assert isinstance(sigma, float)
  assert _bw_delta(sigma, eps, sens) <= delta * (1 + 1e-9)            # meets the condition
  assert _bw_delta(sigma * (1 - 1e-7), eps, sens) > delta              # and is the smallest
  assert math.isclose(M.analytic_gaussian_sigma(eps, delta, 1.0) * sens, sigma, rel_tol=1e-12)


@pytest.mark.parametrize("eps,delta,sens", CASES)
def test_analytic_sigma_on_dp_accounting_0_5(monkeypatch, eps, delta, sens):
  """dp-accounting 0.5 has no ``get_sigma_gaussian``: the fallback,
  ``GaussianPrivacyLoss.from_privacy_guarantee``, meets the condition and is within its absolute
  tolerance (1e-7 in σ/Δ) of the smallest σ."""
  monkeypatch.delattr(dp_accounting, "get_sigma_gaussian", raising=False)
  accounting._analytic_unit_sigma.cache_clear()
  try:
    sigma = M.analytic_gaussian_sigma(eps, delta, sens)
  finally:
    accounting._analytic_unit_sigma.cache_clear()
  assert _bw_delta(sigma, eps, sens) <= delta * (1 + 1e-9)
  assert _bw_delta(sigma - 1e-7 * sens, eps, sens) > delta


def test_analytic_sigma_refuses_what_float64_cannot_hold():
  if hasattr(dp_accounting, "get_sigma_gaussian"):         # dp-accounting >= 0.6
    with pytest.raises(ValueError, match="cannot calibrate"):
      M.analytic_gaussian_sigma(1e200, 1e-5)               # the solver's log Φ turns NaN
  with pytest.raises(ValueError, match="overflows"):
    M.analytic_gaussian_sigma(1e-3, 1e-5, 1e306)
  assert M.analytic_gaussian_sigma(1.0, 1e-5, 1e-300) == pytest.approx(3.7306e-300, rel=1e-4)


def test_analytic_known_value_and_below_classic():
  assert math.isclose(M.analytic_gaussian_sigma(1.0, 1e-5), 3.7306, abs_tol=1e-4)
  for eps, delta, sens in CASES:
    if eps < 1:
      classic = M.classic_gaussian_sigma(eps, delta, sens)
      assert classic == pytest.approx(sens * math.sqrt(2 * math.log(1.25 / delta)) / eps)
      assert M.analytic_gaussian_sigma(eps, delta, sens) < classic


def test_classic_refuses_epsilon_at_least_one():
  with pytest.raises(ValueError, match="epsilon"):
    M.classic_gaussian_sigma(1.0, 1e-5)
  with pytest.raises(ValueError, match="epsilon"):
    M.gaussian_mechanism(jax.random.key(0), jnp.zeros(3), sensitivity=1.0, epsilon=2.0,
                         delta=1e-5, calibration="classic", secure=False)


def test_noise_has_the_normal_law():
  z = M.gaussian_noise(jax.random.key(1), (N,), sigma=1.7)
  assert z.shape == (N,) and z.dtype == jnp.float32
  _assert_scale_is_right(z, 1.7)
  assert jnp.all(M.gaussian_noise(jax.random.key(1), (4,), sigma=0.0) == 0)


@pytest.mark.parametrize("calibration", ["analytic", "classic", "rdp"])
def test_raw_mechanism_uses_the_calibrated_sigma(calibration):
  eps, delta = 0.5, 1e-5
  sigma = {"analytic": M.analytic_gaussian_sigma, "classic": M.classic_gaussian_sigma,
           "rdp": M.rdp_gaussian_sigma}[calibration](eps, delta, 2.0)
  value = jnp.full((N,), 4.0)
  out = M.gaussian_mechanism(jax.random.key(2), value, sensitivity=2.0, epsilon=eps,
                             delta=delta, calibration=calibration, secure=False)
  assert out.dtype == jnp.float32
  _assert_scale_is_right(out - value, sigma)


@pytest.mark.parametrize("eps,delta", [(1.0, 1e-5), (0.1, 1e-6), (5.0, 1e-8)])
def test_rdp_sigma_meets_the_budget_and_is_the_smallest(eps, delta):
  def eps_at(z):
    return dp_accounting.rdp.RdpAccountant().compose(
        dp_accounting.GaussianDpEvent(z)).get_epsilon(delta)
  z = M.rdp_gaussian_sigma(eps, delta)
  assert eps_at(z) <= eps and eps_at(z * (1 - 1e-6)) > eps
  assert M.rdp_gaussian_sigma(eps, delta, 3.0) == pytest.approx(3.0 * z, rel=1e-12)
  assert 1.0 < z / M.analytic_gaussian_sigma(eps, delta) < 1.2     # the price of RDP: 5–15%


def test_secure_release_is_on_the_public_grid_with_the_rdp_sigma():
  """Default (secure) release: every output a multiple of the public grid step Λ, noise of std
  σ = z·Δ_Λ·Λ ≈ rdp_gaussian_sigma, float64 NumPy whatever the input dtype."""
  eps, delta, sens = 0.5, 1e-5, 2.0
  value = np.full(N, 4.0 + 1 / 3)
  out = M.gaussian_mechanism(jax.random.key(2), jnp.asarray(value, jnp.float32), sensitivity=sens,
                             epsilon=eps, delta=delta)
  grid = M.discretization(sens, N)
  assert isinstance(out, np.ndarray) and out.dtype == np.float64 and out.shape == (N,)
  assert np.all(out == np.round(out / grid.grid) * grid.grid)
  sigma = M.rdp_gaussian_sigma(eps, delta) * grid.grid_sensitivity * grid.grid
  assert sigma == pytest.approx(M.rdp_gaussian_sigma(eps, delta, sens), rel=2e-3)
  _assert_scale_is_right(out - np.float32(value).astype(np.float64), sigma)
  # Large values keep their digits: the grid is set by Δ and p, not by the value's magnitude.
  big = M.gaussian_mechanism(jax.random.key(3), np.array([1e9 + 0.25]), sensitivity=1e-3,
                             epsilon=8.0, delta=1e-5)
  assert abs(big[0] - (1e9 + 0.25)) < 0.1


def test_secure_release_clamps_to_the_public_bound():
  out = M.gaussian_mechanism(jax.random.key(4), np.array([1e6, -1e6, 3.0]), sensitivity=1.0,
                             epsilon=50.0, delta=1e-5, bound=10.0)
  assert abs(out[0] - 10.0) < 1 and abs(out[1] + 10.0) < 1 and abs(out[2] - 3.0) < 1


def test_discrete_gaussian_sampler_has_the_exact_law():
  """Exact pmf ∝ exp(−z²/(2σ²)) at σ² rounded up to a multiple of 2^-10: chi-square fit."""
  sigma = 1.3
  s2 = float(discrete.discrete_gaussian_sigma2(sigma))
  assert s2 >= sigma**2 and s2 - sigma**2 < 2.0**-10
  z = M.discrete_gaussian(jax.random.key(5), (N,), sigma=sigma)
  assert z.dtype == np.int64 and z.shape == (N,)
  support = np.arange(-6, 7)
  pmf = np.exp(-np.arange(-40, 41) ** 2 / (2 * s2))
  pmf /= pmf.sum()
  probs = pmf[34:47].copy()
  probs[0] += pmf[:34].sum()
  probs[-1] += pmf[47:].sum()
  observed = np.bincount(np.clip(z, -6, 6) + 6, minlength=13)
  assert support.size == observed.size
  assert stats.chisquare(observed, probs * N).pvalue > 1e-3
  again = M.discrete_gaussian(jax.random.key(5), (N,), sigma=sigma)
  assert np.array_equal(z, again)
  assert not np.array_equal(z, M.discrete_gaussian(jax.random.key(6), (N,), sigma=sigma))


def _discrete_gaussian_pvalue(z, sigma, half_width):
  """Chi-square p-value of integer draws against the exact pmf ∝ exp(−z²/(2σ²)), σ² rounded up
  as the sampler does; the outer bins pool the tails."""
  s2 = float(discrete.discrete_gaussian_sigma2(sigma))
  support = np.arange(-400, 401)
  pmf = np.exp(-support.astype(float) ** 2 / (2 * s2))
  pmf /= pmf.sum()
  inner = slice(400 - half_width, 400 + half_width + 1)
  probs = pmf[inner].copy()
  probs[0] += pmf[:400 - half_width].sum()
  probs[-1] += pmf[400 + half_width + 1:].sum()
  observed = np.bincount(np.clip(z, -half_width, half_width) + half_width,
                         minlength=2 * half_width + 1)
  return stats.chisquare(observed, probs * z.size).pvalue


@pytest.mark.parametrize("sigma,half_width", [(0.4, 2), (3.0, 8), (40.0, 120)])
def test_vectorised_discrete_gaussian_has_the_exact_law(sigma, half_width):
  z = discrete.discrete_gaussian_host(np.random.default_rng(11), (N,), sigma)
  assert z.dtype == np.int64
  assert _discrete_gaussian_pvalue(z, sigma, half_width) > 1e-3


def test_tiny_and_huge_sigma():
  """σ = 0.05: P(Z ≠ 0) ≈ e^-170, all zeros. σ = 2^40 (the limit): Gaussian moments and shape."""
  assert not discrete.discrete_gaussian_host(np.random.default_rng(0), (1000,), 0.05).any()
  sigma = 2.0**40
  z = discrete.discrete_gaussian_host(np.random.default_rng(1), (N,), sigma) / sigma
  assert abs(z.mean()) < 4 / math.sqrt(N) and abs(z.std() - 1) < 0.03
  assert stats.kstest(z, "norm").pvalue > 1e-3


def test_undecided_coins_are_settled_exactly(monkeypatch):
  """The acceptance coins the float estimate cannot settle go to exact rationals. A margin of
  2^-6 (instead of 2^-30) sends a few percent of them there — the law must not move — and a
  float-γ limit of 0.5 sends every γ > 0.5 through the exact Python Bernoulli(exp(−γ))."""
  calls = {"below": 0, "exp": 0}
  below, bern = discrete._uniform_below, discrete._bernoulli_exp

  def counted_below(*args):
    calls["below"] += 1
    return below(*args)

  def counted_exp(*args):
    calls["exp"] += 1
    return bern(*args)

  monkeypatch.setattr(discrete, "_uniform_below", counted_below)
  monkeypatch.setattr(discrete, "_bernoulli_exp", counted_exp)
  monkeypatch.setattr(discrete, "_MARGIN", 2.0**-6)
  z = discrete.discrete_gaussian_host(np.random.default_rng(12), (N,), 0.4)
  assert calls["below"] > 100
  assert _discrete_gaussian_pvalue(z, 0.4, 2) > 1e-3
  monkeypatch.setattr(discrete, "_MAX_FLOAT_GAMMA", 0.5)
  z = discrete.discrete_gaussian_host(np.random.default_rng(13), (N,), 1.3)
  assert calls["exp"] > 100
  assert _discrete_gaussian_pvalue(z, 1.3, 4) > 1e-3


def test_uniform_below_is_exact():
  """U uniform on [prefix, prefix+1)·2^-53 against a rational p: sure outside, Bernoulli of the
  fractional part inside."""
  rng = random.Random(0)
  one = 2**-53
  assert discrete._uniform_below(rng, 5, Fraction(6) * Fraction(one))       # P = 6 ≥ prefix + 1
  assert not discrete._uniform_below(rng, 5, Fraction(5) * Fraction(one))   # P = 5 ≤ prefix
  inside = Fraction(21, 4) * Fraction(one)                                  # P − prefix = 1/4
  hits = sum(discrete._uniform_below(rng, 5, inside) for _ in range(4000))
  assert abs(hits / 4000 - 0.25) < 0.03


def test_float64_and_key_hygiene():
  with jax.enable_x64(True):
    out = M.gaussian_mechanism(jax.random.key(3), jnp.zeros(5, jnp.float64), sensitivity=1.0,
                               epsilon=1.0, delta=1e-5, secure=False)
    assert out.dtype == jnp.float64
  secure = M.gaussian_mechanism(jax.random.key(3), np.zeros(5), sensitivity=1.0, epsilon=1.0,
                                delta=1e-5)
  assert np.array_equal(secure, M.gaussian_mechanism(jax.random.key(3), np.zeros(5),
                                                     sensitivity=1.0, epsilon=1.0, delta=1e-5))
  a = M.gaussian_noise(jax.random.key(4), (6,), sigma=1.0)
  assert jnp.array_equal(a, M.gaussian_noise(jax.random.key(4), (6,), sigma=1.0))
  assert not jnp.array_equal(a, M.gaussian_noise(jax.random.key(5), (6,), sigma=1.0))


KEY = jax.random.key(0)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: M.analytic_gaussian_sigma(0.0, 1e-5), ValueError, "epsilon"),
    (lambda: M.analytic_gaussian_sigma(float("nan"), 1e-5), ValueError, "epsilon"),
    (lambda: M.analytic_gaussian_sigma(1.0, 0.0), ValueError, "delta"),
    (lambda: M.analytic_gaussian_sigma(1.0, 1.0), ValueError, "delta"),
    (lambda: M.analytic_gaussian_sigma(1.0, float("nan")), ValueError, "delta"),
    (lambda: M.analytic_gaussian_sigma(1.0, 1e-5, 0.0), ValueError, "sensitivity"),
    (lambda: M.classic_gaussian_sigma(0.5, 1.5), ValueError, "delta"),
    (lambda: M.gaussian_noise(KEY, (2,), sigma=-1.0), ValueError, "sigma"),
    (lambda: M.gaussian_noise(KEY, (2,), sigma=1.0, dtype=jnp.int8), TypeError, "dtype"),
    (lambda: M.gaussian_noise(None, (2,), sigma=1.0), TypeError, "key"),
    (lambda: M.gaussian_mechanism(KEY, jnp.ones(2), sensitivity=1.0, epsilon=1.0, delta=1.5),
     ValueError, "delta"),
    (lambda: M.gaussian_mechanism(KEY, jnp.ones(2), sensitivity=1.0, epsilon=1.0, delta=1e-5,
                                  calibration="zcdp"), ValueError, "calibration"),
    (lambda: M.gaussian_mechanism(KEY, jnp.ones(2), sensitivity=1.0, epsilon=1.0, delta=1e-5,
                                  calibration="analytic"), ValueError, "continuous"),
    (lambda: M.gaussian_mechanism(KEY, jnp.ones(2), sensitivity=0.0, epsilon=1.0, delta=1e-5),
     ValueError, "sensitivity"),
    (lambda: M.gaussian_mechanism(KEY, jnp.ones(2), sensitivity=1.0, epsilon=1.0, delta=1e-5,
                                  bound=1e-9), ValueError, "bound"),
    (lambda: M.discrete_gaussian(KEY, (2,), sigma=0.0), ValueError, "sigma"),
    (lambda: M.discrete_gaussian(KEY, (2,), sigma=2.0**41), ValueError, "sigma"),
    (lambda: M.gaussian_mechanism(KEY, jnp.ones(2, jnp.int32), sensitivity=1.0, epsilon=1.0,
                                  delta=1e-5), TypeError, "value"),
])
def test_bad_inputs_raise_naming_the_argument(call, exc, match):
  with pytest.raises(exc, match=match):
    call()
