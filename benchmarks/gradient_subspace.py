"""Gradient-subspace DP-SGD routes against a tuned DP-SGD, paired over seeds, at ε ∈ {1, 2}.

    python benchmarks/gradient_subspace.py [--quick] [--json PATH] [--plot PATH]
        [--oracle-refresh R [R ...]] [--oracle-rank r] [--gep-edge-scale c] [--gep-two-sided]

Routes, trained by ``dpjax.experiments.train_route`` (a research harness on ``dpjax.sgd``'s
public API; every DP route at the same total (ε, δ) under add/remove-one, by one PLD accountant:
T Poisson-sampled Gaussian steps with the same q and σ):

* ``non_private``: the same model, optimiser and weight averaging without clipping or noise.
* ``dp_sgd``: the baseline at its best straightforward settings — Poisson sampling,
  normalised (automatic) clipping ``g/(‖g‖ + 0.01)`` (C = 1), Gaussian noise in all p
  coordinates (``dpjax.sgd.dp_noise`` built from the clipped-gradient sum), Adam, an EMA of the
  iterates (0.99, evaluated).
* ``dp_sgd_denoise``: ``dp_sgd`` followed by ``dpjax.sgd.low_rank_denoise`` (EMA filter 0.5 and
  Gavish–Donoho shrinkage of each layer matrix at the public noise level): post-processing.
* ``gep_trajectory``: no public data. A warm-up of plain DP-SGD (20% of the steps), then the
  first layer's per-example gradients are split BEFORE clipping by an input-side basis of rank
  8 into an embedding and a residual, clipped separately (C_e = 1, C_ρ = 0.3; sensitivity √2) and
  noised (``dpjax.sgd.embedding_residual_grad_sum``, whose Δ = √2 ``dpjax.sgd.dp_noise`` reads);
  the basis is the top singular subspace of an EMA (0.9) of the released noisy updates
  (``dpjax.sgd.trajectory_bases``), refreshed every 10% of the steps: post-processing, free.
* ``private_input_subspace``: no public data. The first layer's noise lives in the top-16
  eigenvectors of Analyze Gauss's noisy second moment of the training rows' inputs (one release
  per run at a stand-alone (0.1ε, 0.1δ), continuous noise, add/remove-one, rows clipped to norm
  4), after clipping; its GaussianDpEvent is composed with the T steps by the PLD accountant,
  so DP-SGD's σ is 0.3–0.5% above plain DP-SGD's (an ε split cost 5–11%).
* ``public_subspace``: uses public data. 10% of the training rows are marked public (and left out
  of this route's private rows); the first layer's noise lives in the top-16 principal
  directions of the public rows' inputs (``dpjax.sgd.public_input_basis``; ``dpjax.sgd.dp_noise``
  with per-layer ``bases=``, after clipping).

Ablation, NOT private (``--oracle-refresh``, off by default): ``oracle_every<R>`` is
``dp_sgd``'s release with each weight matrix's update projected onto ``U Uᵀ (·) V Vᵀ``, U and V
the top-r (``--oracle-rank``, default 3) singular vectors of the mean clipped gradient over all
training rows, recomputed every R steps (``dpjax.experiments.train_route("oracle_subspace")``).
It shows the room an exact low-rank gradient subspace of age < R steps would give, i.e. what a
private subspace estimate competes for; its rows say ``"private": false`` and never win.

Protocol. A fixed split per data set: 25% test, 10% of all rows held back as the tuning set,
the rest training. Each route's learning rate is chosen on the tuning set (the same grid for
every route, ``--learning-rates``; mean tuning accuracy over ``--tuning-seeds`` seeds), then
``--seeds`` paired seeds are run at the chosen rate (seed s: the same initialisation, sampling
and noise keys for every route) and scored on the test set. Reported per
``<dataset>/<model>/eps=<ε>`` and route: the median test accuracy, the mean paired difference
against ``dp_sgd`` with a 95% t-interval, the chosen rate and its tuning accuracy (the equal-grid
best-of result), and ``private``. A private route ``wins`` when the interval is above zero AND its
mean accuracy beats the best ``dp_sgd`` over every model tried on that data set at that ε. Tuning is not privacy-
accounted (as in the papers compared with; stated, not hidden).

Data: ``digits`` (scikit-learn's bundled 8×8 digits, features ×1/16) and ``generated``
(``make_classification``: 20,000 rows, 64 features of which 8 informative and 24 linear
combinations of them, so the informative structure has rank 8, 10 classes; a public scale 1/4).
Models: softmax regression and tanh MLPs with 32 and 128 hidden units.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats

from dpjax import demo, experiments

ROUTES = experiments.ROUTES
NOT_PRIVATE = ("non_private",)
MODELS = {"softmax": (), "mlp_small": (32,), "mlp_large": (128,)}
DATASETS = ("digits", "generated")
DELTA = 1e-5
# The routes' settings (the defaults of dpjax.experiments.RouteSettings: normalised clipping C = 1,
# γ = 0.01; weight EMA 0.99; denoise filter 0.5; GEP r = 8, C_ρ = 0.3, 20% warm-up, 10 refreshes,
# filter 0.9; public rank 16).
ROUTE_SETTINGS = experiments.RouteSettings()
PUBLIC_FRACTION = 0.1
SETTINGS = {"digits": {"batch": 128, "steps": 300}, "generated": {"batch": 256, "steps": 400}}


def load(name: str, rows: int | None = None):
  """``{"train", "tune", "test"}: (X, y)`` NumPy float32 / int32; fixed split (seed 0)."""
  if name == "digits":
    from sklearn.datasets import load_digits
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
  else:
    from sklearn.datasets import make_classification
    X, y = make_classification(n_samples=rows or 20_000, n_features=64, n_informative=8,
                               n_redundant=24, n_classes=10, n_clusters_per_class=1,
                               class_sep=1.0, random_state=0)
    X = X / 4.0
  perm = np.random.default_rng(0).permutation(len(y))
  n_test, n_tune = round(0.25 * len(y)), round(0.10 * len(y))
  parts = {"test": perm[:n_test], "tune": perm[n_test:n_test + n_tune],
           "train": perm[n_test + n_tune:]}
  return {k: (X[i].astype(np.float32), y[i].astype(np.int32)) for k, i in parts.items()}


@functools.lru_cache(maxsize=None)
def init_fn(in_dim: int, sizes: tuple[int, ...]):
  """The model's ``key -> params`` (one object per shape, so compilations are reused)."""
  return functools.partial(demo.init_mlp, sizes=(in_dim, *sizes, 10))


@jax.jit
def _accuracy(params, X, y):
  return jax.vmap(lambda p: demo.accuracy(p, X, y))(params)


def oracle_name(every: int) -> str:
  """The summary's row name of the oracle ablation refreshed every ``every`` steps."""
  return f"oracle_every{every}"


def is_oracle(row: str) -> bool:
  return row.startswith("oracle_every")


def noise_multiplier(epsilon: float, sampling_prob: float, steps: int) -> float:
  """σ of T Poisson-sampled Gaussian steps at (ε, DELTA), add/remove-one, PLD accountant."""
  return experiments.noise_multiplier(epsilon, DELTA, sampling_prob, steps, "pld")


def run_route(route, data, *, sizes, epsilon, settings, keys, lrs, chunk,
              route_settings=ROUTE_SETTINGS):
  """Test/tuning accuracies of ``route`` for each (key, lr) by ``dpjax.experiments.train_route``;
  keys are run in chunks of ``chunk`` (padded) so that tuning and evaluation share one
  compilation."""
  X, y = data["train"]
  public = None
  if route in experiments.PUBLIC_ROUTES:
    n_public = round(PUBLIC_FRACTION * len(y))
    public, X, y = X[:n_public], X[n_public:], y[n_public:]
  total = len(keys)
  pad = (-total) % chunk
  keys = jnp.concatenate([keys, jnp.stack([keys[0]] * pad)]) if pad else keys
  lrs = np.concatenate([lrs, np.repeat(lrs[:1], pad)]) if pad else lrs
  out = {"tune": [], "test": []}
  start = time.perf_counter()
  for i in range(0, len(keys), chunk):
    run = experiments.train_route(route, keys[i:i + chunk], lrs[i:i + chunk], (X, y),
                                  init_fn=init_fn(X.shape[1], tuple(sizes)),
                                  loss_fn=demo.example_loss, epsilon=epsilon, delta=DELTA,
                                  steps=settings["steps"],
                                  expected_batch_size=settings["batch"], public_inputs=public,
                                  settings=route_settings)
    for split in ("tune", "test"):
      out[split].append(np.asarray(_accuracy(run.params, *map(jnp.asarray, data[split]))))
  return ({s: np.concatenate(v)[:total] for s, v in out.items()}, run.noise_multiplier,
          time.perf_counter() - start)


def paired_interval(diffs: np.ndarray) -> tuple[float, list[float]]:
  """Mean of the paired differences and its 95% t-interval."""
  mean = float(np.mean(diffs))
  if len(diffs) < 2 or np.std(diffs) == 0:
    return mean, [mean, mean]
  lo, hi = scipy.stats.t.interval(0.95, len(diffs) - 1, loc=mean,
                                  scale=scipy.stats.sem(diffs))
  return mean, [float(lo), float(hi)]


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true",
                      help="5 seeds, 2 tuning seeds, 3 learning rates (the full run: 20, 3, 6)")
  parser.add_argument("--seeds", type=int, default=None, help="paired evaluation seeds")
  parser.add_argument("--tuning-seeds", type=int, default=None)
  parser.add_argument("--learning-rates", type=float, nargs="+", default=None,
                      help="the Adam learning-rate grid, the same for every route")
  parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0])
  parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
  parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
  parser.add_argument("--steps", type=int, default=None, help="override T (both data sets)")
  parser.add_argument("--rows", type=int, default=None,
                      help="rows of the generated data set (default 20,000)")
  parser.add_argument("--gep-edge-scale", type=float, default=None,
                      help="turn on gep_trajectory's noise-edge rank rule at this scale "
                           "(RouteSettings.gep_edge_scale; default off: rank 8)")
  parser.add_argument("--gep-two-sided", action="store_true",
                      help="gep_trajectory's bases get an output-side factor too "
                           "(RouteSettings.gep_two_sided: embedding UᵀGV)")
  parser.add_argument("--oracle-refresh", type=int, nargs="*", default=[],
                      help="add the NOT private oracle_subspace ablation, one row "
                           "oracle_every<R> per refresh period R (steps)")
  parser.add_argument("--oracle-rank", type=int, default=ROUTE_SETTINGS.oracle_rank,
                      help="the oracle's rank r per weight matrix (left and right)")
  parser.add_argument("--json", type=str, default=None)
  parser.add_argument("--plot", type=str, default=None, help="PNG of accuracy against ε")
  args = parser.parse_args(argv)
  route_settings = dataclasses.replace(ROUTE_SETTINGS, gep_edge_scale=args.gep_edge_scale,
                                       gep_two_sided=args.gep_two_sided)
  seeds = args.seeds or (5 if args.quick else 20)
  tuning_seeds = args.tuning_seeds or (2 if args.quick else 3)
  lrs_grid = np.asarray(args.learning_rates or ([0.01, 0.03, 0.1] if args.quick
                                                else [0.005, 0.01, 0.02, 0.05, 0.1, 0.2]))
  routes = [r for r in ROUTES if r in args.routes]
  if "dp_sgd" not in routes:
    routes.insert(1 if "non_private" in routes else 0, "dp_sgd")
  # (row name, route, settings): the routes, then the oracle ablation (not private).
  jobs = [(r, r, route_settings) for r in routes] + [
      (oracle_name(every), "oracle_subspace",
       dataclasses.replace(route_settings, oracle_rank=args.oracle_rank, oracle_refresh=every))
      for every in args.oracle_refresh]
  chunk = len(lrs_grid) * tuning_seeds
  print(f"seeds={seeds} tuning seeds={tuning_seeds} learning rates={lrs_grid.tolist()} "
        f"δ={DELTA} accountant=PLD neighboring=add/remove-one", flush=True)

  summary, details = {}, {}
  for dataset in args.datasets:
    data = load(dataset, args.rows)
    settings = dict(SETTINGS[dataset])
    if args.steps:
      settings["steps"] = args.steps
    for model in args.models:
      sizes = MODELS[model]
      for eps in args.epsilons:
        name = f"{dataset}/{model}/eps={eps:g}"
        tune_keys = jnp.stack([jax.random.key(10_000 + s) for s in range(tuning_seeds)
                               for _ in lrs_grid])
        tune_lrs = np.tile(lrs_grid, tuning_seeds)
        eval_keys = jnp.stack([jax.random.key(s) for s in range(seeds)])
        rows = {}
        for row, route, row_settings in jobs:
          if route == "non_private" and eps != args.epsilons[0]:
            rows[row] = details[f"{dataset}/{model}/eps={args.epsilons[0]:g}"][row]
            continue
          tuned, _, t_tune = run_route(route, data, sizes=sizes, epsilon=eps, settings=settings,
                                       keys=tune_keys, lrs=tune_lrs, chunk=chunk,
                                       route_settings=row_settings)
          by_lr = tuned["tune"].reshape(tuning_seeds, len(lrs_grid)).mean(axis=0)
          best = float(lrs_grid[int(np.argmax(by_lr))])
          acc, sigma, t_eval = run_route(route, data, sizes=sizes, epsilon=eps,
                                         settings=settings, keys=eval_keys,
                                         lrs=np.full(seeds, best), chunk=chunk,
                                         route_settings=row_settings)
          rows[row] = {"test": acc["test"].tolist(), "learning_rate": best,
                       "tuning_accuracy": float(by_lr.max()),
                       "tuning_grid": dict(zip(map(float, lrs_grid), map(float, by_lr))),
                       "noise_multiplier": sigma, "seconds": t_tune + t_eval}
          print(f"  {name:28s} {row:22s} lr={best:<6g} σ={sigma:.3f} "
                f"median acc={np.median(acc['test']):.3f} ({t_tune + t_eval:.0f} s)", flush=True)
        details[name] = rows
        base = np.asarray(rows["dp_sgd"]["test"])
        summary[name] = {}
        for route, r in rows.items():
          acc = np.asarray(r["test"])
          diff, ci = paired_interval(acc - base)
          summary[name][route] = {"acc": float(np.median(acc)), "mean": float(np.mean(acc)),
                                  "diff": diff, "ci": ci, "learning_rate": r["learning_rate"],
                                  "tuning_accuracy": r["tuning_accuracy"],
                                  "private": route not in NOT_PRIVATE and not is_oracle(route)}
  _mark_wins(summary)
  report = {"config": {"seeds": seeds, "tuning_seeds": tuning_seeds,
                       "learning_rates": lrs_grid.tolist(), "delta": DELTA,
                       "accountant": "pld", "neighboring": "add_or_remove_one",
                       "settings": SETTINGS if not args.steps else
                       {k: {**s, "steps": args.steps} for k, s in SETTINGS.items()},
                       "route_settings": dataclasses.asdict(route_settings),
                       "public_fraction": PUBLIC_FRACTION},
            "summary": summary, "details": details}
  _print_table(summary)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  if args.plot:
    _plot(summary, args.plot)
  return report


def _mark_wins(summary: dict) -> None:
  """``wins``: a private route other than dp_sgd, interval above zero and mean accuracy above the
  best dp_sgd over all models."""
  best = {}
  for name, rows in summary.items():
    dataset, _, eps = name.split("/")
    best[(dataset, eps)] = max(best.get((dataset, eps), 0.0), rows["dp_sgd"]["mean"])
  for name, rows in summary.items():
    dataset, _, eps = name.split("/")
    for route, r in rows.items():
      r["wins"] = bool(r["private"] and route != "dp_sgd" and r["ci"][0] > 0
                       and r["mean"] > best[(dataset, eps)])
      r["vs_best_dp_sgd"] = r["mean"] - best[(dataset, eps)]


def _print_table(summary: dict) -> None:
  print(f"\n{'setting':28s} {'route':22s} {'median':>7s} {'diff':>7s} {'95% CI':>17s} "
        f"{'vs best':>8s} {'lr':>6s}  wins")
  for name, rows in summary.items():
    for route, r in rows.items():
      print(f"{name:28s} {route:22s} {r['acc']:7.3f} {r['diff']:+7.3f} "
            f"[{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}] {r['vs_best_dp_sgd']:+8.3f} "
            f"{r['learning_rate']:6g}  {'yes' if r['wins'] else ''}")


def _plot(summary: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  groups = sorted({name.rsplit("/", 1)[0] for name in summary})
  fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.5), squeeze=False)
  for ax, group in zip(axes[0], groups):
    names = sorted((n for n in summary if n.startswith(group + "/")),
                   key=lambda n: float(n.rsplit("=", 1)[1]))
    eps = [float(n.rsplit("=", 1)[1]) for n in names]
    for route in summary[names[0]]:
      acc = [summary[n][route]["acc"] for n in names]
      ax.plot(eps, acc, marker="o", label=route)
    ax.set_title(group)
    ax.set_xlabel("ε (δ = 1e-5)")
    ax.set_ylabel("median test accuracy")
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  main()
  sys.exit(0)
