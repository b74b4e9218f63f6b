"""The public rounding grid of dpjax's float-safe releases (docs/algorithms.md §1.10).

A real statistic ``f`` is clamped to a public ``[−B, B]``, divided by a public power-of-two step
Λ (exact in floating point) and rounded to the nearest integer; exact integer noise is added and
the result scaled back by Λ. Every output is then a multiple of Λ whatever ``f``, so the
floating-point attack on real-valued noise (Mironov 2012) finds nothing. Rounding each of the p
coordinates moves it by at most half a step, so the statistic's sensitivity in grid steps grows
from ``Δ/Λ`` to at most ``Δ/Λ + √p`` (ℓ2) or ``Δ/Λ + p`` (ℓ1); Λ is chosen so that this costs at
most a factor ``1 + 2^-10``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from dpjax import _validation as v

__all__ = ["Discretization", "discretization"]

_GRID_RESOLUTION = 2.0**10     # rounding adds ≤ 2^-10 of the sensitivity
_MAX_GRID_INDEX = 2.0**50      # |f|/Λ ≤ 2^50 and the noise ≪ 2^52: every output exact in float64


class Discretization(NamedTuple):
  """The public grid of :func:`discretized_gaussian_mechanism` for one ``(Δ, size, bound)``.

  Attributes:
    grid: Λ, a power of two ``≤ Δ/(2^10 √p)``; every output is a multiple of Λ.
    grid_sensitivity: ``Δ_Λ``, the sensitivity of the rounded statistic in grid steps: rounding
      each of the p coordinates to the nearest step moves it by ≤ ½ step, so two rounded
      neighbours differ by at most ``Δ/Λ + √p`` steps in ℓ2 (``Δ/Λ + p`` in ℓ1); at most
      ``(1 + 2^-10) Δ/Λ``.
    bound: B, the public clamp: values are clamped to ``[−B, B]`` before rounding.
  """
  grid: float
  grid_sensitivity: float
  bound: float

  def round(self, value) -> np.ndarray:
    """``round(clamp(value, −B, B)/Λ)`` as int64, flattened (exact: Λ is a power of two)."""
    flat = np.clip(np.asarray(value, np.float64).reshape(-1), -self.bound, self.bound)
    return np.round(flat / self.grid).astype(np.int64)

  def release(self, index, shape) -> np.ndarray:
    """``Λ·index`` as float64 of ``shape`` (exact for ``|index| < 2^53``)."""
    total = np.clip(np.asarray(index, np.int64), -(2**53 - 1), 2**53 - 1)
    return (total.astype(np.float64) * self.grid).reshape(shape)


def discretization(sensitivity: float, size: int, bound: float | None = None, *,
                   norm: int = 2) -> Discretization:
  """The public grid Λ, the grid sensitivity and the clamp B of a float-safe release.

  ``Λ = 2^⌊log2(Δ/(2^10 r))⌋`` with ``r = √p`` (ℓ2) or ``p`` (ℓ1), and
  ``Δ_Λ = Δ/Λ + r ≤ (1 + 2^-10)·Δ/Λ``.

  Args:
    sensitivity: ``Δ > 0``, the statistic's ℓ2- (``norm=2``) or ℓ1-sensitivity (``norm=1``).
    size: number of coordinates ``p ≥ 1``.
    bound: public clamp ``B`` with ``Λ ≤ B ≤ 2^50 Λ`` (default ``2^50 Λ``, far beyond any
      value whose noise scale is Δ-sized).
    norm: 2 (Gaussian noise) or 1 (Laplace-type noise).

  Raises:
    ValueError: bad Δ, p, B or norm.
  """
  sensitivity = v.check_positive(sensitivity, "sensitivity")
  size = v.check_int(size, "size", low=1)
  v.check_choice(norm, "norm", (1, 2))
  root = float(size) if norm == 1 else math.nextafter(math.sqrt(size), math.inf)
  grid = 2.0 ** math.floor(math.log2(sensitivity / (_GRID_RESOLUTION * root)))
  grid_sensitivity = math.nextafter(sensitivity / grid + root, math.inf)
  if bound is None:
    bound = _MAX_GRID_INDEX * grid
  else:
    bound = v.check_positive(bound, "bound")
    if not grid <= bound <= _MAX_GRID_INDEX * grid:
      raise ValueError(f"bound must lie in [Λ, 2^50 Λ] = [{grid:.6g}, {_MAX_GRID_INDEX * grid:.6g}]"
                       f" for sensitivity {sensitivity:g} and {size} coordinates, got "
                       f"bound={bound!r}.")
  return Discretization(grid, grid_sensitivity, float(bound))


