"""PSMM, the Private Signed Measure Mechanism ([HVZ] Algorithm 5; docs/algorithms.md §4.6).

Points ``a_i`` in the d'-ball of radius R are counted in the cells of a cubic lattice (side h)
that meet the ball; the counts get exact discrete Laplace noise (ℓ1-sensitivity 2 under
replace-one); the noisy counts, divided by n, form a signed measure ν on the cell centres, and
the output is the probability measure μ on the same centres nearest to ν in the
bounded-Lipschitz norm — a linear program solved on the host by SciPy's HiGHS (post-processing).
n points are then placed on the centres in proportions μ (largest-remainder rounding).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from scipy import optimize, sparse
from scipy.spatial.distance import cdist

from dpjax import _validation as v
from dpjax.mechanisms import exact as exact_lib

__all__ = ["Lattice", "bounded_lipschitz_projection", "psmm", "psmm_lattice"]

MAX_CELLS = 400                  # the LP has m'² + 3m' variables: 160k at 400 cells


class Lattice(NamedTuple):
  """The public lattice of PSMM: ``centres (m', d')`` of the cells meeting the ball,
  ``side`` h, ``per_axis`` cells along each axis of ``[−R, R]^{d'}``, ``index (per_axis^{d'},)``
  mapping a cube cell to its row in ``centres`` (−1 outside the ball)."""
  centres: np.ndarray
  side: float
  per_axis: int
  index: np.ndarray


def psmm_lattice(radius: float, dim: int, epsilon_n: float, *, side: float | None = None,
                 max_cells: int = MAX_CELLS) -> Lattice:
  """The lattice of side ``h = R (εn)^{−1/d'}`` ([HVZ] Prop 4.3) restricted to the ball.

  Raises:
    ValueError: more than ``max_cells`` cells (the LP would not finish in reasonable time;
      pass a larger ``side`` or use PMM), or bad arguments.
  """
  radius = v.check_positive(radius, "radius")
  dim = v.check_int(dim, "dim", low=1)
  side = radius * epsilon_n ** (-1.0 / dim) if side is None else v.check_positive(side, "side")
  per_axis = max(1, math.ceil(2 * radius / side))
  if per_axis**dim > 50 * max_cells:
    raise ValueError(f"PSMM's lattice (side {side:.3g}, {per_axis}^{dim} cube cells) is far "
                     f"beyond max_cells={max_cells}; pass a larger side, or method='pmm'.")
  axes = [(np.arange(per_axis) + 0.5) * side - radius] * dim
  centres = np.array(list(itertools.product(*axes)), np.float64).reshape(-1, dim)
  # A cell meets the ball iff the point of the cell nearest to the origin is inside it.
  nearest = np.clip(0.0, centres - side / 2, centres + side / 2)
  inside = np.linalg.norm(nearest, axis=1) <= radius
  if inside.sum() > max_cells:
    raise ValueError(f"PSMM's lattice has {int(inside.sum())} cells in the ball, more than "
                     f"max_cells={max_cells} (the bounded-Lipschitz LP has m'² variables); pass "
                     f"a larger side, a larger max_cells, or method='pmm'.")
  index = np.where(inside, np.cumsum(inside) - 1, -1)
  return Lattice(centres[inside], float(side), per_axis, index)


def psmm_noisy_counts(key: jax.Array, A: jax.Array, lattice: Lattice, radius: float,
                      epsilon: float) -> jax.Array:
  """``(m',)`` int32: cell counts of the rows of ``A (n, d')`` plus exact ``DLap(2/ε)``.

  Guarantee: ε-DP under replace-one (one replaced row moves two counts by one: ℓ1 = 2). A row
  outside the ball is first pulled radially onto it (a fixed map of each row). Traceable.
  """
  dim = A.shape[1]
  # Rows beyond the ball (outside the contract, or by rounding) are first pulled radially onto
  # it: a fixed map of each row, so the sensitivity is unchanged.
  norms = jnp.linalg.norm(A, axis=1, keepdims=True)
  A = jnp.where(norms > radius, A * (radius / jnp.where(norms > 0, norms, 1.0)), A)
  cell = jnp.clip(jnp.floor((A + radius) / lattice.side), 0, lattice.per_axis - 1)
  cell = cell.astype(jnp.int32)
  flat = jnp.zeros(A.shape[0], jnp.int32)
  for c in range(dim):
    flat = flat * lattice.per_axis + cell[:, c]
  rows = jnp.asarray(lattice.index, jnp.int32)[flat]
  m = lattice.centres.shape[0]
  # A point of the ball always lies in a kept cell; a rounding case that does not goes to the
  # kept cell nearest to the origin (fixed).
  rows = jnp.where(rows >= 0, rows, int(np.argmin(np.linalg.norm(lattice.centres, axis=1))))
  counts = jnp.bincount(rows, length=m).astype(jnp.int32)
  num, den = exact_lib.rational_scale(2.0 / epsilon)
  return counts + exact_lib.exact_discrete_laplace(key, (m,), num, den)


def bounded_lipschitz_projection(signed: np.ndarray, centres: np.ndarray) -> np.ndarray:
  """The probability vector μ on ``centres`` nearest to the signed measure ``signed`` in the
  bounded-Lipschitz norm (post-processing, host, SciPy HiGHS).

  ``‖σ‖_BL = min{ Σ_kl d_kl F_kl + Σ_k (u_k + w_k) : F, u, w ≥ 0,
  Σ_l F_kl − Σ_l F_lk + u_k − w_k = σ_k }`` (moving mass costs its distance, creating or
  destroying it costs 1), minimised jointly over ``μ ≥ 0``, ``Σ μ = 1``, ``σ = μ − signed``
  (docs/algorithms.md §4.6 [DERIVED formulation]).

  Returns:
    ``(m',)`` float64, non-negative, summing to 1.
  """
  m = len(signed)
  D = cdist(centres, centres)
  off = ~np.eye(m, dtype=bool)
  pairs = np.argwhere(off)                          # F_kl for k ≠ l (F_kk moves nothing)
  num_f = len(pairs)
  # Columns: F (num_f), u (m), w (m), μ (m). Rows: m balances, then Σ μ = 1.
  f_cols = np.arange(num_f)
  rows = np.concatenate([pairs[:, 0], pairs[:, 1], np.arange(m), np.arange(m), np.arange(m),
                         np.full(m, m)])
  cols = np.concatenate([f_cols, f_cols, num_f + np.arange(m), num_f + m + np.arange(m),
                         num_f + 2 * m + np.arange(m), num_f + 2 * m + np.arange(m)])
  vals = np.concatenate([np.ones(num_f), -np.ones(num_f), np.ones(m), -np.ones(m),
                         -np.ones(m), np.ones(m)])
  A_eq = sparse.csr_matrix((vals, (rows, cols)), shape=(m + 1, num_f + 3 * m))
  b_eq = np.concatenate([-np.asarray(signed, np.float64), [1.0]])
  cost = np.concatenate([D[off], np.ones(2 * m), np.zeros(m)])
  res = optimize.linprog(cost, A_eq=A_eq, b_eq=b_eq, bounds=(0, None), method="highs")
  if res.status != 0:                               # pragma: no cover - the LP is always feasible
    raise RuntimeError(f"the bounded-Lipschitz LP failed: {res.message}")
  mu = np.maximum(res.x[num_f + 2 * m:], 0.0)
  return mu / mu.sum()


def round_to_counts(mu: np.ndarray, n: int) -> np.ndarray:
  """Largest-remainder rounding of ``n·μ`` to non-negative integers summing to n."""
  raw = n * np.asarray(mu, np.float64)
  counts = np.floor(raw).astype(np.int64)
  short = n - counts.sum()
  counts[np.argsort(counts - raw, kind="stable")[:short]] += 1
  return counts


def psmm(key: jax.Array, A, *, epsilon: float, radius: float, side: float | None = None,
         max_cells: int = MAX_CELLS) -> tuple[np.ndarray, dict]:
  """PSMM on rows ``A (n, d')`` in the ball of radius R: ``(points (n, d'), released)``.

  Args:
    key: PRNG key.
    A: ``(n, d')`` float rows, ``‖a_i‖ ≤ radius`` (the caller's contract; a row outside is
      pulled radially onto the ball first).
    epsilon: ε > 0 of this release.
    radius: R, public (or a DP output).
    side: lattice side (default ``R (εn)^{−1/d'}``).
    max_cells: refuse a lattice with more cells (ValueError): the LP grows like m'².

  Returns:
    ``points``: ``(n, d')`` float64 NumPy, on the cell centres, rows shuffled;
    ``released``: ``{"noisy_counts": (m',) int32, "centres": (m', d')}``.

  Guarantee: ε-DP under replace-one (:func:`psmm_noisy_counts`); the LP, the rounding and the
  placement are post-processing.

  References:
    He, Vershynin & Zhu (2023); [HVZ] Algorithm 5 and Prop 4.3; docs/algorithms.md §4.6.
  """
  v.check_key(key)
  A = v.check_data(A, "A")
  epsilon = v.check_epsilon(epsilon)
  n, dim = A.shape
  lattice = psmm_lattice(radius, dim, epsilon * n, side=side, max_cells=max_cells)
  k_counts, k_order = jax.random.split(key)
  noisy = np.asarray(psmm_noisy_counts(k_counts, A, lattice, float(radius), epsilon))
  mu = bounded_lipschitz_projection(noisy / n, lattice.centres)
  counts = round_to_counts(mu, n)
  points = np.repeat(lattice.centres, counts, axis=0)
  order = np.asarray(jax.random.permutation(k_order, n))
  return points[order], {"noisy_counts": noisy, "centres": lattice.centres}
