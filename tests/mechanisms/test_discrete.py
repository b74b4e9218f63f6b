"""Discrete Laplace (docs/algorithms.md §1.4): pmf (chi-square), tail, mechanism, guards, errors."""

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpjax import mechanisms as M
from dpjax.mechanisms import discrete

N = 10_000         # the wrong-scale p-values stay below 1e-200, the variance within 4.5 SE


def _chi2_p(z, scale):
  """Chi-square p-value of integer samples against DLap(scale), tails lumped (expected ≥ 5)."""
  p = math.exp(-1 / scale)
  m = 1
  while N * p ** (m + 1) / (1 + p) >= 5:
    m += 1
  support = np.arange(-m, m + 1)
  probs = (1 - p) / (1 + p) * p ** np.abs(support)
  probs[0] = probs[-1] = p**m / (1 + p)                       # P[Z ≤ −m] = P[Z ≥ m]
  observed = np.bincount(np.clip(z, -m, m) + m, minlength=2 * m + 1)
  return stats.chisquare(observed, probs * z.size).pvalue


def _assert_scale_is_right(z, scale):
  z = np.asarray(z)
  assert _chi2_p(z, scale) > 1e-3
  assert _chi2_p(z, scale * 2 / 3) < 1e-6 and _chi2_p(z, scale * 3 / 2) < 1e-6


@pytest.mark.parametrize("exact", [True, False])
def test_pmf_at_the_right_scale(exact):
  z = M.discrete_laplace(jax.random.key(0), (N,), scale=2.0, exact=exact)
  assert z.shape == (N,) and z.dtype == jnp.int32
  _assert_scale_is_right(z, 2.0)
  p = math.exp(-1 / 2.0)
  assert abs(float(np.var(np.asarray(z, np.float64))) / (2 * p / (1 - p) ** 2) - 1) < 0.1


def test_exact_sampler_uses_the_scale_rounded_up(monkeypatch):
  """The exact sampler runs at ``⌈σ·2^10⌉/2^10 ≥ σ`` (never less noise), read where it can be
  seen: the rational scale handed to the jitted sampler (a χ² test cannot tell 5/3 from its
  rounding, 6·10⁻⁴ apart)."""
  for scale in (0.3, 2.0, 5.0 / 3.0, 1e-6):
    eff = discrete.effective_scale(scale)
    assert scale <= eff <= scale + 2.0**-10 and (eff * 2**10).is_integer()
  seen = []
  real = discrete._exact_jit

  def spy(key, shape, num, den):
    seen.append(Fraction(num, den))
    return real(key, shape, num, den)

  monkeypatch.setattr(discrete, "_exact_jit", spy)
  M.discrete_laplace(jax.random.key(1), (4,), scale=5.0 / 3.0)
  assert seen[-1] == Fraction(1707, 1024) > Fraction(5, 3)          # ⌈(5/3)·1024⌉ = 1707
  M.discrete_laplace(jax.random.key(1), (4,), scale=2.0)
  assert seen[-1] == 2                                               # exact scales stay exact
  M.discrete_laplace_mechanism(jax.random.key(1), jnp.zeros(4, jnp.int32), sensitivity=5,
                               epsilon=3.0)                          # Δ/ε = 5/3 again
  assert seen[-1] == Fraction(1707, 1024)
  assert discrete.effective_scale(5.0 / 3.0) == 1707 / 1024


def test_tail_formula():
  for scale in (0.5, 2.0, 7.0):
    p = math.exp(-1 / scale)
    for z in (1, 3, 10):
      direct = sum((1 - p) / (1 + p) * p**k for k in range(z, z + 2_000))
      assert math.isclose(M.discrete_laplace_tail(z, scale), direct, rel_tol=1e-10)
  assert math.isclose(M.discrete_laplace_tail(3, 2.0), math.exp(-1.5) / (1 + math.exp(-0.5)))


def test_tiny_and_huge_scales():
  for exact in (True, False):
    z = M.discrete_laplace(jax.random.key(2), (1_000,), scale=1e-3, exact=exact)
    assert bool(jnp.all(z == 0))
  z = M.discrete_laplace(jax.random.key(3), (1_000,), scale=1e5, exact=False)   # one shape
  assert z.dtype == jnp.int32 and float(jnp.std(z.astype(jnp.float32))) > 1e4
  with pytest.raises(ValueError, match="scale"):
    M.discrete_laplace(jax.random.key(3), (2,), scale=1e6)
  with pytest.raises(ValueError, match="scale"):
    M.discrete_laplace(jax.random.key(3), (2,), scale=1e7, exact=False)


def test_mechanism_adds_integer_noise_of_scale_sensitivity_over_epsilon():
  value = jnp.full((N,), 7, jnp.int32)
  out = M.discrete_laplace_mechanism(jax.random.key(4), value, sensitivity=2, epsilon=1.0)
  assert out.dtype == jnp.int32 and out.shape == value.shape
  _assert_scale_is_right(out - value, 2.0)
  out = M.discrete_laplace_mechanism(jax.random.key(4), np.arange(6, dtype=np.int64).reshape(2, 3),
                                     sensitivity=1, epsilon=1.0)
  assert out.dtype == jnp.int32 and out.shape == (2, 3)


def test_key_hygiene_and_jit():
  draw = jax.jit(lambda k: M.discrete_laplace(k, (64,), scale=3.0))
  a = draw(jax.random.key(5))
  assert jnp.array_equal(a, draw(jax.random.key(5)))
  assert not jnp.array_equal(a, draw(jax.random.key(6)))
  assert jnp.array_equal(a, M.discrete_laplace(jax.random.key(5), (64,), scale=3.0))


KEY = jax.random.key(0)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: M.discrete_laplace(KEY, (3,), scale=0.0), ValueError, "scale"),
    (lambda: M.discrete_laplace(KEY, (3,), scale=float("nan")), ValueError, "scale"),
    (lambda: M.discrete_laplace(KEY, (-3,), scale=1.0), ValueError, "shape"),
    (lambda: M.discrete_laplace(1, (3,), scale=1.0), TypeError, "key"),
    (lambda: M.discrete_laplace_mechanism(KEY, jnp.ones(3), sensitivity=1, epsilon=1.0),
     TypeError, "value"),
    (lambda: M.discrete_laplace_mechanism(KEY, jnp.ones(3, jnp.int32), sensitivity=1.5,
                                          epsilon=1.0), TypeError, "sensitivity"),
    (lambda: M.discrete_laplace_mechanism(KEY, jnp.ones(3, jnp.int32), sensitivity=0,
                                          epsilon=1.0), ValueError, "sensitivity"),
    (lambda: M.discrete_laplace_mechanism(KEY, jnp.ones(3, jnp.int32), sensitivity=1,
                                          epsilon=0.0), ValueError, "epsilon"),
    (lambda: M.discrete_laplace_mechanism(KEY, jnp.ones(3, jnp.int32), sensitivity=1,
                                          epsilon=1e-6), ValueError, "epsilon"),
    (lambda: M.discrete_laplace_tail(0, 1.0), ValueError, "z"),
    (lambda: M.discrete_laplace_tail(1.5, 1.0), TypeError, "z"),
    (lambda: M.discrete_laplace_tail(1, -1.0), ValueError, "scale"),
])
def test_bad_inputs_raise_naming_the_argument(call, exc, match):
  with pytest.raises(exc, match=match):
    call()
