"""DPASE's success rate on the paper's model data, with Clopper–Pearson intervals.

Each trial draws a fresh dataset from N(0, Σ) (top-k eigenvalues in [1, 2], the rest γ²) and a
fresh key, runs DPASE with the default (PROPOSED) parameters, and records ‖Π̂ − Π‖ (∞ for ⊥).

    python benchmarks/dpase_success.py                 # d = 20 and 200, 50 trials each
    python benchmarks/dpase_success.py --quick         # 15 trials
    python benchmarks/dpase_success.py --json out.json
    python benchmarks/dpase_success.py --configs "6000,20,2,1e-5;20000,200,3,1e-6"
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import numpy as np

from dpjax import data, metrics
from dpjax.subspace import approximate


def run_point(n, d, k, gamma, epsilon, delta, alpha, trials, seed=0):
  errors = []
  for trial in range(trials):
    key_data, key_run = jax.random.split(jax.random.fold_in(jax.random.key(seed), trial))
    X, model = data.approximate_subspace_data(key_data, n, d, k, gamma=gamma)
    res = approximate.dpase(key_run, X, epsilon=epsilon, delta=delta, k=k, gamma=gamma)
    errors.append(float(metrics.projection_distance(res.basis, model.basis))
                  if bool(res.ok) else math.inf)
  errors = np.asarray(errors)
  summary = metrics.success_rate(errors, alpha)
  finite = errors[np.isfinite(errors)]
  return {"n": n, "d": d, "k": k, "gamma": gamma, "epsilon": epsilon, "delta": delta,
          "alpha": alpha, "success_rate": summary["rate"], "ci95": [summary["low"], summary["high"]],
          "bottom_rate": float(np.mean(~np.isfinite(errors))),
          "median_error_when_ok": float(np.median(finite)) if finite.size else None,
          "trials": trials}


CONFIGS = ((6_000, 20, 2, 1e-5), (6_000, 20, 2, 1e-4), (20_000, 200, 3, 1e-6),
           (6_000, 20, 2, 1e-2))


def _configs(text: str):
  points = []
  for item in text.split(";"):
    n, d, k, gamma = item.split(",")
    points.append((int(n), int(d), int(k), float(gamma)))
  return tuple(points)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--trials", type=int, default=None)
  parser.add_argument("--json", type=str, default=None)
  parser.add_argument("--configs", type=_configs, default=CONFIGS,
                      help="semicolon-separated n,d,k,gamma points (default "
                           + ";".join(",".join(f"{v:g}" for v in c) for c in CONFIGS) + ")")
  args = parser.parse_args(argv)
  trials = args.trials or (15 if args.quick else 50)
  configs = args.configs
  points = [run_point(n, d, k, g, 1.0, 1e-6, 0.1, trials) for n, d, k, g in configs]
  print(f"DPASE on model data, ε=1, δ=1e-6, α=0.1, {trials} trials per row")
  print(f"{'n':>7}{'d':>6}{'k':>3}{'gamma':>8}{'P[err<=α]':>11}{'95% CI':>17}{'⊥ rate':>8}"
        f"{'median err':>12}")
  for p in points:
    med = "-" if p["median_error_when_ok"] is None else f"{p['median_error_when_ok']:.3f}"
    print(f"{p['n']:>7}{p['d']:>6}{p['k']:>3}{p['gamma']:>8.0e}{p['success_rate']:>11.2f}"
          f"   [{p['ci95'][0]:.2f}, {p['ci95'][1]:.2f}]{p['bottom_rate']:>8.2f}{med:>12}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"points": points}, f, indent=2)
  return points


if __name__ == "__main__":
  main()
