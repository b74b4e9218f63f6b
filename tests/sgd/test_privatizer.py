"""dp_sgd_privatizer: C, σ and L bound together; the whole Poisson sample summed in one call."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_accounting import NeighboringRelation

import dpjax
from dpjax import accounting
from dpjax.sgd import privatizer, sampling
from helpers import normal

N, D = 400, 5
_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.normal(size=(N, D)), jnp.float32)
W_TRUE = jnp.arange(1.0, D + 1.0)
DATA = (X, X @ W_TRUE)


def loss_fn(w, example):
  x, y = example
  return (x @ w - y) ** 2


# The reference masked sum at C = 1, jitted once for the module (op by op it compiles ~30 ops).
_masked_sum = jax.jit(dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=1.0))


@pytest.mark.slow(reason="a README-style loop learns within budget; test_docs runs the README's "
                         "own loop by default")
def test_the_readme_loop_learns_within_its_budget():
  """The README's example: four DP-specific lines added to a plain optax loop."""
  params, steps = jnp.zeros(D), 150
  grad_fn = dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=5.0)
  dp = dpjax.sgd.dp_sgd_privatizer(grad_fn, epsilon=2.0, delta=1e-5, num_examples=N,
                                   expected_batch_size=40, steps=steps, key=jax.random.key(0))
  tx = optax.chain(dp.transform, optax.adam(0.05))
  opt_state = tx.init(params)
  for step_key in jax.random.split(jax.random.key(1), steps):
    grads = dp.clipped_sum(params, DATA, step_key)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  assert float(jnp.linalg.norm(params - W_TRUE)) < 0.5          # from ‖W‖ = 7.4 at the start
  assert dp.budget.epsilon <= 2.0 and dp.budget.delta <= 1e-5 * (1 + 1e-12)
  assert dp.budget.neighbouring == NeighboringRelation.ADD_OR_REMOVE_ONE
  assert dp.dp_event == accounting.dpsgd_event(dp.noise_multiplier, 40 / N, steps)
  assert accounting.dpsgd_epsilon(dp.noise_multiplier, 40 / N, steps, 1e-5) <= 2.0


def test_clipped_sum_covers_every_sampled_example_once():
  grad_fn = dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=1.0)
  dp = dpjax.sgd.dp_sgd_privatizer(grad_fn, noise_multiplier=1.0, num_examples=N,
                                   expected_batch_size=50, steps=1, key=jax.random.key(0),
                                   microbatch_size=7)                 # many micro-batches
  params = jnp.ones(D)
  key = jax.random.key(5)
  mask = np.asarray(sampling.poisson_mask(key, N, 50 / N))
  expected = _masked_sum(params, DATA, jnp.asarray(mask))             # one pass over all rows
  got = dp.clipped_sum(params, DATA, key)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
  # Padding micro-batches (the count is rounded up to a power of two) add nothing.
  indices, m = sampling.poisson_microbatches(key, N, 50 / N, 7)
  padded = privatizer.accumulate_microbatches(
      grad_fn, params, DATA, jnp.concatenate([jnp.asarray(indices), jnp.zeros((3, 7),
                                                                              jnp.int32)]),
      jnp.concatenate([jnp.asarray(m), jnp.zeros((3, 7), bool)]))
  np.testing.assert_allclose(np.asarray(padded), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q,microbatch", [
    pytest.param(50 / N, 7, marks=pytest.mark.slow(reason="many micro-batches (B = 7); the default "
                                                          "run checks q = 0.9, B = 16")),
    pytest.param(0.9, 400, marks=pytest.mark.slow(reason="one micro-batch (B = N); the default run "
                                                         "checks q = 0.9, B = 16")),
    (0.9, 16)])
def test_poisson_clipped_sum_in_the_trace_covers_the_whole_sample(q, microbatch):
  """The traceable core draws the host helper's sample and sums every micro-batch of it (many
  micro-batches, one, and a sample far above B: never truncated), under jit and vmap."""
  grad_fn = dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=1.0)
  params = jnp.ones(D)
  keys = jax.random.split(jax.random.key(6), 3)

  @jax.jit
  def sums(keys):       # and with extra_args, which reach grad_fn (in the same program)
    return (jax.vmap(lambda k: dpjax.sgd.poisson_clipped_sum(
        grad_fn, params, DATA, k, sampling_prob=q, microbatch_size=microbatch))(keys),
            dpjax.sgd.poisson_clipped_sum(
                lambda p, b, m, c: grad_fn(p, b, m) * c, params, DATA, keys[0],
                sampling_prob=q, microbatch_size=microbatch, extra_args=(2.0,)))

  got, scaled = sums(keys)
  for key, row in zip(keys, np.asarray(got)):
    mask = np.asarray(sampling.poisson_mask(key, N, q))
    expected = _masked_sum(params, DATA, jnp.asarray(mask))
    np.testing.assert_allclose(row, np.asarray(expected), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(scaled), 2 * np.asarray(got[0]), rtol=1e-5, atol=1e-4)
  # Data leaves must share the example axis.
  with pytest.raises(ValueError, match="leading example axis"):
    dpjax.sgd.poisson_clipped_sum(grad_fn, params, (X, X[:3]), keys[0], sampling_prob=q,
                                  microbatch_size=microbatch)


def test_the_noise_is_sigma_times_the_carried_clip_norm():
  """C comes from the clipped function: the transform's noise std is σ·C / L."""
  C, sigma, L = 3.0, 2.0, 10.0
  grad_fn = dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=C)
  dp = dpjax.sgd.dp_sgd_privatizer(grad_fn, noise_multiplier=sigma, num_examples=N,
                                   expected_batch_size=L, steps=1, key=jax.random.key(0))
  zeros = jnp.zeros(2_000)
  out, _ = dp.transform.update(zeros, dp.transform.init(zeros))
  std = float(jnp.std(out))
  assert abs(std - sigma * C / L) < 0.05 * sigma * C / L
  assert privatizer.l2_norm_bound(grad_fn) == C
  assert grad_fn.sensitivity() == C
  assert grad_fn.sensitivity(NeighboringRelation.REPLACE_ONE) == 2 * C


def test_a_basis_puts_the_noise_in_its_span_and_can_be_refreshed():
  V = jnp.asarray(np.linalg.qr(np.asarray(normal(3, (D, 2))))[0])
  grad_fn = dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=1.0)
  # σ given, not calibrated from ε (~1 s): the next test calibrates.
  dp = dpjax.sgd.dp_sgd_privatizer(grad_fn, noise_multiplier=1.0, num_examples=N,
                                   expected_batch_size=40, steps=10, key=jax.random.key(0),
                                   basis=V)
  tx = optax.chain(dp.transform, optax.sgd(0.1))
  state = tx.init(jnp.zeros(D))
  updates, state = tx.update(dp.clipped_sum(jnp.zeros(D), DATA, jax.random.key(1)), state)
  u = np.asarray(updates, np.float64) / -0.1
  Vn = np.asarray(V, np.float64)
  np.testing.assert_allclose(u, Vn @ (Vn.T @ u), atol=1e-5)
  V2 = jnp.asarray(np.linalg.qr(np.asarray(normal(4, (D, 2))))[0])
  state = dpjax.sgd.update_basis(state, V2)
  updates, _ = tx.update(dp.clipped_sum(jnp.zeros(D), DATA, jax.random.key(2)), state)
  u = np.asarray(updates, np.float64) / -0.1
  Vn = np.asarray(V2, np.float64)
  np.testing.assert_allclose(u, Vn @ (Vn.T @ u), atol=1e-5)


def test_a_private_subspace_cost_is_composed_into_the_total():
  grad_fn = dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=1.0)
  # At ε = 1 (σ ≈ 3) the RDP calibrations take ~0.7 s each (~2 s at ε = 2).
  kw = dict(num_examples=N, expected_batch_size=40, steps=50, key=jax.random.key(0))
  alone = dpjax.sgd.dp_sgd_privatizer(grad_fn, epsilon=1.0, delta=1e-5, **kw)
  shared = dpjax.sgd.dp_sgd_privatizer(grad_fn, epsilon=1.0, delta=1e-5, subspace_epsilon=0.25,
                                       subspace_delta=2e-6, **kw)
  assert shared.noise_multiplier > alone.noise_multiplier
  assert shared.budget.epsilon <= 1.0 + 1e-9 and shared.budget.delta <= 1e-5 * (1 + 1e-9)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(), ValueError, "exactly one"),
    (dict(epsilon=1.0, noise_multiplier=1.0), ValueError, "exactly one"),
    (dict(epsilon=1.0, expected_batch_size=N + 1), ValueError, "num_examples"),
    (dict(epsilon=-1.0), ValueError, "epsilon"),
    (dict(noise_multiplier=1.0, key=0), TypeError, "key"),
    (dict(noise_multiplier=1.0, basis=jnp.ones((D, 2))), ValueError, "orthonormal"),
])
def test_bad_arguments_raise_clear_errors(kwargs, exc, match):
  base = dict(num_examples=N, expected_batch_size=40, steps=5, key=jax.random.key(0))
  base.update(kwargs)
  with pytest.raises(exc, match=match):
    dpjax.sgd.dp_sgd_privatizer(dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=1.0), **base)


def test_a_function_without_a_sensitivity_is_refused():
  plain = dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=1.0).fun       # C dropped
  with pytest.raises(TypeError, match="l2_norm_bound"):
    dpjax.sgd.dp_sgd_privatizer(plain, epsilon=1.0, num_examples=N, expected_batch_size=40,
                                steps=5, key=jax.random.key(0))
  forged = dataclasses.replace(dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=1.0),
                               l2_norm_bound=float("nan"))
  with pytest.raises(ValueError, match="l2_norm_bound"):
    dpjax.sgd.dp_sgd_privatizer(forged, epsilon=1.0, num_examples=N, expected_batch_size=40,
                                steps=5, key=jax.random.key(0))


@pytest.mark.slow(reason="interop with jax_privacy's clipped_grad; the privatizer's own tests "
                         "run by default")
def test_interoperates_with_jax_privacy_clipped_grad():
  """jax_privacy's clipped_grad drives dpjax's privatizer (C read from its l2_norm_bound, padding
  passed as is_padding_example), and its clipped sum equals dpjax's on the same batch."""
  clipping = pytest.importorskip("jax_privacy.clipping")
  C = 2.0
  theirs = clipping.clipped_grad(lambda w, batch: jnp.sum(jax.vmap(loss_fn, (None, 0))(w, batch)),
                                 l2_clip_norm=C, batch_argnums=1)
  ours = dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=C)
  params = jnp.ones(D)
  np.testing.assert_allclose(np.asarray(theirs(params, DATA)),
                             np.asarray(ours(params, DATA, jnp.ones(N))), rtol=1e-4, atol=1e-4)
  dp_theirs = dpjax.sgd.dp_sgd_privatizer(theirs, noise_multiplier=1.0, num_examples=N,
                                          expected_batch_size=40, steps=1,
                                          key=jax.random.key(0))
  dp_ours = dpjax.sgd.dp_sgd_privatizer(ours, noise_multiplier=1.0, num_examples=N,
                                        expected_batch_size=40, steps=1, key=jax.random.key(0))
  key = jax.random.key(9)
  np.testing.assert_allclose(np.asarray(dp_theirs.clipped_sum(params, DATA, key)),
                             np.asarray(dp_ours.clipped_sum(params, DATA, key)),
                             rtol=1e-4, atol=1e-4)
  assert theirs.sensitivity(NeighboringRelation.ADD_OR_REMOVE_ONE) == ours.sensitivity()


def test_the_pld_accountant_option():
  grad_fn = dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=1.0)
  kw = dict(num_examples=N, expected_batch_size=40, steps=5, key=jax.random.key(0))
  # σ = 2: the PLD accountant takes ~0.3 s here (~1.4 s at σ = 1).
  rdp = dpjax.sgd.dp_sgd_privatizer(grad_fn, noise_multiplier=2.0, **kw)
  pld = dpjax.sgd.dp_sgd_privatizer(grad_fn, noise_multiplier=2.0, accountant="pld", **kw)
  assert pld.budget.epsilon == pytest.approx(
      accounting.dpsgd_epsilon(2.0, 40 / N, 5, 1e-5, accountant="pld"))
  assert pld.budget.epsilon <= rdp.budget.epsilon                    # PLD is the tighter one
  with pytest.raises(ValueError, match="accountant"):
    dpjax.sgd.dp_sgd_privatizer(grad_fn, noise_multiplier=1.0, accountant="gdp", **kw)
