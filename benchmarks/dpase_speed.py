"""DPASE speed: dpjax (jitted, vmapped) against a vectorised NumPy version of the same algorithm.

Both of DPASE's per-subset top-k solvers (``top_k_method``) are timed, each against the best
straightforward vectorised NumPy DPASE with the SAME solver (:func:`numpy_dpase`): one
permutation, each subset scaled by a power of two, then either

* "exact": a batched BLAS Gram matrix ``X_j X_jᵀ`` (m < d) or covariance ``X_jᵀ X_j`` (m ≥ d) per
  subset and ONE batched ``np.linalg.eigh`` over the stacked subsets, or
* "subspace_iteration": the same blocked subspace iteration as ``dpjax.linalg`` (same public
  start, ``r = k + 8`` columns, batched matmuls and one batched ``np.linalg.qr`` per iteration over
  all subsets, the same convergence test and cap, a batched Rayleigh–Ritz SVD),

then the same top-k selection and QR and sign fix, the projected reference points snapped to the
grid, ``np.unique`` grouping with one discrete-Laplace draw per distinct cell, and the same final
PCA. Neither side is a Python loop over subsets. ``summary.speedup_vs_numpy`` is dpjax's default
("auto") solver against NumPy with the same solver; the JSON also has each solver's pair and
dpjax's default against NumPy's faster solver.

Timing protocol: dpjax's first call (tracing + XLA compilation + one run) is reported on its own;
the baseline gets one untimed warm-up call too. Then the two sides alternate
(dpjax, numpy, dpjax, numpy, ...) so that both see the same machine load, and the reported
speed-up is the median (and min) over repeats of the paired ratio ``numpy_r / dpjax_r``.
Separately, the Gram stage, the eigh stage and ten subspace-iteration steps are timed on their own
for both libraries and given in GFLOP/s (Gram: ``2·s²·L`` flops per subset with ``s = min(m, d)``,
``L = max(m, d)``; eigh: the nominal ``9·s³`` of a symmetric eigendecomposition with vectors,
Golub & Van Loan; one iteration: ``4·m·d·r``), next to a plain square matmul of the same flop
count as the Gram stage.

Absolute times depend on the machine (and its load) and are not a claim.

    python benchmarks/dpase_speed.py              # n = 100,000, d = 1,000, k = 5
    python benchmarks/dpase_speed.py --quick      # n = 20,000, d = 200
    python benchmarks/dpase_speed.py --n 2000 --d 60 --k 2 --repeats 5 --json out.json
    python benchmarks/dpase_speed.py --quick --blas-threads 1     # one BLAS thread per side

Measured (2-core shared CPU, ``--blas-threads 1 --repeats 5``; n = 10⁵, d = 10³, k = 5): dpjax's
default solver (the subspace iteration) 0.53 s, paired ratio median 1.7× (min 1.4×) against NumPy's
same iteration and 19× against NumPy's exact route (10.1 s); the exact route 3.8 s, 2.6× (min 2.3×)
against NumPy's exact route. Gram stage 187 GFLOP/s (NumPy 188), plain matmul 159, iteration
steps 44 (NumPy 22). ``--quick``: 1.4× (min 1.2×) iteration, 1.7× (min 1.4×) exact.
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
from dpjax import data, linalg, metrics
from dpjax.subspace import approximate

BASELINE = ("vectorised NumPy DPASE with the same per-subset solver: exact = batched BLAS "
            "Gram/covariance and one batched np.linalg.eigh over the stacked subsets; "
            "subspace_iteration = batched matmuls and np.linalg.qr over all subsets per step; "
            "np.unique histogram")


def numpy_top_k(blocks: np.ndarray, k: int, method: str = "exact",
                max_iterations: int = linalg.DEFAULT_MAX_ITERATIONS) -> np.ndarray:
  """Top-k right singular subspaces of ``(t, m, d)`` blocks, as ``dpjax.linalg`` computes them.

  Per-block power-of-two scaling, then for "exact" the Gram route when ``m < d`` (eigenvectors U
  of ``X Xᵀ`` give ``V = Xᵀ U`` with normalised columns) else ``eigh(XᵀX)``; for
  "subspace_iteration" :func:`numpy_subspace_iteration`. Then QR, and each column's sign fixed as
  :func:`dpjax.linalg.canonical_signs` does.
  """
  _, m, d = blocks.shape
  _, e = np.frexp(np.max(np.abs(blocks), axis=(1, 2)))
  blocks = np.ldexp(blocks, -e[:, None, None].astype(np.int32))
  if method == "subspace_iteration":
    V = numpy_subspace_iteration(blocks, k, max_iterations)
  elif m < d:
    _, U = np.linalg.eigh(blocks @ blocks.transpose(0, 2, 1))
    V = blocks.transpose(0, 2, 1) @ U[:, :, ::-1][:, :, :k]
    norms = np.linalg.norm(V, axis=1, keepdims=True)
    V = V / np.maximum(norms, np.finfo(blocks.dtype).tiny ** 0.5)
  else:
    _, U = np.linalg.eigh(blocks.transpose(0, 2, 1) @ blocks)
    V = U[:, :, ::-1][:, :, :k]
  Q, _ = np.linalg.qr(V)
  top = np.argmax(np.abs(Q), axis=1)[:, None, :]
  return Q * np.where(np.take_along_axis(Q, top, axis=1) < 0, -1, 1).astype(blocks.dtype)


def numpy_subspace_iteration(blocks: np.ndarray, k: int, max_iterations: int,
                             tol: float | None = linalg.DEFAULT_TOL) -> np.ndarray:
  """dpjax's subspace iteration for all blocks at once: ``V ← qr(Xᵀ(X V))`` until every block's
  leading k columns move by at most dpjax's tolerance (``linalg.subspace_iteration_tolerance``)
  or the cap, then Rayleigh–Ritz. The start is dpjax's (the same public Gaussian matrix).
  ``tol=None`` runs exactly ``max_iterations`` steps (the stage timing)."""
  t, _, d = blocks.shape
  r = min(k + linalg.DEFAULT_OVERSAMPLING, d)
  start = np.asarray(jax.random.normal(jax.random.key(0), (d, r), blocks.dtype))
  V = np.broadcast_to(np.linalg.qr(start)[0], (t, d, r))
  stop = None if tol is None else linalg.subspace_iteration_tolerance(tol, d, k, blocks.dtype)
  for _ in range(max_iterations):
    W, _ = np.linalg.qr(blocks.transpose(0, 2, 1) @ (blocks @ V))
    Vk, Wk = V[:, :, :k], W[:, :, :k]
    moved = np.linalg.norm(Wk - Vk @ (Vk.transpose(0, 2, 1) @ Wk), axis=(1, 2))
    V = W
    if stop is not None and np.all(moved <= stop):
      break
  _, _, Rt = np.linalg.svd(blocks @ V, full_matrices=False)
  return V @ Rt[:, :k].transpose(0, 2, 1)


def numpy_dpase(rng: np.random.Generator, X: np.ndarray, *, epsilon: float, k: int,
                params: approximate.DPASEParameters,
                solver: approximate.TopKSolver = approximate.TopKSolver("exact", 0),
                ) -> tuple[bool, np.ndarray]:
  """DPASE (permutation partition, discrete noise) written as vectorised NumPy.

  The noise is NumPy's (a difference of two geometrics), not dpjax's exact integer sampler: the
  baseline is for speed, and that step is a few dozen draws either way.
  """
  n, d = X.shape
  t, m, q, ell = (params.num_subsets, params.subset_size, params.num_reference_points,
                  params.cell_length)
  perm = rng.permutation(n)
  bases = numpy_top_k(X[perm[:t * m]].reshape(t, m, d), k, *solver)     # (t, d, k)
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


ITERATION_STEPS = 10


def _iteration_steps(b, k, steps):
  """Exactly ``steps`` steps of dpjax's iteration ``V ← qr(Xᵀ(X V))`` and the Rayleigh–Ritz SVD
  (the kernel of ``top_k_right_singular_vectors(method="subspace_iteration")`` without its
  stopping test, so both sides do the same flops)."""
  d = b.shape[1]
  r = min(k + linalg.DEFAULT_OVERSAMPLING, d)
  hi = jax.lax.Precision.HIGHEST
  V0, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(0), (d, r), b.dtype))
  step = lambda _, V: jnp.linalg.qr(jnp.matmul(b.T, jnp.matmul(b, V, precision=hi),  # noqa: E731
                                               precision=hi))[0]
  V = jax.lax.fori_loop(0, steps, step, V0)
  return jnp.linalg.svd(jnp.matmul(b, V, precision=hi), full_matrices=False)[2]


def stage_rates(blocks: np.ndarray, k: int, repeats: int) -> dict:
  """GFLOP/s of the Gram stage, the eigh stage and ten subspace-iteration steps (dpjax and
  NumPy), and of a plain matmul."""
  t, m, d = blocks.shape
  s, L = min(m, d), max(m, d)
  r = min(k + linalg.DEFAULT_OVERSAMPLING, d)
  gram_flops, eigh_flops = 2.0 * t * s * s * L, 9.0 * t * s**3
  iteration_flops = ITERATION_STEPS * 4.0 * t * m * d * r
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
  iterate_jx = jax.jit(jax.vmap(lambda b: _iteration_steps(b, k, ITERATION_STEPS)))
  cases = {"gram": (gram_flops, lambda: gram_jx(bj), lambda: gram_np(blocks)),
           "eigh": (eigh_flops, lambda: eigh_jx(Gj), lambda: np.linalg.eigh(G)),
           "iteration": (iteration_flops, lambda: iterate_jx(bj),
                         lambda: numpy_subspace_iteration(blocks, k, ITERATION_STEPS, tol=None)),
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
  t, m, q = params.num_subsets, params.subset_size, params.num_reference_points
  default = approximate.top_k_solver("auto", m, d, k)

  def errors(results):
    return [float(metrics.projection_distance(jnp.asarray(V), model.basis)) if bool(ok)
            else math.inf for ok, V in results]

  per_method = {}
  with blas_threads(args.blas_threads):
    for method in linalg.TOP_K_METHODS:
      solver = approximate.top_k_solver(method, m, d, k)
      kwargs = dict(epsilon=args.epsilon, delta=args.delta, k=k, cell_length=params.cell_length,
                    top_k_method=method)
      run_jax = lambda r: approximate.dpase(jax.random.key(2 + r), X, **kwargs)  # noqa: E731
      run_np = lambda r: numpy_dpase(np.random.default_rng(100 + r), X_np,  # noqa: E731
                                     epsilon=args.epsilon, k=k, params=params, solver=solver)
      first_call, _ = timed(lambda: run_jax(-1).basis)
      timed(lambda: run_np(-1))                                         # untimed warm-up
      jax_times, np_times, results, np_results = interleaved(run_jax, run_np, repeats)
      pair = paired(jax_times, np_times)
      per_method[method] = {
          "speedup_vs_numpy": pair["speedup_median"],
          "speedup_vs_numpy_min": pair["speedup_min"],
          "paired_ratios": pair["paired_ratios"],
          "dpjax_median_s": pair["dpjax_median_s"],
          "numpy_median_s": pair["baseline_median_s"],
          "dpjax_first_call_s_including_compile": first_call,
          "dpjax_compile_s_estimate": first_call - pair["dpjax_median_s"],
          "dpjax_errors": errors((res.ok, res.basis) for res in results),
          "numpy_errors": errors(np_results),
          "max_iterations": solver.max_iterations if method != "exact" else None,
      }
    blocks = X_np[np.random.default_rng(0).permutation(n)[:t * m]].reshape(t, m, d)
    stages = stage_rates(blocks, k, repeats)
    blas = blas_info()
  ours = per_method[default.method]
  numpy_best = min(per_method.values(), key=lambda p: p["numpy_median_s"])
  summary = dict(ours, top_k_method=default.method, baseline=BASELINE, gflops=stages,
                 per_method=per_method,
                 speedup_vs_fastest_numpy=numpy_best["numpy_median_s"] / ours["dpjax_median_s"])
  config = {"n": n, "d": d, "k": k, "epsilon": args.epsilon, "delta": args.delta,
            "gamma": gamma, "t": t, "m": m, "q": q,
            "cell_length": params.cell_length, "route": "gram" if m < d else "covariance",
            "repeats": repeats, "blas": blas, "backend": jax.default_backend(),
            "machine": platform.processor() or platform.machine()}
  print(f"DPASE speed  n={n} d={d} k={k} t={t} m={m} q={q} route={config['route']} "
        f"backend={jax.default_backend()}; dpjax's default solver: {default.method}")
  print(f"baseline: {BASELINE}")
  print(f"{'top_k_method':<20}{'dpjax s':>9}{'numpy s':>9}{'ratio med':>10}{'min':>7}"
        f"{'compile s':>10}   errors ‖Π̂−Π‖ (dpjax | numpy)")
  for method, p in per_method.items():
    errs = (", ".join(f"{e:.3f}" for e in p["dpjax_errors"]) + " | "
            + ", ".join(f"{e:.3f}" for e in p["numpy_errors"]))
    print(f"{method:<20}{p['dpjax_median_s']:>9.3f}{p['numpy_median_s']:>9.3f}"
          f"{p['speedup_vs_numpy']:>9.2f}x{p['speedup_vs_numpy_min']:>6.2f}x"
          f"{p['dpjax_compile_s_estimate']:>10.2f}   {errs}")
  print(f"paired ratio numpy/dpjax over {repeats} interleaved repeats, each solver against the "
        "same solver in NumPy; dpjax default against NumPy's faster solver: "
        f"{summary['speedup_vs_fastest_numpy']:.2f}x (ratio of medians)")
  print(f"{'stage GFLOP/s':<34}{'GFLOP':>8}{'dpjax':>10}{'numpy':>10}")
  for name, label in (("gram", "Gram/covariance (batched)"), ("eigh", "eigh (batched, 9s³)"),
                      ("iteration", f"{ITERATION_STEPS} iteration steps (4mdr each)"),
                      ("matmul", f"plain matmul {stages['matmul']['side']}²")):
    st = stages[name]
    print(f"{label:<34}{st['gflop']:>8.2f}{st['dpjax_gflops']:>10.1f}{st['numpy_gflops']:>10.1f}")
  out = {"summary": summary, "config": config}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
  return out


if __name__ == "__main__":
  main()
