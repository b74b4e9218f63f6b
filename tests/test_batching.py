"""The batching policy (dpjax.linalg): block i's output depends on block i alone, bit for bit.

For every batched decomposition the library uses, changing one block of a batch must leave every
other block's output bitwise unchanged, and a block's output must not depend on the batch size.
Where this holds on the running backend, ``dpjax.linalg.map_blocks`` batches with ``vmap``; the
test runs on whatever backend JAX uses (the CPU in CI; a GPU too when one is present).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import linalg
from dpjax.ashtiani_liaw import semimetric


def _sym(B):
  return B @ jnp.swapaxes(B, -1, -2) / B.shape[-1] + 0.1 * jnp.eye(B.shape[-2], dtype=B.dtype)


DECOMPOSITIONS = {
    # name: (block -> output, block shape (m, d))
    "eigh": (lambda B: jnp.linalg.eigh(_sym(B)), (12, 20)),
    "svd": (lambda B: jnp.linalg.svd(B, full_matrices=False), (30, 12)),
    "cholesky": (lambda B: jnp.linalg.cholesky(_sym(B)), (16, 24)),
    "qr": (lambda B: jnp.linalg.qr(B), (30, 12)),
    "top_k_right_singular_vectors (Gram route)": (
        lambda B: linalg.top_k_right_singular_vectors(B, 3), (10, 40)),
    "top_k_right_singular_vectors (covariance route)": (
        lambda B: linalg.top_k_right_singular_vectors(B, 3), (40, 10)),
    "top_k_right_singular_vectors (subspace iteration, m < d)": (
        lambda B: linalg.top_k_right_singular_vectors(B, 3, method="subspace_iteration"),
        (10, 40)),
    "top_k_right_singular_vectors (subspace iteration, m ≥ d)": (
        lambda B: linalg.top_k_right_singular_vectors(B, 3, method="subspace_iteration"),
        (40, 10)),
    "semimetric Cholesky test (library, d > 12)": (
        lambda B: semimetric._cholesky_succeeds(_sym(B)[None] - 0.3 * jnp.eye(B.shape[0])),
        (16, 16)),
}


SLOW_CASES = ("top_k_right_singular_vectors (covariance route)",
              "top_k_right_singular_vectors (subspace iteration, m ≥ d)")


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _check_block_independence(batch, fn, name, shape, dtype):
  """``batch(fn, blocks)`` moves no other block's output when block 3 changes, and gives the
  first four blocks' outputs bit for bit when run on those four alone."""
  with jax.enable_x64(dtype == jnp.float64):
    rng = np.random.default_rng(0)      # NumPy data: no random-number program to compile per shape
    blocks = rng.standard_normal((8, *shape))
    changed = blocks.copy()
    changed[3] = 1e3 * rng.standard_normal(shape)                       # a very different block
    batched = jax.jit(lambda b: batch(fn, b))
    before, after = batched(jnp.asarray(blocks, dtype)), batched(jnp.asarray(changed, dtype))
    half = batched(jnp.asarray(blocks[:4], dtype))
    for i in range(8):
      for x, y in zip(_leaves(before), _leaves(after)):
        if i != 3:
          np.testing.assert_array_equal(x[i], y[i], err_msg=f"{name}: block {i} moved")
    for x, y in zip(_leaves(before), _leaves(half)):              # batch size does not matter
      np.testing.assert_array_equal(x[:4], y, err_msg=f"{name}: depends on the batch size")
    assert any(not np.array_equal(x[3], y[3]) for x, y in zip(_leaves(before), _leaves(after)))


_SECOND_ROUTE = pytest.mark.slow(reason="the second route of its top-k method; the default run "
                                         "checks one route per method")


@pytest.mark.parametrize("dtype", [
    jnp.float32,
    pytest.param(jnp.float64, marks=pytest.mark.slow(reason="float64 blocks; the default run "
                                                            "checks float32"))])
@pytest.mark.parametrize("name", [pytest.param(n, marks=_SECOND_ROUTE) if n in SLOW_CASES else n
                                  for n in sorted(DECOMPOSITIONS)])
def test_changing_one_block_leaves_the_others_bitwise_unchanged(name, dtype):
  fn, shape = DECOMPOSITIONS[name]
  _check_block_independence(linalg.map_blocks, fn, name, shape, dtype)


# Larger blocks, where GPU solvers switch algorithm (e.g. batched Jacobi only for small matrices).
LARGER_SHAPES = [(64, 100), (300, 200)]


@pytest.mark.skipif(jax.default_backend() in linalg.VERIFIED_BATCHING_BACKENDS,
                    reason="map_blocks already vmaps here, so the test above checks vmap")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("shape", [None, *LARGER_SHAPES], ids=str)
@pytest.mark.parametrize("name", sorted(DECOMPOSITIONS))
def test_vmap_block_independence_on_an_unverified_backend(name, shape, dtype):
  """On a backend outside ``VERIFIED_BATCHING_BACKENDS`` (a GPU, a TPU), check ``vmap`` itself:
  a failure is expected and reported (``map_blocks`` keeps one call per block there); a pass
  is the evidence needed to add the backend to the list."""
  fn, default_shape = DECOMPOSITIONS[name]
  shape = default_shape if shape is None else shape
  if name.startswith("semimetric"):
    shape = (shape[0], 2 * shape[0])   # a well-conditioned covariance: the changed block's answer moves
  try:
    _check_block_independence(lambda f, b: jax.vmap(f)(b), fn, name, shape, dtype)
  except AssertionError as err:
    pytest.xfail(f"vmap is not block-independent on {jax.default_backend()}: {err}")


def test_map_blocks_batches_on_verified_backends_only(monkeypatch):
  blocks = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 4)), jnp.float32)
  jaxpr = str(jax.make_jaxpr(lambda b: linalg.map_blocks(jnp.linalg.qr, b))(blocks))
  assert ("while" not in jaxpr and "scan" not in jaxpr) == (
      jax.default_backend() in linalg.VERIFIED_BATCHING_BACKENDS)
  monkeypatch.setattr(linalg, "VERIFIED_BATCHING_BACKENDS", ())
  jaxpr = str(jax.make_jaxpr(lambda b: linalg.map_blocks(jnp.linalg.qr, b))(blocks))
  assert "scan" in jaxpr or "while" in jaxpr                        # one call per block


@pytest.mark.slow(reason="subsets gathered 3 per chunk stay independent; DPASE's small runs "
                         "gather in one chunk")
@pytest.mark.parametrize("method", ["exact", "subspace_iteration"])
def test_gathered_subsets_chunked_are_independent(method, monkeypatch):
  """DPASE's path: subsets gathered by index from one X, a few subsets per chunk (``lax.map``
  with ``batch_size``). Changing one subset's rows moves no other subset's basis, and a chunked
  run equals one batch of all subsets bit for bit."""
  X = jnp.asarray(np.random.default_rng(0).standard_normal((8 * 12, 30)) * np.linspace(3.0, 0.1, 30),
                  jnp.float32)
  index = jax.random.permutation(jax.random.key(1), X.shape[0]).reshape(8, 12)
  index = index.at[5, -2:].set(X.shape[0])                         # padding rows
  def run():   # a fresh function per trace: jit and make_jaxpr cache traces by function
    return lambda A: linalg.gathered_top_k_subspaces(A, index, 3, method=method)

  whole = jax.jit(run())(X)
  monkeypatch.setattr(linalg, "GATHER_CHUNK_BYTES", 3 * 12 * 30 * 4)  # 3 subsets per chunk
  assert "scan" in str(jax.make_jaxpr(run())(X))
  before = jax.jit(run())(X)
  after = jax.jit(run())(X.at[index[3]].set(1e3 * X[index[3]][:, ::-1]))
  np.testing.assert_array_equal(np.asarray(before), np.asarray(whole))
  for i in range(8):
    if i != 3:
      np.testing.assert_array_equal(np.asarray(before[i]), np.asarray(after[i]))
  assert not np.array_equal(np.asarray(before[3]), np.asarray(after[3]))
