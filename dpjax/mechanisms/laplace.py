"""The Laplace mechanism (ALGORITHMS.md §1.1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpjax import _validation as v


def laplace_scale(sensitivity: float, epsilon: float) -> float:
  """The noise scale ``b = Δ₁/ε`` (host, float64). Raises ValueError on Δ ≤ 0 or ε ≤ 0."""
  return v.check_positive(sensitivity, "sensitivity") / v.check_epsilon(epsilon)


def laplace_noise(key: jax.Array, shape=(), *, scale: float, dtype=None) -> jax.Array:
  """I.i.d. ``Lap(b)`` samples (density ``e^{−|x|/b}/(2b)``) of the given shape and dtype."""
  v.check_key(key)
  scale = v.check_positive(scale, "scale")
  return scale * jax.random.laplace(key, tuple(shape), dtype or jnp.result_type(float))


def laplace_mechanism(key: jax.Array, value, *, sensitivity: float, epsilon: float,
                      secure: bool = True, bound: float | None = None):
  """Releases ``value + Lap(Δ₁/ε)`` independently in every coordinate.

  Guarantee: ε-DP under the caller's neighbouring relation when ``value`` has ℓ1-sensitivity
  ``sensitivity`` under it: the density ratio at any output is ``≤ exp(ε ‖f(X) − f(X')‖₁/Δ₁)``.

  Floating point (ALGORITHMS.md §1.10): with ``secure=True`` (default, for released statistics)
  the release goes through Mironov's snapping mechanism (:mod:`dpjax.mechanisms.snapping`):
  host-side float64, clamped to ``[−bound, bound]``, output on a public power-of-two grid, ε-DP
  including the floating-point effects. ``secure=False`` adds raw ``jax.random.laplace`` noise in
  the value's dtype (jittable, e.g. inside training loops) and is open to Mironov's attack.

  Args:
    key: PRNG key.
    value: float array (any shape).
    sensitivity: ℓ1-sensitivity Δ₁ > 0 (per coordinate for ``secure=True``).
    epsilon: ε > 0.
    secure: snap (default) or add raw float noise.
    bound: public clamp for snapping (default ``2^32 λ``).

  Returns:
    float64 NumPy array (``secure=True``) or a JAX array in ``value``'s dtype.

  Raises:
    TypeError: non-float ``value`` or non-key ``key``.
    ValueError: NaN/inf in ``value``, Δ ≤ 0, ε ≤ 0.
  """
  v.check_key(key)
  value = _float_value(value)
  if secure:
    from dpjax.mechanisms.snapping import snapping_mechanism
    return snapping_mechanism(key, value, sensitivity=sensitivity, epsilon=epsilon, bound=bound)
  b = laplace_scale(sensitivity, epsilon)
  return value + b * jax.random.laplace(key, value.shape, value.dtype)


def _float_value(value) -> jax.Array:
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(f"value must be a float array, got dtype={value.dtype}.")
  if not bool(jnp.all(jnp.isfinite(value))):
    raise ValueError("value contains NaN or infinite entries.")
  return value
