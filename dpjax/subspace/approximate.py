"""DPASE — the DP Approximate Subspace Estimator ([SS21] Algorithm 2; docs/algorithms.md §2.2).

Subsample-and-aggregate: split the rows into ``t`` disjoint subsets, compute each subset's top-k
subspace, describe it by the projections of ``q`` public random reference points, snap those
``q·d``-dimensional points to a randomly offset grid of side ``ℓ``, and release the most popular
cell through the stability-based histogram. A random point of that cell, turned back into a
subspace by PCA, is the answer. Privacy rests only on the histogram: one row changes one subset,
hence one histogram item.

One entry point, :func:`dpase`, takes the rows as an array (in memory, traceable), a gather
function (rows made on demand) or chunks / a memmap (streamed, memory independent of n:
:mod:`dpjax.subspace.streaming`), with an optional device mesh; the public partition is
:mod:`dpjax.subspace.partition`'s.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import ledger as ledger_lib
from dpjax import linalg
from dpjax.mechanisms import histogram
from dpjax.results import SubspaceResult, warn_underpowered
from dpjax.subspace import streaming
from dpjax.subspace.partition import (permutation_index, random_label_index, random_labels,
                                      subset_capacity)

__all__ = ["DPASEParameters", "dpase", "dpase_max_gamma", "dpase_parameters", "dpase_required_n",
           "num_subsets_for"]

ELL_RULES = ("paper_proof", "l1_safe", "paper_formula")
PARTITIONS = ("permutation", "random_labels")
# Per-subset top-k solvers: "auto" picks one from the public shapes (top_k_solver).
TOP_K_METHOD_CHOICES = ("auto",) + linalg.TOP_K_METHODS
# PROPOSED (measured with benchmarks/dpase_speed.py): "auto" iterates when one exact solve costs at
# least this many iterations' flops; the iteration is capped at a quarter of that many.
AUTO_MIN_FLOP_RATIO = 16
MIN_ITERATIONS_CAP = 10

# Failure probabilities of the explicit radius bounds (docs/algorithms.md §2.2, PROPOSED).
_BETA_S = 0.05
_BETA_CUT = 0.1


class DPASEParameters(NamedTuple):
  """The public parameters of one DPASE run, computed from ``(n, d, k, ε, δ, γ)`` only.

  Attributes:
    num_subsets: ``t``, the number of disjoint subsets (the histogram's sample size).
    subset_size: ``m = ⌊n/t⌋`` rows per subset (the expected size for random labels).
    num_reference_points: ``q``.
    cell_length: ``ℓ``, the grid's side length.
    ell_rule: how ``ℓ`` was chosen ("paper_proof", "l1_safe", "paper_formula" or "given").
    xi: ``ξ̂``, the high-probability bound on ``‖Π_j − Π‖`` (nan when not computed).
    radius: ``r̂``, the bound on ``‖Π_j p_i − Π p_i‖`` (nan when not computed).
    threshold: the histogram's release threshold τ.
  """
  num_subsets: int
  subset_size: int
  num_reference_points: int
  cell_length: float
  ell_rule: str
  xi: float
  radius: float
  threshold: float


def num_subsets_for(epsilon: float, delta: float, *, noise: str = "discrete") -> int:
  """The PROPOSED ``t`` (C2 of [SS21]): the smallest integer meeting three Laplace-tail bounds.

  With ``f = 0.1`` of the subsets allowed to be bad and ``β_h = 0.05`` per event (docs/algorithms.md
  §2.2): ``0.9 t ≥ τ + (2/ε) ln 20`` (the popular cell passes the threshold τ),
  ``0.4 t ≥ (2/ε) ln 20`` (its noisy count stays ≥ t/2) and ``0.8 t > (2/ε)(ln(20 t) + ln 20)``
  (it beats every other cell). Gives ``t = 37`` at ε = 1, δ = 1e-6.
  """
  tau = histogram.histogram_threshold(epsilon, delta, noise=noise)
  b = 2.0 / epsilon
  t = 1
  while not (0.9 * t >= tau + b * math.log(20.0) and 0.4 * t >= b * math.log(20.0)
             and 0.8 * t > b * (math.log(20.0 * t) + math.log(20.0))):
    t += 1
  return t


def dpase_parameters(n: int, d: int, k: int, *, epsilon: float, delta: float,
                     gamma: float | None = None, num_subsets: int | None = None,
                     num_reference_points: int | None = None,
                     cell_length: float | None = None, ell_rule: str = "paper_proof",
                     c0: float | None = None, noise: str = "discrete",
                     alpha: float | None = 0.1,
                     float_eps: float = float(np.finfo(np.float32).eps)) -> DPASEParameters:
  """Computes DPASE's public parameters (docs/algorithms.md §2.2, PROPOSED constants).

  Every default can be overridden; none of them affects privacy, only the ⊥ rate and accuracy.

  * ``t``: :func:`num_subsets_for` (``C2 ≈ 2.6–2.9``). ``m = ⌊n/t⌋``.
  * ``q = max(⌈2.25 k⌉, k + 1)`` (C1).
  * ``ℓ``: explicit versions of the paper's radii (Wedin's sin-θ bound over the t subsets and a
    χ²_{2k} tail over the q·t projected points, each failing with probability ≤ 0.05)::

        w = sqrt(2 ln(2t/0.05))
        ξ̂ = γ (√m + √d + w) / (√m − √k − w − γ (√m + √d + w))     (clamped to 1)
        r̂ = ξ̂ sqrt(2k + 2 sqrt(2k x) + 2x),   x = ln(q t / 0.05)

    then ``"paper_proof"``: ``ℓ = 20 q r̂`` (the proof of Lemma D.3, made explicit);
    ``"l1_safe"``: ``ℓ = 2 q √d r̂ sqrt(2 ln 2t) / 0.1`` (cells sized for the ℓ1-extent of a cluster,
    fewer ⊥, larger error); ``"paper_formula"``: ``ℓ = c0 γ sqrt(dk)(√k + sqrt(ln(kt)))/√m``.
    ``cell_length`` given explicitly wins over any rule. See also :func:`calibrate_cell_length`.
  * Numerical floor (PROPOSED): ``ξ̂ ≥ 10⁴·float_eps`` (the machine epsilon of the data's dtype).
    The per-subset subspaces are computed in floating point (the Gram route squares the
    condition number), so they differ by rounding even when the data lie exactly in a subspace;
    cells sized below that spread split the cluster and give ⊥ however many rows there are.
  * Accuracy cap (PROPOSED, on unless ``alpha=None``): the released point is uniform in its cell,
    so the final PCA sees an error matrix with entries of size ≈ ℓ/√6 and, by Wedin's bound,
    ``sin θ ≲ ‖E‖/(s_k(P) − ‖E‖)`` with ``‖E‖ ≈ ℓ(√q + √d)/√6`` and ``s_k(P) ≈ √q − √k``. A
    rule's ℓ is therefore capped at ``α(√q − √k)√6 / ((1 + α)(√q + √d))``: larger cells make
    success likely but the answer no better than ``α``-accurate — a random subspace when the
    radius bound is vacuous. The cap trades such answers for ⊥. Privacy-neutral.

  Raises:
    ValueError: bad arguments, ``gamma`` missing when a rule needs it, or ``n`` too small for
      ``m = ⌊n/t⌋ ≥ k + 1``.

  References:
    Singhal & Steinke, "Privately Learning Subspaces", NeurIPS 2021,
    Algorithm 2, Thm 1.2, Lemmas D.1–D.5; docs/algorithms.md §2.2.
  """
  n = v.check_int(n, "n", low=1)
  d = v.check_int(d, "d", low=1)
  k = v.check_int(k, "k", low=1, high=d)
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  v.check_choice(ell_rule, "ell_rule", ELL_RULES)
  t = (num_subsets_for(epsilon, delta, noise=noise) if num_subsets is None
       else v.check_int(num_subsets, "num_subsets", low=1))
  m = n // t
  if m < k + 1:
    raise ValueError(
        f"n is too small: DPASE splits the rows into t={t} subsets (set by epsilon={epsilon:g}, "
        f"delta={delta:g}) and needs at least k + 1 = {k + 1} rows in each, i.e. "
        f"n >= {t * (k + 1)}, got n={n}.")
  q = (max(math.ceil(2.25 * k), k + 1) if num_reference_points is None
       else v.check_int(num_reference_points, "num_reference_points", low=k))
  tau = histogram.histogram_threshold(epsilon, delta, noise=noise)
  if cell_length is not None:
    ell = v.check_positive(cell_length, "cell_length")
    return DPASEParameters(t, m, q, ell, "given", math.nan, math.nan, tau)
  if gamma is None:
    largest = dpase_max_gamma(n, d, k, epsilon=epsilon, delta=delta, noise=noise,
                              num_subsets=t)
    supported = (f"At n={n:,}, d={d}, k={k}, epsilon={epsilon:g}, delta={delta:g} the agreement "
                 f"bound holds only for gamma < {largest:.3g} (dpjax.subspace.dpase_max_gamma; "
                 "smaller in practice, see its docstring)" if largest is not None else
                 f"n={n:,} rows meet the agreement bound for no gamma")
    raise ValueError(
        "gamma is required to set the cell length: a public upper bound on sqrt(λ_{k+1}/λ_k), "
        "how much weaker the (k+1)-th direction of the rows' second moment is than the k-th "
        f"(0: rows in an exact k-dimensional subspace). {supported}. Estimate it on public data "
        "of the same kind, or pass cell_length=...; a gamma below the data's makes ⊥ likely, "
        "never a privacy loss.")
  gamma = v.check_positive(gamma, "gamma", allow_zero=True)
  if ell_rule == "paper_formula":
    if c0 is None:
      raise ValueError("ell_rule='paper_formula' needs the constant c0 (a float > 0).")
    c0 = v.check_positive(c0, "c0")
    ell = c0 * gamma * math.sqrt(d * k) * (math.sqrt(k) + math.sqrt(math.log(k * t))) / math.sqrt(m)
    return DPASEParameters(t, m, q, _cap(ell, alpha, d, k, q), ell_rule, math.nan, math.nan, tau)
  w = math.sqrt(2.0 * math.log(2.0 * t / _BETA_S))
  noise_norm = gamma * (math.sqrt(m) + math.sqrt(d) + w)
  denominator = math.sqrt(m) - math.sqrt(k) - w - noise_norm
  if denominator <= 0 or noise_norm / denominator >= 1.0:
    need = dpase_required_n(d, k, epsilon=epsilon, delta=delta, gamma=gamma, noise=noise,
                            num_subsets=t)
    needed = (f"it needs n ≥ {need:,} rows (dpjax.subspace.dpase_required_n({d}, {k}, "
              f"epsilon={epsilon:g}, delta={delta:g}, gamma={gamma:g}))" if need is not None
              else f"no n suffices at gamma={gamma:g} ≥ 1/2 (the bound needs γ < 1/2)")
    warn_underpowered(
        f"DPASE: with m={m} rows in each of its t={t} subsets (n={n}), d={d}, k={k} and "
        f"gamma={gamma:g}, the subsets' subspaces are not guaranteed to agree, and it will most "
        f"likely return ⊥ (still private); {needed}. Collect rows, raise epsilon (fewer "
        "subsets), or check gamma, the public bound on sqrt(λ_{k+1}/λ_k).")
    xi = 1.0
  else:
    xi = noise_norm / denominator
  xi = max(xi, 1e4 * v.check_positive(float_eps, "float_eps"))
  x = math.log(q * t / _BETA_S)
  radius = xi * math.sqrt(2 * k + 2 * math.sqrt(2 * k * x) + 2 * x)
  if ell_rule == "paper_proof":
    ell = 20.0 * q * radius
  else:  # l1_safe
    ell = 2.0 * q * math.sqrt(d) * radius * math.sqrt(2.0 * math.log(2.0 * t)) / _BETA_CUT
  if ell <= 0.0:  # gamma == 0: any positive cell works; keep cells of unit side.
    ell = 1.0
  return DPASEParameters(t, m, q, _cap(ell, alpha, d, k, q), ell_rule, xi, radius, tau)


def dpase_required_n(d: int, k: int, *, epsilon: float, delta: float, gamma: float,
                     noise: str = "discrete", num_subsets: int | None = None) -> int | None:
  """Rows DPASE needs for its per-subset subspaces to be guaranteed to agree (the ``ξ̂ < 1``
  condition of :func:`dpase_parameters`, below which it most likely answers ⊥).

  >>> import dpjax
  >>> dpjax.subspace.dpase_required_n(784, 10, epsilon=1.0, delta=1e-6, gamma=0.1)
  10602

  With ``t`` subsets (:func:`num_subsets_for`) and ``w = sqrt(2 ln(2t/0.05))``, ξ̂ < 1 holds
  when each subset's ``m`` rows satisfy ``√m (1 − 2γ) > √k + w + 2γ(√d + w)``; the answer is
  ``t·m`` for the smallest such m (at least ``k + 1``). A public planning figure (utility only);
  it is the number DPASE's :class:`dpjax.UnderpoweredWarning` quotes. None when γ ≥ 1/2 (no
  number of rows meets the condition). A necessary condition, not a promise of a release: see
  :func:`dpase_max_gamma` for what was measured at the default accuracy cap.

  Args:
    d, k: the dimension and the subspace's dimension, ``1 ≤ k ≤ d``.
    epsilon, delta: DPASE's budget (they set t).
    gamma: γ ≥ 0, the public bound on ``sqrt(λ_{k+1}/λ_k)`` (0: data in an exact k-subspace).
    noise: DPASE's histogram noise (sets t), ``"discrete"`` or ``"laplace"``.
    num_subsets: t, if given to DPASE explicitly.

  Raises:
    ValueError / TypeError: bad arguments.
  """
  d = v.check_int(d, "d", low=1)
  k = v.check_int(k, "k", low=1, high=d)
  epsilon, delta = v.check_epsilon(epsilon), v.check_delta(delta)
  gamma = v.check_positive(gamma, "gamma", allow_zero=True)
  t = (num_subsets_for(epsilon, delta, noise=noise) if num_subsets is None
       else v.check_int(num_subsets, "num_subsets", low=1))
  if gamma >= 0.5:
    return None
  w = math.sqrt(2.0 * math.log(2.0 * t / _BETA_S))
  root = (math.sqrt(k) + w + 2.0 * gamma * (math.sqrt(d) + w)) / (1.0 - 2.0 * gamma)
  m = max(k + 1, math.floor(root * root) + 1)
  return t * m


def dpase_max_gamma(n: int, d: int, k: int, *, epsilon: float, delta: float,
                    noise: str = "discrete", num_subsets: int | None = None) -> float | None:
  """The largest γ for which n rows meet :func:`dpase_required_n`'s agreement bound (ξ̂ < 1): the
  question it answers, turned around for a user who has n rows and does not know γ.

  >>> import dpjax
  >>> round(dpjax.subspace.dpase_max_gamma(20000, 50, 2, epsilon=1.0, delta=1e-6), 4)
  0.2615

  γ bounds ``sqrt(λ_{k+1}/λ_k)`` of the rows' second moment. With ``w = sqrt(2 ln(2t/0.05))`` and
  ``m = ⌊n/t⌋`` the bound ``2γ(√m + √d + w) < √m − √k − w`` gives ``γ < (√m − √k − w)/(2(√m +
  √d + w))`` (docs/algorithms.md §2.2). A NECESSARY condition of the proof, not a promise: at
  the default accuracy cap (``alpha=0.1``) DPASE's cells are small and it succeeds only for much
  smaller γ (measured on model data, n = 6,000, d = 20, k = 2, ε = 1, 4 keys each: released 4
  times at γ = 1e-4, 3 at 1e-3, once at 3e-3, never at 1e-2, where this bound allows 0.24; at
  n = 60,000: 4 times at 3e-3, twice at 1e-2). None when even γ = 0 fails. Public numbers only.

  Raises:
    ValueError / TypeError: bad arguments.
  """
  n = v.check_int(n, "n", low=1)
  d = v.check_int(d, "d", low=1)
  k = v.check_int(k, "k", low=1, high=d)
  epsilon, delta = v.check_epsilon(epsilon), v.check_delta(delta)
  t = (num_subsets_for(epsilon, delta, noise=noise) if num_subsets is None
       else v.check_int(num_subsets, "num_subsets", low=1))
  m = n // t
  w = math.sqrt(2.0 * math.log(2.0 * t / _BETA_S))
  slack = math.sqrt(m) - math.sqrt(k) - w
  if m < k + 1 or slack <= 0.0:
    return None
  return slack / (2.0 * (math.sqrt(m) + math.sqrt(d) + w))


def _cap(ell: float, alpha: float | None, d: int, k: int, q: int) -> float:
  """Caps ℓ so that a success is α-accurate (see :func:`dpase_parameters`)."""
  if alpha is None:
    return ell
  alpha = v.check_positive(alpha, "alpha")
  cap = alpha * (math.sqrt(q) - math.sqrt(k)) * math.sqrt(6.0) / (
      (1.0 + alpha) * (math.sqrt(q) + math.sqrt(d)))
  return min(ell, cap)


def dpase(key: jax.Array, rows, *, epsilon: float, delta: float, k: int,
          gamma: float | None = None, num_subsets: int | None = None,
          num_reference_points: int | None = None, cell_length: float | None = None,
          ell_rule: str = "paper_proof", c0: float | None = None,
          partition: str | None = None, noise: str = "discrete",
          grouping: str = "auto", alpha: float | None = 0.1,
          top_k_method: str = "auto", n: int | None = None, d: int | None = None,
          dtype=None, block_rows: int | None = None, max_bytes: float | None = None,
          ledger=None, mesh: jax.sharding.Mesh | None = None,
          mesh_axis: str | None = None) -> SubspaceResult:
  """Learns a k-dimensional subspace privately with DPASE ([SS21] Algorithm 2).

  Usage::

      res = dpjax.subspace.dpase(jax.random.key(0), X, epsilon=1.0, delta=1e-6, k=2,
                                 gamma=0.01)   # X (n, d); gamma: see dpase_max_gamma
      res.ok, res.basis                        # False on ⊥; (d, k), zeros on ⊥

  Utility: for rows ``x_i ~ N(0, Σ)`` (zero mean) with ``λ_{k+1} ≤ γ² λ_k``, within ``α`` of the
  top-k eigenspace from a number of rows that does not grow with ``d`` ([SS21] Thm 1.2/4.3).
  Guarantee, whatever the data: (ε, δ)-DP under replace-one, and with random labels under
  add/remove-one too (n public). One row changes one of ``t`` disjoint subsets of a public
  partition, hence one item of the stability histogram (§1.5) over grid cells of the subsets'
  projected reference points (public, as are the offset and ``ℓ``); each subset's basis depends
  on its own rows alone whatever the row source, solver or mesh; the rest is post-processing.
  Proof, parameters and the row sources in detail: docs/algorithms.md §2.2.

  Args:
    key: PRNG key, the only source of randomness.
    rows: rows are individuals: an ``(n, d)`` array (in memory; traceable in ``key`` and
      ``rows`` with the public arguments static, a non-finite traced ``rows`` giving ⊥); or a
      gather function ``rows_fn(indices (m,) int) -> (m, d)`` (rows made per subset, never
      stored; row i must be a function of individual ``indices[i]`` alone, an index ``>= n``
      must give a zero row; traceable; it must sanitise its rows: a non-finite row spoils its
      subset's basis, no error); or chunks: an iterable of ``(chunk_rows, d)`` NumPy arrays of
      ``dtype`` in row order, or an ``(n, d)`` ``np.memmap`` (memory independent of ``n``:
      :mod:`dpjax.subspace.streaming`; random labels, exact solver, no mesh). A nested list is
      read as chunks: pass ``np.asarray(rows)`` to run in memory.
    epsilon, delta: ε > 0 (nats), δ ∈ (0, 1).
    k: subspace dimension, ``1 <= k <= d``.
    gamma: public bound on ``sqrt(λ_{k+1}/λ_k)`` of the rows' second moment (from public data of
      the same kind; :func:`dpase_max_gamma` gives the largest the rows could support); required
      unless ``cell_length`` is set.
    num_subsets, num_reference_points, cell_length, ell_rule, c0: override the public parameters
      (:func:`dpase_parameters`).
    partition: "permutation" (default for an array; replace-one) or "random_labels" (default and
      only choice otherwise; add/remove-one as well, as DP-SGD composes).
    noise, grouping: histogram noise, "discrete" (exact integer noise, the only option;
      "laplace" raises), and how equal cells are grouped ("auto", "pairwise", "hash").
    alpha: accuracy target capping a rule's ℓ (default 0.1; None: no cap; never an explicit
      ``cell_length``).
    top_k_method: each subset's solver: "exact", "subspace_iteration" or "auto" (default,
      :func:`top_k_solver`); chunks: "auto" or "exact", always exact.
    n, d, dtype: public row count, dimension and the rows' float dtype: all three required for a
      gather function, ``n`` and ``d`` for an iterable of chunks (``dtype`` default float32;
      16-bit floats computed as float32, float64 needs x64); for an array or memmap, if given,
      they must match it.
    block_rows, max_bytes: chunks only: rows per update (static; default ``max(2^26/(8d),
      512t)``) and the cap on the ``t`` float64 ``d × d`` accumulators (default 4 GiB,
      :data:`dpjax.subspace.streaming.DEFAULT_MAX_BYTES`).
    ledger: optional :class:`dpjax.ledger.PrivacyLedger`, charged (or ``BudgetExceededError``)
      after every argument is checked and before any row is read or made.
    mesh, mesh_axis: optional ``jax.sharding.Mesh`` (array or gather function) and the axis
      (None: its only one) over which the per-subset solves are sharded: the same output per key
      on one device or many, the same guarantee; with an array also under an outer ``jax.jit``.

  Returns:
    :class:`~dpjax.results.SubspaceResult`: ``ok``, ``basis (d, k)`` in the rows' dtype (zeros
    on ⊥), ``released["winning_count"]`` (the winning cell's noisy count, 0 on ⊥), ``epsilon``,
    ``delta``, ``neighboring`` (``REPLACE_ONE`` for the permutation, ``ADD_OR_REMOVE_ONE`` for
    random labels, which also holds under replace-one), ``info`` (the public parameters).

  Raises:
    TypeError: ``key`` not a PRNG key; ``rows`` none of the three sources, a non-real array, or
      chunks / a memmap of another ``dtype``; ``dtype`` not a float dtype; non-integer
      ``n``/``d``/``block_rows``; ``mesh`` not a ``jax.sharding.Mesh``.
    ValueError: NaN/inf in a concrete array, wrong rank, bad ε, δ, k or option,
      ``⌊n/t⌋ < k + 1``, no ``gamma`` (nor ``cell_length``), ``mesh_axis`` not an axis of
      ``mesh``; ``n``, ``d`` or (gather) ``dtype`` missing where needed or not matching an
      array; with chunks ``partition="permutation"`` (also with a gather function), ``mesh``
      or ``top_k_method="subspace_iteration"``; ``block_rows``/``max_bytes`` without chunks;
      ``t·d²·8 > max_bytes``; chunks of another shape or not ``n`` rows in all (raised while
      reading, before anything is released).

  Warns:
    dpjax.UnderpoweredWarning: at this n and ``gamma`` the subsets' subspaces are not
      guaranteed to agree (⊥ likely; still private); the message gives the rows
      :func:`dpase_required_n` asks, or says that none suffice.

  References:
    [SS21] Singhal & Steinke, "Privately Learning Subspaces", NeurIPS 2021, Algorithm 2,
    Lemma 5.3, Thm 1.2/4.3.
  """
  key = v.check_key(key)
  source = _row_source(rows, n=n, d=d, dtype=dtype, partition=partition,
                       top_k_method=top_k_method, block_rows=block_rows, max_bytes=max_bytes,
                       mesh=mesh)
  mesh_axis = _check_mesh(mesh, mesh_axis)
  n, d, partition = source.n, source.d, source.partition
  top_k_method = "exact" if source.kind == _CHUNKS else top_k_method
  params = _plan(n, d, k, source.dtype, epsilon=epsilon, delta=delta, gamma=gamma,
                 num_subsets=num_subsets, num_reference_points=num_reference_points,
                 cell_length=cell_length, ell_rule=ell_rule, c0=c0, partition=partition,
                 noise=noise, grouping=grouping, alpha=alpha, top_k_method=top_k_method)
  if source.kind == _CHUNKS:
    streaming.check_memory(params.num_subsets, d, max_bytes)
    block_rows = streaming.block_rows_for(block_rows, n=n, d=d, t=params.num_subsets)
  _record(ledger, epsilon, delta, partition, (key, rows))
  if source.kind == _ARRAY:
    X = source.rows
    ok, basis, count = _dpase_core(key, X, params, k=k, epsilon=float(epsilon),
                                   delta=float(delta), partition=partition, noise=noise,
                                   grouping=grouping, top_k_method=top_k_method, mesh=mesh,
                                   mesh_axis=mesh_axis)
    if v.is_traced(X):                     # a NaN dataset is outside the domain: ⊥
      ok, basis, count = v.domain_bottom(X, ok, basis, count)
  else:
    k_part, k_ref, k_off, k_hist, k_point = jax.random.split(key, 5)
    if source.kind == _GATHER:
      bases = _gathered_bases(k_part, source.rows, params, n=n, d=d, k=k, dtype=source.dtype,
                              top_k_method=top_k_method, mesh=mesh, mesh_axis=mesh_axis)
    else:
      bases = _streamed_bases(k_part, source.rows, params, n=n, d=d, k=k,
                              dtype=source.chunk_dtype, work_dtype=source.dtype,
                              block_rows=block_rows)
    scalars = histogram.histogram_scalars(float(epsilon), float(delta), noise=noise)
    ok, basis, count = _release(k_ref, k_off, k_hist, k_point, bases, params.cell_length,
                                scalars, q=params.num_reference_points, grouping=grouping)
  return _result(ok, basis, count, params, d=d, k=k, epsilon=epsilon, delta=delta,
                 partition=partition, top_k_method=top_k_method)


# The three row sources of dpase.
_ARRAY, _GATHER, _CHUNKS = "array", "gather", "chunks"


class _RowSource(NamedTuple):
  """A checked row source: its kind, the rows (a checked JAX array, the gather function, or the
  chunks / memmap), ``n``, ``d``, the dtype DPASE computes in, the chunks' own dtype (chunks
  only) and the resolved partition."""
  kind: str
  rows: object
  n: int
  d: int
  dtype: object
  chunk_dtype: object
  partition: str


def _row_source(rows, *, n, d, dtype, partition, top_k_method, block_rows, max_bytes,
                mesh) -> _RowSource:
  """Dispatches ``rows`` on its type and checks what that source needs (host, before tracing
  or reading anything); see :func:`dpase`."""
  if partition is not None:
    v.check_choice(partition, "partition", PARTITIONS)
  if isinstance(rows, np.memmap):
    kind = _CHUNKS
  elif isinstance(rows, (jax.Array, np.ndarray)) or hasattr(rows, "__array__"):
    kind = _ARRAY
  elif callable(rows):
    kind = _GATHER
  elif hasattr(rows, "__iter__") and not isinstance(rows, (str, bytes)):
    kind = _CHUNKS
  else:
    raise TypeError("rows must be an (n, d) array, a gather function rows_fn(indices) -> "
                    "(len(indices), d), or an iterable of (chunk_rows, d) arrays (or an (n, d) "
                    f"np.memmap), got {type(rows).__name__}.")
  if kind != _CHUNKS:
    for name, value in (("block_rows", block_rows), ("max_bytes", max_bytes)):
      if value is not None:
        raise ValueError(f"{name} applies only to rows streamed in chunks (an iterable or an "
                         f"np.memmap), not to {_DESCRIBE[kind]}; got {name}={value!r}.")
  if kind == _ARRAY:
    X = v.check_data(rows, "rows")
    for name, given, actual in (("n", n, X.shape[0]), ("d", d, X.shape[1])):
      if given is not None and given != actual:
        raise ValueError(f"rows has shape {tuple(X.shape)}, but {name}={given!r} was given "
                         "(an array's n and d are its shape; they need not be passed).")
    own = rows.dtype if hasattr(rows, "dtype") else np.asarray(rows).dtype
    if dtype is not None and jnp.dtype(dtype) != own:
      raise TypeError(f"rows has dtype {own}, but dtype={dtype!r} was given (an array's dtype "
                      "is its own; convert the array instead).")
    return _RowSource(_ARRAY, X, X.shape[0], X.shape[1], X.dtype, None,
                      partition or "permutation")
  if partition not in (None, "random_labels"):
    raise ValueError(f"partition={partition!r} needs the rows in memory (an array); "
                     f"{_DESCRIBE[kind]} supports only partition='random_labels'.")
  if kind == _CHUNKS and isinstance(rows, np.memmap):
    if rows.ndim != 2:
      raise ValueError(f"rows given as a memmap must be 2-D (n, d), got shape {rows.shape}.")
    n = rows.shape[0] if n is None else n
    d = rows.shape[1] if d is None else d
    dtype = rows.dtype if dtype is None else dtype
  for name, value in (("n", n), ("d", d)):
    if value is None:
      raise ValueError(f"{name} is required with {_DESCRIBE[kind]} (the number of rows n is "
                       "public and sets DPASE's parameters; d is the rows' dimension).")
  n = v.check_int(n, "n", low=1)
  d = v.check_int(d, "d", low=1)
  if kind == _GATHER:
    if dtype is None:
      raise ValueError("dtype is required with a gather function (the float dtype of the rows "
                       "it returns).")
    return _RowSource(_GATHER, rows, n, d, v.check_float_dtype(dtype), None, "random_labels")
  dtype = v.check_float_dtype(jnp.float32 if dtype is None else dtype)
  streaming.check_chunks(rows, n, d, dtype)
  v.check_choice(top_k_method, "top_k_method", TOP_K_METHOD_CHOICES)
  if top_k_method not in ("auto", "exact"):
    raise ValueError(f"top_k_method={top_k_method!r} is not available for rows streamed in "
                     "chunks (their subsets' bases come from exact second moments); pass "
                     "'auto' or 'exact'.")
  if mesh is not None:
    raise ValueError("mesh is not available for rows streamed in chunks (they are read once, "
                     "on the host); pass an array or a gather function to shard the subsets.")
  work_dtype = jax.dtypes.canonicalize_dtype(jnp.float32 if dtype.itemsize < 4 else dtype)
  return _RowSource(_CHUNKS, rows, n, d, work_dtype, dtype, "random_labels")


_DESCRIBE = {_ARRAY: "an array", _GATHER: "a gather function",
             _CHUNKS: "rows streamed in chunks (an iterable or an np.memmap)"}


def _gathered_bases(k_part, rows_fn, params, *, n, d, k, dtype, top_k_method, mesh, mesh_axis):
  """The ``(t, d, k)`` bases of the random-labels subsets of the rows ``rows_fn`` makes, each
  subset's rows made when its basis is taken (sharded over ``mesh`` if given)."""
  solver = top_k_solver(top_k_method, params.subset_size, d, k)
  index = random_label_index(k_part, n, params.num_subsets, subset_capacity(params.subset_size))

  def subset_bases(_, block):
    return linalg.top_k_subspaces_of_rows(rows_fn, block, d, k, dtype=dtype,
                                          method=solver.method,
                                          max_iterations=solver.max_iterations)

  return _sharded(subset_bases, (), index, n, mesh, mesh_axis)


def _streamed_bases(k_part, chunks, params, *, n, d, k, dtype, work_dtype, block_rows):
  """The ``(t, d, k)`` bases (in ``work_dtype``) of the random-labels subsets of streamed rows
  (:func:`dpjax.subspace.streaming.subset_bases`); the public labels are drawn before any row
  is read."""
  t = params.num_subsets
  labels = np.asarray(random_labels(k_part, n, t))                # public, as in memory
  bases = streaming.subset_bases(chunks, labels, n=n, d=d, k=k, t=t,
                                 capacity=subset_capacity(params.subset_size), dtype=dtype,
                                 block_rows=block_rows)
  return jnp.asarray(bases.astype(work_dtype))


def _plan(n, d, k, dtype, *, epsilon, delta, gamma, num_subsets, num_reference_points,
          cell_length, ell_rule, c0, partition, noise, grouping, alpha, top_k_method):
  """DPASE's checks of the public arguments, and its parameters (host; touches no data)."""
  v.check_choice(partition, "partition", PARTITIONS)
  histogram.check_noise(noise)
  v.check_choice(grouping, "grouping", ("auto", "pairwise", "hash"))
  v.check_choice(top_k_method, "top_k_method", TOP_K_METHOD_CHOICES)
  params = dpase_parameters(n, d, k, epsilon=epsilon, delta=delta, gamma=gamma,
                            num_subsets=num_subsets,
                            num_reference_points=num_reference_points,
                            cell_length=cell_length, ell_rule=ell_rule, c0=c0, noise=noise,
                            alpha=alpha, float_eps=float(jnp.finfo(dtype).eps))
  return params


def _record(ledger, epsilon, delta, partition, arguments):
  """Records one DPASE release in ``ledger`` (None: nothing); refused under a transformation of
  ``arguments`` (:func:`dpjax.ledger.check_untraced`)."""
  if ledger is not None:
    ledger_lib.check_untraced("dpase", arguments)
    # Random labels hold under both relations, so they fit a ledger of either kind.
    ledger.record_approx_dp(float(epsilon), float(delta), label="DPASE",
                            neighboring=(NeighboringRelation.REPLACE_ONE
                                          if partition == "permutation" else None))


def _check_mesh(mesh, mesh_axis):
  """Validates DPASE's ``mesh`` / ``mesh_axis`` on the host; returns the axis name (None when
  ``mesh`` is None: no sharding, ``mesh_axis`` ignored).

  Raises:
    TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
    ValueError: ``mesh_axis`` is not an axis of ``mesh``, or it is None and the mesh has
      several axes.
  """
  if mesh is None:
    return None
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}.")
  if mesh_axis is None:
    if len(mesh.axis_names) != 1:
      raise ValueError(f"the mesh has axes {mesh.axis_names}: pass mesh_axis=... to name the one "
                       "the subsets are sharded over.")
    return mesh.axis_names[0]
  if mesh_axis not in mesh.axis_names:
    raise ValueError(f"mesh_axis {mesh_axis!r} is not an axis of the mesh {mesh.axis_names}.")
  return mesh_axis


def _result(ok, basis, count, params, *, d, k, epsilon, delta, partition, top_k_method):
  t, m, q = params.num_subsets, params.subset_size, params.num_reference_points
  info = {
      "num_subsets": t,
      "subset_size": m,
      "num_reference_points": q,
      "cell_length": params.cell_length,
      "ell_rule": params.ell_rule,
      "partition": partition,
      "threshold": params.threshold,
      "top_k_method": top_k_solver(top_k_method, m, d, k).method,
  }
  neighboring = (NeighboringRelation.REPLACE_ONE if partition == "permutation"
                  else NeighboringRelation.ADD_OR_REMOVE_ONE)
  return SubspaceResult(ok=ok, basis=basis, released={"winning_count": count},
                        epsilon=float(epsilon), delta=float(delta), neighboring=neighboring,
                        info=info)


def _dpase_core(key, X, params: DPASEParameters, *, k: int, epsilon: float, delta: float,
                partition: str = "permutation", noise: str = "discrete", grouping: str = "auto",
                top_k_method: str = "auto", mesh=None, mesh_axis: str | None = None):
  """In-memory DPASE without argument validation, traceable in ``key`` and ``X``: what
  :func:`dpase` runs on an array after its checks, ``params`` from :func:`dpase_parameters`.
  Internal (the public traceable form is :func:`dpase` with an array); the privacy audits call it
  with histogram scalars for another ε than ``params``' (a negative control). ``mesh_axis`` an
  axis name (not None) when a mesh is given.

  Returns:
    ``(ok, basis (d, k), winning_count)``.
  """
  scalars = histogram.histogram_scalars(epsilon, delta, noise=noise)
  return _dpase_traced(key, X, params.cell_length, scalars, t=params.num_subsets,
                       m=params.subset_size, q=params.num_reference_points, k=k,
                       partition=partition, grouping=grouping,
                       solver=top_k_solver(top_k_method, params.subset_size, X.shape[1], k),
                       mesh=mesh, mesh_axis=mesh_axis)


class TopKSolver(NamedTuple):
  """The per-subset top-k solver DPASE runs: a :data:`dpjax.linalg.TOP_K_METHODS` entry and the
  subspace iteration's cap (unused by "exact")."""
  method: str
  max_iterations: int


def top_k_solver(method: str, m: int, d: int, k: int) -> TopKSolver:
  """Resolves DPASE's ``top_k_method`` for subsets of ``m`` rows in ``R^d`` (public shapes only).

  One exact solve costs about ``2 s² L + 9 s³`` flops (Gram or covariance matrix, then ``eigh``;
  ``s = min(m, d)``, ``L = max(m, d)``), one iteration ``4 m d r`` (``r = k + oversampling``);
  their ratio ρ counts the iterations that cost one exact solve. "auto" takes the subspace
  iteration when ``ρ >= AUTO_MIN_FLOP_RATIO`` (16), else "exact". The iteration is capped at
  ``max(MIN_ITERATIONS_CAP, ρ/4)`` iterations (at most ``linalg.DEFAULT_MAX_ITERATIONS``), so a
  subset without a spectral gap, which stops only at the cap, costs at most about a quarter of
  the exact solve's flops (slower BLAS-2-like flops: measured up to 0.6× of exact's time at
  n = 10⁵, d = 10³). Stopping early changes nothing in the privacy argument, and a subset that
  has not converged after ρ/4 iterations has a gap ``σ_{r+1}/σ_k`` close to 1, where the subsets'
  subspaces disagree by far more than a cell length and DPASE answers ⊥ anyway.
  """
  v.check_choice(method, "top_k_method", TOP_K_METHOD_CHOICES)
  s, big = min(m, d), max(m, d)
  r = min(k + linalg.DEFAULT_OVERSAMPLING, d)
  ratio = (2.0 * s * s * big + 9.0 * s**3) / (4.0 * m * d * r)
  cap = min(linalg.DEFAULT_MAX_ITERATIONS, max(MIN_ITERATIONS_CAP, int(ratio // 4)))
  if method == "auto":
    method = "subspace_iteration" if ratio >= AUTO_MIN_FLOP_RATIO else "exact"
  return TopKSolver(method, cap)


def _dpase_traced(key, X, cell_length, scalars, *, t, m, q, k, partition, grouping, solver,
                  rows=None, mesh=None, mesh_axis=None):
  """DPASE with its public scalars (ℓ, the histogram's noise scale and τ) traced: only the
  shapes (t, m, q, k) and the partition/grouping/solver choices are static.

  ``rows`` (optional ``(n_b,)`` indices into ``X``) runs DPASE on the dataset ``X[rows]``
  without copying it (DPASEB's blocks). Subsets are gathered by index inside the jitted stage;
  with a ``mesh``, each device gathers and solves its share of the subsets (:func:`_sharded`).
  """
  N, d = X.shape
  n = N if rows is None else rows.shape[0]
  k_part, k_ref, k_off, k_hist, k_point = jax.random.split(key, 5)
  if partition == "permutation":
    index = permutation_index(k_part, n, t, m)
  else:
    index = random_label_index(k_part, n, t, subset_capacity(m))
  if rows is not None:                     # local row i is X[rows[i]]; the padding n maps to N
    index = jnp.append(rows.astype(index.dtype), N)[index]

  def subset_bases(X, block):
    return linalg.gathered_top_k_subspaces(X, block, k, method=solver.method,
                                           max_iterations=solver.max_iterations)

  bases = _sharded(subset_bases, X, index, N, mesh, mesh_axis)                     # (t, d, k)
  return _release(k_ref, k_off, k_hist, k_point, bases, cell_length, scalars, q=q,
                  grouping=grouping)


def _sharded(subset_bases, operand, index, pad, mesh, mesh_axis):
  """``subset_bases(operand, index) -> (t, d, k)``, with the t index rows sharded over
  ``mesh_axis`` of ``mesh`` (None: one call, no sharding).

  ``t`` is padded up to a multiple of the axis size with index rows of ``pad`` only (dummy
  subsets of padding rows, each solved like any subset, from no data); every device solves its
  own ``t_pad / size`` subsets with ``operand`` replicated; the dummy bases are dropped and the
  rest gathered (replicated over the mesh) for the histogram. A subset's basis is computed from
  its own index row alone, wherever it runs.
  """
  if mesh is None:
    return subset_bases(operand, index)
  t, m = index.shape
  size = mesh.shape[mesh_axis]
  padded = -(-t // size) * size
  index = jnp.concatenate([index, jnp.full((padded - t, m), pad, index.dtype)])
  spec = PartitionSpec(mesh_axis)
  if mesh.devices.flat[0].platform == "cpu":
    # jaxlib's batched LAPACK kernels (QR, eigh, SVD) split a large batch into tasks on the
    # intra-op thread pool and block their thread until the tasks finish; with several CPU
    # devices running at once every pool thread can block so, and nothing runs the tasks (a
    # deadlock: seen in gdb with jaxlib 0.10.2, 4 simulated devices, 2 cores). One subset per
    # call keeps each LAPACK call inline on its own thread; each basis is unchanged.
    batched = subset_bases

    def subset_bases(operand, rows):
      return jax.lax.map(lambda r: batched(operand, r[None])[0], rows)
  bases = jax.shard_map(subset_bases, mesh=mesh, in_specs=(PartitionSpec(), spec),
                        out_specs=spec)(operand, index)
  return bases[:t]                   # sharded; the histogram stage gathers them


def _release(k_ref, k_off, k_hist, k_point, bases, cell_length, scalars, *, q, grouping):
  """DPASE's aggregation of the subsets' ``(t, d, k)`` bases (each a function of one subset):
  reference points → cells → stability histogram → ``(ok, basis, winning_count)``."""
  t, d, k = bases.shape
  cells, offset = _subset_cells(k_ref, k_off, bases, q, cell_length)
  bins, counts, released = histogram.stable_histogram_core(k_hist, cells, scalars, grouping)
  return _finish(k_point, bins[0], released[0], counts[0], offset, cell_length, t, q, d, k)


@functools.partial(jax.jit, static_argnames=("q",))
def _subset_cells(key_ref, key_off, bases, q, cell_length):
  t, d, _ = bases.shape
  reference = jax.random.normal(key_ref, (q, d), bases.dtype)             # public
  points = linalg.project_points(reference, bases).reshape(t, q * d)      # (t, q d)
  offset = jax.random.uniform(key_off, (), bases.dtype)                   # one offset for all axes
  scaled = jnp.floor(points / cell_length - offset)
  bound = float(np.iinfo(np.int32).max - 1)
  return jnp.clip(scaled, -bound, bound).astype(jnp.int32), offset


@functools.partial(jax.jit, static_argnames=("t", "q", "d", "k"))
def _finish(key, cell, released, noisy_count, offset, cell_length, t, q, d, k):
  ok = released & (noisy_count >= t / 2)
  dtype = offset.dtype
  uniform = jax.random.uniform(key, (q * d,), dtype)
  point = cell_length * (cell.astype(dtype) + offset + uniform)
  basis = linalg.top_k_right_singular_vectors(point.reshape(q, d), k)
  basis = jnp.where(ok, basis, jnp.zeros_like(basis))
  count = jnp.where(released, noisy_count, jnp.zeros_like(noisy_count))
  return ok, basis, count
