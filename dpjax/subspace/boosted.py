"""DPASEB — boosted DPASE ([SS21] Algorithm 3, Thm E.1; docs/algorithms.md §2.3).

T independent DPASE runs on disjoint blocks (one ``vmap``), then a public agreement check: a run
whose subspace is within 2α of at least 0.6T − 1 other runs is returned; if none is, ⊥. Failure
probability drops from DPASE's constant (≈ 0.3) to β.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import ledger as ledger_lib
from dpjax import linalg
from dpjax.mechanisms import histogram
from dpjax.subspace import approximate
from dpjax.results import SubspaceResult, UnderpoweredWarning, warn_underpowered

__all__ = ["dpaseb", "num_blocks_for"]

C3 = 45.0      # PROPOSED: T = ⌈45 ln(1/β)⌉ (Chernoff with KL(0.6 ‖ 0.7) = 0.02258).


def num_blocks_for(beta: float, c3: float = C3) -> int:
  """``T = ⌈c3 · ln(1/β)⌉`` DPASE runs (PROPOSED c3 = 45, docs/algorithms.md §2.3).

  References:
    Singhal & Steinke, "Privately Learning Subspaces", NeurIPS 2021,
    Algorithm 3 (DPASEB), Thm E.1; docs/algorithms.md §2.3.
  """
  beta = v.check_probability(beta, "beta", open_high=True)
  return max(1, math.ceil(v.check_positive(c3, "c3") * math.log(1.0 / beta)))


def dpaseb(key: jax.Array, X, *, epsilon: float, delta: float, k: int, alpha: float,
           beta: float = 0.1, gamma: float | None = None, num_blocks: int | None = None,
           c3: float = C3, ledger=None, **dpase_kwargs) -> SubspaceResult:
  """Learns a k-dim subspace with DPASEB: T DPASE runs on disjoint blocks and a vote.

  Privacy guarantee: (ε, δ)-DP under replace-one. Each row lies in exactly one block (a public
  random permutation, then ``T`` blocks of ``⌊n/T⌋`` rows), so the T DPASE outputs are jointly
  (ε, δ)-DP by parallel composition; the vote is post-processing.

  Utility [SS21 Thm E.1]: if each run is within α/3 of the truth with probability ≥ 0.7, then with
  probability ≥ 1 − β at least 0.6T runs are, and any returned run is within 2·(α/3) of one of
  them, hence within α. DPASE's cell length is capped for accuracy α/3 accordingly (PROPOSED).

  Args:
    key: PRNG key.
    X: ``(n, d)`` float data; rows are individuals. Runs in X's dtype (float16 / bfloat16 are
      upcast to float32); any finite scale works (see :func:`dpjax.subspace.dpase`).
    epsilon, delta: the budget (each block's DPASE uses all of it).
    k: subspace dimension.
    alpha: target accuracy ‖Π̂ − Π‖ ≤ α (the agreement radius is 2α/3).
    beta: target failure probability; sets ``T = ⌈c3 ln(1/β)⌉``.
    gamma: DPASE's gap parameter (or ``cell_length=`` in ``dpase_kwargs``).
    num_blocks: override T.
    c3: the constant in T.
    ledger: optional :class:`dpjax.ledger.PrivacyLedger` (replace-one).
    **dpase_kwargs: public DPASE parameters (``num_subsets``, ``cell_length``, ``ell_rule``,
      ``top_k_method``, …).

  Returns:
    :class:`~dpjax.results.SubspaceResult` (neighboring ``REPLACE_ONE``); ``info`` has
    ``num_blocks``, ``block_size`` and the blocks' DPASE parameters; ``released`` has
    ``agreeing`` (the vote count of the returned run, 0 on ⊥) and ``runs_ok`` (how many runs
    answered), both covered by the guarantee. Traceable in ``key`` and ``X`` (a non-finite
    traced ``X`` gives ⊥).

  Raises:
    ValueError / TypeError: as :func:`dpjax.subspace.dpase`, plus bad ``alpha``/``beta`` and
      ``n < T·t·(k + 1)`` (T blocks, t DPASE subsets each of ≥ k + 1 rows; the message names
      the user's n, T, t and the rows needed in total).

  Warns:
    dpjax.UnderpoweredWarning: the blocks too small for DPASE's agreement bound at ``gamma``;
      the message gives the rows in the user's n: T times
      :func:`dpjax.subspace.dpase_required_n`.
  """
  key = v.check_key(key)
  X = v.check_data(X, "X")
  n, d = X.shape
  alpha = v.check_positive(alpha, "alpha")
  T = num_blocks_for(beta, c3) if num_blocks is None else v.check_int(num_blocks, "num_blocks",
                                                                        low=1)
  block = n // T
  noise = dpase_kwargs.pop("noise", "discrete")
  grouping = dpase_kwargs.pop("grouping", "auto")
  top_k_method = v.check_choice(dpase_kwargs.pop("top_k_method", "auto"), "top_k_method",
                                approximate.TOP_K_METHOD_CHOICES)
  # Check the user's n here (public numbers only), so that the error names n and T rather than
  # the block size that DPASE's own check would call "n".
  num_subsets = dpase_kwargs.get("num_subsets")
  needed = _rows_needed(d, k, epsilon, delta, T, noise, num_subsets)
  if n < needed.rows:
    blocks_from = "num_blocks" if num_blocks is not None else f"beta={beta:g}"
    subsets_from = ("num_subsets" if num_subsets is not None
                    else f"epsilon={epsilon:g}, delta={delta:g}")
    raise ValueError(
        f"n is too small: DPASEB splits the n={n} rows into T={T} blocks ({blocks_from}) of "
        f"⌊n/T⌋={block} rows, and each block's DPASE splits its rows into t={needed.subsets} "
        f"subsets ({subsets_from}) of at least k + 1 = {k + 1} rows, so DPASEB needs "
        f"n >= T·t·(k + 1) = {needed.rows} rows in total, got n={n}. Collect more rows, raise "
        "epsilon or beta, or pass a smaller num_blocks.")
  dpase_kwargs.setdefault("alpha", alpha / 3.0)
  dpase_kwargs.setdefault("float_eps", float(jnp.finfo(X.dtype).eps))
  # A block's DPASE warns in terms of its block; DPASEB restates it in the user's n (T blocks).
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", UnderpoweredWarning)
    params = approximate.dpase_parameters(block, d, k, epsilon=epsilon, delta=delta,
                                          gamma=gamma, noise=noise, **dpase_kwargs)
  if any(issubclass(w.category, UnderpoweredWarning) for w in caught):
    per_block = approximate.dpase_required_n(
        d, k, epsilon=epsilon, delta=delta, gamma=gamma, noise=noise,
        num_subsets=params.num_subsets)
    needed = (f"n ≥ T·{per_block:,} = {T * per_block:,} rows (T = {T} blocks times "
              f"dpjax.subspace.dpase_required_n({d}, {k}, epsilon={epsilon:g}, "
              f"delta={delta:g}, gamma={gamma:g}))" if per_block is not None
              else f"no n (gamma={gamma:g} ≥ 1/2)")
    warn_underpowered(
        f"DPASEB: at n={n:,} rows each of its T={T} blocks has {block:,} rows, too few for the "
        "block's DPASE subsets to be guaranteed to agree: it will most likely return ⊥ (still "
        f"private). It needs {needed}; or raise epsilon (fewer subsets) or beta (fewer blocks).")
  for w in caught:                     # anything else the parameters said, as it was
    if not issubclass(w.category, UnderpoweredWarning):
      warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
  solver = approximate.top_k_solver(top_k_method, params.subset_size, d, k)
  if ledger is not None:
    ledger_lib.check_untraced("dpaseb", key, X)
    ledger.record_approx_dp(float(epsilon), float(delta), label="DPASEB",
                            neighboring=NeighboringRelation.REPLACE_ONE)
  scalars = histogram.histogram_scalars(epsilon, delta, noise=noise)
  ok, basis, agreeing, runs_ok = _dpaseb(
      key, X, params.cell_length, scalars, 2.0 * alpha / 3.0, t=params.num_subsets,
      m=params.subset_size, q=params.num_reference_points, k=k, T=T, block=block,
      grouping=grouping, solver=solver)
  if v.is_traced(X):                       # a NaN dataset is outside the domain: ⊥
    ok, basis, agreeing = v.domain_bottom(X, ok, basis, agreeing)
  info = {"num_blocks": T, "block_size": block, "dpase": params._asdict(),
          "top_k_method": solver.method}
  return SubspaceResult(ok=ok, basis=basis, released={"agreeing": agreeing, "runs_ok": runs_ok},
                        epsilon=float(epsilon), delta=float(delta),
                        neighboring=NeighboringRelation.REPLACE_ONE, info=info)


class _Rows(NamedTuple):
  subsets: int
  rows: int


def _rows_needed(d, k, epsilon, delta, T, noise, num_subsets) -> _Rows:
  """DPASEB's smallest n: T blocks, each split by DPASE into t subsets of ≥ k + 1 rows.

  ``⌊⌊n/T⌋/t⌋ = ⌊n/(T t)⌋ ≥ k + 1`` iff ``n ≥ T·t·(k + 1)``. Public parameters only.
  """
  k = v.check_int(k, "k", low=1, high=d)
  epsilon, delta = v.check_epsilon(epsilon), v.check_delta(delta)
  t = (approximate.num_subsets_for(epsilon, delta, noise=noise) if num_subsets is None
       else v.check_int(num_subsets, "num_subsets", low=1))
  return _Rows(t, T * t * (k + 1))


@functools.partial(jax.jit, static_argnames=("t", "m", "q", "k", "T", "block", "grouping",
                                             "solver"))
def _dpaseb(key, X, cell_length, scalars, radius, *, t, m, q, k, T, block, grouping, solver):
  """ε, δ (through the histogram's scalars), ℓ and the radius are traced: an ε sweep at fixed
  shapes compiles once. The blocks are index sets into ``X`` (no copy of the data)."""
  k_perm, k_runs = jax.random.split(key)
  perm = jax.random.permutation(k_perm, X.shape[0])
  blocks = perm[: T * block].reshape(T, block)
  run = functools.partial(approximate._dpase_traced, cell_length=cell_length, scalars=scalars,
                          t=t, m=m, q=q, k=k, partition="permutation", grouping=grouping,
                          solver=solver)
  oks, bases, _ = jax.vmap(lambda kk, rows: run(kk, X, rows=rows))(jax.random.split(k_runs, T),
                                                                    blocks)
  # sin of the largest principal angle between every pair of runs: from the (k, k) overlaps.
  overlaps = jnp.einsum("idk,jdl->ijkl", bases, bases, precision=linalg.HIGHEST)
  smallest = jnp.min(jnp.linalg.svd(overlaps, compute_uv=False), axis=-1)
  distance = jnp.sqrt(jnp.clip(1.0 - smallest**2, 0.0, 1.0))
  close = (distance <= radius) & oks[:, None] & oks[None, :] & ~jnp.eye(T, dtype=bool)
  votes = jnp.sum(close, axis=1)
  qualifies = oks & (votes >= 0.6 * T - 1)
  winner = jnp.argmax(qualifies)            # the first qualifying run (post-processing)
  ok = jnp.any(qualifies)
  basis = jnp.where(ok, bases[winner], jnp.zeros_like(bases[0]))
  return ok, basis, jnp.where(ok, votes[winner], 0), jnp.sum(oks)
