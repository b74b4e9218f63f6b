"""Accuracy of private ERM ([CMS11] output and objective perturbation) against the regularisation
Λ, on sklearn's digits and on synthetic data: the measurements behind
``dpjax.classic.erm.default_regularization`` (``Λ = κ·sqrt(d/(nε))``).

Digits: 8×8 pixels in 0..16, centred and scaled by PUBLIC constants, ``(x − 8)/64`` (64 = 8·8 is
the largest possible row norm after centring; ``x/128`` is the uncentred alternative, worse
conditioned: ``--uncentred``), a constant column 1 appended (the intercept) and
``data_norm = sqrt(2)``; a fixed random split, 1200 rows to train, 597 to test. Tasks: each digit
against the rest (binary, ε each; the majority baseline is ≈ 0.90), digits 0–4 against 5–9
(balanced) and the 10-class one-vs-rest (total ε, split over the classes). Synthetic:
``x ~ N(0, I_d/d)`` clipped to norm 1 (a public clip), ``y = sign(x·w + 0.1 g)`` with ``‖w‖ = 5``,
test accuracy on fresh rows. Rows marked ``*`` are the default κ of each method.

    python benchmarks/erm_regularization.py              # both datasets, the default grid
    python benchmarks/erm_regularization.py --repeats 3  # quicker
    python benchmarks/erm_regularization.py --quick      # one repeat at ε = 1
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import numpy as np

from dpjax.classic import erm

KAPPAS = (0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 1.0, 3.0)


def digits_data(seed: int = 0, centred: bool = True):
  from sklearn.datasets import load_digits
  data = load_digits()
  pixels = (data.data - 8.0) / 64.0 if centred else data.data / 128.0
  X = np.concatenate([pixels, np.ones((len(data.data), 1))], axis=1)
  order = np.random.default_rng(seed).permutation(len(X))
  train, test = order[:1200], order[1200:]
  return X[train], data.target[train], X[test], data.target[test]


def synthetic_data(n: int, d: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  w = rng.standard_normal(d)
  w *= 5.0 / np.linalg.norm(w)

  def draw(m):
    X = rng.standard_normal((m, d)) / math.sqrt(d)
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
    return X, np.where(X @ w + 0.1 * rng.standard_normal(m) >= 0, 1.0, -1.0)
  return (*draw(n), *draw(5000))


def _mark(kappa, method):
  return " *" if kappa == erm.REGULARIZATION_FACTORS[method] else "  "


def _accuracy(coefficients, X, y, classes=None):
  return float(np.mean(erm.predict(coefficients, X, classes) == y))


def sweep_binary(X, y, Xt, yt, *, epsilon, method, repeats, data_norm, loss="logistic"):
  """Mean test accuracy per κ (and the non-private accuracy at the same Λ)."""
  n, d = X.shape
  fit = erm.objective_perturbation if method == "objective" else erm.output_perturbation
  rows = []
  for kappa in KAPPAS:
    lam = kappa * math.sqrt(d / (n * epsilon))
    accs = [_accuracy(fit(jax.random.key(r), X, y, epsilon=epsilon, regularization=lam,
                          data_norm=data_norm, loss=loss).coefficients, Xt, yt)
            for r in range(repeats)]
    exact = fit(jax.random.key(0), X, y, epsilon=1e12, regularization=lam, data_norm=data_norm,
                loss=loss).coefficients            # ε huge: the non-private minimiser (+ ~0)
    rows.append((kappa, lam, float(np.mean(accs)), float(np.std(accs)),
                 _accuracy(exact, Xt, yt)))
  return rows


def digits(repeats: int, epsilons=(1.0,), centred: bool = True):
  X, labels, Xt, labels_t = digits_data(centred=centred)
  norm = math.sqrt(2.0)
  scaling = "(x − 8)/64" if centred else "x/128"
  print(f"digits: n={len(X)}, d={X.shape[1]} (pixels {scaling} + intercept), data_norm=√2")
  for epsilon in epsilons:
    for method in erm.METHODS:
      y, yt = np.where(labels < 5, 1.0, -1.0), np.where(labels_t < 5, 1.0, -1.0)
      print(f"  digits 0-4 vs 5-9, ε={epsilon:g}, {method} perturbation:")
      for kappa, lam, mean, std, exact in sweep_binary(X, y, Xt, yt, epsilon=epsilon,
                                                       method=method, repeats=repeats,
                                                       data_norm=norm):
        print(f"  {_mark(kappa, method)} κ={kappa:<5g} Λ={lam:.4f}  private {mean:.3f} ± {std:.3f}"
              f"  non-private {exact:.3f}")
    for method in erm.METHODS:
      table = {}
      for digit in range(10):
        y, yt = np.where(labels == digit, 1.0, -1.0), np.where(labels_t == digit, 1.0, -1.0)
        for row in sweep_binary(X, y, Xt, yt, epsilon=epsilon, method=method, repeats=repeats,
                                data_norm=norm):
          table.setdefault(row[0], []).append(row)
      print(f"  one digit vs rest, ε={epsilon:g} each, {method} perturbation "
            f"(mean over 10 tasks; majority baseline {np.mean(labels_t != 0):.3f}):")
      for kappa, rows in table.items():
        private, exact = np.mean([r[2] for r in rows]), np.mean([r[4] for r in rows])
        print(f"  {_mark(kappa, method)} κ={kappa:<5g} Λ={rows[0][1]:.4f}  private {private:.3f}"
              f"  non-private {exact:.3f}")
    for method in erm.METHODS:
      n, d = X.shape
      print(f"  10-class one-vs-rest, total ε={epsilon:g} (ε/10 per class), {method}:")
      for kappa in KAPPAS:
        lam = kappa * math.sqrt(d / (n * epsilon / 10))
        accs = [_accuracy(erm.one_vs_rest(jax.random.key(r), X, labels, classes=range(10),
                                          epsilon=epsilon, method=method, regularization=lam,
                                          data_norm=norm).coefficients, Xt, labels_t, range(10))
                for r in range(repeats)]
        exact = erm.one_vs_rest(jax.random.key(0), X, labels, classes=range(10), epsilon=1e12,
                                method=method, regularization=lam, data_norm=norm).coefficients
        print(f"  {_mark(kappa, method)} κ={kappa:<5g} Λ={lam:.4f}  private {np.mean(accs):.3f} ± "
              f"{np.std(accs):.3f}  non-private {_accuracy(exact, Xt, labels_t, range(10)):.3f}")


def synthetic(repeats: int, epsilons=(1.0,)):
  for n, d in ((1000, 10), (10000, 10), (2000, 50), (10000, 50)):
    X, y, Xt, yt = synthetic_data(n, d)
    for epsilon in epsilons:
      for method in erm.METHODS:
        print(f"synthetic n={n}, d={d}, ε={epsilon:g}, {method}:")
        for kappa, lam, mean, std, exact in sweep_binary(X, y, Xt, yt, epsilon=epsilon,
                                                         method=method, repeats=repeats,
                                                         data_norm=1.0):
          print(f"  {_mark(kappa, method)} κ={kappa:<5g} Λ={lam:.4f}  private {mean:.3f} ± "
                f"{std:.3f}  non-private {exact:.3f}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--dataset", choices=("digits", "synthetic", "both"), default="both")
  parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 10.0])
  parser.add_argument("--uncentred", action="store_true", help="digits scaled by x/128")
  parser.add_argument("--quick", action="store_true", help="one repeat, ε = 1 only")
  args = parser.parse_args(argv)
  if args.quick:
    args.repeats, args.epsilons = 1, args.epsilons[:1]
  start = time.perf_counter()
  if args.dataset in ("digits", "both"):
    digits(args.repeats, args.epsilons, centred=not args.uncentred)
  if args.dataset in ("synthetic", "both"):
    synthetic(args.repeats, args.epsilons)
  print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
  main()
