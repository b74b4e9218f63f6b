"""DOPPLER's low-pass filter of the released updates (issue 52 §4; docs/algorithms.md §6.8):
DC gain 1 from the first step, white noise averaged down, optax's EMA as its first-order case,
post-processing inside the plan's transform."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax import sgd
from dpjax.sgd import filters


def _filtered(tx, sequence):
  state = tx.init({"w": jnp.zeros(sequence.shape[1:])})
  update = jax.jit(tx.update)
  out = []
  for g in sequence:
    u, state = update({"w": jnp.asarray(g)}, state)
    out.append(np.asarray(u["w"]))
  return np.stack(out)


def test_first_order_default_is_optax_ema_with_debiasing():
  g = np.random.default_rng(0).normal(size=(30, 4)).astype(np.float32)
  np.testing.assert_allclose(_filtered(filters.low_pass(), g),
                             _filtered(optax.ema(0.9, debias=True), g), rtol=1e-5, atol=1e-6)


def test_a_constant_passes_unchanged_from_the_first_step():
  """Second order, with feed-forward taps: the bias correction makes the DC gain 1 at every
  step, transient included."""
  tx = filters.low_pass(a=(-1.2, 0.36), b=(0.1, 0.06))
  np.testing.assert_allclose(_filtered(tx, np.full((40, 3), 2.5, np.float32)), 2.5, rtol=1e-5)


def test_white_noise_is_averaged_down_and_an_alternating_input_attenuated():
  rng = np.random.default_rng(1)
  signal = np.linspace(0.0, 1.0, 400)[:, None] * np.ones((1, 50))
  noisy = (signal + rng.normal(size=signal.shape)).astype(np.float32)
  out = _filtered(filters.low_pass(), noisy)
  raw_error = np.mean((noisy[100:] - signal[100:]) ** 2)
  filtered_error = np.mean((out[100:] - signal[100:]) ** 2)
  assert filtered_error < 0.1 * raw_error           # noise variance × 0.01/0.19, plus a lag
  alternating = np.tile(np.array([[1.0], [-1.0]], np.float32), (50, 1))
  assert np.abs(_filtered(filters.low_pass(), alternating)[50:]).max() < 0.06


def _linear_plan():
  """``(plan, grad_fn, (X, y))``: 30 steps of DP-SGD at σ = 1 on a noiseless linear model."""
  rng = np.random.default_rng(0)
  X = rng.normal(size=(200, 3)).astype(np.float32)
  y = X @ np.array([1.0, -2.0, 0.5], np.float32)
  grad_fn = sgd.clipped_grad_sum(lambda w, ex: (ex[0] @ w - ex[1]) ** 2, clip_norm=1.0)
  plan = sgd.dp_sgd_plan(grad_fn, num_examples=200, expected_batch_size=20, steps=30,
                         noise_multiplier=1.0, key=jax.random.key(0))
  return plan, grad_fn, (X, y)


def test_inside_a_plan_it_only_sees_released_updates():
  plan, _, (X, y) = _linear_plan()
  opt = optax.chain(filters.low_pass(), optax.sgd(0.5))
  state = plan.init(jnp.zeros(3), opt)
  params, state = plan.run(jnp.zeros(3), state, plan.prepare((X, y)), opt)
  assert np.all(np.isfinite(params)) and plan.steps_taken(state) == 30
  assert isinstance(state[0], sgd.noise.NoiseState)      # the noise first, the filter after
  assert isinstance(state[1][0], filters.LowPassState)


@pytest.mark.parametrize("a,b", [((), ()), ((-0.9,), (np.nan,)), ((-1.0,), (0.1,)),
                                 ((0.5,), (-0.1,)), ((1.0, 1.0), (0.1, -0.3))])
def test_bad_filters_are_refused(a, b):
  with pytest.raises(ValueError):
    filters.low_pass(a, b)


def _quadratic():
  rng = np.random.default_rng(3)
  A = rng.normal(size=(8, 4)).astype(np.float32)
  b = rng.normal(size=8).astype(np.float32)
  return A, b, lambda w: A.T @ (A @ w - b) / 8


def test_kalman_filter_is_dis_k_recursion_run_on_the_extrapolated_points():
  """The transform, driven by gradients at the params it updates (y_t), follows exactly the
  direct scheme: g̃_t = (1 − κ)g̃_{t−1} + κ∇f(x_t + c(x_t − x_{t−1})), x_{t+1} = x_t − η g̃_t,
  c = (1 − κ)/κ; and kalman_filter_iterate recovers x_t from y_t."""
  _, _, grad = _quadratic()
  kappa, eta = 0.4, 0.05
  c = (1 - kappa) / kappa
  x_prev = x = np.zeros(4)
  estimate = None
  direct = []
  for _ in range(25):
    g = grad(x + c * (x - x_prev))
    estimate = g if estimate is None else (1 - kappa) * estimate + kappa * g
    x_prev, x = x, x - eta * estimate
    direct.append(x)
  tx = filters.kalman_filter(optax.sgd(eta), kappa)
  y = jnp.zeros(4)
  state = tx.init(y)
  for t in range(25):
    u, state = tx.update(jnp.asarray(grad(np.asarray(y))), state, y)
    y = optax.apply_updates(y, u)
    np.testing.assert_allclose(filters.kalman_filter_iterate(y, state), direct[t],
                               rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(y, direct[-1] + c * (direct[-1] - direct[-2]), rtol=1e-4,
                             atol=1e-5)


def test_kalman_filter_tracks_the_gradient_without_lag_and_averages_its_noise():
  """On a quadratic the extrapolated gradient makes the estimate exact: without noise the model
  x_t follows plain gradient descent exactly (an EMA of gradients would lag), and with white
  noise of variance s² the estimate's error g̃_t − ∇f(x_t) has variance κ/(2 − κ)·s² (0.18 s²
  at κ = 0.3), against s² for the raw gradient."""
  _, _, grad = _quadratic()
  tx = filters.kalman_filter(optax.sgd(0.05), 0.3)
  update = jax.jit(tx.update)
  for noise in (0.0, 1.0):
    rng = np.random.default_rng(0)
    y, x_gd = jnp.zeros(4), np.zeros(4)
    state = tx.init(y)
    errors = []
    for t in range(400):
      x = np.asarray(filters.kalman_filter_iterate(y, state))        # x_t
      g = grad(np.asarray(y)) + noise * rng.normal(size=4).astype(np.float32)
      u, state = update(jnp.asarray(g), state, y)
      errors.append(np.asarray(state.estimate) - grad(x))
      y = optax.apply_updates(y, u)
      if noise == 0.0:
        np.testing.assert_allclose(x, x_gd, rtol=1e-4, atol=1e-5)
        x_gd = x_gd - 0.05 * grad(x_gd)
    if noise:
      variance = float(np.var(np.asarray(errors[50:])))
      assert 0.12 < variance < 0.25, variance                          # κ/(2 − κ) = 0.176


def test_kalman_filter_in_a_plan_and_bad_settings():
  plan, grad_fn, (X, y) = _linear_plan()
  opt = sgd.kalman_filter(optax.adam(0.05), kappa=0.5)
  state = plan.init(jnp.zeros(3), opt)
  params, state = plan.run(jnp.zeros(3), state, plan.prepare((X, y)), opt)
  model = sgd.kalman_filter_iterate(params, state)
  assert np.all(np.isfinite(model)) and plan.steps_taken(state) == 30
  assert plan.dp_event == sgd.dp_sgd_plan(grad_fn, num_examples=200, expected_batch_size=20,
                                          steps=30, noise_multiplier=1.0,
                                          key=jax.random.key(0)).dp_event
  for kappa in (0.0, 1.5, float("nan")):
    with pytest.raises(ValueError, match="kappa"):
      sgd.kalman_filter(optax.sgd(0.1), kappa)
  with pytest.raises(TypeError):
    sgd.kalman_filter(lambda g: g)
  with pytest.raises(ValueError, match="Kalman"):
    sgd.kalman_filter_iterate(params, {"other": 1})
