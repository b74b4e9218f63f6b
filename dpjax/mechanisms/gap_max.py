"""Thresholded GAP-MAX ([BDRS18]; [SS21] Lemma A.16; ALGORITHMS.md §1.6)."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import _validation as v
from dpjax.mechanisms import discrete, exact
from dpjax.mechanisms.truncated_laplace import _truncated_laplace, truncated_laplace_params


class GapMaxResult(NamedTuple):
  """Outcome of :func:`gap_max` (a pytree).

  Attributes:
    ok: bool scalar; False is the papers' ⊥.
    index: int32 scalar, the chosen candidate; the placeholder 0 (no information) when not ok.
  """
  ok: jax.Array
  index: jax.Array


def gap_max_threshold(epsilon: float, delta: float) -> float:
  """The threshold ``A − 1`` that the noisy gap of float scores must exceed (host, float64).

  ``A = (2/ε) ln(1 + (e^ε − 1)/(2δ))`` is the bound of ``TLap(2, ε, δ)``
  (:func:`dpjax.mechanisms.truncated_laplace_params`).

  Raises:
    ValueError: ε not finite and > 0, δ ∉ (0, 1).

  References:
    ALGORITHMS.md §1.6, §1.3.
  """
  return truncated_laplace_params(2.0, epsilon, delta).bound - 1.0


def integer_gap_max_bound(epsilon: float, delta: float) -> tuple[int, int, int]:
  """``(K, num, den)`` of the discrete truncated Laplace used for integer scores (host).

  Noise ``P(Z = z) ∝ e^{−|z|·den/num}`` on ``{−K, …, K}`` with ``num/den ≥ 2/ε`` (the scale
  rounded up to a multiple of 2^-10) and ``K`` the smallest integer ≥ 2 with
  ``P[Z ≥ K − 1] ≤ δ`` (ALGORITHMS.md §1.4 PROPOSED, with Δ = 2): a shift by ≤ 2 leaves at most
  δ of the mass outside the common support.

  Raises:
    ValueError: ε not finite and > 0 (or below ``2^-14``), δ ∉ (0, 1).
  """
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  if 2.0 / epsilon > discrete.MAX_EXACT_SCALE:
    raise ValueError(f"epsilon must be at least 2/{discrete.MAX_EXACT_SCALE:g} for integer "
                     f"scores, got epsilon={epsilon!r}.")
  num, den = exact.rational_scale(2.0 / epsilon)
  p = math.exp(-den / num)
  K = 2
  while True:
    total = (1 + p) / (1 - p) - 2 * p ** (K + 1) / (1 - p)      # Σ_{|z|≤K} p^|z|
    upper = p ** (K - 1) + p**K                                  # Σ_{z=K−1}^{K} p^z
    if upper / total <= delta:
      return K, num, den
    K += 1


def gap_max(key: jax.Array, scores, *, epsilon: float, delta: float) -> GapMaxResult:
  """Returns the top candidate if its score gap is large, else ⊥ (thresholded GAP-MAX).

  ``s1 = argmax scores`` (lowest index on ties, via ``jax.lax.top_k``), ``u1 = scores[s1]``,
  ``u2`` = second largest score (0 if there is one candidate), ``g = max(0, u1 − u2 − 1)``;
  float scores: release ``s1`` iff ``g + Z > A − 1`` with ``Z ~ TLap(2, ε, δ)``
  (:func:`gap_max_threshold`).

  Integer scores (counts; ALGORITHMS.md §1.10 rule 1) use integer noise sampled exactly instead:
  ``Z`` discrete truncated Laplace on ``{−K, …, K}`` (:func:`integer_gap_max_bound`) and release
  iff ``g + Z ≥ K``.

  Guarantee: (ε, δ)-DP under the caller's neighbouring relation when every candidate's score has
  sensitivity 1 under it and candidates not listed score 0. The candidate list must be in a
  data-independent canonical order (the order sets the tie-break). Why: if the argmax is the
  same on both neighbours, ``g`` has sensitivity 2 and the release is post-processing of
  ``g + TLap(2, ε, δ)``. If it differs, ``G + G' ≤ 2`` forces both gaps ``g ≤ 1``, so either
  answer appears with probability ``≤ P[Z > A − 2] = δ`` (integer case: ``P[Z ≥ K − 1] ≤ δ``)
  and with probability 0 on the other neighbour (ALGORITHMS.md §1.6).

  Args:
    key: JAX PRNG key.
    scores: ``(C,)`` finite float or integer scores, C ≥ 1.
    epsilon: ``ε > 0``.
    delta: ``δ ∈ (0, 1)``.

  Returns:
    :class:`GapMaxResult` ``(ok, index)``: ``ok`` a bool scalar (False is ⊥), ``index`` an int32
    scalar, 0 when not ok. With probability 1 it is ``(True, s1)`` when ``g > 2A − 1``
    (integer scores: ``g ≥ 2K``).

  Raises:
    TypeError: ``scores`` not real/integer (bool included), ``key`` not a key.
    ValueError: ``scores`` not of shape (C,) with C ≥ 1, NaN/inf scores, integer scores outside
      [-2^29, 2^29], bad ε or δ.

  References:
    ALGORITHMS.md §1.6; Bun, Dwork, Rothblum & Steinke, "Composable and versatile privacy via
    truncated CDP", STOC 2018; [SS21] Lemma A.16.
  """
  v.check_key(key)
  scores = v.check_scores(scores)           # NumPy input stays NumPy: int64 range check
  if np.issubdtype(scores.dtype, np.integer):
    low, high = int(scores.min()), int(scores.max())
    if low < -(2**29) or high > 2**29:
      raise ValueError(f"integer scores must lie in [-2^29, 2^29], got values in "
                       f"[{low}, {high}].")
    scores = jnp.asarray(scores.astype(np.int32) if isinstance(scores, np.ndarray)
                         else scores.astype(jnp.int32))
    bound, num, den = integer_gap_max_bound(epsilon, delta)
    return _integer_gap_max(key, scores, num, den, bound)
  scores = jnp.asarray(scores)
  if not bool(jnp.all(jnp.isfinite(scores))):
    raise ValueError("scores contain NaN or infinite entries.")
  params = truncated_laplace_params(2.0, epsilon, delta)
  return _gap_max(key, scores, params.scale, params.bound)


@functools.partial(jax.jit, static_argnames=("num", "den", "bound"))
def _integer_gap_max(key, scores, num, den, bound):
  if scores.shape[0] == 1:
    u1, u2, s1 = scores[0], jnp.int32(0), jnp.int32(0)
  else:
    top, idx = jax.lax.top_k(scores, 2)
    u1, u2, s1 = top[0], top[1], idx[0].astype(jnp.int32)
  gap = jnp.maximum(0, u1 - u2 - 1)
  noise = exact.exact_truncated_discrete_laplace(key, (), num, den, bound)
  ok = gap + noise >= bound
  return GapMaxResult(ok, jnp.where(ok, s1, 0))


@jax.jit
def _gap_max(key, scores, scale, bound):
  dtype = jnp.result_type(float)
  scores = scores.astype(dtype)
  if scores.shape[0] == 1:
    u1, u2, s1 = scores[0], jnp.zeros((), dtype), jnp.zeros((), jnp.int32)
  else:
    top, idx = jax.lax.top_k(scores, 2)      # lowest index first among equal values
    u1, u2, s1 = top[0], top[1], idx[0].astype(jnp.int32)
  gap = jnp.maximum(0.0, u1 - u2 - 1.0)
  noise = _truncated_laplace(key, (), scale, bound, dtype)
  ok = gap + noise > bound - 1.0
  return GapMaxResult(ok, jnp.where(ok, s1, 0))
