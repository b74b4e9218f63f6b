"""DPASE speed: dpjax (jitted, vmapped) against a vectorised NumPy version of the same algorithm.

The baseline (:func:`numpy_dpase`) is the best straightforward vectorised NumPy DPASE: the same
per-subset computation as ``dpjax.subspace.approximate.dpase`` — one permutation, each subset
scaled by a power of two, a batched BLAS Gram matrix ``X_j X_jᵀ`` (m < d) or covariance ``X_jᵀ X_j``
(m ≥ d) per subset, ONE batched ``np.linalg.eigh`` over the stacked subsets, the same top-k
selection and QR sign fix, the projected reference points snapped to the grid, ``np.unique``
grouping with one discrete-Laplace draw per distinct cell, and the same final PCA. It is not a
Python loop of SVDs.

Timing protocol: dpjax's first call (tracing + XLA compilation + one run) is reported on its own;
the baseline gets one untimed warm-up call too. Then the two sides alternate
(dpjax, numpy, dpjax, numpy, ...) so that both see the same machine load, and the reported
speed-up is the median (and min) over repeats of the paired ratio ``numpy_r / dpjax_r``.
Separately, the Gram stage and the eigh stage are timed on their own for both libraries and
given in GFLOP/s (Gram: ``2·s²·L`` flops per subset with ``s = min(m, d)``, ``L = max(m, d)``;
eigh: the nominal ``9·s³`` of a symmetric eigendecomposition with vectors, Golub & Van Loan),
next to a plain square matmul of the same flop count as the Gram stage.

Absolute times depend on the machine (and its load) and are not a claim.

    python benchmarks/dpase_speed.py              # n = 100,000, d = 1,000, k = 5
    python benchmarks/dpase_speed.py --quick      # n = 20,000, d = 200
    python benchmarks/dpase_speed.py --n 2000 --d 60 --k 2 --repeats 5 --json out.json
    python benchmarks/dpase_speed.py --quick --blas-threads 1     # one BLAS thread per side

Measured (2-core shared CPU, ``--quick --blas-threads 1 --repeats 5``): paired ratio median
1.4×, min 1.0×; the eigh stage dominates both sides, and both call LAPACK for it.
"""

from __future__ import annotations

import argparse
import json
import math
import platform

import jax
import jax.numpy as jnp
import numpy as np

from _timing import blas_info, blas_threads, interleaved, paired, timed
from dpjax import data, metrics
from dpjax.subspace import approximate

BASELINE = ("vectorised NumPy DPASE: batched BLAS Gram/covariance per subset, one batched "
            "np.linalg.eigh over the stacked subsets, np.unique histogram")


def numpy_top_k(blocks: np.ndarray, k: int) -> np.ndarray:
  """Top-k right singular subspaces of ``(t, m, d)`` blocks, as ``dpjax.linalg`` computes them.

  Per-block power-of-two scaling, Gram route when ``m < d`` (eigenvectors U of ``X Xᵀ`` give
  ``V = Xᵀ U`` with normalised columns) else ``eigh(XᵀX)``, then QR with the signs fixed.
  """
  _, m, d = blocks.shape
  _, e = np.frexp(np.max(np.abs(blocks), axis=(1, 2)))
  blocks = np.ldexp(blocks, -e[:, None, None].astype(np.int32))
  if m < d:
    _, U = np.linalg.eigh(blocks @ blocks.transpose(0, 2, 1))
    V = blocks.transpose(0, 2, 1) @ U[:, :, ::-1][:, :, :k]
    norms = np.linalg.norm(V, axis=1, keepdims=True)
    V = V / np.maximum(norms, np.finfo(blocks.dtype).tiny ** 0.5)
  else:
    _, U = np.linalg.eigh(blocks.transpose(0, 2, 1) @ blocks)
    V = U[:, :, ::-1][:, :, :k]
  Q, R = np.linalg.qr(V)
  signs = np.where(np.diagonal(R, axis1=1, axis2=2) < 0, -1.0, 1.0).astype(blocks.dtype)
  return Q * signs[:, None, :]


def numpy_dpase(rng: np.random.Generator, X: np.ndarray, *, epsilon: float, k: int,
                params: approximate.DPASEParameters) -> tuple[bool, np.ndarray]:
  """DPASE (permutation partition, discrete noise) written as vectorised NumPy.

  The noise is NumPy's (a difference of two geometrics), not dpjax's exact integer sampler: the
  baseline is for speed, and that step is a few dozen draws either way.
  """
  n, d = X.shape
  t, m, q, ell = (params.num_subsets, params.subset_size, params.num_reference_points,
                  params.cell_length)
  perm = rng.permutation(n)
  bases = numpy_top_k(X[perm[:t * m]].reshape(t, m, d), k)               # (t, d, k)
  reference = rng.standard_normal((q, d)).astype(X.dtype)
  points = (reference @ bases) @ bases.transpose(0, 2, 1)               # (t, q, d)
  offset = X.dtype.type(rng.random())
  bound = float(np.iinfo(np.int32).max - 1)
  cells = np.clip(np.floor(points.reshape(t, q * d) / ell - offset), -bound, bound)
  cells = cells.astype(np.int32)
  bins, counts = np.unique(cells, axis=0, return_counts=True)
  p = math.exp(-epsilon / 2.0)                                           # replace-one: Δ = 2
  noisy = counts + rng.geometric(1 - p, len(counts)) - rng.geometric(1 - p, len(counts))
  best = np.lexsort((rng.random(len(counts)), noisy))[-1]               # ties: fresh randomness
  if noisy[best] < params.threshold or noisy[best] < t / 2:
    return False, np.zeros((d, k), X.dtype)
  point = ell * (bins[best].astype(X.dtype) + offset + rng.random(q * d).astype(X.dtype))
  return True, numpy_top_k(point.reshape(1, q, d), k)[0]


def stage_rates(blocks: np.ndarray, repeats: int) -> dict:
  """GFLOP/s of the Gram stage and the eigh stage (dpjax and NumPy), and of a plain matmul."""
  t, m, d = blocks.shape
  s, L = min(m, d), max(m, d)
  gram_flops, eigh_flops = 2.0 * t * s * s * L, 9.0 * t * s**3
  side = max(1, round((t * s * s * L) ** (1 / 3)))                     # 2·side³ ≈ gram_flops
  gram_np = (lambda b: b @ b.transpose(0, 2, 1)) if m < d else (lambda b: b.transpose(0, 2, 1) @ b)
  gram_jx = jax.jit(lambda b: jnp.einsum("tmd,tnd->tmn", b, b) if m < d
                    else jnp.einsum("tmd,tme->tde", b, b))
  eigh_jx = jax.jit(jnp.linalg.eigh)
  mm_jx = jax.jit(jnp.matmul)
  bj = jnp.asarray(blocks)
  G = gram_np(blocks)
  Gj = jnp.asarray(G)
  rng = np.random.default_rng(0)
  A = rng.standard_normal((side, side)).astype(blocks.dtype)
  Aj = jnp.asarray(A)
  cases = {"gram": (gram_flops, lambda: gram_jx(bj), lambda: gram_np(blocks)),
           "eigh": (eigh_flops, lambda: eigh_jx(Gj), lambda: np.linalg.eigh(G)),
           "matmul": (2.0 * side**3, lambda: mm_jx(Aj, Aj), lambda: A @ A)}
  out = {}
  for name, (flops, fj, fn) in cases.items():
    timed(fj), timed(fn)                                                # compile / warm up
    tj, tn = [], []
    for _ in range(repeats):                                            # interleaved
      tj.append(timed(fj)[0])
      tn.append(timed(fn)[0])
    out[name] = {"gflop": flops / 1e9, "dpjax_gflops": flops / 1e9 / float(np.median(tj)),
                 "numpy_gflops": flops / 1e9 / float(np.median(tn)),
                 "dpjax_median_s": float(np.median(tj)), "numpy_median_s": float(np.median(tn))}
  out["matmul"]["side"] = side
  return out


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
  parser.add_argument("--repeats", type=int, default=None,
                      help="interleaved timed pairs (default 5, 3 with --quick)")
  parser.add_argument("--blas-threads", type=int, default=None,
                      help="limit NumPy's and jax's LAPACK/BLAS threads (needs threadpoolctl); "
                      "1 avoids oversubscription on a shared machine")
  parser.add_argument("--json", type=str, default=None)
  args = parser.parse_args(argv)
  n = args.n or (20_000 if args.quick else 100_000)
  d = args.d or (200 if args.quick else 1_000)
  k = args.k
  repeats = args.repeats or (3 if args.quick else 5)
  gamma = args.gamma if args.gamma is not None else 1e-6

  X, model = data.approximate_subspace_data(jax.random.key(0), n, d, k, gamma=gamma)
  X.block_until_ready()
  X_np = np.asarray(X)
  params = approximate.dpase_parameters(n, d, k, epsilon=args.epsilon, delta=args.delta,
                                        gamma=gamma)
  kwargs = dict(epsilon=args.epsilon, delta=args.delta, k=k, cell_length=params.cell_length)
  run_jax = lambda r: approximate.dpase(jax.random.key(2 + r), X, **kwargs)  # noqa: E731
  run_np = lambda r: numpy_dpase(np.random.default_rng(100 + r), X_np, epsilon=args.epsilon,  # noqa: E731
                                 k=k, params=params)

  with blas_threads(args.blas_threads):
    first_call, _ = timed(lambda: run_jax(-1).basis)
    timed(lambda: run_np(-1))                                           # untimed warm-up
    jax_times, np_times, results, np_results = interleaved(run_jax, run_np, repeats)
    t, m = params.num_subsets, params.subset_size
    blocks = X_np[np.random.default_rng(0).permutation(n)[:t * m]].reshape(t, m, d)
    stages = stage_rates(blocks, repeats)
    blas = blas_info()
  jax_errors = [float(metrics.projection_distance(res.basis, model.basis)) if bool(res.ok)
                else math.inf for res in results]
  np_errors = [float(metrics.projection_distance(jnp.asarray(V), model.basis)) if ok
               else math.inf for ok, V in np_results]
  pair = paired(jax_times, np_times)
  jax_median, np_median = pair["dpjax_median_s"], pair["baseline_median_s"]
  summary = {
      "speedup_vs_numpy": pair["speedup_median"],
      "speedup_vs_numpy_min": pair["speedup_min"],
      "paired_ratios": pair["paired_ratios"],
      "dpjax_median_s": jax_median,
      "numpy_median_s": np_median,
      "dpjax_first_call_s_including_compile": first_call,
      "dpjax_compile_s_estimate": first_call - jax_median,
      "dpjax_errors": jax_errors,
      "numpy_errors": np_errors,
      "baseline": BASELINE,
      "gflops": stages,
  }
  config = {"n": n, "d": d, "k": k, "epsilon": args.epsilon, "delta": args.delta,
            "gamma": gamma, "t": t, "m": m, "q": params.num_reference_points,
            "cell_length": params.cell_length, "route": "gram" if m < d else "covariance",
            "repeats": repeats, "blas": blas, "backend": jax.default_backend(),
            "machine": platform.processor() or platform.machine()}
  print(f"DPASE speed  n={n} d={d} k={k} t={t} m={m} q={params.num_reference_points} "
        f"route={config['route']} backend={jax.default_backend()}")
  print(f"baseline: {BASELINE}")
  print(f"{'implementation':<28}{'median s':>10}{'errors ‖Π̂−Π‖':>30}")
  print(f"{'dpjax (jit + vmap)':<28}{jax_median:>10.3f}   "
        f"{', '.join(f'{e:.3f}' for e in jax_errors):>27}")
  print(f"{'numpy (vectorised)':<28}{np_median:>10.3f}   "
        f"{', '.join(f'{e:.3f}' for e in np_errors):>27}")
  print(f"paired ratio numpy/dpjax over {repeats} interleaved repeats: median "
        f"{summary['speedup_vs_numpy']:.2f}x, min {summary['speedup_vs_numpy_min']:.2f}x")
  print(f"dpjax first call {first_call:.2f} s (compile ≈ {summary['dpjax_compile_s_estimate']:.2f} s "
        "beyond a steady-state call)")
  print(f"{'stage GFLOP/s':<28}{'GFLOP':>8}{'dpjax':>10}{'numpy':>10}")
  for name, label in (("gram", "Gram/covariance (batched)"), ("eigh", "eigh (batched, 9s³)"),
                      ("matmul", f"plain matmul {stages['matmul']['side']}²")):
    st = stages[name]
    print(f"{label:<28}{st['gflop']:>8.2f}{st['dpjax_gflops']:>10.1f}{st['numpy_gflops']:>10.1f}")
  out = {"summary": summary, "config": config}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
  return out


if __name__ == "__main__":
  main()
