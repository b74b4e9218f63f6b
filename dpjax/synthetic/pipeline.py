"""He–Vershynin–Zhu Algorithm 1: private low-dimensional synthetic data (docs/algorithms.md §4.1).

Learn an affine d'-dimensional subspace privately (covariance, mean), project the rows onto it,
make a private synthetic copy of the projected points (PMM or PSMM) and map it back into the
cube. With data near a d'-dimensional subspace, the 1-Wasserstein error decays like
``(εn)^{−1/d'}`` instead of ``(εn)^{−1/d}``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax.results import SyntheticDataResult, warn_underpowered
from dpjax.synthetic import pmm as pmm_lib
from dpjax.synthetic import projection
from dpjax.synthetic import psmm as psmm_lib
from dpjax.ledger import with_ledger

__all__ = ["METHODS", "low_dimensional_synthetic_data", "synthetic_required_n"]

METHODS = ("auto", "pmm", "psmm")


@with_ledger
def low_dimensional_synthetic_data(key: jax.Array, X, *, epsilon: float, dim: int | None = None,
                                   method: str = "auto", covariance_scale: str = "paper",
                                   budget_split=(1 / 3, 1 / 3, 1 / 3), max_dim: int | None = None,
                                   c_syn: float = 1.0, depth: int | None = None,
                                   lattice_side: float | None = None,
                                   max_cells: int = psmm_lib.MAX_CELLS) -> SyntheticDataResult:
  """ε-DP synthetic data near a privately learned d'-dimensional affine subspace.

  Usage::

      res = dpjax.synthetic.low_dimensional_synthetic_data(jax.random.key(0), X, epsilon=1.0)
      res.synthetic, res.released["dim"]    # (n, d) rows in [0, 1]^d; the private d'

  Steps ([HVZ] Algorithm 1): ``M̂`` = private centred covariance (Algorithm 2, ε_c); ``μ̂`` =
  private mean (ε_m), clipped into the cube; ``V`` = top-d' eigenvectors of ``M̂``; ``a_i =
  Vᵀ(x_i − μ̂)``; PMM or PSMM on the ``a_i`` (ε_s) inside the ball of radius
  ``R = ‖max(μ̂, 1 − μ̂)‖`` (public, from DP outputs only); ``x̂_j = clip(V b_j + μ̂, 0, 1)``.

  Guarantee: pure ε-DP under replace-one (n public): ε_c + ε_m + ε_s = ε by basic composition;
  the synthetic step is ε_s-DP for every fixed ``(V, μ̂)`` because each row contributes one
  point ``a_i`` ([HVZ] Prop 5.1). Covariance and mean use the snapping mechanism (float-safe
  Laplace); PMM and PSMM use exact integer discrete Laplace noise. Everything after is
  post-processing. Not jittable as a whole (d' sets shapes and may be chosen privately; PSMM
  solves an LP on the host); PMM's core (:func:`dpjax.synthetic.pmm.pmm_core`) is. Proof:
  docs/algorithms.md §4.1, §4.9.

  Args:
    key: PRNG key.
    X: ``(n, d)`` float rows in ``[0, 1]^d`` (rows are individuals), n ≥ 2. Rescale other data
      with public bounds first: :func:`dpjax.data.scale_to_unit_cube`.
    epsilon: total ε > 0 (nats).
    dim: d' (1 ≤ d' ≤ d); ``None`` chooses it privately from ``M̂`` alone ([HVZ] §6,
      :func:`dpjax.synthetic.projection.choose_dim`).
    method: ``"pmm"``, ``"psmm"`` or ``"auto"`` (PMM for d' ≤ 2; PSMM for d' ≥ 3 when its
      lattice has at most ``max_cells`` cells, else PMM).
    covariance_scale: ``"paper"`` (noise ``3d²/(ε_c n)``) or ``"tight"`` (``3d(d+1)/(2ε_c n)``).
    budget_split: fractions ``(ε_c, ε_m, ε_s)/ε``, positive, summing to 1 (default thirds).
    max_dim: largest d' the private choice considers (default ``min(d, 10)``).
    c_syn: the private choice's synthetic-term constant (PROPOSED 1).
    depth: PMM's levels (default ``⌈log2(ε_s n)⌉``).
    lattice_side: PSMM's lattice side (default ``R (ε_s n)^{−1/d'}``).
    max_cells: PSMM refuses a larger lattice (``method="psmm"``: ValueError).

  Returns:
    :class:`dpjax.SyntheticDataResult`: ``synthetic (n, d)`` in the cube, ``basis (d, d')``,
    ``mean (d,)`` (in X's float dtype), ``ok`` always True (no ⊥), and ``released`` — ``dim``
    (d'), ``radius`` (R) and the synthetic step's own release (``leaf_counts`` for PMM,
    ``noisy_counts`` for PSMM), all DP outputs. ``epsilon`` = the total, ``delta = 0``,
    ``neighboring = REPLACE_ONE``; ``info`` holds the public settings.

  Raises:
    TypeError: ``key`` not a PRNG key; ``X`` not a real array; called under ``jit`` / ``vmap``.
    ValueError: ``X`` not 2-D, fewer than 2 rows, NaN/inf, or rows outside ``[0, 1]^d``;
      ε not finite and > 0; ``dim`` outside ``1..d``; a bad ``method``, ``covariance_scale`` or
      ``budget_split``; ``method="psmm"`` with a lattice over ``max_cells``.

  Warns:
    dpjax.UnderpoweredWarning: n below :func:`synthetic_required_n` (the error bound's public
      terms exceed √d/2); the message gives that number. The result is still private.

  References:
    He, Vershynin & Zhu, "Differentially private low-dimensional synthetic data from
    high-dimensional datasets", Algorithm 1, Thm 1.2, Prop 5.1; docs/algorithms.md §4.
  """
  v.check_key(key)
  X = _check_cube_rows(X)
  n, d = X.shape
  epsilon = v.check_epsilon(epsilon)
  v.check_choice(method, "method", METHODS)
  v.check_choice(covariance_scale, "covariance_scale", projection.COVARIANCE_SCALES)
  eps_c, eps_m, eps_s = _split(epsilon, budget_split)
  if dim is not None:
    dim = v.check_int(dim, "dim", low=1, high=d)
  requested = dim
  c_syn = v.check_positive(c_syn, "c_syn")
  k_cov, k_mean, k_syn = jax.random.split(key, 3)
  _warn_if_underpowered(n, d, epsilon, dim, covariance_scale, budget_split, max_dim)

  M_hat = projection.private_centered_covariance(k_cov, X, epsilon=eps_c, scale=covariance_scale)
  mean = projection.private_mean(k_mean, X, epsilon=eps_m)
  radius = projection.cube_radius(mean)
  eigenvalues, vectors = np.linalg.eigh(M_hat)
  eigenvalues, vectors = eigenvalues[::-1], vectors[:, ::-1]     # largest algebraic first
  if dim is None:
    noise_scale = projection.covariance_sensitivity(n, d, covariance_scale) / eps_c
    dim = projection.choose_dim(
        eigenvalues, d=d, noise_norm=projection.laplace_matrix_norm_quantile(d, noise_scale),
        radius=radius, epsilon_n=eps_s * n, max_dim=max_dim, c_syn=c_syn)
  V = vectors[:, :dim]
  A = (np.asarray(X, np.float64) - mean) @ V                    # ‖a_i‖ ≤ ‖x_i − μ̂‖ ≤ R
  chosen = _choose_method(method, dim, radius, eps_s * n, lattice_side, max_cells)
  if chosen == "pmm":
    params = pmm_lib.pmm_parameters(n, dim, epsilon=eps_s, depth=depth)
    Y = jnp.asarray((A + radius) / (2 * radius), X.dtype)      # the ball inside [0, 1]^{d'}
    points, released = pmm_lib._pmm_jit(k_syn, Y, params)
    B = 2 * radius * np.asarray(points, np.float64) - radius
  else:
    B, released = psmm_lib.psmm(k_syn, jnp.asarray(A, X.dtype), epsilon=eps_s, radius=radius,
                                side=lattice_side, max_cells=max_cells)
    released = {"noisy_counts": released["noisy_counts"]}
  synthetic = np.clip(B @ V.T + mean, 0.0, 1.0)
  # The method used is a function of public settings and of the DP-released d' and R.
  info = {"method": chosen, "method_requested": method, "dim_requested": requested,
          "epsilon_split": (eps_c, eps_m, eps_s), "covariance_scale": covariance_scale}
  released = {"dim": jnp.int32(dim), "radius": jnp.asarray(radius, X.dtype),
              **{k: jnp.asarray(val) for k, val in released.items()}}
  return SyntheticDataResult(ok=jnp.bool_(True), released=released,
                             synthetic=jnp.asarray(synthetic, X.dtype),
                             basis=jnp.asarray(V, X.dtype), mean=jnp.asarray(mean, X.dtype),
                             epsilon=epsilon, delta=0.0,
                             neighboring=NeighboringRelation.REPLACE_ONE, info=info)


def synthetic_required_n(d: int, *, epsilon: float, dim: int | None = None,
                         accuracy: float | None = None, covariance_scale: str = "paper",
                         budget_split=(1 / 3, 1 / 3, 1 / 3), max_dim: int | None = None) -> int:
  """Rows :func:`low_dimensional_synthetic_data` needs for the public terms of its error bound to
  reach ``accuracy`` (1-Wasserstein, ℓ2 cost, in the cube's units; default ``√d/2``); the
  number its :class:`dpjax.UnderpoweredWarning` quotes (at the default), which it gives exactly
  when n is below it.

  >>> import dpjax
  >>> dpjax.synthetic.synthetic_required_n(13, epsilon=1.0)
  5571

  [HVZ] Thm 1.2 bounds ``E W1`` by ``sqrt(Σ_{i>d'} σ_i(M)) + sqrt(d'·‖A‖) + √d (ε_s n)^{−1/d'}``
  up to constants: the first term is the data's own (private) tail, the other two are public —
  the covariance noise ``A`` (its 0.95 quantile, :func:`~dpjax.synthetic.projection.
  laplace_matrix_norm_quantile`, at the call's scale ``covariance_sensitivity(n, d)/ε_c``) and
  the synthetic step. With ``dim=None`` the best d' ≤ ``max_dim`` (default ``min(d, 10)``).
  The default accuracy ``√d/2`` is the distance within which n copies of the cube's centre lie
  from any data in the cube: above it the bound promises nothing that constant rows would not
  (docs/algorithms.md §4.9). Constants of 1; public numbers only.

  Raises:
    ValueError: bad arguments, or no n up to 10¹² reaches ``accuracy``.
  """
  d = v.check_int(d, "d", low=1)
  epsilon = v.check_epsilon(epsilon)
  eps_c, _, eps_s = _split(epsilon, budget_split)
  v.check_choice(covariance_scale, "covariance_scale", projection.COVARIANCE_SCALES)
  accuracy = (math.sqrt(d) / 2.0 if accuracy is None
              else v.check_positive(accuracy, "accuracy"))
  if dim is None:
    dims = range(1, (min(d, 10) if max_dim is None
                     else v.check_int(max_dim, "max_dim", low=1, high=d)) + 1)
  else:
    dims = (v.check_int(dim, "dim", low=1, high=d),)
  unit_norm = _unit_noise_norm(d)

  def enough(n):
    a = unit_norm * projection.covariance_sensitivity(n, d, covariance_scale) / eps_c
    return min(math.sqrt(k * a) + math.sqrt(d) * (eps_s * n) ** (-1.0 / k)
               for k in dims) <= accuracy

  return v.smallest_n(enough, f"no n up to 1e12 reaches accuracy={accuracy:g} for d={d}",
                      start=2)


@functools.lru_cache(maxsize=16)
def _unit_noise_norm(d: int) -> float:
  """``‖A‖``'s 0.95 quantile at scale 1 (it scales linearly with the scale); remembered."""
  return projection.laplace_matrix_norm_quantile(d, 1.0)


def _warn_if_underpowered(n, d, epsilon, dim, covariance_scale, budget_split, max_dim):
  need = synthetic_required_n(d, epsilon=epsilon, dim=dim, covariance_scale=covariance_scale,
                              budget_split=budget_split, max_dim=max_dim)
  if n < need:
    options = "" if dim is None else f", dim={dim}"
    options += "" if covariance_scale == "paper" else f", covariance_scale={covariance_scale!r}"
    warn_underpowered(
        f"low_dimensional_synthetic_data: at n={n:,} rows (d={d}, ε={epsilon:g}{options}) the "
        "public terms of its error bound (the covariance noise and the synthetic step) exceed "
        f"√d/2 = {math.sqrt(d) / 2:.3g}, the 1-Wasserstein distance within which n copies of "
        "the cube's centre lie from any data: the synthetic rows may say little. That accuracy "
        f"needs n ≥ {need:,} rows (dpjax.synthetic.synthetic_required_n({d}, "
        f"epsilon={epsilon:g}{options})); or raise epsilon. The result is still private.")


def _check_cube_rows(X) -> jax.Array:
  X = v.check_data(X, "X", min_rows=2)
  if v.is_traced(X):
    raise TypeError("low_dimensional_synthetic_data runs eagerly (d' sets shapes and PSMM "
                    "solves an LP on the host); call it outside jit/vmap.")
  lo, hi = float(jnp.min(X)), float(jnp.max(X))
  if lo < 0.0 or hi > 1.0:
    raise ValueError(f"X must lie in the unit cube [0, 1]^d (its rows span [{lo:.3g}, {hi:.3g}]); "
                     "rescale with public bounds first: dpjax.data.scale_to_unit_cube(X, lower, "
                     "upper), with lower/upper known without looking at the data.")
  return X


def _split(epsilon: float, budget_split) -> tuple[float, float, float]:
  try:
    parts = tuple(float(p) for p in budget_split)
  except TypeError as exc:
    raise ValueError(f"budget_split must be three fractions, got {budget_split!r}.") from exc
  if len(parts) != 3 or not all(p > 0 and math.isfinite(p) for p in parts) \
      or abs(sum(parts) - 1.0) > 1e-9:
    raise ValueError(f"budget_split must be three positive fractions summing to 1, got "
                     f"{budget_split!r}.")
  # The three parts must not exceed ε in floating point: scale the last one down by the excess.
  eps = [epsilon * p for p in parts]
  eps[2] = min(eps[2], epsilon - eps[0] - eps[1])
  return eps[0], eps[1], eps[2]


def _choose_method(method, dim, radius, epsilon_n, side, max_cells) -> str:
  if method == "pmm" or (method == "auto" and dim <= 2):
    return "pmm"
  if method == "psmm":
    psmm_lib.psmm_lattice(radius, dim, epsilon_n, side=side, max_cells=max_cells)   # raises
    return "psmm"
  try:
    psmm_lib.psmm_lattice(radius, dim, epsilon_n, side=side, max_cells=max_cells)
  except ValueError:
    return "pmm"
  return "psmm"
