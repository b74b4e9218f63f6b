"""PMM, the Private Measure Mechanism (He, Vershynin & Zhu 2023; [HVZ] Algorithm 4 as adapted
in docs/algorithms.md §4.5): a private synthetic copy of points in the unit cube ``[0, 1]^{d'}``.

A binary hierarchical partition of depth ``r``: level ``j`` halves every cell of level ``j − 1``
along coordinate ``(j − 1) mod d'``. Every level's cell counts get exact discrete Laplace noise
(integers, no floating point: :mod:`dpjax.mechanisms.exact`); a top-down consistency step
(post-processing) turns them into non-negative integers that sum to their parent, the root
being ``n``; each leaf then emits its count of points drawn uniformly in its cell.

Leaves are numbered by interleaving the points' grid bits in split order, most significant bit
first, so a level-``j`` cell is ``leaf >> (r − j)`` and every level's counts are row sums of the
leaf counts: one ``bincount``, linear in n, static shapes throughout (jittable, vmappable).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import _validation as v
from dpjax.mechanisms import exact as exact_lib

__all__ = ["PMMParameters", "pmm", "pmm_core", "pmm_depth", "pmm_parameters"]

MAX_DEPTH = 20                   # 2^20 leaves, 2^21 noise draws: the default depth is capped here


class PMMParameters(NamedTuple):
  """Public parameters of :func:`pmm_core` (from :func:`pmm_parameters`).

  Attributes:
    depth: ``r``, the number of levels below the root.
    dim: ``d'``.
    scales: ``(r,)`` the discrete Laplace scales ``σ_j`` (level 1 first), before rounding up.
    nums, den: the exact sampler's rational scales ``nums[j]/den ≥ σ_j``.
  """
  depth: int
  dim: int
  scales: tuple
  nums: tuple
  den: int


def pmm_depth(epsilon_n: float) -> int:
  """``r = ⌈log2(ε n)⌉`` (at least 1, at most :data:`MAX_DEPTH`), [HVZ23] / reference code."""
  return int(min(MAX_DEPTH, max(1, math.ceil(math.log2(max(epsilon_n, 2.0))))))


def pmm_noise_scales(epsilon: float, depth: int, dim: int) -> np.ndarray:
  """``σ_j = (2/ε)·2^{−j(1−1/d')/2}·Σ_{i=1}^{r} 2^{i(1−1/d')/2}``, ``j = 1..r``.

  Privacy: replacing one point moves at most two cell counts of a level by one each
  (ℓ1-sensitivity 2), so level ``j`` costs ``2/σ_j`` and ``Σ_j 2/σ_j = ε`` (basic composition
  across levels). The profile ``σ_j ∝ 2^{−j(1−1/d')/2}`` minimises ``Σ_j σ_j 2^{j(1−1/d')}``,
  the levels' contribution to W1, under that budget (docs/algorithms.md §4.5, PROPOSED
  calibration, DERIVED privacy).
  """
  a = (1.0 - 1.0 / dim) / 2.0
  j = np.arange(1, depth + 1)
  return (2.0 / epsilon) * 2.0 ** (-j * a) * np.sum(2.0 ** (j * a))


def pmm_parameters(n: int, dim: int, *, epsilon: float, depth: int | None = None) -> PMMParameters:
  """Validated public parameters of PMM for ``n`` points in ``[0, 1]^{dim}`` at ε.

  Raises:
    ValueError: ε not finite and > 0, ``n < 1``, ``dim < 1``, a depth outside
      ``1..MAX_DEPTH``, or a scale beyond the exact sampler's range (ε far too small).
  """
  epsilon = v.check_epsilon(epsilon)
  n = v.check_int(n, "n", low=1)
  dim = v.check_int(dim, "dim", low=1)
  depth = pmm_depth(epsilon * n) if depth is None else v.check_int(depth, "depth", low=1,
                                                                    high=MAX_DEPTH)
  scales = pmm_noise_scales(epsilon, depth, dim)
  rational = [exact_lib.rational_scale(float(s)) for s in scales]
  nums = tuple(int(num) for num, _ in rational)
  if max(nums) >= 2**31 // 64:
    raise ValueError(f"PMM's noise scale {max(scales):.3g} exceeds the exact sampler's range; "
                     f"epsilon={epsilon} is too small for a useful release.")
  return PMMParameters(depth, dim, tuple(float(s) for s in scales), nums, rational[0][1])


def _splits(depth: int, dim: int) -> list[int]:
  """How many times each coordinate is halved in ``depth`` levels."""
  return [len(range(c, depth, dim)) for c in range(dim)]


def leaf_index(Y: jax.Array, depth: int) -> jax.Array:
  """``(n,)`` int32 leaf of each row of ``Y (n, d')`` in ``[0, 1]^{d'}`` (values outside are
  clamped to the cube's edge cells: a fixed map of each point)."""
  dim = Y.shape[1]
  splits = _splits(depth, dim)
  grid = [jnp.clip(jnp.floor(Y[:, c] * 2.0**splits[c]), 0, 2**splits[c] - 1).astype(jnp.int32)
          for c in range(dim)]
  leaf = jnp.zeros(Y.shape[0], jnp.int32)
  used = [0] * dim
  for j in range(depth):                       # level j + 1 splits coordinate j mod d'
    c = j % dim
    used[c] += 1
    bit = (grid[c] >> (splits[c] - used[c])) & 1
    leaf = (leaf << 1) | bit
  return leaf


def leaf_cells(depth: int, dim: int) -> tuple[jax.Array, jax.Array]:
  """``(lower (2^r, d'), side (d',))``: each leaf cell's lower corner and the cells' sides."""
  splits = _splits(depth, dim)
  leaves = jnp.arange(2**depth, dtype=jnp.int32)
  grid = [jnp.zeros(2**depth, jnp.int32) for _ in range(dim)]
  for j in range(depth):
    c = j % dim
    grid[c] = (grid[c] << 1) | ((leaves >> (depth - 1 - j)) & 1)
  side = jnp.asarray([2.0**-s for s in splits], jnp.float32)
  lower = jnp.stack([g.astype(jnp.float32) for g in grid], axis=1) * side
  return lower, side


def consistent_counts(noisy_levels: list, n) -> jax.Array:
  """Top-down consistency (post-processing): non-negative integer children summing to their
  parent, the root holding ``n``. For a parent ``N`` and noisy children ``(c_L, c_R)``:
  ``L = round(N c_L⁺/(c_L⁺ + c_R⁺))`` (``⌊N/2⌋`` if both are ≤ 0), ``R = N − L``
  (docs/algorithms.md §4.5 [PROPOSED])."""
  parent = jnp.reshape(jnp.asarray(n, jnp.int32), (1,))
  for noisy in noisy_levels:
    pairs = jnp.maximum(noisy.reshape(-1, 2), 0).astype(jnp.float32)
    total = pairs.sum(axis=1)
    share = jnp.where(total > 0, pairs[:, 0] / jnp.where(total > 0, total, 1.0), 0.5)
    left = jnp.where(total > 0, jnp.round(parent * share), parent // 2)
    left = jnp.clip(left.astype(jnp.int32), 0, parent)
    parent = jnp.stack([left, parent - left], axis=1).reshape(-1)
  return parent


def pmm_noisy_levels(key: jax.Array, Y: jax.Array, params: PMMParameters) -> list:
  """PMM's DP release: every level's cell counts plus exact discrete Laplace noise.

  Returns:
    ``[level 1 (2,), level 2 (4,), …, level r (2^r,)]`` int32 arrays (level j: cell
    ``leaf >> (r − j)``). Traceable.

  Guarantee: ε-DP under replace-one for the ε of ``params``: one replaced point moves at most two
  counts of a level by one (ℓ1 = 2), level j's noise ``DLap(σ_j)`` makes it ``2/σ_j``-DP and
  ``Σ_j 2/σ_j = ε`` (:func:`pmm_noise_scales`; ``σ_j`` rounded up to the sampler's rational grid
  only adds noise).
  """
  n, dim = Y.shape
  if dim != params.dim:
    raise ValueError(f"Y has {dim} columns but the parameters are for dim={params.dim}.")
  r = params.depth
  counts = jnp.bincount(leaf_index(Y, r), length=2**r).astype(jnp.int32)
  # Every level's noise from one sampler loop (one compiled loop, not r): draw i of level j has
  # scale nums[j]/den.
  nums = jnp.concatenate([jnp.full(2**j, num, jnp.uint32)
                          for j, num in enumerate(params.nums, start=1)])
  noise = exact_lib.exact_discrete_laplace(key, (nums.size,), nums, params.den)
  levels, start = [], 0
  for j in range(1, r + 1):
    levels.append(counts.reshape(2**j, -1).sum(axis=1) + noise[start:start + 2**j])
    start += 2**j
  return levels


def pmm_core(key: jax.Array, Y: jax.Array, params: PMMParameters) -> tuple[jax.Array, dict]:
  """PMM on ``Y (n, d')`` in ``[0, 1]^{d'}``: ``(synthetic (n, d'), released)``, traceable.

  ``released`` holds the consistent leaf counts ``(2^r,)`` int32 (a post-processing of the
  release :func:`pmm_noisy_levels`, from which all output points are drawn). Output dtype:
  ``Y``'s float dtype; rows in random order.

  Guarantee: ε-DP under replace-one for the ε the parameters were made for
  (:func:`pmm_noisy_levels`); n is public (the root count). The noise is exact discrete
  Laplace, so the released integers carry no floating-point side channel; the consistency step,
  the uniform placement in the leaves and the shuffle are post-processing.

  References:
    He, Vershynin & Zhu (2023), "Algorithmically effective differentially private synthetic
    data"; [HVZ] Algorithm 4; docs/algorithms.md §4.5.
  """
  n, dim = Y.shape
  r = params.depth
  k_levels, k_emit, k_order = jax.random.split(key, 3)
  final = consistent_counts(pmm_noisy_levels(k_levels, Y, params), n)
  ids = jnp.repeat(jnp.arange(2**r, dtype=jnp.int32), final, total_repeat_length=n)
  lower, side = leaf_cells(r, dim)
  dtype = Y.dtype if jnp.issubdtype(Y.dtype, jnp.floating) else jnp.float32
  offsets = jax.random.uniform(k_emit, (n, dim), dtype)
  points = lower[ids].astype(dtype) + offsets * side.astype(dtype)
  # Rows come out grouped by leaf; a uniform shuffle (post-processing) makes any prefix a fair
  # subsample.
  return jax.random.permutation(k_order, points), {"leaf_counts": final}


def pmm(key: jax.Array, Y, *, epsilon: float, depth: int | None = None) -> jax.Array:
  """PMM on points ``Y (n, d')`` in ``[0, 1]^{d'}``: ``(n, d')`` synthetic points, ε-DP.

  Args:
    key: PRNG key.
    Y: ``(n, d')`` float rows in the unit cube (outside values are clamped to edge cells).
    epsilon: ε > 0.
    depth: levels ``r`` (default ``⌈log2(εn)⌉``).

  Returns:
    ``(n, d')`` synthetic points in ``Y``'s float dtype (jitted core :func:`pmm_core`).

  Guarantee: ε-DP under replace-one (see :func:`pmm_core`).

  Raises:
    TypeError: a non-key ``key`` or non-numeric ``Y``. ValueError: see :func:`pmm_parameters`;
    NaN rows.
  """
  v.check_key(key)
  Y = v.check_data(Y, "Y")
  params = pmm_parameters(Y.shape[0], Y.shape[1], epsilon=epsilon, depth=depth)
  return _pmm_jit(key, Y, params)[0]


@functools.partial(jax.jit, static_argnames=("depth", "dim", "den"))
def _pmm_traced(key, Y, nums, *, depth, dim, den):
  """:func:`pmm_core` with the scales traced: one compilation per shape and depth, whatever ε."""
  return pmm_core(key, Y, PMMParameters(depth, dim, (), tuple(nums[j] for j in range(depth)),
                                        den))


def _pmm_jit(key, Y, params: PMMParameters):
  return _pmm_traced(key, Y, jnp.asarray(params.nums, jnp.uint32), depth=params.depth,
                     dim=params.dim, den=params.den)
