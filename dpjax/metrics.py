"""Utility metrics (docs/algorithms.md §2.4, §7). Non-private: they compare an estimate with the truth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from dpjax import linalg

__all__ = ["captured_energy", "captured_variance_ratio", "clopper_pearson", "covariance_error",
           "gaussian_kl", "gaussian_tv", "mahalanobis_error", "principal_angles",
           "projection_distance", "success_rate", "wasserstein_1"]


def projection_distance(V_hat: jax.Array, V: jax.Array) -> jax.Array:
  """Operator-norm distance ``‖Π̂ − Π‖`` between the projections onto two subspaces.

  For subspaces of equal dimension this is ``sin θ_max``, the sine of the largest principal
  angle (:func:`dpjax.linalg.principal_angles`: accurate to working precision for small angles
  too, where ``√(1 − cos²θ)`` resolves nothing below ``√(2·eps)``, 3·10⁻⁴ in float32). No
  ``(d, d)`` matrix is formed; a zero basis (a ⊥ result) is at distance 1.
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
  return jnp.sin(linalg.principal_angles(V_hat, V)[-1])


# One implementation: principal angles (radians, ascending) live in dpjax.linalg.
principal_angles = linalg.principal_angles


def captured_energy(V: jax.Array, G: jax.Array) -> jax.Array:
  """Fraction of the energy of the rows of ``G (n, p)`` inside ``span(V)``: ``‖GV‖²_F/‖G‖²_F``."""
  return jnp.sum(linalg.matmul(G, V) ** 2) / jnp.sum(G**2)


@jax.jit
def captured_variance_ratio(V: jax.Array, A: jax.Array) -> jax.Array:
  """``tr(VᵀAV) / Σ_{i≤k} λ_i(A)``: the variance a k-dim subspace captures, relative to the best
  k-dim subspace's (the top-k eigenvectors of A; Ky Fan). [CSS13]'s utility ``q(V)``, normalised.

  Args:
    V: ``(d, k)`` orthonormal basis (e.g. ``SubspaceResult.basis``).
    A: ``(d, d)`` symmetric positive semidefinite, e.g. the second moment ``XᵀX/n``.

  Returns:
    Scalar in ``[0, 1]`` (up to rounding); 1 when the top-k eigenvalues of A sum to 0 (every
    subspace is then optimal). Jitted (one program per shape).
  """
  if A.shape != (V.shape[0], V.shape[0]):
    raise ValueError(f"A must be ({V.shape[0]}, {V.shape[0]}) for V of shape {V.shape}, got "
                     f"{A.shape}.")
  k = V.shape[1]
  captured = jnp.trace(linalg.matmul(V.T, linalg.matmul(A, V)))
  best = jnp.sum(jnp.linalg.eigvalsh(A)[::-1][:k])
  return jnp.where(best > 0, captured / jnp.where(best > 0, best, 1), 1.0)


def clopper_pearson(successes: int, trials: int, confidence: float = 0.95
                    ) -> tuple[float, float]:
  """Exact (Clopper–Pearson) two-sided confidence interval for a binomial proportion.

  SciPy's ``binomtest(successes, trials).proportion_ci(confidence, method="exact")``.

  Returns:
    ``(low, high)`` Python floats.

  Raises:
    ValueError: ``trials ≤ 0`` or ``successes ∉ [0, trials]``.
  """
  if trials <= 0:
    raise ValueError(f"trials must be > 0, got trials={trials}.")
  if not 0 <= successes <= trials:
    raise ValueError(f"successes must lie in [0, trials], got successes={successes}.")
  ci = stats.binomtest(int(successes), int(trials)).proportion_ci(confidence_level=confidence,
                                                                 method="exact")
  return float(ci.low), float(ci.high)


def success_rate(errors, alpha: float, confidence: float = 0.95) -> dict:
  """Empirical ``P[error ≤ alpha]`` with its Clopper–Pearson interval.

  ``errors`` is a sequence of floats; ⊥ outcomes should be passed as ``inf`` (they count as
  failures).
  """
  errors = np.asarray(errors, dtype=float)
  hits = int(np.sum(errors <= alpha))
  low, high = clopper_pearson(hits, errors.size, confidence)
  return {"rate": hits / errors.size, "low": low, "high": high, "trials": int(errors.size)}


# --- Gaussians and covariances (docs/algorithms.md §3.8; host-side float64) -----------------------

def _whitener(Sigma: np.ndarray) -> np.ndarray:
  w, V = np.linalg.eigh((Sigma + Sigma.T) / 2)
  if w[0] <= 0:
    raise ValueError("Sigma must be positive definite for a whitened error.")
  return (V / np.sqrt(w)) @ V.T


def covariance_error(Sigma_hat, Sigma, ord=2) -> float:
  """``‖Σ^{-1/2} Σ̂ Σ^{-1/2} − I‖`` (spectral by default, ``ord="fro"`` for Frobenius).

  Affine invariant; the error measure of [AL22] Thm 5.4–5.6 (Frobenius ≤ α gives TV O(α)).
  Σ must be positive definite (restrict both to ``range(Σ)`` first for singular Σ).
  """
  S = np.asarray(Sigma, np.float64)
  W = _whitener(S)
  return float(np.linalg.norm(W @ np.asarray(Sigma_hat, np.float64) @ W - np.eye(S.shape[0]), ord))


def mahalanobis_error(mu_hat, mu, Sigma) -> float:
  """``‖Σ^{-1/2}(μ̂ − μ)‖₂`` for positive definite Σ."""
  W = _whitener(np.asarray(Sigma, np.float64))
  return float(np.linalg.norm(W @ (np.asarray(mu_hat, np.float64) - np.asarray(mu, np.float64))))


def gaussian_kl(mu1, Sigma1, mu2, Sigma2) -> float:
  """``KL(N(μ1, Σ1) ‖ N(μ2, Σ2))`` ([AL22] Fact 2.1), both covariances positive definite."""
  S1, S2 = (np.asarray(S, np.float64) for S in (Sigma1, Sigma2))
  diff = np.asarray(mu2, np.float64) - np.asarray(mu1, np.float64)
  _, logdet1 = np.linalg.slogdet(S1)
  _, logdet2 = np.linalg.slogdet(S2)
  return float(0.5 * (np.trace(np.linalg.solve(S2, S1)) - S1.shape[0]
                      + diff @ np.linalg.solve(S2, diff) + logdet2 - logdet1))


def gaussian_tv(key: jax.Array, mu1, Sigma1, mu2, Sigma2, num_samples: int = 100_000) -> dict:
  """TV between two non-degenerate Gaussians: Monte Carlo and the Pinsker bound (docs/algorithms.md §3.8).

  ``TV = E_{x∼P}[(1 − q(x)/p(x))_+]`` estimated from ``num_samples`` draws of P (log-densities in
  float64), with its standard error, and ``sqrt(KL(P‖Q)/2)`` (Pinsker, an upper bound).

  Returns:
    ``{"tv": float, "stderr": float, "pinsker": float}``.
  """
  S1, S2 = (np.asarray(S, np.float64) for S in (Sigma1, Sigma2))
  m1, m2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
  L1 = np.linalg.cholesky(S1)
  z = np.asarray(jax.random.normal(key, (num_samples, S1.shape[0])), np.float64)
  x = m1 + z @ L1.T
  log_p = _gaussian_logpdf(x, m1, S1)
  log_q = _gaussian_logpdf(x, m2, S2)
  vals = np.maximum(0.0, -np.expm1(np.minimum(log_q - log_p, 700.0)))
  return {"tv": float(vals.mean()), "stderr": float(vals.std() / np.sqrt(num_samples)),
          "pinsker": float(np.sqrt(max(gaussian_kl(m1, S1, m2, S2), 0.0) / 2.0))}


def _gaussian_logpdf(x, mu, Sigma):
  return stats.multivariate_normal.logpdf(x, mean=mu, cov=Sigma)


W1_EXACT_LIMIT = 5_000            # rows per side for the exact transport plan (a 5k × 5k LP)


def wasserstein_1(X, Y, *, method: str = "auto", num_projections: int = 200,
                  seed: int = 0) -> tuple[float, str]:
  """1-Wasserstein distance (ℓ2 ground cost) between the empirical measures of ``X (n, d)`` and
  ``Y (m, d)`` (uniform weights; n and m may differ). Non-private: an evaluation metric.

  ``method``: ``"exact"`` (POT's network simplex, ``ot.emd2``; O(nm) memory), ``"sliced"``
  (POT's sliced W1 over ``num_projections`` random directions, ``seed`` fixed: an
  APPROXIMATION, a lower bound of W1 up to Monte Carlo error), or ``"auto"`` (exact up to
  :data:`W1_EXACT_LIMIT` rows per side, sliced above).

  Returns:
    ``(value, method_used)``: the label says which (``"exact"`` or ``"sliced"``).

  Raises:
    ImportError: POT is missing (``pip install dpjax[synthetic]``).
    ValueError: shapes that differ in d, empty inputs, or a bad method.
  """
  try:
    import ot
  except ImportError as exc:      # pragma: no cover - exercised only without the extra
    raise ImportError("wasserstein_1 needs POT: pip install 'dpjax[synthetic]'.") from exc
  X = np.asarray(X, np.float64)
  Y = np.asarray(Y, np.float64)
  if X.ndim != 2 or Y.ndim != 2 or X.shape[1] != Y.shape[1] or not len(X) or not len(Y):
    raise ValueError(f"X and Y must be non-empty (n, d) and (m, d), got {X.shape} and {Y.shape}.")
  if method not in ("auto", "exact", "sliced"):
    raise ValueError(f"method must be 'auto', 'exact' or 'sliced', got {method!r}.")
  if method == "auto":
    method = "exact" if max(len(X), len(Y)) <= W1_EXACT_LIMIT else "sliced"
  if method == "exact":
    cost = ot.dist(X, Y, metric="euclidean")
    return float(ot.emd2(np.full(len(X), 1 / len(X)), np.full(len(Y), 1 / len(Y)), cost,
                         numItermax=10_000_000)), "exact"
  value = ot.sliced_wasserstein_distance(X, Y, n_projections=num_projections, p=1, seed=seed)
  return float(value), "sliced"
