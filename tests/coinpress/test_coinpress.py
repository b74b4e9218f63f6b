"""Tests for dpjax.coinpress: CoinPress private mean and covariance refinement."""

import functools
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import NeighboringRelation

from dpjax import accounting
from dpjax import coinpress as cp
from dpjax.coinpress import covariance as cp_covariance
from dpjax.mechanisms import analytic_gaussian_sigma, discretization

EPS, DELTA = 1.0, 1e-6
D_MEAN, N_MEAN = 10, 20_000


def _mean_problem(seed, n=N_MEAN, d=D_MEAN):
  """N(μ, I) rows and a wrong prior centre at distance 60 inside a radius-100 ball."""
  rng = np.random.default_rng(seed)
  mu = rng.normal(size=d) * 10.0
  X = mu + rng.normal(size=(n, d))
  offset = rng.normal(size=d)
  center = mu + 60.0 * offset / np.linalg.norm(offset)
  return X, mu, center


def _random_cov(rng, d, kappa):
  """``Q diag(geomspace(1, κ, d)) Qᵀ``: I ⪯ Σ ⪯ κ I with both ends attained."""
  q, _ = np.linalg.qr(rng.normal(size=(d, d)))
  return (q * np.geomspace(1.0, kappa, d)) @ q.T


def _cov_problem(seed, n, d, kappa=10.0):
  rng = np.random.default_rng(seed)
  sigma = _random_cov(rng, d, kappa)
  X = rng.normal(size=(n, d)) @ np.linalg.cholesky(sigma).T
  return X, sigma


def _mahalanobis_error(sigma, sigma_hat):
  """``‖Σ^{-1/2} Σ̂ Σ^{-1/2} − I‖_2``."""
  w, V = np.linalg.eigh(sigma)
  inv_sqrt = (V / np.sqrt(w)) @ V.T
  return np.linalg.norm(inv_sqrt @ sigma_hat @ inv_sqrt - np.eye(len(sigma)), 2)


def _recomposed_epsilon(noise_multipliers, delta, accountant="pld"):
  """ε recomputed independently with dp_accounting (shift-1 Gaussians, add/remove reading)."""
  events = [dp_accounting.GaussianDpEvent(z) for z in noise_multipliers]
  acc = (dp_accounting.pld.PLDAccountant() if accountant == "pld"
         else dp_accounting.rdp.RdpAccountant())
  return acc.compose(dp_accounting.ComposedDpEvent(events)).get_epsilon(delta)


# ------------------------------------------------------------------------------ mean: utility


def test_mean_accuracy_several_seeds():
  # Derived bound: with prob ≥ 1 − β (β = 0.01), ‖μ̂ − μ‖ ≤ r_T = γ' sqrt(1/n + σ_{T−1}²) with
  # γ' = gaussian_norm_radius(d, β/(2T)): sampling (1/n) plus the last step's noise (σ²).
  # Here r_T ≈ 0.051, against the non-private sqrt(d/n) ≈ 0.022.
  for seed in range(5):
    X, mu, center = _mean_problem(seed)
    res = cp.coinpress_mean(jax.random.key(seed), X, epsilon=EPS, delta=DELTA, center=center,
                            radius=100.0)
    info = res.info
    sigma_last = info["sigmas"][-1]
    gamma_step = cp.gaussian_norm_radius(D_MEAN, 0.01 / (2 * info["steps"]))
    bound = gamma_step * math.sqrt(1.0 / N_MEAN + sigma_last**2)
    assert info["error_bound"] == pytest.approx(bound, rel=1e-12)
    assert bound < 0.06
    err = np.linalg.norm(res.estimate - mu)
    assert err <= bound, (seed, err, bound)
    # Every intermediate ball contained μ (the induction behind the bound).
    radii = np.asarray(info["radii"][1:])
    assert np.all(np.linalg.norm(res.released["centers"] - mu, axis=1) <= radii)


def test_mean_error_decreases_with_n():
  errs = []
  for n in (2_000, 20_000, 100_000):
    e = []
    for seed in range(4):
      X, mu, center = _mean_problem(100 + seed, n=n)
      res = cp.coinpress_mean(jax.random.key(seed), X, epsilon=EPS, delta=DELTA,
                              center=center, radius=100.0)
      e.append(np.linalg.norm(res.estimate - mu))
    errs.append(np.mean(e))
  assert errs[0] > errs[1] > errs[2], errs
  assert errs[0] > 3.0 * errs[2], errs


def test_mean_radii_are_public_functions_of_the_arguments():
  X1, _, center = _mean_problem(0)
  X2 = np.random.default_rng(7).standard_cauchy(size=X1.shape) * 1e3   # wildly different rows
  for secure in (True, False):
    r1 = cp.coinpress_mean(jax.random.key(0), X1, epsilon=EPS, delta=DELTA, center=center,
                           radius=100.0, secure=secure)
    r2 = cp.coinpress_mean(jax.random.key(1), X2, epsilon=EPS, delta=DELTA, center=center,
                           radius=100.0, secure=secure)
    for name in ("clip_radii", "radii", "sigmas", "sensitivities", "noise_multipliers"):
      assert r1.info[name] == r2.info[name], name
      assert all(isinstance(x, float) for x in r1.info[name]), name
    # ... and equal to the documented recursion, recomputed here. The float-safe release's std
    # is z times the grid sensitivity (≤ (1 + 2^-10)·2R/n).
    n, d, beta = N_MEAN, D_MEAN, 0.01
    gamma = cp.gaussian_norm_radius(d, beta / (2 * n))
    gamma_step = cp.gaussian_norm_radius(d, beta / 8)
    r = 100.0
    for t, z in enumerate(r1.info["noise_multipliers"]):
      big_r = r + gamma
      if secure:                        # room for rounding the centre to the step's grid
        big_r += math.sqrt(d) * discretization(2.0 * big_r / n, d).grid
      assert r1.info["clip_radii"][t] == pytest.approx(big_r, rel=1e-12)
      sens = 2.0 * big_r / n
      if secure:
        grid = discretization(sens, d)
        assert r1.info["grids"][t] == grid.grid
        sigma = z * grid.grid_sensitivity * grid.grid
        assert 1.0 < sigma / (z * sens) < 1.0 + 2.0**-9
      else:
        sigma = z * sens
      assert r1.info["sigmas"][t] == pytest.approx(sigma, rel=1e-12)
      r = gamma_step * math.sqrt(1.0 / n + sigma**2)
    assert r1.info["error_bound"] == pytest.approx(r, rel=1e-12)


def test_mean_translation_equivariant():
  """Exactly with raw noise; up to the public rounding grid with the float-safe release (the
  shifted statistic rounds to other grid points; the noise is the same)."""
  X, _, center = _mean_problem(3, n=2_000)
  shift = np.linspace(-2e3, 1e3, D_MEAN)
  key = jax.random.key(11)
  for secure in (False, True):
    kw = dict(epsilon=EPS, delta=DELTA, radius=100.0, secure=secure)
    a = cp.coinpress_mean(key, X, center=center, **kw)
    b = cp.coinpress_mean(key, X + shift, center=center + shift, **kw)
    atol = 1e-9 if not secure else 2 * max(a.info["grids"])
    np.testing.assert_allclose(b.estimate - shift, a.estimate, atol=atol)


def test_secure_releases_lie_on_their_public_grids():
  """Every release of the float-safe default is a multiple of its public grid step: the mean's
  centres c_1..c_T, and the covariance's noisy second moments in isometric coordinates."""
  X, _, center = _mean_problem(4, n=2_000)
  res = cp.coinpress_mean(jax.random.key(2), X, epsilon=EPS, delta=DELTA, center=center,
                          radius=100.0)
  for c, grid in zip(res.released["centers"], res.info["grids"]):
    assert np.all(c == np.round(c / grid) * grid)
  assert np.array_equal(res.estimate, res.released["centers"][-1])
  Xc, _ = _cov_problem(4, 5_000, 5)                # the shape of the privacy tests: one compile
  cov = cp.coinpress_covariance(jax.random.key(3), Xc, epsilon=EPS, delta=DELTA, kappa=10.0,
                                steps=2)
  rows, cols = np.triu_indices(5)
  for Z, grid in zip(cov.released["releases"], cov.info["grids"]):
    coords = Z[rows, cols] * np.where(rows == cols, 1.0, math.sqrt(2.0))
    assert np.array_equal(Z, Z.T)
    np.testing.assert_allclose(coords / grid, np.round(coords / grid), atol=1e-6)


@pytest.mark.parametrize("offset", [1e8, 1e12])
def test_secure_mean_far_from_the_origin_is_accurate_and_on_its_grids(offset):
  """The float-safe release is made about the (public) centre: released about 0 its clamp
  2^50 Λ bound (≈ 2·10⁸ at n = 3·10⁵, radius 1.5) and the estimate saturated there (an error of
  7·10⁷ at offset 1e8, found end to end in learn_gaussian)."""
  rng = np.random.default_rng(0)
  mu = offset * np.array([1.0, -0.5, 1.0 / 3.0])
  X = mu + rng.normal(size=(276_000, 3))
  res = cp.coinpress_mean(jax.random.key(0), X, epsilon=1.0, delta=1e-6, center=mu + 0.05,
                          radius=1.5)
  assert np.linalg.norm(np.asarray(res.estimate) - mu) <= res.info["error_bound"]
  for c, grid in zip(res.released["centers"], res.info["grids"]):
    assert np.all(c == np.round(c / grid) * grid)


def test_secure_release_refuses_continuous_only_accountants():
  X, _, center = _mean_problem(0, n=2_000)
  for accountant in ("analytic", "pld"):
    with pytest.raises(ValueError, match="continuous"):
      cp.coinpress_mean(jax.random.key(0), X, epsilon=EPS, delta=DELTA, center=center,
                        radius=100.0, accountant=accountant)
    with pytest.raises(ValueError, match="continuous"):
      cp.coinpress_covariance(jax.random.key(0), X, epsilon=EPS, delta=DELTA, kappa=2.0,
                              accountant=accountant)


def test_mean_released_noise_has_the_calibrated_scale():
  # A tiny audit of the last release: rows concentrated at μ are never clipped, so
  # μ̂ − x̄ ~ N(0, σ_{T−1}² I) exactly; its pooled moments must match the σ that was accounted.
  rng = np.random.default_rng(5)
  n, d, trials = 2_000, D_MEAN, 100
  X = np.linspace(-3.0, 3.0, d) + 0.01 * rng.normal(size=(n, d))
  xbar = X.mean(axis=0)
  zs, sigma = [], None
  for i in range(trials):
    res = cp.coinpress_mean(jax.random.key(1000 + i), X, epsilon=EPS, delta=DELTA,
                            center=np.zeros(d), radius=10.0)
    sigma = res.info["sigmas"][-1]
    zs.append((res.estimate - xbar) / sigma)
  z = np.concatenate(zs)                                    # 1000 standard normals
  m = z.size
  assert abs(z.mean()) < 4.0 / math.sqrt(m)
  # var ~ χ²_m/m: sd sqrt(2/m) ≈ 0.067; 4.5 sd bounds.
  assert abs(z.var() - 1.0) < 4.5 * math.sqrt(2.0 / m)


# ------------------------------------------------------------------------ covariance: utility


@pytest.mark.parametrize("d", [
    5, pytest.param(10, marks=pytest.mark.slow(reason="d = 10; the default run checks d = 5"))])
def test_covariance_accuracy(d):
  # Rigorous bound (prob ≥ 0.99): info["error_bound"] (worst case, ≈0.56 at d=5, ≈1.3 at d=10).
  # Stated practical bound: 0.15, about 2× the largest error seen over many seeds at n = 5e4
  # (typical 0.03 at d=5 and 0.06 at d=10; the non-private error is ≈0.02–0.03).
  n = 50_000
  for seed in range(3):
    X, sigma = _cov_problem(10 * d + seed, n, d)
    res = cp.coinpress_covariance(jax.random.key(seed), X, epsilon=EPS, delta=DELTA,
                                  kappa=10.0, steps=3)
    err = _mahalanobis_error(sigma, res.estimate)
    assert err <= res.info["error_bound"], (seed, err)
    assert err <= 0.15, (d, seed, err)


def test_covariance_error_decreases_with_n():
  d = 5
  errs = []
  for n in (5_000, 20_000, 50_000):
    e = []
    for seed in range(3):
      X, sigma = _cov_problem(200 + seed, n, d)
      res = cp.coinpress_covariance(jax.random.key(seed), X, epsilon=EPS, delta=DELTA,
                                    kappa=10.0, steps=3)
      e.append(_mahalanobis_error(sigma, res.estimate))
    errs.append(np.mean(e))
  assert errs[0] > errs[1] > errs[2], errs
  assert errs[0] > 4.0 * errs[2], errs


@pytest.mark.parametrize("n,epsilon", [(50_000, 1.0), (5_000, 0.002)])
def test_covariance_output_is_symmetric_psd_float64(n, epsilon):
  # (5000, 0.002): the noise swamps the statistic, Z is indefinite, and the PSD projection is
  # what keeps the output PSD (it then has exact zero eigenvalues).
  d = 5
  X, _ = _cov_problem(1, n, d)
  res = cp.coinpress_covariance(jax.random.key(3), jnp.asarray(X, jnp.float32),
                                epsilon=epsilon, delta=DELTA, kappa=10.0, steps=3)
  S = res.estimate
  assert isinstance(S, np.ndarray) and S.shape == (d, d) and S.dtype == np.float64
  assert np.array_equal(S, S.T)
  w = np.linalg.eigvalsh(S)
  assert w.min() >= -1e-12 * max(1.0, w.max())
  assert np.all(np.isfinite(S))
  if epsilon < 0.01:
    assert w.min() <= 1e-9 * w.max()


def test_covariance_default_steps_rule():
  s0 = analytic_gaussian_sigma(EPS, DELTA)
  for n, d, expected in ((10_000, 10, 1), (50_000, 5, 3), (200_000, 10, 3)):
    chosen = cp.choose_covariance_steps(n, d, kappa=10.0, epsilon=EPS, delta=DELTA)
    proxies = [cp_covariance._covariance_plan(n, d, 10.0, 0.01, cp.default_fractions(t), s0).typical_error
               for t in range(1, 9)]
    # The smallest T within 10% of the best typical-case proxy.
    assert proxies[chosen - 1] <= 1.1 * min(proxies)
    assert all(p > 1.1 * min(proxies) for p in proxies[:chosen - 1])
    assert chosen == expected
  X, _ = _cov_problem(2, 50_000, 5)
  res = cp.coinpress_covariance(jax.random.key(0), X, epsilon=EPS, delta=DELTA, kappa=10.0)
  assert res.info["steps_rule"] == "choose_covariance_steps" and res.info["steps"] == 3
  given = cp.coinpress_covariance(jax.random.key(0), X, epsilon=EPS, delta=DELTA, kappa=10.0,
                                  steps=3)
  assert given.info["steps_rule"] == "given" and given.info["steps"] == 3


def test_covariance_required_n_is_the_first_n_whose_default_run_meets_the_target():
  s0 = analytic_gaussian_sigma(EPS, DELTA)
  best = lambda n, d, kappa: min(                                         # noqa: E731
      cp_covariance._covariance_plan(n, d, kappa, 0.01, cp.default_fractions(t), s0).typical_error
      for t in range(1, 9))
  for d, kappa, accuracy in ((5, 52.0, 0.1), (10, 1540.0, 0.1), (3, 16.0, 0.3)):
    n = cp.covariance_required_n(d, kappa=kappa, epsilon=EPS, delta=DELTA, accuracy=accuracy)
    assert best(n, d, kappa) <= accuracy / 1.1 < best(n - 1, d, kappa)
    for m in (n, 2 * n, 10 * n):                 # the default T's proxy stays under the target
      T = cp.choose_covariance_steps(m, d, kappa=kappa, epsilon=EPS, delta=DELTA)
      plan = cp_covariance._covariance_plan(m, d, kappa, 0.01, cp.default_fractions(T), s0)
      assert plan.typical_error <= accuracy
  # Fewer rows at a looser target or a larger ε; slowly more at a larger κ (3.7× at 1e8).
  n = cp.covariance_required_n(5, kappa=52.0, epsilon=EPS, delta=DELTA)
  assert cp.covariance_required_n(5, kappa=52.0, epsilon=EPS, delta=DELTA, accuracy=0.2) < n
  assert cp.covariance_required_n(5, kappa=52.0, epsilon=4.0, delta=DELTA) < n
  assert n < cp.covariance_required_n(5, kappa=1e8, epsilon=EPS, delta=DELTA) < 5 * n


def test_covariance_at_required_n_meets_the_target_on_the_worst_spread():
  """Measured error at the planned n, eigenvalues geometric on [1, κ] (the proxy's worst case)."""
  d, kappa = 5, 52.0
  n = cp.covariance_required_n(d, kappa=kappa, epsilon=EPS, delta=DELTA, accuracy=0.1)
  errors = []
  for seed in range(3):
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    A = Q * np.sqrt(np.geomspace(1.0, kappa, d))
    X = rng.normal(size=(n, d)) @ A.T
    S = cp.coinpress_covariance(jax.random.key(seed), X, epsilon=EPS, delta=DELTA,
                                kappa=kappa).estimate
    W = np.linalg.inv(np.linalg.cholesky(A @ A.T))
    errors.append(np.linalg.norm(W @ S @ W.T - np.eye(d), 2))
  assert max(errors) < 0.1, errors


@pytest.mark.parametrize("bad, match", [
    (dict(kappa=0.5), "kappa"), (dict(accuracy=0.0), "accuracy"), (dict(epsilon=-1.0), "epsilon"),
    (dict(delta=1.0), "delta"), (dict(beta=1.0), "beta")])
def test_covariance_required_n_rejects_bad_arguments(bad, match):
  kwargs = dict(kappa=10.0, epsilon=EPS, delta=DELTA) | bad
  with pytest.raises(ValueError, match=match):
    cp.covariance_required_n(5, **kwargs)


# ---------------------------------------------------------------------- privacy bookkeeping


def _mean_result(accountant="pld", fractions=None):
  X, _, center = _mean_problem(0, n=2_000)
  return X, cp.coinpress_mean(jax.random.key(0), X, epsilon=EPS, delta=DELTA, center=center,
                              radius=100.0, accountant=accountant, fractions=fractions,
                              secure=accountant == "rdp")


def test_mean_composed_epsilon_meets_target():
  X, res = _mean_result()
  n = X.shape[0]
  info = res.info
  # Sensitivities recomputed from the public clip radii: replace-one ℓ2 sensitivity 2R_t/n.
  sens = [2.0 * R / n for R in info["clip_radii"]]
  zs = [s / dl for s, dl in zip(info["sigmas"], sens)]
  np.testing.assert_allclose(zs, info["noise_multipliers"], rtol=1e-12)
  eps = _recomposed_epsilon(zs, DELTA)
  assert eps <= EPS
  assert EPS - eps < 1e-3
  assert res.epsilon <= EPS and res.epsilon == pytest.approx(eps, abs=1e-9)
  assert res.delta == DELTA and res.neighboring == NeighboringRelation.REPLACE_ONE
  # Paper's split: z_t² f_t is the same for every step (ρ_t = f_t ρ), fractions 1/12,1/12,1/12,3/4.
  np.testing.assert_allclose(info["fractions"], [1 / 12, 1 / 12, 1 / 12, 3 / 4])
  np.testing.assert_allclose(np.square(zs) * np.asarray(info["fractions"]),
                             info["noise_scale"] ** 2, rtol=1e-12)
  # Cross-check that does not rest on dp_accounting's conventions: composed Gaussians are one
  # Gaussian with multiplier (Σ z_t^-2)^-1/2, whose exact (Balle–Wang) σ at (ε, δ) is known.
  z_eff = 1.0 / math.sqrt(sum(z**-2 for z in zs))
  assert z_eff == pytest.approx(analytic_gaussian_sigma(EPS, DELTA), rel=1e-3)
  assert info["zcdp_rho"] == pytest.approx(1.0 / (2.0 * z_eff**2), rel=1e-9)


def test_covariance_composed_epsilon_meets_target():
  X, _ = _cov_problem(0, 5_000, 5)
  n, d = X.shape
  gamma = cp.gaussian_norm_radius(d, 0.01 / (3 * n))
  sens = math.sqrt(2.0) * gamma**2 / n                      # replace-one Frobenius sensitivity
  raw = cp.coinpress_covariance(jax.random.key(0), X, epsilon=EPS, delta=DELTA, kappa=10.0,
                                steps=3, secure=False)
  assert raw.info["clip_radii"] == (pytest.approx(gamma, rel=1e-12),) * 3
  zs = [s / sens for s in raw.info["sigmas"]]
  np.testing.assert_allclose(zs, raw.info["noise_multipliers"], rtol=1e-12)
  eps = _recomposed_epsilon(zs, DELTA)
  # The raw default (analytic) s is exact; PLD's discretisation is pessimistic by ~1e-8.
  assert eps <= EPS * (1 + 1e-6) and EPS - eps < 1e-3
  pld = cp.coinpress_covariance(jax.random.key(0), X, epsilon=EPS, delta=DELTA, kappa=10.0,
                                steps=3, accountant="pld", secure=False)
  assert _recomposed_epsilon(pld.info["noise_multipliers"], DELTA) <= EPS
  # The float-safe default: z_t from the RDP accountant, noise z_t times the grid sensitivity.
  res = cp.coinpress_covariance(jax.random.key(0), X, epsilon=EPS, delta=DELTA, kappa=10.0,
                                steps=3)
  assert res.info["accountant"] == "rdp" and res.info["secure"]
  grid = discretization(sens, d * (d + 1) // 2)
  np.testing.assert_allclose(res.info["sigmas"], np.asarray(res.info["noise_multipliers"])
                             * grid.grid_sensitivity * grid.grid, rtol=1e-12)
  eps = _recomposed_epsilon(res.info["noise_multipliers"], DELTA, accountant="rdp")
  assert eps <= EPS and EPS - eps < 1e-3


def test_frobenius_sensitivity_bound_is_tight():
  # ‖wwᵀ − w'w'ᵀ‖_F ≤ √2 γ² for ‖w‖, ‖w'‖ ≤ γ, attained by orthogonal vectors of norm γ.
  rng = np.random.default_rng(0)
  gamma = 2.5
  W = rng.normal(size=(2000, 2, 5))
  W *= gamma * rng.uniform(size=(2000, 2, 1)) ** 0.2 / np.linalg.norm(W, axis=2, keepdims=True)
  diff = np.einsum("ki,kj->kij", W[:, 0], W[:, 0]) - np.einsum("ki,kj->kij", W[:, 1], W[:, 1])
  assert np.linalg.norm(diff, axis=(1, 2)).max() <= math.sqrt(2.0) * gamma**2 + 1e-12
  e1, e2 = gamma * np.eye(5)[0], gamma * np.eye(5)[1]
  tight = np.linalg.norm(np.outer(e1, e1) - np.outer(e2, e2))
  assert tight == pytest.approx(math.sqrt(2.0) * gamma**2)


def test_rdp_accountant_and_custom_fractions():
  _, rdp = _mean_result(accountant="rdp")
  _, pld = _mean_result()
  eps = _recomposed_epsilon(rdp.info["noise_multipliers"], DELTA, accountant="rdp")
  assert eps <= EPS and EPS - eps < 1e-3
  assert rdp.info["noise_scale"] > pld.info["noise_scale"]          # RDP is the looser bound
  _, custom = _mean_result(accountant="rdp", fractions=(0.1, 0.2, 0.3, 0.4))
  assert custom.info["steps"] == 4
  zs = np.asarray(custom.info["noise_multipliers"])
  np.testing.assert_allclose(zs**2 * [0.1, 0.2, 0.3, 0.4], custom.info["noise_scale"]**2)
  assert _recomposed_epsilon(custom.info["noise_multipliers"], DELTA, accountant="rdp") <= EPS


def test_calibrate_noise_scale_public_helper():
  fr = cp.default_fractions(3)
  for accountant, epsilon, delta in (("rdp", 2.0, 1e-5), ("rdp", 0.1, 1e-8), ("pld", EPS, DELTA)):
    s = cp.calibrate_noise_scale(epsilon, delta, fr, accountant=accountant)
    eps = accounting.gaussian_composition_epsilon([s / math.sqrt(f) for f in fr], delta, accountant=accountant)
    assert eps <= epsilon and epsilon - eps < 1e-3 * epsilon
  assert cp.default_fractions(1) == (1.0,)
  assert sum(cp.default_fractions(5)) == pytest.approx(1.0)


# ---------------------------------------------------------------- determinism, shapes, errors


def test_determinism_and_key_use():
  X, _, center = _mean_problem(0, n=2_000)
  kw = dict(epsilon=EPS, delta=DELTA, center=center, radius=100.0)
  a = cp.coinpress_mean(jax.random.key(4), X, **kw)
  b = cp.coinpress_mean(jax.random.key(4), X, **kw)
  c = cp.coinpress_mean(jax.random.key(5), X, **kw)
  legacy = cp.coinpress_mean(jax.random.PRNGKey(4), X, **kw)
  assert np.array_equal(a.estimate, b.estimate)
  assert not np.array_equal(a.estimate, c.estimate)
  assert legacy.estimate.shape == (D_MEAN,) and legacy.estimate.dtype == np.float64
  assert a.estimate.shape == (D_MEAN,) and a.estimate.dtype == np.float64
  assert a.released["centers"].shape == (4, D_MEAN)
  Xc, _ = _cov_problem(0, 5_000, 5)
  kc = dict(epsilon=EPS, delta=DELTA, kappa=10.0, steps=3)
  s1 = cp.coinpress_covariance(jax.random.key(4), Xc, **kc).estimate
  s2 = cp.coinpress_covariance(jax.random.key(4), Xc, **kc).estimate
  s3 = cp.coinpress_covariance(jax.random.key(5), Xc, **kc).estimate
  assert np.array_equal(s1, s2) and not np.array_equal(s1, s3)


def test_float64_inside_without_touching_the_global_flag():
  flag = jax.config.jax_enable_x64
  X, _, center = _mean_problem(0, n=2_000)
  res = cp.coinpress_mean(jax.random.key(0), jnp.asarray(X, jnp.float32), epsilon=EPS,
                          delta=DELTA, center=center, radius=100.0)
  assert res.estimate.dtype == np.float64
  assert jax.config.jax_enable_x64 == flag


def _good_mean_kwargs():
  return dict(epsilon=EPS, delta=DELTA, center=np.zeros(3), radius=10.0)


@pytest.mark.parametrize("X,kwargs,exc,match", [
    (np.full((10, 3), np.nan), {}, ValueError, "X contains NaN"),
    (np.r_[np.ones((9, 3)), [[np.inf, 0, 0]]], {}, ValueError, "X contains NaN"),
    (np.ones(10), {}, ValueError, "X must have 2 dimensions"),
    (np.ones((1, 3)), {}, ValueError, "X must have at least 2 rows"),
    (np.ones((10, 3)), dict(center=np.zeros(4)), ValueError, "center must have shape"),
    (np.ones((10, 3)), dict(center=np.zeros((1, 3))), ValueError, "center must have 1 dim"),
    (np.ones((10, 3)), dict(center=np.array([0, np.nan, 0])), ValueError, "center contains"),
    (np.ones((10, 3)), dict(radius=0.0), ValueError, "radius"),
    (np.ones((10, 3)), dict(radius=-1.0), ValueError, "radius"),
    (np.ones((10, 3)), dict(epsilon=0.0), ValueError, "epsilon"),
    (np.ones((10, 3)), dict(delta=0.0), ValueError, "delta"),
    (np.ones((10, 3)), dict(delta=1.0), ValueError, "delta"),
    (np.ones((10, 3)), dict(beta=1.0), ValueError, "beta"),
    (np.ones((10, 3)), dict(steps=0), ValueError, "steps"),
    (np.ones((10, 3)), dict(steps=2.5), TypeError, "steps"),
    (np.ones((10, 3)), dict(fractions=(0.5, 0.6)), ValueError, "fractions must sum to 1"),
    (np.ones((10, 3)), dict(fractions=(1.5, -0.5)), ValueError, "fractions must all be"),
    (np.ones((10, 3)), dict(steps=3, fractions=(0.5, 0.5)), ValueError, "fractions has 2"),
    (np.ones((10, 3)), dict(accountant="moments"), ValueError, "accountant"),
])
def test_mean_rejects_bad_input(X, kwargs, exc, match):
  with pytest.raises(exc, match=match):
    cp.coinpress_mean(jax.random.key(0), X, **{**_good_mean_kwargs(), **kwargs})


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(kappa=0.0), ValueError, "kappa"),
    (dict(kappa=0.5), ValueError, "kappa must be >= 1"),
    (dict(kappa=float("inf")), ValueError, "kappa"),
    (dict(epsilon=-1.0), ValueError, "epsilon"),
    (dict(delta=2.0), ValueError, "delta"),
    (dict(steps=100), ValueError, "steps"),
])
def test_covariance_rejects_bad_input(kwargs, exc, match):
  good = dict(epsilon=EPS, delta=DELTA, kappa=10.0)
  with pytest.raises(exc, match=match):
    cp.coinpress_covariance(jax.random.key(0), np.ones((10, 3)), **{**good, **kwargs})


def test_bad_key_and_bad_data_type():
  with pytest.raises(TypeError, match="key"):
    cp.coinpress_mean(0, np.ones((10, 3)), **_good_mean_kwargs())
  with pytest.raises(TypeError, match="X"):
    cp.coinpress_covariance(jax.random.key(0), np.array([["a", "b"], ["c", "d"]]),
                            epsilon=EPS, delta=DELTA, kappa=2.0)
  with pytest.raises(ValueError, match="X contains NaN"):
    cp.coinpress_covariance(jax.random.key(0), np.full((5, 2), np.nan), epsilon=EPS,
                            delta=DELTA, kappa=2.0)


# ------------------------------------------------------------------ tracing (JAX's x64 mode on)


def _traced_problems():
  # The eager tests' shapes: the eager references below reuse their compiled programs.
  X, _, center = _mean_problem(6, n=2_000)
  Xc, _ = _cov_problem(6, 5_000, 5)
  mean = lambda secure: lambda k, X, c: cp.coinpress_mean(            # noqa: E731
      k, X, epsilon=EPS, delta=DELTA, center=c, radius=100.0, secure=secure)
  cov = lambda secure: lambda k, X: cp.coinpress_covariance(          # noqa: E731
      k, X, epsilon=EPS, delta=DELTA, kappa=10.0, steps=2, secure=secure)
  return X, center, Xc, mean, cov


@functools.cache
def _batched(secure):
  """``jit(vmap)`` of both learners over keys, the data traced: one program each (seconds to
  compile), shared by the tracing tests below."""
  _, _, _, mean, cov = _traced_problems()
  return (jax.jit(jax.vmap(mean(secure), in_axes=(0, None, None))),
          jax.jit(jax.vmap(cov(secure), in_axes=(0, None))))


@pytest.mark.parametrize("secure", [True, False])
def test_jit_of_vmap_with_x64_gives_each_keys_eager_result(secure):
  """Traced with x64 on, the float64 steps are staged in the caller's program (with ``secure``
  each step's release a NumPy host callback drawing from the step's key as eagerly): each key
  gets its eager result, float64, up to the fusion of the float64 arithmetic."""
  X, center, Xc, mean, cov = _traced_problems()
  keys = jax.random.split(jax.random.key(8), 2)
  run_mean, run_cov = _batched(secure)
  with jax.enable_x64(True):
    m, c = run_mean(keys, X, center), run_cov(keys, Xc)
  assert m.estimate.dtype == jnp.float64 and c.estimate.dtype == jnp.float64
  assert bool(jnp.all(m.ok)) and bool(jnp.all(c.ok))
  for i, key in enumerate(keys):
    em, ec = mean(secure)(key, X, center), cov(secure)(key, Xc)
    np.testing.assert_allclose(m.estimate[i], em.estimate, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(m.released["centers"][i], em.released["centers"], rtol=1e-12,
                               atol=1e-12)
    np.testing.assert_allclose(c.estimate[i], ec.estimate, rtol=1e-9, atol=1e-12)
    if secure:
      np.testing.assert_allclose(c.released["releases"][i], ec.released["releases"],
                                 rtol=1e-9, atol=1e-12)
      for centre, grid in zip(np.asarray(m.released["centers"][i]), em.info["grids"]):
        assert np.all(centre == np.round(centre / grid) * grid)


@pytest.mark.parametrize("name", ["coinpress_mean", "coinpress_covariance"])
def test_a_float32_trace_is_refused_with_the_x64_hint(name):
  """The float64 steps cannot live in a float32 program: tracing with x64 off raises (traced
  data or a traced key alike); eagerly the same call runs."""
  X, center, Xc, mean, cov = _traced_problems()
  if name == "coinpress_mean":
    run, data = (lambda k, X: mean(True)(k, X, center)), jnp.asarray(X, jnp.float32)
  else:
    run, data = cov(True), jnp.asarray(Xc, jnp.float32)
  key = jax.random.key(0)
  for traced in (lambda: jax.jit(run)(key, data), lambda: jax.jit(lambda k: run(k, data))(key)):
    with pytest.raises(TypeError, match=f"{name} computes in float64.*enable_x64"):
      traced()
  assert bool(run(key, data).ok)


@pytest.mark.parametrize("secure", [True, False])
def test_traced_non_finite_input_gives_bottom(secure):
  """A traced X (or mean centre) with NaN/inf lies outside the domain: ``ok=False`` and zero
  outputs (a concrete one is rejected by the validation, above)."""
  X, center, Xc, _, _ = _traced_problems()
  keys = jax.random.split(jax.random.key(0), 2)
  bad_center = center.copy()
  bad_center[1] = np.inf
  run_mean, run_cov = _batched(secure)        # the programs of the test above
  with jax.enable_x64(True):
    for res in (run_mean(keys, _with_nan(X), center),
                run_mean(keys, X, bad_center), run_cov(keys, _with_nan(Xc))):
      assert not np.any(np.asarray(res.ok))
      for leaf in jax.tree_util.tree_leaves((res.estimate, res.released)):
        assert np.all(np.asarray(leaf) == 0)
    assert np.all(np.asarray(run_mean(keys, X, center).ok))
    assert np.all(np.asarray(run_cov(keys, Xc).ok))


def _with_nan(X):
  X = X.copy()
  X[3, 1] = np.nan
  return X
