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
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import _validation as v

__all__ = ["BandedToeplitz", "BufferedToeplitz", "banded_toeplitz", "buffered_toeplitz",
           "lambda_cgd", "optimal_banded_toeplitz", "optimal_buffered_toeplitz"]


def _factorization(module: str = "toeplitz"):
  try:
    from jax_privacy.matrix_factorization import buffered_toeplitz, toeplitz
  except ImportError as err:       # an optional dependency: say how to get it
    raise ImportError("correlated noise drives jax_privacy's matrix factorization: "
                      "pip install 'dpjax[interop]' (jax-privacy >= 2.0).") from err
  return {"toeplitz": toeplitz, "buffered_toeplitz": buffered_toeplitz}[module]


def _toeplitz():
  return _factorization("toeplitz")


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

  @property
  def min_separation(self) -> int:
    """The least cycle length of the sampling: b (an example's steps never share a band)."""
    return self.bands

  amplified = True   # its event: ⌈T/b⌉ Poisson-sampled rounds (the amplified BandMF theorem)

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


class _Scaled(NamedTuple):
  """``scale · M`` for a jax_privacy ``StreamingMatrix`` M (its two streaming methods)."""
  matrix: Any
  scale: float

  def init_multiply(self, like):
    return self.matrix.init_multiply(like)

  def multiply_next(self, x, state):
    y, state = self.matrix.multiply_next(x, state)
    return y * jnp.asarray(self.scale, y.dtype), state


@dataclasses.dataclass(frozen=True)
class BufferedToeplitz:
  """A buffered-linear-Toeplitz strategy C (BLT; Dvijotham et al. 2024, McMahan et al. 2024),
  scaled so that its min-separation sensitivity is 1, for multi-epoch matrix factorization
  WITHOUT amplification.

  C is lower-triangular Toeplitz with ``c_0 = 1`` and ``c_j = Σ_i ω_i θ_i^{j−1}`` (``θ`` the
  buffer decays, ``ω`` the output scales): its noise ``C⁻¹Z`` streams with one buffer per
  ``θ_i`` (a handful), whatever T. An example may take part in steps at least ``min_sep`` apart
  (cyclic sampling of cycle ≥ ``min_sep``), so at most ``k = ⌈T/min_sep⌉`` times; with
  non-negative, non-increasing coefficients the worst case is k steps exactly ``min_sep``
  apart (jax_privacy's ``toeplitz.minsep_sensitivity_squared``; Kalinin & Lampert 2024, Thm 2),
  and :meth:`sensitivity` is that bound. The noise is ``s·C⁻¹Z`` — the mechanism of
  ``C/s``, whose sensitivity is 1 — so the whole run is ONE Gaussian mechanism at the plan's σ
  (no amplification is claimed; sampling within a group only helps). docs/algorithms.md §6.7.

  Usage::

      strategy = dpjax.sgd.optimal_buffered_toeplitz(steps=T, min_sep=N // L)
      plan = dpjax.sgd.dp_sgd_plan(grad_fn, num_examples=N, expected_batch_size=L, steps=T,
                                   epsilon=8.0, key=key, noise_strategy=strategy)

  Attributes:
    buf_decay: ``(θ_1, …, θ_m)``, each in (0, 1).
    output_scale: ``(ω_1, …, ω_m)``, with C's coefficients non-negative and non-increasing.
    min_sep: the least separation of an example's steps (the sampling's cycle length).
  """
  buf_decay: tuple[float, ...]
  output_scale: tuple[float, ...]
  min_sep: int

  def __post_init__(self):
    theta = np.asarray(self.buf_decay, np.float64).reshape(-1)
    omega = np.asarray(self.output_scale, np.float64).reshape(-1)
    if theta.shape != omega.shape or not np.all(np.isfinite(np.concatenate([theta, omega]))):
      raise ValueError("buf_decay and output_scale must be finite and of one length, got "
                       f"{list(theta)} and {list(omega)}.")
    if np.any((theta <= 0) | (theta >= 1)):
      raise ValueError(f"every buf_decay must lie in (0, 1), got {list(theta)}.")
    object.__setattr__(self, "buf_decay", tuple(float(x) for x in theta))
    object.__setattr__(self, "output_scale", tuple(float(x) for x in omega))
    object.__setattr__(self, "min_sep", v.check_int(self.min_sep, "min_sep", low=1))

  @property
  def min_separation(self) -> int:
    """The least cycle length of the sampling: ``min_sep``."""
    return self.min_sep

  amplified = False  # its event: one Gaussian mechanism for the whole run

  def coefficients(self, steps: int) -> np.ndarray:
    """``(c_0, …, c_{T−1})`` of C (float64, host)."""
    T = v.check_int(steps, "steps", low=1)
    j = np.arange(T - 1, dtype=np.float64)
    tail = (np.asarray(self.output_scale)[:, None]
            * np.asarray(self.buf_decay)[:, None] ** j[None, :]).sum(0)
    return np.concatenate([[1.0], tail])

  def sensitivity(self, steps: int) -> float:
    """s: the ℓ2 norm of the largest sum of ``k = ⌈T/min_sep⌉`` columns of C at least
    ``min_sep`` apart (jax_privacy's min-sep bound, in float64, rounded up by 10⁻⁹; computed
    once per T, on the host).

    Raises:
      ValueError: coefficients that are negative or increasing (the bound needs both).
    """
    return _blt_sensitivity(self, v.check_int(steps, "steps", low=1))

  def noising_matrix(self, steps: int):
    """``s·C⁻¹`` for T steps, streamed (jax_privacy's BLT inverse in float32, one buffer per
    decay), so the released ``C/s · Y`` has sensitivity 1."""
    blt = _factorization("buffered_toeplitz").BufferedToeplitz(
        buf_decay=np.asarray(self.buf_decay, np.float32),
        output_scale=np.asarray(self.output_scale, np.float32))
    return _Scaled(blt.inverse_as_streaming_matrix(), self.sensitivity(steps))

  def materialize(self, steps: int) -> np.ndarray:
    """The ``(T, T)`` float64 strategy ``C/s`` (host; for tests and audits)."""
    T = v.check_int(steps, "steps", low=1)
    c = self.coefficients(T)
    C = np.zeros((T, T))
    for j in range(T):
      C[j:, j] = c[:T - j]
    return C / self.sensitivity(T)


@functools.lru_cache(maxsize=64)
def _blt_sensitivity(strategy: BufferedToeplitz, steps: int) -> float:
  with jax.ensure_compile_time_eval(), jax.enable_x64(True):
    squared = _toeplitz().minsep_sensitivity_squared(
        np.asarray(strategy.coefficients(steps), np.float64), min_sep=strategy.min_sep,
        max_participations=None, n=steps, skip_checks=False)
    squared = float(squared)
  return math.sqrt(squared) * (1 + 1e-9)


def buffered_toeplitz(buf_decay, output_scale, min_sep: int) -> BufferedToeplitz:
  """A validated :class:`BufferedToeplitz` (its min-sep bound is checked now for 1,000 steps).

  Raises:
    ValueError: decays outside (0, 1), lengths that differ, or coefficients that are negative
      or increasing.
  """
  strategy = BufferedToeplitz(tuple(np.asarray(buf_decay, np.float64).reshape(-1)),
                              tuple(np.asarray(output_scale, np.float64).reshape(-1)), min_sep)
  strategy.sensitivity(1_000)
  return strategy


def lambda_cgd(lam: float, min_sep: int) -> BufferedToeplitz:
  """DP-λCGD's noise: each step's noise correlated with the previous step's only,
  ``w_t = s(z_t − λ z_{t−1})`` — the one-buffer BLT with ``θ = ω = λ`` (``C⁻¹ = I − λ·shift``,
  ``c_j = λ^j``), normalised to min-sep sensitivity 1 and accounted as every BLT (one Gaussian
  for the run, no amplification; docs/algorithms.md §6.7). It keeps one buffer (the previous
  draw); the variant that regenerates ``z_{t−1}`` from its key instead is not built.

  Raises:
    ValueError: λ outside (0, 1); min_sep not a positive integer.

  References:
    Kalinin et al. 2026, DP-λCGD (as cited in issue 52): noise correlated with the previous
    step only. The accounting here is dpjax's min-sep argument, not the paper's.
  """
  lam = float(lam)
  if not 0.0 < lam < 1.0:
    raise ValueError(f"lam must lie in (0, 1), got {lam}.")
  return buffered_toeplitz([lam], [lam], min_sep)


def optimal_buffered_toeplitz(steps: int, min_sep: int, *,
                              max_buffers: int = 6) -> BufferedToeplitz:
  """The BLT strategy of least maximum squared error on the prefix sums of T steps under
  min-sep participation (``jax_privacy.matrix_factorization.buffered_toeplitz.optimize`` with
  ``min_sep`` and ``⌈T/min_sep⌉`` participations; seconds to a minute on a CPU).

  Args:
    steps: T ≥ 1.
    min_sep: b ≥ 1, the sampling's cycle length (e.g. the number of batches in an epoch).
    max_buffers: the most buffers the optimiser tries (jax_privacy allows ≤ 15).

  Raises:
    ValueError / TypeError: T, b or ``max_buffers`` not a positive integer; an optimised
      strategy that fails :func:`buffered_toeplitz`'s checks.
    ImportError: ``jax_privacy`` is not installed.

  References:
    McMahan, Xu & Zhang, "A Hassle-free Algorithm for Private Learning in Practice: Don't Use
    Tree Aggregation, Use BLTs", 2024 (arXiv 2408.08868); Dvijotham, McMahan, Pillutla, Steinke
    & Thakurta, "Efficient and Near-Optimal Noise Generation for Streaming Differential
    Privacy", FOCS 2024.
  """
  T = v.check_int(steps, "steps", low=1)
  b = v.check_int(min_sep, "min_sep", low=1)
  nbuf = v.check_int(max_buffers, "max_buffers", low=1, high=15)
  with jax.enable_x64(True):
    blt = _factorization("buffered_toeplitz").optimize(n=T, min_sep=b, max_participations=None,
                                                       max_buffers=nbuf)
    theta, omega = np.asarray(blt.buf_decay), np.asarray(blt.output_scale)
  return buffered_toeplitz(theta, omega, b)
