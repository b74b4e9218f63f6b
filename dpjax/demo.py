"""The main job: private training on real data, four ways, at one total (ε, δ).

    python -m dpjax.demo                       # digits, ε = 2, δ = 1e-5
    python -m dpjax.demo --json results.json --plot accuracy.png
    python -m dpjax.demo --data my.npz         # arrays X (n, d) and integer y (n,)

Methods (all DP ones at the same total (ε, δ) under add/remove-one, the private subspace's cost
included):

* ``non_private``: the same model and optimiser without clipping or noise (the ceiling);
* ``dp_sgd``: DP-SGD with Poisson sampling, per-example clipping and Gaussian noise in all p
  parameters;
* ``subspace_dp_sgd_private``: a rank-k gradient subspace learned with DPASE from the per-example
  gradients at the initial parameters, paying (ε_s, δ_s) out of the total; the SGD noise then
  lives in k dimensions. If DPASE returns ⊥, training continues as plain DP-SGD with the
  remaining budget (never with a non-private subspace);
* ``subspace_dp_sgd_public``: a rank-k subspace from the gradients of a public split (10% of the
  training rows, marked public and left out of the private training set).

Features are scaled by the public constant 1/16 (pixel range); no statistic of the private data
is used unprivately.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax import data as data_lib
from dpjax.sgd import training


def init_mlp(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
  """He-style initialisation of a fully connected network with layer sizes ``sizes``."""
  params = []
  for key_layer, (fan_in, fan_out) in zip(jax.random.split(key, len(sizes) - 1),
                                          zip(sizes[:-1], sizes[1:])):
    w = jax.random.normal(key_layer, (fan_in, fan_out)) * math.sqrt(2.0 / fan_in)
    params.append({"w": w, "b": jnp.zeros(fan_out)})
  return params


def mlp_logits(params, x: jax.Array) -> jax.Array:
  """Logits of the MLP (tanh hidden layers) for one example ``x (d,)`` or a batch ``(B, d)``."""
  h = x
  for layer in params[:-1]:
    h = jnp.tanh(h @ layer["w"] + layer["b"])
  return h @ params[-1]["w"] + params[-1]["b"]


def example_loss(params, example) -> jax.Array:
  """Cross-entropy of one example ``(x (d,), y ())``: the per-example loss DP-SGD clips."""
  x, y = example
  return optax.softmax_cross_entropy_with_integer_labels(mlp_logits(params, x), y)


@jax.jit
def accuracy(params, X: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean(jnp.argmax(mlp_logits(params, X), axis=-1) == y)


def train_non_private(key, params, X, y, *, steps, batch_size, learning_rate, eval_fn,
                      eval_every):
  """Minibatch training without privacy: the same model and optimiser, for reference."""
  optimizer = optax.adam(learning_rate)
  state = optimizer.init(params)

  @jax.jit
  def step(params, state, idx):
    def batch_loss(p):
      return jnp.mean(jax.vmap(example_loss, in_axes=(None, 0))(p, (X[idx], y[idx])))
    grads = jax.grad(batch_loss)(params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  history = []
  for i, step_key in enumerate(jax.random.split(key, steps)):
    idx = jax.random.choice(step_key, X.shape[0], (batch_size,), replace=False)
    params, state = step(params, state, idx)
    if (i + 1) % eval_every == 0 or i + 1 == steps:
      history.append({"step": i + 1, **eval_fn(params)})
  return params, history


def run(args) -> dict:
  if args.data:
    ds = data_lib.load_npz(args.data, seed=0)
  else:
    ds = data_lib.load_digits(seed=0)
  n_train, d = ds.X_train.shape
  # The public split: a fixed, seeded 10% of the training rows, excluded from private training.
  perm = np.random.default_rng(1).permutation(n_train)
  n_public = max(1, int(round(args.public_fraction * n_train)))
  pub, priv = perm[:n_public], perm[n_public:]
  X_train, y_train = jnp.asarray(ds.X_train), jnp.asarray(ds.y_train)
  X_test, y_test = jnp.asarray(ds.X_test), jnp.asarray(ds.y_test)
  sizes = (d, args.hidden, ds.num_classes)

  def eval_fn(params):
    return {"test_accuracy": float(accuracy(params, X_test, y_test))}

  results, curves = [], {}
  progress = not args.no_progress
  for seed in range(args.seeds):
    key_init, key_np, key_dp, key_priv, key_pub = jax.random.split(jax.random.key(seed), 5)
    params0 = init_mlp(key_init, sizes)
    runs = [("non_private", None), ("dp_sgd", "none"), ("subspace_dp_sgd_private", "private"),
            ("subspace_dp_sgd_public", "public")]
    for method, subspace in runs:
      if progress:
        print(f"[seed {seed}] {method}", file=sys.stderr)
      if subspace is None:
        params, history = train_non_private(
            key_np, params0, X_train, y_train, steps=args.steps,
            batch_size=args.batch_size, learning_rate=args.learning_rate, eval_fn=eval_fn,
            eval_every=args.eval_every)
        eps = delta = subspace_ok = None
      else:
        if subspace == "public":
          train_data = (X_train[priv], y_train[priv])
          public_data = (X_train[pub], y_train[pub])
        else:
          train_data, public_data = (X_train, y_train), None
        key = {"none": key_dp, "private": key_priv, "public": key_pub}[subspace]
        with warnings.catch_warnings(record=True) as caught:
          warnings.simplefilter("always")
          out = training.train_dp_sgd(
              key, example_loss, params0, train_data, optax.adam(args.learning_rate),
              epsilon=args.epsilon, delta=args.delta, steps=args.steps,
              expected_batch_size=args.batch_size, clip_norm=args.clip_norm,
              subspace=subspace, k=args.k if subspace != "none" else None,
              public_data=public_data, gamma=args.gamma,
              refresh_every=args.refresh_every if subspace == "public" else None,
              subspace_epsilon_fraction=args.subspace_epsilon_fraction,
              eval_fn=eval_fn, eval_every=args.eval_every, progress=progress)
        for w in caught:
          print(f"  note: {w.message}", file=sys.stderr)
        params, history = out.params, out.history
        eps, delta, subspace_ok = out.budget.epsilon, out.budget.delta, out.subspace_ok
      acc = float(accuracy(params, X_test, y_test))
      results.append({"method": method, "epsilon": eps, "delta": delta,
                      "test_accuracy": acc, "subspace_ok": subspace_ok, "seed": seed})
      curves.setdefault(method, []).append(history)

  report = {"dataset": ds.name, "n_train": int(n_train), "n_test": int(ds.X_test.shape[0]),
            "n_public": int(n_public), "k": args.k, "steps": args.steps,
            "neighbouring": "add_remove", "results": results}
  _print_table(report)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=2)
    print(f"wrote {args.json}")
  if args.plot:
    _plot(curves, report, args.plot)
    print(f"wrote {args.plot}")
  return report


def _print_table(report: dict) -> None:
  print(f"\n{report['dataset']}: n_train={report['n_train']} (public split "
        f"{report['n_public']}), n_test={report['n_test']}, k={report['k']}, "
        f"steps={report['steps']}; (ε, δ) under add/remove-one")
  header = f"{'method':<26}{'seed':>5}{'epsilon':>9}{'delta':>10}{'test acc':>10}  subspace ok"
  print(header)
  print("-" * len(header))
  for r in report["results"]:
    eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.3f}"
    delta = "-" if r["delta"] is None else f"{r['delta']:.1e}"
    ok = "-" if r["subspace_ok"] is None else str(r["subspace_ok"])
    print(f"{r['method']:<26}{r['seed']:>5}{eps:>9}{delta:>10}{r['test_accuracy']:>10.4f}  {ok}")


def _plot(curves: dict, report: dict, path: str) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as exc:  # pragma: no cover
    raise ImportError('--plot needs matplotlib: pip install "dpjax[examples]".') from exc
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for method, runs in curves.items():
    steps = [h["step"] for h in runs[0]]
    acc = np.mean([[h["test_accuracy"] for h in hist] for hist in runs], axis=0)
    ax.plot(steps, acc, marker="o", markersize=3, label=method)
  ax.set_xlabel("training step")
  ax.set_ylabel("test accuracy")
  eps = next(r["epsilon"] for r in report["results"] if r["epsilon"] is not None)
  ax.set_title(f"{report['dataset']}: total ε = {eps:.2f}, δ = "
               f"{next(r['delta'] for r in report['results'] if r['delta'] is not None):.0e}")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(
      prog="python -m dpjax.demo", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--epsilon", type=float, default=2.0, help="total ε (default 2.0)")
  parser.add_argument("--delta", type=float, default=1e-5, help="total δ (default 1e-5)")
  parser.add_argument("--k", type=int, default=16, help="subspace dimension (default 16)")
  parser.add_argument("--seeds", type=int, default=1, help="number of seeds (default 1)")
  parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
  parser.add_argument("--data", type=str, default=None,
                      help="an .npz with arrays X (n, d) and integer y (n,) instead of digits")
  parser.add_argument("--json", type=str, default=None, help="write the results to this path")
  parser.add_argument("--plot", type=str, default=None,
                      help="write a PNG of test accuracy against steps")
  parser.add_argument("--batch-size", type=int, default=128, help="expected batch size")
  parser.add_argument("--clip-norm", type=float, default=1.0)
  parser.add_argument("--learning-rate", type=float, default=1e-2)
  parser.add_argument("--hidden", type=int, default=32, help="hidden units of the MLP")
  parser.add_argument("--public-fraction", type=float, default=0.1)
  parser.add_argument("--gamma", type=float, default=1e-3,
                      help="DPASE's public gap parameter for the gradient subspace")
  parser.add_argument("--subspace-epsilon-fraction", type=float, default=0.25,
                      help="share of ε spent on the private subspace")
  parser.add_argument("--refresh-every", type=int, default=5,
                      help="recompute the public subspace every this many steps (free)")
  parser.add_argument("--eval-every", type=int, default=25)
  parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
  args = parser.parse_args(argv)
  # dp_accounting logs every fractional RDP order it drops (the ε stays an upper bound); keep
  # the main job's output readable.
  logging.getLogger("absl").setLevel(logging.ERROR)
  if args.epsilon <= 0:
    parser.error(f"--epsilon must be > 0, got {args.epsilon}")
  if not 0 < args.delta < 1:
    parser.error(f"--delta must lie in (0, 1), got {args.delta}")
  for name in ("k", "seeds", "steps", "batch_size", "hidden", "eval_every", "refresh_every"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  return run(args)


if __name__ == "__main__":
  main()
