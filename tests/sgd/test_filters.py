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


def test_inside_a_plan_it_only_sees_released_updates():
  rng = np.random.default_rng(0)
  X = rng.normal(size=(200, 3)).astype(np.float32)
  y = X @ np.array([1.0, -2.0, 0.5], np.float32)
  grad_fn = sgd.clipped_grad_sum(lambda w, ex: (ex[0] @ w - ex[1]) ** 2, clip_norm=1.0)
  plan = sgd.dp_sgd_plan(grad_fn, num_examples=200, expected_batch_size=20, steps=30,
                         noise_multiplier=1.0, key=jax.random.key(0))
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
