"""Gradient-subspace DP-SGD routes against a tuned DP-SGD, paired over seeds, at ε ∈ {1, 2}.

    python benchmarks/gradient_subspace.py [--quick] [--json PATH] [--plot PATH]

Routes (every DP route at the same total (ε, δ) under add/remove-one, by one PLD accountant:
T Poisson-sampled Gaussian steps with the same q and σ, ``dpjax.accounting.plan_dpsgd_budget``):

* ``non_private``: the same model, optimiser and weight averaging without clipping or noise.
* ``dp_sgd``: the baseline at its best straightforward settings — Poisson sampling,
  normalised (automatic) clipping ``g/(‖g‖ + 0.01)`` (C = 1), Gaussian noise in all p
  coordinates (``dpjax.sgd.dp_gaussian_noise``), Adam, an EMA of the iterates (0.99, evaluated).
* ``dp_sgd_denoise``: ``dp_sgd`` followed by ``dpjax.sgd.low_rank_denoise`` (EMA filter 0.5 and
  Gavish–Donoho shrinkage of each layer matrix at the public noise level): post-processing.
* ``gep_trajectory``: no public data. A warm-up of plain DP-SGD (20% of the steps), then the
  first layer's per-example gradients are split BEFORE clipping by an input-side basis of rank
  8 into an embedding and a residual, clipped separately (C_e = 1, C_ρ = 0.3; sensitivity √2) and
  noised (``dpjax.sgd.embedding_residual_grad_sum`` / ``embedding_residual_noise``); the basis is
  the top singular subspace of an EMA (0.9) of the released noisy updates
  (``dpjax.sgd.trajectory_bases``), refreshed every 10% of the steps: post-processing, free.
* ``public_subspace``: uses public data. 10% of the training rows are marked public (and left out
  of this route's private rows); the first layer's noise lives in the top-16 principal
  directions of the public rows' inputs (``dpjax.sgd.layer_subspace_noise``, after clipping).

Protocol. A fixed split per data set: 25% test, 10% of all rows held back as the tuning set,
the rest training. Each route's learning rate is chosen on the tuning set (the same grid for
every route, ``--learning-rates``; mean tuning accuracy over ``--tuning-seeds`` seeds), then
``--seeds`` paired seeds are run at the chosen rate (seed s: the same initialisation, sampling
and noise keys for every route) and scored on the test set. Reported per
``<dataset>/<model>/eps=<ε>`` and route: the median test accuracy, the mean paired difference
against ``dp_sgd`` with a 95% t-interval, the chosen rate and its tuning accuracy (the equal-grid
best-of result). A route ``wins`` when the interval is above zero AND its mean accuracy beats the
best ``dp_sgd`` over every model tried on that data set at that ε. Tuning is not privacy-
accounted (as in the papers compared with; stated, not hidden).

Data: ``digits`` (scikit-learn's bundled 8×8 digits, features ×1/16) and ``generated``
(``make_classification``: 20,000 rows, 64 features of which 8 informative and 24 linear
combinations of them, so the informative structure has rank 8, 10 classes; a public scale 1/4).
Models: softmax regression and tanh MLPs with 32 and 128 hidden units.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.stats

from dpjax import accounting, demo, sgd

ROUTES = ("non_private", "dp_sgd", "dp_sgd_denoise", "gep_trajectory", "public_subspace")
MODELS = {"softmax": (), "mlp_small": (32,), "mlp_large": (128,)}
DATASETS = ("digits", "generated")
DELTA = 1e-5
EMA = 0.99                 # weight averaging (post-processing)
STABILITY = 0.01           # normalised clipping's γ
WARMUP = 0.2               # gep_trajectory: share of steps of plain DP-SGD before projecting
REFRESHES = 10             # gep_trajectory: bases refreshed every T/REFRESHES steps
GEP_RANK, GEP_RESIDUAL_CLIP, GEP_FILTER = 8, 0.3, 0.9
PUBLIC_RANK, PUBLIC_FRACTION = 16, 0.1
DENOISE_DECAY = 0.5
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


def first_layer_bases(params, basis):
  """Bases pytree: ``basis`` for the first weight matrix, None elsewhere."""
  return [{"w": basis if i == 0 else None, "b": None} for i in range(len(params))]


def _with_key(state, key):
  """The noise transform's state with its PRNG key replaced (one noise stream per seed)."""
  is_keyed = lambda x: hasattr(x, "_replace") and hasattr(x, "key")  # noqa: E731
  return jax.tree_util.tree_map(lambda x: x._replace(key=key) if is_keyed(x) else x, state,
                                is_leaf=is_keyed)


@functools.lru_cache(maxsize=None)
def _noise_transforms(route, sigma, batch, basis_bytes, in_dim, sizes):
  """The route's noise transforms, built (and their bases checked) on the host, once per
  configuration, so the jitted training reuses one compilation. A placeholder key; each seed's
  key is swapped in inside the trace."""
  key = jax.random.key(0)
  full = sgd.dp_gaussian_noise(clip_norm=1.0, noise_multiplier=sigma, expected_batch_size=batch,
                               key=key)
  template = demo.init_mlp(key, (in_dim, *sizes, 10))
  if route in ("non_private", "dp_sgd"):
    return (full,) if route == "dp_sgd" else ()
  if route == "dp_sgd_denoise":
    return (optax.chain(full, sgd.low_rank_denoise(sigma / batch, decay=DENOISE_DECAY)),)
  if route == "public_subspace":
    basis = np.frombuffer(basis_bytes, np.float32).reshape(in_dim, PUBLIC_RANK)
    return (sgd.layer_subspace_noise(first_layer_bases(template, basis), clip_norm=1.0,
                                     noise_multiplier=sigma, expected_batch_size=batch,
                                     key=key),)
  # gep_trajectory: the warm-up's full noise, then GEP. GEP is built with a fixed public
  # placeholder basis; the released trajectory bases are swapped into its state in the trace
  # (the GEP release's sensitivity, √2 in scaled units, does not depend on the bases).
  bound = sgd.embedding_residual_grad_sum(demo.example_loss, embedding_clip=1.0,
                                          residual_clip=GEP_RESIDUAL_CLIP,
                                          joint=False).l2_norm_bound
  placeholder = np.eye(in_dim, GEP_RANK, dtype=np.float32)
  return (full, sgd.embedding_residual_noise(
      first_layer_bases(template, placeholder), embedding_clip=1.0,
      residual_clip=GEP_RESIDUAL_CLIP, noise_multiplier=sigma, expected_batch_size=batch,
      key=key, l2_norm_bound=bound))


@functools.partial(jax.jit, static_argnames=("route", "sizes", "steps", "batch", "txs",
                                             "microbatch"))
def _train(keys, lrs, X, y, states, *, txs, route, sizes, steps, batch, microbatch):
  """One route for each (key, learning rate) pair; returns the averaged params (stacked)."""
  n = X.shape[0]
  q = batch / n

  def one(key, lr):
    k_init, k_noise, k_sample = jax.random.split(key, 3)
    params = demo.init_mlp(k_init, (X.shape[1], *sizes, 10))
    noise_states = [_with_key(st, k) for st, k in
                    zip(states, jax.random.split(k_noise, max(1, len(states))))]
    adam = optax.adam(lr)
    opt = adam.init(params)
    clipped = sgd.clipped_grad_sum(demo.example_loss, clip_norm=1.0, clipping="normalize",
                                   stability=STABILITY)
    if route == "gep_trajectory":
      return _train_gep(noise_states, txs, k_sample, params, lr, X, y, steps=steps,
                        batch=batch, microbatch=microbatch, clipped=clipped)
    if route == "non_private":
      def step_grad(params, aux, k):
        total = sgd.poisson_clipped_sum(_unclipped_sum, params, (X, y), k, sampling_prob=q,
                                        microbatch_size=microbatch)
        return jax.tree_util.tree_map(lambda g: g / batch, total), aux
      aux = None
    else:
      def step_grad(params, noise_state, k):
        total = sgd.poisson_clipped_sum(clipped, params, (X, y), k, sampling_prob=q,
                                        microbatch_size=microbatch)
        return txs[0].update(total, noise_state, params)
      aux = noise_states[0]

    def body(carry, k):
      params, opt, aux, avg, t = carry
      g, aux = step_grad(params, aux, k)
      updates, opt = adam.update(g, opt, params)
      params = optax.apply_updates(params, updates)
      avg = _average(params, avg, t)
      return (params, opt, aux, avg, t + 1), None

    carry = (params, opt, aux, params, jnp.int32(0))
    carry, _ = jax.lax.scan(body, carry, jax.random.split(k_sample, steps))
    return carry[3]

  # Seeds run one after another inside the program (lax.map), not vmapped: on XLA:CPU (jaxlib
  # 0.10.2) a vmapped while_loop (the Poisson sum) next to an SVD (low_rank_denoise) in one scan
  # body deadlocked (all threads parked, measured at 8 seeds × 100 steps); lax.map was as fast.
  return jax.lax.map(lambda a: one(*a), (keys, lrs))


def _unclipped_sum(params, batch, mask):
  grads = sgd.per_example_grads(demo.example_loss)(params, batch)
  return jax.tree_util.tree_map(lambda g: jnp.tensordot(mask.astype(g.dtype), g, axes=1), grads)


def _average(params, avg, t):
  decay = jnp.minimum(EMA, (1.0 + t) / (10.0 + t))
  return optax.incremental_update(params, avg, 1.0 - decay)


def _train_gep(noise_states, txs, k_sample, params, lr, X, y, *, steps, batch, microbatch,
               clipped, return_bases=False):
  """Warm-up DP-SGD, then GEP with trajectory bases on the first layer (see the docstring).
  Returns the averaged params (and the last bases with ``return_bases``)."""
  q = batch / X.shape[0]
  adam = optax.adam(lr)
  warm, gep = txs
  warm_steps = max(1, round(WARMUP * steps))
  period = max(1, (steps - warm_steps) // REFRESHES)
  periods = max(1, (steps - warm_steps) // period)
  keys = jax.random.split(k_sample, warm_steps + periods * period)

  def filtered(ema, g):
    return jax.tree_util.tree_map(lambda m, x: GEP_FILTER * m + (1 - GEP_FILTER) * x, ema, g)

  def warm_body(carry, k):
    params, opt, noise_state, ema, avg, t = carry
    total = sgd.poisson_clipped_sum(clipped, params, (X, y), k, sampling_prob=q,
                                    microbatch_size=microbatch)
    g, noise_state = warm.update(total, noise_state, params)
    updates, opt = adam.update(g, opt, params)
    params = optax.apply_updates(params, updates)
    return (params, opt, noise_state, filtered(ema, g), _average(params, avg, t), t + 1), None

  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  carry = (params, adam.init(params), noise_states[0], zeros, params, jnp.int32(0))
  carry, _ = jax.lax.scan(warm_body, carry, keys[:warm_steps])
  params, opt, _, ema, avg, t = carry

  grad_sum = sgd.embedding_residual_grad_sum(
      demo.example_loss, embedding_clip=1.0, residual_clip=GEP_RESIDUAL_CLIP, joint=False,
      clipping="normalize", stability=STABILITY)

  def released_bases(ema):
    # Post-processing: the bases read only the EMA of released noisy updates.
    return first_layer_bases(ema, sgd.trajectory_bases([ema[0]], GEP_RANK)[0]["w"])

  def gep_body(carry, k):
    params, opt, noise_state, ema, avg, t = carry
    total = sgd.poisson_clipped_sum(grad_sum, params, (X, y), k, sampling_prob=q,
                                    microbatch_size=microbatch, extra_args=(noise_state.bases,))
    g, noise_state = gep.update(total, noise_state, params)
    updates, opt = adam.update(g, opt, params)
    params = optax.apply_updates(params, updates)
    return (params, opt, noise_state, filtered(ema, g), _average(params, avg, t), t + 1), None

  def period_body(carry, period_keys):
    params, opt, noise_state, ema, avg, t = carry
    noise_state = noise_state._replace(bases=released_bases(ema))   # free refresh
    return jax.lax.scan(gep_body, (params, opt, noise_state, ema, avg, t), period_keys)[0], None

  carry = (params, opt, noise_states[1], ema, avg, t)
  carry, _ = jax.lax.scan(period_body, carry,
                          keys[warm_steps:].reshape(periods, period, *keys.shape[1:]))
  return (carry[4], carry[2].bases) if return_bases else carry[4]


@jax.jit
def _accuracy(params, X, y):
  return jax.vmap(lambda p: demo.accuracy(p, X, y))(params)


def public_basis(X_public: np.ndarray, rank: int) -> np.ndarray:
  """Top-``rank`` right singular vectors of the public rows (uncentred PCA of the inputs)."""
  return np.linalg.svd(X_public, full_matrices=False)[2][:rank].T.astype(np.float32)


@functools.lru_cache(maxsize=None)
def noise_multiplier(epsilon: float, sampling_prob: float, steps: int) -> float:
  """σ of T Poisson-sampled Gaussian steps at (ε, DELTA), add/remove-one, PLD accountant."""
  return accounting.plan_dpsgd_budget(epsilon, DELTA, sampling_prob=sampling_prob, steps=steps,
                                      accountant="pld").noise_multiplier


def run_route(route, data, *, sizes, epsilon, settings, keys, lrs, chunk):
  """Test/tuning accuracies of ``route`` for each (key, lr); keys are run in chunks of ``chunk``
  (padded) so that tuning and evaluation share one compilation."""
  X, y = data["train"]
  basis = np.zeros((X.shape[1], PUBLIC_RANK), np.float32)
  if route == "public_subspace":
    n_public = round(PUBLIC_FRACTION * len(y))
    basis = public_basis(X[:n_public], PUBLIC_RANK)
    X, y = X[n_public:], y[n_public:]
  batch, steps = settings["batch"], settings["steps"]
  sigma = 0.0 if route == "non_private" else noise_multiplier(epsilon, batch / len(y), steps)
  microbatch = min(len(y), math.ceil(batch + 4 * math.sqrt(batch)))
  out = {"tune": [], "test": []}
  total = len(keys)
  pad = (-total) % chunk
  keys = jnp.concatenate([keys, jnp.stack([keys[0]] * pad)]) if pad else keys
  lrs = np.concatenate([lrs, np.repeat(lrs[:1], pad)]) if pad else lrs
  txs = _noise_transforms(route, float(sigma), batch, basis.tobytes(), X.shape[1],
                          tuple(sizes))
  template = demo.init_mlp(jax.random.key(0), (X.shape[1], *sizes, 10))
  states = tuple(tx.init(template) for tx in txs)
  start = time.perf_counter()
  for i in range(0, len(keys), chunk):
    params = _train(keys[i:i + chunk], jnp.asarray(lrs[i:i + chunk], jnp.float32),
                    jnp.asarray(X), jnp.asarray(y), states, txs=txs, route=route,
                    sizes=tuple(sizes), steps=steps, batch=batch, microbatch=microbatch)
    for split in ("tune", "test"):
      out[split].append(np.asarray(_accuracy(params, *map(jnp.asarray, data[split]))))
  return ({s: np.concatenate(v)[:total] for s, v in out.items()}, float(sigma),
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
  parser.add_argument("--json", type=str, default=None)
  parser.add_argument("--plot", type=str, default=None, help="PNG of accuracy against ε")
  args = parser.parse_args(argv)
  seeds = args.seeds or (5 if args.quick else 20)
  tuning_seeds = args.tuning_seeds or (2 if args.quick else 3)
  lrs_grid = np.asarray(args.learning_rates or ([0.01, 0.03, 0.1] if args.quick
                                                else [0.005, 0.01, 0.02, 0.05, 0.1, 0.2]))
  routes = [r for r in ROUTES if r in args.routes]
  if "dp_sgd" not in routes:
    routes.insert(1 if "non_private" in routes else 0, "dp_sgd")
  chunk = len(lrs_grid) * tuning_seeds
  print(f"seeds={seeds} tuning seeds={tuning_seeds} learning rates={lrs_grid.tolist()} "
        f"δ={DELTA} accountant=PLD neighbouring=add/remove-one", flush=True)

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
        for route in routes:
          if route == "non_private" and eps != args.epsilons[0]:
            rows[route] = details[f"{dataset}/{model}/eps={args.epsilons[0]:g}"][route]
            continue
          tuned, _, t_tune = run_route(route, data, sizes=sizes, epsilon=eps, settings=settings,
                                       keys=tune_keys, lrs=tune_lrs, chunk=chunk)
          by_lr = tuned["tune"].reshape(tuning_seeds, len(lrs_grid)).mean(axis=0)
          best = float(lrs_grid[int(np.argmax(by_lr))])
          acc, sigma, t_eval = run_route(route, data, sizes=sizes, epsilon=eps,
                                         settings=settings, keys=eval_keys,
                                         lrs=np.full(seeds, best), chunk=chunk)
          rows[route] = {"test": acc["test"].tolist(), "learning_rate": best,
                         "tuning_accuracy": float(by_lr.max()),
                         "tuning_grid": dict(zip(map(float, lrs_grid), map(float, by_lr))),
                         "noise_multiplier": sigma, "seconds": t_tune + t_eval}
          print(f"  {name:28s} {route:16s} lr={best:<6g} σ={sigma:.3f} "
                f"median acc={np.median(acc['test']):.3f} ({t_tune + t_eval:.0f} s)", flush=True)
        details[name] = rows
        base = np.asarray(rows["dp_sgd"]["test"])
        summary[name] = {}
        for route, r in rows.items():
          acc = np.asarray(r["test"])
          diff, ci = paired_interval(acc - base)
          summary[name][route] = {"acc": float(np.median(acc)), "mean": float(np.mean(acc)),
                                  "diff": diff, "ci": ci, "learning_rate": r["learning_rate"],
                                  "tuning_accuracy": r["tuning_accuracy"]}
  _mark_wins(summary)
  report = {"config": {"seeds": seeds, "tuning_seeds": tuning_seeds,
                       "learning_rates": lrs_grid.tolist(), "delta": DELTA,
                       "accountant": "pld", "neighbouring": "add_or_remove_one",
                       "settings": SETTINGS if not args.steps else
                       {k: {**s, "steps": args.steps} for k, s in SETTINGS.items()},
                       "gep": {"rank": GEP_RANK, "residual_clip": GEP_RESIDUAL_CLIP,
                               "warmup": WARMUP, "refreshes": REFRESHES,
                               "filter": GEP_FILTER},
                       "public": {"rank": PUBLIC_RANK, "fraction": PUBLIC_FRACTION},
                       "denoise_decay": DENOISE_DECAY, "weight_ema": EMA},
            "summary": summary, "details": details}
  _print_table(summary)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  if args.plot:
    _plot(summary, args.plot)
  return report


def _mark_wins(summary: dict) -> None:
  """``wins``: interval above zero and mean accuracy above the best dp_sgd over all models."""
  best = {}
  for name, rows in summary.items():
    dataset, _, eps = name.split("/")
    best[(dataset, eps)] = max(best.get((dataset, eps), 0.0), rows["dp_sgd"]["mean"])
  for name, rows in summary.items():
    dataset, _, eps = name.split("/")
    for route, r in rows.items():
      r["wins"] = bool(route not in ("dp_sgd", "non_private") and r["ci"][0] > 0
                       and r["mean"] > best[(dataset, eps)])
      r["vs_best_dp_sgd"] = r["mean"] - best[(dataset, eps)]


def _print_table(summary: dict) -> None:
  print(f"\n{'setting':28s} {'route':16s} {'median':>7s} {'diff':>7s} {'95% CI':>17s} "
        f"{'vs best':>8s} {'lr':>6s}  wins")
  for name, rows in summary.items():
    for route, r in rows.items():
      print(f"{name:28s} {route:16s} {r['acc']:7.3f} {r['diff']:+7.3f} "
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
