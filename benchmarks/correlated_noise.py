"""Correlated (BandMF) against independent noise on the strongest private pipeline, with and
without a learned subspace: scattering features + linear on full MNIST.

    python benchmarks/correlated_noise.py [--quick] [--epsilons 1 2 8] [--bands 1 4 16]
        [--seeds 2] [--subspace none dp_pca] [--filter none low_pass kalman]
        [--strategy banded blt] [--json PATH]

The main job's scatnet model (softmax regression on the scattering features of the first
``--rows`` = 54,000 canonical training digits, ``dpjax.features.scattering_features``) trained
by DP-SGD on the plan (``dpjax.sgd.dp_sgd_plan``: L = 1,024, T = 528 steps — the main job's 10
epochs —, clip C = 1 by ``vmap(grad)``, σ calibrated by PLD at (ε, 1e-5), Adam at 0.006, the
final iterate) with

* ``--bands 1``: independent noise and Poisson sampling (plain DP-SGD);
* ``--bands b > 1``: BandMF noise, ``dpjax.sgd.optimal_banded_toeplitz(T, b)``, with cyclic
  Poisson sampling of cycle b (docs/algorithms.md §6.7; σ calibrated on the amplified event);

and ``--strategy blt``: a BLT strategy (``dpjax.sgd.optimal_buffered_toeplitz(T, N // L)``)
normalised to min-sep sensitivity 1, with cyclic sampling of cycle ``N // L`` (one epoch: an
example's steps are an epoch apart) and NO amplification — the run is one Gaussian mechanism
(docs/algorithms.md §6.7); ``--bands`` is then ignored;

and ``--subspace``:

* ``none``: the full release (39,700 coordinates a step);
* ``dp_pca``: the first kernel's per-layer release in a rank-``--rank`` (2,048) basis of the
  private rows' features (``dpjax.sgd.private_input_basis``, Analyze Gauss on the unit-scaled
  rows, continuous noise, 5% of ε and 10% of δ, its Gaussian event composed into the plan by
  PLD): the correlated noise then lives in the 2,048·10 released coefficients.

and ``--filter``: ``none``; ``low_pass`` — DOPPLER's first-order low-pass filter of the
released updates before Adam (``dpjax.sgd.low_pass()``); or ``kalman`` — DiSK's simplified
Kalman filter around Adam (``dpjax.sgd.kalman_filter(adam, kappa=0.7)``, the gradient at the
extrapolated point, the model ``kalman_filter_iterate``); both post-processing,
docs/algorithms.md §6.8.

Each row: test accuracy on the canonical 10,000 test digits, mean and range over ``--seeds``
(the same seeds for every cell: paired), σ, and seconds a run. The learning rate is the main
job's public choice for this model, not tuned per cell: a comparison of noises at one setting.
``--quick``: 5,000 rows, T = 60, ε = 2, one seed (a smoke run).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax import sgd
from dpjax import data as data_lib
from dpjax import features as features_lib

DELTA = 1e-5
CLIP = 1.0
LEARNING_RATE = 0.006
CACHE = os.environ.get("DPJAX_CACHE", os.path.expanduser("~/.cache/dpjax"))


def loss(params, example):
  x, label = example
  return optax.softmax_cross_entropy_with_integer_labels(x @ params["w"] + params["b"], label)


def unit_rows(X: np.ndarray) -> np.ndarray:
  """Each row scaled to norm 1 (a public per-row map, for the basis release only)."""
  norms = np.linalg.norm(X, axis=1, keepdims=True)
  return np.divide(X, norms, out=np.zeros_like(X), where=norms > 0)


@functools.lru_cache(maxsize=None)
def _strategy(kind: str, steps: int, bands: int, epoch: int):
  if kind == "blt":
    return sgd.optimal_buffered_toeplitz(steps, epoch)
  return sgd.optimal_banded_toeplitz(steps, bands) if bands > 1 else None


def one_run(key, train, test, *, epsilon, bands, subspace, rank, batch, steps,
            filter_="none", strategy_kind="banded") -> dict:
  """One DP-SGD run; its test accuracy, σ and time."""
  basis_key, plan_key = jax.random.split(key)             # one split into named purposes
  X, y = train
  n, d = X.shape
  classes = int(y.max()) + 1
  strategy = _strategy(strategy_kind, steps, bands, n // batch)
  if strategy_kind == "blt":
    bands = strategy.min_sep
  bases = None
  budget = {"epsilon": epsilon}
  if subspace == "dp_pca":
    release = sgd.private_input_basis(basis_key, unit_rows(np.asarray(X, np.float64)), rank,
                                      epsilon=0.05 * epsilon, delta=0.1 * DELTA, clip_norm=1.0,
                                      secure=False)
    bases = {"w": release, "b": None}
  plan = sgd.dp_sgd_plan(sgd.clipped_grad_sum(loss, clip_norm=CLIP), num_examples=n,
                         expected_batch_size=batch, steps=steps, delta=DELTA, key=plan_key,
                         bases=bases, noise_strategy=strategy, **budget)
  params = {"w": jnp.zeros((d, classes)), "b": jnp.zeros(classes)}
  opt = optax.adam(LEARNING_RATE)
  if filter_ == "low_pass":
    opt = optax.chain(sgd.low_pass(), opt)
  elif filter_ == "kalman":
    opt = sgd.kalman_filter(opt, kappa=0.7)
  start = time.perf_counter()
  trained, state = plan.run(params, plan.init(params, opt), plan.prepare(train), opt)
  if filter_ == "kalman":
    trained = sgd.kalman_filter_iterate(trained, state)
  trained = jax.block_until_ready(trained)
  seconds = time.perf_counter() - start
  Xte, yte = test
  accuracy = float(((Xte @ trained["w"] + trained["b"]).argmax(-1) == yte).mean())
  return {"epsilon": epsilon, "bands": bands, "subspace": subspace, "filter": filter_,
          "strategy": strategy_kind,
          "sigma": plan.noise_multiplier,
          "test_accuracy": accuracy, "run_seconds": seconds, "plan_epsilon": plan.epsilon}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--epsilons", type=float, nargs="+", default=None)
  parser.add_argument("--bands", type=int, nargs="+", default=None)
  parser.add_argument("--subspace", nargs="+", default=None, choices=("none", "dp_pca"))
  parser.add_argument("--filter", nargs="+", default=None, choices=("none", "low_pass", "kalman"))
  parser.add_argument("--strategy", nargs="+", default=None, choices=("banded", "blt"))
  parser.add_argument("--seeds", type=int, default=None)
  parser.add_argument("--rows", type=int, default=None)
  parser.add_argument("--rank", type=int, default=2048)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  rows = args.rows or (5_000 if args.quick else 54_000)
  epsilons = args.epsilons or ([2.0] if args.quick else [1.0, 2.0, 8.0])
  bands = args.bands or ([1, 4] if args.quick else [1, 4, 16])
  subspaces = args.subspace or (["none"] if args.quick else ["none", "dp_pca"])
  filters = args.filter or ["none"]
  strategies = args.strategy or ["banded"]
  seeds = args.seeds or (1 if args.quick else 2)
  rank = min(args.rank, 256) if args.quick else args.rank
  steps, batch = (60, 512) if args.quick else (528, 1_024)
  mnist = data_lib.load_mnist(full=True)
  Xtr = features_lib.scattering_features(mnist.X_train[:rows], cache_dir=CACHE)
  Xte = features_lib.scattering_features(mnist.X_test, cache_dir=CACHE)
  train = (jnp.asarray(Xtr), jnp.asarray(mnist.y_train[:rows], jnp.int32))
  test = (jnp.asarray(Xte), jnp.asarray(mnist.y_test, jnp.int32))
  print(f"scattering + linear on {rows:,} rows, L = {batch}, T = {steps}, δ = {DELTA:g}, "
        f"Adam {LEARNING_RATE}, {seeds} seed(s), add/remove-one")
  out = {"config": {"rows": rows, "steps": steps, "batch": batch, "clip_norm": CLIP,
                    "learning_rate": LEARNING_RATE, "delta": DELTA, "rank": rank,
                    "seeds": seeds}, "rows": []}
  start = time.perf_counter()
  cells = [(e, s, b, f, k) for e in epsilons for s in subspaces for k in strategies
           for b in (bands if k == "banded" else [0]) for f in filters]
  for epsilon, subspace, b, filter_, kind in cells:
    runs = [one_run(jax.random.key(seed), train, test, epsilon=epsilon, bands=b,
                    subspace=subspace, rank=rank, batch=batch, steps=steps,
                    filter_=filter_, strategy_kind=kind)
            for seed in range(seeds)]
    accs = [r["test_accuracy"] for r in runs]
    row = dict(runs[0], test_accuracy=float(np.mean(accs)), accuracies=accs,
               run_seconds=float(np.mean([r["run_seconds"] for r in runs])))
    out["rows"].append(row)
    label = f"bands {b:2d}" if kind == "banded" else f"BLT sep {row['bands']:2d}"
    print(f"ε = {epsilon:g} {subspace:6s} {label} {filter_:8s}: σ = {row['sigma']:6.3f}  "
          f"test acc {row['test_accuracy']:.4f} [{min(accs):.4f}, {max(accs):.4f}]  "
          f"({row['run_seconds']:.0f} s a run)", flush=True)
    if args.json:                      # written as the rows come: a long run keeps them
      out["wall_seconds"] = time.perf_counter() - start
      with open(args.json, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
  out["wall_seconds"] = time.perf_counter() - start
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
