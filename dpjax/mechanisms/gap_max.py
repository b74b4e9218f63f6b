"""Thresholded GAP-MAX ([BDRS18]; [SS21] Lemma A.16; ALGORITHMS.md §1.6)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dpjax import _validation as v
from dpjax.mechanisms.truncated_laplace import _truncated_laplace, truncated_laplace_params


class GapMaxResult(NamedTuple):
  """``ok`` (bool scalar; False is ⊥) and ``index`` (int32 scalar; 0 placeholder on ⊥)."""
  ok: jax.Array
  index: jax.Array


def gap_max_threshold(epsilon: float, delta: float) -> float:
  """``A − 1`` with ``A`` the bound of ``TLap(2, ε, δ)``: the noisy gap must exceed it."""
  return truncated_laplace_params(2.0, epsilon, delta).bound - 1.0


def gap_max(key: jax.Array, scores, *, epsilon: float, delta: float) -> GapMaxResult:
  """Returns the top candidate if its score gap is large, else ⊥ (thresholded GAP-MAX).

  ``s1 = argmax scores`` (lowest index on ties), ``u2`` = second largest score (0 if there is
  one candidate), ``g = max(0, u1 − u2 − 1)``; release ``s1`` iff ``g + TLap(2, ε, δ) > A − 1``.

  Guarantee: (ε, δ)-DP under the caller's neighbouring relation when every candidate's score has
  sensitivity 1 under it and candidates not listed score 0. If the argmax is the same on both
  neighbours, ``g`` has sensitivity 2 and the release is post-processing of TLap(2, ε, δ). If it
  differs, ``G + G' ≤ 2`` forces both gaps ≤ 1, so either answer appears with probability
  ``≤ P[Z > A − 2] = δ`` (ALGORITHMS.md §1.6). The candidate order must be data-independent (it
  sets the tie-break).

  Args:
    key: PRNG key.
    scores: ``(C,)`` real or integer scores, C ≥ 1.
    epsilon: ε > 0.
    delta: δ ∈ (0, 1).

  Returns:
    :class:`GapMaxResult`. With probability 1 it is ``s1`` when ``g > 2A − 1``.
  """
  v.check_key(key)
  scores = jnp.asarray(scores)
  if scores.ndim != 1 or scores.shape[0] == 0:
    raise ValueError(f"scores must have shape (C,) with C >= 1, got {tuple(scores.shape)}.")
  if not (jnp.issubdtype(scores.dtype, jnp.integer) or jnp.issubdtype(scores.dtype, jnp.floating)):
    raise TypeError(f"scores must be real or integer, got dtype={scores.dtype}.")
  if not bool(jnp.all(jnp.isfinite(scores))):
    raise ValueError("scores contain NaN or infinite entries.")
  params = truncated_laplace_params(2.0, epsilon, delta)
  return _gap_max(key, scores, params.scale, params.bound)


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
