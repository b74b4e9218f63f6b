"""The Ashtiani–Liaw exact subspace learner ([AL22] Algorithm 2, Thm 4.1; docs/algorithms.md §3.3).

Learns ``range(Σ)`` exactly in its stable-mode form: split the rows into groups, let every group
propose the projection onto its row space, snap the proposals to a public random grid, and
release the majority proposal behind a truncated-Laplace test on its count. Polynomial time (one
SVD per group, jitted, float64).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import linalg
from dpjax._core.noise import truncated_laplace_sample
from dpjax._host import float64
from dpjax.mechanisms.truncated_laplace import truncated_laplace_params, truncated_laplace_survival
from dpjax.results import SubspaceResult
from dpjax.ledger import with_ledger

__all__ = ["ALSubspaceParameters", "al_subspace", "al_subspace_core", "al_subspace_parameters",
           "released_basis"]

_SNAP_DELTA_SHARE = 11.0       # as in dpese: the test gets δ/1.1, snapping is given δ/11
_SNAP_SCALE_RANGE = (2.0**-40, 0.25)   # × (1/d) at the top: keeps ‖snapping error‖ < 1/4


class ALSubspaceParameters(NamedTuple):
  """The public parameters of one :func:`al_subspace` run, from ``(n, d, ε, δ)`` and options only.

  Attributes:
    num_groups: ``k``, the number of disjoint groups.
    group_size: ``m = ⌊n/k⌋`` rows per group (the last ``n − km`` permuted rows are unused).
    min_groups: ``k_min = ⌈4A⌉ + 3``, the fewest groups for which unanimous groups pass surely.
    rank_tol: a group's rank counts singular values ``> rank_tol · σ_max`` of its block.
    snap_scale: the grid step ``s`` of the snapping grid ``s(ℤ + ω)``.
    tlap_epsilon, tlap_delta: the parameters of the test noise ``TLap(1, ε, δ/1.1)``.
    tlap_bound: ``A = (1/ε) ln(1 + (e^ε − 1)/(2 δ_T))``, the noise's support bound.
    majority: ``⌊k/2⌋ + 1``; a winning count ``c* ≤ majority`` gives ⊥ surely.
    threshold: ``majority + A``; the test passes iff ``c* + Z > threshold``.
    sure_pass_count: ``majority + ⌊2A⌋ + 1``; ``c* ≥`` this passes surely.
  """
  num_groups: int
  group_size: int
  min_groups: int
  rank_tol: float
  snap_scale: float
  tlap_epsilon: float
  tlap_delta: float
  tlap_bound: float
  majority: int
  threshold: float
  sure_pass_count: int


def _al_min_groups(epsilon: float, delta: float) -> tuple[int, float]:
  bound = truncated_laplace_params(1.0, epsilon, delta / 1.1).bound
  return math.ceil(4.0 * bound) + 3, bound


def al_subspace_parameters(n: int, d: int, *, epsilon: float, delta: float,
                           num_groups: int | None = None, rank_tol: float | None = None,
                           snap_scale: float | None = None,
                           unit_roundoff: float = 2.0**-53) -> ALSubspaceParameters:
  """Computes (and validates) the public parameters of :func:`al_subspace`.

  Defaults (docs/algorithms.md §3.3, PROPOSED):

  * ``num_groups = max(k_min, min(n // d, 4 k_min))`` with ``k_min = ⌈4A⌉ + 3`` (A at the test's
    δ/1.1): at least ``k_min`` groups, so that unanimous groups pass surely; group size
    ``m = ⌊n/k⌋ ≥ d`` so that a group spans ``range(Σ)`` whatever its (unknown) rank; extra rows
    buy more groups (more tolerated outlier groups) up to ``4 k_min``, then larger groups.
  * ``rank_tol = 1e-9`` for float64 / integer data: a singular value counts if it exceeds
    ``1e-9 σ_max`` of its block. Rounding leaves ≈ 1e-16·√d σ_max outside the range (cut with a
    wide margin), while data whose covariance has condition number 1e8 within its range
    (singular values spread 1e4) keep their rank with a wide margin (checked up to 1e16 at
    d = 10, m = 10). 1e-5 for float32 data, 1e-2 for 16-bit.
  * ``snap_scale = min(10 d e_F/(δ/11), 1/(100 d))`` with ``e_F = 100 d u`` (u the input's unit
    roundoff; κ = 1): dpese's rule, capped so that the snapping error (≤ d s in operator norm)
    stays ≤ 0.01 and the nearest projection keeps the rank.

  Args:
    n, d: the data's shape (public).
    epsilon, delta: the budget; δ ∈ (0, 1/2).
    num_groups: ``k ≥ 3`` (``k ≤ 2`` can never pass), ``k ≤ n``.
    rank_tol: in (0, 1).
    snap_scale: ``s ∈ [2^-40, 1/(4d)]``.
    unit_roundoff: u of the data's dtype (2^-53 for float64 and integer data, 2^-24 for float32).

  Returns:
    :class:`ALSubspaceParameters`.

  Raises:
    ValueError: a bad argument, ``n < k_min · d`` with the default ``num_groups``, or a
      ``num_groups`` so small that even unanimous groups pass the test with probability
      ≤ δ/1.1 (``num_groups ≤ 4``: ⊥ would be certain).
    TypeError: a non-integer ``num_groups``.

  Warns:
    UnderpoweredWarning: a ``num_groups`` with which unanimous groups do not pass surely (at most
      ``k_min − 1``); the message gives the largest pass probability and ``k_min``.

  References:
    Ashtiani & Liaw, "Private and polynomial time algorithms for learning Gaussians and
    beyond", COLT 2022, Algorithm 2, Thm 4.1 (constants PROPOSED in docs/algorithms.md §3.3).
  """
  n = v.check_int(n, "n", low=1)
  d = v.check_int(d, "d", low=1)
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta, upper=0.5)
  tlap_delta = delta / 1.1
  k_min, bound = _al_min_groups(epsilon, delta)
  if num_groups is None:
    if n < k_min * d:
      raise ValueError(
          f"n too small: needs at least {k_min * d} rows (k_min = {k_min} groups of at least "
          f"d = {d} rows each, for epsilon={epsilon:g}, delta={delta:g}), got n={n}. Use more "
          f"rows, a larger epsilon or delta, or pass num_groups knowingly.")
    k = max(k_min, min(n // d, 4 * k_min))
  else:
    k = v.check_int(num_groups, "num_groups", low=3, high=n)
    # ⊥ from public numbers alone: c* ≤ k, so even unanimous groups pass only when the test
    # noise Z ~ TLap(1, ε, δ/1.1) exceeds A + ⌊k/2⌋ + 1 − k. Refuse when that is ≤ δ/1.1
    # (k ≤ 4), warn when it is < 1. No data involved: privacy is unchanged.
    best = truncated_laplace_survival(bound + (k // 2 + 1) - k, 1.0 / epsilon, bound)
    v.check_test_can_pass(
        best, tlap_delta, sure=best >= 1.0,
        refusal=(f"al_subspace would answer ⊥ (almost) surely: with num_groups={k} even "
                 f"unanimous groups pass the test with probability {best:.3g} <= "
                 f"delta/1.1={tlap_delta:g}; use num_groups >= min_groups = {k_min} (for "
                 f"epsilon={epsilon:g}, delta={delta:g})."),
        warning=(f"al_subspace: with num_groups={k} < min_groups = {k_min} (for "
                 f"epsilon={epsilon:g}, delta={delta:g}), the test passes with probability at "
                 f"most {v.probability_text(best)} even when all groups agree (⊥ otherwise); "
                 f"use num_groups >= {k_min} for a sure pass."))
  if rank_tol is None:
    rank_tol = 1e-9 if unit_roundoff <= 2.0**-53 else (1e-5 if unit_roundoff <= 2.0**-24
                                                        else 1e-2)
  rank_tol = v.check_positive(rank_tol, "rank_tol")
  if rank_tol >= 1.0:
    raise ValueError(f"rank_tol must lie in (0, 1), got rank_tol={rank_tol!r}.")
  if snap_scale is None:
    e_f = 100 * d * unit_roundoff                           # κ = 1
    snap_scale = min(10 * d * e_f / (delta / _SNAP_DELTA_SHARE), 0.01 / d)
  s = v.check_positive(snap_scale, "snap_scale")
  lo, hi = _SNAP_SCALE_RANGE[0], _SNAP_SCALE_RANGE[1] / d
  if not lo <= s <= hi:
    raise ValueError(f"snap_scale must lie in [2^-40, 1/(4d)] = [{lo:.3g}, {hi:.3g}] for d={d}, "
                     f"got snap_scale={snap_scale!r}.")
  majority = k // 2 + 1
  return ALSubspaceParameters(
      num_groups=k, group_size=n // k, min_groups=k_min, rank_tol=rank_tol, snap_scale=s,
      tlap_epsilon=epsilon, tlap_delta=tlap_delta, tlap_bound=bound, majority=majority,
      threshold=majority + bound, sure_pass_count=majority + math.floor(2.0 * bound) + 1)


@with_ledger
def al_subspace(key: jax.Array, X, *, epsilon: float, delta: float,
                num_groups: int | None = None, rank_tol: float | None = None,
                snap_scale: float | None = None) -> SubspaceResult:
  """Learns ``range(Σ)`` exactly from zero-mean rows with the Ashtiani–Liaw exact learner.

  Usage::

      res = dpjax.ashtiani_liaw.al_subspace(jax.random.key(0), X, epsilon=1.0, delta=1e-6)
      basis = dpjax.ashtiani_liaw.released_basis(res)   # (d, r): r the released rank, 0 on ⊥

  For ``x_i ~ N(0, Σ)`` (Σ possibly singular) every group of ``m ≥ rank Σ`` rows spans
  ``range(Σ)`` almost surely; the learner releases the majority of k groups' projections, snapped
  to a public grid of step s, if a truncated-Laplace test on its count passes
  (``n = O(d ln(1/δ)/ε)`` rows), else ⊥: when the groups disagree (data not exactly low-rank
  within ``rank_tol``, ``m`` below the rank, outliers in about half of the groups). Full-rank
  data give ``R^d``.

  Privacy: (ε, δ)-DP under replace-one (n public): one row changes one group's snapped proposal,
  so the majority count has sensitivity 1 and a winning majority is the same on both neighbours;
  the test's TLap noise makes the decision (ε, δ/1.1)-DP (δ/11 kept unspent) and the released
  value is identical on neighbours (no float leak, §1.10). Utility: the test passes surely when
  ``info["sure_pass_count"]`` groups agree (up to ``info["outlier_groups_tolerated"]`` spoiled
  groups); the release is within ``d·s`` of the common projection in operator norm. Algorithm
  and proofs: docs/algorithms.md §3.3.

  Args:
    key: PRNG key (split into the permutation, the offset ω and the test noise).
    X: ``(n, d)`` real array, rows are individuals, zero mean (for an unknown mean pass pairwise
      differences ``x_{2i} − x_{2i−1}``). Integer and float64 data are used exactly; float32
      rows are low-rank only up to ≈ 1e-7 relative rounding, hence looser float32 defaults.
    epsilon, delta: ε > 0 (nats), δ ∈ (0, 1/2).
    num_groups: ``k`` (default ``max(k_min, min(n // d, 4 k_min))``, see
      :func:`al_subspace_parameters`); an explicit k may make groups smaller than d (good when
      rank Σ is known to be small).
    rank_tol: relative singular-value threshold of a group's rank (default 1e-9 for float64 /
      integer data, 1e-5 for float32).
    snap_scale: the grid step ``s`` (default ``min(10 d e_F/(δ/11), 1/(100 d))``,
      ``e_F = 100 d u``).

  Returns:
    :class:`~dpjax.results.SubspaceResult`: ``ok`` (bool scalar), ``basis (d, d)`` in X's dtype
    (16-bit floats upcast to float32) whose first ``r = released["rank"]`` columns are an
    orthonormal basis of the released projection (by decreasing eigenvalue) and whose other
    columns are zeros (static shapes; all zeros and ``r = 0`` on ⊥), ``epsilon``, ``delta``,
    ``neighboring=REPLACE_ONE``, and ``info`` with the public parameters (``num_groups``,
    ``group_size``, ``min_groups``, ``snap_scale``, ``rank_tol``, ``threshold``, ``tlap_bound``,
    ``sure_pass_count``, ``outlier_groups_tolerated``); :func:`released_basis` trims the basis.
    Computed in float64; traceable in ``key`` and ``X`` inside ``with jax.enable_x64(True):``
    (the eager test bit and rank per key, the basis up to rounding; non-finite ``X`` gives ⊥).

  Raises:
    TypeError: ``key`` is not a PRNG key, ``X`` not a real array, ``num_groups`` not an integer;
      traced with JAX's x64 mode off (call it eagerly, or trace inside ``jax.enable_x64(True)``).
    ValueError: NaN/inf in a concrete ``X``, ``X`` not 2-D, ε ≤ 0, δ ∉ (0, 1/2),
      ``num_groups ∉ [3, n]``, ``rank_tol ∉ (0, 1)``, ``snap_scale ∉ [2^-40, 1/(4d)]``, n too
      small for the default ``num_groups`` (``n < k_min·d``), or ``num_groups ≤ 4`` (⊥ certain
      up to δ/1.1).

  Warns:
    UnderpoweredWarning: a ``num_groups`` with which even unanimous groups may fail the test (see
    :func:`al_subspace_parameters`).

  References:
    [AL22] Ashtiani & Liaw, COLT 2022, Algorithm 2, Thm 4.1; docs/algorithms.md §3.3, §1.3, §1.10.
  """
  key = v.check_key(key)
  checked = v.check_data(X, "X")
  raw_dtype = np.asarray(X).dtype if not isinstance(X, jax.Array) else X.dtype
  if np.issubdtype(raw_dtype, np.integer):
    unit_roundoff = 2.0**-53
  else:
    unit_roundoff = float(jnp.finfo(raw_dtype).eps) / 2
  n, d = checked.shape
  params = al_subspace_parameters(n, d, epsilon=epsilon, delta=delta, num_groups=num_groups,
                                  rank_tol=rank_tol, snap_scale=snap_scale,
                                  unit_roundoff=unit_roundoff)
  info = al_subspace_info(params)
  raw = checked if v.is_traced(checked) else np.asarray(X)   # float64 input keeps its digits
  ok, basis, rank = float64("al_subspace", functools.partial(_al_subspace_release,
                                                             params=params), key, raw)
  return SubspaceResult(ok=jnp.asarray(ok), basis=jnp.asarray(basis, checked.dtype),
                        released={"rank": jnp.asarray(rank, jnp.int32)},
                        epsilon=params.tlap_epsilon, delta=float(delta),
                        neighboring=NeighboringRelation.REPLACE_ONE, info=info)


def al_subspace_info(params: ALSubspaceParameters) -> dict:
  """The public ``info`` of an :func:`al_subspace` result with these parameters."""
  return {
      "num_groups": params.num_groups,
      "group_size": params.group_size,
      "min_groups": params.min_groups,
      "snap_scale": params.snap_scale,
      "rank_tol": params.rank_tol,
      "threshold": params.threshold,
      "tlap_bound": params.tlap_bound,
      "sure_pass_count": params.sure_pass_count,
      "outlier_groups_tolerated": params.num_groups - params.sure_pass_count,
  }


def _al_subspace_release(key, X, params):
  """:func:`al_subspace`'s release, traceable JAX in float64 (run through ``float64``): ``(ok,
  basis (d, d) zero-padded, rank)``. A non-finite X (reachable only traced: a concrete X is
  validated) lies outside the domain and gives ⊥."""
  X = jnp.asarray(X, jnp.float64)                   # integer data: exact up to 2^53
  ok, snapped = al_subspace_core(key, jnp.where(v.all_finite(X), X, 0.0), params)
  ok, snapped = v.domain_bottom(X, ok, snapped)
  return (ok, *nearest_projection_basis(snapped))   # post-processing of the released Π* (0 on ⊥)


def released_basis(result) -> np.ndarray:
  """The ``(d, r)`` basis of a concrete :func:`al_subspace` result (``r = released["rank"]``)."""
  return np.asarray(result.basis)[:, :int(result.released["rank"])]


def nearest_projection_basis(P: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Orthonormal basis of the orthogonal projection nearest to a symmetric ``P`` (traceable).

  The nearest projection (in Frobenius or operator norm) keeps the eigenvectors with eigenvalue
  > 1/2. Returns ``(basis (d, d), rank)``: the kept eigenvectors in the first ``rank`` columns,
  ordered by decreasing eigenvalue, and zeros in the others (static shapes); ``P = 0`` gives
  rank 0.
  """
  w, vecs = jnp.linalg.eigh((P + P.T) / 2)          # ascending
  w, vecs = w[::-1], vecs[:, ::-1]                   # decreasing: the kept ones come first
  keep = w > 0.5
  return jnp.where(keep[None, :], vecs, 0.0), jnp.sum(keep).astype(jnp.int32)


def al_subspace_core(key: jax.Array, X: jax.Array, params: ALSubspaceParameters):
  """:func:`al_subspace` without validation or post-processing: traceable in ``key`` and ``X``.

  Call it under ``jax.enable_x64(True)`` with float64 ``X`` (what :func:`al_subspace` does); the
  privacy argument does not depend on the dtype, utility does. Same guarantee as
  :func:`al_subspace` (the released value is ``(ok, Π*)``).

  Returns:
    ``(ok, Π* (d, d))``: the snapped majority projection ``s(z* + ω)`` when ``ok``, zeros
    otherwise.
  """
  return _al_core(key, X, params.rank_tol, params.snap_scale, 1.0 / params.tlap_epsilon,
                  params.tlap_bound, k=params.num_groups, m=params.group_size)


@functools.partial(jax.jit, static_argnames=("k", "m"))
def _al_core(key, X, rank_tol, snap_scale, noise_scale, bound, *, k, m):
  dtype = X.dtype
  d = X.shape[1]
  k_perm, k_off, k_noise = jax.random.split(key, 3)
  perm = jax.random.permutation(k_perm, X.shape[0])
  blocks = X[perm[: k * m]].reshape(k, m, d)

  def group_projection(block):
    _, sv, vt = jnp.linalg.svd(block, full_matrices=False)     # vt: (min(m, d), d)
    keep = (sv > rank_tol * sv[0]).astype(dtype)                # σ_max = 0: rank 0
    return (vt.T * keep[None, :]) @ vt

  # Π_i must depend on group i alone: batched only where that is verified (linalg's policy).
  proj = linalg.map_blocks(group_projection, blocks)            # (k, d, d)
  offset = jax.random.uniform(k_off, (d, d), dtype)             # public ω ∈ [0, 1)
  scaled = proj / snap_scale - offset[None]
  valid = jnp.all(jnp.isfinite(scaled) & (jnp.abs(scaled) < 2.0**52), axis=(1, 2))
  cells = jnp.where(valid[:, None, None], jnp.round(scaled), 0.0).astype(jnp.int64)

  def count(args):
    cell, ok_i = args
    same = jnp.all(cells == cell[None], axis=(1, 2)) & valid
    return jnp.where(ok_i, jnp.sum(same), 0)

  counts = jax.lax.map(count, (cells, valid))                   # (k,): c_i, 0 if invalid
  winner = jnp.argmax(counts)
  c_star = counts[winner]
  noise = truncated_laplace_sample(k_noise, (), noise_scale, bound, dtype)
  majority = k // 2 + 1
  ok = noise > bound + (majority - c_star).astype(dtype)       # ⊥ surely when c* ≤ majority
  released = snap_scale * (cells[winner].astype(dtype) + offset)
  return ok, jnp.where(ok, released, jnp.zeros_like(released))
