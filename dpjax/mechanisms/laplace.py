"""The Laplace mechanism (docs/algorithms.md §1.1)."""

from __future__ import annotations


import jax

from dpjax import _validation as v

__all__ = ["laplace_mechanism", "laplace_noise", "laplace_scale"]


def laplace_scale(sensitivity: float, epsilon: float) -> float:
  """The Laplace noise scale ``b = Δ₁/ε`` that makes a release ε-DP (host, float64).

  Args:
    sensitivity: ℓ1-sensitivity ``Δ₁ > 0`` of the statistic under the neighboring relation.
    epsilon: privacy parameter ``ε > 0`` (nats).

  Returns:
    ``b`` as a Python float.

  Raises:
    ValueError: ``sensitivity`` or ``epsilon`` is not a finite number > 0 (NaN included).
    TypeError: either is not a real scalar.

  References:
    docs/algorithms.md §1.1; Dwork & Roth (2014), Thm 3.6.
  """
  return v.check_positive(sensitivity, "sensitivity") / v.check_epsilon(epsilon)


def laplace_noise(key: jax.Array, shape=(), *, scale: float, dtype=None) -> jax.Array:
  """I.i.d. ``Lap(b)`` samples, density ``e^{−|x|/b}/(2b)``.

  On its own this is just a sampler; the privacy guarantee comes from calibrating ``scale`` with
  :func:`laplace_scale` and adding the noise to a statistic (see :func:`laplace_mechanism`).

  Args:
    key: JAX PRNG key (consumed; split before reusing).
    shape: output shape, a tuple of non-negative ints.
    scale: ``b > 0``.
    dtype: float dtype (default: JAX's default float, float32 unless x64 is enabled).

  Returns:
    Array of ``shape`` and ``dtype``.

  Raises:
    TypeError: ``key`` is not a PRNG key, ``shape`` is not a tuple of ints, ``dtype`` is not a
      float dtype.
    ValueError: ``scale`` is not a finite number > 0, or ``shape`` has a negative entry.

  References:
    Dwork, McSherry, Nissim & Smith, "Calibrating noise to sensitivity in private data
    analysis", TCC 2006; Mironov, "On significance of the least significant bits for
    differential privacy", CCS 2012 (floating point); docs/algorithms.md §1.1, §1.10.
  """
  v.check_key(key)
  shape = v.check_shape(shape)
  scale = v.check_positive(scale, "scale")
  dtype = v.check_float_dtype(dtype)
  return (scale * jax.random.laplace(key, shape, dtype)).astype(dtype)


def laplace_mechanism(key: jax.Array, value, *, sensitivity: float, epsilon: float,
                      secure: bool = True, bound: float | None = None):
  """Releases ``value + Lap(Δ₁/ε)``, independent noise in every coordinate.

  Guarantee: ε-DP under whatever neighboring relation the caller uses, provided ``value`` has
  ℓ1-sensitivity ``sensitivity`` under it: the output density ratio between neighbours is
  ``exp(ε ‖f(X) − f(X')‖₁/Δ₁) ≤ e^ε`` (docs/algorithms.md §1.1).

  Floating point (docs/algorithms.md §1.10 rule 2): with ``secure=True`` (default, for released
  statistics) the release goes through Mironov's snapping mechanism
  (:mod:`dpjax.mechanisms.snapping`): host-side float64, clamped to ``[−bound, bound]``, output on
  a public power-of-two grid, ε-DP including the floating-point effects for one coordinate (a
  vector of ℓ1-sensitivity Δ₁ pays the floating-point slack per coordinate:
  ``(ε + (D − 1)·2^{-17})``-DP for D coordinates at the default bound;
  :func:`dpjax.mechanisms.snapping_l1_mechanism` calibrates a vector to exactly ε).
  ``secure=False`` adds raw ``jax.random.laplace`` noise in the value's dtype (jittable, e.g.
  inside training loops); that is ε-DP in real arithmetic only and open to Mironov's attack on
  floating-point Laplace noise.

  Args:
    key: JAX PRNG key.
    value: float array of any shape, the exact statistic ``f(X)``.
    sensitivity: ℓ1-sensitivity ``Δ₁ > 0``.
    epsilon: ``ε > 0``.
    secure: snap (default) or add raw floating-point noise.
    bound: public clamp for snapping (default ``2^32 λ``); ignored when ``secure=False``.

  Returns:
    ``secure=True``: as :func:`dpjax.mechanisms.snapping_mechanism` (eagerly a float64
    ``np.ndarray`` shaped like ``value``). ``secure=False``: a JAX array with ``value``'s shape
    and dtype. NaN/inf entries of ``value`` are replaced by 0 before the noise (a fixed map, not
    a data-dependent error). Traceable either way.

  Raises:
    TypeError: ``value`` is not a float array, ``key`` is not a PRNG key.
    ValueError: ``sensitivity`` or ``epsilon`` not finite and > 0.

  References:
    docs/algorithms.md §1.1, §1.10; Mironov (2012), "On significance of the least significant bits
    for differential privacy".
  """
  v.check_key(key)
  if secure:
    from dpjax.mechanisms.snapping import snapping_mechanism
    return snapping_mechanism(key, value, sensitivity=sensitivity, epsilon=epsilon, bound=bound)
  value = v.sanitise_value(value)
  b = laplace_scale(sensitivity, epsilon)
  return value + (b * jax.random.laplace(key, value.shape, value.dtype)).astype(value.dtype)
