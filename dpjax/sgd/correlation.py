"""Correlated noise for DP-SGD: banded matrix-factorization strategies (BandMF), driven by
``jax_privacy`` (docs/algorithms.md §6.7).

DP-SGD with matrix-factorization noise releases, over the T steps, ``Y = S + C⁻¹ Z`` instead of
``S + Z``: the per-step sums S (in the release map's coordinates) plus noise correlated across
steps by the inverse of a strategy matrix C, so that much of it cancels in the running sums the
model follows. Privacy is that of ``C Y = C S + Z``, the Gaussian mechanism on ``C S``. With a
lower-triangular b-banded Toeplitz C whose columns have norm 1, and cyclic Poisson sampling of
cycle ``b`` (an example may take part only in steps b apart, so its contributions never share a
band), Choquette-Choo et al. (2023, Thm 4) show the run is ``⌈T/b⌉`` compositions of the
Poisson-sampled Gaussian mechanism at the group rate — the event
:class:`dpjax.sgd.sampling.CyclicPoissonSampling` states.

dpjax does not re-implement the strategies: a :class:`BandedToeplitz` holds the coefficients and
builds ``jax_privacy.matrix_factorization.toeplitz.inverse_as_streaming_matrix`` (with its
column normalisation for T steps), which :func:`dpjax.sgd.dp_noise` drives on the released
coordinates of every release map — p of them for the full release, k for a flat basis, the
coefficients of per-layer bases, GEP's embedding and residual — so in a learned subspace the
buffers hold ``(b−1)·k`` numbers instead of ``(b−1)·p``. Keys, steps and the event stay the
plan's: jax_privacy's ``matrix_factorization_privatizer`` (which may draw its own key) is not
used.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from dpjax import _validation as v

__all__ = ["BandedToeplitz", "banded_toeplitz", "optimal_banded_toeplitz"]


def _toeplitz():
  try:
    from jax_privacy.matrix_factorization import toeplitz
  except ImportError as err:       # an optional dependency: say how to get it
    raise ImportError("correlated noise drives jax_privacy's matrix factorization: "
                      "pip install 'dpjax[interop]' (jax-privacy >= 2.0).") from err
  return toeplitz


@dataclasses.dataclass(frozen=True)
class BandedToeplitz:
  """A b-banded lower-triangular Toeplitz strategy C (BandMF), its columns normalised to norm 1.

  Usage::

      strategy = dpjax.sgd.optimal_banded_toeplitz(steps=T, bands=4)
      plan = dpjax.sgd.dp_sgd_plan(grad_fn, num_examples=N, expected_batch_size=L, steps=T,
                                   epsilon=2.0, key=key, noise_strategy=strategy)

  Attributes:
    coefs: ``(c_0, …, c_{b−1})``, the first column's non-zero part, unit ℓ2 norm, ``c_0 > 0``.
      ``(1.0,)`` is C = I: independent noise.
  """
  coefs: tuple[float, ...]

  def __post_init__(self):
    c = np.asarray(self.coefs, np.float64).reshape(-1)
    if c.size == 0 or not np.all(np.isfinite(c)) or c[0] <= 0:
      raise ValueError(f"coefs must be finite with coefs[0] > 0 (C must be invertible), got "
                       f"{list(c)}.")
    object.__setattr__(self, "coefs", tuple(float(x) for x in c))

  @property
  def bands(self) -> int:
    """b, the number of non-zero diagonals of C."""
    return len(self.coefs)

  def noising_matrix(self, steps: int):
    """``C⁻¹`` for T steps as ``jax_privacy``'s ``StreamingMatrix`` (column-normalised C:
    every column has norm exactly 1, so the sensitivity is the clip bound's)."""
    return _toeplitz().inverse_as_streaming_matrix(
        jnp.asarray(self.coefs, jnp.float32), column_normalize_for_n=steps)

  def materialize(self, steps: int) -> np.ndarray:
    """The ``(T, T)`` float64 strategy C with columns of norm 1 (host; for tests and audits)."""
    T = v.check_int(steps, "steps", low=1)
    c = np.zeros(T)
    c[:min(T, self.bands)] = self.coefs[:T]
    C = np.zeros((T, T))
    for j in range(T):
      C[j:, j] = c[:T - j]
    return C / np.linalg.norm(C, axis=0)


def banded_toeplitz(coefs) -> BandedToeplitz:
  """A :class:`BandedToeplitz` from its first column ``(c_0, …, c_{b−1})``, scaled to unit norm.

  Raises:
    ValueError: no coefficients, a non-finite one, or ``c_0 ≤ 0`` (C must be invertible).
  """
  c = np.asarray(BandedToeplitz(tuple(np.asarray(coefs, np.float64).reshape(-1))).coefs)
  return BandedToeplitz(tuple(c / np.linalg.norm(c)))


def optimal_banded_toeplitz(steps: int, bands: int, *,
                            max_optimizer_steps: int = 250) -> BandedToeplitz:
  """The b-banded Toeplitz strategy of least mean squared error on the prefix sums of T steps
  (``jax_privacy.matrix_factorization.toeplitz.optimize_banded_toeplitz``; L-BFGS, seconds).

  Args:
    steps: T ≥ 1.
    bands: b ≥ 1 (1: independent noise); use it as the cyclic sampling's cycle length.
    max_optimizer_steps: L-BFGS iterations.

  Raises:
    ValueError / TypeError: T, b or the iteration count not a positive integer.
    ImportError: ``jax_privacy`` is not installed.

  References:
    Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu, "(Amplified) Banded Matrix
    Factorization: A unified approach to private training", NeurIPS 2023.
  """
  T = v.check_int(steps, "steps", low=1)
  b = v.check_int(bands, "bands", low=1)
  iterations = v.check_int(max_optimizer_steps, "max_optimizer_steps", low=1)
  if b == 1:
    return BandedToeplitz((1.0,))
  coefs = _toeplitz().optimize_banded_toeplitz(T, min(b, T), max_optimizer_steps=iterations)
  coefs = np.asarray(coefs, np.float64)
  if not math.isclose(float(np.linalg.norm(coefs)), 1.0, rel_tol=1e-4) or coefs[0] <= 0:
    raise ValueError(f"jax_privacy's optimiser returned unusable coefficients {coefs}.")
  return banded_toeplitz(coefs)
