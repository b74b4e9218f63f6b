"""DPASE's subset bases from rows streamed in chunks: sufficient statistics, memory O(t d²).

The streamed row source of :func:`dpjax.subspace.dpase` (an iterable of chunks, or a NumPy
memmap): for datasets that do not fit in memory. DPASE with ``partition="random_labels"``
([SS21] Algorithm 2; docs/algorithms.md §2.2) needs of each subset only its top-k right singular
vectors, i.e. the top-k eigenvectors of the subset's ``d × d`` second-moment matrix
``X_jᵀ X_j``. Those t matrices are accumulated block by block as the rows go by, then
eigendecomposed (:func:`subset_bases`), and DPASE's aggregation (reference points, cells,
stability histogram) runs on the t bases exactly as in memory.

The rows are read once, in a fixed order; at no time are more than a block of them in memory.
Row i's subset is its public random label (:func:`dpjax.subspace.partition.random_labels`, drawn
from DPASE's key split as in memory); within a subset rows rank by row order and those past the
public capacity ``m + ⌈4√m⌉ + 4`` are dropped. So the partition is the in-memory one, and the
output equals in-memory DPASE with random labels and ``top_k_method="exact"`` on the stacked rows
up to rounding of the bases (the same ``ok``, winning count and basis unless a projected
coordinate lies within rounding of a cell boundary).

How: each subset's second moment is accumulated in float64, block by block (one jitted update,
compiled once: blocks have the static size ``block_rows``, the last one padded with rows that
belong to no subset). Scale safety as :func:`dpjax.linalg._normalise_scale` in memory: every
subset keeps a power of two ``2^{e_j}`` ≥ its largest entry so far; rows are divided by it
before their products are added, and the sum is rescaled (exactly) when ``e_j`` grows, so
neither float32 nor float64 input of any finite scale overflows or underflows. At the end each
subset's basis is the top-k eigenvectors of its matrix (``eigh`` in float64, columns
re-orthonormalised and signs fixed by :func:`dpjax.linalg.canonical_signs`: the in-memory
"exact" solver's basis up to rounding).

Memory: ``t·d²·8`` bytes for the accumulators, independent of ``n`` (refused by
:func:`check_memory` before any row is read above ``max_bytes``), plus per block about
``block_rows·d`` of the chunk dtype and ``≈ 8·block_rows·d·(1 + 5√(t/block_rows))`` bytes of
float64 rows grouped by subset, one ``d × d`` eigendecomposition at a time at the end, and the
public labels (4 bytes per row). Time: ``≈ 2 n d²`` float64 flops for the products and ``t``
eigendecompositions of ``d × d`` matrices. (The pages of one whole memmap that have been read
stay mapped: the OS may reclaim them, but they count in the process's resident size; a generator
that maps and copies one chunk at a time, ``np.array(np.memmap(path, ..., offset=...,
shape=(rows, d)))``, does not.)

Edge cases:

==========================  =======================================================
input                       what happens
==========================  =======================================================
a row with a NaN or inf     it contributes a zero row (sanitised per row: a fixed,
                            data-independent map inside one subset; no error)
a chunk of another shape    ``ValueError`` (rows read so far are discarded, nothing
or more than ``n`` rows     is released)
a chunk of another dtype    ``TypeError`` (no silent cast)
fewer than ``n`` rows       ``ValueError`` once the iterable is exhausted
an all-zero subset          a fixed canonical basis, as in memory
==========================  =======================================================

Privacy: each subset's basis is a function of its own rows only (the labels, capacity, block
size, grouping and scaling are public or per subset), which is all DPASE's guarantee uses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import _validation as v
from dpjax import linalg
from dpjax.subspace.partition import subset_capacity

# subset_bases is the concept; check_chunks, check_memory and block_rows_for are dpase's checks
# of a streamed source (run before any row is read).
__all__ = ["DEFAULT_MAX_BYTES", "subset_bases"]

# The default of ``max_bytes``: the t second-moment accumulators may take 4 GiB.
DEFAULT_MAX_BYTES = 4 << 30
# The running exponent of a subset that has seen no nonzero row yet (below float64's range).
_EMPTY = -(1 << 12)


def check_chunks(chunks, n: int, d: int, dtype) -> None:
  """Checks a row stream before any row is read: one ``(n, d)`` NumPy array (a memmap) of
  ``dtype``, or an iterable (not a string) of chunks.

  Raises:
    ValueError: an array of another shape. TypeError: an array of another dtype, or a
      non-iterable.
  """
  if isinstance(chunks, np.ndarray):
    if chunks.shape != (n, d):
      raise ValueError(f"rows given as one array must have shape (n, d) = ({n}, {d}), got "
                       f"{chunks.shape}.")
    if chunks.dtype != dtype:
      raise TypeError(f"rows has dtype {chunks.dtype}, expected {dtype} (the dtype argument).")
  elif isinstance(chunks, (str, bytes)) or not hasattr(chunks, "__iter__"):
    raise TypeError("rows must be an iterable of (rows, d) arrays or an (n, d) NumPy memmap, "
                    f"got {type(chunks).__name__}.")


def check_memory(t: int, d: int, max_bytes) -> float:
  """Validates ``max_bytes`` (None: :data:`DEFAULT_MAX_BYTES`) and that the ``t`` float64
  ``d × d`` accumulators fit in it; returns it as a float.

  Raises:
    ValueError: ``max_bytes`` not > 0, or ``t·d²·8 > max_bytes``.
  """
  max_bytes = v.check_positive(DEFAULT_MAX_BYTES if max_bytes is None else max_bytes,
                               "max_bytes", allow_inf=True)
  needed = t * d * d * 8
  if needed > max_bytes:
    raise ValueError(
        f"streamed DPASE keeps t={t} float64 {d}x{d} second-moment matrices, "
        f"t*d*d*8 = {needed:,} bytes, more than max_bytes={max_bytes:,.0f}; raise max_bytes, or "
        "reduce d (e.g. a public random projection) or t (a larger epsilon).")
  return max_bytes


def block_rows_for(block_rows, *, n: int, d: int, t: int) -> int:
  """Rows per update: ``block_rows`` (an int ≥ 1) or by default ``max(2^26 / (8 d), 512 t)``;
  at most ``n``. Raises ``TypeError`` / ``ValueError`` for a bad ``block_rows``."""
  if block_rows is None:
    block_rows = max(linalg.GATHER_CHUNK_BYTES // (8 * d), 512 * t)
  return min(v.check_int(block_rows, "block_rows", low=1), n)


def subset_bases(chunks, labels, *, n: int, d: int, k: int, t: int, capacity: int, dtype,
                 block_rows: int) -> np.ndarray:
  """The ``(t, d, k)`` float64 top-k bases of the subsets of streamed rows (module docstring).

  Row i (in the order the chunks give the rows) belongs to subset ``labels[i]`` (public, ``(n,)``
  ints in ``[0, t)``), unless ``capacity`` rows of that subset came before it (then it is
  dropped). Each subset's basis is a function of its own rows only. Every argument has been
  validated (:func:`check_chunks`, :func:`check_memory`, :func:`block_rows_for`); a bad chunk
  raises here (``TypeError`` for another dtype, ``ValueError`` for another shape or a total
  other than ``n``).
  """
  moments = _accumulate_stream(chunks, labels, n=n, d=d, t=t, dtype=np.dtype(dtype),
                               capacity=capacity, block_rows=block_rows)
  with jax.enable_x64(True):
    return np.asarray(_top_k_of_moments(*moments, k=k))


def _blocks_of(chunks, n, d, dtype, block_rows):
  """Yields the rows of ``chunks`` regrouped into ``(block_rows, d)`` blocks (the last one
  zero-padded) with their number of real rows; checks every chunk."""
  if isinstance(chunks, np.ndarray):
    array = chunks
    chunks = (array[i:i + block_rows] for i in range(0, n, block_rows))
  seen, filled = 0, 0
  block = np.zeros((block_rows, d), dtype)
  for number, chunk in enumerate(chunks):
    chunk = np.asarray(chunk)
    if chunk.dtype != dtype:
      raise TypeError(f"chunk {number} has dtype {chunk.dtype}, expected {dtype} (the dtype "
                      "argument); convert the chunks, nothing is cast silently.")
    if chunk.ndim != 2 or chunk.shape[1] != d:
      raise ValueError(f"chunk {number} has shape {chunk.shape}, expected (rows, {d}).")
    if seen + chunk.shape[0] > n:
      raise ValueError(f"the chunks hold more than n={n} rows (chunk {number} ends at row "
                       f"{seen + chunk.shape[0]}).")
    seen += chunk.shape[0]
    start = 0
    while start < chunk.shape[0]:
      take = min(block_rows - filled, chunk.shape[0] - start)
      block[filled:filled + take] = chunk[start:start + take]
      filled, start = filled + take, start + take
      if filled == block_rows:
        yield block, filled
        block, filled = np.zeros((block_rows, d), dtype), 0   # a fresh buffer: no aliasing
  if seen != n:
    raise ValueError(f"the chunks hold {seen} rows, expected n={n}.")
  if filled:
    yield block, filled


def _accumulate_stream(chunks, labels, *, n, d, t, dtype, capacity, block_rows):
  """The t subsets' scaled second moments ``(t, d, d)`` float64 and exponents ``(t,)``: subset
  j's ``X_jᵀ X_j`` is ``2^{2 e_j}`` times its matrix."""
  # Rows of one subset in one block: its expected share plus a public margin; a block whose
  # public labels put more rows in a subset runs the update again for the excess (rare).
  width = min(block_rows, subset_capacity(-(-block_rows // t)))
  counts = np.zeros(t, np.int64)                         # rows of each subset so far (public)
  with jax.enable_x64(True):
    moments = jnp.zeros((t, d, d), jnp.float64)
    exponents = jnp.full((t,), _EMPTY, jnp.int32)
  start, in_flight = 0, None
  for block, rows in _blocks_of(chunks, n, d, dtype, block_rows):
    label = labels[start:start + rows].astype(np.int64)
    start += rows
    order = np.argsort(label, kind="stable")
    first = np.searchsorted(label[order], np.arange(t))
    rank = np.empty(rows, np.int64)
    rank[order] = np.arange(rows) - first[label[order]]   # rank within the block's subset
    kept = counts[label] + rank < capacity                 # the in-memory capacity rule
    counts += np.bincount(label, minlength=t)
    passes = int(rank[kept].max()) // width + 1 if kept.any() else 0
    with jax.enable_x64(True):
      device_rows = jnp.asarray(block)
      for p in range(passes):
        sel = kept & (rank // width == p)
        group = np.full(block_rows, t, np.int32)           # t: no subset (dropped)
        group[:rows][sel] = label[sel]
        slot = np.zeros(block_rows, np.int32)
        slot[:rows][sel] = rank[sel] - p * width
        moments, exponents = _accumulate(moments, exponents, device_rows, group, slot,
                                         width=width)
    if in_flight is not None:      # at most two blocks queued: memory stays O(one block)
      in_flight.block_until_ready()
    in_flight = exponents
  return moments, exponents


@functools.partial(jax.jit, static_argnames=("width",), donate_argnums=(0,))
def _accumulate(moments, exponents, rows, group, slot, *, width):
  """Adds the rows of one block to their subsets' scaled second moments (float64; x64 on).

  ``group[i]`` (``t``: none) and ``slot[i] < width`` place row i; a row with a NaN/inf is a zero
  row. Subset j's exponent grows to cover its new rows, the old sum is rescaled by the exact
  power of two, and the rows, divided by ``2^{e_j}``, add ``X_jᵀ X_j`` one subset at a time
  (in place).
  """
  t, d, _ = moments.shape
  x = rows.astype(jnp.float64)
  x = jnp.where(jnp.all(jnp.isfinite(x), axis=1, keepdims=True), x, 0.0)
  grouped = jnp.zeros((t, width, d), jnp.float64).at[group, slot].set(x, mode="drop")
  peak = jnp.max(jnp.abs(grouped), axis=(1, 2))
  _, e = jnp.frexp(peak)
  new = jnp.maximum(exponents, jnp.where(peak > 0, e, _EMPTY))
  grouped = linalg.times_power_of_two(grouped, -jnp.where(new == _EMPTY, 0, new)[:, None, None])

  def add(j, moments):
    old = linalg.times_power_of_two(moments[j], 2 * (exponents[j] - new[j]))
    return moments.at[j].set(old + linalg.matmul(grouped[j].T, grouped[j]))

  return jax.lax.fori_loop(0, t, add, moments), new


@functools.partial(jax.jit, static_argnames=("k",))
def _top_k_of_moments(moments, exponents, *, k):
  """``(t, d, k)`` top-k eigenvectors of each subset's second moment (one ``eigh`` at a time),
  ordered by decreasing eigenvalue, re-orthonormalised, signs by ``canonical_signs``."""
  del exponents                       # a positive scale changes no eigenvector

  def one(S):
    _, vectors = jnp.linalg.eigh(S)
    V, _ = jnp.linalg.qr(vectors[:, ::-1][:, :k])
    return linalg.canonical_signs(V)

  return linalg.map_blocks(one, moments, batch_size=1)
