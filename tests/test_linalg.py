"""Tests for dpjax.linalg: batched top-k subspaces, projections, principal angles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import linalg
from helpers import normal


def _numpy_top_k(X, k):
  _, _, vt = np.linalg.svd(np.asarray(X, dtype=np.float64), full_matrices=False)
  return vt[:k].T


def _span_distance(A, B):
  A, B = np.asarray(A, np.float64), np.asarray(B, np.float64)
  return np.linalg.norm(A @ A.T - B @ B.T, 2)


@pytest.mark.parametrize("m,d", [(8, 30), (40, 12)])  # Gram route (m < d) and eigh route
def test_top_k_matches_numpy_svd(m, d):
  X = normal(0, (m, d)) * jnp.linspace(3.0, 0.1, d)
  V = linalg.top_k_right_singular_vectors(X, 3)
  assert V.shape == (d, 3) and V.dtype == X.dtype
  V = np.asarray(V)                             # checked in NumPy: no JAX program per check
  np.testing.assert_allclose(V.T @ V, np.eye(3), atol=1e-5)
  assert _span_distance(V, _numpy_top_k(X, 3)) < 1e-3


def test_zero_padding_rows_do_not_change_the_subspace():
  X = normal(1, (5, 30))
  padded = jnp.asarray(np.concatenate([X, np.zeros((3, 30), np.float32)]))   # (8, 30): shared
  a = linalg.top_k_right_singular_vectors(X, 3)
  b = linalg.top_k_right_singular_vectors(padded, 3)
  assert _span_distance(a, b) < 1e-4


def test_batched_equals_loop():
  blocks = np.asarray(normal(2, (6, 8, 30)))        # blocks of the (8, 30) shape used above
  batched = linalg.batched_top_k_subspaces(blocks, 3)
  assert batched.shape == (6, 30, 3)
  for j in range(6):
    single = linalg.top_k_right_singular_vectors(blocks[j], 3)
    np.testing.assert_allclose(np.asarray(batched[j]), np.asarray(single), atol=1e-5)


def test_rank_deficient_block_still_orthonormal():
  X = np.outer(np.arange(1.0, 9.0), np.ones(30)).astype(np.float32)   # rank 1, ask for 3
  V = np.asarray(linalg.top_k_right_singular_vectors(X, 3))
  np.testing.assert_allclose(V.T @ V, np.eye(3), atol=1e-5)
  assert abs(abs(V[:, 0] @ np.ones(30)) - np.sqrt(30)) < 1e-4   # leading direction is 1/√30


def test_project_points_is_projection():
  rng = np.random.default_rng(3)                  # test data in NumPy: no JAX programs
  bases = np.stack([np.linalg.qr(rng.standard_normal((15, 3)))[0] for _ in range(4)])
  bases, P = bases.astype(np.float32), rng.standard_normal((5, 15)).astype(np.float32)
  out = linalg.project_points(P, bases)
  assert out.shape == (4, 5, 15)
  expected = np.einsum("tdk,tek,qe->tqd", bases, bases, P)
  np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)


def test_principal_angles_known_case():
  e = np.eye(4, dtype=np.float32)                 # NumPy: no JAX program per operation
  theta = 0.3
  V1 = e[:, :2]
  V2 = np.stack([e[:, 0], np.cos(theta) * e[:, 1] + np.sin(theta) * e[:, 2]], axis=1)
  np.testing.assert_allclose(np.asarray(linalg.principal_angles(V1, V2)), [0.0, theta],
                             atol=1e-3)


def test_orthonormal_basis_float64():
  with jax.enable_x64(True):
    V = linalg.orthonormal_basis(jax.random.key(0), 30, 4, jnp.float64)
    assert V.dtype == jnp.float64
    V = np.asarray(V)
    np.testing.assert_allclose(V.T @ V, np.eye(4), atol=1e-12)


# Scale safety (issue 10 §6): the block is divided by a power of two of its largest entry first.


@pytest.mark.parametrize("m,d", [(8, 30), (40, 12)])  # Gram route and eigh route
@pytest.mark.parametrize("power", [-100, 60, 100])
def test_top_k_is_bit_identical_under_power_of_two_scaling(m, d, power):
  X = normal(4, (m, d)) * jnp.linspace(3.0, 0.1, d)
  scaled = X * jnp.float32(2.0**power)
  assert bool(jnp.all(jnp.isfinite(scaled)))
  a = linalg.top_k_right_singular_vectors(X, 3)
  b = linalg.top_k_right_singular_vectors(scaled, 3)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("m,d", [(8, 30), (40, 12)])
@pytest.mark.parametrize("scale", [1e25, 1e-25, 1e-36])
def test_top_k_float32_rows_whose_gram_overflows_or_underflows(m, d, scale):
  # (1e25)² and (1e-25)² are outside float32's range: the plain Gram route gave NaN or zeros.
  X = np.asarray(normal(5, (m, d))) * np.linspace(3.0, 0.1, d)
  V = linalg.top_k_right_singular_vectors(jnp.asarray(X * scale, jnp.float32), 3)
  assert V.dtype == jnp.float32
  V = np.asarray(V)
  assert np.all(np.isfinite(V))
  np.testing.assert_allclose(V.T @ V, np.eye(3), atol=1e-5)
  assert _span_distance(V, _numpy_top_k(X, 3)) < 1e-3


@pytest.mark.parametrize("scale", [1e200, 1e-200, 1e300])
def test_top_k_float64_rows_whose_gram_overflows_or_underflows(scale):
  X = np.random.default_rng(6).standard_normal((8, 30)) * np.linspace(3.0, 0.1, 30)
  with jax.enable_x64(True):
    V = linalg.top_k_right_singular_vectors(jnp.asarray(X * scale, jnp.float64), 3)
    assert V.dtype == jnp.float64 and np.all(np.isfinite(np.asarray(V)))
    assert _span_distance(V, _numpy_top_k(X, 3)) < 1e-9


@pytest.mark.parametrize("m,d", [(8, 30), (40, 12)])  # Gram route and eigh route (shapes above)
def test_zero_block_gives_a_finite_orthonormal_basis(m, d):
  V = np.asarray(linalg.top_k_right_singular_vectors(np.zeros((m, d), np.float32), 3))
  assert np.all(np.isfinite(V))
  np.testing.assert_allclose(V.T @ V, np.eye(3), atol=1e-6)


def test_times_power_of_two_is_exact_and_saturates():
  x = jnp.asarray([1.5, -3.0, 0.0], jnp.float32)
  np.testing.assert_array_equal(np.asarray(linalg.times_power_of_two(x, 200 - 200)), x)
  tiny = np.asarray(linalg.times_power_of_two(x, -140))        # below the normal range
  assert np.all(np.isfinite(tiny)) and np.all(np.abs(tiny) <= np.finfo(np.float32).tiny)
  big = np.asarray(linalg.times_power_of_two(jnp.float32(1.5), 130))
  assert np.isinf(big)
  np.testing.assert_array_equal(np.asarray(linalg.times_power_of_two(jnp.float32(0.75), 127)),
                                np.float32(0.75 * 2.0**127))


def test_symmetrize_is_exactly_symmetric_on_computed_arrays():
  """Issue 10 §4: a jitted second moment comes out off-symmetric by an ulp (fused multiply-adds
  round the mirrored entries differently); ``symmetrize`` on the computed array fixes it."""
  @jax.jit
  def second_moment(X, w):
    S = (X * w[:, None]).T @ X / jnp.sum(w)
    return 0.5 * (S + S.T) * 2.3

  for seed in range(10):
    X = normal(jax.random.key(seed), (200, 9))
    w = jnp.asarray(np.random.default_rng(100 + seed).uniform(size=200), jnp.float32)
    raw = second_moment(X, w)
    S = np.asarray(linalg.symmetrize(raw))
    np.testing.assert_array_equal(S, S.T)
    np.testing.assert_array_equal(np.tril(S), np.tril(np.asarray(raw)))   # the lower triangle kept
  batch = np.asarray(linalg.symmetrize(normal(2, (3, 4, 4))))
  np.testing.assert_array_equal(batch, np.swapaxes(batch, 1, 2))


# ------------------------------------------------------- top-k by subspace iteration


def _spiked(seed, m, d, k, noise, dtype=jnp.float32):
  """A rank-k spike plus noise, drawn by NumPy (no JAX programs for test data)."""
  rng = np.random.default_rng(seed)
  B = np.linalg.qr(rng.standard_normal((d, k)))[0]
  Z = rng.standard_normal((m, k)) * np.arange(k, 0, -1)
  return jnp.asarray(Z @ B.T + noise * rng.standard_normal((m, d)), dtype), B


@pytest.mark.parametrize("m,d", [
    (300, 80),
    pytest.param(40, 120, marks=pytest.mark.slow(reason="m < d (40 × 120); the default run checks "
                                                        "300 × 80"))])
@pytest.mark.parametrize("dtype", [
    jnp.float32,
    pytest.param(jnp.float64, marks=pytest.mark.slow(reason="float64; the default run checks "
                                                            "float32"))])
def test_subspace_iteration_agrees_with_the_exact_top_k(m, d, dtype):
  with jax.enable_x64(dtype == jnp.float64):
    X, _ = _spiked(m + d, m, d, 4, 0.05, dtype)
    exact = linalg.top_k_right_singular_vectors(X, 4)
    fast = linalg.top_k_right_singular_vectors(X, 4, method="subspace_iteration")
    assert fast.shape == (d, 4) and fast.dtype == dtype
    tol = 1e-3 if dtype == jnp.float32 else 1e-6
    assert float(linalg.principal_angles(exact, fast).max()) < tol
    np.testing.assert_allclose(np.asarray(fast).T @ np.asarray(fast), np.eye(4), atol=10 * tol)
    # Scale safety: X·2^j gives the same bits; determinism.
    again = linalg.top_k_right_singular_vectors(X * 2.0**40, 4, method="subspace_iteration")
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(again))


def test_subspace_iteration_edge_cases():
  def iterate(X, k, **kw):       # (300, 80), k = 4: the program of the test above
    return np.asarray(linalg.top_k_right_singular_vectors(X, k, method="subspace_iteration",
                                                           **kw))

  zero = iterate(np.zeros((300, 80), np.float32), 4)
  assert np.all(np.isfinite(zero))
  np.testing.assert_allclose(zero.T @ zero, np.eye(4), atol=1e-5)
  V = iterate(np.outer(np.arange(1.0, 301.0), np.ones(80)).astype(np.float32), 4)   # rank one
  np.testing.assert_allclose(V.T @ V, np.eye(4), atol=1e-5)
  assert abs(V[:, 0] @ np.ones(80)) / np.sqrt(80) > 1 - 1e-5
  # k = d, and an iteration cap that is hit: still an orthonormal finite basis.
  X, _ = _spiked(5, 30, 6, 2, 1.0)
  full = iterate(X, 6)
  np.testing.assert_allclose(full.T @ full, np.eye(6), atol=1e-5)
  capped = iterate(X, 2, max_iterations=1)
  np.testing.assert_allclose(capped.T @ capped, np.eye(2), atol=1e-5)
  with pytest.raises(ValueError, match="method"):
    linalg.top_k_right_singular_vectors(X, 2, method="lanczos")


@pytest.mark.slow(reason="gathered subsets equal the materialised blocks, per method; DPASE "
                         "gathers by default")
def test_gathered_top_k_equals_the_materialised_blocks():
  X = normal(4, (60, 20)) * jnp.linspace(2.0, 0.1, 20)
  index = jnp.arange(60).reshape(5, 12).at[2, -3:].set(60)         # 60 = a zero padding row
  blocks = jnp.concatenate([X, jnp.zeros((1, 20))])[index]
  for method in linalg.TOP_K_METHODS:
    got = linalg.gathered_top_k_subspaces(X, index, 2, method=method)
    want = linalg.batched_top_k_subspaces(blocks, 2, method=method)
    assert got.shape == (5, 20, 2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def _dot_precisions(closed):
  """The precision of every dot_general in a jaxpr, sub-jaxprs (jit, scan, while, cond) included."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found.append(eqn.params["precision"])
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          if hasattr(sub, "eqns"):                                  # a Jaxpr
            walk(sub)
          elif hasattr(getattr(sub, "jaxpr", None), "eqns"):        # a ClosedJaxpr
            walk(sub.jaxpr)
  walk(closed.jaxpr)
  return found


@pytest.mark.filterwarnings("ignore:DPASE")
@pytest.mark.slow(reason="every privacy-bearing product asks for HIGHEST precision; no default "
                         "test reads the traces")
def test_dpjax_products_ask_for_full_precision():
  """On GPUs/TPUs a default-precision float32 product runs in TF32/bfloat16 (error ~1e-3), which
  would loosen the bounds the privacy arguments read off dpjax's products: every product in the
  privacy-bearing paths must carry ``precision=HIGHEST`` (checked in the trace, so on the CPU)."""
  from dpjax.sgd import gep, noise, per_example
  from dpjax.sgd.bases import TwoSidedBasis
  from dpjax.subspace import approximate

  highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
  key = jax.random.key(0)
  X = normal(key, (40, 12))
  params = {"w": jnp.ones((6, 3)), "b": jnp.zeros(3)}
  batch = (jnp.ones((9, 6)), jnp.ones((9, 3)))
  loss = lambda p, ex: jnp.sum((jnp.sum(ex[0][:, None] * p["w"], 0) + p["b"] - ex[1]) ** 2)  # noqa: E731
  bases = {"w": jnp.eye(6, 2), "b": None}
  V = jnp.eye(21, 4)
  plain_sum = per_example.clipped_grad_sum(loss, clip_norm=1.0)
  gep_sum = gep.embedding_residual_grad_sum(loss, embedding_clip=1.0, residual_clip=0.5)
  sub_tx = noise.dp_noise(plain_sum, noise_multiplier=1.0, expected_batch_size=4.0, key=key,
                          basis=V)
  layer_tx = noise.dp_noise(plain_sum, noise_multiplier=1.0, expected_batch_size=4.0, key=key,
                            bases=bases)
  two_sided_tx = noise.dp_noise(plain_sum, noise_multiplier=1.0, expected_batch_size=4.0,
                                key=key, bases={"w": TwoSidedBasis(jnp.eye(6, 2), jnp.eye(3, 2)),
                                                "b": None})
  gep_tx = noise.dp_noise(gep_sum, noise_multiplier=1.0, expected_batch_size=4.0, key=key,
                          bases=bases)
  sums = gep_sum(params, batch, jnp.ones(9), bases)
  params_dpase = approximate.dpase_parameters(400, 12, 2, epsilon=1.0, delta=1e-5, gamma=0.01)
  programs = {
      "top_k exact": lambda: linalg.top_k_right_singular_vectors(X[:8], 3),
      "top_k covariance": lambda: linalg.top_k_right_singular_vectors(X, 3),
      "top_k iteration": lambda: linalg.top_k_right_singular_vectors(X, 3,
                                                                     method="subspace_iteration"),
      "project_points": lambda: linalg.project_points(X[:5], jnp.stack([jnp.eye(12, 3)] * 2)),
      "clipped_grad_sum": lambda: per_example.clipped_grad_sum(loss, clip_norm=1.0)(
          params, batch, jnp.ones(9)),
      "subspace noise": lambda: sub_tx.update({"w": jnp.ones(18), "b": jnp.ones(3)},
                                              sub_tx.init({"w": jnp.ones(18), "b": jnp.ones(3)})),
      "layer noise": lambda: layer_tx.update(params, layer_tx.init(params)),
      "two-sided layer noise": lambda: two_sided_tx.update(params, two_sided_tx.init(params)),
      "embedding_residual_grad_sum": lambda: gep_sum(params, batch, jnp.ones(9), bases),
      "embedding_residual_noise": lambda: gep_tx.update(sums, gep_tx.init(params)),
      "dpase_core": lambda: approximate._dpase_core(key, jnp.tile(X, (10, 1)), params_dpase,
                                                    k=2, epsilon=1.0, delta=1e-5),
  }
  for name, program in programs.items():
    precisions = _dot_precisions(jax.make_jaxpr(program)())
    assert precisions and all(p == highest for p in precisions), (name, precisions)
