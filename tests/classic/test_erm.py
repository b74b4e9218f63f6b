"""The ℓ2-Laplace mechanism and private ERM by output and objective perturbation ([CMS11]
Algorithms 1 and 2; dpjax.mechanisms.l2_laplace, dpjax.classic.erm).

Most tests share one data shape (N, D) in float64, so that the ERM program (one for both methods
and both losses) is compiled once for the module, and in the wrappers' context (float64 on the
CPU), so that the eager, traced and test-helper paths share it.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import NeighboringRelation
from scipy import optimize, stats

import dpjax
from dpjax import mechanisms as M
from dpjax._host import host_rng
from dpjax.classic import erm
from dpjax.mechanisms.l2_laplace import l2_laplace_host_noise

N, D = 40, 3
KEY = jax.random.key(0)


def _data(seed, n=N, d=D, noise=0.3):
  """Rows with norm ≤ 1 (a third of them exactly 1) and labels of a noisy linear rule."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal(d)
  X = rng.standard_normal((n, d))
  X[: n // 3] /= np.linalg.norm(X[: n // 3], axis=1, keepdims=True)
  X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
  y = np.where(X @ w + noise * rng.standard_normal(n) >= 0, 1.0, -1.0)
  return X, y


def _minimiser(X, y, lam, loss="logistic", huber_width=0.5):
  """The non-private minimiser of J by the library's own program: output perturbation's raw
  release with an astronomically large β (‖b‖ ~ d·1e-290)."""
  params, _ = erm.erm_parameters(X.shape[0], X.shape[1], epsilon=1.0, method="output",
                                 regularization=lam, loss=loss, huber_width=huber_width,
                                 release="raw")
  # The wrappers' context (float64 on the CPU, the key committed to it, compile-time evaluation
  # as in dpjax._host.float64: all part of jit's cache key), so that the compiled program is
  # shared with them.
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu), jax.enable_x64(True), jax.ensure_compile_time_eval():
    f, grad_norm = erm.erm_core(jax.device_put(KEY, cpu), jnp.asarray(X), jnp.asarray(y),
                                params._replace(beta=1e290))
    return np.asarray(f), float(grad_norm)


def _scipy_minimiser(X, y, lam, loss="logistic", linear=None, huber_width=0.5):
  """argmin (1/n) Σ ℓ(y xᵀf) + (λ/2)‖f‖² + linearᵀf by SciPy's L-BFGS-B in float64."""
  h = huber_width
  linear = np.zeros(X.shape[1]) if linear is None else np.asarray(linear)

  def fun(f):
    z = y * (X @ f)
    if loss == "logistic":
      value, slope = np.logaddexp(0.0, -z), -1.0 / (1.0 + np.exp(z))
    else:
      value = np.where(z > 1 + h, 0.0, np.where(z < 1 - h, 1 - z, (1 + h - z) ** 2 / (4 * h)))
      slope = np.where(z > 1 + h, 0.0, np.where(z < 1 - h, -1.0, -(1 + h - z) / (2 * h)))
    grad = X.T @ (slope * y) / len(y) + lam * f + linear
    return value.mean() + 0.5 * lam * f @ f + linear @ f, grad

  res = optimize.minimize(fun, np.zeros(X.shape[1]), jac=True, method="L-BFGS-B",
                          options=dict(gtol=1e-14, ftol=0.0, maxiter=20_000, maxcor=20))
  return res.x


# ------------------------------------------------------------------------ ℓ2-Laplace mechanism


def test_l2_laplace_noise_has_the_gamma_norm_and_a_uniform_direction():
  """The mechanism on the value 0 releases the noise itself: 10,000 draws in d = 3 at
  β = ε/Δ₂ = 2.5, vmapped over keys with x64 on (the NumPy host sampler as a callback, float64
  out). (At 10,000 the wrong laws' p-values are below 1e-25, the moments within 5 SE.)"""
  d, trials = 3, 10_000
  keys = jax.random.split(jax.random.key(1), trials)
  with jax.enable_x64(True):
    b = np.asarray(jax.vmap(lambda k: M.l2_laplace_mechanism(k, jnp.zeros(d), sensitivity=1.0,
                                                             epsilon=2.5))(keys))
  assert b.shape == (trials, d) and b.dtype == np.float64
  np.testing.assert_allclose(b[0], M.l2_laplace_mechanism(keys[0], np.zeros(d), sensitivity=1.0,
                                                          epsilon=2.5), rtol=1e-12)   # = eager
  norms = np.linalg.norm(b, axis=1)
  assert stats.kstest(norms, stats.gamma(d, scale=1.0 / 2.5).cdf).pvalue > 1e-3
  # A wrong shape or rate is rejected by the same test (it has power at this sample size).
  assert stats.kstest(norms, stats.gamma(d - 1, scale=1.0 / 2.5).cdf).pvalue < 1e-6
  assert stats.kstest(norms, stats.gamma(d, scale=1.1 / 2.5).cdf).pvalue < 1e-6
  u = b / norms[:, None]
  assert np.all(np.abs(u.mean(axis=0)) < 4.0 / math.sqrt(trials))       # E u = 0
  np.testing.assert_allclose(u.T @ u / trials, np.eye(d) / d, atol=0.015)  # E uuᵀ = I/d
  # The direction is independent of the norm (the density depends on ‖b‖ only).
  assert abs(np.corrcoef(norms, np.abs(u[:, 0]))[0, 1]) < 0.05


def test_l2_laplace_noise_is_deterministic_per_key_and_traceable():
  k1, k2 = jax.random.split(jax.random.key(2))
  default = jax.eval_shape(lambda k: M.l2_laplace_noise(k, 3, 1.0), k1)
  assert default.shape == (3,) and default.dtype == jnp.float32   # JAX's default float
  with jax.enable_x64(True):
    a = np.asarray(M.l2_laplace_noise(k1, 3, 1.0, jnp.float64))
    np.testing.assert_array_equal(a, M.l2_laplace_noise(k1, 3, 1.0, jnp.float64))
    # vmap over keys and a traced β at once: the same draws, the norm scaling as 1/β.
    rows = np.asarray(jax.vmap(lambda k, bt: M.l2_laplace_noise(k, 3, bt, jnp.float64))(
        jnp.stack([k1, k1, k2]), jnp.asarray([1.0, 4.0, 1.0])))
  np.testing.assert_allclose(rows[0], a, rtol=1e-12)
  np.testing.assert_allclose(rows[1], a / 4.0, rtol=1e-12)
  assert not np.allclose(rows[2], a)


def test_l2_laplace_mechanism_is_float64_and_the_same_eagerly_and_under_jit():
  value = np.array([1.0, -2.0, 0.5])
  eager = M.l2_laplace_mechanism(KEY, value, sensitivity=0.5, epsilon=2.0)
  assert isinstance(eager, np.ndarray) and eager.dtype == np.float64 and eager.shape == (3,)
  assert M.l2_laplace_beta(0.5, 2.0) == 4.0
  # The host sampler (NumPy, the generator seeded from the key), β = ε/Δ₂ = 4.
  expected = l2_laplace_host_noise(host_rng(KEY), 3, 4.0)
  np.testing.assert_allclose(eager - value, expected, rtol=1e-12)
  callback = jax.jit(lambda k: M.l2_laplace_mechanism(k, value, sensitivity=0.5,
                                                      epsilon=2.0))(KEY)  # host, no x64
  np.testing.assert_allclose(np.asarray(callback), eager, rtol=1e-6)
  # Any shape: the ℓ2 norm is over all entries; NaN/inf → 0 before the same noise.
  odd = M.l2_laplace_mechanism(KEY, np.array([[np.nan, 1.0, np.inf]]), sensitivity=0.5,
                               epsilon=2.0)
  assert odd.shape == (1, 3)
  np.testing.assert_allclose(odd[0] - [0.0, 1.0, 0.0], eager - value, rtol=1e-12)


@pytest.mark.parametrize("kwargs,error", [
    (dict(sensitivity=0.0, epsilon=1.0), ValueError),
    (dict(sensitivity=1.0, epsilon=-1.0), ValueError),
    (dict(sensitivity=1.0, epsilon=float("inf")), ValueError),
    (dict(sensitivity=float("nan"), epsilon=1.0), ValueError),
])
def test_l2_laplace_mechanism_rejects_bad_parameters(kwargs, error):
  with pytest.raises(error):
    M.l2_laplace_mechanism(KEY, np.ones(3), **kwargs)


def test_l2_laplace_rejects_bad_inputs():
  with pytest.raises(ValueError, match="at least one entry"):
    M.l2_laplace_mechanism(KEY, np.ones(0), sensitivity=1.0, epsilon=1.0)
  with pytest.raises(TypeError):
    M.l2_laplace_mechanism(KEY, np.ones(3, np.int32), sensitivity=1.0, epsilon=1.0)
  with pytest.raises(TypeError):
    M.l2_laplace_mechanism(0, np.ones(3), sensitivity=1.0, epsilon=1.0)
  with pytest.raises(ValueError):
    M.l2_laplace_noise(KEY, 0, 1.0)
  with pytest.raises(ValueError):
    M.l2_laplace_noise(KEY, 3, 0.0)
  with pytest.raises(TypeError):
    M.l2_laplace_noise(KEY, 3.0, 1.0)


# ------------------------------------------------------------------ public calibration (host)


def test_objective_perturbation_budget_matches_hand_computed_values():
  # ε' > 0 branch: n = 100, Λ = 0.01, ε = 1, c = 1/4: c/(nΛ) = 1/4,
  # ε' = 1 − ln(1 + 1/2 + 1/16) = 1 − ln 1.5625 = 0.5537129...
  b = erm.objective_perturbation_budget(100, 1.0, 0.01, 0.25)
  assert b.branch == "Delta=0" and b.extra_regularization == 0.0
  assert b.epsilon_prime == pytest.approx(0.55371289, abs=1e-8)
  assert b.beta == pytest.approx(0.27685644, abs=1e-8)
  # Δ > 0 branch: n = 100, Λ = 0.001, ε = 0.5, c = 1/4: c/(nΛ) = 2.5 and
  # ln(1 + 5 + 6.25) = 2.5055 > 0.5, so ε' = ε/2 = 0.25, β = 0.125,
  # Δ = 0.25/(100 (e^{0.125} − 1)) − 0.001 = 0.25/13.3148453 − 0.001 = 0.0177760349
  b = erm.objective_perturbation_budget(100, 0.5, 0.001, 0.25)
  assert b.branch == "Delta>0"
  assert b.epsilon_prime == 0.25 and b.beta == 0.125
  assert b.extra_regularization == pytest.approx(0.0177760349, abs=1e-10)
  # Huber: c = 1/(2h); h = 0.5 → c = 1. At the boundary ε' = 0 exactly the Δ branch is taken.
  assert erm.loss_curvature("huber", 0.5) == 1.0 and erm.loss_curvature("logistic") == 0.25
  lam = 1.0 / (10 * math.expm1(0.5))                # 2 ln(1 + c/(nΛ)) = ε = 1 at n = 10
  assert erm.objective_perturbation_budget(10, 1.0, lam * (1 + 1e-9), 1.0).branch == "Delta=0"
  assert erm.objective_perturbation_budget(10, 1.0, lam * (1 - 1e-9), 1.0).branch == "Delta>0"


def test_erm_parameters_and_the_default_regularization():
  params, info = erm.erm_parameters(N, D, epsilon=2.0, method="output", regularization=0.1,
                                    release="raw")
  assert info["release"] == params.release == "raw" and "grid" not in info
  sensitivity = 2.0 / (N * 0.1) + 2.0 * 1e-10 / 0.1
  assert info["sensitivity"] == pytest.approx(sensitivity, rel=1e-15)
  assert params.beta == pytest.approx(2.0 / sensitivity, rel=1e-15)
  assert params.beta == pytest.approx(N * 0.1 * 2.0 / 2, rel=1e-8)    # [CMS11]'s nΛε/2
  lam = erm.default_regularization(N, D, 2.0, "objective")
  assert lam == pytest.approx(erm.REGULARIZATION_FACTORS["objective"] * math.sqrt(D / (N * 2.0)))
  params, info = erm.erm_parameters(N, D, epsilon=2.0, method="objective")
  assert info["regularization"] == lam and info["regularization_rule"] == "default"
  assert info["branch"] == "Delta=0" and params.extra_regularization == 0.0


# ------------------------------------------------------------------- sensitivity and solver


@pytest.mark.parametrize("loss", ["logistic", "huber"])
def test_minimiser_matches_scipy_and_reaches_tol(loss):
  X, y = _data(3)
  f, grad_norm = _minimiser(X, y, 0.05, loss)
  assert grad_norm <= 1e-10
  np.testing.assert_allclose(f, _scipy_minimiser(X, y, 0.05, loss), atol=1e-8)


def test_objective_perturbation_minimises_the_perturbed_objective():
  """The raw release is argmin J + (1/n) bᵀf + (Δ/2)‖f‖², b the ℓ2-Laplace draw of the same
  key, in both branches (Δ = 0 at Λ = 0.05; Δ > 0 at Λ = 1e-3, ε = 0.5); the raw output
  release is f̂ + b."""
  X, y = _data(4)
  key = jax.random.key(5)
  for lam, epsilon, branch in ((0.05, 1.0, "Delta=0"), (1e-3, 0.5, "Delta>0")):
    res = erm.objective_perturbation(key, X, y, epsilon=epsilon, regularization=lam,
                                     release="raw")
    assert res.info["branch"] == branch and res.nonprivate_gradient_norm <= 1e-10
    extra = res.info["extra_regularization"]
    with jax.enable_x64(True):
      b = np.asarray(M.l2_laplace_noise(key, D, res.info["beta"], jnp.float64))
    expected = _scipy_minimiser(X, y, lam + extra, linear=b / N)
    np.testing.assert_allclose(res.coefficients, expected, atol=1e-8)
  out = erm.output_perturbation(key, X, y, epsilon=1.0, regularization=0.05, release="raw")
  with jax.enable_x64(True):
    b = np.asarray(M.l2_laplace_noise(key, D, out.info["beta"], jnp.float64))
  np.testing.assert_allclose(out.coefficients - b, _scipy_minimiser(X, y, 0.05), atol=1e-8)


def test_neighboring_minimisers_differ_by_at_most_two_over_n_lambda():
  """Replace one row at the norm bound by the same row with the label flipped: random data
  stay within 2/(nΛ); a crafted pair reaches it (Huber loss, every row on the linear part
  ℓ' = −1, ℓ'' = 0, so the Hessian is ΛI and the gradients differ by exactly 2x/n)."""
  lam = 0.1
  bound = 2.0 / (N * lam)
  for seed in range(3):
    X, y = _data(10 + seed)
    X[0] /= np.linalg.norm(X[0])
    y_prime = y.copy()
    y_prime[0] = -y[0]
    for loss in ("logistic", "huber"):
      gap = np.linalg.norm(_minimiser(X, y, lam, loss)[0] - _minimiser(X, y_prime, lam, loss)[0])
      assert 0.05 * bound < gap <= bound * (1 + 1e-6), (seed, loss, gap, bound)
  X = np.zeros((N, D))
  X[0, 0] = 1.0                                      # the replaced row: e0, label +1 or −1
  X[1:N - 1, 1] = 1.0                                # e1 rows with balanced labels: z = 0
  y = np.ones(N)
  y[1:N - 1:2] = -1.0
  y_prime = y.copy()
  y_prime[0] = -1.0
  f, f_prime = _minimiser(X, y, lam, "huber")[0], _minimiser(X, y_prime, lam, "huber")[0]
  np.testing.assert_allclose(f - f_prime, [bound, 0.0, 0.0], atol=1e-9)


# -------------------------------------------------------------------------------- wrappers


def test_private_accuracy_approaches_the_non_private_one_at_large_n_epsilon():
  X, y = _data(20, noise=0.1)
  X_test, y_test = _data(20, n=4000, noise=0.1)            # the same rule, fresh rows
  lam = 0.05
  exact = np.mean(erm.predict(_minimiser(X, y, lam)[0], X_test) == y_test)
  assert exact > 0.8
  for fit in (erm.output_perturbation, erm.objective_perturbation):
    big = [np.mean(erm.predict(fit(jax.random.key(s), X, y, epsilon=1e4,
                                   regularization=lam).coefficients, X_test) == y_test)
           for s in range(3)]
    small = [np.mean(erm.predict(fit(jax.random.key(s), X, y, epsilon=0.01,
                                     regularization=lam).coefficients, X_test) == y_test)
             for s in range(3)]
    assert min(big) >= exact - 0.01, (fit.__name__, big, exact)
    assert np.mean(small) < exact - 0.1, (fit.__name__, small, exact)   # noise dominates


def test_results_are_typed_deterministic_per_key_and_public_info():
  X, y = _data(30)
  res = erm.objective_perturbation(KEY, X, y, epsilon=1.0)
  assert isinstance(res, dpjax.ERMResult) and bool(res.ok)
  assert res.epsilon == 1.0 and res.delta == 0.0
  assert res.neighboring == NeighboringRelation.REPLACE_ONE
  assert res.coefficients.shape == (D,) and res.coefficients.dtype == np.float64
  assert res.released == {}                        # the gradient norm is not a DP release
  assert float(res.nonprivate_gradient_norm) <= 1e-10
  for name in ("regularization", "c", "epsilon_prime", "extra_regularization", "branch",
               "beta", "tol", "loss", "method"):
    assert name in res.info
  again = erm.objective_perturbation(KEY, X, y, epsilon=1.0)
  np.testing.assert_array_equal(res.coefficients, again.coefficients)
  other = erm.objective_perturbation(jax.random.key(1), X, y, epsilon=1.0)
  assert not np.allclose(res.coefficients, other.coefficients)
  leaves = jax.tree_util.tree_leaves(res)
  assert len(leaves) == 3                          # ok, coefficients, gradient norm


def test_data_norm_and_clip_are_fixed_public_maps():
  X, y = _data(31)
  scaled = erm.output_perturbation(KEY, 4.0 * X, y, epsilon=1.0, regularization=0.1,
                                   data_norm=4.0)
  plain = erm.output_perturbation(KEY, X, y, epsilon=1.0, regularization=0.1)
  np.testing.assert_allclose(4.0 * scaled.coefficients, plain.coefficients, rtol=1e-9)
  big = X.copy()
  big[:5] *= 3.0                                   # five rows above the bound
  with pytest.raises(ValueError, match="5 of 40 rows"):
    erm.output_perturbation(KEY, big, y, epsilon=1.0)
  clipped = big / np.maximum(1.0, np.linalg.norm(big, axis=1, keepdims=True))
  a = erm.output_perturbation(KEY, big, y, epsilon=1.0, regularization=0.1, clip=True)
  b = erm.output_perturbation(KEY, clipped, y, epsilon=1.0, regularization=0.1)
  np.testing.assert_allclose(a.coefficients, b.coefficients, rtol=1e-9)
  assert a.info["clip"] is True


@pytest.mark.parametrize("change,error,match", [
    (lambda X, y: (X, 2.0 * y), ValueError, "outside"),
    (lambda X, y: (X, (y > 0).astype(float)), ValueError, "outside"),
    (lambda X, y: (X, y > 0), TypeError, "real"),
    (lambda X, y: (X, y[:-1]), ValueError, "shape"),
    (lambda X, y: (np.where(np.eye(N, D, dtype=bool), np.nan, X), y), ValueError, "NaN"),
    (lambda X, y: (X, np.where(np.arange(N) == 3, np.nan, y)), ValueError, "NaN"),
])
def test_bad_data_is_refused(change, error, match):
  X, y = change(*_data(32))
  with pytest.raises(error, match=match):
    erm.objective_perturbation(KEY, X, y, epsilon=1.0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(epsilon=0.0), "epsilon"), (dict(epsilon=float("inf")), "epsilon"),
    (dict(epsilon=1.0, regularization=0.0), "regularization"),
    (dict(epsilon=1.0, regularization=-1.0), "regularization"),
    (dict(epsilon=1.0, regularization=float("nan")), "regularization"),
    (dict(epsilon=1.0, loss="hinge"), "loss"),
    (dict(epsilon=1.0, loss="huber", huber_width=0.0), "huber_width"),
    (dict(epsilon=1.0, data_norm=0.0), "data_norm"),
    (dict(epsilon=1.0, tol=0.0), "tol"),
    (dict(epsilon=1.0, max_iterations=0), "max_iterations"),
])
def test_bad_parameters_are_refused(kwargs, match):
  X, y = _data(33)
  with pytest.raises(ValueError, match=match):
    erm.output_perturbation(KEY, X, y, **kwargs)


@pytest.mark.slow(reason="the cores vmapped over keys and labels; the default run calls them "
                         "via the wrappers")
def test_cores_run_under_vmap_over_keys_and_labels():
  """erm_core and one_vs_rest_core vmapped over keys (and label vectors), equal to the eager
  wrappers. (By default the audits run the cores vmapped over keys, through the wrappers.)"""
  X, y = _data(34)
  keys = jax.random.split(jax.random.key(7), 3)
  signs = np.stack([y, -y, np.where(X[:, 0] > 0, 1.0, -1.0)])
  params, _ = erm.erm_parameters(N, D, epsilon=1.0, method="objective")
  with jax.enable_x64(True):
    coef, grad_norm = jax.vmap(lambda k, s: erm.erm_core(k, jnp.asarray(X), s, params))(
        keys, jnp.asarray(signs))
  assert coef.shape == (3, D) and grad_norm.shape == (3,)
  for k, labels, row in zip(keys, signs, np.asarray(coef)):
    np.testing.assert_allclose(
        row, erm.objective_perturbation(k, X, labels, epsilon=1.0).coefficients, atol=1e-9)
  classes = np.argmax(X, axis=1)
  with jax.enable_x64(True):
    params, _ = erm.erm_parameters(N, D, epsilon=1.0 / D, method="objective")
    coef, _ = jax.jit(lambda k: erm.one_vs_rest_core(k, jnp.asarray(X), jnp.asarray(classes),
                                                     jnp.arange(D), params))(KEY)
  np.testing.assert_allclose(coef, erm.one_vs_rest(KEY, X, classes, classes=range(D),
                                                   epsilon=1.0).coefficients, atol=1e-9)


def test_wrappers_are_traceable_and_answer_bottom_outside_the_domain():
  X, y = _data(35)
  eager = erm.objective_perturbation(KEY, X, y, epsilon=1.0, regularization=0.05)
  # With x64 on the float64 program is staged inline (the audits run it under vmap).
  run = jax.jit(lambda k, X: erm.objective_perturbation(k, X, y, epsilon=1.0,
                                                        regularization=0.05))
  with jax.enable_x64(True):
    traced = run(KEY, jnp.asarray(X))
    outside = run(KEY, jnp.asarray(3.0 * X))
  assert bool(traced.ok) and traced.coefficients.dtype == jnp.float64
  np.testing.assert_allclose(np.asarray(traced.coefficients), eager.coefficients, atol=1e-9)
  assert not bool(outside.ok) and np.all(np.asarray(outside.coefficients) == 0)


@pytest.mark.parametrize("name", ["output_perturbation", "objective_perturbation", "one_vs_rest"])
def test_a_float32_trace_is_refused_with_the_x64_hint(name):
  """The float64 program cannot live in a float32 program: tracing with x64 off raises (traced
  data or a traced key alike), before anything is solved."""
  X, y = _data(35)
  if name == "one_vs_rest":
    labels = np.where(y > 0, 1, 0)
    fn = lambda k, X: erm.one_vs_rest(k, X, labels, classes=[0, 1], epsilon=1.0)
  else:
    fn = lambda k, X: getattr(erm, name)(k, X, y, epsilon=1.0)
  X32 = jnp.asarray(X, jnp.float32)
  with pytest.raises(TypeError, match=f"{name} computes in float64.*enable_x64"):
    jax.jit(fn)(KEY, X32)
  with pytest.raises(TypeError, match=f"{name} computes in float64.*enable_x64"):
    jax.jit(lambda k: fn(k, X32))(KEY)


def test_one_vs_rest_splits_the_budget_over_public_classes():
  X, _ = _data(36)
  labels = np.argmax(X, axis=1) + 5                 # classes 5, 6, 7
  res = erm.one_vs_rest(KEY, X, labels, classes=[5, 6, 7], epsilon=3.0)
  assert res.coefficients.shape == (3, D) and res.nonprivate_gradient_norm.shape == (3,)
  assert res.epsilon == 3.0 and res.info["epsilon_per_class"] == 1.0
  assert res.info["classes"] == (5, 6, 7) and res.info["num_classes"] == 3
  assert res.info["regularization"] == erm.default_regularization(N, D, 1.0, "objective")
  assert np.all(np.asarray(res.nonprivate_gradient_norm) <= 1e-10)
  # Each row is the binary learner at ε/K on its own key.
  keys = jax.random.split(KEY, 3)
  binary = erm.objective_perturbation(keys[1], X, np.where(labels == 6, 1.0, -1.0), epsilon=1.0)
  np.testing.assert_allclose(res.coefficients[1], binary.coefficients, atol=1e-9)
  accurate = erm.one_vs_rest(KEY, X, labels, classes=[5, 6, 7], epsilon=1e5, regularization=0.01)
  assert np.mean(erm.predict(accurate.coefficients, X, [5, 6, 7]) == labels) > 0.8
  with pytest.raises(ValueError, match="outside"):
    erm.one_vs_rest(KEY, X, labels, classes=[5, 6], epsilon=1.0)
  with pytest.raises(ValueError, match="distinct"):
    erm.one_vs_rest(KEY, X, labels, classes=[5, 5, 6], epsilon=1.0)
  with pytest.raises(TypeError):
    erm.one_vs_rest(KEY, X, labels.astype(float), classes=[5, 6, 7], epsilon=1.0)


@pytest.mark.slow(reason="an unfinished solve (max_iterations=1); the default run checks "
                         "finished ones")
def test_the_gradient_norm_diagnostic_reports_an_unfinished_solve():
  """With the iteration cap at 1 the solver stops early and the (non-private) diagnostic says
  so; with the default cap it reaches tol on the same problem."""
  X, y = _data(37)
  capped = erm.objective_perturbation(KEY, X, y, epsilon=1.0, regularization=1e-3,
                                      max_iterations=1)
  full = erm.objective_perturbation(KEY, X, y, epsilon=1.0, regularization=1e-3)
  assert float(capped.nonprivate_gradient_norm) > 1e-6
  assert float(full.nonprivate_gradient_norm) <= 1e-10
  assert "nonprivate_gradient_norm" not in full.released


# ------------------------------------------------------------- the grid release (float-safe)


def _lattice_index(coefficients, grid, data_norm):
  """``m`` with ``coefficients == fl(grid·m/B)`` bit for bit (asserted): the release is a
  function of an integer vector. For B a power of two ``coefficients·B/grid`` is m exactly."""
  coefficients = np.asarray(coefficients)
  m = np.round(coefficients * data_norm / grid)
  np.testing.assert_array_equal((m * grid) / data_norm, coefficients)
  return m


def test_grid_output_release_is_on_the_public_lattice():
  """The default release: every coordinate times B/Λ_g is an integer exactly (B = 1 and 4),
  for output perturbation and one-vs-rest; B = 3 releases fl(Λ_g·m/B) for an integer m."""
  X, y = _data(40)
  sensitivity = 2.0 / (N * 0.1) + 2.0 * 1e-10 / 0.1
  grid = M.discretization(sensitivity, D).grid             # 2^-12 here
  for data_norm in (1.0, 4.0, 3.0):
    res = erm.output_perturbation(KEY, data_norm * X, y, epsilon=1.0, regularization=0.1,
                                  data_norm=data_norm)
    m = _lattice_index(res.coefficients, grid, data_norm)
    assert res.info["release"] == "grid" and res.info["grid"] == grid
    if data_norm != 3.0:
      scaled = np.asarray(res.coefficients) * data_norm / grid
      np.testing.assert_array_equal(scaled, np.round(scaled))
    assert np.all(np.abs(m) < 2.0**51)
  labels = np.argmax(X, axis=1)
  multi = erm.one_vs_rest(KEY, X, labels, classes=range(D), epsilon=3.0, method="output",
                          regularization=0.1)
  assert multi.coefficients.shape == (D, D)
  _lattice_index(multi.coefficients, multi.info["grid"], 1.0)
  scaled = np.asarray(multi.coefficients) / multi.info["grid"]
  np.testing.assert_array_equal(scaled, np.round(scaled))


def test_grid_release_is_on_the_lattice_under_jit_and_vmap():
  """With x64 on, jit and vmap over keys stage the same float64 program: lattice outputs equal
  to the eager ones, for output perturbation and one-vs-rest."""
  X, y = _data(41)
  labels = np.argmax(X, axis=1)
  keys = jax.random.split(jax.random.key(3), 3)
  fit = lambda k, X: erm.output_perturbation(k, X, y, epsilon=1.0, regularization=0.1)
  multi = lambda k, X: erm.one_vs_rest(k, X, labels, classes=range(D), epsilon=3.0,
                                       method="output", regularization=0.1)
  with jax.enable_x64(True):
    single = jax.jit(jax.vmap(fit, in_axes=(0, None)))(keys, jnp.asarray(X))
    several = jax.vmap(multi, in_axes=(0, None))(keys, jnp.asarray(X))
  for batch, fn in ((single, fit), (several, multi)):
    assert bool(np.all(batch.ok)) and batch.coefficients.dtype == jnp.float64
    for k, row in zip(keys, np.asarray(batch.coefficients)):
      _lattice_index(row, batch.info["grid"], 1.0)
      np.testing.assert_array_equal(row, fn(k, X).coefficients)


def test_raw_release_is_the_float_value_and_grid_the_same_draw_rounded():
  """``release="raw"`` is f̂ + b (b the ℓ2-Laplace draw of the key at β = ε/Δ₂); the grid
  release of the same key is ``Λ_g(round(f̂/Λ_g) + round(b_g))``, b_g the same draw at the rate
  ε/Δ_Λ per grid step, hence per coordinate
  ``|B·grid − B·raw| ≤ Λ_g/2 + Λ_g/2 + |b_j|(Λ_g Δ_Λ/Δ₂ − 1)`` (the two roundings, and the
  rate's factor ``Δ₂/(Λ_g Δ_Λ) ∈ [1/(1 + 2^-10), 1]``)."""
  X, y = _data(42)
  lam = 0.1
  f_hat = _minimiser(X, y, lam, "huber")[0]
  for s in range(3):
    key = jax.random.key(100 + s)
    raw = erm.output_perturbation(key, X, y, epsilon=1.0, regularization=lam, loss="huber",
                                  release="raw")
    grid = erm.output_perturbation(key, X, y, epsilon=1.0, regularization=lam, loss="huber")
    assert raw.info["release"] == "raw" and grid.info["release"] == "grid"
    step = grid.info["grid"]
    with jax.enable_x64(True):
      b = np.asarray(M.l2_laplace_noise(key, D, raw.info["beta"], jnp.float64))
      b_grid = np.asarray(M.l2_laplace_noise(key, D, grid.info["grid_beta"], jnp.float64))
    np.testing.assert_allclose(raw.coefficients, f_hat + b, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(_lattice_index(grid.coefficients, step, 1.0),
                                  np.round(f_hat / step) + np.round(b_grid))
    factor = step * grid.info["grid_sensitivity"] / grid.info["sensitivity"] - 1.0
    assert 0.0 < factor <= 2.0**-10 * (1 + 1e-9)
    gap = np.abs(np.asarray(grid.coefficients) - np.asarray(raw.coefficients))
    assert np.all(gap <= step + np.abs(b) * factor + 1e-12), (gap, step)


def test_grid_noise_is_calibrated_to_the_grid_sensitivity():
  """info holds the grid of ``discretization(Δ₂, d, R)``, the rate ``β_g = ε/Δ_Λ`` per grid step
  (the program's β) and its unit-scale equivalent ``β_g/Λ_g``; the recovered noise
  ``k = m − round(f̂/Λ_g)`` of 2,000 keys has norm ``≈ Gamma(d, 1/β_g)`` (the KS test rejects a
  rate 10% off at this size)."""
  X, y = _data(43)
  lam, epsilon = 0.1, 2.0
  params, info = erm.erm_parameters(N, D, epsilon=epsilon, method="output", regularization=lam)
  sensitivity = 2.0 / (N * lam) + 2.0 * 1e-10 / lam
  bound = math.sqrt(2.0 * math.log(2.0) / lam) + 1e-10 / lam
  lattice = M.discretization(sensitivity, D, bound)
  assert info["sensitivity"] == pytest.approx(sensitivity, rel=1e-15)
  assert (info["grid"], info["grid_sensitivity"], info["grid_bound"]) == tuple(lattice)
  assert info["grid_sensitivity"] <= (1 + 2.0**-10) * sensitivity / info["grid"]
  assert params.beta == info["grid_beta"] == epsilon / info["grid_sensitivity"]
  assert info["beta"] == pytest.approx(info["grid_beta"] / info["grid"], rel=1e-15)
  assert info["noise"] == "discretised l2-laplace" and params.release == "grid"
  assert (params.grid, params.grid_bound) == (info["grid"], info["grid_bound"])
  trials = 2_000
  keys = jax.random.split(jax.random.key(9), trials)
  with jax.enable_x64(True):
    coef = np.asarray(jax.vmap(lambda k: erm.output_perturbation(
        k, jnp.asarray(X), y, epsilon=epsilon, regularization=lam).coefficients)(keys))
  f_hat = _minimiser(X, y, lam)[0]
  k = _lattice_index(coef, info["grid"], 1.0) - np.round(f_hat / info["grid"])
  norms = np.linalg.norm(k, axis=1)          # rounding moves each norm by ≤ √d/2 of ~10^4
  beta = info["grid_beta"]
  assert stats.kstest(norms, stats.gamma(D, scale=1.0 / beta).cdf).pvalue > 1e-3
  assert stats.kstest(norms, stats.gamma(D, scale=1.1 / beta).cdf).pvalue < 1e-6
  assert stats.kstest(norms, stats.gamma(D, scale=0.9 / beta).cdf).pvalue < 1e-6


@pytest.mark.parametrize("loss,lam", [("logistic", 1e-3), ("logistic", 0.1), ("huber", 1e-3),
                                      ("huber", 1.0)])
def test_the_public_clamp_never_binds_on_valid_data(loss, lam):
  """R = sqrt(2ℓ(0)/Λ) + tol/Λ bounds the minimiser (J(f*) ≤ J(0)) on random data and on data
  built to push it far (every row e₀ with label +1, where only the regulariser holds f back),
  so the clamp changes nothing on valid data."""
  _, info = erm.erm_parameters(N, D, epsilon=1.0, method="output", regularization=lam, loss=loss)
  at_zero = math.log(2.0) if loss == "logistic" else 1.0        # Huber h = 0.5 < 1
  assert info["grid_bound"] == pytest.approx(math.sqrt(2 * at_zero / lam) + 1e-10 / lam)
  aligned = np.zeros((N, D))
  aligned[:, 0] = 1.0
  for X, y in [_data(44), _data(45, noise=0.0), (aligned, np.ones(N))]:
    f_hat = _minimiser(X, y, lam, loss)[0]
    assert np.linalg.norm(f_hat) <= info["grid_bound"]
  if lam >= 0.1:                          # not vacuous (at small Λ, ‖f*‖ ~ ln(1/Λ) ≪ R)
    assert np.linalg.norm(f_hat) >= 0.3 * info["grid_bound"]


def test_objective_grid_release_rounds_the_raw_release():
  """Objective perturbation's grid release is post-processing: the raw release of the same key
  rounded to the public step of ``discretization(2/(n(Λ + Δ)), d)``, in both branches."""
  X, y = _data(46)
  for lam, epsilon in ((0.05, 1.0), (1e-3, 0.5)):
    raw = erm.objective_perturbation(KEY, X, y, epsilon=epsilon, regularization=lam,
                                     release="raw")
    grid = erm.objective_perturbation(KEY, X, y, epsilon=epsilon, regularization=lam)
    step = grid.info["grid"]
    extra = grid.info["extra_regularization"]
    assert step == M.discretization(2.0 / (N * (lam + extra)), D).grid
    assert "grid_bound" not in grid.info and grid.info["release"] == "grid"
    np.testing.assert_array_equal(grid.coefficients,
                                  np.round(np.asarray(raw.coefficients) / step) * step)


@pytest.mark.parametrize("name", ["output_perturbation", "objective_perturbation", "one_vs_rest",
                                  "erm_parameters"])
def test_a_bad_release_is_refused(name):
  X, y = _data(47)
  call = {
      "output_perturbation": lambda r: erm.output_perturbation(KEY, X, y, epsilon=1.0, release=r),
      "objective_perturbation": lambda r: erm.objective_perturbation(KEY, X, y, epsilon=1.0,
                                                                     release=r),
      "one_vs_rest": lambda r: erm.one_vs_rest(KEY, X, np.where(y > 0, 1, 0), classes=[0, 1],
                                               epsilon=1.0, release=r),
      "erm_parameters": lambda r: erm.erm_parameters(N, D, epsilon=1.0, method="output",
                                                     release=r),
  }[name]
  for bad in ("bits", "Grid", None):
    with pytest.raises(ValueError, match="release must be one of"):
      call(bad)


def test_extreme_scales_give_a_clear_error_or_a_lattice_output():
  """Huge or tiny data_norm and tiny ε: either a ValueError naming the argument, or a finite
  lattice output with ok=True (never NaN)."""
  X, y = _data(48)
  for data_norm, epsilon in ((1e290, 1.0), (1e-280, 1.0), (1.0, 1e-6), (2.0**-900, 1e-3)):
    for fit in (erm.output_perturbation, erm.objective_perturbation):
      res = fit(KEY, data_norm * X, y, epsilon=epsilon, regularization=0.1, data_norm=data_norm)
      assert bool(res.ok) and np.all(np.isfinite(res.coefficients)), (fit, data_norm, epsilon)
      _lattice_index(res.coefficients, res.info["grid"], data_norm)
  with pytest.raises(ValueError, match="data_norm"):
    erm.output_perturbation(KEY, X * 1e305, y, epsilon=1.0, data_norm=1e305)
  with pytest.raises(ValueError, match="data_norm"):
    erm.output_perturbation(KEY, X * 1e-300, y, epsilon=1.0, data_norm=1e-300)
  with pytest.raises(ValueError, match="epsilon=1e-12 is too small"):
    erm.output_perturbation(KEY, X, y, epsilon=1e-12)
  with pytest.raises(ValueError, match="2\\^50 grid steps"):
    erm.erm_parameters(2**45, 1, epsilon=1.0, method="output", regularization=1.0, tol=1e-30)
  # The raw release keeps today's behaviour at those scales.
  raw = erm.output_perturbation(KEY, X, y, epsilon=1e-12, release="raw")
  assert np.all(np.isfinite(raw.coefficients))


def test_erm_core_grid_output_release_needs_float64():
  """The lattice arithmetic needs integers to 2^51 exactly: a float32 core refuses the output
  method's grid release (the raw release and objective perturbation's rounding run)."""
  X, y = _data(49)
  params, _ = erm.erm_parameters(N, D, epsilon=1.0, method="output", regularization=0.1)
  X32, y32 = jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32)
  with pytest.raises(TypeError, match="needs float64"):
    erm.erm_core(KEY, X32, y32, params)
  with pytest.raises(ValueError, match="release must be one of"):
    erm.erm_core(KEY, X32, y32, params._replace(release="bits"))
