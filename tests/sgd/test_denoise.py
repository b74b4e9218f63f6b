"""Low-rank denoising of privatised gradients (post-processing; dpjax/sgd/denoise.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.sgd import denoise, noise, per_example
from helpers import normal


# One program per shape (op by op, each shape compiles ~20 small programs); the tests use three.
_shrink = jax.jit(denoise.shrink_singular_values)


def _spiked(key, m, n, rank, strength, noise):
  """NumPy float32 ``(signal, signal + noise)``: test data need no compilation."""
  k1, k2, k3 = jax.random.split(key, 3)
  U = np.linalg.qr(np.asarray(normal(k1, (m, rank))))[0]
  V = np.linalg.qr(np.asarray(normal(k2, (n, rank))))[0]
  signal = strength * U @ V.T
  return signal, (signal + noise * np.asarray(normal(k3, (m, n)))).astype(np.float32)


def test_pure_noise_is_shrunk_to_almost_nothing():
  G = 0.3 * normal(0, (64, 100))
  out = _shrink(G, 0.3)
  # Everything lies in the bulk below the edge s(√64 + √100): little or nothing survives.
  assert float(np.linalg.norm(out)) < 0.05 * float(np.linalg.norm(G))


@pytest.mark.parametrize("shape", [(64, 100), (100, 64)])
def test_a_low_rank_signal_is_recovered_better_than_the_noisy_matrix(shape):
  signal, G = _spiked(jax.random.key(1), *shape, rank=3, strength=30.0, noise=1.0)
  out = np.asarray(_shrink(G, 1.0))
  before = float(np.linalg.norm(G - signal))
  after = float(np.linalg.norm(out - signal))
  assert after < 0.4 * before
  # The Gavish–Donoho shrinker beats keeping the top 3 singular values as they are (hard
  # truncation at the true rank), which over-estimates each by the noise.
  U, sv, Vt = np.linalg.svd(G, full_matrices=False)
  truncated = (U[:, :3] * sv[:3]) @ Vt[:3]
  assert after < float(np.linalg.norm(truncated - signal))


def test_the_shrinker_matches_its_formula_on_one_value():
  # A diagonal G: its singular values are its entries, so the map is checked value by value.
  s, m, n = 0.5, 20, 80
  beta = m / n
  values = np.array([0.1, 1.0, 1.2, 2.0, 5.0]) * s * np.sqrt(n) * (1 + np.sqrt(beta))
  G = np.zeros((m, n))
  G[np.arange(5), np.arange(5)] = values
  out = np.asarray(_shrink(jnp.asarray(G, jnp.float32), s, 1.0), np.float64)
  y = values / (s * np.sqrt(n))
  expected = np.where(y > 1 + np.sqrt(beta),
                      s * np.sqrt(n) * np.sqrt(np.clip((y**2 - beta - 1) ** 2 - 4 * beta, 0, None))
                      / y, 0.0)
  np.testing.assert_allclose(np.diag(out)[:5], expected, rtol=1e-4, atol=1e-5)
  assert expected[0] == expected[1] == 0 and expected[-1] > 0


def test_zero_noise_returns_the_input():
  G = normal(2, (100, 64))                   # tall (m > n)
  np.testing.assert_allclose(_shrink(G, 0.0), G, rtol=1e-5, atol=1e-5)


def test_the_filtered_noise_std_is_the_ema_of_independent_noise():
  s, decay, steps, trials = 2.0, 0.7, 6, 20000
  noise = s * np.random.default_rng(0).standard_normal((trials, steps))
  m = np.zeros(trials)
  for t in range(steps):
    m = decay * m + (1 - decay) * noise[:, t]
    empirical = np.std(m / (1 - decay ** (t + 1)))
    assert float(denoise.filtered_noise_std(s, decay, t + 1)) == pytest.approx(empirical,
                                                                               rel=0.03)
  assert float(denoise.filtered_noise_std(s, decay, 1)) == pytest.approx(s, rel=1e-6)
  assert float(denoise.filtered_noise_std(s, 0.0, 5)) == s


def test_the_transform_works_on_nested_pytrees_and_keeps_shapes_and_dtypes():
  params = {"layers": [{"w": jnp.zeros((8, 6)), "b": jnp.zeros(6)},
                       {"w": jnp.zeros((6, 3), jnp.bfloat16), "b": jnp.zeros(3)}],
            "conv": jnp.zeros((3, 3, 2, 4)), "scale": jnp.zeros(())}
  updates = jax.tree_util.tree_map(lambda p: normal(3, p.shape, p.dtype), params)
  tx = denoise.low_rank_denoise(0.1)
  out, state = jax.jit(tx.update)(updates, tx.init(params))
  assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(params)
  for o, p in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(params)):
    assert o.shape == p.shape and o.dtype == p.dtype
  # No filter: leaves that are not matrices pass through unchanged.
  np.testing.assert_array_equal(out["layers"][0]["b"], updates["layers"][0]["b"])
  np.testing.assert_array_equal(out["scale"], updates["scale"])
  assert int(state.count) == 1


def test_no_noise_and_no_filter_is_plain_dp_sgd():
  params = {"w": jnp.ones((5, 4)), "b": jnp.zeros(4)}
  summed = {"w": normal(4, (5, 4)), "b": jnp.arange(4.0)}
  chain = lambda extra: optax.chain(  # noqa: E731
      noise.dp_noise(per_example.ClippedGradSum(lambda *a: None, 1.0), noise_multiplier=1.0,
                     expected_batch_size=8.0, key=jax.random.key(5)), *extra, optax.sgd(0.1))
  plain, denoised = chain([]), chain([denoise.low_rank_denoise(0.0)])
  s1, s2 = plain.init(params), denoised.init(params)
  step1, step2 = jax.jit(plain.update), jax.jit(denoised.update)
  for _ in range(3):
    u1, s1 = step1(summed, s1, params)
    u2, s2 = step2(summed, s2, params)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                           u1, u2)


def test_denoising_reduces_the_error_of_a_noisy_low_rank_gradient_stream():
  signal, _ = _spiked(jax.random.key(6), 32, 64, rank=2, strength=4.0, noise=0.0)
  s = 0.2
  tx = denoise.low_rank_denoise(s, decay=0.5)
  state = tx.init({"w": jnp.asarray(signal, jnp.float32)})
  update = jax.jit(tx.update)
  errors_raw, errors_out = [], []
  for seed in range(10):
    noisy = {"w": (signal + s * np.asarray(normal(70 + seed, signal.shape))).astype(np.float32)}
    out, state = update(noisy, state)
    errors_raw.append(float(np.linalg.norm(noisy["w"] - signal)))
    errors_out.append(float(np.linalg.norm(np.asarray(out["w"]) - signal)))
  assert np.mean(errors_out[3:]) < 0.3 * np.mean(errors_raw[3:])


@pytest.mark.parametrize("kwargs", [{"noise_std": -1.0}, {"noise_std": float("nan")},
                                    {"noise_std": 1.0, "decay": 1.0},
                                    {"noise_std": 1.0, "decay": -0.1},
                                    {"noise_std": 1.0, "threshold_scale": 0.0},
                                    {"noise_std": 1.0, "min_dim": 0}])
def test_bad_options_raise(kwargs):
  with pytest.raises(ValueError):
    denoise.low_rank_denoise(**kwargs)
