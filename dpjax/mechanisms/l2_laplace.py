"""The ℓ2-Laplace mechanism ("vector Laplace", [CMS11] Algorithm 1; docs/algorithms.md §5.1).

Noise ``b ∈ ℝ^d`` with density ``∝ exp(−β‖b‖₂)``. In polar coordinates the density factors into
a uniform direction on the sphere and a norm ``r`` with density ``∝ r^{d−1} e^{−βr}``, i.e.
``r ~ Gamma(shape d, scale 1/β)``; the sampler draws exactly that (a normalised Gaussian for the
direction). Adding it to a statistic of ℓ2-sensitivity Δ₂ with ``β = ε/Δ₂`` is ε-DP: for
neighboring values the output densities differ by the factor
``exp(β(‖y − f'‖ − ‖y − f‖)) ≤ exp(β‖f − f'‖) ≤ e^ε`` (triangle inequality).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import _validation as v
from dpjax._core.noise import l2_laplace_sample
from dpjax._host import host_call

__all__ = ["l2_laplace_beta", "l2_laplace_mechanism", "l2_laplace_noise"]


def l2_laplace_beta(sensitivity: float, epsilon: float) -> float:
  """The rate ``β = ε/Δ₂`` that makes ℓ2-Laplace noise ε-DP for ℓ2-sensitivity Δ₂ (host).

  Raises:
    ValueError: ``sensitivity`` or ``epsilon`` not a finite number > 0, or β overflows.
    TypeError: a non-real argument.
  """
  sensitivity = v.check_positive(sensitivity, "sensitivity")
  beta = v.check_epsilon(epsilon) / sensitivity
  if not np.isfinite(beta):
    raise ValueError(f"epsilon/sensitivity overflows float64 (sensitivity={sensitivity!r}).")
  return beta


def l2_laplace_noise(key: jax.Array, d: int, beta, dtype=None) -> jax.Array:
  """A ``(d,)`` vector with density ``∝ exp(−β‖b‖₂)`` (a sampler; see the module docstring).

  ``b = r·u``: ``u = g/‖g‖`` with ``g ~ N(0, I_d)`` (uniform on the sphere) and
  ``r ~ Gamma(d, 1)/β``, drawn as ``(E_1 + … + E_d)/β`` with ``E_i ~ Exp(1)`` i.i.d. (the
  integer-shape Gamma is exactly the sum of d exponentials; no rejection loop, which keeps the
  compiled program small), so ``E‖b‖ = d/β``. On its own this is just a
  sampler; the guarantee comes from ``β = ε/Δ₂`` (:func:`l2_laplace_mechanism`).

  Args:
    key: JAX PRNG key (consumed: split it before reusing).
    d: dimension, a Python int ≥ 1 (static).
    beta: rate β > 0; a Python float (validated) or a traced scalar (not validated).
    dtype: float dtype (default: JAX's default float, float32 unless x64 is enabled).

  Returns:
    ``(d,)`` array of ``dtype``. Traceable: ``jit`` and ``vmap`` over keys (and over a traced β).

  Raises:
    TypeError: ``key`` not a PRNG key, ``d`` not an int, ``dtype`` not a float dtype.
    ValueError: ``d < 1``; a concrete β not finite and > 0.

  References:
    [CMS11] Chaudhuri, Monteleoni & Sarwate, "Differentially private empirical risk
    minimization", JMLR 12 (2011), Algorithm 1 and its sampling remark; docs/algorithms.md §5.1.
  """
  v.check_key(key)
  d = v.check_int(d, "d", low=1)
  if not v.is_traced(beta):
    beta = v.check_positive(beta, "beta")
  dtype = v.check_float_dtype(dtype)
  return l2_laplace_sample(key, jnp.asarray(beta, dtype), d=d, dtype=dtype)


def l2_laplace_mechanism(key: jax.Array, value, *, sensitivity: float, epsilon: float):
  """Releases ``value + b``, ``b`` ℓ2-Laplace with ``β = ε/Δ₂`` over all entries of ``value``.

  Usage::

      theta = dpjax.mechanisms.l2_laplace_mechanism(key, theta_hat, sensitivity=2 / (n * lam),
                                                    epsilon=1.0)      # float64 NumPy, eagerly

  Guarantee: (ε, 0)-DP for a statistic whose ℓ2-sensitivity (over all its entries, flattened)
  is ``sensitivity`` under the caller's neighboring relation — whatever relation that
  sensitivity is stated under (replace-one for the ERM minimisers of
  :mod:`dpjax.classic.erm`): the output density ratio between neighbours is at most
  ``exp(β·Δ₂) = e^ε`` (module docstring; docs/algorithms.md §5.1).

  Floating point: NOT float-safe. The release is computed and rounded in float64, so the set of
  floats ``f(X) + b`` can take depends on ``f(X)`` (Mironov 2012) and an observer of the exact
  output bits may learn more than ε allows: the guarantee holds in real arithmetic only, and
  rounding the output to a coarse public grid blunts the leak but does not provably remove it.
  For a float-safe release (up to a sampler approximation) use the default ``release="grid"``
  of :func:`dpjax.classic.output_perturbation` (lattice output; docs/algorithms.md §5.1), or
  per coordinate :func:`dpjax.mechanisms.snapping_l1_mechanism` and the discretised samplers
  of §1.10.

  Numerics: the noise is sampled and added in float64 on the host (NumPy). NaN/inf entries of
  ``value`` are replaced by 0 first (a fixed map: raising would branch on private data).

  Args:
    key: JAX PRNG key.
    value: float array of any shape with at least one entry (the exact statistic).
    sensitivity: ℓ2-sensitivity ``Δ₂ > 0``.
    epsilon: ``ε > 0``.

  Returns:
    Eagerly: a float64 NumPy array shaped like ``value`` (sampled on the host in NumPy,
    :func:`l2_laplace_host_noise`). Traceable in ``key`` and ``value``: under ``jit`` / ``vmap``
    the same host computation runs as a ``jax.pure_callback`` (the same output per key, returned
    in JAX's default float dtype: post-processing).

  Raises:
    TypeError: ``key`` not a PRNG key, ``value`` not a float array.
    ValueError: ``value`` empty; ``sensitivity`` or ``epsilon`` not finite and > 0.

  References:
    [CMS11] Algorithm 1 (output perturbation); Mironov, "On significance of the least
    significant bits for differential privacy", CCS 2012; docs/algorithms.md §5.1, §1.10.
  """
  v.check_key(key)
  value = v.check_float_array(value)
  if value.size == 0:
    raise ValueError("value must have at least one entry, got shape "
                     f"{tuple(value.shape)}.")
  beta = l2_laplace_beta(sensitivity, epsilon)
  shape, size = tuple(value.shape), int(value.size)

  def release(rng, value):
    value = v.sanitise_host_value(np.asarray(value, np.float64))
    return value + l2_laplace_host_noise(rng, size, beta).reshape(shape)

  return host_call(release, jax.ShapeDtypeStruct(shape, np.float64), key, value)


def l2_laplace_host_noise(rng: np.random.Generator, d: int, beta: float) -> np.ndarray:
  """:func:`l2_laplace_noise`'s law on the host in float64 (plain NumPy, callable inside a host
  callback): a uniform direction (a normalised Gaussian) times a ``Gamma(d, 1/β)`` norm."""
  g = rng.standard_normal(d)
  # ‖g‖ = 0 has probability 0 (it would need d exact zeros); the guard only avoids 0/0.
  u = g / max(float(np.sqrt(g @ g)), np.finfo(np.float64).tiny)
  return (rng.standard_gamma(d) / beta) * u
