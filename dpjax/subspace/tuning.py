"""Simulation-based tuning of DPASE's public parameters on public model data (docs/algorithms.md §2.2).

Nothing here touches private data: the tuner generates data from the paper's model at the user's
public configuration, so its choice costs no privacy budget.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import numpy as np

from dpjax import _validation as v
from dpjax import data, metrics
from dpjax.subspace.approximate import dpase, dpase_parameters

__all__ = ["CellLengthCalibration", "calibrate_cell_length"]


class CellLengthCalibration(NamedTuple):
  """Result of :func:`calibrate_cell_length`: the chosen ``ℓ`` and the simulated success rates."""
  cell_length: float
  grid: np.ndarray
  success_rate: np.ndarray
  bottom_rate: np.ndarray


def calibrate_cell_length(key: jax.Array, *, n: int, d: int, k: int, gamma: float,
                          epsilon: float, delta: float, alpha: float = 0.1,
                          grid: np.ndarray | None = None, trials: int = 10,
                          dtype=None, **dpase_kwargs) -> CellLengthCalibration:
  """Chooses DPASE's cell length ``ℓ`` by simulation on public model data (docs/algorithms.md §2.2).

  Generates ``trials`` datasets from the paper's model with the user's *public* configuration
  ``(n, d, k, γ)`` (:func:`dpjax.data.approximate_subspace_data`), runs DPASE with every ``ℓ`` in
  ``grid`` (default: the ``"paper_proof"`` value times ``2^j``, ``j = −6..4``) and returns the ``ℓ``
  with the highest empirical ``P[‖Π̂ − Π‖ ≤ α]`` (the smallest such ℓ on ties). No private data is
  touched, so the calibration costs no privacy budget.

  Returns:
    :class:`CellLengthCalibration`.

  References:
    Singhal & Steinke, "Privately Learning Subspaces", NeurIPS 2021,
    Algorithm 2 and Lemma D.3 (the cell length ℓ); docs/algorithms.md §2.2.
  """
  key = v.check_key(key)
  alpha = v.check_positive(alpha, "alpha")
  trials = v.check_int(trials, "trials", low=1)
  if grid is None:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      base = dpase_parameters(n, d, k, epsilon=epsilon, delta=delta, gamma=gamma).cell_length
    grid = base * 2.0 ** np.arange(-6, 5)
  grid = np.asarray(grid, dtype=float)
  if grid.ndim != 1 or grid.size == 0 or not np.all(grid > 0):
    raise ValueError("grid must be a non-empty 1-D array of positive cell lengths.")
  hits = np.zeros(grid.size)
  bottoms = np.zeros(grid.size)
  for trial_key in jax.random.split(key, trials):
    k_data, k_run = jax.random.split(trial_key)
    X, model = data.approximate_subspace_data(k_data, n, d, k, gamma=gamma, dtype=dtype)
    for i, ell in enumerate(grid):
      res = dpase(jax.random.fold_in(k_run, i), X, epsilon=epsilon, delta=delta, k=k,
                  cell_length=float(ell), **dpase_kwargs)
      if bool(res.ok):
        hits[i] += float(metrics.projection_distance(res.basis, model.basis)) <= alpha
      else:
        bottoms[i] += 1
  rates = hits / trials
  best = int(np.argmax(rates))
  return CellLengthCalibration(float(grid[best]), grid, rates, bottoms / trials)
