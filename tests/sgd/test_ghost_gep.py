"""GEP by ghost clipping (``ghost_clipped_grad_sum(..., embedding_clip=, residual_clip=)``):
the same sums as the vmap path's :func:`dpjax.sgd.embedding_residual_grad_sum`, and every
example's scaled term within its bound in low precision (issue 35 §1: every route composes with
ghost clipping)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.sgd import bases as bases_lib
from dpjax.sgd import gep, ghost

D, H, K, B = 6, 5, 3, 12


def apply_fn(p, x, *, dense):
  return dense(p["l2"], jnp.tanh(dense(p["l1"], x)))


def example_loss(out, y):
  return optax.softmax_cross_entropy_with_integer_labels(out, y)


def _orth(rows, cols, seed):
  return np.linalg.qr(np.random.default_rng(seed).normal(size=(rows, cols)))[0].astype(np.float32)


def _setup(dtype=jnp.float32, scale=3.0, seed=0):
  rng = np.random.default_rng(seed)
  params = {"l1": {"w": jnp.asarray(rng.normal(size=(D, H)), dtype), "b": jnp.zeros(H, dtype)},
            "l2": {"w": jnp.asarray(rng.normal(size=(H, K)), dtype), "b": jnp.zeros(K, dtype)}}
  X = jnp.asarray(scale * rng.normal(size=(B, D)), dtype)
  y = jnp.asarray(rng.integers(0, K, B))
  return params, (X, y)


BASES = {
    "one-sided": lambda: {"l1": {"w": _orth(D, 2, 1), "b": None}, "l2": {"w": None, "b": None}},
    "two-sided (vmap fallback)": lambda: {
        "l1": {"w": _orth(D, 2, 1), "b": None},
        "l2": {"w": bases_lib.TwoSidedBasis(_orth(H, 2, 2), _orth(K, 2, 3)), "b": None}},
}


def _pair(joint, clipping, c_e=1.0, c_r=0.3):
  fast = ghost.ghost_clipped_grad_sum(apply_fn, example_loss, embedding_clip=c_e,
                                      residual_clip=c_r, joint=joint, clipping=clipping)
  ref = gep.embedding_residual_grad_sum(ghost.model_loss(apply_fn, example_loss),
                                        embedding_clip=c_e, residual_clip=c_r, joint=joint,
                                        clipping=clipping)
  return fast, ref


@pytest.mark.parametrize("kind", ["one-sided", pytest.param(
    "two-sided (vmap fallback)", marks=pytest.mark.slow(
        reason="two-sided bases on the ghost GEP path (the vmap fallback); one-sided by default"))])
@pytest.mark.parametrize("joint,clipping", [(True, "clip"), (False, "clip"),
                                            pytest.param(True, "normalize", marks=pytest.mark.slow(
                                                reason="normalize on the ghost GEP path; clip "
                                                       "runs by default")),
                                            pytest.param(False, "normalize",
                                                         marks=pytest.mark.slow(
                                                             reason="as above, per part"))])
def test_ghost_gep_equals_the_vmap_path(kind, joint, clipping):
  """Same structure, shapes, dtypes and sums (to float32 rounding), padded rows ignored; the
  bound Δ (1 joint, √2 per part) and the clip norms travel with the function."""
  params, batch = _setup()
  bases = BASES[kind]()
  mask = jnp.ones(B, bool).at[3].set(False)
  fast, ref = _pair(joint, clipping)
  assert isinstance(fast, gep.EmbeddingResidualGradSum)
  assert fast.l2_norm_bound == pytest.approx(1.0 if joint else math.sqrt(2.0))
  assert (fast.embedding_clip, fast.residual_clip, fast.joint) == (1.0, 0.3, joint)
  a = jax.jit(fast.fun)(params, batch, mask, bases)
  b = jax.jit(ref.fun)(params, batch, mask, bases)
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, z in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    assert x.shape == z.shape and x.dtype == z.dtype
    np.testing.assert_allclose(x, z, rtol=2e-5, atol=2e-6)


def _terms(fn, params, batch, bases):
  """Each example's scaled (embedding, residual) term as the sum receives it: the sum with a
  one-hot mask, in float64, flattened per part."""
  def one(i):
    out = fn(params, batch, jnp.arange(B) == i, bases)
    return [jnp.concatenate([x.astype(jnp.float32).ravel() for x in
                             jax.tree_util.tree_leaves(out[part])]) for part in
            ("embedding", "residual")]
  return [np.asarray(t, np.float64) for t in jax.jit(jax.vmap(one))(jnp.arange(B))]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow(
    reason="float16 on the ghost GEP path; bfloat16 runs by default"))])
@pytest.mark.parametrize("joint", [True, False])
def test_ghost_gep_terms_stay_within_the_bound_in_low_precision(dtype, joint):
  """In 16-bit models at scales from 1e-3 to 1e3 of the clip, every example's scaled term has
  exact norm ≤ 1 jointly (joint) or per part (per part), evaluated over the stored values."""
  worst = 0.0
  for seed, scale in enumerate((1e-3, 1.0, 1e3)):
    params, batch = _setup(dtype, scale, seed)
    fast, _ = _pair(joint, "clip")
    emb, res = _terms(fast.fun, params, batch, BASES["one-sided"]())
    norms = (np.sqrt(np.sum(emb ** 2, 1) + np.sum(res ** 2, 1)) if joint
             else np.maximum(np.linalg.norm(emb, axis=1), np.linalg.norm(res, axis=1)))
    worst = max(worst, float(norms.max()))
  assert 0.5 < worst <= 1.0, worst


def test_ghost_gep_needs_both_clips_and_not_clip_norm():
  for kwargs in ({"clip_norm": 1.0, "embedding_clip": 1.0, "residual_clip": 1.0},
                 {"embedding_clip": 1.0}, {}):
    with pytest.raises(ValueError, match="clip_norm"):
      ghost.ghost_clipped_grad_sum(apply_fn, example_loss, **kwargs)
  with pytest.raises(ValueError, match="residual_clip"):
    ghost.ghost_clipped_grad_sum(apply_fn, example_loss, embedding_clip=1.0, residual_clip=0.0)


def test_the_fallback_warning_gives_the_reason_the_fix_and_points_at_the_caller():
  """Issue 53: the fallback warning pointed into dpjax/sgd/ghost.py, gave no way out, did not
  say it was safe to ignore, and under GEP blamed coverage for a two-sided basis or a 3-D
  attention kernel. Now: the caller's line, the reason per leaf, how to avoid it, "safe"."""
  params, batch = _setup()
  fast, _ = _pair(True, "clip")
  with pytest.warns(UserWarning, match="ghost clipping") as caught:
    fast.fun(params, batch, jnp.ones(B, bool), BASES["two-sided (vmap fallback)"]())
  message = str(caught[0].message)
  assert caught[0].filename == __file__
  assert "['l2']['w'] has a two-sided basis" in message and "Safe to ignore" in message
  assert "not read by exactly one" not in message            # not a coverage problem
  params3 = {"l1": {"w": params["l1"]["w"].reshape(D, H, 1),
                    "b": params["l1"]["b"].reshape(H, 1)}}

  def head(p, x, *, dense):             # a 3-D (in, heads, dim) kernel, as attention's
    return ghost.layer(dense, ghost.DenseLayer(), p["l1"], x,
                       lambda q, h: jnp.einsum("a,ahd->hd", h, q["w"]) + q["b"])[:, 0]
  three = ghost.ghost_clipped_grad_sum(head, example_loss, embedding_clip=1.0,
                                       residual_clip=1.0)
  with pytest.warns(UserWarning, match="2-D dense kernels only") as caught:
    three.fun(params3, batch, jnp.ones(B, bool), {"l1": {"w": _orth(D, 2, 1), "b": None}})
  assert caught[0].filename == __file__
