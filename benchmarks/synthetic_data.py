"""He–Vershynin–Zhu private low-dimensional synthetic data: the W1 rate, digits, and speed.

    python benchmarks/synthetic_data.py [--quick] [--json PATH] [--plot PREFIX]

1. Reproduction (ε = ``--epsilon``, default 1). Data: ``dpjax.data.low_dimensional_cube_data``
   (rows near a d'-dimensional affine plane in ``[0, 1]^d``: a ball of radius 0.3 plus N(0, 0.01²)
   noise in every coordinate). For each d (``--dims``), d' (``--sub-dims``), key (``--keys``) ONE
   sample of ``2·n_max`` rows is drawn: the first n rows are the data ``X_n`` (nested prefixes,
   one plane per key), rows ``n_max .. n_max + n`` an independent sample of the same law. For n
   on a half-decade grid from ``--n-max`` down to ``--n-min``, the median over keys of the
   1-Wasserstein distance W1(X_n, ·) to

   * ``pipeline``: ``dpjax.synthetic.low_dimensional_synthetic_data(dim=d')`` (ε split in thirds;
     method "auto": PMM for d' ≤ 2, PSMM for d' = 3 when its lattice is small, else PMM);
   * ``pmm_full_dim``: the baseline the paper improves on — PMM (``dpjax.synthetic.pmm.pmm``)
     directly on X_n in all d coordinates at the whole ε (no projection; W1 ~ (εn)^{−1/d});
   * ``nonprivate_projection``: the floor of the projection step — the EXACT mean and top-d'
     eigenvectors of the exact centred covariance, then PMM at the pipeline's own ε_s (its third)
     with the pipeline's cube scaling (:func:`nonprivate_projection_synthetic`; not private);
   * ``sampling_floor``: the independent non-private sample of the same size;
   * ``mean_point_mass`` (context, not private): every synthetic row at the exact mean of X_n
     (W1 = the mean distance to it, closed form). A private method below this line has learnt
     more than the centre of the data.

   W1 is ``dpjax.metrics.wasserstein_1`` (exact, POT's network simplex) on the first
   ``--w1-rows`` rows of each side (every output is row-shuffled, the data i.i.d., so prefixes
   are fair subsamples). Above ``--w1-rows`` every method's value carries the subsample's own
   floor (``sampling_floor`` shows it), so ``slope`` (the least-squares slope of log W1 against
   log n for the pipeline, to compare with the theory's −1/d') is also given over n ≤ w1-rows
   alone (``slope_exact_range``). ``w1_ratio_vs_full_dim_pmm``: W1(pmm_full_dim)/W1(pipeline) at
   the largest n. The data's noise (≈ 0.01·√(d − d') off the plane) is a floor for every method
   that outputs points on a d'-plane, so the rate flattens once the synthetic error falls to it.
   Also: the privately chosen d' (``dim=None``) against ε (``--dim-epsilons``) for d = 10, true
   d' = 2, n = the largest n.
2. Digits: scikit-learn's bundled 8×8 digits (1,797 × 64), scaled by the public bound 16
   (``dpjax.data.scale_to_unit_cube(X, 0, 16)``), the pipeline at ε ∈ ``--digits-epsilons`` with
   d' chosen privately: median W1(data, synthetic) over keys, the chosen d', and for context the
   W1 between two random halves of the digits (a sampling floor at n/2).
3. Speed: the pipeline at d = 50, d' = 2 (given, not chosen), n ∈ ``--speed-n`` against a
   straightforward vectorised NumPy implementation of the SAME steps (:func:`numpy_pipeline`):
   float64 centred covariance + ``rng.laplace`` on its upper triangle, mean + ``rng.laplace``,
   ``np.linalg.eigh``, then PMM with ``np.bincount`` on bit-interleaved leaf indices, per-level
   integer noise as differences of geometric variables (discrete Laplace), the same top-down
   consistency, ``np.repeat`` emission and a shuffle. The baseline uses plain float Laplace where
   dpjax uses the snapping mechanism and an exact integer sampler (dpjax does more work per noise
   draw). Its leaf index, leaf cells and consistency step are checked equal to dpjax's before
   timing. dpjax's first call (compilation) is reported on its own; then the two sides alternate
   over ``--repeats`` and the ratio numpy/dpjax is the median (and min) of the per-repeat ratios.

Options: ``--quick``, ``--epsilon``, ``--dims``, ``--sub-dims``, ``--n-min``, ``--n-max``,
``--keys``, ``--w1-rows``, ``--dim-epsilons``, ``--digits-epsilons``, ``--speed-n``,
``--repeats``, ``--blas-threads``, ``--covariance-scale`` (the pipeline's ``"paper"`` or
``"tight"`` noise, everywhere including the baseline), ``--seed``, ``--json``, ``--plot PREFIX``.
JSON: ``summary`` = ``slope``, ``slope_exact_range``, ``slope_theory`` and
``w1_ratio_vs_full_dim_pmm`` keyed ``"<d>,<d'>"``; ``digits`` keyed ``"<ε>"`` (``w1``, ``dim``,
``sampling_floor``); ``speed`` keyed ``"<n>"`` (``dpjax_s``, ``numpy_s``, ``ratio_median``,
``ratio_min``, ``compile_s``). ``points``: one per (d, d', n, method) with ``w1_median`` and the
per-key ``w1``; then ``dim_choice``, ``digits``, ``speed`` (all times) and ``baseline_checks``.

Measured (full run, 2-core shared CPU, 18 min; ε = 1, "paper" scale): at n = 1e5 the pipeline's
W1 is 2.4–15.7× below PMM in all d coordinates, but the fitted slopes (−0.22 … −0.62) are not the
theory's −1/d'. At ε = 1 the private covariance's noise (‖A‖ ≈ 0.1, 5 and 150 at d = 10, 50, 200
and n = 1e5) exceeds the data's eigenvalues (≈ 0.02–0.03) everywhere on the grid, so the private
basis is poor (random for d ≥ 50) and what falls with n is the PMM mass spread over the public
ball of radius R ≈ √d/2: at n = 1e5 the pipeline ends slightly below (d = 10) or above (d ≥ 50)
the non-private point mass at the mean, while ``nonprivate_projection`` falls towards the sampling
floor. Private d' (d = 10, true 2, n = 1e5): 1 for ε ≤ 4, 2 for ε ≥ 8. Digits: d' = 1 at every
ε and W1 2.43 / 2.16 / 2.14 at ε = 1 / 4 / 16 against 2.15 for the point mass at the mean (halves'
floor 1.25). Speed: dpjax takes 4.0× / 2.3× the NumPy baseline's time at n = 1e5 / 1e6 (paired
medians; most of PMM's time is the exact integer noise sampler), first call 5 / 12 s.

    python benchmarks/synthetic_data.py --quick --json q.json --plot q   # q_w1.png, q_dim.png
    python benchmarks/synthetic_data.py          # d ∈ {10, 50, 200}, n ≤ 1e5: ≈ 18 min, 2 cores
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from _timing import blas_info, blas_threads, interleaved, paired, timed
from dpjax import data as data_lib
from dpjax import metrics
from dpjax.synthetic import low_dimensional_synthetic_data
from dpjax.synthetic import pmm as pmm_lib
from dpjax.synthetic import projection

METHODS = ("pipeline", "pmm_full_dim", "nonprivate_projection", "sampling_floor",
           "mean_point_mass")
DIM_CHOICE = (10, 2)                       # (d, true d') of the private-d' experiment
SPEED_SHAPE = (50, 2)                      # (d, d') of the speed comparison


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def n_grid(n_min: int, n_max: int) -> list[int]:
  """``n_max·10^{−k/2}`` for k = 0, 1, … while ≥ n_min, increasing."""
  grid, k = [], 0
  while round(n_max * 10 ** (-k / 2)) >= n_min:
    grid.append(int(round(n_max * 10 ** (-k / 2))))
    k += 1
  return sorted(set(grid))


def eps_key(eps: float) -> str:
  return f"{eps:g}"


def w1(X, Y, rows: int) -> tuple[float, str]:
  """Exact W1 between the first ``rows`` rows of X and of Y (``dpjax.metrics.wasserstein_1``)."""
  return metrics.wasserstein_1(np.asarray(X[:rows]), np.asarray(Y[:rows]), method="exact")


def cube_scaling(A: np.ndarray, radius: float) -> np.ndarray:
  """The pipeline's map of ``a_i`` (‖a_i‖ ≤ R) into ``[0, 1]^{d'}``: ``(A + R)/(2R)``."""
  return (A + radius) / (2 * radius)


def nonprivate_projection_synthetic(key: jax.Array, X, *, epsilon_s: float, dim: int,
                                    depth: int | None = None) -> np.ndarray:
  """The pipeline with the projection step made EXACT (not private): the floor of that step.

  ``μ`` = the exact mean, ``V`` = the top-d' eigenvectors of the exact centred covariance,
  ``R = ‖max(μ, 1 − μ)‖``, ``Y = (Vᵀ(x_i − μ) + R)/(2R)``, PMM at ``epsilon_s`` on Y (the
  pipeline's share for its synthetic step), ``x̂ = clip(V(2R·y − R) + μ, 0, 1)``. ``(n, d)``.
  """
  Xf = np.asarray(X, np.float64)
  mean = Xf.mean(axis=0)
  cov = Xf.T @ Xf / len(Xf) - np.outer(mean, mean)
  V = np.linalg.eigh(cov)[1][:, ::-1][:, :dim]
  radius = projection.cube_radius(mean)
  Y = jnp.asarray(cube_scaling((Xf - mean) @ V, radius), X.dtype)
  points = np.asarray(pmm_lib.pmm(key, Y, epsilon=epsilon_s, depth=depth), np.float64)
  return np.clip((2 * radius * points - radius) @ V.T + mean, 0.0, 1.0)


# ------------------------------------------------------------------------------------------------
# 1. Reproduction


def cube_sample(seed: int, d: int, dim: int, k: int, rows: int) -> jax.Array:
  """``rows`` i.i.d. rows of one law (one plane per (seed, d, d', key index))."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), d), dim),
                           k)
  return data_lib.low_dimensional_cube_data(key, rows, d, dim)[0]


def reproduction(*, dims, sub_dims, grid, keys, epsilon, w1_rows, seed,
                 covariance_scale="paper") -> list[dict]:
  """One point per (d, d', n, method): median W1 over keys, per-key values, W1 labels."""
  points = []
  n_max = grid[-1]
  for d in dims:
    for dim in sub_dims:
      per = {(n, m): {"w1": [], "labels": set(), "extra": []} for n in grid for m in METHODS}
      for k in range(keys):
        start = time.perf_counter()
        sample = cube_sample(seed, d, dim, k, 2 * n_max)
        for n in grid:
          X, X_other = sample[:n], sample[n_max:n_max + n]
          key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed + 1), 1000 * d + dim),
                                   1000 * k + grid.index(n))
          k_pipe, k_pmm, k_oracle = jax.random.split(key, 3)
          res = low_dimensional_synthetic_data(k_pipe, X, epsilon=epsilon, dim=dim,
                                               covariance_scale=covariance_scale)
          outputs = {
              "pipeline": res.synthetic,
              "pmm_full_dim": pmm_lib.pmm(k_pmm, X, epsilon=epsilon),
              "nonprivate_projection": nonprivate_projection_synthetic(
                  k_oracle, X, epsilon_s=res.info["epsilon_split"][2], dim=dim),
              "sampling_floor": X_other}
          per[(n, "pipeline")]["extra"].append(res.info["method"])
          for m, Y in outputs.items():
            value, label = w1(X, Y, w1_rows)
            per[(n, m)]["w1"].append(value)
            per[(n, m)]["labels"].add(label)
          Xw = np.asarray(X[:w1_rows], np.float64)
          at_mean = np.linalg.norm(Xw - np.asarray(X, np.float64).mean(axis=0), axis=1).mean()
          per[(n, "mean_point_mass")]["w1"].append(float(at_mean))
          per[(n, "mean_point_mass")]["labels"].add("closed_form")
        log(f"  d={d} d'={dim} key {k + 1}/{keys}: {time.perf_counter() - start:.1f} s")
      for (n, m), r in per.items():
        point = {"d": d, "dim": dim, "n": n, "method": m, "w1_median": float(np.median(r["w1"])),
                 "w1": r["w1"], "w1_label": "/".join(sorted(r["labels"])),
                 "w1_rows": min(n, w1_rows)}
        if m == "pipeline":
          point["synthetic_method"] = r["extra"]
        points.append(point)
  return points


def fit_slope(ns, values) -> float | None:
  """Least-squares slope of log W1 against log n (None with fewer than 2 points)."""
  if len(ns) < 2:
    return None
  return float(np.polyfit(np.log(ns), np.log(values), 1)[0])


def summarise_reproduction(points, w1_rows) -> dict:
  slope, slope_exact, ratio = {}, {}, {}
  cells = sorted({(p["d"], p["dim"]) for p in points})
  for d, dim in cells:
    mine = {(p["n"], p["method"]): p["w1_median"] for p in points
            if p["d"] == d and p["dim"] == dim}
    ns = sorted({n for n, _ in mine})
    name = f"{d},{dim}"
    slope[name] = fit_slope(ns, [mine[(n, "pipeline")] for n in ns])
    small = [n for n in ns if n <= w1_rows]
    slope_exact[name] = fit_slope(small, [mine[(n, "pipeline")] for n in small])
    ratio[name] = mine[(ns[-1], "pmm_full_dim")] / mine[(ns[-1], "pipeline")]
  return {"slope": slope, "slope_exact_range": slope_exact,
          "slope_theory": {f"{d},{dim}": -1.0 / dim for d, dim in cells},
          "w1_ratio_vs_full_dim_pmm": ratio}


def dim_choice(*, epsilons, n, keys, seed, covariance_scale="paper") -> dict:
  """The privately chosen d' (``dim=None``) per ε and key, d = 10, true d' = 2, n rows."""
  d, true_dim = DIM_CHOICE
  out = {}
  for eps in epsilons:
    dims = []
    for k in range(keys):
      X = cube_sample(seed, d, true_dim, k, n)
      key = jax.random.fold_in(jax.random.key(seed + 2), k)
      res = low_dimensional_synthetic_data(key, X, epsilon=eps, covariance_scale=covariance_scale)
      dims.append(int(res.released["dim"]))
    out[eps_key(eps)] = dims
    log(f"  private d' at ε={eps:g}: {dims}")
  return {"d": d, "true_dim": true_dim, "n": n, "dims": out}


# ------------------------------------------------------------------------------------------------
# 2. Digits


def digits(*, epsilons, keys, w1_rows, seed, covariance_scale="paper") -> dict:
  """Median W1(digits, synthetic) over keys and the chosen d' per ε; the halves' W1 floor."""
  from sklearn.datasets import load_digits
  X = data_lib.scale_to_unit_cube(jnp.asarray(load_digits().data, jnp.float32), 0.0, 16.0)
  Xn = np.asarray(X)
  perm = np.random.default_rng(seed).permutation(len(Xn))
  half = len(Xn) // 2
  floor, floor_label = w1(Xn[perm[:half]], Xn[perm[half:]], w1_rows)
  # Context: every synthetic row at the data's mean (a non-private point mass) has this W1.
  at_mean = float(np.linalg.norm(Xn - Xn.mean(axis=0), axis=1).mean())
  out = {"n": len(Xn), "d": Xn.shape[1], "sampling_floor_halves": floor, "w1_label": floor_label,
         "w1_all_at_mean": at_mean, "epsilons": {}}
  for eps in epsilons:
    values, dims, methods = [], [], []
    for k in range(keys):
      key = jax.random.fold_in(jax.random.key(seed + 3), k)
      res = low_dimensional_synthetic_data(key, X, epsilon=eps, covariance_scale=covariance_scale)
      values.append(w1(Xn, res.synthetic, w1_rows)[0])
      dims.append(int(res.released["dim"]))
      methods.append(res.info["method"])
    out["epsilons"][eps_key(eps)] = {"w1": float(np.median(values)), "w1_per_key": values,
                                     "dims": dims, "synthetic_method": methods}
    log(f"  digits ε={eps:g}: W1 {np.median(values):.4f}, d' {dims}")
  return out


def summarise_digits(result) -> dict:
  """``{"<ε>": {"w1", "dim" (the most common chosen d', smallest on ties), "sampling_floor"}}``."""
  out = {}
  for eps, r in result["epsilons"].items():
    counts = collections.Counter(r["dims"])
    top = max(counts.values())
    out[eps] = {"w1": r["w1"], "dim": min(k for k, c in counts.items() if c == top),
                "sampling_floor": result["sampling_floor_halves"]}
  return out


# ------------------------------------------------------------------------------------------------
# 3. Speed: the NumPy baseline (the same steps, vectorised; loops only over PMM's r ≤ 24 levels)


def numpy_leaf_index(Y: np.ndarray, depth: int) -> np.ndarray:
  """``(n,)`` leaf of each row: grid bits interleaved in split order, most significant first."""
  dim = Y.shape[1]
  splits = np.asarray([len(range(c, depth, dim)) for c in range(dim)])
  grid = np.clip(np.floor(Y * 2.0**splits), 0, 2**splits - 1).astype(np.int64)
  leaf = np.zeros(len(Y), np.int64)
  used = np.zeros(dim, np.int64)
  for j in range(depth):
    c = j % dim
    used[c] += 1
    leaf = (leaf << 1) | ((grid[:, c] >> (splits[c] - used[c])) & 1)
  return leaf


def numpy_leaf_cells(depth: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
  """``(lower (2^r, d'), side (d',))`` of the leaf cells."""
  splits = np.asarray([len(range(c, depth, dim)) for c in range(dim)])
  leaves = np.arange(2**depth, dtype=np.int64)
  grid = np.zeros((2**depth, dim), np.int64)
  for j in range(depth):
    c = j % dim
    grid[:, c] = (grid[:, c] << 1) | ((leaves >> (depth - 1 - j)) & 1)
  side = 2.0 ** -splits
  return grid * side, side


def numpy_consistent_counts(noisy_levels: list, n: int) -> np.ndarray:
  """The same top-down consistency as ``dpjax.synthetic.pmm.consistent_counts`` (float32
  shares, round half to even), in NumPy."""
  parent = np.asarray([n], np.int64)
  for noisy in noisy_levels:
    pairs = np.maximum(np.asarray(noisy).reshape(-1, 2), 0).astype(np.float32)
    total = pairs.sum(axis=1)
    share = np.where(total > 0, pairs[:, 0] / np.where(total > 0, total, 1.0), 0.5)
    share = share.astype(np.float32)
    left = np.where(total > 0, np.round(parent.astype(np.float32) * share), parent // 2)
    left = np.clip(left.astype(np.int64), 0, parent)
    parent = np.stack([left, parent - left], axis=1).reshape(-1)
  return parent


def numpy_discrete_laplace(rng, scales: np.ndarray) -> np.ndarray:
  """Integers with ``P(z) ∝ exp(−|z|/scale)``: the difference of two geometric variables."""
  p = -np.expm1(-1.0 / np.asarray(scales, np.float64))
  return rng.geometric(p) - rng.geometric(p)


def numpy_pmm(rng, Y: np.ndarray, *, epsilon: float, depth: int | None = None) -> np.ndarray:
  """PMM on ``Y (n, d')`` in the unit cube, NumPy: the same levels, noise scales (the public
  formulas ``pmm_depth`` / ``pmm_noise_scales``), consistency and emission as dpjax."""
  n, dim = Y.shape
  r = pmm_lib.pmm_depth(epsilon * n) if depth is None else depth
  counts = np.bincount(numpy_leaf_index(Y, r), minlength=2**r)
  levels = [counts]
  for _ in range(r - 1):                               # level j from level j + 1: O(2^r) in all
    levels.append(levels[-1].reshape(-1, 2).sum(axis=1))
  levels = levels[::-1]                                # level 1 first
  scales = pmm_lib.pmm_noise_scales(epsilon, r, dim)
  noise = numpy_discrete_laplace(rng, np.repeat(scales, 2 ** np.arange(1, r + 1)))
  offsets = np.cumsum([0] + [2**j for j in range(1, r + 1)])
  noisy = [levels[j] + noise[offsets[j]:offsets[j + 1]] for j in range(r)]
  final = numpy_consistent_counts(noisy, n)
  lower, side = numpy_leaf_cells(r, dim)
  points = np.repeat(lower, final, axis=0) + rng.random((n, dim)) * side
  return points[rng.permutation(n)]


def numpy_pipeline(rng, X: np.ndarray, *, epsilon: float, dim: int,
                   covariance_scale: str = "paper") -> np.ndarray:
  """The pipeline's steps in NumPy (thirds of ε, the same covariance noise scale, PMM)."""
  X = np.asarray(X, np.float64)
  n, d = X.shape
  eps_c = eps_m = eps_s = epsilon / 3
  mean = X.mean(axis=0)
  M = X.T @ X / n - np.outer(mean, mean)
  upper = np.triu_indices(d)
  noisy = np.zeros((d, d))
  scale = projection.covariance_sensitivity(n, d, covariance_scale) / eps_c    # 3d²/(ε_c n)
  noisy[upper] = M[upper] + rng.laplace(scale=scale, size=len(upper[0]))
  noisy = noisy + np.triu(noisy, 1).T
  mu = np.clip(mean + rng.laplace(scale=d / (eps_m * n), size=d), 0.0, 1.0)
  radius = float(np.linalg.norm(np.maximum(mu, 1.0 - mu)))
  V = np.linalg.eigh(noisy)[1][:, ::-1][:, :dim]
  Y = cube_scaling((X - mu) @ V, radius)
  points = numpy_pmm(rng, Y, epsilon=eps_s)
  return np.clip((2 * radius * points - radius) @ V.T + mu, 0.0, 1.0)


def check_numpy_baseline(seed: int = 0) -> dict:
  """The baseline's leaf index, leaf cells and consistency equal dpjax's (bool per piece)."""
  rng = np.random.default_rng(seed)
  out = {"leaf_index": True, "leaf_cells": True, "consistent_counts": True}
  for dim, depth in ((1, 7), (2, 9), (3, 10)):
    Y = rng.random((3000, dim)).astype(np.float32)
    Y[:5] = [[0.0] * dim, [1.0] * dim, [0.5] * dim, [-0.1] * dim, [1.2] * dim]    # edge cases
    ours = numpy_leaf_index(Y, depth)
    out["leaf_index"] &= bool(np.array_equal(ours, np.asarray(pmm_lib.leaf_index(
        jnp.asarray(Y), depth))))
    lower, side = numpy_leaf_cells(depth, dim)
    their_lower, their_side = pmm_lib.leaf_cells(depth, dim)
    out["leaf_cells"] &= bool(np.allclose(lower, their_lower) and np.allclose(side, their_side))
    counts = np.bincount(ours, minlength=2**depth)
    noisy = [counts.reshape(2**j, -1).sum(axis=1) + rng.integers(-40, 40, 2**j)
             for j in range(1, depth + 1)]
    mine = numpy_consistent_counts(noisy, len(Y))
    theirs = pmm_lib.consistent_counts([jnp.asarray(x, jnp.int32) for x in noisy], len(Y))
    out["consistent_counts"] &= bool(np.array_equal(mine, np.asarray(theirs)))
  return out


def speed(*, sizes, epsilon, repeats, seed, covariance_scale="paper") -> dict:
  """dpjax's pipeline vs :func:`numpy_pipeline` at d = 50, d' = 2: paired, interleaved times."""
  d, dim = SPEED_SHAPE
  out = {}
  for n in sizes:
    X = data_lib.low_dimensional_cube_data(jax.random.key(seed + 4), n, d, dim)[0]
    X = jax.block_until_ready(X)
    Xn = np.asarray(X)

    def ours(r, X=X):
      key = jax.random.fold_in(jax.random.key(seed + 5), r + 1)       # r = -1: the first call
      syn = low_dimensional_synthetic_data(key, X, epsilon=epsilon, dim=dim,
                                           covariance_scale=covariance_scale).synthetic
      return jax.block_until_ready(syn).shape            # keep no (n, d) output per repeat

    def baseline(r, Xn=Xn):
      rng = np.random.default_rng([seed, r + 1])
      return numpy_pipeline(rng, Xn, epsilon=epsilon, dim=dim,
                            covariance_scale=covariance_scale).shape

    jax.clear_caches()                                  # a true first call: compile everything
    compile_s, _ = timed(lambda: ours(-1))
    baseline(-1)                                        # warm the baseline's caches too
    t_ours, t_base, out_ours, out_base = interleaved(ours, baseline, repeats)
    p = paired(t_ours, t_base)
    out[str(n)] = {"dpjax_s": p["dpjax_median_s"], "numpy_s": p["baseline_median_s"],
                   "ratio_median": p["speedup_median"], "ratio_min": p["speedup_min"],
                   "ratios": p["paired_ratios"], "dpjax_times": t_ours, "numpy_times": t_base,
                   "compile_s": compile_s,
                   "shapes_agree": all(a == b == (n, d) for a, b in zip(out_ours, out_base))}
    log(f"  speed n={n}: dpjax {p['dpjax_median_s']:.3f} s, numpy {p['baseline_median_s']:.3f} s, "
        f"first call {compile_s:.2f} s")
  return out


# ------------------------------------------------------------------------------------------------
# Output


def _print_tables(report: dict) -> None:
  cfg, summary = report["config"], report["summary"]
  print(f"\n1. W1(data, ·) at ε={cfg['epsilon']:g} (covariance scale {cfg['covariance_scale']}): "
        f"median over {cfg['keys']} keys, exact on ≤ {cfg['w1_rows']} rows per side\n"
        f"   pipeline: dpjax (ε-DP); pmm_full_dim: PMM in all d coordinates (baseline); "
        f"nonpriv_proj: exact projection + PMM (not private);\n   sampl_floor: an independent "
        f"sample; at_mean: every row at the exact mean (not private)")
  print(f"{'d':>4s} {'d′':>3s} {'n':>8s} {'pipeline':>9s} {'pmm_full_dim':>13s} "
        f"{'nonpriv_proj':>13s} {'sampl_floor':>12s} {'at_mean':>8s}  synthetic step")
  by = {(p["d"], p["dim"], p["n"], p["method"]): p for p in report["points"]}
  for d, dim, n in sorted({k[:3] for k in by}):
    w = [by[(d, dim, n, m)]["w1_median"] for m in METHODS]
    steps = ",".join(sorted(set(by[(d, dim, n, "pipeline")]["synthetic_method"])))
    print(f"{d:4d} {dim:3d} {n:8d} {w[0]:9.4f} {w[1]:13.4f} {w[2]:13.4f} {w[3]:12.4f} "
          f"{w[4]:8.4f}  {steps}")
  print(f"\n{'d,d′':>7s} {'slope':>7s} {'slope n≤w1rows':>15s} {'theory':>7s} "
        f"{'W1 ratio pmm_full_dim/pipeline at largest n':>44s}")
  for name, s in summary["slope"].items():
    se = summary["slope_exact_range"][name]
    print(f"{name:>7s} {_fmt(s):>7s} {_fmt(se):>15s} {summary['slope_theory'][name]:7.3f} "
          f"{summary['w1_ratio_vs_full_dim_pmm'][name]:44.2f}")
  dc = report["dim_choice"]
  print(f"\nprivate d′ (dim=None), d={dc['d']}, true d′={dc['true_dim']}, n={dc['n']}: " +
        "; ".join(f"ε={e}: {v}" for e, v in dc["dims"].items()))
  dg = report["digits"]
  print(f"\n2. digits ({dg['n']} × {dg['d']}, /16), d′ chosen privately; sampling floor "
        f"(W1 of two random halves) {dg['sampling_floor_halves']:.4f}; every row at the data's "
        f"mean (non-private point mass) {dg['w1_all_at_mean']:.4f}")
  print(f"{'ε':>5s} {'W1':>8s}  d′ per key")
  for eps, r in dg["epsilons"].items():
    print(f"{eps:>5s} {r['w1']:8.4f}  {r['dims']}")
  print(f"\n3. speed, d={SPEED_SHAPE[0]}, d′={SPEED_SHAPE[1]}: dpjax pipeline vs a vectorised "
        f"NumPy implementation of the same steps\n   (float Laplace, geometric-difference integer "
        f"noise); baseline checks {report['baseline_checks']}")
  print(f"{'n':>9s} {'dpjax s':>9s} {'numpy s':>9s} {'numpy/dpjax median':>19s} {'min':>6s} "
        f"{'first call s':>13s}")
  for n, r in summary["speed"].items():
    print(f"{n:>9s} {r['dpjax_s']:9.3f} {r['numpy_s']:9.3f} {r['ratio_median']:19.2f} "
          f"{r['ratio_min']:6.2f} {r['compile_s']:13.2f}")


def _fmt(x) -> str:
  return "—" if x is None else f"{x:.3f}"


def _plot(report: dict, prefix: str) -> list[str]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  prefix = prefix[:-4] if prefix.endswith(".png") else prefix
  points = report["points"]
  dims = sorted({p["d"] for p in points})
  subs = sorted({p["dim"] for p in points})
  fig, axes = plt.subplots(len(dims), len(subs), figsize=(3.6 * len(subs), 3.0 * len(dims)),
                           squeeze=False)
  for i, d in enumerate(dims):
    for j, dim in enumerate(subs):
      ax = axes[i][j]
      for m in METHODS:
        mine = sorted((p["n"], p["w1_median"]) for p in points
                      if p["d"] == d and p["dim"] == dim and p["method"] == m)
        style = {"ls": "--", "color": "grey"} if m == "mean_point_mass" else {}
        ax.plot(*zip(*mine), marker="o", ms=3, label=m, **style)
      ns = np.asarray(sorted({p["n"] for p in points}), float)
      first = [p["w1_median"] for p in points if p["d"] == d and p["dim"] == dim
               and p["method"] == "pipeline" and p["n"] == ns[0]][0]
      ax.plot(ns, first * (ns / ns[0]) ** (-1.0 / dim), "k:", lw=1, label="∝ n^(−1/d′)")
      ax.set_xscale("log")
      ax.set_yscale("log")
      ax.set_title(f"d={d}, d′={dim}", fontsize=9)
      ax.set_xlabel("n")
      ax.set_ylabel("W1")
  axes[0][0].legend(fontsize=6)
  fig.suptitle(f"W1 to the data, ε={report['config']['epsilon']:g}", fontsize=10)
  fig.tight_layout()
  paths = [f"{prefix}_w1.png", f"{prefix}_dim.png"]
  fig.savefig(paths[0], dpi=110)
  plt.close(fig)
  dc = report["dim_choice"]
  eps = [float(e) for e in dc["dims"]]
  fig, ax = plt.subplots(figsize=(4.5, 3.2))
  for e, ds in zip(eps, dc["dims"].values()):
    ax.scatter([e] * len(ds), ds, alpha=0.5, color="C0")
  ax.plot(eps, [np.median(ds) for ds in dc["dims"].values()], "C0-", label="median chosen d′")
  ax.axhline(dc["true_dim"], color="k", ls=":", label="true d′")
  ax.set_xscale("log")
  ax.set_xlabel("ε")
  ax.set_ylabel("privately chosen d′")
  ax.set_title(f"d={dc['d']}, n={dc['n']}", fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(paths[1], dpi=110)
  plt.close(fig)
  return paths


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true",
                      help="d ∈ {10, 50}, n ≤ 1e4, 2 keys, speed at n ∈ {1e4, 1e5}, 2 repeats, "
                           "W1 on ≤ 1000 rows (full run: d ∈ {10, 50, 200}, n ≤ 1e5, 5 keys, "
                           "1e5 and 1e6, 5 repeats, 2000 rows)")
  parser.add_argument("--epsilon", type=float, default=1.0, help="ε of the reproduction (1)")
  parser.add_argument("--dims", type=int, nargs="+", default=None, help="ambient d's")
  parser.add_argument("--sub-dims", type=int, nargs="+", default=[1, 2, 3],
                      help="the data's (and the pipeline's) d'")
  parser.add_argument("--n-min", type=int, default=300, help="smallest n of the grid")
  parser.add_argument("--n-max", type=int, default=None,
                      help="largest n; the grid steps down by √10 to --n-min")
  parser.add_argument("--keys", type=int, default=None, help="keys (planes) per cell")
  parser.add_argument("--w1-rows", type=int, default=None, help="rows per side for exact W1")
  parser.add_argument("--dim-epsilons", type=float, nargs="+",
                      default=[0.5, 1.0, 2.0, 4.0, 8.0, 16.0],
                      help="ε grid of the private-d' experiment")
  parser.add_argument("--digits-epsilons", type=float, nargs="+", default=[1.0, 4.0, 16.0])
  parser.add_argument("--speed-n", type=int, nargs="+", default=None, help="n's of the timing")
  parser.add_argument("--repeats", type=int, default=None, help="paired timing repeats")
  parser.add_argument("--blas-threads", type=int, default=None,
                      help="limit BLAS/LAPACK threads (both sides; needs threadpoolctl)")
  parser.add_argument("--covariance-scale", default="paper", choices=projection.COVARIANCE_SCALES,
                      help="the pipeline's covariance noise: 'paper' 3d²/(ε_c n) or 'tight' "
                           "3d(d+1)/(2ε_c n) (every part, and the NumPy baseline)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", type=str, default=None)
  parser.add_argument("--plot", type=str, default=None,
                      help="PREFIX: writes PREFIX_w1.png and PREFIX_dim.png")
  args = parser.parse_args(argv)
  quick = args.quick
  dims = args.dims or ([10, 50] if quick else [10, 50, 200])
  if max(args.sub_dims) > min(dims) or min(args.sub_dims) < 1:
    parser.error("every d' must lie in 1..min(d)")
  grid = n_grid(args.n_min, args.n_max or (10_000 if quick else 100_000))
  if not grid:
    parser.error("--n-max must be at least --n-min")
  keys = args.keys or (2 if quick else 5)
  w1_rows = args.w1_rows or (1000 if quick else 2000)
  speed_n = args.speed_n or ([10_000, 100_000] if quick else [100_000, 1_000_000])
  repeats = args.repeats or (2 if quick else 5)
  config = {"epsilon": args.epsilon, "dims": dims, "sub_dims": args.sub_dims, "n_grid": grid,
            "keys": keys, "w1_rows": w1_rows, "dim_epsilons": args.dim_epsilons,
            "digits_epsilons": args.digits_epsilons, "speed_n": speed_n,
            "speed_shape": SPEED_SHAPE, "repeats": repeats, "blas_threads": args.blas_threads,
            "seed": args.seed, "budget_split": "thirds", "covariance_scale": args.covariance_scale,
            "data": "low_dimensional_cube_data(radius=0.3, noise=0.01)",
            "platform": platform.platform(), "device": str(jax.devices()[0])}
  started = time.perf_counter()
  with blas_threads(args.blas_threads):
    log(f"1. reproduction: d={dims} d'={args.sub_dims} n={grid} keys={keys}")
    points = reproduction(dims=dims, sub_dims=args.sub_dims, grid=grid, keys=keys,
                          epsilon=args.epsilon, w1_rows=w1_rows, seed=args.seed,
                          covariance_scale=args.covariance_scale)
    dims_chosen = dim_choice(epsilons=args.dim_epsilons, n=grid[-1], keys=keys, seed=args.seed,
                             covariance_scale=args.covariance_scale)
    log("2. digits")
    digit = digits(epsilons=args.digits_epsilons, keys=keys, w1_rows=w1_rows, seed=args.seed,
                   covariance_scale=args.covariance_scale)
    log("3. speed")
    checks = check_numpy_baseline(args.seed)
    if not all(checks.values()):
      log(f"WARNING: the NumPy baseline differs from dpjax: {checks}")
    timing = speed(sizes=speed_n, epsilon=args.epsilon, repeats=repeats, seed=args.seed,
                   covariance_scale=args.covariance_scale)
    config["blas"] = blas_info()
  summary = summarise_reproduction(points, w1_rows)
  summary["digits"] = summarise_digits(digit)
  summary["speed"] = {n: {k: r[k] for k in ("dpjax_s", "numpy_s", "ratio_median", "ratio_min",
                                            "compile_s")} for n, r in timing.items()}
  config["seconds"] = time.perf_counter() - started
  report = {"config": config, "summary": summary, "points": points, "dim_choice": dims_chosen,
            "digits": digit, "speed": timing, "baseline_checks": checks}
  _print_tables(report)
  print(f"\ntotal {config['seconds']:.0f} s")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  if args.plot:
    report["plots"] = _plot(report, args.plot)
  return report


if __name__ == "__main__":
  main()
  sys.exit(0)
