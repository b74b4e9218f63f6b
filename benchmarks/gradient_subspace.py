"""When does a private subspace pay? Gradient-subspace routes against tuned DP-SGD, over n and ε.

    python benchmarks/gradient_subspace.py [--quick] [--data mnist generated digits PATH.npz]
        [--n N ...] [--epsilons ε ...] [--models softmax mlp_small mlp_large]
        [--routes ...] [--public-rows m ...] [--pca-ranks k ...] [--pca-fractions f ...]
        [--gep-ranks r ...]
        [--oracle-refresh R ...] [--json PATH] [--plot PREFIX] [--write-crossover PATH]
    python benchmarks/gradient_subspace.py --merge A.json B.json ... [--diagnostics] [--json PATH]
        [--plot PREFIX] [--write-crossover PATH] [--markdown PATH]

The crossover study (issue 37). For each data set, training-set size n (nested subsets of one
private pool), ε (δ = 1e-5) and model, every route is tuned on a tuning split and run on paired
seeds against ``dp_sgd``; per (data set, model, ε, route) the report gives the paired difference
with its 95% interval at every n and **n\\***, the smallest n at which the route wins (interval above
zero AND mean accuracy above the best ``dp_sgd`` over the models and feature maps of the task at
that n and ε), or "none up to n_max" with the miss at n_max; ``n_star_model`` the same against the
route's own model alone. ``--plot PREFIX`` writes ``PREFIX_<task>.png``: a row of panels per (data
set, model) and a column per ε, each route's difference vs n with its interval, the NOT private
oracle in grey, and the level of the task's best ``dp_sgd``.
``--write-crossover PATH`` merges the crossover summary into the JSON at PATH (the main job reads
``dpjax/_data/crossover.json`` for its "wins from n ≈ …" lines). ``--merge A.json B.json …``
runs nothing: it unites the cells of ``--json`` reports of a grid run in pieces (n*, the wins and
the figure are derived from the whole: a route wins only above the best dp_sgd over every model
of the merged reports at that n and ε).

Routes (``dpjax.experiments.train_route``, a research harness on ``dpjax.sgd``; every DP route at
the same total (ε, δ) under add/remove-one, by one PLD accountant):

* ``dp_sgd``: Poisson sampling, normalised clipping ``g/(‖g‖ + 0.01)`` (C = 1), Gaussian noise in
  all p coordinates, Adam, an EMA (0.99) of the iterates.
* ``private_input_subspace`` (no public data): Abadi et al.'s DP-PCA: rows scaled to unit norm
  (public map), an Analyze Gauss release of their second moment, top-k eigenvectors, the first
  layer TRAINED in that basis; the release's ``GaussianDpEvent`` composed with the T steps by PLD.
  k and the PCA's share f (its stand-alone ε_s = f·ε, which sets σ_p) are tuned with the learning
  rate on the tuning split over ``--pca-ranks`` × ``--pca-fractions`` (public choices, reported
  with σ_p per row).
* ``public_gradient_subspace_m<m>`` (public data, PDP-SGD): the noisy gradient projected on the top-32
  right singular vectors of the per-example gradients of m public examples, refreshed every 10
  steps. The m public rows are held out of the private pool (``--public-rows``).
* ``gep_trajectory`` (no public data): GEP with a basis from the released updates (free); its
  rank r is tuned with the learning rate over ``--gep-ranks`` (default 8).
* ``public_subspace`` (public data, 10% of the pool as public inputs; not in the default set: its
  first-layer input basis is dominated by the public gradient route on MNIST).
* ``dp_sgd_denoise`` (not in the default set: post-processing denoising that lost 30 points on
  digits at the defaults, docs/algorithms.md §6.5).
* ``non_private``; ``oracle_every<R>`` (``--oracle-refresh``, NOT private: the update projected on
  the exact top-3 singular subspace of the all-rows clipped gradient every R steps): the ceiling.

Protocol: per data set one fixed split (seed 0) into test, tuning, public and private pool rows;
n private rows are the first n of the pool, for every route (the public rows are outside the
pool; each row records ``n_private``). Each row's settings
(learning rate from ``--learning-rates``, and for the DP-PCA route k and f) are chosen by mean
tuning-split accuracy over ``--tuning-seeds`` seeds; then ``--seeds`` paired seeds (the same
initialisation, sampling and noise keys for every route) are scored on the test rows. Tuning is
not privacy-accounted (as in the papers compared with; stated, not hidden).

Data: ``mnist`` (the bundled MNIST-10k: 8,000 training / 2,000 test rows, pixels /255; 500 tuning
rows, 1,000 public rows, a private pool of 6,500), ``mnist_full`` (the canonical 60,000 / 10,000:
1,000 tuning rows, 1,000 public rows, a pool of 58,000; n ∈ 10k, 20k, 40k, 58k; 500 steps at
batch 2,048), ``mnist_full_scattering`` (the same rows as scattering features, 3,969 per image:
``dpjax.features.scattering_features``, cached in ``$DPJAX_CACHE`` or ``~/.cache/dpjax``), ``generated`` (``make_classification``: 64
features of which 8 informative and 24 linear combinations of them — the informative structure
has rank 8 — 10 classes, scale 1/4; 5,000 test, 2,000 tuning, 1,000 public rows and a pool of
max(n)), ``digits`` (scikit-learn's 8×8 digits /16: 360 test, 180 tuning, 100 public, pool 1,157)
or a user's ``PATH.npz`` (X (n, d) float, integer y; 20% test, 10% tuning, min(1,000, 10%)
public). Models: softmax regression, tanh MLPs with 32, 128, 256 and 1,000 hidden units (on
scattering features, ``softmax`` is Tramèr & Boneh's ScatterNet + linear), and ``cnn`` (a Flax
NNX CNN on square images given as flat rows, needs ``flax``; the routes that act on a first dense
layer — ``private_input_subspace``, ``gep_trajectory``, ``public_subspace``, the oracle — do not
apply to it and are skipped). Steps: 300 at
batch 128 for digits, 400 at batch 256 otherwise (``--steps``, ``--batch``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats

from dpjax import accounting, demo, experiments, sgd, subspace
from dpjax import data as data_lib
from dpjax import features as features_lib

NOT_PRIVATE = ("non_private",)
TASKS = {"mnist_full_scattering": "mnist_full"}
DPASE_PROBE_RANKS = (1, 4, 16)      # the diagnostics' DPASE ranks (and the route's own, up to
DPASE_MAX_RANK = 64                 # 64: its q ≈ 2.25k reference points per subset cost q·d each)
MODELS = {"softmax": (), "mlp_small": (32,), "mlp_large": (128,), "mlp_256": (256,),
          "mlp_1000": (1000,), "cnn": None}
# mnist_full: the canonical 60,000 / 10,000 digits; mnist_full_scattering: their scattering
# features (dpjax.features, J = 2, L = 8, group-normalised; a public per-image map).
DATASETS = ("mnist", "mnist_full", "mnist_full_scattering", "generated", "digits")
# Routes a user can ask for; the default set leaves out public_subspace and dp_sgd_denoise (see
# the module docstring).
ROUTES = ("non_private", "dp_sgd", "private_input_subspace", "public_gradient_subspace",
          "gep_trajectory", "public_subspace", "dp_sgd_denoise")
DEFAULT_ROUTES = ("non_private", "dp_sgd", "private_input_subspace", "public_gradient_subspace",
                  "gep_trajectory")
DELTA = 1e-5
ROUTE_SETTINGS = experiments.RouteSettings()
FULL_N = [10_000, 20_000, 40_000, 58_000]   # the pool: 60,000 less 1,000 tuning, 1,000 public
DEFAULT_N = {"mnist": [1000, 2000, 4000, 6500], "generated": [10_000, 30_000, 100_000, 200_000],
             "digits": [1157], "mnist_full": FULL_N, "mnist_full_scattering": FULL_N}
QUICK_N = {"mnist": [2000], "generated": [10_000], "digits": [1157], "mnist_full": [10_000],
           "mnist_full_scattering": [10_000]}
# (steps, batch); others: (400, 256). Full MNIST: 500 steps at L = 2,048 (19 epochs of 54,000
# rows, 100 of 10,000), near the main job's scatnet (527 at 4,096).
STEPS = {"digits": (300, 128), "mnist_full": (500, 2048), "mnist_full_scattering": (500, 2048)}
CACHE = os.environ.get("DPJAX_CACHE", os.path.expanduser("~/.cache/dpjax"))


def load(name: str, n_max: int, *, public_rows: int = 1000) -> dict:
  """``{"test", "tune", "public", "pool"}: (X float32, y int32)`` of one data set; fixed split."""
  if name in ("mnist", "mnist_full", "mnist_full_scattering"):
    ds = data_lib.load_mnist(seed=0) if name == "mnist" else data_lib.load_mnist(full=True)
    Xtr, ytr, Xte = ds.X_train, ds.y_train, ds.X_test
    if name == "mnist_full_scattering":       # a public map of each image alone; cached
      Xtr, Xte = (features_lib.scattering_features(x, cache_dir=CACHE) for x in (Xtr, Xte))
    n_tune = 500 if name == "mnist" else 1000
    parts = {"test": (Xte, ds.y_test), "tune": (Xtr[:n_tune], ytr[:n_tune]),
             "public": (Xtr[-public_rows:], ytr[-public_rows:]),
             "pool": (Xtr[n_tune:len(ytr) - public_rows], ytr[n_tune:len(ytr) - public_rows])}
  else:
    if name == "generated":
      from sklearn.datasets import make_classification
      X, y = make_classification(n_samples=n_max + 8000, n_features=64, n_informative=8,
                                 n_redundant=24, n_classes=10, n_clusters_per_class=1,
                                 class_sep=1.0, random_state=0)
      X = X / 4.0
      sizes = (5000, 2000, 1000)
    else:
      ds = data_lib.load_digits(seed=0) if name == "digits" else data_lib.load_npz(name, seed=0)
      X = np.concatenate([ds.X_train, ds.X_test])
      y = np.concatenate([ds.y_train, ds.y_test])
      sizes = ((360, 180, 100) if name == "digits" else
               (round(0.2 * len(y)), round(0.1 * len(y)), min(1000, round(0.1 * len(y)))))
    perm = np.random.default_rng(0).permutation(len(y))
    cuts = np.cumsum(sizes)
    parts = {"test": perm[:cuts[0]], "tune": perm[cuts[0]:cuts[1]],
             "public": perm[cuts[1]:cuts[2]], "pool": perm[cuts[2]:]}
    parts = {k: (X[i], y[i]) for k, i in parts.items()}
  return {k: (np.asarray(X, np.float32), np.asarray(y, np.int32)) for k, (X, y) in parts.items()}


def model_fns(model: str, in_dim: int, classes: int):
  """``(init_fn, loss_fn, logits_fn)`` of a model: the MLPs of ``dpjax.demo`` (a list of dense
  layers), or ``cnn``, the main job's Flax NNX CNN on square single-channel images given as flat
  rows (``dpjax.demo.cnn_model``: two 3×3 stride-2 convolutions with 8 and 16 channels, tanh,
  then a dense layer; 9,098 parameters on MNIST), whose params are the NNX ``State`` (trained by
  the routes outside ``DENSE_ROUTES``). One object per shape, so compilations are reused."""
  if model == "cnn":
    return tuple(demo.cnn_model(in_dim, classes))[:3]
  return tuple(demo.mlp_model((in_dim, *MODELS[model], classes)))[:3]


@functools.partial(jax.jit, static_argnums=0)
def _accuracy(logits_fn, params, X, y):
  return jax.vmap(lambda p: jnp.mean(jnp.argmax(logits_fn(p, X), axis=-1) == y))(params)


def oracle_name(every: int) -> str:
  """The summary's row name of the oracle ablation refreshed every ``every`` steps."""
  return f"oracle_every{every}"


def is_oracle(row: str) -> bool:
  return row.startswith("oracle_every")


def public_name(m: int) -> str:
  """The row name of the public gradient route with m public examples."""
  return f"public_gradient_subspace_m{m}"


def noise_multiplier(epsilon: float, sampling_prob: float, steps: int) -> float:
  """σ of T Poisson-sampled Gaussian steps at (ε, DELTA), add/remove-one, PLD accountant."""
  return accounting.calibrate_noise_multiplier(epsilon, DELTA, sampling_prob, steps,
                                              accountant="pld")


def run_route(route, data, *, n, model, epsilon, steps, batch, keys, lrs, chunk,
              route_settings=ROUTE_SETTINGS, public_rows=0):
  """Test/tuning accuracies of ``route`` for each (key, lr), the run's σ, its private row count
  and the seconds; keys run in chunks of ``chunk`` (padded) so tuning and evaluation share one
  compilation."""
  X, y = data["pool"]
  kwargs = {}
  if route == "public_gradient_subspace":
    kwargs["public_data"] = tuple(a[:public_rows] for a in data["public"])
  if route == "public_subspace":
    kwargs["public_inputs"] = data["public"][0]
  X, y = X[:n], y[:n]
  classes = int(max(y.max(), *(data[s][1].max() for s in ("test", "tune")))) + 1
  model_init, loss_fn, logits_fn = model_fns(model, X.shape[1], classes)
  # Ranks capped at what the public rows and the model allow (a user's small data set).
  p = sum(x.size for x in jax.tree_util.tree_leaves(jax.eval_shape(model_init, keys[0])))
  route_settings = dataclasses.replace(
      route_settings, public_rank=min(route_settings.public_rank, *data["public"][0].shape),
      public_gradient_rank=min(route_settings.public_gradient_rank, public_rows or p, p))
  total = len(keys)
  pad = (-total) % chunk
  keys = jnp.concatenate([keys, jnp.stack([keys[0]] * pad)]) if pad else keys
  lrs = np.concatenate([lrs, np.repeat(lrs[:1], pad)]) if pad else lrs
  out = {"tune": [], "test": []}
  start = time.perf_counter()
  for i in range(0, len(keys), chunk):
    run = experiments.train_route(route, keys[i:i + chunk], lrs[i:i + chunk], (X, y),
                                  init_fn=model_init,
                                  loss_fn=loss_fn, epsilon=epsilon, delta=DELTA,
                                  steps=steps, expected_batch_size=min(batch, len(y)),
                                  settings=route_settings, **kwargs)
    for split in ("tune", "test"):
      out[split].append(np.asarray(_accuracy(logits_fn, run.params,
                                             *map(jnp.asarray, data[split]))))
  return ({s: np.concatenate(v)[:total] for s, v in out.items()}, run.noise_multiplier, len(y),
          time.perf_counter() - start)


def paired_interval(diffs: np.ndarray) -> tuple[float, list[float]]:
  """Mean of the paired differences and its 95% t-interval."""
  mean = float(np.mean(diffs))
  if len(diffs) < 2 or np.std(diffs) == 0:
    return mean, [mean, mean]
  lo, hi = scipy.stats.t.interval(0.95, len(diffs) - 1, loc=mean,
                                  scale=scipy.stats.sem(diffs))
  return mean, [float(lo), float(hi)]


def welch_interval(a, b) -> tuple[float, list[float]]:
  """Mean of ``a − b`` for independent runs (different models: their seeds share keys, not
  randomness) and its 95% Welch t-interval."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  mean = float(a.mean() - b.mean())
  va = a.var(ddof=1) / a.size if a.size > 1 else 0.0
  vb = b.var(ddof=1) / b.size if b.size > 1 else 0.0
  if va + vb == 0:
    return mean, [mean, mean]
  df = (va + vb) ** 2 / ((va ** 2 / (a.size - 1) if a.size > 1 else 0.0)
                         + (vb ** 2 / (b.size - 1) if b.size > 1 else 0.0))
  half = float(scipy.stats.t.ppf(0.975, df) * np.sqrt(va + vb))
  return mean, [mean - half, mean + half]


def _jobs(routes, args, route_settings):
  """(row name, route, [(settings, public rows)] candidates tuned over)."""
  jobs = []
  for route in routes:
    if route == "public_gradient_subspace":
      jobs += [(public_name(m), route, [(route_settings, m)]) for m in args.public_rows]
    elif route == "private_input_subspace":
      jobs.append((route, route, [
          (dataclasses.replace(route_settings, input_rank=k, input_epsilon_fraction=f), 0)
          for k, f in itertools.product(args.pca_ranks, args.pca_fractions)]))
    elif route == "gep_trajectory":
      jobs.append((route, route, [(dataclasses.replace(route_settings, gep_rank=r), 0)
                                  for r in args.gep_ranks]))
    else:
      jobs.append((route, route, [(route_settings, 0)]))
  jobs += [(oracle_name(every), "oracle_subspace",
            [(dataclasses.replace(route_settings, oracle_refresh=every), 0)])
           for every in args.oracle_refresh]
  return jobs


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true",
                      help="one cell per axis: the first data set's smallest default n, ε = 2, "
                           "softmax, 3 seeds, 1 tuning seed, 3 learning rates, k = 60, f = 0.2")
  parser.add_argument("--data", nargs="+", default=["mnist", "generated"],
                      help=f"data sets: {', '.join(DATASETS)} or a PATH.npz (X (n, d), integer y)")
  parser.add_argument("--n", type=int, nargs="+", default=None,
                      help="private training-row counts (nested subsets of the pool); default "
                           "per data set: " + "; ".join(f"{k} {v}" for k, v in DEFAULT_N.items()))
  parser.add_argument("--seeds", type=int, default=None, help="paired evaluation seeds (4)")
  parser.add_argument("--tuning-seeds", type=int, default=None, help="(1)")
  parser.add_argument("--learning-rates", type=float, nargs="+", default=None,
                      help="the Adam grid, the same for every route (0.01 0.03 0.1 0.3)")
  parser.add_argument("--epsilons", type=float, nargs="+", default=None, help="(1 2 4 8)")
  parser.add_argument("--models", nargs="+", default=None, choices=list(MODELS),
                      help="(softmax mlp_small)")
  parser.add_argument("--routes", nargs="+", default=None, choices=ROUTES,
                      help=f"default {' '.join(DEFAULT_ROUTES)}; dp_sgd always runs")
  parser.add_argument("--public-rows", type=int, nargs="+", default=None,
                      help="public examples of the public gradient route, one row each (100 1000)")
  parser.add_argument("--pca-ranks", type=int, nargs="+", default=None,
                      help="the DP-PCA route's ranks k, tuned (16 32 60)")
  parser.add_argument("--pca-fractions", type=float, nargs="+", default=None,
                      help="the DP-PCA route's shares f of ε (stand-alone ε_s = f·ε), tuned "
                           "(0.1 0.3)")
  parser.add_argument("--gep-ranks", type=int, nargs="+", default=None,
                      help="gep_trajectory's ranks r tuned over (8)")
  parser.add_argument("--steps", type=int, default=None, help="override T")
  parser.add_argument("--batch", type=int, default=None, help="override the expected batch L")
  parser.add_argument("--oracle-refresh", type=int, nargs="*", default=None,
                      help="the NOT private oracle ablation, one row per refresh period (10)")
  parser.add_argument("--json", type=str, default=None)
  parser.add_argument("--plot", type=str, default=None, help="PNG prefix: PREFIX_<task>.png")
  parser.add_argument("--write-crossover", type=str, default=None,
                      help="merge the crossover summary (n* per data set, model, ε, route) into "
                           "this JSON file (dpjax/_data/crossover.json for the main job)")
  parser.add_argument("--markdown", type=str, default=None,
                      help="write the report's tables (cells, crossover, diagnostics) as "
                           "Markdown to this path")
  parser.add_argument("--diagnostics", action="store_true",
                      help="with --merge: add each DP-PCA row's release diagnostics (captured "
                           "energy, detectable directions, a DPASE probe at the largest n)")
  parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                      help="run nothing: merge these --json reports (a grid run in pieces), "
                           "then print, --json, --plot and --write-crossover the whole")
  args = parser.parse_args(argv)
  if args.merge:
    summary, details, configs = merge_reports(args.merge)
    if args.diagnostics:
      add_diagnostics(details, configs)
    return finish(summary, details, {"merged": args.merge, "configs": configs}, args)
  quick = args.quick
  args.seeds = args.seeds or (3 if quick else 4)
  args.tuning_seeds = args.tuning_seeds or 1
  args.learning_rates = args.learning_rates or ([0.03, 0.1, 0.3] if quick
                                                else [0.01, 0.03, 0.1, 0.3])
  args.epsilons = args.epsilons or ([2.0] if quick else [1.0, 2.0, 4.0, 8.0])
  args.models = args.models or (["softmax"] if quick else ["softmax", "mlp_small"])
  args.public_rows = args.public_rows or ([1000] if quick else [100, 1000])
  args.pca_ranks = args.pca_ranks or ([60] if quick else [16, 32, 60])
  args.pca_fractions = args.pca_fractions or ([0.2] if quick else [0.1, 0.3])
  args.oracle_refresh = [10] if args.oracle_refresh is None else args.oracle_refresh
  args.gep_ranks = args.gep_ranks or [ROUTE_SETTINGS.gep_rank]
  if quick and len(args.data) > 1:
    args.data = args.data[:1]
  routes = [r for r in ROUTES if r in (args.routes or DEFAULT_ROUTES)]
  if "dp_sgd" not in routes:
    routes.insert(1 if "non_private" in routes else 0, "dp_sgd")
  jobs = _jobs(routes, args, ROUTE_SETTINGS)
  lrs_grid = np.asarray(args.learning_rates)
  print(f"seeds={args.seeds} tuning seeds={args.tuning_seeds} learning rates={lrs_grid.tolist()} "
        f"δ={DELTA} accountant=PLD neighboring=add/remove-one", flush=True)
  wall = time.perf_counter()
  summary, details = {}, {}
  for dataset in args.data:
    key_name = os.path.basename(dataset) if dataset.endswith(".npz") else dataset
    grid = args.n or (QUICK_N if quick else DEFAULT_N).get(dataset)
    data = load(dataset, max(grid) if grid else 0, public_rows=max(args.public_rows))
    pool = len(data["pool"][1])
    grid = sorted({min(n, pool) for n in (grid or [pool])})
    steps, batch = STEPS.get(dataset, (400, 256))
    steps, batch = args.steps or steps, args.batch or batch
    for n, model, eps in itertools.product(grid, args.models, args.epsilons):
      name = f"{key_name}/n={n}/{model}/eps={eps:g}"
      eval_keys = jnp.stack([jax.random.key(s) for s in range(args.seeds)])
      tune_keys = jnp.stack([jax.random.key(10_000 + s) for s in range(args.tuning_seeds)
                             for _ in lrs_grid])
      tune_lrs = np.tile(lrs_grid, args.tuning_seeds)
      chunk = max(len(tune_lrs), args.seeds)
      rows = {}
      for row, route, candidates in jobs:
        if route == "public_gradient_subspace" and candidates[0][1] > len(data["public"][1]):
          continue                         # fewer public rows than asked for (digits)
        if model == "cnn" and route in experiments.DENSE_ROUTES:
          continue                         # acts on a first dense layer: not the CNN's
        if route == "non_private" and eps != args.epsilons[0]:
          rows[row] = details[f"{key_name}/n={n}/{model}/eps={args.epsilons[0]:g}"][row]
          continue
        common = dict(n=n, model=model, epsilon=eps, steps=steps, batch=batch, chunk=chunk)
        best, seconds = None, 0.0
        for settings, m in candidates:     # the tuning: every candidate × the lr grid
          tuned, _, _, t = run_route(route, data, keys=tune_keys, lrs=tune_lrs,
                                     route_settings=settings, public_rows=m, **common)
          seconds += t
          by_lr = tuned["tune"].reshape(args.tuning_seeds, len(lrs_grid)).mean(axis=0)
          i = int(np.argmax(by_lr))
          if best is None or by_lr[i] > best[0]:
            best = (float(by_lr[i]), float(lrs_grid[i]), settings, m)
        tuning_acc, lr, settings, m = best
        acc, sigma, n_private, t = run_route(route, data, keys=eval_keys,
                                             lrs=np.full(args.seeds, lr),
                                             route_settings=settings, public_rows=m, **common)
        seconds += t
        rows[row] = {"test": acc["test"].tolist(), "learning_rate": lr,
                     "tuning_accuracy": tuning_acc, "noise_multiplier": sigma,
                     "n_private": n_private, "seconds": seconds}
        if route == "private_input_subspace":
          rows[row].update(rank=settings.input_rank,
                           pca_fraction=settings.input_epsilon_fraction,
                           pca_noise_multiplier=experiments.input_basis_event(
                               settings.input_epsilon_fraction * eps,
                               settings.input_delta_fraction * DELTA).noise_multiplier)
        if route == "public_gradient_subspace":
          rows[row]["public_rows"] = m
        if route == "gep_trajectory":
          rows[row]["rank"] = settings.gep_rank
        print(f"  {name:36s} {row:30s} lr={lr:<5g} σ={sigma:.3f} "
              f"median acc={np.median(acc['test']):.3f} ({seconds:.0f} s)", flush=True)
      details[name] = rows
      summary[name] = summarise(rows)
  config = {"seeds": args.seeds, "tuning_seeds": args.tuning_seeds,
                       "learning_rates": lrs_grid.tolist(), "delta": DELTA,
                       "accountant": "pld", "neighboring": "add_or_remove_one",
                       "data": args.data, "epsilons": args.epsilons, "models": args.models,
                       "public_rows": args.public_rows, "pca_ranks": args.pca_ranks,
                       "pca_fractions": args.pca_fractions, "gep_ranks": args.gep_ranks,
                       "steps": args.steps,
                       "batch": args.batch, "route_settings": dataclasses.asdict(ROUTE_SETTINGS),
                       "wall_seconds": time.perf_counter() - wall}
  return finish(summary, details, config, args)


def input_diagnostics(X: np.ndarray, *, rank: int, epsilon: float, fraction: float,
                      dpase_probe: bool = False, key_seed: int = 0) -> dict:
  """Why ``private_input_subspace`` gains or loses on rows ``X (n, d)``: its Analyze Gauss release
  at rank k and stand-alone ε_s = fraction·ε (δ_s = 0.1 δ), as the route makes it for seed
  ``key_seed`` (the run's ``subspace`` stream), against the exact top-k basis of the same unit
  rows. NOT private (it reads the exact spectrum): a diagnostic of a release, never a release.

  Returns ``eigenvalues`` (the top 2k of the unit rows' second-moment SUM ``S = Σ x xᵀ``),
  ``noise_sigma`` σ_p (per-entry std of the release's symmetric noise on S, sensitivity 1),
  ``noise_edge`` 2σ_p√d (the noise matrix's spectral norm: a direction with λ below it is not
  resolved), ``detectable`` (#λ above the edge), ``snr`` (λ_i/(σ_p√d), i ≤ k),
  ``captured_exact`` / ``captured_released`` (tr(BᵀSB)/tr S of the exact and the released basis)
  and, with ``dpase_probe``, ``dpase``: DPASE at the same (ε_s, δ_s) on random labels at the
  ranks :data:`DPASE_PROBE_RANKS` below k and at k (if k ≤ :data:`DPASE_MAX_RANK`), γ set to
  the exact sqrt(λ_{k+1}/λ_k) (optimistic: γ is not public); per rank whether it answered and what its basis captures
  (``note``: why it could not run, e.g. too few rows for its subsets)."""
  U = np.asarray(X, np.float64)
  norms = np.linalg.norm(U, axis=1, keepdims=True)
  U = np.divide(U, norms, out=np.zeros_like(U), where=norms > 0)     # the route's public map
  S = U.T @ U
  lam, V = np.linalg.eigh(S)
  lam, V = lam[::-1], V[:, ::-1]
  d = S.shape[0]
  eps_s, delta_s = fraction * epsilon, 0.1 * DELTA
  sigma = float(experiments.input_basis_event(eps_s, delta_s).noise_multiplier)
  release = sgd.private_input_basis(experiments.run_keys(jax.random.key(key_seed)).subspace,
                                    U, rank, epsilon=eps_s, delta=delta_s, clip_norm=1.0,
                                    secure=False)

  def captured(B):
    B = np.asarray(B, np.float64)
    return float(np.trace(B.T @ S @ B) / np.trace(S))

  edge = 2.0 * sigma * np.sqrt(d)
  out = {"rank": rank, "epsilon_s": eps_s, "delta_s": delta_s, "noise_sigma": sigma,
         "noise_edge": float(edge), "eigenvalues": lam[:2 * rank].tolist(),
         "detectable": int(np.sum(lam > edge)),
         "snr": (lam[:rank] / (sigma * np.sqrt(d))).tolist(),
         "captured_exact": captured(V[:, :rank]), "captured_released": captured(release.basis)}
  if dpase_probe:
    out["dpase"] = [_dpase_probe(U, S, lam, k, eps_s, delta_s, key_seed, captured)
                    for k in sorted({k for k in DPASE_PROBE_RANKS if k < rank}
                                    | ({rank} if rank <= DPASE_MAX_RANK else set()))]
  return out


def _dpase_probe(U, S, lam, k, eps_s, delta_s, key_seed, captured) -> dict:
  """DPASE at rank k on the unit rows (one key), γ the exact sqrt(λ_{k+1}/λ_k)."""
  gamma = float(np.sqrt(max(lam[k], 0.0) / lam[k - 1]))
  try:
    with warnings.catch_warnings():    # "will most likely return ⊥": the outcome is recorded
      warnings.simplefilter("ignore")
      res = subspace.dpase(jax.random.key(key_seed), U.astype(np.float32), epsilon=eps_s,
                           delta=delta_s, k=k, gamma=gamma, partition="random_labels")
  except ValueError as exc:        # too few rows for its subsets: a public fact
    return {"k": k, "ok": False, "gamma": gamma, "cell_length": None, "num_subsets": None,
            "captured": None, "note": str(exc)}
  return {"k": k, "ok": bool(res.ok), "gamma": gamma,
          "cell_length": float(res.info["cell_length"]),
          "num_subsets": int(res.info["num_subsets"]),
          "captured": captured(res.basis) if bool(res.ok) else None, "note": None}


def add_diagnostics(details: dict, configs: list, *, dpase_at_n_max: bool = True) -> None:
  """Adds :func:`input_diagnostics` to every ``private_input_subspace`` row of ``details`` (its
  tuned rank and share; the DPASE probe at each data set's largest n); a user's ``.npz`` is
  found by the path the pieces' ``configs`` name."""
  paths = {os.path.basename(d) if d.endswith(".npz") else d: d
           for config in configs for d in config.get("data", [])}
  cells = sorted(((name, _cell(name)) for name in details
                  if "private_input_subspace" in details[name]), key=lambda c: c[1][:2])
  n_max = {}
  for _, (dataset, n, _, _) in cells:
    n_max[dataset] = max(n, n_max.get(dataset, 0))
  loaded = {}
  for name, (dataset, n, _, eps) in cells:
    row = details[name]["private_input_subspace"]
    if dataset not in loaded:
      loaded = {dataset: load(paths.get(dataset, dataset), n_max[dataset])["pool"][0]}  # one held
    row["diagnostics"] = input_diagnostics(
        loaded[dataset][:n], rank=row["rank"], epsilon=float(eps),
        fraction=row["pca_fraction"], dpase_probe=dpase_at_n_max and n == n_max[dataset])
    d = row["diagnostics"]
    said = "".join(f", DPASE(k={p['k']}) " + ("answers" if p["ok"] else "not runnable"
                                                if p["note"] else "⊥")
                   for p in d.get("dpase", []))
    print(f"  {name:36s} k={row['rank']} f={row['pca_fraction']:g}: detectable {d['detectable']}, "
          f"captured {d['captured_released']:.3f} of the exact {d['captured_exact']:.3f}"
          + said,
          flush=True)


def summarise(rows: dict) -> dict:
  """One cell's summary from its detail rows: per row the median and mean test accuracy and the
  paired difference from ``dp_sgd`` with its 95% interval (seed i of every row is run with key
  i, so the first m seeds pair up when two rows have different seed counts)."""
  base = np.asarray(rows["dp_sgd"]["test"])
  out = {}
  for row, r in rows.items():
    acc = np.asarray(r["test"])
    m = min(len(acc), len(base))
    diff, ci = paired_interval(acc[:m] - base[:m])
    out[row] = {"acc": float(np.median(acc)), "mean": float(np.mean(acc)), "diff": diff,
                "ci": ci, "test": [float(a) for a in acc], "learning_rate": r["learning_rate"],
                "tuning_accuracy": r["tuning_accuracy"],
                "private": row not in NOT_PRIVATE and not is_oracle(row)}
  return out


def merge_reports(paths) -> tuple[dict, dict, list]:
  """``(summary, details, configs)`` of the JSON reports at ``paths`` (a grid run in pieces):
  their cells' detail rows united, a later file's row replacing an earlier one's of the same
  name, and the summary derived again from the united rows (:func:`summarise`: every difference
  against the cell's one ``dp_sgd`` row)."""
  details, configs = {}, []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      report = json.load(f)
    for name, rows in report["details"].items():
      details.setdefault(name, {}).update(rows)
    configs.append(report["config"])
  return {name: summarise(rows) for name, rows in details.items()}, details, configs


def finish(summary: dict, details: dict, config, args) -> dict:
  """Marks the wins, derives the crossover, prints, and writes what the options ask for."""
  _mark_wins(summary)
  crossover = crossovers(summary)
  report = {"config": config, "summary": summary, "crossover": crossover, "details": details}
  _print_table(summary)
  _print_crossover(crossover)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  if args.plot:
    _plot(summary, args.plot)
  if args.write_crossover:
    write_crossover(crossover, args.write_crossover)
  if args.markdown:
    with open(args.markdown, "w", encoding="utf-8") as f:
      f.write(markdown_tables(summary, details, crossover))
  return report


def shipped_name(dataset: str, model: str) -> tuple[str, str]:
  """The (data set, model) a crossover cell is shipped under for the main job: scattering cells
  as full MNIST's ``scatnet`` (softmax on scattering features, the main job's model) or
  ``scatnet_<model>``; others as they are."""
  if dataset == "mnist_full_scattering":
    return "mnist_full", "scatnet" if model == "softmax" else f"scatnet_{model}"
  return dataset, model


def markdown_tables(summary: dict, details: dict, crossover: dict) -> str:
  """The report as docs/algorithms.md shows it: per (data set, model, ε, n) each private route's
  paired difference in points with its interval (bold: beats its model), the crossover per route
  (n*, n*_model, the difference at n_max and against the task's best), and the DP-PCA
  diagnostics where ``--diagnostics`` added them."""
  def pts(x):
    return "unknown" if x is None else f"{100 * x:+.1f}"

  def interval(r):
    text = f"{pts(r['diff'])} [{pts(r['ci'][0])}, {pts(r['ci'][1])}]"
    return f"**{text}**" if r.get("beats_model") else text

  order = sorted(summary, key=lambda name: (_cell(name)[0], _cell(name)[2], float(_cell(name)[3]),
                                            _cell(name)[1]))
  routes = list(dict.fromkeys(r for name in order for r in summary[name]
                              if summary[name][r]["private"] and r != "dp_sgd"))
  out = ["| data, model | ε | n | dp_sgd (seeds) | " + " | ".join(routes)
         + " | dp_sgd vs the best |",
         "|---|---|---|---|" + "---|" * len(routes) + "---|"]
  for name in order:
    dataset, n, model, eps = _cell(name)
    rows, base = summary[name], summary[name]["dp_sgd"]
    out.append(f"| {dataset}, {model} | {eps} | {n:,} | {base['acc']:.3f} "
               f"({len(details[name]['dp_sgd']['test'])}) | "
               + " | ".join(interval(rows[r]) if r in rows else "" for r in routes)
               + f" | {pts(base['vs_best_dp_sgd'])} ({base['best_model']}"
               + "".join(f"; {m} not run" for m in base["best_unmeasured"]) + ") |")
  star = (lambda n: "none" if n is None else f"{n:,}")
  around = (lambda ci: "" if ci is None else f" [{pts(ci[0])}, {pts(ci[1])}]")
  out += ["", "| data, model | route | ε | n* | n*_model | n measured | at n_max vs its dp_sgd "
          "| vs the best |", "|---|---|---|---|---|---|---|---|"]
  for dataset, models in crossover.items():
    for model, epss in models.items():
      for eps in sorted(epss, key=float):
        for route, c in epss[eps].items():
          if route in NOT_PRIVATE or is_oracle(route):
            continue
          ns = ", ".join(f"{n:,}" for n in sorted(map(int, c["by_n"])))
          out.append(f"| {dataset}, {model} | {route} | {eps} | {star(c['n_star'])} | "
                     f"{star(c['n_star_model'])} | {ns} | {pts(c['diff_at_n_max'])} "
                     f"[{pts(c['ci_at_n_max'][0])}, {pts(c['ci_at_n_max'][1])}] | "
                     f"{pts(c['vs_best_dp_sgd_at_n_max'])}{around(c.get('ci_vs_best_at_n_max'))} |")
  diagnosed = [(name, rows) for name, rows in details.items()
               if "diagnostics" in rows.get("private_input_subspace", {})]
  if diagnosed:
    out += ["", "| data, model | n | ε | k, f | σ_p | above 2σ_p√d | captured: released / "
            "exact | σ with / without the release | DPASE |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, rows in sorted(diagnosed, key=lambda c: _cell(c[0])):
      dataset, n, model, eps = _cell(name)
      r = rows["private_input_subspace"]
      g = r["diagnostics"]
      probe = ", ".join(f"k = {p['k']}: " + ("answers" if p["ok"] else "too few rows"
                                              if p["note"] else "⊥")
                        for p in g.get("dpase", []))
      out.append(f"| {dataset}, {model} | {n:,} | {eps} | {r['rank']}, {r['pca_fraction']:g} | "
                 f"{g['noise_sigma']:.1f} | {g['detectable']} | {g['captured_released']:.3f} / "
                 f"{g['captured_exact']:.3f} | {r['noise_multiplier']:.3f} / "
                 f"{rows['dp_sgd']['noise_multiplier']:.3f} | {probe} |")
  return "\n".join(out) + "\n"


def write_crossover(crossover: dict, path: str) -> None:
  """Merges ``crossover`` into the JSON file at ``path`` (cells of this run replace the same
  (data set, model, ε) cells there, named by :func:`shipped_name`), without the per-n detail."""
  try:
    with open(path, encoding="utf-8") as f:
      merged = json.load(f)
  except FileNotFoundError:
    merged = {}
  for dataset, models in crossover.items():
    for model, epss in models.items():
      for eps, routes in epss.items():
        name, shipped = shipped_name(dataset, model)
        merged.setdefault(name, {}).setdefault(shipped, {})[eps] = {
            route: {k: v if k != "best_model_at_n_max" or v is None
                    else shipped_name(*v.split("/"))[1]
                    for k, v in c.items() if k != "by_n"} for route, c in routes.items()}
  with open(path, "w", encoding="utf-8") as f:
    json.dump(merged, f, indent=1, sort_keys=True)


def _cell(name: str) -> tuple[str, int, str, str]:
  dataset, n, model, eps = name.rsplit("/", 3)
  return dataset, int(n.split("=")[1]), model, eps.split("=")[1]


def task(dataset: str) -> str:
  """The task a data set poses: the same rows under a public feature map pose the same task, so
  the best private model is sought over both (scattering features are full MNIST's)."""
  return TASKS.get(dataset, dataset)


def _mark_wins(summary: dict) -> None:
  """``beats_model``: a private route other than dp_sgd whose paired interval against the same
  model's dp_sgd lies above zero; ``wins``: that AND an interval above zero against the best
  dp_sgd over every model (and feature map, :func:`task`) at that (task, n, ε), named in
  ``best_model`` (``ci_vs_best``: paired when it is the route's own model, else Welch's, as
  different models' seeds are independent runs).
  A win needs every (data set, model) the study ran at that ε to have run at that n too:
  elsewhere ``best_unmeasured`` names the missing ones, ``vs_best_dp_sgd`` is against the best
  of those that ran (an upper bound of the true margin) and ``wins`` is False."""
  best, present, here = {}, {}, {}
  for name, rows in summary.items():
    dataset, n, model, eps = _cell(name)
    cell = (task(dataset), n, eps)
    if rows["dp_sgd"]["mean"] > best.get(cell, (0.0, "", None))[0]:
      best[cell] = (rows["dp_sgd"]["mean"], f"{dataset}/{model}", rows["dp_sgd"].get("test"))
    present.setdefault((task(dataset), eps), set()).add(f"{dataset}/{model}")
    here.setdefault(cell, set()).add(f"{dataset}/{model}")
  for name, rows in summary.items():
    dataset, n, model, eps = _cell(name)
    cell = (task(dataset), n, eps)
    top, where, top_runs = best[cell]
    # The task's best model is known only where every (data, model) that the study ran at this
    # ε was run at this n too: elsewhere a route can beat its model but not be said to win.
    missing = sorted(present[(task(dataset), eps)] - here[cell])
    for route, r in rows.items():
      r["beats_model"] = bool(r["private"] and route != "dp_sgd" and r["ci"][0] > 0)
      # Against the best model: paired when it is this model, else a Welch interval.
      if where == f"{dataset}/{model}" or top_runs is None or "test" not in r:
        r["ci_vs_best"] = [c + r["mean"] - top - r["diff"] for c in r["ci"]]
      else:
        r["ci_vs_best"] = welch_interval(r["test"], top_runs)[1]
      r["wins"] = bool(r["beats_model"] and r["ci_vs_best"][0] > 0 and not missing)
      r["vs_best_dp_sgd"] = r["mean"] - top
      r["best_model"] = where
      r["best_unmeasured"] = missing


def crossovers(summary: dict) -> dict:
  """``{data: {model: {ε: {route: {"n_star", "n_wins", "n_star_model", "n_beats_model", "n_max",
  "diff_at_n_max", "ci_at_n_max", "vs_best_dp_sgd_at_n_max", "best_model_at_n_max",
  "by_n"}}}}}``: n* the smallest n
  where the route wins (None: none up to n_max), ``n_wins`` every n where it wins (a public
  subspace can win at small n only: DP-SGD's noise shrinks with n, the public basis's error does
  not); ``n_star_model`` / ``n_beats_model`` the same against the same model's dp_sgd alone."""
  out: dict = {}
  for name in sorted(summary, key=lambda s: _cell(s)[1]):
    dataset, n, model, eps = _cell(name)
    for route, r in summary[name].items():
      if route == "dp_sgd":
        continue
      c = out.setdefault(dataset, {}).setdefault(model, {}).setdefault(eps, {}).setdefault(
          route, {"n_star": None, "n_wins": [], "n_star_model": None, "n_beats_model": [],
                  "by_n": {}})
      c["by_n"][str(n)] = {"diff": r["diff"], "ci": r["ci"], "wins": r["wins"],
                           "beats_model": r["beats_model"], "vs_best_dp_sgd": r["vs_best_dp_sgd"],
                           "best_model": r["best_model"]}
      for flag, ns, star in (("wins", "n_wins", "n_star"),
                             ("beats_model", "n_beats_model", "n_star_model")):
        if r[flag]:
          c[ns].append(n)
          c[star] = c[ns][0]
      c.update(n_max=n, diff_at_n_max=r["diff"], ci_at_n_max=r["ci"],
               vs_best_dp_sgd_at_n_max=r["vs_best_dp_sgd"], best_model_at_n_max=r["best_model"],
               ci_vs_best_at_n_max=r.get("ci_vs_best"))
  return out


def _signed(x) -> str:
  """``+0.012``, or ``unknown`` where the task's best model was not run (:func:`_mark_wins`)."""
  return "unknown" if x is None else f"{x:+.3f}"


def _print_table(summary: dict) -> None:
  print(f"\n{'setting':36s} {'route':30s} {'median':>7s} {'diff':>7s} {'95% CI':>17s} "
        f"{'vs best':>8s} {'lr':>6s}  wins")
  for name, rows in summary.items():
    for route, r in rows.items():
      print(f"{name:36s} {route:30s} {r['acc']:7.3f} {r['diff']:+7.3f} "
            f"[{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}] {_signed(r['vs_best_dp_sgd']):>8s} "
            f"{r['learning_rate']:6g}  {'yes' if r['wins'] else ''}")


def _print_crossover(crossover: dict) -> None:
  print(f"\n{'data':12s} {'model':10s} {'ε':>3s} {'route':30s} n*")
  for dataset, models in crossover.items():
    for model, epss in models.items():
      for eps, routes in epss.items():
        for route, c in routes.items():
          if route in NOT_PRIVATE or is_oracle(route):
            continue
          verdict = (f"wins at n = {c['n_wins']} of {sorted(map(int, c['by_n']))}"
                     if c["n_star"] is not None else
                     f"none up to n = {c['n_max']} (diff {c['diff_at_n_max']:+.3f}, "
                     f"vs best dp_sgd {_signed(c['vs_best_dp_sgd_at_n_max'])})")
          if c["n_star"] is None and c.get("n_star_model") is not None:
            verdict += f"; beats its model's dp_sgd at n = {c['n_beats_model']}"
          print(f"{dataset:12s} {model:10s} {eps:>3s} {route:30s} {verdict}")


def _plot(summary: dict, prefix: str) -> None:
  """``PREFIX_<task>.png`` per task (:func:`task`): one row of panels per (data set, model), one
  column per ε; each route's paired difference from the same model's dp_sgd against n with its
  95% interval, the NOT private oracle in grey, and a dashed line where a route would match the
  task's best dp_sgd (above it a route that beats its model also wins)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cells: dict = {}
  for name, rows in summary.items():
    dataset, n, model, eps = _cell(name)
    cells.setdefault(task(dataset), {}).setdefault((dataset, model), {}).setdefault(
        eps, {})[n] = rows
  for task_name, families in cells.items():
    epss = sorted({e for fam in families.values() for e in fam}, key=float)
    all_n = {n for fam in families.values() for by_n in fam.values() for n in by_n}
    fig, axes = plt.subplots(len(families), len(epss), figsize=(4.2 * len(epss),
                                                                 3.3 * len(families)),
                             squeeze=False)
    colours: dict = {}                 # one colour per route across the panels
    for i, ((dataset, model), by_eps) in enumerate(sorted(families.items())):
      for j, eps in enumerate(epss):
        ax = axes[i, j]
        by_n = by_eps.get(eps, {})
        ns = sorted(by_n)
        routes = [r for r in dict.fromkeys(r for n in ns for r in by_n[n])
                  if r not in NOT_PRIVATE and r != "dp_sgd"]
        for route in routes:
          pts = [(n, by_n[n][route]) for n in ns if route in by_n[n]]
          x = [n for n, _ in pts]
          y = np.array([100 * r["diff"] for _, r in pts])
          err = np.array([[100 * (r["diff"] - r["ci"][0]), 100 * (r["ci"][1] - r["diff"])]
                          for _, r in pts]).T
          colour = "0.6" if is_oracle(route) else colours.setdefault(route, f"C{len(colours)}")
          ax.errorbar(x, y, yerr=err, marker="o", ms=4, capsize=2, color=colour, label=route)
        gap = [(n, -100 * by_n[n]["dp_sgd"]["vs_best_dp_sgd"]) for n in ns    # where known
               if not by_n[n]["dp_sgd"].get("best_unmeasured")]
        if any(g > 0 for _, g in gap):
          ax.plot(*zip(*gap), "k--", marker="_", ms=14, lw=0.8, label="best dp_sgd of the task")
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlim(0.8 * min(all_n), 1.25 * max(all_n))
        ax.set_xticks(sorted(all_n), [f"{n:,}" for n in sorted(all_n)], fontsize=6)
        ax.minorticks_off()
        ax.set_title(f"{dataset} / {model}, ε = {eps}", fontsize=9)
        ax.set_xlabel("private training rows n")
        ax.set_ylabel("points vs its dp_sgd")
        if ns:
          ax.legend(fontsize=5)
        else:
          ax.text(0.5, 0.5, "not measured", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(f"{prefix}_{task_name.replace('/', '_')}.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
  main()
  sys.exit(0)
