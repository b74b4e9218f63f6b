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
  training rows by default, ``--public-fraction``; marked public and left out of this method's
  private training set).

Who the (ε, δ) protects: ``dp_sgd`` and ``subspace_dp_sgd_private`` train on all the training
rows, and the guarantee covers all of them; ``subspace_dp_sgd_public`` trains privately on the
other rows only (90% by default), and the guarantee covers those rows only. The public split is
public only because this experiment marks it so (it is a seeded sample of the same private data
set): its rows get no protection. Each result row records the number of rows its guarantee covers
(``n_private``), and the report states this in ``privacy_note``.

The budget split is planned before any training, from public quantities only (the row counts,
the number of parameters p, k, ε, δ and γ): a method that cannot run at these settings (for
example DPASE needing more rows than the data have at the requested subspace share of ε) is
reported as not runnable, with the reason, and the other methods still run; the requested
experiment is never changed silently. Every run is isolated: one that raises is recorded as
failed with its error, and the table, the JSON and the plot are still written from what finished.
Each result row has a ``status`` ("ok", "not_runnable" or "failed") and a ``note`` (None, the
reason it did not run, or what happened during an ok run, e.g. DPASE's ⊥).

Exit status: 0 when every run finished or was reported not runnable; 1 when a run failed
unexpectedly (the JSON and the plot are written all the same).

Features are scaled by the public constant 1/16 (pixel range); no statistic of the private data
is used unprivately.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import textwrap
import traceback
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax import data as data_lib
from dpjax import subspace as subspace_lib
from dpjax.sgd import training

# The methods, in run order: (name, train_dp_sgd's subspace argument; None: not private).
METHODS = (("non_private", None), ("dp_sgd", "none"), ("subspace_dp_sgd_private", "private"),
           ("subspace_dp_sgd_public", "public"))
# The share of δ spent on the private subspace (train_dp_sgd's subspace_delta_fraction).
SUBSPACE_DELTA_FRACTION = 0.1


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


@functools.lru_cache(maxsize=None)
def adam(learning_rate: float) -> optax.GradientTransformation:
  """``optax.adam(learning_rate)``, one object per learning rate: ``train_dp_sgd`` compiles its
  step with the optimiser as a static argument, so reusing the object reuses the compilation
  across methods, seeds and calls."""
  return optax.adam(learning_rate)


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


class Route(NamedTuple):
  """One method of the main job, planned from public quantities before any training.

  Attributes:
    method: the method's name in the results.
    subspace: None for the non-private run, else ``train_dp_sgd``'s ``subspace`` argument.
    n_private: the number of rows the method's (ε, δ) covers (None for the non-private run).
    note: None if the method can run at these settings, else the reason it cannot.
  """
  method: str
  subspace: str | None
  n_private: int | None
  note: str | None


def num_params(sizes: tuple[int, ...]) -> int:
  """The number p of parameters of :func:`init_mlp`'s network with layer sizes ``sizes``."""
  return sum(fan_in * fan_out + fan_out for fan_in, fan_out in zip(sizes[:-1], sizes[1:]))


def plan_routes(*, n_train: int, n_public: int, p: int, k: int, epsilon: float, delta: float,
                batch_size: int, gamma: float, subspace_epsilon_fraction: float,
                dataset: str = "the data") -> list[Route]:
  """Plans the four methods before any training, from public quantities only.

  Each DP method is checked the way :func:`dpjax.sgd.train_dp_sgd` would check it: the expected
  batch size against its private rows, ``k ≤ p``, the public split's size against k, and, for
  the private subspace, whether DPASE can run at ``ε_s = fraction·ε`` and
  ``δ_s = SUBSPACE_DELTA_FRACTION·δ``: ``train_dp_sgd(subspace="private")`` calls
  :func:`dpjax.sgd.private_gradient_subspace`, which calls :func:`dpjax.subspace.dpase` with
  ``partition="random_labels"`` on the ``(n_train, p)`` per-example gradients, which calls
  :func:`dpjax.subspace.dpase_parameters` with these arguments; this function makes the same
  call. A route that cannot run gets a note saying why (with the smallest share of ε, on a grid of
  0.01, that would let DPASE run, when there is one); the experiment itself is not changed. The
  noise calibration of the SGD steps is left to the run (it is slow, and it fails only when no
  σ ≤ 1e4 meets the budget; such a run is recorded as failed).

  Args:
    n_train: training rows (all private for ``dp_sgd`` and ``subspace_dp_sgd_private``).
    n_public: rows of the public split (left out of ``subspace_dp_sgd_public``'s private rows).
    p: number of model parameters (the per-example gradients' dimension).
    k: subspace dimension.
    epsilon, delta: the total budget.
    batch_size: the expected batch size L.
    gamma: DPASE's public gap parameter.
    subspace_epsilon_fraction: the share of ε spent on the private subspace.
    dataset: the data set's name, for the notes.

  Returns:
    One :class:`Route` per method, in the order non_private, dp_sgd, subspace_dp_sgd_private,
    subspace_dp_sgd_public.
  """
  n_rest = n_train - n_public
  routes = []
  for method, subspace in METHODS:
    n = n_rest if subspace == "public" else n_train
    note = None
    if batch_size > n:
      note = (f"the expected batch size {batch_size} exceeds the {n} "
              f"{'training' if subspace is None else 'private training'} rows")
    elif subspace in ("private", "public") and k > p:
      note = f"k={k} exceeds the model's p={p} parameters"
    elif subspace == "public" and n_public < k:
      note = f"the public split has {n_public} rows, fewer than k={k}"
    elif subspace == "private":
      note = _dpase_note(n, p, k, epsilon=epsilon, delta=delta, gamma=gamma,
                         fraction=subspace_epsilon_fraction, dataset=dataset)
    routes.append(Route(method, subspace, None if subspace is None else n, note))
  return routes


def _dpase_note(n: int, p: int, k: int, *, epsilon: float, delta: float, gamma: float,
                fraction: float, dataset: str) -> str | None:
  """None if DPASE runs on ``n`` gradient rows at the subspace's share of (ε, δ), else why not."""
  eps_s, delta_s = epsilon * fraction, delta * SUBSPACE_DELTA_FRACTION

  def fits(eps):
    return n // subspace_lib.num_subsets_for(eps, delta_s) >= k + 1

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # DPASE's ⊥-likely warning belongs to the run, not the plan
    try:
      subspace_lib.dpase_parameters(n, p, k, epsilon=eps_s, delta=delta_s, gamma=gamma)
    except ValueError as exc:
      if fits(eps_s):
        return f"DPASE cannot run: {exc}"
    else:
      return None
  t = subspace_lib.num_subsets_for(eps_s, delta_s)
  note = (f"DPASE needs n >= {t * (k + 1)} private rows at ε_s = {eps_s:g}, δ_s = {delta_s:g} "
          f"({t} subsets of at least k + 1 = {k + 1} rows); {dataset} has {n}")
  # The smallest share on a grid of 0.01 that fits (t only shrinks as ε_s grows).
  lo, hi = 1, 99
  if not fits(epsilon * hi / 100):
    return note + f"; no share of ε = {epsilon:g} below 1 is enough (a smaller --k is)"
  while lo < hi:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if fits(epsilon * mid / 100) else (mid + 1, hi)
  return note + f"; --subspace-epsilon-fraction {lo / 100:.2f} or more would let it run"


def run(args) -> dict:
  """Plans, trains and reports the four methods (see the module docstring); ``args`` as parsed
  by :func:`main`. Returns the report that ``--json`` writes."""
  if args.data:
    ds = data_lib.load_npz(args.data, seed=0)
  else:
    ds = data_lib.load_digits(seed=0)
  n_train, d = ds.X_train.shape
  # The public split: a fixed, seeded share of the training rows, excluded from the public
  # route's private training set. It is public only because this experiment says so.
  perm = np.random.default_rng(1).permutation(n_train)
  n_public = max(1, int(round(args.public_fraction * n_train)))
  pub, priv = perm[:n_public], perm[n_public:]
  X_train, y_train = jnp.asarray(ds.X_train), jnp.asarray(ds.y_train)
  X_test, y_test = jnp.asarray(ds.X_test), jnp.asarray(ds.y_test)
  sizes = (d, args.hidden, ds.num_classes)
  routes = plan_routes(n_train=n_train, n_public=n_public, p=num_params(sizes), k=args.k,
                       epsilon=args.epsilon, delta=args.delta, batch_size=args.batch_size,
                       gamma=args.gamma, subspace_epsilon_fraction=args.subspace_epsilon_fraction,
                       dataset=ds.name)

  def eval_fn(params):
    return {"test_accuracy": float(accuracy(params, X_test, y_test))}

  def train(route, keys, params0):
    """One run: ``(params, history, epsilon, delta, subspace_ok, notes)``."""
    if route.subspace is None:
      params, history = train_non_private(
          keys["non_private"], params0, X_train, y_train, steps=args.steps,
          batch_size=args.batch_size, learning_rate=args.learning_rate, eval_fn=eval_fn,
          eval_every=args.eval_every)
      return params, history, None, None, None, []
    if route.subspace == "public":
      train_data = (X_train[priv], y_train[priv])
      public_data = (X_train[pub], y_train[pub])
    else:
      train_data, public_data = (X_train, y_train), None
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      out = training.train_dp_sgd(
          keys[route.subspace], example_loss, params0, train_data,
          adam(args.learning_rate), epsilon=args.epsilon, delta=args.delta,
          steps=args.steps, expected_batch_size=args.batch_size, clip_norm=args.clip_norm,
          subspace=route.subspace, k=args.k if route.subspace != "none" else None,
          public_data=public_data, gamma=args.gamma,
          refresh_every=args.refresh_every if route.subspace == "public" else None,
          subspace_epsilon_fraction=args.subspace_epsilon_fraction,
          subspace_delta_fraction=SUBSPACE_DELTA_FRACTION,
          eval_fn=eval_fn, eval_every=args.eval_every, progress=progress)
    return (out.params, out.history, out.budget.epsilon, out.budget.delta, out.subspace_ok,
            [str(w.message) for w in caught])

  results, curves = [], {}
  progress = not args.no_progress
  for seed in range(args.seeds):
    key_init, key_np, key_dp, key_priv, key_pub = jax.random.split(jax.random.key(seed), 5)
    keys = {"non_private": key_np, "none": key_dp, "private": key_priv, "public": key_pub}
    params0 = init_mlp(key_init, sizes)
    for route in routes:
      row = {"method": route.method, "epsilon": None, "delta": None, "test_accuracy": None,
             "subspace_ok": None, "seed": seed, "status": "ok", "note": None,
             "n_private": route.n_private}
      if route.note is not None:
        row.update(status="not_runnable", note=route.note)
        print(f"[seed {seed}] {route.method}: not runnable: {route.note}", file=sys.stderr)
        results.append(row)
        continue
      if progress:
        print(f"[seed {seed}] {route.method}", file=sys.stderr)
      try:
        params, history, eps, delta, subspace_ok, notes = train(route, keys, params0)
        acc = float(accuracy(params, X_test, y_test))
      except Exception as exc:  # pylint: disable=broad-except  # isolate runs; record the error
        traceback.print_exc()
        row.update(status="failed", note=f"{type(exc).__name__}: {exc}")
        print(f"[seed {seed}] {route.method}: FAILED ({row['note']}); carrying on",
              file=sys.stderr)
      else:
        for note in notes:
          print(f"  note: {note}", file=sys.stderr)
        row.update(epsilon=eps, delta=delta, test_accuracy=acc, subspace_ok=subspace_ok,
                   note=" ".join(notes) or None)
        curves.setdefault(route.method, []).append(history)
      results.append(row)

  report = {"dataset": ds.name, "n_train": int(n_train), "n_test": int(ds.X_test.shape[0]),
            "n_public": int(n_public), "k": args.k, "steps": args.steps,
            "neighbouring": "ADD_OR_REMOVE_ONE", "epsilon": args.epsilon, "delta": args.delta,
            "subspace_epsilon_fraction": args.subspace_epsilon_fraction,
            "privacy_note": _privacy_note(int(n_train), int(n_public), args.epsilon,
                                          args.delta),
            "results": results}
  _print_table(report)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=2, ensure_ascii=False)
    print(f"wrote {args.json}")
  if args.plot:
    _plot(curves, report, args.plot)
    print(f"wrote {args.plot}")
  failed = [r for r in results if r["status"] == "failed"]
  if failed:
    print(f"{len(failed)} run(s) failed (status 'failed' above); the other runs are reported "
          "as usual.", file=sys.stderr)
  return report


def exit_status(report: dict) -> int:
  """The main job's exit status: 1 if a run failed unexpectedly, else 0 (routes reported as
  not runnable at these settings do not count as failures)."""
  return int(any(r["status"] == "failed" for r in report["results"]))


def _privacy_note(n_train: int, n_public: int, epsilon: float, delta: float) -> str:
  share = n_public / n_train
  return (f"(ε, δ) = ({epsilon:g}, {delta:g}) under add/remove-one covers the private training "
          f"rows: all {n_train} training rows for dp_sgd and subspace_dp_sgd_private; for "
          f"subspace_dp_sgd_public the other {n_train - n_public} ({1 - share:.0%}), while its "
          f"public split of {n_public} rows ({share:.0%}) is public only because this experiment "
          "marks it so and gets no protection.")


def _print_table(report: dict) -> None:
  print(f"\n{report['dataset']}: n_train={report['n_train']} (public split "
        f"{report['n_public']}), n_test={report['n_test']}, k={report['k']}, "
        f"steps={report['steps']}; total (ε, δ) = ({report['epsilon']:g}, "
        f"{report['delta']:g}) under add/remove-one")
  print(textwrap.fill("privacy: " + report["privacy_note"], width=100, break_on_hyphens=False))
  header = (f"{'method':<26}{'seed':>5}{'epsilon':>9}{'delta':>10}{'test acc':>10}  "
            f"{'subspace ok':<13}status")
  print(header)
  print("-" * len(header))
  notes = {}
  for r in report["results"]:
    eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.3f}"
    delta = "-" if r["delta"] is None else f"{r['delta']:.1e}"
    acc = "-" if r["test_accuracy"] is None else f"{r['test_accuracy']:.4f}"
    ok = "-" if r["subspace_ok"] is None else str(r["subspace_ok"])
    print(f"{r['method']:<26}{r['seed']:>5}{eps:>9}{delta:>10}{acc:>10}  {ok:<13}{r['status']}")
    if r["note"] is not None:
      notes.setdefault((r["method"], r["status"], r["note"]), []).append(str(r["seed"]))
  for (method, status, note), seeds in notes.items():
    label = "seed" if len(seeds) == 1 else "seeds"
    print(textwrap.fill(f"{method} ({label} {', '.join(seeds)}, {status}): {note}", width=100,
                        subsequent_indent="    ", break_on_hyphens=False))


def _plot(curves: dict, report: dict, path: str) -> None:
  """Test accuracy against steps, averaged over the seeds, for the runs that finished."""
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
  ax.set_title(f"{report['dataset']}: total ε = {report['epsilon']:.2f}, "
               f"δ = {report['delta']:.0e}")
  ax.grid(alpha=0.3)
  if curves:
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  """Parses the options, runs the main job and returns its report (see :func:`run`).

  ``python -m dpjax.demo`` exits with :func:`exit_status` of the report: 1 if a run failed
  unexpectedly, else 0.
  """
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
  parser.add_argument("--batch-size", type=int, default=128,
                      help="expected batch size (default 128)")
  parser.add_argument("--clip-norm", type=float, default=1.0,
                      help="per-example clip norm (default 1.0)")
  parser.add_argument("--learning-rate", type=float, default=1e-2,
                      help="Adam's learning rate (default 1e-2)")
  parser.add_argument("--hidden", type=int, default=32, help="hidden units of the MLP (default 32)")
  parser.add_argument("--public-fraction", type=float, default=0.1,
                      help="share of the training rows marked public for the public-subspace "
                           "method (default 0.1; public only by this experiment's construction)")
  parser.add_argument("--gamma", type=float, default=1e-3,
                      help="DPASE's public gap parameter for the gradient subspace (default 1e-3)")
  parser.add_argument("--subspace-epsilon-fraction", type=float, default=0.25,
                      help="share of ε spent on the private subspace (default 0.25); if DPASE "
                           "cannot run at this share, that method is reported as not runnable")
  parser.add_argument("--refresh-every", type=int, default=5,
                      help="recompute the public subspace every this many steps (free; default 5)")
  parser.add_argument("--eval-every", type=int, default=25,
                      help="evaluate every this many steps (default 25)")
  parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
  args = parser.parse_args(argv)
  if not (math.isfinite(args.epsilon) and args.epsilon > 0):
    parser.error(f"--epsilon must be > 0, got {args.epsilon}")
  if not 0 < args.delta < 1:
    parser.error(f"--delta must lie in (0, 1), got {args.delta}")
  for name in ("k", "seeds", "steps", "batch_size", "hidden", "eval_every", "refresh_every"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  for name in ("clip_norm", "learning_rate"):
    if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
      parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
  for name in ("public_fraction", "subspace_epsilon_fraction"):
    if not 0 < getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must lie in (0, 1), got {getattr(args, name)}")
  if not (math.isfinite(args.gamma) and args.gamma >= 0):
    parser.error(f"--gamma must be >= 0, got {args.gamma}")
  if args.plot:
    try:
      import matplotlib  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
      parser.error('--plot needs matplotlib: pip install "dpjax[examples]"')
  return run(args)


if __name__ == "__main__":
  sys.exit(exit_status(main()))
