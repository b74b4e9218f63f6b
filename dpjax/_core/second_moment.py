"""The clipped unit second moment ``S = Σ u uᵀ`` and its noisy top-k eigenvector releases.

Shared by Analyze Gauss (:func:`dpjax.subspace.analyze_gauss`, ℓ2-sensitivity Δ = 2 under
replace-one) and MOD-SuLQ (:func:`dpjax.classic.mod_sulq`, Δ = √2 for rows in the unit ball):
both release the upper triangle (diagonal included) of S with Gaussian noise and keep the top-k
eigenvectors, either with continuous noise in JAX (:func:`noisy_top_k`) or float-safely with the
discretized Gaussian on the host (:func:`secure_top_k`). Nothing here validates its arguments:
the public callers do, before tracing.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import linalg
from dpjax._host import host_call
from dpjax.mechanisms import discrete
from dpjax.mechanisms.gaussian import discretized_gaussian_host
from dpjax.mechanisms.grid import discretization


def unit_clip(X, clip_mantissa, clip_exponent):
  """Rows ``x ↦ x / max(C, ‖x‖)`` with ``C = clip_mantissa·2^clip_exponent``, overflow-safe.

  Row-wise (a function of each row and the public C only, so clipping keeps its sensitivity):
  with ``max_j |x_j| = f·2^e``, ``y = x/2^e`` (exact) has entries below 1 and a norm in
  ``[1/2, √d]``, and ``x / max(C, ‖x‖) = y / max(C/2^e, ‖y‖)``. ``C/2^e`` may round to 0 (row far
  above C: the row is normalised to norm 1) or to inf (row far below C: it contributes 0, which is
  its value to within the dtype's range); ``‖u‖ ≤ 1`` holds in every case.
  """
  _, e = jnp.frexp(jnp.max(jnp.abs(X), axis=1, keepdims=True))     # e = 0 for a zero row
  Y = linalg.times_power_of_two(X, -e)
  norms = jnp.linalg.norm(Y, axis=1, keepdims=True)
  c = linalg.times_power_of_two(jnp.asarray(clip_mantissa, X.dtype), clip_exponent - e)
  return Y / jnp.maximum(jnp.maximum(c, norms), jnp.finfo(X.dtype).tiny)


@jax.jit
def unit_second_moment(X, clip_mantissa, clip_exponent):
  """``Σ u uᵀ`` (``(d, d)`` in X's dtype) of the rows :func:`unit_clip` maps into the unit ball."""
  U = unit_clip(X, clip_mantissa, clip_exponent)
  return linalg.matmul(U.T, U)


def noisy_top_k(key, S, sigma, k):
  """Top-k eigenvectors of ``S + E``, ``E`` symmetric with its upper triangle and diagonal
  i.i.d. ``N(0, σ²)`` (mirrored), in S's dtype: the continuous-noise release of a second moment.
  Traceable."""
  d = S.shape[0]
  noise = jax.random.normal(key, (d, d), S.dtype) * sigma
  E = jnp.triu(noise) + jnp.triu(noise, 1).T
  _, evecs = jnp.linalg.eigh(S + E)
  return evecs[:, ::-1][:, :k]


def secure_top_k(key, A, noise_multiplier: float, k: int, *, sensitivity: float = 2.0):
  """The top-k eigenvectors (eigenvalues descending) of the symmetric ``A (d, d)`` whose upper
  triangle is released by the discretized Gaussian (:func:`secure_noisy_moment`): the float-safe
  release of a second moment. One ``host_call`` of plain NumPy (the release, then ``eigh`` in
  float64): eagerly a float64 NumPy ``(d, k)``; traced (``A`` concrete or not, any x64 mode) a
  pure callback returning JAX's default float dtype. The grid and σ are validated here, before
  any tracing."""
  d = A.shape[0]
  moment_discretization(d, noise_multiplier, sensitivity)     # raises before tracing

  def release(rng, A):
    noisy = secure_noisy_moment(rng, A, noise_multiplier, sensitivity)
    return np.linalg.eigh(noisy)[1][:, ::-1][:, :k]

  return host_call(release, jax.ShapeDtypeStruct((d, k), np.float64), key, A)


def moment_discretization(d, noise_multiplier, sensitivity):
  """``(grid, σ in grid steps)`` of the discretized Gaussian on the ``d(d+1)/2`` entries of an
  upper triangle, exactly as :func:`dpjax.mechanisms.discretized_gaussian_mechanism` computes
  them (default clamp); raises ``ValueError`` for a bad Δ, z or ``σ > 2^40``."""
  grid = discretization(sensitivity, d * (d + 1) // 2)
  sigma = math.nextafter(noise_multiplier * grid.grid_sensitivity, math.inf)
  discrete.discrete_gaussian_sigma2(sigma)
  return grid, sigma


def secure_noisy_moment(rng, A, noise_multiplier, sensitivity: float = 2.0) -> np.ndarray:
  """Host (plain NumPy; ``rng`` a NumPy ``Generator``): the upper triangle of ``A (d, d)``
  released by the discretized Gaussian with ℓ2-sensitivity Δ = ``sensitivity`` (default 2) and
  noise multiplier z (:func:`dpjax.mechanisms.gaussian.discretized_gaussian_host`, the release
  of :func:`dpjax.mechanisms.discretized_gaussian_mechanism`), mirrored into a symmetric
  ``(d, d)`` float64 matrix. NaN/inf entries of ``A`` count as 0. The caller validates (z, Δ)
  first (:func:`secure_top_k` does)."""
  A = np.asarray(A, np.float64)
  d = A.shape[0]
  grid, sigma = moment_discretization(d, noise_multiplier, sensitivity)
  rows, cols = np.triu_indices(d)
  released = discretized_gaussian_host(rng, A[rows, cols], grid=grid, sigma=sigma)
  noisy = np.zeros((d, d))
  noisy[rows, cols] = released
  noisy[cols, rows] = released
  return noisy
