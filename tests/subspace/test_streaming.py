"""Tests for streamed DPASE (``dpjax.dpase`` on chunks or a memmap, dpjax.subspace.streaming;
docs/algorithms.md §2.2): the same partition and output as in-memory DPASE with random labels,
whatever the chunks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import NeighboringRelation

import dpjax
from dpjax import data, metrics
from dpjax import ledger as ledger_lib
from dpjax.subspace import approximate, streaming
from helpers import normal

N, D, K, GAMMA = 6_000, 20, 2, 1e-5
EPS, DELTA = 1.0, 1e-6
KW = dict(epsilon=EPS, delta=DELTA, k=K, gamma=GAMMA)
BLOCK = 1_536                      # does not divide N: the last block is padded
KEY = jax.random.key(12)


@pytest.fixture(scope="module")
def model():
  # Jitted: one program (eagerly, each of the generator's ~20 operations compiled apart).
  X, model = jax.jit(data.approximate_subspace_data, static_argnums=(1, 2, 3),
                     static_argnames=("gamma",))(jax.random.key(11), N, D, K, gamma=GAMMA)
  reference = approximate.dpase(KEY, X, partition="random_labels", **KW)
  assert bool(reference.ok)
  return np.asarray(X), model, reference


def _chunks(X, size):
  for start in range(0, X.shape[0], size):
    yield X[start:start + size]


def _assert_same(result, reference):
  assert bool(result.ok) == bool(reference.ok)
  assert int(result.released["winning_count"]) == int(reference.released["winning_count"])
  np.testing.assert_allclose(np.asarray(result.basis), np.asarray(reference.basis), atol=1e-5)
  assert result.basis.shape == (D, K) and result.basis.dtype == reference.basis.dtype
  assert result.neighboring == NeighboringRelation.ADD_OR_REMOVE_ONE
  for name in ("num_subsets", "subset_size", "cell_length", "partition"):
    assert result.info[name] == reference.info[name]


@pytest.fixture
def memmap(tmp_path, model):
  X = model[0]
  path = tmp_path / "rows.f32"
  stored = np.memmap(path, dtype=np.float32, mode="w+", shape=X.shape)
  stored[:] = X
  stored.flush()
  del stored
  yield np.memmap(path, dtype=np.float32, mode="r", shape=X.shape)


_MEMMAP = "memmap chunks of {} rows; the default run streams the memmap whole, arrays in chunks"


@pytest.mark.parametrize("size", [pytest.param(n, marks=pytest.mark.slow(reason=_MEMMAP.format(n)))
                                  for n in (777, 1_000, N)])
def test_streaming_from_a_memmap_equals_in_memory_random_labels(memmap, model, size):
  _, truth, reference = model
  result = dpjax.dpase(KEY, _chunks(memmap, size), n=N, d=D, block_rows=BLOCK, **KW)
  _assert_same(result, reference)
  assert float(metrics.projection_distance(result.basis, truth.basis)) < 0.1


def test_the_block_update_compiles_once_whatever_the_chunk_sizes(model):
  X, _, reference = model
  before = streaming._accumulate._cache_size()
  for size in (500, 777, 2_999):
    _assert_same(dpjax.dpase(KEY, _chunks(X, size), n=N, d=D, block_rows=BLOCK, **KW),
                 reference)
  assert streaming._accumulate._cache_size() - before <= 1


def test_streaming_from_a_generator_and_from_a_whole_array(model, memmap):
  X, _, reference = model
  sizes = iter([1, 250, 3_000, 0, 1_999, 750])                    # uneven, one empty chunk

  def rows():
    start = 0
    for size in sizes:
      yield X[start:start + size]
      start += size
  _assert_same(dpjax.dpase(KEY, rows(), n=N, d=D, block_rows=BLOCK, **KW), reference)
  _assert_same(dpjax.dpase(KEY, memmap, **KW), reference)   # n, d from it; default blocks


@pytest.mark.slow(reason="blocks of 40 rows force extra passes; the default run streams blocks "
                         "of 1536")
def test_a_subset_with_more_rows_in_a_block_than_its_share_runs_extra_passes(model):
  """Blocks of 40 rows over t = 38 subsets: the per-block width is 12 rows, and the blocks that
  put more rows into one subset add them in further passes; nothing is lost."""
  X, _, reference = model
  _assert_same(dpjax.dpase(KEY, _chunks(X, 1_000), n=N, d=D, block_rows=40, **KW),
               reference)


def test_no_gap_gives_bottom_in_both():
  X = normal(3, (N, D))
  reference = approximate.dpase(KEY, X, partition="random_labels", **KW)
  result = dpjax.dpase(KEY, _chunks(np.asarray(X), 1_000), n=N, d=D, block_rows=BLOCK,
                                 **KW)
  assert not bool(reference.ok)
  _assert_same(result, reference)
  assert jnp.all(result.basis == 0)


@pytest.mark.parametrize("scale", [
    1e30,
    pytest.param(1e-30, marks=pytest.mark.slow(reason="underflow (1e-30); the default run checks "
                                                      "overflow (1e30)"))])
def test_extreme_scales_give_the_unscaled_answer(model, scale):
  """float32 rows × 1e±30: their squares over- (1e60) or underflow (1e-60) float32; float64
  and the per-subset power-of-two scale keep the answer."""
  X, _, reference = model
  scaled = (X * np.float32(scale)).astype(np.float32)
  assert np.all(np.isfinite(scaled)) and np.all(np.any(scaled != 0, axis=1))
  _assert_same(dpjax.dpase(KEY, _chunks(scaled, 1_000), n=N, d=D, block_rows=BLOCK,
                                     **KW), reference)


def test_a_non_finite_row_contributes_a_zero_row(model):
  X, _, _ = model
  bad = X.copy()
  bad[[5, 2_000, 4_321], 0] = [np.nan, np.inf, -np.inf]
  bad[77, 3] = np.nan                                       # one entry suffices
  zeroed = bad.copy()
  zeroed[~np.all(np.isfinite(bad), axis=1)] = 0.0
  reference = approximate.dpase(KEY, jnp.asarray(zeroed), partition="random_labels", **KW)
  _assert_same(dpjax.dpase(KEY, _chunks(bad, 1_000), n=N, d=D, block_rows=BLOCK, **KW),
               reference)


def _untouchable():
  raise AssertionError("a chunk was read before the arguments were checked")
  yield  # noqa: unreachable - makes this a generator


class _Memmap:
  """A memmap of zeros of ``shape`` and ``dtype``, made in the test's ``tmp_path``."""

  def __init__(self, shape, dtype):
    self.shape, self.dtype = shape, dtype

  def make(self, tmp_path):
    stored = np.memmap(tmp_path / "rows.bin", dtype=self.dtype, mode="w+", shape=self.shape)
    stored.flush()
    return np.memmap(tmp_path / "rows.bin", dtype=self.dtype, mode="r", shape=self.shape)


@pytest.mark.parametrize("change,exc,match", [
    (dict(epsilon=0.0), ValueError, "epsilon"),
    (dict(delta=1.0), ValueError, "delta"),
    (dict(k=0), ValueError, "k"),
    (dict(k=D + 1), ValueError, "k"),
    (dict(gamma=None), ValueError, "gamma"),
    (dict(n=100), ValueError, "n is too small"),
    (dict(d=0), ValueError, "d"),
    (dict(max_bytes=approximate.num_subsets_for(EPS, DELTA) * D * D * 8 - 1), ValueError,
     "max_bytes"),
    (dict(max_bytes=0), ValueError, "max_bytes"),
    (dict(block_rows=0), ValueError, "block_rows"),
    (dict(dtype=jnp.int32), TypeError, "dtype"),
    (dict(noise="laplace"), ValueError, "float32"),
    (dict(key=3), TypeError, "key"),
    (dict(rows=42), TypeError, "rows"),
    (dict(rows=_Memmap((N, D + 1), np.float32)), ValueError, "shape"),
    (dict(rows=_Memmap((N, D), np.float64), dtype=np.float32), TypeError, "dtype"),
    (dict(rows=_Memmap((N, D), np.float32), n=N - 1), ValueError, "shape"),
    (dict(top_k_method="subspace_iteration"), ValueError, "top_k_method"),
])
def test_bad_arguments_raise_before_any_chunk_is_read(change, exc, match, tmp_path):
  ledger = ledger_lib.PrivacyLedger(10.0, 1e-3)
  args = dict(key=KEY, rows=_untouchable(), n=N, d=D, **KW) | change
  if isinstance(args["rows"], _Memmap):
    args["rows"] = args["rows"].make(tmp_path)
  with pytest.raises(exc, match=match):
    dpjax.dpase(ledger=ledger, **args)
  assert ledger.entries == ()                              # nothing recorded either


@pytest.mark.parametrize("chunks,exc,match", [
    ([np.zeros((10, D + 1), np.float32)], ValueError, r"shape \(10, 21\)"),
    ([np.zeros((10, D), np.float64)], TypeError, "dtype float64"),
    ([np.zeros((N + 1, D), np.float32)], ValueError, "more than n"),
    ([np.zeros((N - 1, D), np.float32)], ValueError, "expected n"),
])
def test_bad_chunks_raise(chunks, exc, match):
  with pytest.raises(exc, match=match):
    dpjax.dpase(KEY, iter(chunks), n=N, d=D, block_rows=BLOCK, **KW)


def test_the_ledger_records_the_release():
  ledger = ledger_lib.PrivacyLedger(2.0, 1e-5)
  rows = (np.zeros((N // 4, D), np.float32) for _ in range(4))
  res = dpjax.dpase(KEY, rows, n=N, d=D, block_rows=BLOCK, ledger=ledger, **KW)
  assert res.epsilon == EPS and res.delta == DELTA
  assert len(ledger.entries) == 1 and ledger.spent.epsilon == EPS
