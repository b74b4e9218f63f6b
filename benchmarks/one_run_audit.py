"""Auditing a real DP-SGD run in one run: scattering features + linear on full MNIST, with canaries.

    python benchmarks/one_run_audit.py [--quick] [--epsilons 1 2 4] [--canaries 1000] [--json PATH]

The strongest private pipeline of the main job (softmax regression on the scattering features of
the canonical 60,000 training digits, ``dpjax.features.scattering_features``; the first
``--rows`` rows, 54,000 by default) is trained ONCE per ε by DP-SGD on the plan
(``dpjax.sgd.dp_sgd_plan``: Poisson sampling at L = 1,024, T = 528 steps — the main job's 10
epochs —, clipping at C = 1 by ``vmap(grad)``, σ calibrated by PLD at (ε, 1e-5), Adam at
0.006) with m ``--canaries`` white-box Dirac canaries (:class:`dpjax.audit.DiracCanaries`) in its
training set, each included with probability ½. After the run each canary is scored by how far
its own coordinate moved, and :func:`dpjax.audit.one_run_audit` turns the scores into an
empirical lower bound on ε (Steinke, Nasr & Jagielski 2023, ``one_run``; and the f-DP analysis of
Mahloujifar et al. 2024, ``one_run_fdp``; both by ``jax_privacy.auditing.CanaryScoreAuditor``,
95% confidence). The claim holds when the bound stays at or below ε.

Two negative controls per ε, which the same audit must flag (bound above ε):

* ``no_noise``: the plan at noise multiplier 0.05 (RDP), audited against the claimed ε;
* ``unclipped``: canaries of norm 30·C in a gradient sum that clips at 30·C but declares C, so
  the noise is calibrated to a sensitivity 30× too small.

Each row also gives the model's test accuracy on the canonical 10,000 test digits: the canaries
live on a parameter leaf of their own, so they cost the model only their share of the batches.
``--quick``: 5,000 rows, T = 100, 500 canaries, ε = 2 (a smoke run; its bounds say little).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax import audit, sgd
from dpjax import data as data_lib
from dpjax import features as features_lib

DELTA = 1e-5
CLIP = 1.0
CACHE = os.environ.get("DPJAX_CACHE", os.path.expanduser("~/.cache/dpjax"))


class _DeclaresLess:
  """The ``unclipped`` control: a gradient sum that declares a smaller bound than it clips at."""

  def __init__(self, grad_fn, bound):
    self._grad_fn, self.l2_norm_bound = grad_fn, bound

  def __call__(self, params, batch, mask):
    return self._grad_fn(params, batch, mask)


def loss(params, example):
  x, label = example
  return optax.softmax_cross_entropy_with_integer_labels(x @ params["w"] + params["b"], label)


def one_run(key, train, test, *, epsilon, canaries, batch, steps, lr, control=None) -> dict:
  """One DP-SGD run with Dirac canaries; its test accuracy and one-run bounds."""
  inclusion_key, run_key = jax.random.split(key)          # one split into named purposes
  scale = 30 * CLIP if control == "unclipped" else CLIP
  cans = audit.DiracCanaries.draw(inclusion_key, canaries, scale=scale)
  loss_c = cans.loss(loss)
  grad_fn = sgd.clipped_grad_sum(loss_c, clip_norm=scale)
  if control == "unclipped":
    grad_fn = _DeclaresLess(grad_fn, CLIP)
  budget = ({"noise_multiplier": 0.05, "accountant": "rdp"} if control == "no_noise"
            else {"epsilon": epsilon})
  X, y = train
  plan = sgd.dp_sgd_plan(grad_fn, num_examples=cans.num_examples(len(y)),
                         expected_batch_size=batch, steps=steps, delta=DELTA, key=run_key,
                         **budget)
  d, classes = X.shape[1], int(y.max()) + 1
  params = cans.params({"w": jnp.zeros((d, classes)), "b": jnp.zeros(classes)})
  opt = optax.adam(lr)
  start = time.perf_counter()
  trained, _ = plan.run(params, plan.init(params, opt), plan.prepare(cans.data(train)), opt)
  trained = jax.block_until_ready(trained)
  seconds = time.perf_counter() - start
  Xte, yte = test
  accuracy = float(((Xte @ trained["model"]["w"] + trained["model"]["b"]).argmax(-1)
                    == yte).mean())
  scores = cans.scores(params, trained)
  row = {"control": control or "none", "epsilon_claimed": epsilon, "sigma": plan.noise_multiplier,
         "canaries": canaries, "included": int(cans.included.sum()), "test_accuracy": accuracy,
         "run_seconds": seconds}
  for method in audit.ONE_RUN_METHODS:
    report = audit.one_run_audit(scores, cans.included, delta=DELTA, epsilon_claimed=epsilon,
                                 method=method)
    row[method] = report.epsilon_lower_bound
    row[f"{method}_passed"] = report.passed
  return row


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--epsilons", type=float, nargs="+", default=None)
  parser.add_argument("--canaries", type=int, default=None)
  parser.add_argument("--rows", type=int, default=None)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  rows = args.rows or (5_000 if args.quick else 54_000)
  canaries = args.canaries or (500 if args.quick else 1_000)
  epsilons = args.epsilons or ([2.0] if args.quick else [1.0, 2.0, 4.0])
  steps, batch = (100, 512) if args.quick else (528, 1_024)
  mnist = data_lib.load_mnist(full=True)
  Xtr = features_lib.scattering_features(mnist.X_train[:rows], cache_dir=CACHE)
  Xte = features_lib.scattering_features(mnist.X_test, cache_dir=CACHE)
  train = (jnp.asarray(Xtr), jnp.asarray(mnist.y_train[:rows], jnp.int32))
  test = (jnp.asarray(Xte), jnp.asarray(mnist.y_test, jnp.int32))
  print(f"scattering + linear on {rows:,} rows, {canaries:,} canaries, L = {batch}, T = {steps}, "
        f"δ = {DELTA:g}, add/remove-one")
  out = {"config": {"rows": rows, "canaries": canaries, "steps": steps, "batch": batch,
                    "clip_norm": CLIP, "learning_rate": 0.006, "delta": DELTA,
                    "significance": 0.05}, "rows": []}
  start = time.perf_counter()
  failed = False
  for i, epsilon in enumerate(epsilons):
    for control in (None, "no_noise", "unclipped"):
      row = one_run(jax.random.key(i), train, test, epsilon=epsilon, canaries=canaries,
                    batch=batch, steps=steps, lr=0.006, control=control)
      out["rows"].append(row)
      ok = row["one_run_passed"] and row["one_run_fdp_passed"]
      expected = ok if control is None else not ok
      failed |= not expected
      print(f"ε = {epsilon:g} {row['control']:10s} σ = {row['sigma']:7.3f} test acc "
            f"{row['test_accuracy']:.4f}  one-run ε ≥ {row['one_run']:.3f}  f-DP ε ≥ "
            f"{row['one_run_fdp']:.3f}  {'as expected' if expected else 'UNEXPECTED'} "
            f"({row['run_seconds']:.0f} s)")
  out["wall_seconds"] = time.perf_counter() - start
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(out, f, indent=1)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
