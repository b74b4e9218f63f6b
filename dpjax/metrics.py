"""Utility metrics (ALGORITHMS.md §2.4, §7). Non-private: they compare an estimate with the truth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from dpjax import linalg


def projection_distance(V_hat: jax.Array, V: jax.Array) -> jax.Array:
  """Operator-norm distance ``‖Π̂ − Π‖`` between the projections onto two subspaces.

  For subspaces of equal dimension this is ``sin θ_max``, the sine of the largest principal
  angle, computed from the small ``(k, k)`` matrix ``V̂ᵀV`` (no ``(d, d)`` matrix is formed).
  Subspaces of different dimensions are at distance 1.

  Args:
    V_hat: ``(d, k1)`` orthonormal basis (e.g. ``SubspaceResult.basis``).
    V: ``(d, k2)`` orthonormal basis of the reference subspace.

  Returns:
    Scalar in ``[0, 1]``.
  """
  if V_hat.shape[0] != V.shape[0]:
    raise ValueError(f"V_hat and V must have the same number of rows, got {V_hat.shape} and "
                     f"{V.shape}.")
  if V_hat.shape[1] != V.shape[1]:
    return jnp.asarray(1.0, dtype=jnp.result_type(V_hat.dtype, V.dtype))
  s = jnp.linalg.svd(V_hat.T @ V, compute_uv=False)
  smallest = jnp.clip(jnp.min(s), 0.0, 1.0)
  return jnp.sqrt(jnp.maximum(1.0 - smallest**2, 0.0))


def principal_angles(V_hat: jax.Array, V: jax.Array) -> jax.Array:
  """Principal angles between two subspaces (radians, ascending); see ``dpjax.linalg``."""
  return linalg.principal_angles(V_hat, V)


def captured_energy(V: jax.Array, G: jax.Array) -> jax.Array:
  """Fraction of the energy of the rows of ``G (n, p)`` inside ``span(V)``: ``‖GV‖²_F/‖G‖²_F``."""
  return jnp.sum((G @ V) ** 2) / jnp.sum(G**2)


def clopper_pearson(successes: int, trials: int, confidence: float = 0.95
                    ) -> tuple[float, float]:
  """Exact (Clopper–Pearson) two-sided confidence interval for a binomial proportion."""
  if trials <= 0:
    raise ValueError(f"trials must be > 0, got trials={trials}.")
  if not 0 <= successes <= trials:
    raise ValueError(f"successes must lie in [0, trials], got successes={successes}.")
  alpha = 1.0 - confidence
  low = 0.0 if successes == 0 else float(stats.beta.ppf(alpha / 2, successes,
                                                        trials - successes + 1))
  high = 1.0 if successes == trials else float(stats.beta.ppf(1 - alpha / 2, successes + 1,
                                                              trials - successes))
  return low, high


def success_rate(errors, alpha: float, confidence: float = 0.95) -> dict:
  """Empirical ``P[error ≤ alpha]`` with its Clopper–Pearson interval.

  ``errors`` is a sequence of floats; ⊥ outcomes should be passed as ``inf`` (they count as
  failures).
  """
  errors = np.asarray(errors, dtype=float)
  hits = int(np.sum(errors <= alpha))
  low, high = clopper_pearson(hits, errors.size, confidence)
  return {"rate": hits / errors.size, "low": low, "high": high, "trials": int(errors.size)}
