"""Stability-based histogram over an unbounded domain (docs/algorithms.md §1.5; [SS21] Lemma A.15).

Only non-empty bins are ever touched, so the domain (e.g. all cells of a grid in Z^D) may be
infinite: each non-empty bin gets one noise draw, and only bins whose noisy count clears a
threshold τ are released. A bin that exists in only one of two neighboring datasets holds a
single item and clears τ with probability at most δ.

The noise is integer (discrete Laplace) and sampled exactly with integer arithmetic, so the
released noisy counts are integers whose set of possible values does not depend on the true
counts. An earlier ``noise="laplace"`` option added float32 Laplace noise and released the noisy
counts raw: the float32 values reachable from a count c differ from those reachable from c + 1
(Mironov 2012), and about a quarter of the output mass on one neighbour was unreachable on the
other (ε = ∞; ``dpjax.audit.exact_output_audit``). It was removed; passing it raises.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import NeighboringRelation
from jax import lax

from dpjax import _validation as v
from dpjax.mechanisms import discrete
from dpjax.mechanisms import exact as exact_lib

__all__ = ["HistogramScalars", "StableHistogram", "histogram_scalars", "stable_histogram",
           "stable_histogram_core", "top_bin"]

NOISES = ("discrete",)
GROUPINGS = ("auto", "pairwise", "hash")
_PAIRWISE_LIMIT = 50_000_000          # t·t·D booleans above which "auto" hashes instead
_CHUNK_ELEMENTS = 1 << 22             # (t, chunk) words per step of the O(tD) passes


class StableHistogram(NamedTuple):
  """The released part of a stability-based histogram (a pytree of length-t static arrays).

  Only the pairs ``(bins[i], noisy_counts[i])`` with ``released[i]`` carry information (they are
  the DP release); the other rows hold a fixed placeholder (bin all zeros, count 0). Rows are
  ordered: released bins first, by decreasing noisy count, ties broken by fresh randomness (never
  by the position of an item in the input, which the privacy proof does not cover).

  Attributes:
    bins: ``(t, D)`` int32 bin keys.
    noisy_counts: ``(t,)`` int32 noisy counts.
    released: ``(t,)`` bool.
    threshold: the public release threshold τ, a Python float with an integer value (release
      iff noisy count ≥ τ).
  """
  bins: jax.Array
  noisy_counts: jax.Array
  released: jax.Array
  threshold: float


def _sensitivity(neighboring: NeighboringRelation) -> int:
  # Replace-one moves one item between two bins (ℓ1 change 2); add/remove changes one bin by 1.
  return 2 if v.check_neighboring(neighboring) == NeighboringRelation.REPLACE_ONE else 1


def check_noise(noise: str) -> str:
  """Validates the histogram's ``noise`` option (only the exact ``"discrete"`` noise is offered)."""
  if noise == "laplace":
    raise ValueError(
        "noise='laplace' was removed: float32 Laplace noise on a count leaks the count through "
        "the float values it can reach (Mironov 2012; a quarter of the output mass is "
        "unreachable from the neighboring count, so it is not DP at any ε). Use the default "
        "noise='discrete' (exact integer discrete Laplace noise, same scale).")
  return v.check_choice(noise, "noise", NOISES)


def _noise_scale(epsilon: float, neighboring: NeighboringRelation) -> float:
  """The scale the exact sampler really uses (rounded up, :func:`discrete.effective_scale`)."""
  scale = _sensitivity(neighboring) / epsilon
  if scale > discrete.MAX_EXACT_SCALE:
    raise ValueError(f"epsilon must be at least {_sensitivity(neighboring)}/"
                     f"{discrete.MAX_EXACT_SCALE:g} for discrete noise, got epsilon={epsilon!r}.")
  return discrete.effective_scale(scale)


def histogram_threshold(epsilon: float, delta: float, *,
                        neighboring: NeighboringRelation = NeighboringRelation.REPLACE_ONE,
                        noise: str = "discrete") -> float:
  """The release threshold τ of the stability histogram (host, float64).

  With Δ = 2 (replace-one) or 1 (add/remove-one), discrete Laplace noise ``DLap(σ)``,
  ``p = e^{−1/σ}``, and release iff ``c + Z ≥ τ``: ``τ = 1 + ⌈σ ln(1/(δ(1 + p)))⌉``, so a
  singleton passes with probability ``P[Z ≥ τ − 1] = p^{τ−1}/(1 + p) ≤ δ``. Here ``σ`` is the
  scale the exact sampler uses: ``Δ/ε`` rounded up to a multiple of 2^-10
  (:func:`dpjax.mechanisms.discrete.effective_scale`; equal to ``Δ/ε`` for ε = 1, 0.5, 0.25, …).
  Computing τ at the rounded scale matters: more noise raises a singleton's pass probability.

  Args:
    epsilon: ``ε > 0``.
    delta: ``δ ∈ (0, 1)``.
    neighboring: a ``dp_accounting.NeighboringRelation``: ``REPLACE_ONE`` (default) or
      ``ADD_OR_REMOVE_ONE``.
    noise: ``"discrete"`` (the only option; ``"laplace"`` was removed, see the module docstring).

  Returns:
    τ as a Python float with an integer value.

  Raises:
    ValueError: ε not finite and > 0, δ ∉ (0, 1), unknown ``neighboring`` / ``noise`` (with an
      explanation for ``"laplace"``), or ``Δ/ε > 2^15``.

  References:
    Bun, Nissim & Stemmer, "Simultaneous private learning of multiple concepts", ITCS 2016;
    Vadhan, "The complexity of differential privacy", 2017; Singhal & Steinke, "Privately
    Learning Subspaces", NeurIPS 2021, Lemma A.15; docs/algorithms.md §1.5 (threshold
    re-derived there), §1.4 (discrete Laplace tail).
  """
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  v.check_neighboring(neighboring)
  check_noise(noise)
  scale = _noise_scale(epsilon, neighboring)
  p = math.exp(-1.0 / scale)
  steps = max(0, math.ceil(scale * math.log(1.0 / (delta * (1.0 + p)))))
  while steps >= 1 and discrete.discrete_laplace_tail(steps, scale) > delta:   # float guard
    steps += 1
  return float(1 + steps)


def stable_histogram(key: jax.Array, items, *, epsilon: float, delta: float,
                     neighboring: NeighboringRelation = NeighboringRelation.REPLACE_ONE,
                     noise: str = "discrete", grouping: str = "auto") -> StableHistogram:
  """Releases the popular bins of ``items`` with the stability-based histogram.

  Usage::

      cells = jnp.array([[0, 1]] * 40 + [[3, 2]] * 3)     # (t, D) integer bin keys, one per item
      hist = dpjax.mechanisms.stable_histogram(key, cells, epsilon=1.0, delta=1e-6)
      ok, cell, count = dpjax.mechanisms.top_bin(hist)    # the released bin with the top count

  Every non-empty bin (distinct row) gets ONE integer noise draw (never one per item) and is
  released iff its noisy count clears :func:`histogram_threshold`. Guarantee: (ε, δ)-DP under
  ``neighboring`` (``REPLACE_ONE``, t public: two counts change by 1, noise scale 2/ε;
  ``ADD_OR_REMOVE_ONE``: one count, scale 1/ε): counts of bins non-empty in both neighbours are
  ε-DP, a bin non-empty in only one holds one item and is released w.p. ≤ δ, the rest is
  post-processing. Only the released ``(bin, noisy count)`` pairs carry information
  (:class:`StableHistogram`). The noise is exact integer noise, so the release is float-safe.
  Proof and the grouping algorithms: docs/algorithms.md §1.5, §1.10.

  Args:
    key: JAX PRNG key.
    items: ``(t, D)`` integer array, t ≥ 1, D ≥ 1; row ``i`` is the bin key (in ℤ^D) of item
      ``i``. Keys outside the int32 range are clamped to it (a fixed map of each item, which
      keeps the neighboring relation; raising would branch on private data).
    epsilon: ``ε > 0``.
    delta: ``δ ∈ (0, 1)``.
    neighboring: a ``dp_accounting.NeighboringRelation``: ``REPLACE_ONE`` (default) or
      ``ADD_OR_REMOVE_ONE``.
    noise: ``"discrete"`` (the default and only option: exact integer noise, no floating-point
      side channel). ``"laplace"`` raises (removed: float32 Laplace counts leak, module docstring).
    grouping: how equal rows are grouped under ``jit``: ``"auto"`` (default: ``"pairwise"`` when
      ``t·t·D ≤ 5·10⁷``, else ``"hash"``), ``"pairwise"`` (all pairs of rows) or ``"hash"`` (two
      random 32-bit hashes per row, verified exactly); it does not change the output (§1.5).

  Returns:
    :class:`StableHistogram` with ``bins (t, D) int32``, ``noisy_counts (t,)``,
    ``released (t,) bool`` and the public ``threshold``. Traceable in ``key`` and ``items``;
    ε and δ enter the compiled core as traced integers, so an ε sweep compiles once.

  Raises:
    TypeError: ``items`` not an integer array, ``key`` not a PRNG key, ``neighboring`` not a
      ``NeighboringRelation``.
    ValueError: ``items`` not 2-D or empty; ε not finite and > 0; δ ∉ (0, 1); an unsupported
      relation, ``noise`` (``"laplace"`` included) or ``grouping``.

  References:
    Bun, Nissim & Stemmer (2016); Vadhan (2017); [SS21] Lemma A.15; Canonne, Kamath & Steinke
    (2020) (exact sampler); proof in docs/algorithms.md §1.5.
  """
  v.check_key(key)
  items = _check_items(items)
  v.check_choice(grouping, "grouping", GROUPINGS)
  scalars = histogram_scalars(epsilon, delta, neighboring=neighboring, noise=noise)
  bins, counts, released = stable_histogram_core(key, items, scalars, grouping)
  return StableHistogram(bins, counts, released, float(scalars.threshold))


class HistogramScalars(NamedTuple):
  """The public scalars of :func:`stable_histogram`: the noise scale ``num/den`` (exact rational,
  ``Δ/ε``) and the integer threshold τ. Python ints, or traced arrays inside a jitted caller."""
  num: Any
  den: Any
  threshold: Any


def histogram_scalars(epsilon: float, delta: float, *,
                      neighboring: NeighboringRelation = NeighboringRelation.REPLACE_ONE,
                      noise: str = "discrete") -> HistogramScalars:
  """Host side of :func:`stable_histogram`: validates (ε, δ, relation, noise) and returns the
  :class:`HistogramScalars` its traceable core uses (same errors as :func:`stable_histogram`)."""
  threshold = histogram_threshold(epsilon, delta, neighboring=neighboring, noise=noise)
  num, den = exact_lib.rational_scale(_noise_scale(float(epsilon), neighboring))
  return HistogramScalars(int(num), int(den), int(threshold))


def stable_histogram_core(key: jax.Array, items: jax.Array, scalars: HistogramScalars,
                          grouping: str = "auto") -> tuple[jax.Array, jax.Array, jax.Array]:
  """:func:`stable_histogram` without validation: ``(bins, noisy_counts, released)``.

  Traceable in ``key``, ``items`` and the ``scalars`` (from :func:`histogram_scalars`, possibly
  traced), so a caller jitting over ε compiles once. Same guarantee as :func:`stable_histogram`
  for the (ε, δ) the scalars were computed from.
  """
  t, d = items.shape
  if grouping == "auto":
    grouping = "pairwise" if t * t * d <= _PAIRWISE_LIMIT else "hash"
  return _stable_histogram(key, items, jnp.asarray(scalars.num, jnp.uint32),
                           jnp.asarray(scalars.den, jnp.uint32),
                           jnp.asarray(scalars.threshold, jnp.int32), grouping)


def top_bin(hist: StableHistogram) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(ok, bin (D,), noisy_count)``: the first row, i.e. the released bin with the largest
  noisy count; ``ok = hist.released[0]`` is False (and the rest placeholders) if none is."""
  return hist.released[0], hist.bins[0], hist.noisy_counts[0]


def _check_items(items) -> jax.Array:
  if not isinstance(items, jax.Array):
    items = np.asarray(items)                # keep int64 / uint values as they are for the check
  dtype = items.dtype
  if dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
    raise TypeError(f"items must be an integer array of bin keys, got dtype={dtype}.")
  if items.ndim != 2 or items.shape[0] == 0 or items.shape[1] == 0:
    raise ValueError(f"items must have shape (t, D) with t, D >= 1, got shape "
                     f"{tuple(items.shape)}.")
  if isinstance(items, np.ndarray):
    if np.iinfo(dtype).bits > 32 or dtype == np.uint32:
      items = np.clip(items, np.iinfo(np.int32).min, np.iinfo(np.int32).max)
    return jnp.asarray(items.astype(np.int32))
  if jnp.iinfo(dtype).bits > 32 or dtype == jnp.uint32:
    items = jnp.clip(items, jnp.iinfo(jnp.int32).min, jnp.iinfo(jnp.int32).max)
  return items.astype(jnp.int32)


def _column_chunks(t: int, d: int, per_column: int) -> int:
  """Columns per chunk so that a chunk holds about ``_CHUNK_ELEMENTS`` words."""
  return int(max(1, min(d, _CHUNK_ELEMENTS // max(1, t * per_column))))


def _reduce_columns(items, chunk: int, fn, init):
  """``acc = fn(acc, items[:, j:j+chunk])`` over column chunks (a fori_loop plus a remainder)."""
  d = items.shape[1]
  full, rest = divmod(d, chunk)
  acc = init
  if full:
    def body(i, acc):
      return fn(acc, lax.dynamic_slice_in_dim(items, i * chunk, chunk, axis=1), i * chunk)
    acc = lax.fori_loop(0, full, body, acc) if full > 1 else body(0, acc)
  if rest:
    acc = fn(acc, items[:, full * chunk:], full * chunk)
  return acc


def _group_pairwise(items):
  """Index of the first row equal to each row: ``argmax_j all(items[i] == items[j])``."""
  t, d = items.shape
  chunk = int(max(1, min(d, _PAIRWISE_LIMIT // (t * t))))

  def step(equal, block, _):
    return equal & jnp.all(block[:, None, :] == block[None, :, :], axis=-1)
  equal = _reduce_columns(items, chunk, step, jnp.ones((t, t), jnp.bool_))
  return jnp.argmax(equal, axis=1)


def _mix32(x):
  """MurmurHash3's 32-bit finaliser: a fixed bijection of uint32 that spreads every bit."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _group_hash(key, items):
  """As :func:`_group_pairwise`, via two random 32-bit hashes and an exact O(tD) check."""
  t, d = items.shape
  k_a, k_b = jax.random.split(key)
  coefficients = jax.random.bits(k_a, (2, d), jnp.uint32)
  offsets = jax.random.bits(k_b, (2, d), jnp.uint32)
  chunk = _column_chunks(t, d, 2)

  def hash_step(acc, block, start):
    width = block.shape[1]
    a = lax.dynamic_slice_in_dim(coefficients, start, width, axis=1)
    b = lax.dynamic_slice_in_dim(offsets, start, width, axis=1)
    mixed = _mix32(block.astype(jnp.uint32)[None] ^ b[:, None, :])            # (2, t, width)
    return acc + jnp.sum(mixed * a[:, None, :], axis=-1, dtype=jnp.uint32)    # mod 2^32
  hashes = _reduce_columns(items, chunk, hash_step, jnp.zeros((2, t), jnp.uint32))
  equal = (hashes[0][:, None] == hashes[0][None, :]) & (hashes[1][:, None] == hashes[1][None, :])
  first = jnp.argmax(equal, axis=1)

  def verify_step(ok, block, _):
    return ok & jnp.all(block == block[first], axis=1)
  verified = _reduce_columns(items, _column_chunks(t, d, 2), verify_step, jnp.ones(t, jnp.bool_))
  return jnp.where(verified, first, jnp.arange(t))


@functools.partial(jax.jit, static_argnames=("grouping",))
def _stable_histogram(key, items, num, den, threshold, grouping):
  """Jitted core: the noise scale ``num/den`` and the integer ``threshold`` are public traced
  scalars (one compilation for every ε and δ)."""
  t = items.shape[0]
  k_hash, k_noise, k_tie = jax.random.split(key, 3)
  group = _group_pairwise(items) if grouping == "pairwise" else _group_hash(k_hash, items)
  representative = group == jnp.arange(t)
  counts = jnp.zeros(t, jnp.int32).at[group].add(1)          # count stored at the first row
  # One draw per row position, used only at representatives: one draw per distinct bin.
  noisy = counts + exact_lib.exact_discrete_laplace(k_noise, (t,), num, den)
  passes = noisy >= threshold
  sort_key = -noisy
  released = representative & passes
  # Released first, larger noisy count first; ties by a fresh uniform permutation (stable sort
  # of randomly permuted rows), never by row position.
  perm = jax.random.permutation(k_tie, t)
  _, _, order = lax.sort(((~released[perm]).astype(jnp.int32), sort_key[perm], perm),
                         num_keys=2, is_stable=True)
  released = released[order]
  bins = jnp.where(released[:, None], items[order], 0).astype(jnp.int32)
  noisy = jnp.where(released, noisy[order], jnp.zeros((), noisy.dtype))
  return bins, noisy, released
