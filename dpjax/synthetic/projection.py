"""He–Vershynin–Zhu, steps 1–3: the private centred covariance, the private mean, the private
projection and the private choice of its dimension d' (docs/algorithms.md §4.2–§4.4, §4.8).

Rows ``X (n, d)`` lie in the unit cube ``[0, 1]^d`` (the domain of every guarantee here; scale
with public bounds first, :func:`dpjax.data.scale_to_unit_cube`). Neighboring relation:
replace-one (n is public). The releases are Laplace noise through the snapping mechanism
(:func:`dpjax.mechanisms.snapping_l1_mechanism`): float64 on the host, on a public grid, ε-DP
including the floating-point effects.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import _validation as v
from dpjax.mechanisms.snapping import snapping_l1_mechanism

__all__ = ["choose_dim", "covariance_sensitivity", "laplace_matrix_norm_quantile",
           "private_centered_covariance", "private_mean"]

COVARIANCE_SCALES = ("paper", "tight")
_MONTE_CARLO_DRAWS = 200          # draws of the public noise law for its norm quantile


def covariance_sensitivity(n: int, d: int, scale: str = "paper") -> float:
  """ℓ1-sensitivity of the upper triangle of the centred covariance ``M`` under replace-one.

  One replaced row moves every entry of ``M = XᵀX/n − x̄x̄ᵀ`` by at most ``3/n``:
  ``|x_i x_j − x'_i x'_j|/n ≤ 1/n``, and with ``x̄' = x̄ + δ/n``, ``|δ| ≤ 1`` coordinatewise,
  ``|x̄'_i x̄'_j − x̄_i x̄_j| = |x̄'_i (x̄'_j − x̄_j) + x̄_j (x̄'_i − x̄_i)| ≤ 2/n`` (means lie in
  [0, 1]). Over the ``d(d+1)/2`` released entries: ``"tight"`` gives ``3d(d+1)/(2n)``;
  ``"paper"`` (the default, HVZ's reference code) ``3d²/n``, a valid upper bound.
  """
  v.check_choice(scale, "covariance_scale", COVARIANCE_SCALES)
  return 3.0 * d * d / n if scale == "paper" else 1.5 * d * (d + 1) / n


def private_centered_covariance(key: jax.Array, X, *, epsilon: float,
                                scale: str = "paper") -> np.ndarray:
  """[HVZ] Algorithm 2: ``M̂ = M + A``, ``A`` a symmetric matrix of Laplace noise.

  Args:
    key: PRNG key.
    X: ``(n, d)`` rows in ``[0, 1]^d``, n ≥ 2 (rows are clipped into the cube first, a fixed
      map of each row, so the guarantee holds for any input; the public pipeline rejects rows
      outside instead).
    epsilon: ε > 0 of this release.
    scale: ``"paper"`` (noise ``3d²/(εn)``) or ``"tight"`` (``3d(d+1)/(2εn)``), see
      :func:`covariance_sensitivity`.

  Returns:
    ``(d, d)`` float64 NumPy, symmetric: the upper triangle released, mirrored
    (post-processing). Float64 because the snapping mechanism's analysis is for IEEE doubles.
    With a traced key (``jit`` / ``vmap`` over keys; X concrete): the same values as a JAX
    array in JAX's default float dtype.

  Guarantee: ε-DP under replace-one, by the ℓ1-sensitivity above and the snapping mechanism
  (each upper-triangle entry is clamped to the public ``[−1, 1]`` range plus a margin).

  References:
    He, Vershynin & Zhu, Algorithm 2 and Prop 3.1; docs/algorithms.md §4.2.
  """
  X = _rows_in_cube(X)
  n, d = X.shape
  mean = X.mean(axis=0)
  M = X.T @ X / n - np.outer(mean, mean)
  upper = np.triu_indices(d)
  sensitivity = covariance_sensitivity(n, d, scale)
  noisy = snapping_l1_mechanism(key, M[upper], l1_sensitivity=sensitivity, epsilon=epsilon,
                                bound=_bound(sensitivity, epsilon))
  xp = jnp if v.is_traced(noisy) else np                 # traced key: the same, in JAX
  out = xp.zeros((d, d), noisy.dtype)
  out = out.at[upper].set(noisy) if xp is jnp else _set(out, upper, noisy)
  return out + xp.triu(out, 1).T


def private_mean(key: jax.Array, X, *, epsilon: float) -> np.ndarray:
  """[HVZ] §4.3: ``x̄ + Lap(d/(εn))`` per coordinate (ℓ1-sensitivity ``d/n``), clipped into
  the cube (post-processing). ``(d,)`` float64 NumPy; ε-DP under replace-one (snapping). Rows
  are clipped into the cube first, as in :func:`private_centered_covariance`."""
  X = _rows_in_cube(X)
  n, d = X.shape
  sensitivity = d / n
  noisy = snapping_l1_mechanism(key, X.mean(axis=0), l1_sensitivity=sensitivity,
                                epsilon=epsilon, bound=_bound(sensitivity, epsilon))
  return (jnp if v.is_traced(noisy) else np).clip(noisy, 0.0, 1.0)


def _rows_in_cube(X) -> np.ndarray:
  """Float64 rows clipped into ``[0, 1]^d``: a fixed map of each row, so the sensitivities
  (stated for the cube) hold whatever the caller passes (NaN stays NaN and is zeroed by the
  snapping release; the public pipeline rejects both before this)."""
  return np.clip(np.asarray(X, np.float64), 0.0, 1.0)


def _set(out: np.ndarray, index, values) -> np.ndarray:
  out[index] = values
  return out


def _bound(sensitivity: float, epsilon: float) -> float:
  """The public clamp: the statistic's range [−1, 1] plus 2^10 noise scales (so that clamping
  the noisy value almost never bites, and the floating-point slack stays ~2^-39 per entry)."""
  return 1.0 + 2.0**10 * sensitivity / epsilon


def laplace_matrix_norm_quantile(d: int, scale: float, *, quantile: float = 0.95,
                                 draws: int = _MONTE_CARLO_DRAWS, seed: int = 0) -> float:
  """The ``quantile`` of ``‖A‖₂`` for the symmetric Laplace matrix of Algorithm 2 (entries
  ``Lap(scale)`` on and above the diagonal), by Monte Carlo of this public law (no data, no
  privacy cost; a fixed NumPy seed keeps it a deterministic public number)."""
  rng = np.random.default_rng(seed)
  G = rng.laplace(scale=scale, size=(draws, d, d))
  A = np.triu(G) + np.swapaxes(np.triu(G, 1), 1, 2)
  norms = np.abs(np.linalg.eigvalsh(A)).max(axis=1)
  return float(np.quantile(norms, quantile))


def cube_radius(mean: np.ndarray) -> float:
  """``R = ‖max(μ̂, 1 − μ̂)‖₂``: bounds ``‖x − μ̂‖`` for every row of the cube, from the private
  mean alone (docs/algorithms.md §4.1 CAUTION: never from data)."""
  mean = np.clip(np.asarray(mean, np.float64), 0.0, 1.0)
  return float(np.linalg.norm(np.maximum(mean, 1.0 - mean)))


def choose_dim(eigenvalues, *, d: int, noise_norm: float, radius: float, epsilon_n: float,
               max_dim: int | None = None, c_syn: float = 1.0) -> int:
  """[HVZ] §6: the private d' from the private covariance's eigenvalues alone (post-processing).

  ``d'* = argmin_{d'} sqrt(Σ_{i>d'} max(λ̂_i, 0) + (d − d')·a + 2d'·a) + c_syn·R·(εs n)^{−1/d'}``
  with ``a`` a public bound on ``‖A‖`` (:func:`laplace_matrix_norm_quantile`): the rank-d' tail
  (perturbed by at most ``(d − d')‖A‖``, Weyl) against the synthetic-data term.

  Args:
    eigenvalues: ``(d,)`` eigenvalues of ``M̂`` (any order).
    d: the ambient dimension.
    noise_norm: ``a``.
    radius: ``R``.
    epsilon_n: ``εs·n``, the synthetic step's budget times n.
    max_dim: largest d' considered (default ``min(d, 10)``).
    c_syn: the synthetic term's constant (PROPOSED 1).

  Returns:
    d' ∈ {1, …, max_dim}.

  References:
    He, Vershynin & Zhu §6 (Lemma 6.1); docs/algorithms.md §4.8 [PROPOSED concrete form].
  """
  lam = np.sort(np.asarray(eigenvalues, np.float64))[::-1]
  max_dim = min(d, 10) if max_dim is None else v.check_int(max_dim, "max_dim", low=1, high=d)
  best, best_cost = 1, math.inf
  for k in range(1, max_dim + 1):
    tail = float(np.maximum(lam[k:], 0.0).sum())
    cost = (math.sqrt(tail + (d - k) * noise_norm + 2 * k * noise_norm)
            + c_syn * radius * epsilon_n ** (-1.0 / k))
    if cost < best_cost:
      best, best_cost = k, cost
  return best
