"""Baselines for private subspace learning: Analyze Gauss and non-private PCA (same result type)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import linalg
from dpjax._host import host_call
from dpjax.mechanisms import discrete
from dpjax.mechanisms.gaussian import (analytic_gaussian_sigma, discretized_gaussian_host,
                                       rdp_gaussian_sigma)
from dpjax.mechanisms.grid import discretization
from dpjax.results import SubspaceResult


def analyze_gauss(key: jax.Array, X, *, epsilon: float, delta: float, k: int,
                  clip_norm: float, secure: bool = True) -> SubspaceResult:
  """Analyze Gauss (Dwork, Talwar, Thakurta & Zhang 2014): noisy second moment, top-k eigenvectors.

  Rows are clipped to the public norm C (``x ↦ x·min(1, C/‖x‖)``), ``A = XᵀX`` gets a symmetric
  Gaussian matrix ``E`` (upper triangle and diagonal i.i.d. ``N(0, σ²)``, mirrored), and the answer
  is the top-k eigenvectors of ``A + E``.

  Privacy guarantee: (ε, δ)-DP under replace-one. Replacing one row changes ``A`` by
  ``x xᵀ − x' x'ᵀ``, whose upper triangle has ℓ2 norm ≤ ‖x xᵀ‖_F + ‖x' x'ᵀ‖_F ≤ 2C²; the noise is
  calibrated for that sensitivity. The eigenvectors are post-processing. Noise grows with d: the
  error is ``≈ σ sqrt(d) / (n λ_k)``, which is what the dimension-free DPASE avoids.

  * ``secure=True`` (default): the noisy upper triangle is released with
    :func:`dpjax.mechanisms.discretized_gaussian_mechanism` (exact discrete Gaussian noise on a
    public power-of-two grid, σ from the Rényi calibration,
    :func:`dpjax.mechanisms.rdp_gaussian_sigma`), so the matrix whose eigenvectors are returned
    lies on a public grid whatever the data (docs/algorithms.md §1.10); host-side, about
    ``d(d+1)/2 · 10 µs`` for the noise.
  * ``secure=False``: continuous noise with the analytic (Balle & Wang 2018) σ inside one jitted
    program (5–15% less noise; the floating-point caveat of §1.10 applies to the noisy matrix).

  Numerics (scale safety): the computation runs in units of C². Each row becomes
  ``u = x / max(C, ‖x‖)`` (the clipped row divided by C, so ``‖u‖ ≤ 1``), with ``‖x‖`` computed
  after dividing the row by a power of two of its own largest entry, so no row norm over- or
  underflows; then ``Σ u uᵀ`` (entries ≤ n) gets ``E/C²``, whose std ``σ/C² = σ(ε, δ, Δ=2)`` is the
  analytic σ for sensitivity 2. The eigenvectors of ``(A + E)/C²`` are those of ``A + E``, and
  the scaled mechanism is itself the Gaussian mechanism on ``Σ u uᵀ`` (sensitivity ≤ 2), so the
  guarantee is the same; C² is never formed in X's dtype, so neither a huge/tiny C nor huge/tiny
  rows (float32 rows of 1e±25, float64 rows of 1e±200) overflow or underflow.

  Edge cases: rows much smaller than C contribute ≈ 0 (the noise dominates, as it should); a row
  of norm 0 contributes 0; 16-bit float input is upcast to float32 (``check_data``); NaN/inf in
  ``X`` raise before anything runs.

  Args:
    key: PRNG key.
    X: ``(n, d)`` float data; runs in X's dtype (16-bit floats are upcast to float32).
    epsilon, delta: the budget.
    k: subspace dimension, ``1 <= k <= d``.
    clip_norm: public row-norm bound C > 0 (rows above it are scaled down).
    secure: float-safe discretized noise (default) or raw continuous noise.

  Returns:
    :class:`~dpjax.results.SubspaceResult` (always ``ok``; neighbouring ``REPLACE_ONE``), basis
    ``(d, k)`` in X's dtype; ``info["sigma"]`` is the noise std in X's units
    (``σ = info["unit_sigma"]·C²``, computed on the host in float64: ``inf`` if C² overflows
    float64, which the computation never forms), ``info["unit_sigma"]`` the std in units of C²,
    ``info["secure"]``, and with ``secure=True`` ``info["grid"]`` (in units of C²). Traceable in
    ``key`` and ``X`` in every x64 mode (the second moment in X's dtype in JAX; the secure
    release and its eigendecomposition in NumPy on the host, as a ``jax.pure_callback`` under
    tracing).

  Raises:
    TypeError: bad key, or X not a real array.
    ValueError: NaN/inf in a concrete X, wrong rank, bad ε, δ, k, or ``clip_norm`` not finite
      and > 0.
  """
  key = v.check_key(key)
  X = v.check_data(X, "X")
  n, d = X.shape
  k = v.check_int(k, "k", low=1, high=d)
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  clip_norm = v.check_positive(clip_norm, "clip_norm")
  # σ scales linearly with the sensitivity 2C², so in units of C² the std is σ(ε, δ, 2).
  info = {"clip_norm": clip_norm, "secure": bool(secure)}
  mantissa, exponent = math.frexp(float(clip_norm))
  if secure:
    basis, grid, unit_sigma = _secure_basis(key, X, k, mantissa, exponent, epsilon, delta)
    info["grid"] = grid
  else:
    unit_sigma = analytic_gaussian_sigma(epsilon, delta, sensitivity=2.0)
    basis = _analyze_gauss_core(key, X, k, mantissa, exponent, unit_sigma)
  sigma = unit_sigma * clip_norm * clip_norm            # report only; inf beyond float64's range
  info.update(sigma=sigma, unit_sigma=unit_sigma)
  ok = jnp.asarray(True)
  if v.is_traced(X):                       # a NaN dataset is outside the domain: ⊥
    ok, basis = v.domain_bottom(X, ok, basis)
  return SubspaceResult(ok=ok, basis=basis, epsilon=epsilon, delta=delta,
                        neighbouring=NeighboringRelation.REPLACE_ONE, info=info)


def _secure_basis(key, X, k, clip_mantissa, clip_exponent, epsilon, delta):
  """The top-k eigenvectors of ``Σ u uᵀ`` (units of C², computed in X's dtype) with its upper
  triangle released by the float-safe discretized Gaussian (ℓ2-sensitivity 2), the
  eigendecomposition on the host in float64 (post-processing); returns ``(basis (d, k) in X's
  dtype, grid step, noise std)``."""
  A = _unit_second_moment(X, clip_mantissa, clip_exponent)
  z = rdp_gaussian_sigma(epsilon, delta)
  grid, _ = _moment_discretization(A.shape[0], z, 2.0)
  basis = _secure_top_k(key, A, z, k, sensitivity=2.0)
  return jnp.asarray(basis, X.dtype), grid.grid, z * grid.grid_sensitivity * grid.grid


def _secure_top_k(key, A, noise_multiplier: float, k: int, *, sensitivity: float = 2.0):
  """The top-k eigenvectors (eigenvalues descending) of the symmetric ``A (d, d)`` whose upper
  triangle is released by the discretized Gaussian (:func:`_secure_noisy_moment`): the float-safe
  release of a second moment shared by Analyze Gauss (Δ = 2) and MOD-SuLQ (Δ = √2,
  :mod:`dpjax.classic.pca`). One ``host_call`` of plain NumPy (the release, then ``eigh`` in
  float64): eagerly a float64 NumPy ``(d, k)``; traced (``A`` concrete or not, any x64 mode) a
  pure callback returning JAX's default float dtype. The grid and σ are validated here, before
  any tracing."""
  d = A.shape[0]
  _moment_discretization(d, noise_multiplier, sensitivity)     # raises before tracing

  def release(rng, A):
    noisy = _secure_noisy_moment(rng, A, noise_multiplier, sensitivity)
    return np.linalg.eigh(noisy)[1][:, ::-1][:, :k]

  return host_call(release, jax.ShapeDtypeStruct((d, k), np.float64), key, A)


def _moment_discretization(d, noise_multiplier, sensitivity):
  """``(grid, σ in grid steps)`` of the discretized Gaussian on the ``d(d+1)/2`` entries of an
  upper triangle, exactly as :func:`dpjax.mechanisms.discretized_gaussian_mechanism` computes
  them (default clamp); raises ``ValueError`` for a bad Δ, z or ``σ > 2^40``."""
  grid = discretization(sensitivity, d * (d + 1) // 2)
  sigma = math.nextafter(noise_multiplier * grid.grid_sensitivity, math.inf)
  discrete.discrete_gaussian_sigma2(sigma)
  return grid, sigma


def _secure_noisy_moment(rng, A, noise_multiplier, sensitivity: float = 2.0) -> np.ndarray:
  """Host (plain NumPy; ``rng`` a NumPy ``Generator``): the upper triangle of ``A (d, d)``
  released by the discretized Gaussian with ℓ2-sensitivity Δ = ``sensitivity`` (default 2) and
  noise multiplier z (:func:`dpjax.mechanisms.gaussian.discretized_gaussian_host`, the release
  of :func:`dpjax.mechanisms.discretized_gaussian_mechanism`), mirrored into a symmetric
  ``(d, d)`` float64 matrix. NaN/inf entries of ``A`` count as 0. The caller validates (z, Δ)
  first (:func:`_secure_top_k` does)."""
  A = np.asarray(A, np.float64)
  d = A.shape[0]
  grid, sigma = _moment_discretization(d, noise_multiplier, sensitivity)
  rows, cols = np.triu_indices(d)
  released = discretized_gaussian_host(rng, A[rows, cols], grid=grid, sigma=sigma)
  noisy = np.zeros((d, d))
  noisy[rows, cols] = released
  noisy[cols, rows] = released
  return noisy


@jax.jit
def _unit_second_moment(X, clip_mantissa, clip_exponent):
  U = _unit_clip(X, clip_mantissa, clip_exponent)
  return linalg.matmul(U.T, U)


@functools.partial(jax.jit, static_argnames=("k",))
def _analyze_gauss_core(key, X, k, clip_mantissa, clip_exponent, unit_sigma):
  """Top-k eigenvectors of ``Σ u uᵀ + E'``, ``u = x/max(C, ‖x‖)``, ``E'`` symmetric with
  ``N(0, unit_sigma²)`` entries: Analyze Gauss in units of C² with raw continuous noise. C enters
  as its exact host-side mantissa and exponent (``C = f·2^c``), so a C outside X's dtype range
  (e.g. 1e50 with float32 rows) still clips correctly."""
  U = _unit_clip(X, clip_mantissa, clip_exponent)
  return _noisy_top_k(key, linalg.matmul(U.T, U), unit_sigma, k)


def _noisy_top_k(key, S, sigma, k):
  """Top-k eigenvectors of ``S + E``, ``E`` symmetric with its upper triangle and diagonal
  i.i.d. ``N(0, σ²)`` (mirrored), in S's dtype: the continuous-noise release of a second moment
  (also MOD-SuLQ's, :mod:`dpjax.classic.pca`). Traceable."""
  d = S.shape[0]
  noise = jax.random.normal(key, (d, d), S.dtype) * sigma
  E = jnp.triu(noise) + jnp.triu(noise, 1).T
  _, evecs = jnp.linalg.eigh(S + E)
  return evecs[:, ::-1][:, :k]


def _unit_clip(X, clip_mantissa, clip_exponent):
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


def pca_subspace(X, *, k: int) -> SubspaceResult:
  """Non-private PCA: the top-k right singular vectors of ``X``. NOT private — a reference floor.

  Scale-safe (:func:`dpjax.linalg.top_k_right_singular_vectors` normalises the block by a power
  of two first); runs in X's dtype, 16-bit floats upcast to float32.

  Returns:
    :class:`~dpjax.results.SubspaceResult` with ``ok=True``, ``epsilon=inf``, ``delta=1`` and
    ``neighbouring=None`` (not private). Traceable; under tracing a non-finite X or basis gives
    ``ok=False`` instead of an error.

  Raises:
    TypeError: X not a real array. ValueError: NaN/inf in a concrete X, wrong rank,
      ``k ∉ [1, min(n, d)]``, or (defensive, not expected after the normalisation) a non-finite
      basis.
  """
  X = v.check_data(X, "X")
  k = v.check_int(k, "k", low=1, high=min(X.shape))
  basis = linalg.top_k_right_singular_vectors(X, k)
  ok = v.all_finite(basis)
  if v.is_traced(X, ok):              # ok is staged under jit even for a closed-over X
    ok, basis = v.domain_bottom(X, ok, basis)
  # Non-private baseline: checking its own output is fine (nothing private is released here).
  elif not bool(ok):
    raise ValueError("pca_subspace could not compute a finite basis for X in its dtype "
                     f"{X.dtype}; pass float64 data.")
  return SubspaceResult(ok=ok, basis=basis, epsilon=math.inf, delta=1.0, neighbouring=None)
