"""Private covariances and Gaussians with no bound on the scale or the condition number ([AL22]).

Data N(0, Σ) with ``Σ = U diag(10^{s_i}) Uᵀ``, ``s_i ~ U[−6, 6]`` (condition numbers up to 1e12),
a fresh Σ per trial. For each d and n on a grid of multiples of the minimum the public
calibration asks for, several trials give the median spectral error ``‖Σ^{-1/2} Σ̂ Σ^{-1/2} − I‖``
(over the trials that did not answer ⊥) and the ⊥ rate of

* the Ashtiani–Liaw step alone (``learn_covariance(refine=False)`` on the coarse rows of the
  default split, ``learn_covariance_plan``: exactly the preconditioner that the refined learner
  uses, same key),
* the refined learner (AL preconditioner + CoinPress, ``learn_covariance``),
* a clip-and-add-Gaussian-noise baseline with a public clipping bound B = 3√d chosen for
  unit-scale data (never ⊥; it fails when the scale is unknown, and works on Σ = I),

then the full pipeline ``learn_gaussian`` on a singular Σ (rank d − 2) with ‖μ‖ = 1e6 (errors in
range(Σ), and the absolute mean error orthogonal to it), the calibration table (rows needed per
(d, ε, eta_accuracy)), and the speed of the pairwise predicate (``closeness_matrix`` and
``neighbour_counts``) at k = 100 candidates, d = 5 and 50.

Speed baselines: NumPy running the SAME two-Cholesky predicate (``semimetric`` module docstring),
(1) a loop over pairs i ≤ j of ``np.linalg.cholesky`` with short-circuit, and (2) a vectorised
version: LAPACK Cholesky batched over chunks of all pairs, the second test only on the pairs that
pass the first. dpjax's first call (compilation) is reported on its own; then dpjax and the
baseline alternate and the speed-up is the median (and min) of the per-repeat ratios. Measured
(2-core shared CPU, ``--speed-only --blas-threads 1 --repeats 7``, paired medians for
``closeness_matrix`` / ``neighbour_counts``): d = 5, 45× / 50× the loop and 2.1× / 2.8× the
batched version (dpjax's unrolled vector Cholesky); d = 50, 1.8× / 2.1× the loop and 2.2× / 3.0×
the batched version, where both sides call LAPACK ``potrf`` per matrix on the same pairs with the
same short-circuit (dpjax's gain is a jitted loop with no per-call overhead); compile < 1 s.
Absolute times are machine-dependent.

    python benchmarks/covariance.py --quick --json results/covariance_quick.json \\
        --plot results/covariance_quick.png        # d in {5, 10}: ≈ 4.5 min on 2 busy CPU cores
    python benchmarks/covariance.py                # d in {5, 10, 20}: ≈ 25 min, ≈ 10 GB RAM
    python benchmarks/covariance.py --speed-only --blas-threads 1 --json speed.json   # ≈ 30 s
    python benchmarks/covariance.py --quick --dims 3 --trials 1 --epsilon 1000 \\
        --speed-dims 3,20 --speed-k 20 --repeats 1 --seed 1        # smoke run, ≈ 1 min
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from _timing import blas_info, blas_threads, interleaved, paired, timed
from dpjax import metrics
from dpjax.ashtiani_liaw import (SPEC_CHOICES, closeness_matrix, covariance_calibration,
                                 gaussian_batch_sizes, learn_covariance, learn_gaussian,
                                 learn_covariance_plan, learn_covariance_required_n,
                                 neighbour_counts, required_n)
from dpjax.mechanisms import analytic_gaussian_sigma

SPREAD = 6.0                 # eigenvalues 10^{U[−6, 6]}
MEAN_NORM = 1e6              # ‖μ‖ for the Gaussian pipeline


def random_factor(rng, d, rank=None):
  """``(Σ, A, U)`` with ``Σ = AAᵀ``, A = U[:, :rank] diag(10^{s/2}), U Haar-orthogonal."""
  rank = d if rank is None else rank
  q, r = np.linalg.qr(rng.standard_normal((d, d)))
  U = q * np.sign(np.diag(r))
  A = U[:, :rank] * 10.0 ** (rng.uniform(-SPREAD, SPREAD, rank) / 2)
  return A @ A.T, A, U


def sample(rng, n, A, mean=None, chunk=1_000_000):
  """n rows of N(mean, AAᵀ), float64, generated in chunks (no (n, rank) temporary)."""
  X = np.empty((n, A.shape[0]))
  for start in range(0, n, chunk):
    stop = min(n, start + chunk)
    X[start:stop] = rng.standard_normal((stop - start, A.shape[1])) @ A.T
  if mean is not None:
    X += mean
  return X


def clip_and_noise(rng, X, *, epsilon, delta, bound):
  """Baseline: second moment of rows clipped to ‖x‖ ≤ bound, plus symmetric Gaussian noise.

  Replace-one: one term ``xxᵀ/n`` becomes ``x'x'ᵀ/n`` with ‖x‖, ‖x'‖ ≤ B, and
  ``‖xxᵀ − x'x'ᵀ‖_F² = ‖x‖⁴ + ‖x'‖⁴ − 2(x·x')² ≤ 2B⁴``, so the Frobenius sensitivity is √2·B²/n.
  Noise is drawn on the upper triangle (diagonal included) and mirrored: that vector's ℓ2 change
  is at most the Frobenius one, so the analytic Gaussian σ at √2·B²/n makes it (ε, δ)-DP.
  """
  n, d = X.shape
  norms = np.linalg.norm(X, axis=1)
  Xc = X * np.minimum(1.0, bound / np.maximum(norms, 1e-300))[:, None]
  sigma = analytic_gaussian_sigma(epsilon, delta, math.sqrt(2.0) * bound**2 / n)
  E = np.triu(rng.standard_normal((d, d)) * sigma)
  return Xc.T @ Xc / n + E + np.triu(E, 1).T


def is_pd(S):
  return bool(np.linalg.eigvalsh((S + S.T) / 2)[0] > 0)


def summarise(what, d, n, errors, extra=None):
  """Median over non-⊥ trials (None if all ⊥) and the ⊥ rate; ⊥ is passed as None."""
  finite = [e for e in errors if e is not None]
  out = {"what": what, "d": d, "n": n, "trials": len(errors),
         "median_error": float(np.median(finite)) if finite else None,
         "bottom_rate": 1.0 - len(finite) / len(errors), "errors": errors}
  out.update(extra or {})
  return out


def covariance_cells(d, grid, trials, epsilon, delta, seed):
  """AL alone, refined and baseline on one fresh ill-conditioned Σ per trial (nested prefixes)."""
  errs = {n: {"al": [], "refined": [], "baseline": [], "baseline_pd": []} for n in grid}
  # Underpowered on purpose: groups of m/8 rows (a utility override; privacy is unchanged), so
  # the candidates scatter and the private test should refuse (⊥) rather than answer badly.
  small = covariance_calibration(d, epsilon, delta, eta_accuracy=None).min_group_size // 8
  n_small = learn_covariance_required_n(d, epsilon, delta, min_group_size=small)
  under = []
  for trial in range(trials):
    rng = np.random.default_rng([seed, d, trial])
    Sigma, A, _ = random_factor(rng, d)
    X = sample(rng, max(grid), A)                    # cells at smaller n use a prefix
    err = lambda r: metrics.covariance_error(r.estimate, Sigma) if bool(r.ok) else None  # noqa
    for i, n in enumerate(grid):
      key = jax.random.fold_in(jax.random.key(seed), 1000 * d + 100 * i + trial)  # fresh noise
      kw = dict(epsilon=epsilon, delta=delta)
      # Same key and rows as the coarse step inside the refined call: its preconditioner.
      coarse = learn_covariance_plan(n, d, **kw).coarse_rows
      errs[n]["al"].append(err(learn_covariance(key, X[:coarse], refine=False, **kw)))
      errs[n]["refined"].append(err(learn_covariance(key, X[:n], **kw)))
      B = clip_and_noise(rng, X[:n], bound=3.0 * math.sqrt(d), **kw)
      errs[n]["baseline"].append(metrics.covariance_error(B, Sigma))
      errs[n]["baseline_pd"].append(is_pd(B))
      if i == 0:
        under.append(err(learn_covariance(key, X[:n_small], min_group_size=small, **kw)))
    del X
  cells = []
  for n in grid:
    e = errs[n]
    cells.append(summarise("AL alone", d, n, e["al"]))
    cells.append(summarise("AL + CoinPress", d, n, e["refined"]))
    cells.append(summarise("clip+noise B=3√d", d, n, e["baseline"],
                           {"pd_rate": float(np.mean(e["baseline_pd"]))}))
  cells.append(summarise(f"underpowered m={small}", d, n_small, under))
  return cells


def baseline_identity_cell(d, n, trials, epsilon, delta, seed):
  """The baseline where its public bound fits: Σ = I."""
  errors, pd = [], []
  for trial in range(trials):
    rng = np.random.default_rng([seed, d, trial, 7])
    B = clip_and_noise(rng, rng.standard_normal((n, d)), epsilon=epsilon, delta=delta,
                       bound=3.0 * math.sqrt(d))
    errors.append(metrics.covariance_error(B, np.eye(d)))
    pd.append(is_pd(B))
  return summarise("clip+noise, Σ = I", d, n, errors, {"pd_rate": float(np.mean(pd))})


def gaussian_min_n(d, rank, epsilon, delta, *, split="default", **calibration_kwargs):
  """Smallest n whose default batch sizes give step 2's learn_covariance the rows it needs.

  Step 2 differences consecutive pairs of its n2 rows (n2 // 2 rows of rank r) and hands them to
  ``learn_covariance``: ``split="default"`` needs ``n2 // 2 ≥ learn_covariance_required_n(r)``
  (the AL step's rows plus the refinement's); ``split="half"`` is the learner until 2026-11-27
  (the AL step on the first half at ``eta_accuracy=0.5``): ``⌊(n2 // 2)/2⌋ ≥ required_n(r,
  eta_accuracy=0.5)``.
  """
  if split == "half":
    need = 2 * required_n(rank, epsilon, delta, eta_accuracy=0.5, **calibration_kwargs)
  else:
    need = learn_covariance_required_n(rank, epsilon, delta, **calibration_kwargs)
  n1, _, _, n4 = gaussian_batch_sizes(10**12, d, epsilon=epsilon, delta=delta)
  n = n1 + n4 + 3 * need
  while gaussian_batch_sizes(n, d, epsilon=epsilon, delta=delta)[1] // 2 < need:
    n += 8
  return n


def gaussian_cell(d, n, trials, epsilon, delta, seed):
  """learn_gaussian on N(μ, Σ), rank Σ = d − 2, ‖μ‖ = 1e6; errors restricted to range(Σ)."""
  rank = d - 2
  cov, mah, orth, bottom, failed, seconds = [], [], [], 0, [], []
  for trial in range(trials):
    rng = np.random.default_rng([seed, d, trial, 3])
    Sigma, A, U = random_factor(rng, d, rank)
    mu = rng.standard_normal(d)
    mu *= MEAN_NORM / np.linalg.norm(mu)
    X = sample(rng, n, A, mu)
    start = time.perf_counter()
    res = learn_gaussian(jax.random.fold_in(jax.random.key(seed + 1), 1000 * d + trial), X,
                         epsilon=epsilon, delta=delta)
    seconds.append(time.perf_counter() - start)
    del X
    if not res.ok:
      bottom += 1
      failed.append(res.failed_step_name)
      cov.append(None), mah.append(None), orth.append(None)
      continue
    V, U_perp = U[:, :rank], U[:, rank:]             # range(Σ) and its complement
    Sigma_r = V.T @ Sigma @ V
    cov.append(metrics.covariance_error(V.T @ res.covariance @ V, Sigma_r))
    mah.append(metrics.mahalanobis_error(V.T @ res.mean, V.T @ mu, Sigma_r))
    orth.append(float(np.linalg.norm(U_perp.T @ (res.mean - mu))))
    failed.append(None)
  med = lambda xs: float(np.median([x for x in xs if x is not None])) if bottom < trials else None  # noqa
  return {"what": "learn_gaussian", "d": d, "rank": rank, "n": n, "trials": trials,
          "median_covariance_error": med(cov), "median_mahalanobis_error": med(mah),
          "median_orthogonal_mean_error": med(orth), "bottom_rate": bottom / trials,
          "failed_steps": failed, "covariance_errors": cov, "mahalanobis_errors": mah,
          "orthogonal_mean_errors": orth, "median_seconds": float(np.median(seconds)),
          "batch_sizes": list(gaussian_batch_sizes(n, d, epsilon=epsilon, delta=delta))}


REQUIRED_N_DIMS, REQUIRED_N_EPSILONS = (3, 5, 10, 30), (1.0, 4.0)


def required_n_table(dims=REQUIRED_N_DIMS, epsilons=REQUIRED_N_EPSILONS, delta=1e-6):
  """Rows needed, ``{"<d>,<ε>": n}`` (issue 16's before/after): ``al_covariance``
  (``required_n`` at its defaults), ``learn_covariance`` and ``learn_gaussian`` on a full-rank Σ
  (:func:`gaussian_min_n`). "before": the spec's choices (``SPEC_CHOICES``: the mask's tail
  bound F, PPME's earlier sensitivity bound, ε/4, r = 1/4, (0.6, 0.8, 0.9), the bound's accuracy
  cap, a sure-pass target) and ``learn_covariance``'s AL step on half the rows at
  ``eta_accuracy=0.5``; "after": the defaults (Rényi accounting, the tight PPME bound, the
  re-chosen split, thresholds and radius, the simulated mask accuracy, a p95 pass target, and
  the AL step on its required rows with the rest for CoinPress)."""
  settings = {"before": (dict(SPEC_CHOICES), "half"), "after": ({}, "default")}
  out = {}
  for label, (kw, split) in settings.items():
    for d in dims:
      for eps in epsilons:
        key = f"{d},{eps:g}"
        out.setdefault("al_covariance", {}).setdefault(label, {})[key] = required_n(
            d, eps, delta, **kw)
        out.setdefault("learn_covariance", {}).setdefault(label, {})[key] = (
            2 * required_n(d, eps, delta, **dict(kw, eta_accuracy=0.5)) if split == "half"
            else learn_covariance_required_n(d, eps, delta, **kw))
        out.setdefault("learn_gaussian", {}).setdefault(label, {})[key] = gaussian_min_n(
            d, d, eps, delta, split=split, **kw)
  return out


def calibration_table(dims, epsilons, delta):
  rows = []
  for d in dims:
    for eps in epsilons:
      for acc in (0.2, 0.5):
        c = covariance_calibration(d, eps, delta, eta_accuracy=acc)
        rows.append({"d": d, "epsilon": eps, "delta": delta, "eta_accuracy": acc,
                     "num_groups": c.num_groups, "min_group_size": c.min_group_size,
                     "required_n": c.required_n, "eta": c.eta,
                     "mask_sensitivity": c.mask_sensitivity,
                     "mask_accuracy": c.mask_accuracy})
  return rows


def numpy_closeness_loop(Y, radius):
  """Baseline 1: the module predicate pair by pair (i ≤ j), two ``np.linalg.cholesky`` calls.

  ``close(i, j)`` iff ``Y_j − Y_i/(1+r)`` and then ``(1+r)Y_i − Y_j`` factorise (the second is
  skipped once the first fails), exactly the predicate of ``dpjax.ashtiani_liaw.semimetric``.
  """
  k = Y.shape[0]
  lo, hi = 1.0 / (1.0 + radius), 1.0 + radius
  close = np.zeros((k, k), bool)
  for i in range(k):
    for j in range(i, k):
      try:
        np.linalg.cholesky(Y[j] - lo * Y[i])
        np.linalg.cholesky(hi * Y[i] - Y[j])
      except np.linalg.LinAlgError:
        continue
      close[i, j] = close[j, i] = True
  return close


def _batched_cholesky_ok(A):
  """Per-matrix Cholesky success for a stack (NaN/inf or a pivot ≤ 0 fails).

  ``np.linalg.cholesky`` raises if any matrix of a stack fails; its gufunc (private, but the very
  LAPACK ``potrf`` loop that ``np.linalg.cholesky`` runs) returns NaNs for the failed ones instead.
  """
  with np.errstate(invalid="ignore"):
    L = np.linalg._umath_linalg.cholesky_lo(A)
  diag = np.diagonal(L, axis1=-2, axis2=-1)
  return np.all(np.isfinite(diag) & (diag > 0), axis=-1)


def numpy_closeness_batched(Y, radius, chunk_bytes=2**26):
  """Baseline 2: the same predicate vectorised: batched Cholesky over chunks of the pairs i ≤ j.

  The second factorisation runs only on the pairs whose first one succeeded (a vectorised
  short-circuit); chunks keep the stacked differences under ``chunk_bytes``.
  """
  k, d, _ = Y.shape
  lo, hi = 1.0 / (1.0 + radius), 1.0 + radius
  I, J = np.triu_indices(k)
  ok = np.zeros(len(I), bool)
  step = max(1, chunk_bytes // (Y.itemsize * d * d))
  for s in range(0, len(I), step):
    i, j = I[s:s + step], J[s:s + step]
    first = _batched_cholesky_ok(Y[j] - lo * Y[i])
    idx = np.flatnonzero(first)
    first[idx] = _batched_cholesky_ok(hi * Y[i[idx]] - Y[j[idx]])
    ok[s:s + step] = first
  close = np.zeros((k, k), bool)
  close[I, J] = close[J, I] = ok
  return close


def pairwise_psd_distances(Y, pairs):
  """``dist(Y_i, Y_j)`` of [AL22] eq. (5.1) for the given index pairs (NumPy, eigenvalues)."""
  out = []
  for i, j in pairs:
    ev = np.linalg.eigvals(np.linalg.solve(Y[i], Y[j])).real
    out.append(max(ev.max() - 1.0, 1.0 / ev.min() - 1.0))
  return np.asarray(out)


def pairwise_speed(d, k, repeats, seed, group=None):
  """dpjax ``closeness_matrix`` / ``neighbour_counts`` against the two NumPy baselines.

  k candidate covariances of ``group`` rows (default 4d) each from one ill-conditioned Σ; the
  radius is about the median distance of 200 random pairs, so about half the pairs are close
  (the short-circuit matters and the matrix checks agreement). dpjax's first call (tracing and
  compilation) is timed on its own; then dpjax and each baseline alternate, and the speed-up is
  the median (and min) of the per-repeat ratios.
  """
  group = group or 4 * d
  rng = np.random.default_rng([seed, d, k])
  _, A, _ = random_factor(rng, d)
  X = sample(rng, k * group, A).reshape(k, group, d)
  Y = np.einsum("kmi,kmj->kij", X, X) / group           # empirical covariances of the groups
  pairs = rng.integers(0, k, (200, 2))
  pairs = np.unique(np.sort(pairs[pairs[:, 0] != pairs[:, 1]], axis=1), axis=0)
  # Halfway between the two middle distances: a radius equal to some pair's distance would put
  # that pair on the boundary, where rounding decides and the implementations may differ. Each
  # unordered pair once: dist(Y_i, Y_j) and dist(Y_j, Y_i) are equal only up to rounding, and
  # the midpoint of the two would be such a boundary.
  dist = np.unique(pairwise_psd_distances(Y, pairs))
  radius = float(dist[len(dist) // 2 - 1] + dist[len(dist) // 2]) / 2
  out = {"k": k, "d": d, "group_rows": group, "radius": radius}
  with jax.enable_x64(True):
    Yj = jnp.asarray(Y)
    fns = {"closeness_matrix": jax.jit(closeness_matrix, static_argnums=1),
           "neighbour_counts": jax.jit(neighbour_counts, static_argnums=1)}
    first = {name: timed(lambda: fn(Yj, radius))[0] for name, fn in fns.items()}
    fast = np.asarray(fns["closeness_matrix"](Yj, radius))
    counts = np.asarray(fns["neighbour_counts"](Yj, radius))
    baselines = {"loop": numpy_closeness_loop, "batched": numpy_closeness_batched}
    slow = {name: base(Y, radius) for name, base in baselines.items()}   # warm-up + agreement
    out.update(close_fraction=float(fast.mean()), dpjax_first_call_s_including_compile=first,
               mismatched_pairs={name: int((m != fast).sum()) for name, m in slow.items()},
               counts_agree=bool(np.array_equal(counts, fast.sum(1))), results={})
    for name, fn in fns.items():
      for bname, base in baselines.items():
        post = (lambda c: c.sum(1)) if name == "neighbour_counts" else (lambda c: c)  # noqa: E731
        tj, tb, _, _ = interleaved(lambda r: fn(Yj, radius), lambda r: post(base(Y, radius)),
                                   repeats)
        res = paired(tj, tb)
        res["compile_s_estimate"] = first[name] - res["dpjax_median_s"]
        out["results"][f"{name} vs {bname}"] = res
  return out


def _fmt(x, spec=".3g"):
  return "⊥" if x is None else format(x, spec)


def _ints(text):
  return tuple(int(x) for x in text.split(",") if x)


def print_speed(speed):
  """One block per d: agreement, compile time, paired ratios against both baselines."""
  for sp in speed:
    print(f"k={sp['k']} candidates, d={sp['d']}, {sp['group_rows']} rows each, "
          f"r={sp['radius']:.3g}: {100 * sp['close_fraction']:.0f}% pairs close; pairs "
          f"disagreeing with the baselines {sp['mismatched_pairs']}, counts agree "
          f"{sp['counts_agree']}")
    first = sp["dpjax_first_call_s_including_compile"]
    print(f"  dpjax first call incl. compile: closeness_matrix {first['closeness_matrix']:.1f} s, "
          f"neighbour_counts {first['neighbour_counts']:.1f} s")
    print(f"  {'dpjax vs numpy':<36}{'dpjax ms':>10}{'numpy ms':>10}{'ratio med':>11}"
          f"{'ratio min':>11}")
    for name, r in sp["results"].items():
      print(f"  {name:<36}{1e3 * r['dpjax_median_s']:>10.2f}{1e3 * r['baseline_median_s']:>10.2f}"
            f"{r['speedup_median']:>10.2f}x{r['speedup_min']:>10.2f}x")
  print(flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="d in {5, 10}, n in {1, 2}× minimum")
  parser.add_argument("--epsilon", type=float, default=10.0)
  parser.add_argument("--delta", type=float, default=1e-6)
  parser.add_argument("--trials", type=int, default=None)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dims", type=_ints, default=None,
                      help="comma-separated d of the accuracy part (default 5,10 with --quick, "
                      "else 5,10,20)")
  parser.add_argument("--speed-only", action="store_true",
                      help="run the pairwise speed part only")
  parser.add_argument("--speed-dims", type=_ints, default=(5, 50),
                      help="comma-separated d of the pairwise speed part (default 5,50)")
  parser.add_argument("--speed-k", type=int, default=100, help="candidates in the speed part")
  parser.add_argument("--repeats", type=int, default=None,
                      help="interleaved timed pairs per comparison (default 7, 3 with --quick)")
  parser.add_argument("--blas-threads", type=int, default=None,
                      help="limit NumPy's and jax's LAPACK/BLAS threads in the speed part "
                      "(needs threadpoolctl); 1 avoids oversubscription on a shared machine")
  parser.add_argument("--json", type=str, default=None)
  parser.add_argument("--plot", type=str, default=None, help="PNG of error and ⊥ rate vs n")
  args = parser.parse_args(argv)
  eps, delta = args.epsilon, args.delta
  quick = args.quick
  dims = args.dims or ((5, 10) if quick else (5, 10, 20))
  trials = args.trials or (2 if quick else 4)
  repeats = args.repeats or (3 if quick else 7)
  # d = 20: one multiple of the minimum only (time; the learners copy the rows a few times).
  multiples = {d: (1, 2) if quick else (1, 2, 4) for d in dims}
  multiples.update({d: (1,) for d in dims if d >= 20})
  trials_at = {d: trials if d < 20 else max(1, trials // 2) for d in dims}
  # learn_gaussian needs ≈ 3·learn_covariance_required_n(d − 2) rows (gaussian_min_n); d = 20
  # is skipped (time).
  gauss_multiples = {dims[0]: (1,)} if quick else {d: (1, 2) if d == dims[0] else (1,)
                                                  for d in dims if d < 20}
  start_all = time.perf_counter()

  print("pairwise predicate: dpjax closeness_matrix / neighbour_counts against NumPy running the "
        "same two-Cholesky predicate (loop: np.linalg.cholesky per pair with short-circuit; "
        "batched: LAPACK potrf over chunks of pairs, second test on survivors only)", flush=True)
  with blas_threads(args.blas_threads):
    speed = [pairwise_speed(d, args.speed_k, repeats, args.seed) for d in args.speed_dims]
    blas = blas_info()
  print_speed(speed)
  speed_summary = {str(sp["d"]): {name: {"median": r["speedup_median"], "min": r["speedup_min"]}
                                  for name, r in sp["results"].items()} for sp in speed}
  if args.speed_only:
    out = {"summary": {"pairwise_speedup_vs_numpy": speed_summary},
           "pairwise": speed, "config": {"speed_dims": list(args.speed_dims),
                                         "speed_k": args.speed_k, "repeats": repeats,
                                         "blas": blas, "seed": args.seed,
                                         "backend": jax.default_backend(),
                                         "machine": platform.processor() or platform.machine()}}
    if args.json:
      with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    return out

  t0 = time.perf_counter()
  req_dims = REQUIRED_N_DIMS[:3] if quick else REQUIRED_N_DIMS
  req = required_n_table(req_dims, REQUIRED_N_EPSILONS, 1e-6)
  print("rows required at δ = 1e-6, before → after (the spec's choices → the defaults: exact "
        "Rényi mask accounting, PPME's tight bound, re-chosen split/thresholds/radius, simulated "
        "mask accuracy, p95 pass target; docs/algorithms.md §3.2, §3.4, §3.5)")
  print(f"{'d,ε':>7}{'al_covariance':>30}{'learn_covariance':>34}"
        f"{'learn_gaussian (full rank)':>34}")
  for key in req["al_covariance"]["after"]:
    cells = [(req[w]["before"][key], req[w]["after"][key])
             for w in ("al_covariance", "learn_covariance", "learn_gaussian")]
    print(f"{key:>7}" + "".join(f"{b:>14,} → {a:>11,} ({b / a:.1f}×)" for b, a in cells))
  print(f"({time.perf_counter() - t0:.0f} s)\n", flush=True)

  print(f"calibration: rows required by al_covariance (δ={delta:g})", flush=True)
  t0 = time.perf_counter()
  calib = calibration_table((5, 10, 20), (1.0, 10.0), delta)
  print(f"{'d':>4}{'ε':>6}{'eta_acc':>9}{'groups k':>10}{'group m':>9}{'required n':>13}"
        f"{'η':>9}{'γ':>9}")
  for c in calib:
    print(f"{c['d']:>4}{c['epsilon']:>6g}{c['eta_accuracy']:>9g}{c['num_groups']:>10}"
          f"{c['min_group_size']:>9}{c['required_n']:>13,}{c['eta']:>9.4f}"
          f"{c['mask_sensitivity']:>9.4f}")
  print(f"(learn_covariance needs learn_covariance_required_n: its AL step's rows (no cap on η) "
        f"plus CoinPress's; twice that with unknown_mean; {time.perf_counter() - t0:.0f} s)\n",
        flush=True)

  print(f"covariance: N(0, Σ), eig(Σ) = 10^U[−6,6], ε={eps:g}, δ={delta:g}, spectral error "
        "‖Σ^-1/2 Σ̂ Σ^-1/2 − I‖ (median over non-⊥ trials)", flush=True)
  header = f"{'what':<20}{'d':>4}{'n':>13}{'median error':>14}{'⊥ rate':>8}{'trials':>8}"
  print(header)
  cells, n_min = [], {}
  for d in dims:
    n_min[d] = learn_covariance_required_n(d, eps, delta)
    grid = [m * n_min[d] for m in multiples[d]]
    t0 = time.perf_counter()
    new = covariance_cells(d, grid, trials_at[d], eps, delta, args.seed)
    if d == dims[0]:
      new.append(baseline_identity_cell(d, n_min[d], trials_at[d], eps, delta, args.seed))
    for c in new:
      extra = f"  PD {c['pd_rate']:.0%}" if "pd_rate" in c else ""
      print(f"{c['what']:<20}{d:>4}{c['n']:>13,}{_fmt(c['median_error']):>14}"
            f"{c['bottom_rate']:>8.2f}{c['trials']:>8}{extra}", flush=True)
    print(f"  (d={d}: {time.perf_counter() - t0:.0f} s)", flush=True)
    cells += new

  print(f"\nlearn_gaussian: rank Σ = d − 2, ‖μ‖ = {MEAN_NORM:.0e}; errors in range(Σ), "
        "absolute mean error orthogonal to it", flush=True)
  print(f"{'d':>4}{'n':>13}{'cov err':>10}{'Mahal.':>10}{'⊥-mean':>10}{'⊥ rate':>8}"
        f"{'trials':>8}{'s/run':>7}  failed steps")
  gauss = []
  for d, mults in gauss_multiples.items():
    base = gaussian_min_n(d, d - 2, eps, delta)
    for m in mults:
      g = gaussian_cell(d, m * base, max(1, trials // 2), eps, delta, args.seed)
      gauss.append(g)
      print(f"{d:>4}{g['n']:>13,}{_fmt(g['median_covariance_error']):>10}"
            f"{_fmt(g['median_mahalanobis_error']):>10}"
            f"{_fmt(g['median_orthogonal_mean_error']):>10}{g['bottom_rate']:>8.2f}"
            f"{g['trials']:>8}{g['median_seconds']:>7.0f}  "
            f"{[s for s in g['failed_steps'] if s] or '-'}", flush=True)
  total = time.perf_counter() - start_all
  print(f"\n(took {total:.0f} s)")

  def table(what):
    out = {}
    for c in cells:
      if c["what"] == what:
        out.setdefault(str(c["d"]), {})[str(c["n"])] = c
    return out

  refined = table("AL + CoinPress")
  summary = {
      "spectral_error": {d: {n: c["median_error"] for n, c in t.items()} for d, t in refined.items()},
      "bottom_rate": {d: {n: c["bottom_rate"] for n, c in t.items()} for d, t in refined.items()},
      "pairwise_speedup_vs_numpy": speed_summary,
      "required_n": req["al_covariance"]["after"],
      "required_n_before": req["al_covariance"]["before"],
      "learn_covariance_required_n": req["learn_covariance"]["after"],
      "learn_covariance_required_n_before": req["learn_covariance"]["before"],
      "gaussian_required_n": req["learn_gaussian"]["after"],
      "gaussian_required_n_before": req["learn_gaussian"]["before"]}
  strip = lambda t, key: {d: {n: c[key] for n, c in r.items()} for d, r in t.items()}  # noqa
  al, base = table("AL alone"), table("clip+noise B=3√d")
  out = {"summary": summary,
         "al_only": {"spectral_error": strip(al, "median_error"),
                     "bottom_rate": strip(al, "bottom_rate")},
         "baseline": {"spectral_error": strip(base, "median_error"),
                      "pd_rate": strip(base, "pd_rate"),
                      "identity": [c for c in cells if c["what"] == "clip+noise, Σ = I"]},
         "underpowered": [c for c in cells if c["what"].startswith("underpowered")],
         "gaussian": gauss, "calibration": calib, "pairwise": speed, "cells": cells,
         "config": {"epsilon": eps, "delta": delta, "dims": list(dims), "trials": trials_at,
                    "multiples": {d: multiples[d] for d in dims}, "n_min": n_min,
                    "gaussian_multiples": gauss_multiples,
                    "eigenvalue_log10_range": [-SPREAD, SPREAD], "mean_norm": MEAN_NORM,
                    "baseline_bound": "3*sqrt(d)", "quick": quick, "seed": args.seed,
                    "speed_dims": list(args.speed_dims), "speed_k": args.speed_k,
                    "repeats": repeats, "blas": blas,
                    "seconds": total, "backend": jax.default_backend(),
                    "machine": platform.processor() or platform.machine()}}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
  if args.plot:
    _plot(cells, dims, args.plot)
  return out


def _plot(cells, dims, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(dims) + 1, figsize=(4.2 * (len(dims) + 1), 3.6))
  styles = {"AL + CoinPress": "o-", "AL alone": "s--", "clip+noise B=3√d": "x:"}
  for ax, d in zip(axes, dims):
    for what, style in styles.items():
      mine = sorted((c for c in cells if c["d"] == d and c["what"] == what
                     and c["median_error"] is not None), key=lambda c: c["n"])
      ax.plot([c["n"] for c in mine], [c["median_error"] for c in mine], style, label=what)
    for c in cells:
      if c["d"] == d and c["what"] == "clip+noise, Σ = I":
        ax.plot([c["n"]], [c["median_error"]], "x", color="grey", label="clip+noise on Σ = I")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")      # ≥ 1: not even a factor-2 approximation
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(f"d = {d}")
    ax.set_xlabel("n")
  axes[0].set_ylabel("median ‖Σ^-1/2 Σ̂ Σ^-1/2 − I‖")
  axes[0].legend(fontsize=8)
  ax = axes[-1]
  for d in dims:
    mine = sorted((c for c in cells if c["d"] == d and (c["what"] == "AL + CoinPress" or
                                                          c["what"].startswith("underpowered"))),
                  key=lambda c: c["n"])                # leftmost point: groups of m/8 rows
    ax.plot([c["n"] for c in mine], [c["bottom_rate"] for c in mine], "o-", label=f"d = {d}")
  ax.set_xscale("log")
  ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())   # decade labels only
  ax.set_ylim(-0.05, 1.05)
  ax.set_xlabel("n")
  ax.set_ylabel("⊥ rate (AL + CoinPress)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  main()
