"""DPASE speed: dpjax (jitted, vmapped) against a straightforward NumPy loop of the same algorithm.

Both run in this process on the same data and the same public parameters (t, m, q, ℓ), so the
printed ratio is measured in-run; absolute times depend on the machine and are not a claim.

    python benchmarks/dpase_speed.py              # n = 100,000, d = 1,000, k = 5
    python benchmarks/dpase_speed.py --quick      # n = 20,000, d = 200
    python benchmarks/dpase_speed.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import jax
import numpy as np

from dpjax import data, metrics
from dpjax.subspace import approximate


def numpy_dpase(rng: np.random.Generator, X: np.ndarray, *, epsilon: float, delta: float, k: int,
                params: approximate.DPASEParameters) -> tuple[bool, np.ndarray]:
  """Reference DPASE written the obvious way: a Python loop of SVDs and a dict histogram."""
  n, d = X.shape
  t, m, q, ell = (params.num_subsets, params.subset_size, params.num_reference_points,
                  params.cell_length)
  perm = rng.permutation(n)
  reference = rng.standard_normal((q, d)).astype(X.dtype)
  offset = rng.random()
  cells = []
  for j in range(t):
    block = X[perm[j * m:(j + 1) * m]]
    _, _, vt = np.linalg.svd(block, full_matrices=False)
    V = vt[:k].T
    points = (reference @ V) @ V.T
    cells.append(tuple(np.floor(points.reshape(-1) / ell - offset).astype(np.int64)))
  counts: dict[tuple, int] = {}
  for c in cells:
    counts[c] = counts.get(c, 0) + 1
  p = math.exp(-epsilon / 2.0)
  tau = params.threshold
  best, best_key = None, (-np.inf, 0.0)
  for cell, count in counts.items():           # one discrete-Laplace draw per distinct bin
    noisy = count + rng.geometric(1 - p) - rng.geometric(1 - p)
    key = (noisy, rng.random())                # ties broken by fresh randomness
    if noisy >= tau and key > best_key:
      best, best_key = cell, key
  best_count = best_key[0]
  if best is None or best_count < t / 2:
    return False, np.zeros((d, k), X.dtype)
  point = ell * (np.asarray(best, X.dtype) + offset + rng.random(q * d))
  _, _, vt = np.linalg.svd(point.reshape(q, d), full_matrices=False)
  return True, vt[:k].T


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="n=20,000, d=200")
  parser.add_argument("--n", type=int, default=None)
  parser.add_argument("--d", type=int, default=None)
  parser.add_argument("--k", type=int, default=5)
  parser.add_argument("--epsilon", type=float, default=1.0)
  parser.add_argument("--delta", type=float, default=1e-6)
  parser.add_argument("--gamma", type=float, default=None,
                      help="model tail ratio γ (default 1e-6: DPASE succeeds, so both "
                      "implementations run the full algorithm)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--json", type=str, default=None)
  args = parser.parse_args(argv)
  n = args.n or (20_000 if args.quick else 100_000)
  d = args.d or (200 if args.quick else 1_000)
  k = args.k
  gamma = args.gamma if args.gamma is not None else 1e-6

  X, model = data.approximate_subspace_data(jax.random.key(0), n, d, k, gamma=gamma)
  X.block_until_ready()
  X_np = np.asarray(X)
  params = approximate.dpase_parameters(n, d, k, epsilon=args.epsilon, delta=args.delta,
                                        gamma=gamma)
  kwargs = dict(epsilon=args.epsilon, delta=args.delta, k=k, cell_length=params.cell_length)

  start = time.perf_counter()
  first = approximate.dpase(jax.random.key(1), X, **kwargs)
  first.basis.block_until_ready()
  compile_and_first = time.perf_counter() - start

  jax_times, jax_errors = [], []
  for r in range(args.repeats):
    start = time.perf_counter()
    res = approximate.dpase(jax.random.key(2 + r), X, **kwargs)
    res.basis.block_until_ready()
    jax_times.append(time.perf_counter() - start)
    jax_errors.append(float(metrics.projection_distance(res.basis, model.basis))
                      if bool(res.ok) else math.inf)

  np_times, np_errors = [], []
  for r in range(args.repeats):
    rng = np.random.default_rng(100 + r)
    start = time.perf_counter()
    ok, V = numpy_dpase(rng, X_np, epsilon=args.epsilon, delta=args.delta, k=k, params=params)
    np_times.append(time.perf_counter() - start)
    np_errors.append(float(metrics.projection_distance(jax.numpy.asarray(V), model.basis))
                     if ok else math.inf)

  jax_median, np_median = float(np.median(jax_times)), float(np.median(np_times))
  summary = {
      "speedup_vs_numpy": np_median / jax_median,
      "dpjax_median_s": jax_median,
      "numpy_median_s": np_median,
      "dpjax_first_call_s_including_compile": compile_and_first,
      "dpjax_errors": jax_errors,
      "numpy_errors": np_errors,
  }
  config = {"n": n, "d": d, "k": k, "epsilon": args.epsilon, "delta": args.delta,
            "gamma": gamma, "t": params.num_subsets, "m": params.subset_size,
            "q": params.num_reference_points, "cell_length": params.cell_length,
            "repeats": args.repeats, "backend": jax.default_backend(),
            "machine": platform.processor() or platform.machine()}
  print(f"DPASE speed  n={n} d={d} k={k} t={params.num_subsets} m={params.subset_size} "
        f"q={params.num_reference_points} backend={jax.default_backend()}")
  print(f"{'implementation':<28}{'median s':>10}{'errors ‖Π̂−Π‖':>30}")
  print(f"{'dpjax (jit + vmap)':<28}{jax_median:>10.3f}   "
        f"{', '.join(f'{e:.3f}' for e in jax_errors):>27}")
  print(f"{'numpy loop of SVDs':<28}{np_median:>10.3f}   "
        f"{', '.join(f'{e:.3f}' for e in np_errors):>27}")
  print(f"speedup (numpy / dpjax): {summary['speedup_vs_numpy']:.1f}x   "
        f"(dpjax first call incl. compile: {compile_and_first:.2f} s)")
  out = {"summary": summary, "config": config}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
  return out


if __name__ == "__main__":
  main()
