"""Discrete (integer) noise: Laplace and Gaussian (docs/algorithms.md §1.4, §1.10).

Counts and integer scores get integer noise (§1.10 rule 1): an integer-valued statistic plus an
integer sample has a support that does not depend on the statistic's value, so the
floating-point attacks on real-valued noise do not apply. The discrete Laplace sampler is a
jittable JAX state machine (:mod:`dpjax.mechanisms.exact`); the discrete Gaussian sampler runs on
the host in vectorised NumPy, settling the rare coin a float64 estimate cannot decide with exact
Python rationals (its acceptance step needs numbers far beyond 64 bits).
"""

from __future__ import annotations

import functools
import math
import random
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import _validation as v
from dpjax._host import host_call, python_random
from dpjax.mechanisms import exact as exact_lib

__all__ = ["discrete_gaussian", "discrete_laplace", "discrete_laplace_mechanism",
           "truncated_discrete_laplace"]

# The exact sampler needs num = ⌈scale·2^10⌉ ≤ 2^25 (its uint32 arithmetic); the geometric one
# keeps |Z| < 2^31 except with probability e^{−2^11}.
MAX_EXACT_SCALE = 2.0**15
MAX_FAST_SCALE = 2.0**20


def effective_scale(scale: float) -> float:
  """The scale the exact sampler really uses: ``scale`` rounded UP to a multiple of 2^-10.

  Rounding up only adds noise, so an ε-DP calibration stays ε-DP; tail probabilities (e.g. a
  histogram threshold) must be computed at this scale (:func:`discrete_laplace_tail` of it).
  """
  num, den = exact_lib.rational_scale(scale)
  return num / den


def discrete_laplace(key: jax.Array, shape=(), *, scale: float, exact: bool = True) -> jax.Array:
  """Samples ``DLap(σ)``: ``P(Z = z) = (1−p)/(1+p) · p^{|z|}`` on ℤ, ``p = e^{−1/σ}``.

  Mean 0, variance ``2p/(1−p)²``. ``exact=True`` (default): the Canonne–Kamath–Steinke sampler
  with integer arithmetic only (:mod:`dpjax.mechanisms.exact`), at ``σ`` rounded UP to a
  multiple of 2^-10 (:func:`effective_scale`; never less noise). ``exact=False``: the difference
  ``G₁ − G₂`` of two geometric variables on {0, 1, …} with ``P(G = g) = (1−p)p^g``, drawn by
  inverse CDF with floating-point logarithms (``G = ⌊−σ ln U⌋``) — faster, exactly at ``σ``, but
  its probabilities are only approximately right (float rounding; tail cut near ``17σ`` in
  float32).

  A sampler; the ε-DP guarantee comes from :func:`discrete_laplace_mechanism`.

  Args:
    key: JAX PRNG key.
    shape: output shape, a tuple of non-negative ints.
    scale: ``σ > 0``; an integer statistic of ℓ1-sensitivity Δ uses ``σ = Δ/ε``. At most
      ``2^15`` for the exact sampler and ``2^20`` for the fast one (tiny scales are fine:
      ``p`` underflows to 0 and every draw is 0).
    exact: exact integer sampler (default) or the floating-point geometric difference.

  Returns:
    int32 array of ``shape``.

  Raises:
    TypeError: non-key ``key`` or bad ``shape``.
    ValueError: ``scale`` not finite and > 0, or above the sampler's limit.

  References:
    docs/algorithms.md §1.4; Inusah & Kozubowski (2006); Canonne, Kamath & Steinke, "The discrete
    Gaussian for differential privacy", NeurIPS 2020, Algorithms 1–2; He, Vershynin & Zhu,
    Def. 2.4.
  """
  v.check_key(key)
  shape = v.check_shape(shape)
  scale = _check_scale(scale, exact)
  return _discrete_laplace(key, shape, scale, exact)


def _check_scale(scale, exact: bool) -> float:
  scale = v.check_positive(scale, "scale")
  limit = MAX_EXACT_SCALE if exact else MAX_FAST_SCALE
  if scale > limit:
    raise ValueError(f"scale must be a finite number in (0, {limit:g}] for "
                     f"exact={exact}, got scale={scale!r}.")
  return scale


def _discrete_laplace(key, shape, scale: float, exact: bool = True):
  """Unvalidated, traceable core of :func:`discrete_laplace` (``scale`` a Python float)."""
  if exact:
    num, den = exact_lib.rational_scale(scale)
    return _exact_jit(key, tuple(shape), num, den)
  return _fast_jit(key, tuple(shape), scale)


# Jitted once per (shape, scale): repeated eager calls reuse the compiled sampler (inside an
# outer jit these simply inline).
_exact_jit = jax.jit(exact_lib.exact_discrete_laplace, static_argnums=(1, 2, 3))


@functools.partial(jax.jit, static_argnums=(1,))
def _fast_jit(key, shape, scale):
  """``G₁ − G₂`` with ``G = ⌊−σ ln U⌋``, ``U ∈ (0, 1]``: geometric on {0, 1, …} with
  ``P(G ≥ g) = P(U ≤ p^g) = p^g`` (the law of ``jax.random.geometric(key, 1 − p) − 1``, without
  its NaN as ``p → 0``)."""
  dtype = jnp.result_type(float)
  k1, k2 = jax.random.split(key)
  u1 = 1.0 - jax.random.uniform(k1, shape, dtype)             # (0, 1]
  u2 = 1.0 - jax.random.uniform(k2, shape, dtype)
  g1 = jnp.floor(-scale * jnp.log(u1)).astype(jnp.int32)
  g2 = jnp.floor(-scale * jnp.log(u2)).astype(jnp.int32)
  return (g1 - g2).astype(jnp.int32)


def discrete_laplace_mechanism(key: jax.Array, value, *, sensitivity: int,
                               epsilon: float) -> jax.Array:
  """Releases an integer statistic plus ``DLap(Δ/ε)`` noise (exact sampler), per coordinate.

  Guarantee: ε-DP under any neighboring relation for which the integer statistic ``value`` has
  ℓ1-sensitivity ``sensitivity``: the probabilities of an output under neighbours differ by a
  factor ``p^{−Σ|Δz|} ≤ p^{−Δ} ≤ e^ε`` (docs/algorithms.md §1.4; the scale is rounded up, which only
  lowers the factor). The output is an integer, so no floating-point side channel (§1.10).

  Args:
    key: JAX PRNG key.
    value: integer array of any shape (cast to int32).
    sensitivity: ℓ1-sensitivity Δ, an integer ≥ 1.
    epsilon: ``ε > 0`` with ``Δ/ε ≤ 2^15``.

  Returns:
    int32 array shaped like ``value``.

  Raises:
    TypeError: ``value`` is not an integer array, ``key`` not a key, ``sensitivity`` not an int.
    ValueError: ε not finite and > 0, Δ < 1, or ``Δ/ε`` above the sampler's limit.

  References:
    Inusah & Kozubowski, "A discrete analogue of the Laplace distribution", J. Statist. Plann.
    Inference 2006; Canonne, Kamath & Steinke, "The discrete Gaussian for differential
    privacy", NeurIPS 2020 (exact sampler, [CKS20]); docs/algorithms.md §1.4.
  """
  v.check_key(key)
  epsilon = v.check_epsilon(epsilon)
  sensitivity = v.check_int(sensitivity, "sensitivity", low=1)
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.integer):
    raise TypeError(f"value must be an integer array, got dtype={value.dtype}.")
  scale = sensitivity / epsilon
  if scale > MAX_EXACT_SCALE:
    raise ValueError(f"epsilon must be at least sensitivity/{MAX_EXACT_SCALE:g} = "
                     f"{sensitivity / MAX_EXACT_SCALE:g}, got epsilon={epsilon!r}.")
  return value.astype(jnp.int32) + _discrete_laplace(key, value.shape, scale)


def discrete_laplace_tail(z: int, scale: float) -> float:
  """``P[Z ≥ z] = p^z/(1 + p)`` for ``Z ~ DLap(scale)``, ``p = e^{−1/scale}``, integer z ≥ 1.

  Host, float64. (For the exact sampler pass :func:`effective_scale` of the nominal scale.)

  Args:
    z: integer ≥ 1.
    scale: ``σ > 0``.

  Returns:
    The tail probability as a Python float.

  Raises:
    TypeError: ``z`` not an integer. ValueError: z < 1, bad ``scale``.

  References:
    Inusah & Kozubowski, "A discrete analogue of the Laplace distribution", J. Statist. Plann.
    Inference 2006; docs/algorithms.md §1.4.
  """
  z = v.check_int(z, "z", low=1)
  scale = v.check_positive(scale, "scale")
  log_p = -1.0 / scale
  return math.exp(z * log_p) / (1.0 + math.exp(log_p))


# --------------------------------------------------------------------------------------------
# Discrete Gaussian (Canonne, Kamath & Steinke 2020), host-side and exact.
# --------------------------------------------------------------------------------------------

MAX_DISCRETE_GAUSSIAN_SIGMA = 2.0**40       # keeps every draw far inside int64 and float64
_SIGMA2_DENOMINATOR = 1 << 10               # σ² is rounded UP to a multiple of 2^-10


def discrete_gaussian_sigma2(sigma: float) -> Fraction:
  """The exact variance parameter the sampler uses: ``σ²`` rounded UP to a multiple of 2^-10.

  Rounding up only adds noise, so a calibration for σ stays valid at the returned value.
  """
  sigma = v.check_positive(sigma, "sigma")
  if sigma > MAX_DISCRETE_GAUSSIAN_SIGMA:
    raise ValueError(f"sigma must be at most 2^40 for the discrete Gaussian sampler, got "
                     f"sigma={sigma!r}.")
  num = math.ceil(Fraction(sigma) ** 2 * _SIGMA2_DENOMINATOR)
  return Fraction(max(num, 1), _SIGMA2_DENOMINATOR)


def _bernoulli_exp_unit(rng: random.Random, num: int, den: int) -> bool:
  """Bernoulli(exp(−num/den)) for ``0 ≤ num ≤ den`` (CKS 2020, Algorithm 1, γ ∈ [0, 1])."""
  k = 1
  while rng.randrange(den * k) < num:       # Bernoulli(γ/k)
    k += 1
  return k % 2 == 1


def _bernoulli_exp(rng: random.Random, num: int, den: int) -> bool:
  """Bernoulli(exp(−num/den)) for any rational ``num/den ≥ 0`` (CKS 2020, Algorithm 1)."""
  while num > den:                           # e^{−γ} = e^{−1}·e^{−(γ−1)}: peel whole units
    if not _bernoulli_exp_unit(rng, 1, 1):
      return False
    num -= den
  return _bernoulli_exp_unit(rng, num, den)


def _discrete_laplace_integer_scale(rng: random.Random, t: int) -> int:
  """``P(y) ∝ exp(−|y|/t)`` on ℤ for an integer scale t ≥ 1 (CKS 2020, Algorithm 2)."""
  while True:
    u = rng.randrange(t)
    if not _bernoulli_exp_unit(rng, u, t):
      continue
    v_ = 0
    while _bernoulli_exp_unit(rng, 1, 1):
      v_ += 1
    x = u + t * v_
    negative = rng.randrange(2) == 1
    if negative and x == 0:
      continue
    return -x if negative else x


def discrete_gaussian(key: jax.Array, shape=(), *, sigma: float) -> np.ndarray:
  """Exact samples of the discrete Gaussian ``N_ℤ(0, σ²)``: ``P(Z = z) ∝ exp(−z²/(2σ²))`` on ℤ.

  Canonne, Kamath & Steinke's sampler (2020, Algorithms 1–3), vectorised over the draws: a
  discrete Laplace proposal of integer scale ``⌊σ⌋ + 1`` drawn with exact integer coins,
  accepted by an exact Bernoulli(exp(−γ)) for rational γ whose coins compare 53-bit uniforms
  with a float64 estimate of their probability, and settle with exact rationals the few
  (about one in 2^29) that the estimate's proved error bound leaves open. The distribution is
  exactly the discrete Gaussian at ``σ²`` rounded up to a multiple of 2^-10
  (:func:`discrete_gaussian_sigma2`), conditioned on ``|Z| < 2^52`` (for σ ≤ 2^40 a change of
  probability below e^-2^20; docs/algorithms.md §1.10). Host-side, about 1 µs per draw (8 s
  for the 7.9M entries of a 3,969-dimensional second moment); meant for released statistics,
  not for the inside of training loops. Randomness: a NumPy generator seeded by ``key``'s data
  (:func:`dpjax._host.host_rng`), so results are deterministic per key.

  A sampler; the privacy guarantee comes from :func:`dpjax.mechanisms.gaussian_mechanism`
  (``secure=True``), which adds it to a statistic rounded to a public grid.

  Args:
    key: JAX PRNG key.
    shape: output shape, a tuple of non-negative ints.
    sigma: ``σ > 0``, at most 2^40.

  Returns:
    Eagerly: an int64 NumPy array of ``shape``. Traced (``jit`` / ``vmap``; run as a
    ``jax.pure_callback`` with the same draws per key): JAX's default int dtype, saturated at
    its range (int32 without x64: reached with probability below e^-2000 for σ ≤ 2^20).

  Raises:
    TypeError: non-key ``key`` or bad ``shape``.
    ValueError: ``sigma`` not finite, ≤ 0 or above 2^40.

  References:
    Canonne, Kamath & Steinke, "The discrete Gaussian for differential privacy", NeurIPS 2020,
    Algorithms 1–3 and Thm 4 (its Rényi divergence is at most that of the continuous Gaussian).
  """
  v.check_key(key)
  shape = v.check_shape(shape)
  discrete_gaussian_sigma2(sigma)
  return host_call(lambda rng: discrete_gaussian_host(rng, shape, sigma),
                   jax.ShapeDtypeStruct(shape, np.int64), key)


def discrete_gaussian_host(rng: np.random.Generator, shape, sigma: float) -> np.ndarray:
  """:func:`discrete_gaussian` on the host (plain NumPy/Python, callable inside a host callback),
  unvalidated (``sigma`` checked by the caller); randomness from the NumPy generator ``rng``."""
  sigma2 = discrete_gaussian_sigma2(sigma)
  size = math.prod(shape)
  return _DiscreteGaussianSampler(rng, sigma2.numerator, sigma2.denominator).draw(size) \
      .reshape(shape)


# The vectorised sampler (docs/algorithms.md §1.10, "exact discrete Gaussian sampler"): CKS
# Algorithms 1–3 run on whole arrays of candidates. Every coin of the discrete Laplace proposal is
# an exact NumPy integer draw; each coin of the acceptance test compares a 53-bit uniform with a
# float64 estimate of its probability, and a comparison the estimate cannot settle (within
# _MARGIN·(1 + γ) of it, about 2^-29 of them) is settled with exact rationals.
_UNIFORM_BITS = 53
_MARGIN = 2.0**-30            # ≥ 2^20 × the proved float error of γ (docs/algorithms.md §1.10)
_MAX_PROPOSAL = 2**52         # |y| below it: exact in float64 (conditioning costs < e^{-2^23})
_MAX_FLOAT_GAMMA = 2.0**28    # above it the float split of γ is not trusted: exact rationals


class _DiscreteGaussianSampler:
  """Exact ``N_ℤ(0, num/den)`` draws, vectorised (CKS 2020, Algorithm 3 on arrays)."""

  def __init__(self, rng: np.random.Generator, num: int, den: int):
    self.rng, self.num, self.den = rng, num, den
    self.t = math.isqrt(num // den) + 1                # proposal scale ⌊σ⌋ + 1 (t² > σ²)
    self.sigma2 = num / den                            # correctly rounded (int true division)
    self._python = None                                # exact fallback's Python generator

  def python(self) -> random.Random:
    if self._python is None:
      self._python = python_random(self.rng)
    return self._python

  def draw(self, size: int) -> np.ndarray:
    out = np.empty(size, np.int64)
    pending = np.arange(size)
    while pending.size:
      y = self._laplace(pending.size)
      keep = self._accept(np.abs(y))
      out[pending[keep]] = y[keep]
      pending = pending[~keep]
    return out

  # --- proposal: discrete Laplace of integer scale t (Algorithm 2), integer coins only ---------

  def _laplace(self, size: int) -> np.ndarray:
    rng, t = self.rng, self.t
    out = np.empty(size, np.int64)
    pending = np.arange(size)
    while pending.size:
      m = pending.size
      u = rng.integers(0, t, size=m)
      ok = _bernoulli_exp_unit_integer(rng, u, t)     # Bernoulli(exp(−u/t))
      v = np.zeros(m, np.int64)
      v[ok] = _geometric_exp1(rng, int(ok.sum()))     # P(v ≥ j) = e^{−j}
      ok &= v < (_MAX_PROPOSAL - t) // t              # u + t v < 2^52: see _MAX_PROPOSAL
      x = u + t * np.where(ok, v, 0)
      negative = rng.integers(0, 2, size=m) == 1
      ok &= ~(negative & (x == 0))
      out[pending[ok]] = np.where(negative, -x, x)[ok]
      pending = pending[~ok]
    return out

  # --- acceptance: Bernoulli(exp(−γ)), γ = (x − σ²/t)²/(2σ²) ----------------------------------

  def _gamma_exact(self, x: int) -> Fraction:
    a = x * self.t * self.den - self.num
    return Fraction(a * a, 2 * self.num * self.den * self.t * self.t)

  def _accept(self, x: np.ndarray) -> np.ndarray:
    """``Bernoulli(exp(−γ(x)))`` per entry: ``[G ≥ m] ∧ Bernoulli(e^{−r/2})²`` for an integer
    ``m ≤ γ`` (G geometric, ``P(G ≥ m) = e^{−m}``) and ``r = γ − m ∈ [0, 2]``."""
    rng = self.rng
    xf = x.astype(np.float64)                          # exact: x < 2^52
    diff = xf - self.sigma2 / self.t
    gamma = diff * diff / (2.0 * self.sigma2)
    margin = _MARGIN * (1.0 + gamma)                   # |γ_float − γ| < margin / 2^20
    whole = np.floor(np.maximum(gamma - 0.5 - margin, 0.0))
    rest = gamma - whole                               # r ≤ 1.5 + 2 margin ≤ 2 below 2^28
    g = _geometric_exp1(rng, x.size)
    out = g >= whole
    exact = out & (gamma > _MAX_FLOAT_GAMMA)
    for i in np.flatnonzero(exact):                    # probability < e^{−2^27}: exact rationals
      r = self._gamma_exact(int(x[i])) - int(whole[i])
      out[i] = _bernoulli_exp(self.python(), r.numerator, r.denominator)
    for _ in range(2):                                 # e^{−r} = (e^{−r/2})²
      live = np.flatnonzero(out & ~exact)
      out[live] = self._unit(x[live], whole[live], rest[live] / 2.0, margin[live])
    return out

  def _unit(self, x, whole, half, margin) -> np.ndarray:
    """Bernoulli(exp(−ρ)) per entry, ``ρ = (γ(x) − whole)/2 ∈ [0, 1]`` known to ±``margin``
    (CKS Algorithm 1: the least K with a failed Bernoulli(ρ/K) coin; accept iff K is odd)."""
    rng = self.rng
    out = np.empty(x.size, bool)
    active = np.arange(x.size)
    k = 1
    while active.size:
      u = rng.integers(0, 1 << _UNIFORM_BITS, size=active.size)
      low = u * 2.0**-_UNIFORM_BITS                    # exact: the coin's uniform lies in
      high = (u + 1) * 2.0**-_UNIFORM_BITS             # [low, high)
      p = half[active] / k
      hit = high <= p - margin[active]                 # surely below ρ/K
      unsure = ~hit & (low < p + margin[active])
      for j in np.flatnonzero(unsure):
        i = active[j]
        rho = (self._gamma_exact(int(x[i])) - int(whole[i])) / 2
        hit[j] = _uniform_below(self.python(), int(u[j]), rho / k)
      out[active[~hit]] = k % 2 == 1
      active = active[hit]
      k += 1
    return out


def _uniform_below(rng: random.Random, prefix: int, p: Fraction) -> bool:
  """Whether ``U < p`` for ``U`` uniform on ``[prefix, prefix + 1)·2^-53`` (its remaining bits
  drawn here): ``P = p·2^53``; sure when ``P ≥ prefix + 1`` or ``P ≤ prefix``, else a Bernoulli of
  the fractional part."""
  scaled = p * (1 << _UNIFORM_BITS) - prefix
  if scaled >= 1:
    return True
  if scaled <= 0:
    return False
  return rng.randrange(scaled.denominator) < scaled.numerator


def _bernoulli_exp_unit_integer(rng: np.random.Generator, num: np.ndarray, den: int) -> np.ndarray:
  """Bernoulli(exp(−num/den)) per entry for integers ``0 ≤ num ≤ den`` (CKS Algorithm 1), with
  exact integer coins: Bernoulli(num/(den·K)) = [uniform{0..K−1} = 0] ∧ [uniform{0..den−1} <
  num] (no product that could overflow)."""
  out = np.empty(num.shape, bool)
  active = np.arange(num.size)
  k = 1
  while active.size:
    hit = rng.integers(0, den, size=active.size) < num[active]
    if k > 1:
      hit &= rng.integers(0, k, size=active.size) == 0
    out[active[~hit]] = k % 2 == 1
    active = active[hit]
    k += 1
  return out


def _geometric_exp1(rng: np.random.Generator, size: int) -> np.ndarray:
  """Successes before the first failure of Bernoulli(e^{-1}) coins: ``P(G ≥ j) = e^{−j}``."""
  g = np.zeros(size, np.int64)
  active = np.arange(size)
  ones = np.ones(size, np.int64)
  while active.size:
    success = _bernoulli_exp_unit_integer(rng, ones[:active.size], 1)
    active = active[success]
    g[active] += 1
  return g


def truncated_discrete_laplace(key: jax.Array, shape=(), *, scale: int, bound: int) -> np.ndarray:
  """Exact samples of ``P(Z = z) ∝ exp(−|z|/t)`` on ``{−K, …, K}`` for an integer scale t.

  Canonne–Kamath–Steinke's discrete Laplace (Algorithm 2) with Python integers, and rejection of
  draws outside ``[−K, K]``; host-side, deterministic per key. For the float-safe truncated
  Laplace mechanism (:func:`dpjax.mechanisms.truncated_laplace_mechanism`), whose scale can exceed
  the jittable sampler's range.

  Args:
    key: JAX PRNG key.
    shape: output shape.
    scale: t, an integer ≥ 1.
    bound: K, an integer ≥ 0.

  Returns:
    Eagerly: an int64 NumPy array of ``shape``; traced (a ``jax.pure_callback``, the same draws
    per key): JAX's default int dtype, saturated at its range.

  Raises:
    TypeError: non-key ``key``, bad ``shape``, non-integer ``scale`` / ``bound``.
    ValueError: ``scale < 1`` or ``bound < 0``.
  """
  v.check_key(key)
  shape = v.check_shape(shape)
  t = v.check_int(scale, "scale", low=1)
  K = v.check_int(bound, "bound", low=0)
  return host_call(lambda rng: truncated_discrete_laplace_host(rng, shape, t, K),
                   jax.ShapeDtypeStruct(shape, np.int64), key)


def truncated_discrete_laplace_host(rng: np.random.Generator, shape, t: int, K: int) -> np.ndarray:
  """:func:`truncated_discrete_laplace` on the host (plain NumPy/Python), unvalidated;
  randomness from the NumPy generator ``rng``."""
  rng = python_random(rng)

  def one():
    while True:
      z = _discrete_laplace_integer_scale(rng, t)
      if abs(z) <= K:
        return z

  size = math.prod(shape)
  return np.fromiter((one() for _ in range(size)), np.int64, count=size).reshape(shape)
