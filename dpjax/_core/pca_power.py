"""Rows a private PCA needs: its typical captured-energy loss, and the underpowered warning.

Shared by Analyze Gauss (:func:`dpjax.subspace.analyze_gauss`), MOD-SuLQ
(:func:`dpjax.classic.mod_sulq`) and PPCA (:func:`dpjax.classic.ppca`); docs/algorithms.md §5.6.
Each learner's ``*_required_n`` helper computes ``L``, the typical energy (sum over rows of
``‖P x_i‖²``, in units of the row-norm bound squared) that its noise costs the released rank-k
projection, and answers ``⌈L / accuracy⌉``: the fewest rows at which that loss is at most
``accuracy`` times ``n``, the largest energy n rows of norm ≤ the bound can have. The learner
warns exactly when n is below its helper's number at accuracy 1/10: the bound is against the
largest energy, and rows inside the ball have less (measured on scikit-learn's breast_cancer
scaled into the unit ball, k = 2: Analyze Gauss lost 68% of the best basis's energy at ε = 3,
where its loss was 0.03·n). Public numbers only.
"""

from __future__ import annotations

import math

from dpjax import _validation as v
from dpjax.results import warn_underpowered

WARNING_ACCURACY = 0.1            # the learners warn when the typical loss exceeds n/10


def gaussian_energy_loss(unit_sigma: float, d: int, k: int) -> float:
  """``2k·2σ√d``: the captured energy lost to a symmetric Gaussian noise matrix E (upper triangle
  i.i.d. N(0, σ²)), by ``tr(P̂A) ≥ tr(PA) − 2k‖E‖₂`` (Weyl; exact for every E) with ``‖E‖₂``
  at its typical size ``2σ√d`` (the semicircle edge)."""
  return 2.0 * k * 2.0 * unit_sigma * math.sqrt(d)


def bingham_energy_loss(epsilon: float, d: int, k: int) -> float:
  """``k(d − k)/ε``: the typical loss of the matrix Bingham draw ``∝ exp((ε/2) tr(VᵀSV))``,
  each of the Grassmannian's k(d − k) directions costing ``1/ε`` at most (its Laplace
  approximation: a Gaussian of variance ``1/(ε gap)`` in each direction)."""
  return k * (d - k) / epsilon


def required_rows(loss: float, accuracy: float) -> int:
  """The fewest n with ``loss ≤ accuracy · n`` (at least 1)."""
  accuracy = v.check_positive(accuracy, "accuracy")
  return max(1, math.ceil(loss / accuracy))


def warn_if_underpowered(learner: str, n: int, loss: float, call: str, settings: str) -> None:
  """Warns (:class:`dpjax.UnderpoweredWarning`) exactly when ``n < required_rows(loss, 1/10)``,
  quoting that number (``call`` is the helper's call with ``{}`` for the accuracy; ``settings``
  the call's public settings, for the message)."""
  need = required_rows(loss, WARNING_ACCURACY)
  if n < need:
    warn_underpowered(
        f"{learner}: at n={n:,} rows ({settings}) its noise typically costs the basis "
        f"{loss / n:.3g}·n of captured energy, in units of the row-norm bound squared (n rows "
        f"have at most n, and rows inside the ball less): the basis may say little. A loss of "
        f"at most n/10 needs n ≥ {need:,} rows ({call.format(WARNING_ACCURACY)}); or raise "
        "epsilon, lower k, or project the rows to fewer public dimensions first. The result is "
        "still private.")
