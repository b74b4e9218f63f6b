"""GEP's clipped-gradient sum: per-example gradients split by per-layer bases BEFORE clipping
into an embedding and a residual (dpjax/sgd/gep.py; docs/algorithms.md §6.4). The noise of its
release (σΔ with Δ = 1 joint, √2 per part) is tested in test_noise.py."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import NeighboringRelation

from dpjax.sgd import gep, noise, per_example
from dpjax.sgd.bases import TwoSidedBasis
from helpers import normal


def _orthonormal(key, a, r):
  return jnp.asarray(np.linalg.qr(np.asarray(normal(key, (a, r))))[0])   # NumPy: no compile


def _model():
  params = {"w": jnp.zeros((6, 3)), "b": jnp.zeros(3)}
  loss = lambda p, ex: jnp.sum((ex[0] @ p["w"] + p["b"] - ex[1]) ** 2)   # noqa: E731
  keys = jax.random.split(jax.random.key(11), 2)
  batch = (normal(keys[0], (9, 6)), normal(keys[1], (9, 3)))
  return params, loss, batch


@pytest.mark.parametrize("joint,bound", [(True, 1.0), (False, math.sqrt(2.0))])
def test_the_grad_sum_carries_its_bound_and_clip_norms(joint, bound):
  """Joint clipping of the scaled pair bounds a term by Δ = 1; one clip per part by Δ = √2. The
  object carries Δ, C_e, C_ρ and the mode, which the noise reads (it takes none of them)."""
  _, loss, _ = _model()
  fn = gep.embedding_residual_grad_sum(loss, embedding_clip=2.0, residual_clip=0.5, joint=joint)
  assert isinstance(fn, gep.EmbeddingResidualGradSum)
  assert isinstance(fn, per_example.ClippedGradSum)
  assert fn.l2_norm_bound == pytest.approx(bound) and noise.l2_norm_bound(fn) == fn.l2_norm_bound
  assert (fn.embedding_clip, fn.residual_clip, fn.joint) == (2.0, 0.5, joint)
  assert fn.sensitivity() == fn.l2_norm_bound
  assert fn.sensitivity(NeighboringRelation.REPLACE_ONE) == 2 * fn.l2_norm_bound


def test_partial_isometry_bases_keep_the_split_orthogonal():
  # A basis with a zero column: U Uᵀ is still a projector, so each example's gradient splits
  # into orthogonal parts (‖U e‖² + ‖ρ‖² = ‖g‖²) and the clip norms bound the same quantities.
  Q = np.asarray(_orthonormal(jax.random.key(5), 6, 3))
  partial = jnp.asarray(Q * np.array([1.0, 0.0, 1.0]))
  g = normal(6, (6, 4))
  e, rho = gep._split(g, partial, 1.0, 1.0)
  back = partial @ e
  np.testing.assert_allclose(float(jnp.sum(back**2) + jnp.sum(rho**2)), float(jnp.sum(g**2)),
                             rtol=1e-5)
  np.testing.assert_allclose(np.asarray(partial.T @ rho), 0.0, atol=1e-5)   # ρ ⟂ span(U)


@pytest.mark.parametrize("joint", [True, False])
@pytest.mark.parametrize("stretch", [  # 1: plain
    pytest.param(1.0, marks=pytest.mark.slow(reason="an orthonormal basis; the default run checks "
                                                    "a stretching one")),
    3.0])
def test_removing_one_example_moves_the_scaled_sums_by_at_most_the_bound(stretch, joint):
  """The sensitivity of the (embedding, residual) release is Δ (1 joint, √2 per part) in the
  scaled units for every example — huge, zero, non-finite — and any basis (even one that
  stretches)."""
  params, loss, batch = _model()
  x, y = batch
  x = x.at[0].multiply(1e6).at[1].set(0.0).at[2, 0].set(jnp.nan).at[3, 1].set(jnp.inf)
  bases = {"w": _orthonormal(jax.random.key(4), 6, 2).at[0, 0].multiply(stretch), "b": None}
  fn = gep.embedding_residual_grad_sum(loss, embedding_clip=1.0, residual_clip=0.1, joint=joint)
  bound = fn.l2_norm_bound
  # Row 0: all examples; row i + 1: example i removed (one program for the ten sums).
  masks = np.concatenate([np.ones((1, 9)), 1 - np.eye(9)]).astype(np.float32)
  sums = jax.jit(jax.vmap(fn, in_axes=(None, None, 0, None)))(params, (x, y), masks, bases)
  rows = np.concatenate([np.asarray(l, np.float64).reshape(10, -1)
                         for l in jax.tree_util.tree_leaves(sums)], axis=1)
  assert np.all(np.isfinite(rows[0]))
  norms = np.linalg.norm(rows[0] - rows[1:], axis=1)
  assert np.all(np.isfinite(norms)) and np.all(norms <= bound * (1 + 1e-5)), norms
  assert norms.max() > 0.9 * bound                # the huge example reaches the bound


@pytest.mark.parametrize("joint", [True, False])
def test_low_precision_scaled_terms_stay_within_the_bound(joint):
  """Issue 34 §3 on the GEP split: bfloat16 gradients from tiny to near the dtype's max, one
  projected (float32 coefficients) and one unprojected (bfloat16) leaf: each example's scaled
  term, exactly as the sum receives it, is ≤ Δ (joint) or ≤ 1 per part, evaluated in float64
  over the stored values."""
  params = {"w": jnp.full((6, 3), 0.3, jnp.bfloat16), "b": jnp.zeros(3, jnp.bfloat16)}
  loss = lambda p, ex: jnp.sum((ex[0] @ p["w"] + p["b"] - ex[1]) ** 2)   # noqa: E731
  scales = np.array([1e-3, 0.3, 1.0, 3.0, 1e3, 1e9, 1e17, 3e17])[:, None]
  x = jnp.asarray(np.asarray(normal(12, (8, 6))) * scales, jnp.bfloat16)
  batch = (x, jnp.asarray(normal(13, (8, 3)), jnp.bfloat16))
  bases = {"w": _orthonormal(jax.random.key(4), 6, 2), "b": None}
  fn = gep.embedding_residual_grad_sum(loss, embedding_clip=1.0, residual_clip=0.1, joint=joint)
  sums = jax.jit(jax.vmap(fn, in_axes=(None, None, 0, None)))(
      params, batch, np.eye(8, dtype=np.float32), bases)
  assert sums["embedding"]["b"].dtype == jnp.bfloat16
  parts = {k: np.concatenate([np.asarray(l.astype(jnp.float32), np.float64).reshape(8, -1)
                              for l in jax.tree_util.tree_leaves(v)], 1)
           for k, v in sums.items()}
  assert all(np.all(np.isfinite(r)) for r in parts.values())
  norms = {k: np.linalg.norm(r, axis=1) for k, r in parts.items()}
  if joint:
    total = np.sqrt(norms["embedding"] ** 2 + norms["residual"] ** 2)
    assert total.max() <= 1.0 and total.max() > 0.99, total
  else:
    assert max(n.max() for n in norms.values()) <= 1.0, norms
    assert norms["embedding"].max() > 0.99


def test_embedding_residual_shapes_and_bad_options():
  params, loss, batch = _model()
  bases = {"w": _orthonormal(jax.random.key(4), 6, 2), "b": None}
  sums = jax.jit(gep.embedding_residual_grad_sum(loss, embedding_clip=1.0, residual_clip=0.1))(
      params, batch, jnp.ones(9), bases)
  assert sums["embedding"]["w"].shape == (2, 3) and sums["embedding"]["b"].shape == (3,)
  assert sums["residual"]["w"].shape == (6, 3) and sums["residual"]["b"].shape == (0,)
  for bad, match in (({"embedding_clip": 0.0, "residual_clip": 1.0}, "embedding_clip"),
                     ({"embedding_clip": 1.0, "residual_clip": float("nan")}, "residual_clip"),
                     ({"embedding_clip": 1.0, "residual_clip": 1.0, "clipping": "flat"},
                      "clipping")):
    with pytest.raises(ValueError, match=match):
      gep.embedding_residual_grad_sum(loss, **bad)


@pytest.mark.parametrize("joint", [True, False])
def test_two_sided_embedding_residual_split_is_orthogonal_and_bounded(joint):
  """GEP with two-sided bases: e = UᵀGV, ρ = G − U e Vᵀ, ‖e‖² + ‖ρ‖² = ‖G‖², and the noisy
  release maps back to the params' shapes; every example's scaled term is within Δ."""
  params = {"w": jnp.zeros((6, 4)), "b": jnp.zeros(4)}
  keys = jax.random.split(jax.random.key(2), 3)
  bases = {"w": TwoSidedBasis(_orthonormal(keys[0], 6, 2), _orthonormal(keys[1], 4, 2)),
           "b": None}
  G = normal(keys[2], (6, 4))
  e, rho = gep._split(G, bases["w"], 1.0, 1.0)
  U, V = bases["w"]
  np.testing.assert_allclose(e, U.T @ G @ V, atol=1e-5)
  assert float(jnp.sum(e**2) + jnp.sum(rho**2)) == pytest.approx(float(jnp.sum(G**2)), rel=1e-4)
  X = normal(keys[2], (5, 6, 4)) * 10.0
  loss = lambda p, x: jnp.sum(p["w"] * x) + jnp.sum(p["b"])   # noqa: E731
  grad_sum = gep.embedding_residual_grad_sum(loss, embedding_clip=1.0, residual_clip=0.5,
                                             joint=joint)
  # Each example's term alone (one-hot masks, one program), then all of them.
  masks = np.concatenate([np.eye(5), np.ones((1, 5))]).astype(np.float32)
  sums = jax.jit(jax.vmap(grad_sum, in_axes=(None, None, 0, None)))(params, X, masks, bases)
  norms = np.sqrt(sum(np.sum(np.asarray(x, np.float64).reshape(6, -1) ** 2, axis=1)
                      for x in jax.tree_util.tree_leaves(sums)))
  assert np.all(norms[:5] <= grad_sum.l2_norm_bound * (1 + 1e-5)), norms
  tx = noise.dp_noise(grad_sum, noise_multiplier=1.0, expected_batch_size=4.0,
                      key=jax.random.key(0), bases=bases)
  out, _ = tx.update(jax.tree_util.tree_map(lambda x: x[5], sums), tx.init(params))
  assert out["w"].shape == (6, 4) and out["b"].shape == (4,)


@pytest.mark.slow(reason="embedding+residual on identity bases is DP-SGD end to end; the default "
                         "run checks the noise's draws (test_noise)")
def test_embedding_residual_with_identity_bases_is_plain_dp_sgd():
  params, loss, batch = _model()
  mask = jnp.ones(9).at[3].set(0)
  params = {"w": 0.3 * jnp.ones((6, 3)), "b": jnp.zeros(3)}
  eye = {"w": jnp.eye(6), "b": None}
  gep_sum = gep.embedding_residual_grad_sum(loss, embedding_clip=2.0, residual_clip=0.5)
  plain_sum = per_example.clipped_grad_sum(loss, clip_norm=2.0)
  tx = noise.dp_noise(gep_sum, noise_multiplier=1.3, expected_batch_size=4.0,
                      key=jax.random.key(2), bases=eye)
  plain = noise.dp_noise(plain_sum, noise_multiplier=1.3, expected_batch_size=4.0,
                         key=jax.random.key(2))
  a, _ = tx.update(gep_sum(params, batch, mask, eye), tx.init(params))
  b, _ = plain.update(plain_sum(params, batch, mask), plain.init(params))
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5),
                         a, b)


@pytest.mark.slow(reason="without noise or clipping nothing is dropped; the residual channel's "
                         "audit runs by default")
def test_without_noise_or_clipping_the_residual_channel_drops_nothing():
  params, loss, batch = _model()
  bases = {"w": _orthonormal(jax.random.key(4), 6, 2), "b": None}
  gep_sum = gep.embedding_residual_grad_sum(loss, embedding_clip=1e4, residual_clip=1e4)
  tx = noise.dp_noise(gep_sum, noise_multiplier=0.0, expected_batch_size=3.0,
                      key=jax.random.key(2), bases=bases)
  out, _ = tx.update(gep_sum(params, batch, jnp.ones(9), bases), tx.init(params))
  full = jax.tree_util.tree_map(lambda g: jnp.sum(g, 0) / 3.0,
                                jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, batch))
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4),
                         out, full)
