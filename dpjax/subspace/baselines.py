"""Baselines for private subspace learning: Analyze Gauss and non-private PCA (same result type)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from dpjax import _validation as v
from dpjax import linalg
from dpjax.mechanisms.gaussian import analytic_gaussian_sigma
from dpjax.subspace.result import SubspaceResult


def analyze_gauss(key: jax.Array, X, *, epsilon: float, delta: float, k: int,
                  clip_norm: float) -> SubspaceResult:
  """Analyze Gauss (Dwork, Talwar, Thakurta & Zhang 2014): noisy second moment, top-k eigenvectors.

  Rows are clipped to the public norm C (``x ↦ x·min(1, C/‖x‖)``), ``A = XᵀX`` gets a symmetric
  Gaussian matrix ``E`` (upper triangle and diagonal i.i.d. ``N(0, σ²)``, mirrored), and the answer
  is the top-k eigenvectors of ``A + E``.

  Privacy guarantee: (ε, δ)-DP under replace-one. Replacing one row changes ``A`` by
  ``x xᵀ − x' x'ᵀ``, whose upper triangle has ℓ2 norm ≤ ‖x xᵀ‖_F + ‖x' x'ᵀ‖_F ≤ 2C²; σ is the
  analytic Gaussian calibration (Balle & Wang 2018) for that sensitivity. The eigenvectors are
  post-processing. Noise grows with d: the error is ``≈ σ sqrt(d) / (n λ_k)``, which is what the
  dimension-free DPASE avoids.

  Args:
    key: PRNG key.
    X: ``(n, d)`` float data.
    epsilon, delta: the budget.
    k: subspace dimension, ``1 <= k <= d``.
    clip_norm: public row-norm bound C > 0 (rows above it are scaled down).

  Returns:
    :class:`SubspaceResult` (always ``ok``); ``info["sigma"]`` is the noise std.
  """
  key = v.check_key(key)
  X = v.check_data(X, "X")
  n, d = X.shape
  k = v.check_int(k, "k", low=1, high=d)
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  clip_norm = v.check_positive(clip_norm, "clip_norm")
  sigma = analytic_gaussian_sigma(epsilon, delta, sensitivity=2.0 * clip_norm**2)
  basis = _analyze_gauss(key, X, k, clip_norm, sigma)
  return SubspaceResult(ok=jnp.asarray(True), basis=basis, epsilon=epsilon, delta=delta,
                        neighbouring="replace_one", info={"sigma": sigma, "clip_norm": clip_norm})


@functools.partial(jax.jit, static_argnames=("k",))
def _analyze_gauss(key, X, k, clip_norm, sigma):
  norms = jnp.linalg.norm(X, axis=1, keepdims=True)
  Xc = X * jnp.minimum(1.0, clip_norm / jnp.maximum(norms, jnp.finfo(X.dtype).tiny))
  d = X.shape[1]
  noise = jax.random.normal(key, (d, d), X.dtype) * sigma
  E = jnp.triu(noise) + jnp.triu(noise, 1).T
  _, evecs = jnp.linalg.eigh(Xc.T @ Xc + E)
  return evecs[:, ::-1][:, :k]


def pca_subspace(X, *, k: int) -> SubspaceResult:
  """Non-private PCA: the top-k right singular vectors of ``X``. NOT private — a reference floor.

  Returns:
    :class:`SubspaceResult` with ``ok=True``, ``epsilon=inf`` and ``neighbouring="non_private"``.
  """
  X = v.check_data(X, "X")
  k = v.check_int(k, "k", low=1, high=min(X.shape))
  return SubspaceResult(ok=jnp.asarray(True), basis=linalg.top_k_right_singular_vectors(X, k),
                        epsilon=math.inf, delta=1.0, neighbouring="non_private", info={})
