"""Thresholded GAP-MAX ([BDRS18]; [SS21] Lemma A.16; docs/algorithms.md §1.6)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import _validation as v
from dpjax.mechanisms import discrete, exact
from dpjax.mechanisms.truncated_laplace import discrete_truncated_laplace_bound

__all__ = ["GapMaxParameters", "GapMaxResult", "gap_max", "gap_max_core", "gap_max_parameters"]

_FLOAT_RESOLUTION_BITS = 10      # float scores are floored to multiples of 2^-10 (or coarser)


class GapMaxResult(NamedTuple):
  """Outcome of :func:`gap_max` (a pytree).

  Attributes:
    ok: bool scalar; False is the papers' ⊥.
    index: int32 scalar, the chosen candidate; the placeholder 0 (no information) when not ok.
  """
  ok: jax.Array
  index: jax.Array


class GapMaxParameters(NamedTuple):
  """The public constants of one :func:`gap_max` call (host; all exact).

  Scores are compared on the integer grid ``⌊score/h⌋``: integer scores use ``h = 1``; float
  scores ``h = 2^-j``, the finest power of two (at most 2^-10) for which the exact sampler's
  scale stays in range. A float score of sensitivity 1 then has integer sensitivity ``S = 1/h``
  (``⌊a⌋ − ⌊b⌋ ≤ S`` whenever ``a − b ≤ S`` for an integer S).

  Attributes:
    resolution: h.
    sensitivity: S = 1/h, the per-candidate sensitivity on the grid.
    bound: K, the noise's support bound and the release threshold.
    scale_num, scale_den: the noise scale ``num/den ≥ 2S/ε`` (a multiple of 2^-10).
    sure_gap: a score gap ``u1 − u2 ≥ sure_gap`` (score units) releases the top candidate surely.
  """
  resolution: float
  sensitivity: int
  bound: int
  scale_num: int
  scale_den: int
  sure_gap: float


def integer_gap_max_bound(epsilon: float, delta: float,
                          sensitivity: int = 1) -> tuple[int, int, int]:
  """``(K, num, den)`` of the discrete truncated Laplace used on integer scores (host).

  Noise ``P(Z = z) ∝ e^{−|z|·den/num}`` on ``{−K, …, K}`` with ``num/den ≥ 2S/ε`` (the scale
  rounded up to a multiple of 2^-10) and ``K`` the smallest integer ≥ 1 with
  ``P[Z ≥ K − 2S + 1] ≤ δ``: a shift of the gap by ≤ 2S leaves at most δ of the mass outside the
  common support (docs/algorithms.md §1.4 PROPOSED, here with per-score sensitivity S; S = 1 gives
  ``P[Z ≥ K − 1] ≤ δ``).

  Raises:
    ValueError: ε not finite and > 0 (or with ``2S/ε > 2^15``), δ ∉ (0, 1), S < 1.

  References:
    Bun, Dwork, Rothblum & Steinke, "Composable and versatile privacy via truncated CDP",
    STOC 2018 (GAP-MAX); Singhal & Steinke, "Privately Learning Subspaces", NeurIPS 2021,
    Lemma A.16; Geng, Ding, Guo & Kumar, AISTATS 2020 (truncated Laplace); docs/algorithms.md
    §1.4, §1.6.
  """
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  sensitivity = v.check_int(sensitivity, "sensitivity", low=1)
  if 2.0 * sensitivity / epsilon > discrete.MAX_EXACT_SCALE:
    raise ValueError(f"epsilon must be at least {2 * sensitivity}/{discrete.MAX_EXACT_SCALE:g} "
                     f"for the exact GAP-MAX noise, got epsilon={epsilon!r}.")
  num, den = exact.rational_scale(2.0 * sensitivity / epsilon)
  K = discrete_truncated_laplace_bound(Fraction(num, den), 2 * sensitivity, delta)
  return K, num, den


def gap_max_parameters(epsilon: float, delta: float, *,
                       integer_scores: bool = False) -> GapMaxParameters:
  """The grid, sensitivity and noise of :func:`gap_max` for ``(ε, δ)`` (see
  :class:`GapMaxParameters`).

  Raises:
    ValueError: bad ε or δ, or ε below ``2^-14`` (the exact sampler's range).
  """
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  if integer_scores:
    j = 0
  else:                                          # finest h = 2^-j with 2·2^j/ε ≤ 2^14
    j = min(_FLOAT_RESOLUTION_BITS, math.floor(math.log2(epsilon * 2.0**13)))
    if j < 0:
      raise ValueError(f"epsilon must be at least 2^-13 for GAP-MAX on float scores, got "
                       f"epsilon={epsilon!r}.")
  h = 2.0 ** -j
  S = 2**j
  K, num, den = integer_gap_max_bound(epsilon, delta, S)
  return GapMaxParameters(h, S, K, num, den, (2 * K + S + 1) * h)


def gap_max(key: jax.Array, scores, *, epsilon: float, delta: float) -> GapMaxResult:
  """Returns the top candidate if its score gap is large, else ⊥ (thresholded GAP-MAX).

  Usage::

      result = dpjax.mechanisms.gap_max(key, jnp.array([120, 3, 7]), epsilon=1.0, delta=1e-6)
      if result.ok:                                    # ⊥ when the winner is not clear
        best = int(result.index)                       # surely 0: gap 113 ≥ sure_gap 56

  ``s1 = argmax scores`` (lowest index on ties, via ``jax.lax.top_k``), ``u1 = scores[s1]``,
  ``u2`` = second largest score (0 if there is one candidate). Scores are floored to a public
  integer grid (:func:`gap_max_parameters`: ``ũ = ⌊u/h⌋``, h = 1 for integer scores, ``h = 2^-j``
  (j ≤ 10) for float scores), then ``g = max(0, ũ1 − ũ2 − S)`` with ``S = 1/h`` and the top
  candidate is released iff ``g + Z ≥ K``, ``Z`` discrete truncated Laplace on ``{−K, …, K}``
  of scale ``≥ 2S/ε`` sampled exactly with integer arithmetic (:func:`integer_gap_max_bound`).

  Guarantee: (ε, δ)-DP under the caller's neighboring relation when every candidate's score has
  sensitivity 1 under it and candidates not listed score 0. The candidate list must be in a
  data-independent canonical order (the order sets the tie-break). Why: the floored gap has
  sensitivity 2S when the argmax is the same on both neighbours, and when it differs each answer
  has probability ≤ δ on one side and 0 on the other (proof: docs/algorithms.md §1.6). The
  decision depends on integers only, so it is float-safe (§1.10). Float scores are floored to
  multiples of h (a loss of < h per score, ≤ 2^-10 for ε ≥ 1/8) and clamped to
  ``[−2^29 h, 2^29 h]`` (1-Lipschitz, so the sensitivity is kept; scores beyond that tie and
  give ⊥).

  Args:
    key: JAX PRNG key.
    scores: ``(C,)`` float or integer scores, C ≥ 1. Integer scores are clamped to
      ``[−2^29, 2^29]`` and NaN/inf float scores replaced by 0 (fixed maps, 1-Lipschitz where
      it matters; raising would branch on private data).
    epsilon: ``ε > 0`` (≥ 2^-13 for float scores, ≥ 2^-14 for integer scores).
    delta: ``δ ∈ (0, 1)``.

  Returns:
    :class:`GapMaxResult` ``(ok, index)``: ``ok`` a bool scalar (False is ⊥), ``index`` an int32
    scalar, 0 when not ok. With probability 1 it is ``(True, s1)`` when
    ``u1 − u2 ≥ gap_max_parameters(...).sure_gap``. Traceable in ``key`` and ``scores``.

  Raises:
    TypeError: ``scores`` not real/integer (bool included), ``key`` not a key.
    ValueError: ``scores`` not of shape (C,) with C ≥ 1, bad ε or δ.

  References:
    Bun, Dwork, Rothblum & Steinke, "Composable and versatile privacy via truncated CDP",
    STOC 2018; [SS21] Lemma A.16; Canonne, Kamath & Steinke (2020) (exact integer noise); proof
    in docs/algorithms.md §1.6.
  """
  v.check_key(key)
  scores = v.check_scores(scores)           # NumPy input stays NumPy: int64 clamped exactly
  if np.issubdtype(scores.dtype, np.integer):
    lib = np if isinstance(scores, np.ndarray) else jnp
    scores = jnp.asarray(lib.clip(scores, -(2**29), 2**29).astype(lib.int32))
    return gap_max_core(key, scores, gap_max_parameters(epsilon, delta, integer_scores=True))
  return gap_max_core(key, jnp.asarray(scores), gap_max_parameters(epsilon, delta))


def gap_max_core(key: jax.Array, scores: jax.Array, params: GapMaxParameters) -> GapMaxResult:
  """:func:`gap_max` without validation: traceable in ``key`` and ``scores`` (float or int32).

  Same guarantee, for ``params = gap_max_parameters(ε, δ, integer_scores=...)`` matching the
  scores' kind.
  """
  if jnp.issubdtype(scores.dtype, jnp.floating):
    scores = v.sanitise_value(scores)                                         # NaN/inf -> 0
    grid = jnp.floor(scores / jnp.asarray(params.resolution, scores.dtype))   # exact: h = 2^-j
    scores = jnp.clip(grid, -(2.0**29), 2.0**29).astype(jnp.int32)
  return _integer_gap_max(key, scores.astype(jnp.int32), jnp.uint32(params.scale_num),
                          jnp.uint32(params.scale_den), jnp.int32(params.bound),
                          jnp.int32(params.sensitivity))


@jax.jit
def _integer_gap_max(key, scores, num, den, bound, sensitivity):
  """Jitted core; the public constants are traced scalars (one compilation for every ε, δ)."""
  if scores.shape[0] == 1:
    u1, u2, s1 = scores[0], jnp.int32(0), jnp.int32(0)
  else:
    top, idx = jax.lax.top_k(scores, 2)      # lowest index first among equal values
    u1, u2, s1 = top[0], top[1], idx[0].astype(jnp.int32)
  gap = jnp.maximum(0, u1 - u2 - sensitivity)
  noise = exact.exact_truncated_discrete_laplace(key, (), num, den, bound)
  ok = gap + noise >= bound
  return GapMaxResult(ok, jnp.where(ok, s1, 0))
