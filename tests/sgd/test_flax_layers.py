"""Ghost clipping of Flax models as written (issue 38): Linen and NNX layers recorded through
:mod:`dpjax.sgd.flax_layers`, checked against the ``vmap(grad)`` path of the same model."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from dpjax import sgd
from dpjax.sgd import flax_layers, ghost
from dpjax.sgd import per_example as pe

nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")

C = 0.5


def _xent(logits, y):
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


# --- models --------------------------------------------------------------------------------


class _CNN(nnx.Module):
  """2-D convolutions: SAME with stride 2, VALID with kernel dilation 2, explicit padding with
  input dilation; a dense layer on the flattened features."""

  def __init__(self, rngs, dtype=None, param_dtype=jnp.float32):
    kw = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
    self.c1 = nnx.Conv(2, 4, (3, 3), strides=2, **kw)
    self.c2 = nnx.Conv(4, 4, (3, 2), padding="VALID", kernel_dilation=2, **kw)
    self.c3 = nnx.Conv(4, 3, (2, 2), padding=((1, 0), (0, 1)), input_dilation=(1, 2),
                       use_bias=False, **kw)
    self.d = nnx.Linear(2 * 7 * 3, 5, **kw)

  def __call__(self, x):
    h = jnp.tanh(self.c1(x))
    h = jnp.tanh(self.c2(h))
    h = jnp.tanh(self.c3(h))
    return self.d(h.reshape(h.shape[0], -1))


class _Conv1D(nnx.Module):
  """1-D convolutions: CAUSAL padding and an integer padding; a GroupNorm."""

  def __init__(self, rngs):
    self.c1 = nnx.Conv(3, 4, (3,), padding="CAUSAL", kernel_dilation=2, rngs=rngs)
    self.norm = nnx.GroupNorm(4, num_groups=2, rngs=rngs)
    self.c2 = nnx.Conv(4, 5, (2,), padding=1, strides=2, rngs=rngs)

  def __call__(self, x):
    h = self.norm(jnp.tanh(self.c1(x)))
    return self.c2(h).mean(axis=-2)


class _Transformer(nnx.Module):
  """Token and position embeddings, multi-head attention (LinearGeneral projections), a
  LayerNorm and an RMSNorm, a dense MLP, mean pooling."""

  def __init__(self, rngs, dtype=None, param_dtype=jnp.float32, vocab=20, width=8, seq=6):
    kw = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
    self.tokens = nnx.Embed(vocab, width, **kw)
    self.positions = nnx.Embed(seq, width, **kw)
    self.norm1 = nnx.LayerNorm(width, **kw)
    self.attention = nnx.MultiHeadAttention(2, width, decode=False, **kw)
    self.norm2 = nnx.RMSNorm(width, **kw)
    self.up = nnx.Linear(width, 12, **kw)
    self.head = nnx.Linear(12, 5, **kw)

  def __call__(self, ids):
    h = self.tokens(ids) + self.positions(jnp.arange(ids.shape[-1]))
    h = h + self.attention(self.norm1(h))
    return self.head(jnp.tanh(self.up(self.norm2(h)))).mean(axis=-2)


class _LinenModel(nn.Module):
  """Linen: Embed, a causal Conv, DenseGeneral onto and from two axes, LayerNorm, Dense."""

  @nn.compact
  def __call__(self, ids):
    h = nn.Embed(20, 8)(ids)
    h = nn.Conv(8, (3,), padding="CAUSAL")(h)
    h = nn.DenseGeneral((2, 4))(h)
    h = nn.DenseGeneral(6, axis=(-2, -1))(jnp.tanh(h))
    return nn.Dense(5)(nn.LayerNorm()(h)).mean(-2)


def _images(seed, n, dtype=jnp.float32, scale=1.0):
  X = jax.random.normal(jax.random.key(seed), (n, 12, 12, 2), jnp.float32) * scale
  return X.astype(dtype), jnp.arange(n) % 5


def _tokens(seed, n, seq=6):
  ids = jax.random.randint(jax.random.key(seed), (n, seq), 0, 5)    # repeats within a row
  ids = ids.at[0, 1].set(-3)                                         # a negative id (wraps)
  return ids, jnp.arange(n) % 5


def _nnx(cls, **kw):
  return flax_layers.nnx_model(cls(nnx.Rngs(0), **kw))


def _linen():
  module = _LinenModel()
  ids, _ = _tokens(0, 1)
  return flax_layers.linen_apply(module), module.init(jax.random.key(0), ids)["params"]


MODELS = {
    "nnx_cnn": (lambda: _nnx(_CNN), lambda s: _images(s, 6)),
    "nnx_conv1d": (lambda: _nnx(_Conv1D),
                   lambda s: (jax.random.normal(jax.random.key(s), (6, 9, 3)), jnp.arange(6) % 5)),
    "nnx_transformer": (lambda: _nnx(_Transformer), lambda s: _tokens(s, 6)),
    "linen": (_linen, lambda s: _tokens(s, 6)),
}


def _vmap_norms(apply_fn, params, batch):
  return jax.jit(lambda p, b: pe.global_norms(pe.per_example_grads(
      ghost.model_loss(apply_fn, _xent))(p, b)))(params, batch)


def _terms(grad_fn, params, batch):
  """Each example's clipped term alone (one-hot masks), flattened: ``(B, P)``."""
  size = batch[1].shape[0]
  sums = jax.jit(jax.vmap(lambda m: grad_fn(params, batch, m)))(jnp.eye(size))
  return jax.vmap(lambda t: ravel_pytree(t)[0])(sums)


def _no_warnings(fn):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    return fn()


# --- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_layer_covered_and_equal_to_the_vmap_path(name):
  """No parameter falls back (no warning); per-example norms and the clipped sum equal the
  vmap path's to float rounding."""
  build, data = MODELS[name]
  apply_fn, params = build()
  batch = data(1)
  norms = _no_warnings(lambda: jax.jit(ghost.ghost_norms(apply_fn, _xent))(params, batch))
  ref = _vmap_norms(apply_fn, params, batch)
  np.testing.assert_allclose(norms, ref, rtol=2e-5)
  mask = jnp.ones(batch[1].shape[0])
  got = _no_warnings(lambda: jax.jit(sgd.ghost_clipped_grad_sum(
      apply_fn, _xent, clip_norm=C))(params, batch, mask))
  want = jax.jit(sgd.clipped_grad_sum(ghost.model_loss(apply_fn, _xent), clip_norm=C))(
      params, batch, mask)
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * C)


@pytest.mark.parametrize("scale", [2.0 ** -60, 1.0, 2.0 ** 50])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_terms_within_c_at_extreme_scales_and_in_bfloat16(scale, dtype):
  """The CNN (convolutions: the direct route) with inputs scaled by 2^±k, in float32 and with
  bfloat16 computation and parameters: each clipped term's norm ≤ C, the norms match the vmap
  path's, and an example whose gradient overflows contributes nothing."""
  apply_fn, params = _nnx(_CNN, dtype=dtype, param_dtype=dtype)
  batch = _images(2, 4, dtype, scale)
  grad_fn = sgd.ghost_clipped_grad_sum(apply_fn, _xent, clip_norm=C)
  terms = np.asarray(_terms(grad_fn, params, batch), np.float64)
  assert np.all(np.isfinite(terms))
  assert np.max(np.linalg.norm(terms, axis=1)) <= C
  norms = np.asarray(jax.jit(ghost.ghost_norms(apply_fn, _xent))(params, batch))
  ref = np.asarray(_vmap_norms(apply_fn, params, batch), np.float64)
  finite = np.isfinite(ref) & (ref > 0)
  rtol = 1e-5 if dtype == jnp.float32 else 2e-2      # the vmap path's bfloat16 gradients
  np.testing.assert_allclose(norms[finite], ref[finite], rtol=rtol)
  if scale == 1.0:       # clipped: every term is at C(1 − ρ), less bfloat16's rounding down
    np.testing.assert_allclose(np.linalg.norm(terms, axis=1), C,
                               rtol=1e-3 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sequence_model_terms_within_c(dtype):
  """The transformer (embeddings, attention on the Gram route, norms' scales), float32 and
  bfloat16: every term ≤ C, tiny C included."""
  apply_fn, params = _nnx(_Transformer, dtype=dtype, param_dtype=dtype)
  batch = _tokens(3, 5)
  for clip in (C, 1e-30):
    terms = np.asarray(_terms(sgd.ghost_clipped_grad_sum(apply_fn, _xent, clip_norm=clip),
                              params, batch), np.float64)
    assert np.max(np.linalg.norm(terms, axis=1)) <= clip


def test_non_finite_example_contributes_nothing():
  """A NaN input (or an id beyond the table, which jnp.take fills with NaN) drops its example,
  as the vmap path does."""
  apply_fn, params = _nnx(_CNN)
  X, y = _images(4, 4)
  X = X.at[1, 0, 0, 0].set(jnp.nan)
  grad_fn = sgd.ghost_clipped_grad_sum(apply_fn, _xent, clip_norm=C)
  terms = np.asarray(_terms(grad_fn, params, (X, y)))
  assert np.all(terms[1] == 0) and np.all(np.linalg.norm(terms[[0, 2, 3]], axis=1) > 0)
  apply_fn, params = _nnx(_Transformer)
  ids, y = _tokens(5, 3)
  ids = ids.at[2, 0].set(10_000)
  terms = np.asarray(_terms(sgd.ghost_clipped_grad_sum(apply_fn, _xent, clip_norm=C), params,
                            (ids, y)))
  assert np.all(terms[2] == 0) and np.all(np.linalg.norm(terms[:2], axis=1) > 0)


class _Fallbacks(nnx.Module):
  """Layers whose gradient is not one of the identities: a CIRCULAR conv, a masked conv, a
  grouped conv, an embedding tied to the output (``attend``), a subclass of Linear, a raw
  parameter."""

  class _MyLinear(nnx.Linear):
    pass

  def __init__(self, rngs):
    self.circ = nnx.Conv(2, 4, (3,), padding="CIRCULAR", rngs=rngs)
    self.masked = nnx.Conv(4, 4, (2,), mask=jnp.tril(jnp.ones((2, 4, 4))), rngs=rngs)
    self.grouped = nnx.Conv(4, 4, (2,), feature_group_count=2, rngs=rngs)
    self.mine = self._MyLinear(4, 4, rngs=rngs)
    self.raw = nnx.Param(jnp.ones(4))
    self.dense = nnx.Linear(4, 3, rngs=rngs)
    self.emb = nnx.Embed(5, 3, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.grouped(jnp.tanh(self.masked(jnp.tanh(self.circ(x))))))
    h = self.mine(h) * self.raw[...]
    z = self.dense(h) + self.emb(jnp.arange(h.shape[-2]) % 5)
    return self.emb.attend(z).mean(-2)


def test_other_layers_fall_back_exactly_and_are_named():
  apply_fn, params = flax_layers.nnx_model(_Fallbacks(nnx.Rngs(0)))
  batch = (jax.random.normal(jax.random.key(0), (4, 6, 2)), jnp.arange(4) % 5)
  with pytest.warns(UserWarning, match="ghost clipping") as record:
    norms = jax.jit(ghost.ghost_norms(apply_fn, _xent))(params, batch)
  message = str(record[0].message)
  for name in ("circ", "masked", "grouped", "mine", "raw", "emb"):
    assert f"['{name}']" in message
  assert "['dense']" not in message                       # still covered
  np.testing.assert_allclose(norms, _vmap_norms(apply_fn, params, batch), rtol=2e-5)


def test_plain_pytree_models_use_the_layer_hook():
  """:func:`dpjax.sgd.ghost.layer` for a model without Flax: a ``lax`` convolution and a
  ``jnp.take`` lookup recorded with their kinds; with the plain ``dense`` it is the forward."""
  kind = ghost.ConvLayer((1,), "SAME", (1,), (1,))

  def conv(p, x):
    out = jax.lax.conv_general_dilated(x[None], p["w"], (1,), "SAME",
                                       dimension_numbers=("NWC", "WIO", "NWC"))[0]
    return out + p["b"]

  def apply_fn(params, x, *, dense):
    h = ghost.layer(dense, ghost.EmbedLayer(), {"w": params["emb"]}, x,
                    lambda p, ids: jnp.take(p["w"], ids, axis=0))
    h = jnp.tanh(ghost.layer(dense, kind, params["conv"], h, conv))
    return dense(params["out"], h.mean(0))

  rng = np.random.default_rng(0)
  params = {"emb": jnp.asarray(rng.normal(size=(7, 3)), jnp.float32),
            "conv": {"w": jnp.asarray(rng.normal(size=(3, 3, 4)), jnp.float32),
                     "b": jnp.zeros(4, jnp.float32)},
            "out": {"w": jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)}}
  batch = (jnp.asarray(rng.integers(0, 7, (5, 6))), jnp.arange(5))
  norms = _no_warnings(lambda: jax.jit(ghost.ghost_norms(apply_fn, _xent))(params, batch))
  np.testing.assert_allclose(norms, _vmap_norms(apply_fn, params, batch), rtol=2e-5)
  x = batch[0][0]
  np.testing.assert_allclose(apply_fn(params, x, dense=ghost.dense),
                             ghost.dense(params["out"], jnp.tanh(conv(
                                 params["conv"], params["emb"][x])).mean(0)), rtol=1e-6)


def test_apply_fn_is_the_model_and_leaves_it_untouched():
  """Without the ghost hook ``apply_fn`` is the model on one example; the ghost path re-types
  only its own merged copy."""
  model = _CNN(nnx.Rngs(0))
  apply_fn, params = flax_layers.nnx_model(model)
  X, y = _images(0, 3)
  np.testing.assert_allclose(jax.vmap(lambda x: apply_fn(params, x))(X), model(X), rtol=1e-5,
                             atol=1e-6)
  jax.jit(sgd.ghost_clipped_grad_sum(apply_fn, _xent, clip_norm=C))(params, (X, y),
                                                                     jnp.ones(3))
  assert type(model.c1) is nnx.Conv and type(model.d) is nnx.Linear
  module = _LinenModel()
  ids, _ = _tokens(0, 2)
  variables = module.init(jax.random.key(0), ids)
  apply_fn = flax_layers.linen_apply(module)
  np.testing.assert_allclose(jax.vmap(lambda i: apply_fn(variables["params"], i))(ids),
                             module.apply(variables, ids), rtol=1e-5, atol=1e-6)
  unbatched = flax_layers.nnx_apply(nnx.split(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))[0],
                                    batched=False)
  assert unbatched(nnx.split(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))[1], jnp.ones(3)).shape == (2,)


def test_deterministic_and_inside_a_poisson_step():
  """Same inputs, same sum; the grad fn carries C and runs inside the sampled clipped sum."""
  apply_fn, params = _nnx(_CNN)
  ids, y = _images(6, 8)
  grad_fn = sgd.ghost_clipped_grad_sum(apply_fn, _xent, clip_norm=C)
  assert grad_fn.l2_norm_bound == C
  f = jax.jit(grad_fn)
  a, b = f(params, (ids, y), jnp.ones(8)), f(params, (ids, y), jnp.ones(8))
  assert all(np.array_equal(u, v) for u, v in zip(jax.tree_util.tree_leaves(a),
                                                 jax.tree_util.tree_leaves(b)))
  plan = sgd.dp_sgd_plan(grad_fn, num_examples=8, expected_batch_size=4, steps=2,
                         noise_multiplier=1.0, key=jax.random.key(0), delta=1e-5)
  state = plan.noise.init(params)
  summed = jax.jit(plan.clipped_sum)(params, plan.prepare((ids, y)), state)
  assert jax.tree_util.tree_structure(summed) == jax.tree_util.tree_structure(params)


def test_gep_with_a_flax_model():
  """GEP by ghost clipping on an NNX model: a conv kernel with a basis (on its first axis, as
  the vmap path splits it) falls back to ``vmap(grad)``, the other layers are ghost-clipped
  whole into the embedding; equal to the vmap path's split."""
  apply_fn, params = _nnx(_Conv1D)
  batch = (jax.random.normal(jax.random.key(1), (5, 9, 3)), jnp.arange(5) % 5)
  bases = jax.tree_util.tree_map_with_path(                 # on the kernel's first axis (kw = 2)
      lambda path, _: jnp.eye(2, 1, dtype=jnp.float32)
      if jax.tree_util.keystr(path).startswith("['c2']['kernel']") else None, params)
  with pytest.warns(UserWarning, match=r"\['c2'\]\['kernel'\]"):
    got = jax.jit(sgd.ghost_clipped_grad_sum(apply_fn, _xent, embedding_clip=0.3,
                                             residual_clip=0.2))(params, batch, jnp.ones(5),
                                                                 bases)
  want = jax.jit(sgd.embedding_residual_grad_sum(ghost.model_loss(apply_fn, _xent),
                                                 embedding_clip=0.3, residual_clip=0.2))(
      params, batch, jnp.ones(5), bases)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: flax_layers.linen_apply(lambda x: x), TypeError, "flax.linen.Module"),
    (lambda: flax_layers.nnx_model({"w": 1}), TypeError, "flax.nnx.Module"),
    (lambda: flax_layers.nnx_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), batched=1), TypeError,
     "batched"),
    (lambda: flax_layers.linen_apply(_LinenModel(), batched="yes"), TypeError, "batched"),
])
def test_bad_arguments(call, exc, match):
  with pytest.raises(exc, match=match):
    call()
