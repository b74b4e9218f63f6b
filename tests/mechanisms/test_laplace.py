"""The Laplace mechanism (docs/algorithms.md §1.1): scale, sampler law, dtypes, keys, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpjax import mechanisms as M
from dpjax.mechanisms import snapping

N = 20_000


def _ks_p(samples, scale):
  return stats.kstest(np.asarray(samples, np.float64), stats.laplace(scale=scale).cdf).pvalue


def _assert_scale_is_right(samples, scale):
  """The right scale is accepted; 2/3 and 3/2 of it are rejected (so the test can fail)."""
  assert _ks_p(samples, scale) > 1e-3
  assert _ks_p(samples, scale * 2 / 3) < 1e-6
  assert _ks_p(samples, scale * 3 / 2) < 1e-6


def test_scale_is_sensitivity_over_epsilon():
  assert M.laplace_scale(2.0, 0.5) == 4.0
  assert M.laplace_scale(1, 3) == pytest.approx(1 / 3)
  assert isinstance(M.laplace_scale(1.0, 1.0), float)


def test_noise_float32_has_the_laplace_law():
  b = M.laplace_scale(sensitivity=2.0, epsilon=0.5)
  z = M.laplace_noise(jax.random.key(0), (N,), scale=b)
  assert z.shape == (N,) and z.dtype == jnp.float32
  _assert_scale_is_right(z, b)


def test_noise_float64_has_the_laplace_law():
  with jax.enable_x64(True):
    z = M.laplace_noise(jax.random.key(1), (N,), scale=0.7, dtype=jnp.float64)
    assert z.dtype == jnp.float64
    _assert_scale_is_right(z, 0.7)
    value = jnp.full((N,), 3.0, jnp.float64)
    out = M.laplace_mechanism(jax.random.key(2), value, sensitivity=1.0, epsilon=2.0,
                              secure=False)
    assert out.dtype == jnp.float64
    _assert_scale_is_right(out - 3.0, 0.5)


def test_raw_mechanism_keeps_shape_and_dtype_and_centres_on_the_value():
  value = jnp.full((N // 4, 4), -2.5, jnp.float32)
  out = M.laplace_mechanism(jax.random.key(3), value, sensitivity=3.0, epsilon=1.5, secure=False)
  assert out.shape == value.shape and out.dtype == jnp.float32
  _assert_scale_is_right((out - value).ravel(), 2.0)


def test_secure_mechanism_snaps_to_the_public_grid():
  value = np.full(2_000, 10.0)
  out = M.laplace_mechanism(jax.random.key(4), value, sensitivity=1.0, epsilon=1.0)
  _, grid, bound = snapping.snapping_parameters(1.0, 1.0)
  assert isinstance(out, np.ndarray) and out.dtype == np.float64
  assert np.all(np.abs(out) <= bound)
  assert np.all(out / grid == np.round(out / grid))               # every output on the grid
  assert abs(out.mean() - 10.0) < 5 * np.sqrt(2.0 + grid**2) / np.sqrt(out.size)


def test_jittable_and_key_hygiene():
  draw = jax.jit(lambda k: M.laplace_noise(k, (8,), scale=1.0))
  a, b, c = draw(jax.random.key(5)), draw(jax.random.key(5)), draw(jax.random.key(6))
  assert jnp.array_equal(a, b) and not jnp.array_equal(a, c)
  assert jnp.array_equal(a, M.laplace_noise(jax.random.key(5), (8,), scale=1.0))
  legacy = M.laplace_noise(jax.random.PRNGKey(5), (8,), scale=1.0)     # raw uint32[2] keys work
  assert legacy.shape == (8,)
  m1 = M.laplace_mechanism(jax.random.key(7), jnp.zeros(8), sensitivity=1.0, epsilon=1.0)
  m2 = M.laplace_mechanism(jax.random.key(7), jnp.zeros(8), sensitivity=1.0, epsilon=1.0)
  m3 = M.laplace_mechanism(jax.random.key(8), jnp.zeros(8), sensitivity=1.0, epsilon=1.0)
  assert np.array_equal(m1, m2) and not np.array_equal(m1, m3)


KEY = jax.random.key(0)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: M.laplace_scale(1.0, 0.0), ValueError, "epsilon"),
    (lambda: M.laplace_scale(1.0, -1.0), ValueError, "epsilon"),
    (lambda: M.laplace_scale(1.0, float("nan")), ValueError, "epsilon"),
    (lambda: M.laplace_scale(1.0, float("inf")), ValueError, "epsilon"),
    (lambda: M.laplace_scale(1.0, "1"), TypeError, "epsilon"),
    (lambda: M.laplace_scale(0.0, 1.0), ValueError, "sensitivity"),
    (lambda: M.laplace_noise(KEY, (3,), scale=0.0), ValueError, "scale"),
    (lambda: M.laplace_noise(KEY, (-1,), scale=1.0), ValueError, "shape"),
    (lambda: M.laplace_noise(KEY, (2.5,), scale=1.0), TypeError, "shape"),
    (lambda: M.laplace_noise(KEY, (3,), scale=1.0, dtype=jnp.int32), TypeError, "dtype"),
    (lambda: M.laplace_noise(7, (3,), scale=1.0), TypeError, "key"),
    (lambda: M.laplace_noise(np.zeros(3, np.uint32), (3,), scale=1.0), TypeError, "key"),
    (lambda: M.laplace_mechanism(KEY, jnp.ones(2), sensitivity=1.0, epsilon=0.0), ValueError,
     "epsilon"),
    (lambda: M.laplace_mechanism(KEY, jnp.ones(2), sensitivity=-1.0, epsilon=1.0,
                                 secure=False), ValueError, "sensitivity"),
    (lambda: M.laplace_mechanism(KEY, jnp.arange(3), sensitivity=1.0, epsilon=1.0), TypeError,
     "value"),
    (lambda: M.laplace_mechanism("key", jnp.ones(2), sensitivity=1.0, epsilon=1.0), TypeError,
     "key"),
])
def test_bad_inputs_raise_naming_the_argument(call, exc, match):
  with pytest.raises(exc, match=match):
    call()
