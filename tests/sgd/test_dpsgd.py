"""DP-SGD pieces: per-example gradients, clipping, Poisson micro-batches, noise transforms."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from dpjax import linalg, sgd
from dpjax.metrics import clopper_pearson


def _mlp_params(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (5, 4)), "b1": jnp.zeros(4),
          "w2": jax.random.normal(k2, (4, 3)), "b2": jnp.zeros(3)}


def _loss(params, example):
  x, y = example
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"] + params["b2"], y)


def _batch(key, n=16):
  kx, ky = jax.random.split(key)
  return jax.random.normal(kx, (n, 5)) * 3, jax.random.randint(ky, (n,), 0, 3)


def test_vectorised_per_example_grads_equal_a_loop():
  params, (X, y) = _mlp_params(jax.random.key(0)), _batch(jax.random.key(1))
  batched = sgd.per_example_grads(_loss)(params, (X, y))
  for i in range(X.shape[0]):
    single = jax.grad(_loss)(params, (X[i], y[i]))
    for name in params:
      np.testing.assert_allclose(np.asarray(batched[name][i]), np.asarray(single[name]),
                                 rtol=1e-4, atol=1e-5)


def test_clipped_norms_are_bounded_and_small_ones_unchanged():
  params, batch = _mlp_params(jax.random.key(2)), _batch(jax.random.key(3))
  grads = sgd.per_example_grads(_loss)(params, batch)
  norms = sgd.global_norms(grads)
  C = float(jnp.median(norms))
  clipped = sgd.clip_per_example(grads, C)
  new = sgd.global_norms(clipped)
  assert bool(jnp.all(new <= C * (1 + 1e-5)))
  small = norms <= C
  np.testing.assert_allclose(np.asarray(new[small]), np.asarray(norms[small]), rtol=1e-5)
  zero = jax.tree_util.tree_map(jnp.zeros_like, grads)
  assert all(bool(jnp.all(l == 0)) and bool(jnp.all(jnp.isfinite(l)))
             for l in jax.tree_util.tree_leaves(sgd.clip_per_example(zero, 1.0)))


def test_clipped_grad_sum_is_the_masked_sum_of_clipped_grads():
  params, batch = _mlp_params(jax.random.key(4)), _batch(jax.random.key(5))
  mask = jnp.arange(16) % 3 != 0
  fused = jax.jit(sgd.clipped_grad_sum(_loss, clip_norm=0.5))(params, batch, mask)
  clipped = sgd.clip_per_example(sgd.per_example_grads(_loss)(params, batch), 0.5)
  for name in params:
    expected = jnp.sum(clipped[name] * mask.reshape((-1,) + (1,) * (clipped[name].ndim - 1)),
                       axis=0)
    np.testing.assert_allclose(np.asarray(fused[name]), np.asarray(expected), atol=1e-5)


def test_poisson_microbatches_never_truncate():
  counts = []
  for i in range(200):
    key = jax.random.key(i)
    idx, mask = sgd.poisson_microbatches(key, 1_000, 0.05, 16)
    chosen = np.flatnonzero(np.asarray(sgd.poisson_mask(key, 1_000, 0.05)))
    assert idx.shape[0] == max(1, math.ceil(chosen.size / 16)) and idx.shape == mask.shape
    assert sorted(idx[mask].tolist()) == chosen.tolist()       # each sampled example once
    counts.append(chosen.size)
  low, high = clopper_pearson(int(sum(counts)), 200 * 1_000, 0.999)
  assert low <= 0.05 <= high


def test_noise_transform_divides_by_expected_batch_size():
  summed = {"a": jnp.ones(3) * 8.0, "b": jnp.ones((2, 2))}
  tx = sgd.dp_gaussian_noise(clip_norm=1.0, noise_multiplier=0.0, expected_batch_size=4.0,
                             key=jax.random.key(0))
  out, _ = tx.update(summed, tx.init(summed))
  np.testing.assert_allclose(np.asarray(out["a"]), 2.0)
  np.testing.assert_allclose(np.asarray(out["b"]), 0.25)


def test_noise_std_matches_sigma_c_over_l():
  zeros = jnp.zeros(20_000)
  tx = sgd.dp_gaussian_noise(clip_norm=2.0, noise_multiplier=1.5, expected_batch_size=10.0,
                             key=jax.random.key(1))
  state = tx.init(zeros)
  out1, state = tx.update(zeros, state)
  out2, _ = tx.update(zeros, state)
  assert abs(float(jnp.std(out1)) - 0.3) < 0.01
  assert not jnp.array_equal(out1, out2)                  # the key is split, never reused


def test_subspace_noise_lives_in_the_subspace_and_has_k_dims_of_energy():
  p, k, L, sigma, C = 200, 5, 10.0, 2.0, 1.0
  V = linalg.orthonormal_basis(jax.random.key(2), p, k)
  params = {"w": jnp.zeros((20, 10))}
  tx = sgd.subspace_dp_gaussian_noise(V, clip_norm=C, noise_multiplier=sigma,
                                      expected_batch_size=L, key=jax.random.key(3))
  state = tx.init(params)
  energies = []
  for _ in range(300):
    out, state = tx.update(params, state)
    flat = ravel_pytree(out)[0]
    assert float(jnp.linalg.norm(flat - V @ (V.T @ flat))) < 1e-4   # in span(V)
    energies.append(float(flat @ flat))
  expected = sigma**2 * C**2 * k / L**2                    # not p / L²
  assert abs(np.mean(energies) - expected) < 0.2 * expected


def test_subspace_transform_projects_the_signal():
  V = jnp.eye(6)[:, :2]
  tx = sgd.subspace_dp_gaussian_noise(V, clip_norm=1.0, noise_multiplier=0.0,
                                      expected_batch_size=2.0, key=jax.random.key(0))
  g = jnp.arange(1.0, 7.0)
  out, _ = tx.update(g, tx.init(g))
  np.testing.assert_allclose(np.asarray(out), [0.5, 1.0, 0, 0, 0, 0])


def test_dp_aggregate_matches_clip_sum_then_noise():
  params, batch = _mlp_params(jax.random.key(6)), _batch(jax.random.key(7))
  grads = sgd.per_example_grads(_loss)(params, batch)
  tx = sgd.dp_aggregate(clip_norm=0.3, noise_multiplier=0.0, expected_batch_size=8.0,
                        key=jax.random.key(0))
  mask = jnp.arange(16) < 10
  out, _ = tx.update(grads, tx.init(params), mask=mask)
  expected = sgd.clipped_grad_sum(_loss, clip_norm=0.3)(params, batch, mask)
  for name in params:
    np.testing.assert_allclose(np.asarray(out[name]), np.asarray(expected[name]) / 8.0,
                               atol=1e-6)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: sgd.dp_gaussian_noise(clip_norm=0.0, noise_multiplier=1.0, expected_batch_size=1.0, key=jax.random.key(0)), ValueError, "clip_norm"),
    (lambda: sgd.dp_gaussian_noise(clip_norm=1.0, noise_multiplier=-1.0, expected_batch_size=1.0, key=jax.random.key(0)), ValueError, "noise_multiplier"),
    (lambda: sgd.dp_gaussian_noise(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=0.0, key=jax.random.key(0)), ValueError, "expected_batch_size"),
    (lambda: sgd.dp_gaussian_noise(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=1.0, key=3), TypeError, "key"),
    (lambda: sgd.subspace_dp_gaussian_noise(jnp.ones((5, 2)), clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=1.0, key=jax.random.key(0)), ValueError, "orthonormal"),
    (lambda: sgd.subspace_dp_gaussian_noise(jnp.eye(3), clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=1.0, key=jax.random.key(0)).init(jnp.zeros(4)), ValueError, "basis"),
    (lambda: sgd.poisson_mask(jax.random.key(0), 10, 0.0), ValueError, "sampling_prob"),
    (lambda: sgd.poisson_microbatches(jax.random.key(0), 10, 0.5, 0), ValueError, "microbatch_size"),
    (lambda: sgd.clip_per_example({"a": jnp.ones((2, 2))}, -1.0), ValueError, "clip_norm"),
])
def test_bad_inputs(call, exc, match):
  with pytest.raises(exc, match=match):
    call()
