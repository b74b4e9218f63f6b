"""Private covariances and Gaussians with no bound on the scale or the condition number ([AL22]).

Data N(0, Σ) with ``Σ = U diag(10^{s_i}) Uᵀ``, ``s_i ~ U[−6, 6]`` (condition numbers up to 1e12),
a fresh Σ per trial. For each d and n on a grid of multiples of the minimum the public
calibration asks for, several trials give the median spectral error ``‖Σ^{-1/2} Σ̂ Σ^{-1/2} − I‖``
(over the trials that did not answer ⊥) and the ⊥ rate of

* the Ashtiani–Liaw step alone (``learn_covariance(refine=False)`` on the coarse half: exactly
  the preconditioner that the refined learner uses, same key),
* the refined learner (AL preconditioner + CoinPress, ``learn_covariance``),
* a clip-and-add-Gaussian-noise baseline with a public clipping bound B = 3√d chosen for
  unit-scale data (never ⊥; it fails when the scale is unknown, and works on Σ = I),

then the full pipeline ``learn_gaussian`` on a singular Σ (rank d − 2) with ‖μ‖ = 1e6 (errors in
range(Σ), and the absolute mean error orthogonal to it), the calibration table (rows needed per
(d, ε, eta_accuracy)), and the speed of the batched pairwise predicate ``closeness_matrix``
against a NumPy loop over pairs, measured in the same run (absolute times are machine-dependent).

    python benchmarks/covariance.py --quick --json results/covariance_quick.json \\
        --plot results/covariance_quick.png        # d in {5, 10}: ≈ 4.5 min on 2 busy CPU cores
    python benchmarks/covariance.py                # d in {5, 10, 20}: ≈ 25 min, ≈ 10 GB RAM
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

from dpjax import metrics
from dpjax.ashtiani_liaw import (closeness_matrix, covariance_calibration, gaussian_batch_sizes,
                              learn_covariance, learn_gaussian, required_n)
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
  small = covariance_calibration(d, epsilon, delta, eta_accuracy=0.5).min_group_size // 8
  n_small = 2 * required_n(d, epsilon, delta, eta_accuracy=0.5, min_group_size=small)
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
      errs[n]["al"].append(err(learn_covariance(key, X[:n // 2], refine=False, **kw)))
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


def gaussian_min_n(d, rank, epsilon, delta):
  """Smallest n whose default split gives step 2's learn_covariance its minimum coarse half.

  Step 2 differences consecutive pairs of its n2 rows (n2 // 2 rows of rank r) and hands the
  first half of those to the AL step, so it needs ⌊(n2 // 2)/2⌋ ≥ required_n(r, eta_accuracy=0.5).
  """
  need = required_n(rank, epsilon, delta, eta_accuracy=0.5)
  n1, _, _, n4 = gaussian_batch_sizes(10**12, d, epsilon=epsilon, delta=delta)
  n = n1 + n4 + 6 * need
  while int((gaussian_batch_sizes(n, d, epsilon=epsilon, delta=delta)[1] // 2) * 0.5) < need:
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


def calibration_table(dims, epsilons, delta):
  rows = []
  for d in dims:
    for eps in epsilons:
      for acc in (0.2, 0.5):
        c = covariance_calibration(d, eps, delta, eta_accuracy=acc)
        rows.append({"d": d, "epsilon": eps, "delta": delta, "eta_accuracy": acc,
                     "num_groups": c.num_groups, "min_group_size": c.min_group_size,
                     "required_n": c.required_n, "eta": c.eta, "mask_sensitivity": c.mask_sensitivity,
                     "mask_accuracy": c.mask_accuracy})
  return rows


def numpy_closeness(Y, radius):
  """Reference predicate: all eigenvalues of ``Y_i^{-1} Y_j`` in [1/(1+r), 1+r], pairs i < j."""
  k = Y.shape[0]
  close = np.zeros((k, k), bool)
  lo, hi = 1.0 / (1.0 + radius), 1.0 + radius
  for i in range(k):
    close[i, i] = True
    for j in range(i + 1, k):
      ev = np.linalg.eigvals(np.linalg.solve(Y[i], Y[j])).real
      close[i, j] = close[j, i] = bool(ev.min() >= lo and ev.max() <= hi)
  return close


def pairwise_speed(repeats, seed, k=100, d=10, group=200, radius=0.75):
  """closeness_matrix (jit, warmed up) vs the NumPy loop on k candidate covariances.

  r = 0.75 makes roughly half of the pairs of 200-row candidates close at d = 10 (a mixed matrix
  checks the agreement; at the learner's r = 0.25 they would all be apart).
  """
  rng = np.random.default_rng(seed)
  _, A, _ = random_factor(rng, d)
  X = sample(rng, k * group, A).reshape(k, group, d)
  Y = np.einsum("kmi,kmj->kij", X, X) / group           # empirical covariances of the groups
  with jax.enable_x64(True):
    fn = jax.jit(closeness_matrix, static_argnums=1)
    Yj = jnp.asarray(Y)
    start = time.perf_counter()
    fast = np.asarray(fn(Yj, radius))
    first = time.perf_counter() - start
    jax_times = []
    for _ in range(max(repeats, 10)):
      start = time.perf_counter()
      fn(Yj, radius).block_until_ready()
      jax_times.append(time.perf_counter() - start)
  np_times = []
  for _ in range(repeats):
    start = time.perf_counter()
    slow = numpy_closeness(Y, radius)
    np_times.append(time.perf_counter() - start)
  assert np.array_equal(fast, slow), "closeness_matrix disagrees with the NumPy loop"
  j, s = float(np.median(jax_times)), float(np.median(np_times))
  return {"k": k, "d": d, "group_rows": group, "radius": radius,
          "close_fraction": float(fast.mean()), "dpjax_median_s": j, "numpy_median_s": s,
          "dpjax_first_call_s_including_compile": first, "speedup": s / j}


def _fmt(x, spec=".3g"):
  return "⊥" if x is None else format(x, spec)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="d in {5, 10}, n in {1, 2}× minimum")
  parser.add_argument("--epsilon", type=float, default=10.0)
  parser.add_argument("--delta", type=float, default=1e-6)
  parser.add_argument("--trials", type=int, default=None)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", type=str, default=None)
  parser.add_argument("--plot", type=str, default=None, help="PNG of error and ⊥ rate vs n")
  args = parser.parse_args(argv)
  eps, delta = args.epsilon, args.delta
  quick = args.quick
  dims = (5, 10) if quick else (5, 10, 20)
  trials = args.trials or (2 if quick else 4)
  # d = 20: 1× the minimum is 1.9e7 rows (3 GB per float64 copy, and the learners make a few);
  # larger multiples do not fit in this machine's 23 GB.
  multiples = {5: (1, 2) if quick else (1, 2, 4), 10: (1, 2) if quick else (1, 2, 4), 20: (1,)}
  trials_at = {5: trials, 10: trials, 20: max(1, trials // 2)}
  # learn_gaussian needs ≈ 6·required_n(d − 2, eta_accuracy=0.5) rows for its covariance step:
  # 3.4e6 at d = 5, 1.3e7 at d = 10, ≈ 5e7 × 20 floats at d = 20 (skipped: memory).
  gauss_multiples = {5: (1,)} if quick else {5: (1, 2), 10: (1,)}
  start_all = time.perf_counter()

  print(f"calibration: rows required by al_covariance (δ={delta:g})", flush=True)
  t0 = time.perf_counter()
  calib = calibration_table((5, 10, 20), (1.0, 10.0), delta)
  print(f"{'d':>4}{'ε':>6}{'eta_acc':>9}{'groups k':>10}{'group m':>9}{'required n':>13}"
        f"{'η':>9}{'γ':>9}")
  for c in calib:
    print(f"{c['d']:>4}{c['epsilon']:>6g}{c['eta_accuracy']:>9g}{c['num_groups']:>10}"
          f"{c['min_group_size']:>9}{c['required_n']:>13,}{c['eta']:>9.4f}{c['gamma']:>9.4f}")
  print(f"(learn_covariance needs 2× required n at eta_accuracy 0.5; 4× with unknown_mean; "
        f"{time.perf_counter() - t0:.0f} s)\n", flush=True)

  print("pairwise predicate: closeness_matrix vs NumPy loop", flush=True)
  speed = pairwise_speed(repeats=3, seed=args.seed)
  print(f"k={speed['k']} candidates, d={speed['d']}, {speed['group_rows']} rows each, "
        f"r={speed['radius']}: {100 * speed['close_fraction']:.0f}% pairs close, identical "
        f"matrices; dpjax {1e3 * speed['dpjax_median_s']:.2f} ms, numpy "
        f"{1e3 * speed['numpy_median_s']:.0f} ms, speedup {speed['speedup']:.0f}x "
        f"(first call incl. compile {speed['dpjax_first_call_s_including_compile']:.1f} s)\n",
        flush=True)

  print(f"covariance: N(0, Σ), eig(Σ) = 10^U[−6,6], ε={eps:g}, δ={delta:g}, spectral error "
        "‖Σ^-1/2 Σ̂ Σ^-1/2 − I‖ (median over non-⊥ trials)", flush=True)
  header = f"{'what':<20}{'d':>4}{'n':>13}{'median error':>14}{'⊥ rate':>8}{'trials':>8}"
  print(header)
  cells, n_min = [], {}
  for d in dims:
    n_min[d] = 2 * required_n(d, eps, delta, eta_accuracy=0.5)
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
      "pairwise_speedup_vs_numpy": speed["speedup"]}
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
