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
  """The non-private minimiser of J by the library's own program: output perturbation with an
  astronomically large β (‖b‖ ~ d·1e-290)."""
  params, _ = erm.erm_parameters(X.shape[0], X.shape[1], epsilon=1.0, method="output",
                                 regularization=lam, loss=loss, huber_width=huber_width)
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
  params, info = erm.erm_parameters(N, D, epsilon=2.0, method="output", regularization=0.1)
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
  """The release is argmin J + (1/n) bᵀf + (Δ/2)‖f‖², b the ℓ2-Laplace draw of the same key,
  in both branches (Δ = 0 at Λ = 0.05; Δ > 0 at Λ = 1e-3, ε = 0.5)."""
  X, y = _data(4)
  key = jax.random.key(5)
  for lam, epsilon, branch in ((0.05, 1.0, "Delta=0"), (1e-3, 0.5, "Delta>0")):
    res = erm.objective_perturbation(key, X, y, epsilon=epsilon, regularization=lam)
    assert res.info["branch"] == branch and res.nonprivate_gradient_norm <= 1e-10
    extra = res.info["extra_regularization"]
    with jax.enable_x64(True):
      b = np.asarray(M.l2_laplace_noise(key, D, res.info["beta"], jnp.float64))
    expected = _scipy_minimiser(X, y, lam + extra, linear=b / N)
    np.testing.assert_allclose(res.coefficients, expected, atol=1e-8)
  out = erm.output_perturbation(key, X, y, epsilon=1.0, regularization=0.05)
  with jax.enable_x64(True):
    b = np.asarray(M.l2_laplace_noise(key, D, out.info["beta"], jnp.float64))
  np.testing.assert_allclose(out.coefficients - b, _scipy_minimiser(X, y, 0.05), atol=1e-8)


def test_neighbouring_minimisers_differ_by_at_most_two_over_n_lambda():
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
  assert res.neighbouring == NeighboringRelation.REPLACE_ONE
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
