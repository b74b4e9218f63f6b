"""Stability-based histogram over an unbounded domain (ALGORITHMS.md §1.5; [SS21] Lemma A.15).

Only non-empty bins are ever touched, so the domain (e.g. all cells of a grid in Z^D) may be
infinite: each non-empty bin gets one noise draw, and only bins whose noisy count clears a
threshold τ are released. A bin that exists in only one of two neighbouring datasets holds a
single item and clears τ with probability at most δ.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dpjax import _validation as v
from dpjax.mechanisms import discrete

NEIGHBOURING = ("replace_one", "add_remove")
NOISES = ("discrete", "laplace")
GROUPINGS = ("auto", "pairwise", "hash")
_PAIRWISE_LIMIT = 50_000_000          # t·t·D booleans above which "auto" hashes instead


class StableHistogram(NamedTuple):
  """The released part of a stability-based histogram (a pytree; length-t static arrays).

  Rows are ordered: released bins first, by decreasing noisy count, ties broken by fresh
  randomness (never by the position of an item in the input). Rows that are not released hold a
  fixed placeholder (bin 0, count 0) and carry no information; only ``(bins[i], noisy_counts[i])``
  with ``released[i]`` are DP releases.

  Attributes:
    bins: ``(t, D)`` int32 bin keys.
    noisy_counts: ``(t,)`` noisy counts (int32 for discrete noise, float for Laplace).
    released: ``(t,)`` bool.
    threshold: the public release threshold τ (release iff noisy count ≥ τ for discrete noise,
      > τ for Laplace noise).
  """
  bins: jax.Array
  noisy_counts: jax.Array
  released: jax.Array
  threshold: float


def _sensitivity(neighbouring: str) -> float:
  # Replace-one moves one item between two bins (ℓ1 change 2); add/remove changes one bin by 1.
  return 2.0 if neighbouring == "replace_one" else 1.0


def histogram_threshold(epsilon: float, delta: float, *, neighbouring: str = "replace_one",
                        noise: str = "discrete") -> float:
  """The release threshold τ of the stability histogram (host, float64).

  With Δ = 2 (replace-one) or 1 (add/remove-one):

  * Laplace noise ``Lap(Δ/ε)``, release iff ``c + Z > τ``: ``τ = 1 + (Δ/ε) ln(1/(2δ))``, so a
    singleton bin passes with probability ``½ e^{−(τ−1)ε/Δ} = δ``.
  * Discrete Laplace noise ``DLap(Δ/ε)`` (``p = e^{−ε/Δ}``; sampled exactly, at the scale rounded
    up to a multiple of 2^-10, which only lowers the release probability), release iff
    ``c + Z ≥ τ``:
    ``τ = 1 + ⌈(Δ/ε) ln(1/(δ(1 + p)))⌉``, so a singleton passes with probability
    ``p^{τ−1}/(1 + p) ≤ δ``.

  Raises:
    ValueError: ε ≤ 0, δ ∉ (0, 1), or an unknown ``neighbouring`` / ``noise``.
  """
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  v.check_choice(neighbouring, "neighbouring", NEIGHBOURING)
  v.check_choice(noise, "noise", NOISES)
  scale = _sensitivity(neighbouring) / epsilon
  if noise == "laplace":
    return 1.0 + scale * math.log(1.0 / (2.0 * delta))
  p = math.exp(-1.0 / scale)
  return 1.0 + math.ceil(scale * math.log(1.0 / (delta * (1.0 + p))))


def stable_histogram(key: jax.Array, items, *, epsilon: float, delta: float,
                     neighbouring: str = "replace_one", noise: str = "discrete",
                     grouping: str = "auto") -> StableHistogram:
  """Releases the popular bins of ``items`` with the stability-based histogram.

  Guarantee: (ε, δ)-DP under ``neighbouring``: "replace_one" (one item replaced: two bin counts
  change by 1, noise scale 2/ε) or "add_remove" (one item added or removed, scale 1/ε). On bins
  non-empty in both datasets the noisy counts are ε-DP (Laplace / discrete Laplace with
  sensitivity Δ); a bin non-empty in only one holds exactly one item and is released with
  probability ≤ δ (:func:`histogram_threshold`); thresholding and ordering by noisy count are
  post-processing (ALGORITHMS.md §1.5).

  Exactly one noise value is drawn per distinct bin (never per item). Equal rows are grouped under
  ``jit`` with static shapes: ``"pairwise"`` compares all pairs (``t·t·D`` booleans);
  ``"hash"`` compares two random 32-bit linear hashes per row, then verifies each row against its
  group's first row exactly (``O(tD)``; a row whose hash collides with a different row becomes its
  own group, which happens with probability about ``t²·2^{−64}``); ``"auto"`` picks pairwise when
  ``t·t·D ≤ 5·10⁷``.

  Args:
    key: PRNG key.
    items: ``(t, D)`` integer array; row ``i`` is the bin key of item ``i``.
    epsilon: ε > 0.
    delta: δ ∈ (0, 1).
    neighbouring: "replace_one" (default) or "add_remove".
    noise: "discrete" (default: integer noise sampled exactly with integer arithmetic, so the
      release has no floating-point side channel; ALGORITHMS.md §1.10) or "laplace" (float).
    grouping: "auto", "pairwise" or "hash".

  Returns:
    :class:`StableHistogram`.

  Raises:
    TypeError: ``items`` not an integer array, or ``key`` not a key.
    ValueError: ``items`` not 2-D or empty, ε ≤ 0, δ ∉ (0, 1), unknown option.
  """
  v.check_key(key)
  items = jnp.asarray(items)
  if not jnp.issubdtype(items.dtype, jnp.integer):
    raise TypeError(f"items must be an integer array of bin keys, got dtype={items.dtype}.")
  if items.ndim != 2 or items.shape[0] == 0 or items.shape[1] == 0:
    raise ValueError(f"items must have shape (t, D) with t, D >= 1, got {tuple(items.shape)}.")
  v.check_choice(grouping, "grouping", GROUPINGS)
  threshold = histogram_threshold(epsilon, delta, neighbouring=neighbouring, noise=noise)
  scale = _sensitivity(neighbouring) / float(epsilon)
  t, d = items.shape
  if grouping == "auto":
    grouping = "pairwise" if t * t * d <= _PAIRWISE_LIMIT else "hash"
  bins, counts, released = _stable_histogram(key, items.astype(jnp.int32), scale, threshold,
                                             noise, grouping)
  return StableHistogram(bins, counts, released, threshold)


def top_bin(hist: StableHistogram) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(ok, bin (D,), noisy_count)`` of the released bin with the largest noisy count."""
  return hist.released[0], hist.bins[0], hist.noisy_counts[0]


def _group_pairwise(items):
  equal = jnp.all(items[:, None, :] == items[None, :, :], axis=-1)      # (t, t)
  return jnp.argmax(equal, axis=1)                                       # first equal row


def _group_hash(key, items):
  coefficients = jax.random.bits(key, (2, items.shape[1]), jnp.uint32)
  hashes = jnp.sum(items.astype(jnp.uint32)[None] * coefficients[:, None, :], axis=-1,
                   dtype=jnp.uint32)                                     # (2, t), mod 2^32
  equal = jnp.all(hashes[:, :, None] == hashes[:, None, :], axis=0)
  first = jnp.argmax(equal, axis=1)
  verified = jnp.all(items == items[first], axis=1)
  return jnp.where(verified, first, jnp.arange(items.shape[0]))


@functools.partial(jax.jit, static_argnames=("scale", "threshold", "noise", "grouping"))
def _stable_histogram(key, items, scale, threshold, noise, grouping):
  t = items.shape[0]
  k_hash, k_noise, k_tie = jax.random.split(key, 3)
  group = _group_pairwise(items) if grouping == "pairwise" else _group_hash(k_hash, items)
  representative = group == jnp.arange(t)
  counts = jnp.zeros(t, jnp.int32).at[group].add(1)          # count stored at the first row
  if noise == "discrete":
    noisy = counts + discrete._discrete_laplace(k_noise, (t,), scale)
    passes = noisy >= threshold
  else:
    noisy = counts + scale * jax.random.laplace(k_noise, (t,))
    passes = noisy > threshold
  released = representative & passes
  # Order: released first, larger noisy count first, ties by fresh uniform priorities.
  tie = jax.random.uniform(k_tie, (t,))
  order = jnp.lexsort((tie, -noisy.astype(jnp.float32), ~released))
  released = released[order]
  bins = jnp.where(released[:, None], items[order], 0)
  noisy = jnp.where(released, noisy[order], jnp.zeros((), noisy.dtype))
  return bins, noisy, released
