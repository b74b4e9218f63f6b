"""DPESE — the DP Exact Subspace Estimator ([SS21] Algorithm 1; docs/algorithms.md §2.1).

For data of which all but ℓ rows lie in one k-dimensional subspace, DPESE outputs that subspace
exactly with ``n = O(ℓ + ln(1/δ)/ε)`` rows, whatever d. Every k-dim subspace gets the score
``u(s) = |X ∩ s| − max_{t ⊊ s} |X ∩ t|`` (sensitivity 1); the top candidate is released by the
thresholded GAP-MAX (§1.6) with exact integer noise, or ⊥.

Candidate enumeration is host-side (NumPy, float64) and exponential in k: the work estimate from
the public ``(n, k)`` is checked against a cap before anything runs. Intended for small ``n``
(≲ 100) and ``k`` (≲ 4). (The Ashtiani–Liaw exact learner is ``dpjax.ashtiani_liaw.al_subspace``.)
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax._core.noise import truncated_laplace_sample
from dpjax._host import eager_only, host_call, host_rng
from dpjax.mechanisms.gap_max import gap_max_core, gap_max_parameters
from dpjax.mechanisms.truncated_laplace import truncated_laplace_params
from dpjax.results import SubspaceResult, warn_underpowered
from dpjax.ledger import with_ledger

__all__ = ["dpese", "dpese_required_n"]

DEFAULT_MAX_WORK = 10_000_000


class Candidates(NamedTuple):
  """Distinct k-dim subspaces spanned by k rows, in enumeration order (first spanning k-subset).

  Attributes:
    members: ``(C, n)`` bool membership of every row in every candidate (after zero rows are
      dropped).
    scores: ``(C,)`` int32 scores ``|X ∩ s| − max_{t ⊊ s} |X ∩ t|``.
  """
  members: np.ndarray
  scores: np.ndarray


def work_estimate(n: int, k: int) -> int:
  """``C(n, k) · C(n, k − 1)``: candidate × hyperplane pairs, from public ``(n, k)`` only."""
  return math.comb(n, k) * math.comb(n, k - 1)


def enumerate_candidates(X: np.ndarray, k: int, *, tol: float = 1e-9) -> Candidates:
  """Enumerates and scores every distinct k-dim subspace spanned by k rows (non-private).

  Membership: ``‖x − B Bᵀ x‖ ≤ tol·‖x‖`` with B an orthonormal basis of the candidate; proper
  subspaces: hyperplanes of the candidate spanned by k − 1 member rows (any proper subspace
  spanned by members extends to one with at least as many members); for k = 1 only ``{0}``,
  which holds no (non-zero) row. Candidates are deduplicated by member set.
  """
  X = np.asarray(X, np.float64)
  n = X.shape[0]
  norms = np.linalg.norm(X, axis=1)
  seen: dict[bytes, int] = {}
  members_list, scores = [], []
  for subset in itertools.combinations(range(n), k):
    rows = X[list(subset)]
    q, r = np.linalg.qr(rows.T)
    if np.min(np.abs(np.diag(r))) <= tol * max(1.0, np.max(norms[list(subset)])):
      continue                                              # rank < k
    member = _members(X, q, norms, tol)
    # Refit the basis to all members once: a nearly collinear spanning k-subset gives a tilted
    # basis and a spurious near-copy of the candidate; the refit makes their member sets agree.
    _, _, vt = np.linalg.svd(X[member], full_matrices=False)
    q = vt[:k].T
    member = _members(X, q, norms, tol) | member
    key = np.packbits(member).tobytes()
    if key in seen:
      continue
    seen[key] = len(scores)
    members_list.append(member)
    scores.append(int(member.sum()) - _max_hyperplane_count(X[member] @ q, k, tol))
  if not scores:
    return Candidates(np.zeros((0, n), bool), np.zeros((0,), np.int32))
  return Candidates(np.stack(members_list), np.asarray(scores, np.int32))


def _members(X, q, norms, tol):
  residual = np.linalg.norm(X - (X @ q) @ q.T, axis=1)
  return residual <= tol * np.maximum(norms, 1e-300)


def _max_hyperplane_count(Y: np.ndarray, k: int, tol: float) -> int:
  """Max over hyperplanes spanned by k−1 rows of ``Y (c, k)`` of the rows they contain."""
  if k == 1:
    return 0
  c = Y.shape[0]
  combos = np.asarray(list(itertools.combinations(range(c), k - 1)), np.int64)
  spans = Y[combos]                                         # (C', k−1, k)
  _, svals, vt = np.linalg.svd(spans)
  full_rank = svals[:, -1] > tol * np.maximum(svals[:, 0], 1e-300)
  normals = vt[:, -1, :]                                    # (C', k): normal within R^k
  inside = np.abs(Y @ normals.T) <= tol * np.linalg.norm(Y, axis=1)[:, None]
  counts = np.where(full_rank, inside.sum(axis=0), 0)
  return int(counts.max(initial=0))


def dpese_required_n(k: int, *, epsilon: float, delta: float, outliers: int = 0) -> int:
  """Rows :func:`dpese` needs to release surely when all but ``outliers`` rows lie in one
  k-dimensional subspace (in general position within it); the number its
  :class:`dpjax.UnderpoweredWarning` quotes (``outliers=0``), which it gives exactly when n is
  below it.

  >>> import dpjax
  >>> dpjax.subspace.dpese_required_n(3, epsilon=1.0, delta=1e-6)
  56

  GAP-MAX releases surely when the top score beats the second by its public ``sure_gap``
  (:func:`dpjax.mechanisms.gap_max_parameters` at δ/1.1, integer scores). With no outlier every
  enumerated candidate is the one subspace (``u1 = n``, ``u2 = 0``); with o outliers another
  subspace holds at most k − 1 inliers and the o outliers, so the answer is
  ``sure_gap + 2o + k − 1`` (docs/algorithms.md §2.1). Public numbers only.

  Raises:
    ValueError: bad k, ε, δ (< 1/2) or outliers.
  """
  k = v.check_int(k, "k", low=1)
  epsilon, delta = v.check_epsilon(epsilon), v.check_delta(delta, upper=0.5)
  outliers = v.check_int(outliers, "outliers", low=0)
  sure = int(gap_max_parameters(epsilon, delta / 1.1, integer_scores=True).sure_gap)
  return sure + (0 if outliers == 0 else 2 * outliers + k - 1)


@with_ledger
def dpese(key: jax.Array, X, *, epsilon: float, delta: float, k: int, tol: float | None = None,
          snap_scale: float | None = None, max_work: int = DEFAULT_MAX_WORK,
          unsafe_paper_variant: bool = False, ell: int | None = None) -> SubspaceResult:
  """Learns a subspace that contains all but a few rows, exactly, with DPESE.

  Usage::

      res = dpjax.subspace.dpese(jax.random.key(0), X, epsilon=1.0, delta=1e-6, k=2)
      res.ok, res.basis       # False on ⊥; (d, k). X (n, d), best integer/rational, n ≲ 100

  Default (thresholded GAP-MAX, docs/algorithms.md §2.1 [DERIVED]): score every distinct k-dim
  subspace spanned by k rows, take the top two scores u1 ≥ u2 (u2 = 0 with one candidate),
  ``g = max(0, u1 − u2 − 1)``, and release the top subspace iff ``g + Z ≥ K`` with ``Z`` exact
  discrete truncated Laplace (:func:`dpjax.mechanisms.gap_max`), else ⊥; candidates reach
  GAP-MAX in a random order from ``key``. The released value is the canonical projection,
  snapped to a randomly offset public grid (§1.10 rule 3).

  Guarantee: (ε, δ)-DP under replace-one, for exact membership: each score has sensitivity 1 and
  subspaces not enumerated score 0, so GAP-MAX's argument applies (δ/1.1 to it, δ/11 to
  snapping). With floating-point membership (``tol``) the predicate is still a fixed per-row
  test, but exactness of "the same subspace" is heuristic, and the snapping is a
  numerical-analysis argument, not a proof: exact (rational) data are the rigorous route.
  ``unsafe_paper_variant=True`` runs the algorithm as printed in [SS21]; it is NOT (ε, δ)-DP for
  data-dependent candidate sets (a near-uniform draw from candidates, a fraction ≈ k/n of which
  exist only because of one row; tests/subspace/test_exact.py demonstrates it). For replication
  only. Proofs, the counterexample and the defaults: docs/algorithms.md §2.1, §1.10.

  Args:
    key: PRNG key.
    X: ``(n, d)`` float data (rows are individuals); integer/rational-valued data are best.
    epsilon, delta: the budget; δ < 1/2.
    k: subspace dimension.
    tol: relative membership tolerance (public; default 1e-4 for float32 input, 1e-9 for
      float64).
    snap_scale: the snapping grid step s (default for well-conditioned rows; pass a larger one
      for ill-conditioned data, at a cost of ≈ d·s in ‖Π̂ − Π‖).
    max_work: cap on :func:`work_estimate` (raise it knowingly).
    unsafe_paper_variant, ell: see above (ℓ is only used by the paper's NULL score).

  Returns:
    :class:`~dpjax.results.SubspaceResult` (neighboring ``REPLACE_ONE``) with a ``(d, k)``
    basis in JAX's default float dtype; ``info`` has the public work estimate, ``tol`` and
    ``snap_scale`` (not the data-dependent number of candidates). With
    ``unsafe_paper_variant=True``: ``epsilon=inf``, ``delta=1``, ``neighboring=None`` (not
    private) and the nominal budget in ``info``. Traceable in ``key`` and ``X`` (the default
    variant; host work as a ``jax.pure_callback``, the same output per key); a non-finite
    traced ``X`` gives ⊥. The unsafe variant runs eagerly only.

  Raises:
    ValueError: bad arguments (NaN/inf in a concrete X included), ε below GAP-MAX's range, or
      the work estimate above ``max_work``.
    TypeError: ``unsafe_paper_variant=True`` under ``jit`` / ``vmap``.

  Warns:
    dpjax.UnderpoweredWarning: n below :func:`dpese_required_n` (GAP-MAX can answer ⊥ even
      when every row lies in one k-dim subspace); the message gives that number.
  """
  key = v.check_key(key)
  X = v.check_data(X, "X")
  if tol is None:
    tol = 1e-9 if X.dtype == jnp.float64 else 1e-4
  n, d = X.shape
  k = v.check_int(k, "k", low=1, high=d)
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta, upper=0.5)
  tol = v.check_positive(tol, "tol")
  max_work = v.check_int(max_work, "max_work", low=1)
  work = work_estimate(n, k)
  if work > max_work:
    raise ValueError(f"DPESE's enumeration would take about {work:.3g} candidate-hyperplane "
                     f"evaluations for n={n}, k={k}, above max_work={max_work:.3g}; use fewer "
                     "rows, a smaller k, DPASE, or raise max_work knowingly.")
  if snap_scale is None:
    e_f = 100 * d * 2.0**-53           # κ = 1: well-conditioned member rows
    snap_scale = 10 * d * e_f / (delta / 11.0)
  snap_scale = v.check_positive(snap_scale, "snap_scale")
  if unsafe_paper_variant and ell is None:
    raise ValueError("unsafe_paper_variant needs ell (the robustness parameter ℓ).")
  ell = None if ell is None else v.check_int(ell, "ell", low=0)
  info = {"work_estimate": work, "tol": tol, "snap_scale": snap_scale}
  if not unsafe_paper_variant:
    need = dpese_required_n(k, epsilon=epsilon, delta=delta)
    if n < need:
      warn_underpowered(
          f"dpese: at n={n:,} rows (k={k}, ε={epsilon:g}, δ={delta:g}) GAP-MAX's test can answer "
          "⊥ even when every row lies in one k-dimensional subspace. A sure release on such "
          f"rows needs n ≥ {need:,} rows (dpjax.subspace.dpese_required_n({k}, "
          f"epsilon={epsilon:g}, delta={delta:g}); more with outliers: outliers=...); or raise "
          "epsilon. The result is still private.")

  if unsafe_paper_variant:
    eager_only("dpese(unsafe_paper_variant=True)", key, X, cores="paper_variant_select")
    ok, basis = _paper_variant(key, np.asarray(X, np.float64), k=k, epsilon=epsilon,
                               delta=delta, tol=tol, snap_scale=snap_scale, ell=ell)
    info.update(variant="unsafe_paper_variant", nominal_epsilon=epsilon, nominal_delta=delta)
    return SubspaceResult(ok=jnp.asarray(ok), basis=jnp.asarray(basis, jnp.result_type(float)),
                          epsilon=math.inf, delta=1.0, neighboring=None, info=info)
  params = gap_max_parameters(epsilon, delta / 1.1, integer_scores=True)
  k_gap, k_host = jax.random.split(key)
  found, top_two, basis = host_call(
      functools.partial(_top_candidate_host, k=k, tol=tol, snap_scale=snap_scale),
      (jax.ShapeDtypeStruct((), np.bool_), jax.ShapeDtypeStruct((2,), np.int32),
       jax.ShapeDtypeStruct((d, k), np.float64)), k_host, X)
  # GAP-MAX decides from the top two scores alone: on (u1, u2) it takes the same decision as on
  # the whole list, and its index 0 is the top candidate the host picked.
  res = gap_max_core(k_gap, jnp.asarray(top_two, jnp.int32), params)
  ok = jnp.asarray(found) & res.ok
  basis = jnp.where(ok, jnp.asarray(basis, jnp.result_type(float)), 0.0)
  return SubspaceResult(ok=ok, basis=basis, epsilon=epsilon, delta=delta,
                        neighboring=NeighboringRelation.REPLACE_ONE, info=info)


def _top_candidate_host(rng, X, *, k, tol, snap_scale):
  """Host (NumPy, float64): ``(found, (u1, u2), snapped basis (d, k) of the top candidate)``.

  The candidates are put in a uniformly random order (public randomness from ``rng``) before
  the top one is taken: GAP-MAX breaks ties by list position, and enumeration follows row order,
  which its proof does not cover. ``u2 = 0`` with one candidate (GAP-MAX's convention);
  ``found`` is False with none (no k independent rows: ⊥, as a low gap) and for a non-finite X
  (reachable only traced: outside the domain). The basis is computed whatever GAP-MAX decides
  and is released only if it answers (the caller's ``where``).
  """
  X = np.asarray(X, np.float64)
  d = X.shape[1]
  nothing = (False, np.zeros(2, np.int32), np.zeros((d, k)))
  if not np.all(np.isfinite(X)):
    return nothing
  X = X[np.linalg.norm(X, axis=1) > 0]          # zero rows lie in every subspace: no information
  candidates = enumerate_candidates(X, k, tol=tol)
  if candidates.scores.size == 0:
    return nothing
  order = rng.permutation(candidates.scores.size)
  ranked = candidates.scores[order]
  top = order[int(np.argmax(ranked))]           # the first in the random order among ties
  u = np.sort(ranked)[::-1]
  top_two = np.asarray([u[0], u[1] if u.size > 1 else 0], np.int32)
  return True, top_two, _snapped_basis(rng, X[candidates.members[top]], k, snap_scale)


def _snapped_basis(rng, rows, k, snap_scale):
  """The canonical projection of ``rows``' top-k eigenspace snapped to ``s(Z + ω)`` (a public
  uniform offset ω per entry from ``rng``), then its top-k eigenvectors (host, float64)."""
  d = rows.shape[1]
  _, vecs = np.linalg.eigh(rows.T @ rows)
  projection = vecs[:, -k:] @ vecs[:, -k:].T                # canonical: all member rows
  offset = rng.random((d, d))
  snapped = snap_scale * (np.round(projection / snap_scale - offset) + offset)
  snapped = (snapped + snapped.T) / 2
  _, vecs = np.linalg.eigh(snapped)
  return vecs[:, ::-1][:, :k]


def _paper_variant(key, X, *, k, epsilon, delta, tol, snap_scale, ell):
  """The printed [SS21] Algorithm 1, eagerly (NOT private; for replication)."""
  d = X.shape[1]
  if not np.all(np.isfinite(X)):
    return False, np.zeros((d, k))
  X = X[np.linalg.norm(X, axis=1) > 0]
  candidates = enumerate_candidates(X, k, tol=tol)
  k_select, k_snap = jax.random.split(key)
  index = int(paper_variant_select(k_select, candidates.scores, epsilon=epsilon, delta=delta,
                                   ell=ell))
  if index < 0:
    return False, np.zeros((d, k))
  return True, _snapped_basis(host_rng(k_snap), X[candidates.members[index]], k, snap_scale)


def paper_variant_select(key: jax.Array, scores, *, epsilon: float, delta: float,
                         ell: int) -> jax.Array:
  """The printed [SS21] Algorithm 1 selection: index of the output candidate, −1 for NULL.

  ``ŝ = argmax_{s ∈ Y ∪ {NULL}} [max{0, u(s) − u(s2) − 1} + ξ(s)]``, ``ξ ~ TLap(2, ε, δ)``.
  NOT DP for data-dependent candidate sets (see :func:`dpese`); exposed for replication and for
  the privacy test that shows the failure.
  """
  scores = jnp.asarray(scores, jnp.float32)
  params = truncated_laplace_params(2.0, epsilon, delta)
  null_score = ell + 4.0 * math.log(1.0 / delta) / epsilon + 1.0
  all_scores = jnp.concatenate([scores, jnp.array([null_score], jnp.float32)])
  second = jnp.sort(all_scores)[-2] if all_scores.size > 1 else jnp.float32(0.0)
  gaps = jnp.maximum(0.0, all_scores - second - 1.0)
  noise = truncated_laplace_sample(key, all_scores.shape, params.scale, params.bound,
                                   jnp.float32)
  winner = jnp.argmax(gaps + noise)
  return jnp.where(winner == scores.size, -1, winner)
