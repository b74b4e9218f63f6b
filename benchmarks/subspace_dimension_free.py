"""Reproduction: private subspace learning whose sample size does not grow with d ([SS21]).

On the paper's model (N(0, Σ), top-k eigenvalues in [1, 2], the rest γ²), k = 5, ε = 1, δ = 1e-6,
for each d and n on a grid, several keys per point: median ‖Π̂ − Π‖, P[‖Π̂ − Π‖ ≤ 0.1] with a
Clopper–Pearson interval, and the ⊥ rate, for DPASE, DPASEB, Analyze Gauss and non-private PCA
(the floor). Reports, per method and d, the smallest n on the grid with median error ≤ 0.1.

γ: DPASE's guarantee needs ``γ² ≲ ε α² n / (d² k³ ln(1/δ))``, i.e. γ of order 1/d for n
independent of d; with dpjax's explicit constants (and the accuracy cap on the cell length) the
measured regime is γ ≈ 10⁻⁶/d (default ``--gamma-scale 1e-6``). ``--gamma-scale 0.01`` or a
fixed ``--gamma 1e-4`` show where dimension-freedom breaks: the projected reference points of the
t subsets then spread over more than one cell and DPASE answers ⊥ at every n on the grid. Analyze Gauss clips rows to the public norm
``C = sqrt(2·(2k + γ² d))`` (twice the expected squared norm, public from the model's parameters)
and its noise grows like sqrt(d); it is skipped at d > 2,000 where the d×d eigendecomposition is
too slow for this 2-core machine (reported as null).

    python benchmarks/subspace_dimension_free.py --quick --json out.json --plot-prefix fig
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import numpy as np

from dpjax import data, metrics
from dpjax.subspace import analyze_gauss, dpase, dpaseb, pca_subspace

ALPHA = 0.1
METHODS = ("dpase", "dpaseb", "analyze_gauss", "pca")


def _error(res, basis):
  return float(metrics.projection_distance(res.basis, basis)) if bool(res.ok) else math.inf


def run_point(method, n, d, k, gamma, epsilon, delta, trials, seed):
  errors = []
  for trial in range(trials):
    key_data, key_run = jax.random.split(jax.random.fold_in(jax.random.key(seed), trial))
    X, model = data.approximate_subspace_data(key_data, n, d, k, gamma=gamma)
    if method == "dpase":
      res = dpase(key_run, X, epsilon=epsilon, delta=delta, k=k, gamma=gamma)
    elif method == "dpaseb":
      res = dpaseb(key_run, X, epsilon=epsilon, delta=delta, k=k, alpha=ALPHA, beta=0.1,
                   gamma=gamma)
    elif method == "analyze_gauss":
      clip = math.sqrt(2.0 * (2 * k + gamma**2 * d))
      res = analyze_gauss(key_run, X, epsilon=epsilon, delta=delta, k=k, clip_norm=clip)
    else:
      res = pca_subspace(X, k=k)
    errors.append(_error(res, model.basis))
  errors = np.asarray(errors)
  rate = metrics.success_rate(errors, ALPHA)
  return {"method": method, "n": n, "d": d, "gamma": gamma, "trials": trials,
          "median_error": float(np.median(errors)), "success_rate": rate["rate"],
          "ci95": [rate["low"], rate["high"]], "bottom_rate": float(np.mean(np.isinf(errors)))}


def feasible(method, n, d, k, epsilon, delta):
  """Whether a method can run at (n, d) (public parameters only), with the reason if not."""
  if method == "analyze_gauss" and d > 2_000:
    return False, "d×d eigendecomposition too slow on this machine"
  if method == "pca" and min(n, d) ** 2 * max(n, d) > 2e11:
    return False, "too slow on this machine (the floor is 0 at every smaller n)"
  if method == "dpaseb":
    from dpjax.subspace import num_blocks_for, num_subsets_for
    if n // num_blocks_for(0.1) < num_subsets_for(epsilon, delta) * (k + 1):
      return False, "n too small for T blocks of DPASE"
  if method == "dpase":
    from dpjax.subspace import num_subsets_for
    if n // num_subsets_for(epsilon, delta) < k + 1:
      return False, "n too small"
  return True, ""


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(v) for v in text.split(","))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="d in {100, 1000}, 3 keys per point")
  parser.add_argument("--trials", type=int, default=None)
  parser.add_argument("--gamma", type=float, default=None, help="fixed γ for every d")
  parser.add_argument("--gamma-scale", type=float, default=1e-6, help="γ = scale/d (default)")
  parser.add_argument("--json", type=str, default=None)
  parser.add_argument("--plot-prefix", type=str, default=None,
                      help="write PREFIX_error_vs_n.png and PREFIX_n_vs_d.png")
  parser.add_argument("--dims", type=_ints, default=None,
                      help="comma-separated d (default 100,1000,10000; 100,1000 with --quick)")
  parser.add_argument("--grid", type=_ints, default=(1_000, 3_000, 10_000, 30_000),
                      help="comma-separated n (default 1000,3000,10000,30000)")
  parser.add_argument("--k", type=int, default=5, help="subspace dimension (default 5)")
  args = parser.parse_args(argv)
  k, epsilon, delta = args.k, 1.0, 1e-6
  dims = args.dims or ((100, 1_000) if args.quick else (100, 1_000, 10_000))
  grid = args.grid
  trials = args.trials or (3 if args.quick else 5)
  points, skipped = [], []
  start = time.perf_counter()
  for d in dims:
    gamma = args.gamma if args.gamma is not None else args.gamma_scale / d
    for n in grid:
      for method in METHODS:
        ok, why = feasible(method, n, d, k, epsilon, delta)
        if not ok:
          skipped.append({"method": method, "n": n, "d": d, "reason": why})
          continue
        p = run_point(method, n, d, k, gamma, epsilon, delta, trials, seed=n + d)
        points.append(p)
        print(f"d={d:>6} n={n:>7} {method:<14} median={p['median_error']:.3f} "
              f"P[≤{ALPHA}]={p['success_rate']:.2f} [{p['ci95'][0]:.2f},{p['ci95'][1]:.2f}] "
              f"⊥={p['bottom_rate']:.2f}", flush=True)
  n_at_alpha = {m: {} for m in METHODS}
  error_at_largest = {m: {} for m in METHODS}
  for m in METHODS:
    for d in dims:
      mine = sorted((p for p in points if p["method"] == m and p["d"] == d),
                    key=lambda p: p["n"])
      hits = [p["n"] for p in mine if p["median_error"] <= ALPHA]
      n_at_alpha[m][str(d)] = hits[0] if hits else None
      error_at_largest[m][str(d)] = mine[-1]["median_error"] if mine else None
  print("\nsmallest n on the grid with median ‖Π̂ − Π‖ ≤ 0.1 "
        f"(k={k}, ε={epsilon}, δ={delta:g}, γ={'%g' % args.gamma if args.gamma else f'{args.gamma_scale:g}/d'})")
  print(f"{'method':<15}" + "".join(f"{'d=' + str(d):>12}" for d in dims))
  for m in METHODS:
    print(f"{m:<15}" + "".join(f"{str(n_at_alpha[m][str(d)]):>12}" for d in dims))
  print(f"(took {time.perf_counter() - start:.0f} s)")
  out = {"summary": {"n_at_alpha": n_at_alpha, "error_at_largest_n": error_at_largest},
         "config": {"k": k, "epsilon": epsilon, "delta": delta, "alpha": ALPHA,
                    "gamma": args.gamma, "gamma_scale": None if args.gamma else args.gamma_scale,
                    "dims": list(dims), "grid": list(grid), "trials": trials},
         "points": points, "skipped": skipped}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
  if args.plot_prefix:
    _plots(points, dims, n_at_alpha, args.plot_prefix)
  return out


def _plots(points, dims, n_at_alpha, prefix):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(dims), figsize=(4.5 * len(dims), 3.8), sharey=True)
  for ax, d in zip(np.atleast_1d(axes), dims):
    for m in METHODS:
      mine = sorted((p for p in points if p["method"] == m and p["d"] == d),
                    key=lambda p: p["n"])
      if mine:
        ax.plot([p["n"] for p in mine], [min(p["median_error"], 1.0) for p in mine], "o-",
                label=m)
    ax.axhline(ALPHA, color="grey", ls=":")
    ax.set_xscale("log")
    ax.set_title(f"d = {d}")
    ax.set_xlabel("n")
  np.atleast_1d(axes)[0].set_ylabel("median ‖Π̂ − Π‖ (⊥ = 1)")
  np.atleast_1d(axes)[-1].legend()
  fig.tight_layout()
  fig.savefig(f"{prefix}_error_vs_n.png", dpi=110)
  plt.close(fig)
  fig, ax = plt.subplots(figsize=(5, 3.8))
  for m in METHODS:
    xs = [d for d in dims if n_at_alpha[m][str(d)] is not None]
    ax.plot(xs, [n_at_alpha[m][str(d)] for d in xs], "o-", label=m)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("d")
  ax.set_ylabel("smallest n with median error ≤ 0.1")
  ax.legend()
  fig.tight_layout()
  fig.savefig(f"{prefix}_n_vs_d.png", dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  main()
