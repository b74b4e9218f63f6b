"""Classic private PCA and ERM (CSS13, CMS11): utility against ε, and speed against diffprivlib.

    python benchmarks/classic.py [--quick] [--json PATH] [--plot PREFIX]

Data (rows are individuals, scaled to norm ≤ 1 by a PUBLIC constant, never by a data maximum):

* ``digits`` — scikit-learn's bundled 8×8 digits (1,797 rows, d = 64, pixels in [0, 16]):
  pixels mapped to [−1, 1] by ``(p − 8)/8`` (the public midpoint and half-range, not the data's
  mean), then every row divided by √64 (√65 for ERM, whose rows get a public constant column 1
  for the intercept), so every possible row has norm ≤ 1. A fixed split (seeded): 75% train,
  25% test.
* ``spiked`` — a synthetic spiked covariance with a controlled eigen-gap: n = ``--spiked-n``
  rows ``z ~ N(0, diag(λ))`` in d = ``--spiked-d``, λ = 1 on the first k coordinates and
  ``--spiked-noise`` on the others, divided by the public ``3·sqrt(k + (d − k)·noise)`` and
  clipped to norm 1 (a fixed per-row map).

PCA (k = ``--k``): the captured-variance ratio ``tr(VᵀAV) / Σ_{i≤k} λ_i(A)`` of the released
basis V on the training second moment ``A = XᵀX/n`` (CSS13's utility q(V), normalised to 1 for
the non-private top-k), the mean over ``--seeds`` seeds, for MOD-SuLQ (δ = ``--delta``),
PPCA (ε-DP; Gibbs sampler with ``--sweeps`` sweeps for k > 1), Analyze Gauss (δ), DPASE (δ,
γ = ``--gamma``; a ⊥ counts as 0 and the ⊥ rate is reported next to it; "not_runnable" where
DPASE needs more rows than the data have), and diffprivlib's PCA (``data_norm=1``, public
bounds [−1, 1] per coordinate). diffprivlib centres the data with a private mean (part of its ε)
and returns the principal directions of the centred covariance, so its ratio on the uncentred A
is context, not the quantity it optimises. diffprivlib 0.6.6 centres the caller's array in
place (measured), so it gets a copy. Its Bingham sampler can run for many minutes at larger nε
(``centered=True``, no mean, ran for over 10 CPU-minutes on digits at ε = 1 without finishing):
a fit that has not answered after ``--diffprivlib-timeout`` seconds (default 60) is stopped and
recorded as ``timeout`` (no value).

ERM: test accuracy on digits as ten binary one-vs-rest tasks (digit c against the rest, labels
±1; each task its own ε-DP model, the mean over the tasks reported) for output and objective
perturbation (``dpjax.classic``, Λ from ``default_regularization``), non-private logistic
regression (scikit-learn, C = 1/(nΛ) at objective perturbation's Λ, no intercept: the same
objective without the noise), diffprivlib's ``LogisticRegression(data_norm=1,
fit_intercept=False)``, and ``majority`` (predict "rest": about 0.90, the floor). The same on
the balanced task digits 0–4 against 5–9 (``erm_accuracy_balanced``; majority ≈ 0.5), where the
methods differ visibly.

Speed: one fit at ε = ``--speed-epsilon`` (0.3) of dpjax against diffprivlib (MOD-SuLQ against
diffprivlib's PCA, and objective perturbation against diffprivlib's LogisticRegression on the
task "0 against the rest", both on digits), interleaved ``--repeats`` times; the paired median
of ``t_diffprivlib / t_dpjax``; dpjax's first call (compile) reported apart. diffprivlib is
optional: without it (it pins older scikit-learn) its columns are null with a message.

JSON (``--json PATH``)::

    {"summary": {"pca_captured_variance": {"<method>": {"<ε>": float}},   # digits
                 "erm_accuracy": {"<method>": {"<ε>": float}},            # one-vs-rest
                 "speedup_vs_diffprivlib": {"pca": float | null, "erm": float | null}},
     "more": {"spiked_captured_variance": {...}, "erm_accuracy_balanced": {...}},
     "points": [...], "timing": {...}, "config": {...}, "notes": [...]}

``--plot PREFIX`` writes ``PREFIX_pca.png``, ``PREFIX_erm.png`` and ``PREFIX_erm_balanced.png``
(mean ± standard error over the seeds against ε).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import time
import warnings
import zlib

import jax
import numpy as np

from dpjax import classic, subspace
from dpjax.metrics import captured_variance_ratio

PCA_METHODS = ("mod_sulq", "ppca", "analyze_gauss", "dpase", "diffprivlib")
ERM_METHODS = ("objective", "output", "nonprivate", "diffprivlib", "majority")


def digits(seed: int, intercept: bool = False):
  """Digits rows mapped by fixed public maps to norm ≤ 1 (module docstring); a seeded 75/25
  split. ``intercept``: with the public constant column."""
  from sklearn.datasets import load_digits
  X, y = load_digits(return_X_y=True)
  X = (X - 8.0) / 8.0                              # pixels [0, 16] → [−1, 1]
  if intercept:
    X = np.hstack([X, np.ones((len(X), 1))])
  X = X / math.sqrt(X.shape[1])
  perm = np.random.default_rng(seed).permutation(len(X))
  cut = int(0.75 * len(X))
  return X[perm[:cut]], y[perm[:cut]], X[perm[cut:]], y[perm[cut:]]


def spiked(seed: int, n: int, d: int, k: int, noise: float) -> np.ndarray:
  """The spiked-covariance rows (module docstring)."""
  rng = np.random.default_rng(seed)
  lam = np.r_[np.ones(k), np.full(d - k, noise)]
  Z = rng.standard_normal((n, d)) * np.sqrt(lam) / (3.0 * math.sqrt(k + (d - k) * noise))
  norms = np.linalg.norm(Z, axis=1, keepdims=True)
  return Z / np.maximum(norms, 1.0)


def _diffprivlib():
  try:
    import diffprivlib.models as dpl  # noqa: F401
    return dpl
  except Exception as err:                       # ImportError, or an incompatible scikit-learn
    return str(err).splitlines()[0]


@contextlib.contextmanager
def _time_limit(seconds: int):
  """Raises TimeoutError in the block after ``seconds`` (SIGALRM; the main thread on Unix)."""
  def stop(signum, frame):
    raise TimeoutError
  previous = signal.signal(signal.SIGALRM, stop)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def pca_basis(method, key, X, *, epsilon, delta, k, sweeps, gamma, seed, dpl, time_limit=60):
  """``(basis (d, k) or None, ok, note)``."""
  if method == "mod_sulq":
    res = classic.mod_sulq(key, X, epsilon=epsilon, delta=delta, k=k)
  elif method == "ppca":
    res = classic.ppca(key, X, epsilon=epsilon, k=k, num_sweeps=sweeps)
  elif method == "analyze_gauss":
    res = subspace.analyze_gauss(key, X, epsilon=epsilon, delta=delta, k=k, clip_norm=1.0)
  elif method == "dpase":
    try:
      res = subspace.dpase(key, X, epsilon=epsilon, delta=delta, k=k, gamma=gamma)
    except ValueError as err:
      return None, False, f"not_runnable: {str(err).splitlines()[0]}"
  else:
    if isinstance(dpl, str):
      return None, False, f"diffprivlib unavailable: {dpl}"
    try:
      with warnings.catch_warnings(), _time_limit(time_limit):
        warnings.simplefilter("ignore")
        model = dpl.PCA(n_components=k, epsilon=epsilon, data_norm=1.0, centered=False,
                        bounds=(-np.ones(X.shape[1]), np.ones(X.shape[1])),
                        random_state=seed).fit(X.copy())      # it centres its input in place
    except TimeoutError:
      return None, False, f"timeout: no answer within {time_limit} s"
    return model.components_.T, True, ""
  return np.asarray(res.basis, np.float64), bool(res.ok), ""


TASKS = {"one_vs_rest": [(c,) for c in range(10)], "balanced": [(0, 1, 2, 3, 4)]}


def erm_accuracy(method, key, Xtr, ytr, Xte, yte, *, epsilon, seed, dpl, task="one_vs_rest"):
  """``(accuracy or None, note)``: the mean test accuracy over the task's binary problems (the
  digits in a tuple against the rest, labels ±1), each problem its own ε-DP model."""
  accs = []
  for c, positive in enumerate(TASKS[task]):
    ytr_c = np.where(np.isin(ytr, positive), 1.0, -1.0)
    yte_c = np.where(np.isin(yte, positive), 1.0, -1.0)
    if method == "majority":
      accs.append(max(np.mean(yte_c == 1), np.mean(yte_c == -1)))
      continue
    if method in ("objective", "output"):
      fit = (classic.objective_perturbation if method == "objective"
             else classic.output_perturbation)
      f = np.asarray(fit(jax.random.fold_in(key, c), Xtr, ytr_c, epsilon=epsilon).coefficients)
      accs.append(np.mean(np.where(Xte @ f > 0, 1.0, -1.0) == yte_c))
      continue
    if method == "nonprivate":
      from sklearn.linear_model import LogisticRegression
      lam = classic.default_regularization(len(Xtr), Xtr.shape[1], epsilon, "objective")
      model = LogisticRegression(C=1.0 / (len(Xtr) * lam), fit_intercept=False, max_iter=5000)
      accs.append(model.fit(Xtr, ytr_c).score(Xte, yte_c))
      continue
    if isinstance(dpl, str):
      return None, f"diffprivlib unavailable: {dpl}"
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      model = dpl.LogisticRegression(epsilon=epsilon, data_norm=1.0, fit_intercept=False,
                                     random_state=seed * 10 + c).fit(Xtr, ytr_c)
    accs.append(model.score(Xte, yte_c))
  return float(np.mean(accs)), ""


def _key(*parts) -> jax.Array:
  """A key per cell, the same in every process (``hash`` of a str is salted per process)."""
  return jax.random.key(zlib.crc32(repr(parts).encode()))


def _mean_table(points, kind, methods, epsilons):
  table = {}
  for m in methods:
    row = {}
    for eps in epsilons:
      vals = [p["value"] for p in points if p["kind"] == kind and p["method"] == m
              and p["epsilon"] == eps and p["value"] is not None]
      row[str(eps)] = float(np.mean(vals)) if vals else None
    table[m] = row
  return table


def speed(dpl, repeats: int, seed: int, epsilon: float = 0.3, time_limit: int = 60) -> dict:
  """Paired ``t_diffprivlib / t_dpjax`` per fit at ``epsilon`` on digits (module docstring)."""
  from _timing import interleaved, paired, timed
  Xtr, _, _, _ = digits(seed)
  Etr, eytr, _, _ = digits(seed, intercept=True)
  y0 = np.where(eytr == 0, 1.0, -1.0)
  key = jax.random.key(seed)
  dp_fns = {
      "pca": lambda r: np.asarray(classic.mod_sulq(jax.random.fold_in(key, r), Xtr,
                                                   epsilon=epsilon, delta=1e-5, k=4).basis),
      "erm": lambda r: np.asarray(classic.objective_perturbation(
          jax.random.fold_in(key, r), Etr, y0, epsilon=epsilon).coefficients),
  }
  out = {}
  for name, dp_fn in dp_fns.items():
    compile_s, _ = timed(lambda: dp_fn(10**6))
    if isinstance(dpl, str):
      out[name] = {"speedup_median": None, "first_call_s": compile_s, "note": dpl}
      continue

    def base(r, name=name):
      with warnings.catch_warnings(), _time_limit(time_limit):
        warnings.simplefilter("ignore")
        if name == "pca":
          return dpl.PCA(n_components=4, epsilon=epsilon, data_norm=1.0, centered=False,
                         bounds=(-np.ones(64), np.ones(64)), random_state=r).fit(Xtr.copy())
        return dpl.LogisticRegression(epsilon=epsilon, data_norm=1.0, fit_intercept=False,
                                      random_state=r).fit(Etr, y0)
    try:
      base(0)                                      # diffprivlib's first call, untimed
      t_j, t_b, _, _ = interleaved(dp_fn, base, repeats)
    except TimeoutError:
      out[name] = {"speedup_median": None, "first_call_s": compile_s,
                   "note": f"diffprivlib: a fit did not answer within {time_limit} s"}
      continue
    out[name] = {**paired(t_j, t_b), "first_call_s": compile_s}
  return out


def _plot(points, prefix, epsilons):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  for kind, ylabel, methods in (("pca", "captured variance / non-private top-k", PCA_METHODS),
                                ("erm", "test accuracy (digits, one-vs-rest tasks)", ERM_METHODS),
                                ("erm_balanced", "test accuracy (digits 0-4 vs 5-9)",
                                 ERM_METHODS)):
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
      means, errs, xs = [], [], []
      for eps in epsilons:
        vals = [p["value"] for p in points if p["kind"] == kind and p["method"] == m
                and p["epsilon"] == eps and p["value"] is not None]
        if vals:
          xs.append(eps)
          means.append(np.mean(vals))
          errs.append(np.std(vals) / math.sqrt(len(vals)))
      if xs:
        ax.errorbar(xs, means, yerr=errs, marker="o", capsize=3, label=m)
    ax.set_xscale("log")
    ax.set_xlabel("ε")
    ax.set_ylabel(ylabel)
    ax.set_title(f"digits, {kind.replace('_', ' ')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{prefix}_{kind}.png", dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="one seed, two ε, 2 repeats")
  parser.add_argument("--epsilons", type=float, nargs="+", default=None,
                      help="ε grid (default 0.1 0.3 1 3; --quick: 0.3 3)")
  parser.add_argument("--delta", type=float, default=1e-5)
  parser.add_argument("--k", type=int, default=4, help="PCA components (default 4)")
  parser.add_argument("--sweeps", type=int, default=50, help="PPCA Gibbs sweeps for k > 1")
  parser.add_argument("--gamma", type=float, default=0.1, help="DPASE's γ")
  parser.add_argument("--seeds", type=int, default=5)
  parser.add_argument("--spiked-n", type=int, default=20_000)
  parser.add_argument("--spiked-d", type=int, default=50)
  parser.add_argument("--spiked-noise", type=float, default=0.05,
                      help="the non-spike eigenvalues (the spike is 1)")
  parser.add_argument("--repeats", type=int, default=5, help="paired timing repeats")
  parser.add_argument("--speed-epsilon", type=float, default=0.3,
                      help="ε of the speed comparison (0.3: diffprivlib's PCA sampler slows "
                           "down sharply at larger nε)")
  parser.add_argument("--diffprivlib-timeout", type=int, default=60,
                      help="seconds before a diffprivlib PCA fit is stopped (recorded as timeout)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", type=str, default=None)
  parser.add_argument("--plot", type=str, default=None, help="PNG prefix")
  args = parser.parse_args(argv)
  if args.quick:
    args.seeds, args.repeats = 1, 2
    args.spiked_n = min(args.spiked_n, 5_000)
    args.sweeps = min(args.sweeps, 10)
  if args.epsilons is None:
    args.epsilons = [0.3, 3.0] if args.quick else [0.1, 0.3, 1.0, 3.0]
  dpl = _diffprivlib()
  notes = [] if not isinstance(dpl, str) else [f"diffprivlib not measured: {dpl}"]
  points = []
  for s in range(args.seeds):
    seed = args.seed + s
    Xtr, ytr, Xte, yte = digits(seed)
    Etr, eytr, Ete, eyte = digits(seed, intercept=True)
    Xs = spiked(seed, args.spiked_n, args.spiked_d, args.k, args.spiked_noise)
    for data_name, X in (("digits", Xtr), ("spiked", Xs)):
      A = X.T @ X / len(X)
      for eps in args.epsilons:
        for m in PCA_METHODS:
          key = _key(seed, eps, m, data_name)
          start = time.perf_counter()
          V, ok, note = pca_basis(m, key, X, epsilon=eps, delta=args.delta, k=args.k,
                                  sweeps=args.sweeps, gamma=args.gamma, seed=seed, dpl=dpl,
                                  time_limit=args.diffprivlib_timeout)
          value = None if V is None else (float(captured_variance_ratio(V, A)) if ok else 0.0)
          points.append({"kind": "pca" if data_name == "digits" else "spiked",
                         "method": m, "epsilon": eps, "seed": seed, "value": value,
                         "ok": ok, "note": note, "seconds": time.perf_counter() - start})
    for task, kind in (("one_vs_rest", "erm"), ("balanced", "erm_balanced")):
      for eps in args.epsilons:
        for m in ERM_METHODS:
          acc, note = erm_accuracy(m, _key(seed, eps, m, task), Etr, eytr, Ete, eyte,
                                   epsilon=eps, seed=seed, dpl=dpl, task=task)
          points.append({"kind": kind, "method": m, "epsilon": eps, "seed": seed, "value": acc,
                         "ok": acc is not None, "note": note})
  bottoms = {f"{p['kind']}/{p['method']}/{p['epsilon']}": p["note"] or "⊥"
             for p in points if not p["ok"]}
  timing = speed(dpl, args.repeats, args.seed, args.speed_epsilon, args.diffprivlib_timeout)
  summary = {                                        # exactly the schema
      "pca_captured_variance": _mean_table(points, "pca", PCA_METHODS, args.epsilons),
      "erm_accuracy": _mean_table(points, "erm", ERM_METHODS, args.epsilons),
      "speedup_vs_diffprivlib": {k: v["speedup_median"] for k, v in timing.items()},
  }
  more = {
      "spiked_captured_variance": _mean_table(points, "spiked", PCA_METHODS, args.epsilons),
      "erm_accuracy_balanced": _mean_table(points, "erm_balanced", ERM_METHODS, args.epsilons),
  }
  dpase_bottom = {str(eps): float(np.mean([not p["ok"] for p in points if p["method"] == "dpase"
                                           and p["kind"] == "pca" and p["epsilon"] == eps]))
                  for eps in args.epsilons}
  out = {"summary": summary, "more": more, "points": points, "timing": timing,
         "dpase_bottom_rate_digits": dpase_bottom, "not_answered": bottoms, "notes": notes,
         "config": {**vars(args), "devices": str(jax.devices())}}
  _print(out, args.epsilons)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  if args.plot:
    _plot(points, args.plot, args.epsilons)
  return out


def _print(out, epsilons):
  for name, table in (("PCA captured variance (digits)", "pca_captured_variance"),
                      ("PCA captured variance (spiked)", "spiked_captured_variance"),
                      ("ERM test accuracy (digits, one-vs-rest binary tasks)", "erm_accuracy"),
                      ("ERM test accuracy (digits 0-4 against 5-9)", "erm_accuracy_balanced")):
    print(f"\n{name}")
    print(f"{'method':<16}" + "".join(f"{'ε=' + str(e):>10}" for e in epsilons))
    for m, row in {**out["summary"], **out["more"]}[table].items():
      print(f"{m:<16}" + "".join(f"{'—' if row[str(e)] is None else format(row[str(e)], '.3f'):>10}"
                                  for e in epsilons))
  print("\nspeed (t_diffprivlib / t_dpjax, paired median):",
        out["summary"]["speedup_vs_diffprivlib"])
  print("DPASE ⊥ rate on digits:", out["dpase_bottom_rate_digits"])
  for note in out["notes"]:
    print("note:", note)


if __name__ == "__main__":
  main()
