"""Ghost clipping with book-keeping: the vmap path's clipped sum without per-example gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from dpjax import sgd
from dpjax.sgd import ghost, noise, sampling
from dpjax.sgd import per_example as pe
from helpers import normal


def _mlp(num_layers, activation=jnp.tanh):
  def apply_fn(params, x, *, dense):
    for i in range(num_layers):
      x = dense(params[f"l{i}"], x)
      if i < num_layers - 1:
        x = activation(x)
    return x
  return apply_fn


def _params(seed, sizes, bias=True, dtype=jnp.float32):
  params = {}
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    # A Python float keeps the dtype (a NumPy scalar would promote 16-bit weights to float32).
    params[f"l{i}"] = {"w": normal(seed + i, (a, b), dtype) / float(np.sqrt(a))}
    if bias:
      params[f"l{i}"]["b"] = normal(seed + 100 + i, (b,), dtype) * 0.1
  return params


def _xent(logits, y):
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _batch(seed, n, shape, classes, dtype=jnp.float32):
  X = normal(seed, (n,) + shape, dtype) * 2
  y = jnp.asarray(np.random.default_rng(seed).integers(0, classes, (n,) + shape[:-1]))
  return X, y


def _flat(tree):
  return np.asarray(ravel_pytree(tree)[0])


def _vmap_grads(apply_fn, params, batch):
  """Per-example gradients by ``vmap(grad)`` (the reference), jitted."""
  return jax.jit(pe.per_example_grads(ghost.model_loss(apply_fn, _xent)))(params, batch)


def _vmap_norms(apply_fn, params, batch):
  """Their global norms, in the same program (op by op they compile ~20 small programs)."""
  return jax.jit(lambda p, b: pe.global_norms(pe.per_example_grads(
      ghost.model_loss(apply_fn, _xent))(p, b)))(params, batch)


def _both(apply_fn, **kwargs):
  """The ghost path and the vmap path (``clipped_grad_sum``) of the same model, jitted."""
  return (jax.jit(ghost.ghost_clipped_grad_sum(apply_fn, _xent, **kwargs)),
          jax.jit(pe.clipped_grad_sum(ghost.model_loss(apply_fn, _xent), **kwargs)))


@pytest.mark.parametrize("layers,bias,shape,clipping,dtype", [
    pytest.param(1, True, (5,), "clip", jnp.float64,
                 marks=pytest.mark.slow(reason="one layer, clip, float64; the default run checks "
                                               "two layers in float32")),
    (2, False, (5,), "normalize", jnp.float32),
    pytest.param(3, True, (4, 5), "clip", jnp.float32,  # sequence, Gram route (T² < a·b)
                 marks=pytest.mark.slow(reason="the Gram route for sequences (T² < a·b); the "
                                               "default run takes the direct route")),
    (2, True, (30, 3), "normalize", jnp.float32),  # sequence, direct route (T² ≥ a·b)
    pytest.param(3, False, (4, 5), "normalize", jnp.float64,
                 marks=pytest.mark.slow(reason="the Gram route in float64, normalized; the "
                                               "default run takes the direct route")),
])
def test_equals_the_vmap_path(layers, bias, shape, clipping, dtype):
  with jax.enable_x64(dtype == jnp.float64):
    sizes = [shape[-1], 6, 4, 3][:layers] + [3]
    params = _params(layers, sizes, bias, dtype)
    batch = _batch(7, 10, shape, 3, dtype)
    mask = jnp.arange(10) % 4 != 1                                   # padding rows
    norms = np.asarray(_vmap_norms(_mlp(layers), params, batch))
    C = float(np.median(norms))                                      # some rows clipped, some not
    assert (norms > C * 1.01).any() and (norms < C * 0.99).any()
    fast, ref = _both(_mlp(layers), clip_norm=C, clipping=clipping)
    out, expected = fast(params, batch, mask), ref(params, batch, mask)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(params)
    assert all(a.dtype == dtype and a.shape == b.shape for a, b in
               zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(params)))
    rtol = 1e-5 if dtype == jnp.float32 else 1e-12
    np.testing.assert_allclose(_flat(out), _flat(expected), rtol=rtol,
                               atol=rtol * np.abs(_flat(expected)).max())


@pytest.mark.slow(reason="extreme and non-finite rows on the ghost path; test_per_example checks "
                         "them on the vmap path")
def test_extreme_rows_bounded_and_norms_match():
  """Huge (1e30), tiny, zero, NaN and inf rows: each term ≤ C, non-finite rows give 0, and the
  ghost norms equal ``global_norms`` of the per-example gradients (|g|² overflows float32)."""
  apply_fn = _mlp(2, jax.nn.relu)
  params = _params(3, [4, 5, 3])
  X, y = _batch(4, 8, (4,), 3)
  X = (X.at[1].multiply(1e30).at[2].multiply(1e-30).at[3].set(0.0).at[4, 0].set(jnp.nan)
       .at[5, 1].set(jnp.inf).at[6].set(3e38))
  ours = np.asarray(jax.jit(ghost.ghost_norms(apply_fn, _xent))(params, (X, y)))
  grads = _vmap_grads(apply_fn, params, (X, y))
  theirs = np.asarray(pe.global_norms(grads))
  finite = np.isfinite(theirs)
  np.testing.assert_array_equal(np.isfinite(ours), finite)
  assert finite[:4].all() and not finite[4:7].any() and theirs[1] > 1e29
  np.testing.assert_allclose(ours[finite], theirs[finite], rtol=1e-5)
  C = 0.5
  for clipping in ("clip", "normalize"):
    fn = jax.jit(ghost.ghost_clipped_grad_sum(apply_fn, _xent, clip_norm=C, clipping=clipping))
    ref = jax.jit(lambda g: pe.clip_per_example(g, C, clipping=clipping))(grads)
    for i in range(8):
      term = _flat(fn(params, (X, y), jnp.arange(8) == i))
      assert np.all(np.isfinite(term)) and np.linalg.norm(term) <= C * (1 + 1e-5)
      expected = _flat(jax.tree_util.tree_map(lambda g: g[i], ref))
      np.testing.assert_allclose(term, expected, rtol=1e-5, atol=1e-6)
      if not finite[i]:
        np.testing.assert_array_equal(term, 0.0)                     # the example is dropped
    assert np.all(np.isfinite(_flat(fn(params, (X, y), jnp.ones(8, bool)))))


def test_padded_rows_ignored_whatever_they_hold_and_deterministic():
  fast, _ = _both(_mlp(2), clip_norm=1.0)
  params = _params(5, [5, 6, 3])
  X, y = _batch(6, 9, (5,), 3)
  mask = jnp.arange(9) < 6
  a = fast(params, (X, y), mask)
  b = fast(params, (X.at[6:].set(jnp.nan), y), mask)
  np.testing.assert_array_equal(_flat(a), _flat(b))
  np.testing.assert_array_equal(_flat(a), _flat(fast(params, (X, y), mask)))   # bitwise
  np.testing.assert_allclose(_flat(a), _flat(fast(params, (X[:6], y[:6]), jnp.ones(6))),
                             rtol=1e-6, atol=1e-7)


def _tied(params, x, *, dense):
  """Weight tying (``l0.w`` in two calls), a leaf read outside dense (``scale``), an unused leaf
  (``spare``) and an embedding-like leaf indexed directly (``table``)."""
  h = jnp.tanh(dense(params["l0"], x) * params["scale"]) + params["table"][0]
  h = jnp.tanh(dense({"w": params["l0"]["w"][:3, :3]}, h[:3]))        # a slice: a read
  return dense(params["l1"], jnp.concatenate([h, h[:2]]))


def test_uncovered_leaves_get_exact_per_example_gradients():
  params = _params(8, [5, 5, 3])
  params.update(scale=jnp.float32(1.3), table=normal(9, (2, 5)), spare=jnp.ones(4))
  batch = _batch(10, 6, (5,), 3)
  mask = jnp.arange(6) != 2
  fast, ref = _both(_tied, clip_norm=0.2)
  with pytest.warns(UserWarning, match=r"\['l0'\]\['w'\].*\['scale'\].*\['table'\]"):
    out = fast(params, batch, mask)
  np.testing.assert_allclose(_flat(out), _flat(ref(params, batch, mask)), rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(out["spare"]), 0.0)


@pytest.mark.slow(reason="the ghost path inside the Poisson loop; the equality tests run by "
                         "default")
def test_inside_poisson_clipped_sum_under_jit():
  apply_fn = _mlp(2)
  params = _params(11, [5, 6, 3])
  data = _batch(12, 40, (5,), 3)
  fast = ghost.ghost_clipped_grad_sum(apply_fn, _xent, clip_norm=0.4)
  ref = pe.clipped_grad_sum(ghost.model_loss(apply_fn, _xent), clip_norm=0.4)
  step = jax.jit(lambda fn, key: sampling.poisson_clipped_sum(fn, params, data, key,
                                                              sampling_prob=0.3,
                                                              microbatch_size=8),
                 static_argnums=0)
  for seed in (0, 1):
    key = jax.random.key(seed)
    np.testing.assert_allclose(_flat(step(fast, key)), _flat(step(ref, key)), rtol=1e-5,
                               atol=1e-6)
  plan = sgd.dp_sgd_plan(fast, num_examples=40, expected_batch_size=12, steps=3,
                         key=jax.random.key(2), noise_multiplier=1.0, microbatch_size=8)
  assert plan.grad_fn is fast and noise.l2_norm_bound(fast) == 0.4


def _bad_dense(params, x, *, dense):
  return dense({"w": params["l0"]["w"], "c": params["l0"]["b"]}, x)


def _call(apply_fn=_mlp(1), loss=_xent, batch=None, mask=None, params=None):
  params = _params(15, [5, 3]) if params is None else params
  batch = _batch(16, 4, (5,), 3) if batch is None else batch
  mask = jnp.ones(4, bool) if mask is None else mask
  return ghost.ghost_clipped_grad_sum(apply_fn, loss, clip_norm=1.0)(params, batch, mask)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: ghost.ghost_clipped_grad_sum(_mlp(1), _xent, clip_norm=0.0), ValueError,
     "clip_norm"),
    (lambda: ghost.ghost_clipped_grad_sum(_mlp(1), _xent, clip_norm=float("inf")), ValueError,
     "clip_norm"),
    (lambda: ghost.ghost_clipped_grad_sum(_mlp(1), _xent, clip_norm=1.0, clipping="auto"),
     ValueError, "clipping"),
    (lambda: ghost.ghost_clipped_grad_sum(_mlp(1), _xent, clip_norm=1.0, clipping="normalize",
                                          stability=0.0), ValueError, "stability"),
    (lambda: ghost.ghost_clipped_grad_sum("model", _xent, clip_norm=1.0), TypeError,
     "apply_fn"),
    (lambda: ghost.ghost_clipped_grad_sum(_mlp(1), None, clip_norm=1.0), TypeError,
     "example_loss"),
    (lambda: ghost.ghost_norms(_mlp(1), 3), TypeError, "example_loss"),
    (lambda: ghost.model_loss(None, _xent), TypeError, "apply_fn"),
    (lambda: _call(batch=jnp.ones((4, 5))), TypeError, "pair"),
    (lambda: _call(batch=(jnp.ones((4, 5)), jnp.zeros(3, int))), ValueError, "leading batch"),
    (lambda: _call(mask=jnp.ones(3, bool)), ValueError, "mask"),
    (lambda: _call(apply_fn=_bad_dense), ValueError, "dense params"),
    (lambda: _call(batch=(jnp.ones((4, 6)), jnp.zeros(4, int))), ValueError, "dense input"),
    (lambda: _call(loss=lambda logits, y: logits), TypeError, "real scalar"),
    (lambda: ghost.dense({"w": jnp.ones(3)}, jnp.ones(3)), ValueError, "2-D"),
    (lambda: ghost.dense({"w": jnp.ones((3, 2)), "b": jnp.ones(3)}, jnp.ones(3)), ValueError,
     "'b'"),
])
def test_bad_inputs(call, exc, match):
  with pytest.raises(exc, match=match):
    call()


# ------------------------------------------------- low precision: every clipped term is ≤ C

_MODELS, _ROWS = 20, 8


def _scaled_xent(logits, y):
  """Cross-entropy in float32 times a per-example scale carried by the target, back in the
  logits' dtype: the scale sets the example's gradient norm (1e-3 C ... near the dtype's max)."""
  label, scale = y
  loss = scale * jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), label))
  return loss.astype(logits.dtype)


def _exact_norms(rows):
  """Row norms in float64 without overflow (rows scaled by exact powers of two first)."""
  scale = np.exp2(np.frexp(np.abs(rows).max(1, initial=0))[1]).reshape(-1, 1)
  scale[scale == 0] = 1.0
  return np.linalg.norm(rows / scale, axis=1) * scale[:, 0]


def _rows(tree, lead=2):
  """``(models·rows, p)`` float64 rows (exact conversion) of a pytree with ``lead`` axes."""
  leaves = jax.tree_util.tree_leaves(tree)
  return np.concatenate([np.asarray(x.astype(jnp.float32), np.float64).reshape(
      int(np.prod(x.shape[:lead])), -1) for x in leaves], 1)


def _terms(fn):
  """Per-example terms of ``fn`` for a stack of models: ``fn`` with one-hot masks, as the sum
  receives them (``(models, rows, ...)``), one program."""
  eye = jnp.eye(_ROWS, dtype=bool)
  return jax.jit(jax.vmap(lambda p, b: jax.vmap(lambda m: fn(p, b, m))(eye)))


def _models(dtype, shape=(5,), sizes=(5, 6, 3), seed=0):
  """20 random models and batches in ``dtype``; the targets carry per-example gradient scales
  placing the rows' norms at ~1e-3, ~1 (± 2⁻⁶), ~1e3 and 1/64 of the dtype's max (every entry
  below that)."""
  stack = lambda trees: jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)
  params = stack([_params(seed + 7 * s, list(sizes), True, dtype) for s in range(_MODELS)])
  X, y = stack([_batch(seed + 7 * s + 3, _ROWS, shape, 3, dtype) for s in range(_MODELS)])
  apply_fn = _mlp(len(sizes) - 1)
  ones = jnp.ones(y.shape[:2], jnp.float32)
  base = np.asarray(jax.jit(jax.vmap(ghost.ghost_norms(apply_fn, _scaled_xent)))(
      params, (X, (y, ones))), np.float64)
  jitter = 1 + np.random.default_rng(seed).uniform(-2 ** -6, 2 ** -6, base.shape)
  target = np.array([1e-3, 1.0, 1e3, float(jnp.finfo(dtype).max) / 64])[np.arange(_ROWS) % 4]
  scale = target * np.where(np.arange(_ROWS) % 4 == 1, jitter, 1.0) / base
  return apply_fn, params, (X, (y, jnp.asarray(scale, jnp.float32)))


def _check_terms(out, C, dtype, clipping, reference=None, slack=0.0):
  """Exact norms ≤ C; the clipped ones at C within the rounding towards zero; returns rows.
  ``slack``: the relative amount by which a clipped term may be shorter than the reference's
  (the Gram route clips against an upper bound of the norm)."""
  assert all(a.dtype == dtype for a in jax.tree_util.tree_leaves(out))
  y = _rows(out)
  assert np.all(np.isfinite(y))
  norms = _exact_norms(y)
  assert norms.max() <= C, (clipping, C, norms.max() / C - 1)
  u = float(jnp.finfo(dtype).eps) / 2
  if clipping == "clip":   # ≈ C and above: at C(1 − ρ), less < 1 ulp per entry (ρ < 1e-5)
    assert np.sum(norms >= C * (1 - 2 * u - 1e-5)) >= _MODELS * _ROWS // 2
  if reference is not None:
    np.testing.assert_allclose(y, reference, rtol=0, atol=(8 * u + slack) * C)
  return y


def _both_terms(apply_fn, C, clipping):
  """Per-example terms on the ghost and the vmap path (one program each)."""
  return (_terms(ghost.ghost_clipped_grad_sum(apply_fn, _scaled_xent, clip_norm=C,
                                              clipping=clipping)),
          _terms(pe.clipped_grad_sum(ghost.model_loss(apply_fn, _scaled_xent), clip_norm=C,
                                     clipping=clipping)))


_SLOW_OTHERS = pytest.mark.slow(reason="float16, float32 and normalize on both paths; the default "
                                       "run checks clip in bfloat16 here (float16's tiny-C case "
                                       "below), test_per_example the 16-bit dtypes on the vmap "
                                       "path")


@pytest.mark.parametrize("dtype,clipping", [
    pytest.param(jnp.float16, "clip", marks=_SLOW_OTHERS), (jnp.bfloat16, "clip"),
    pytest.param(jnp.float32, "clip", marks=_SLOW_OTHERS),
    pytest.param(jnp.bfloat16, "normalize", marks=_SLOW_OTHERS),
    pytest.param(jnp.float16, "normalize", marks=_SLOW_OTHERS),
    pytest.param(jnp.float32, "normalize", marks=_SLOW_OTHERS),
])
def test_low_precision_terms_within_c_on_both_paths(dtype, clipping):
  """Issue 34 §3: each example's term, exactly as the sum receives it, has norm ≤ C (float64
  over the stored values) on the ghost and the vmap path, 20 random MLPs, gradients from
  1e-3 C to near the dtype's max; the norms match."""
  apply_fn, params, batch = _models(dtype)
  grads = jax.jit(jax.vmap(pe.per_example_grads(ghost.model_loss(apply_fn, _scaled_xent))))(
      params, batch)
  vmap_norms = np.asarray(jax.jit(jax.vmap(pe.global_norms))(grads), np.float64).ravel()
  np.testing.assert_allclose(vmap_norms, _exact_norms(_rows(grads)), rtol=4e-7)
  assert vmap_norms.max() > float(jnp.finfo(dtype).max) / 128
  ghost_norms = np.asarray(jax.jit(jax.vmap(ghost.ghost_norms(apply_fn, _scaled_xent)))(
      params, batch), np.float64).ravel()
  # The vmap path's gradients are the products x·δ rounded to the dtype; the ghost norm is
  # ‖x‖‖δ‖ of the unrounded products: equal to the dtype's rounding.
  np.testing.assert_allclose(ghost_norms, vmap_norms, rtol=max(float(jnp.finfo(dtype).eps),
                                                               1e-6))
  fast, ref = _both_terms(apply_fn, 1.0, clipping)
  expected = _check_terms(ref(params, batch), 1.0, dtype, clipping)
  _check_terms(fast(params, batch), 1.0, dtype, clipping, reference=expected)


@pytest.mark.parametrize("dtype,shape,C,route", [
    (jnp.float16, (5,), 2.0 ** -20, "vector"),      # tiny C: float16 subnormal outputs
    pytest.param(jnp.bfloat16, (5,), 1e-30, "vector", marks=pytest.mark.slow(
        reason="a tiny C in bfloat16; float16's subnormal case runs by default")),
    pytest.param(jnp.bfloat16, (4, 5), 1.0, "gram", marks=pytest.mark.slow(  # T² < a·b
        reason="the Gram sequence route in bfloat16; float16's tiny C runs by default")),
    pytest.param(jnp.bfloat16, (30, 3), 1.0, "direct", marks=pytest.mark.slow(  # T² ≥ a·b
        reason="the direct sequence route in bfloat16; the Gram route runs by default")),
    pytest.param(jnp.float16, (4, 5), 1.0, "gram", marks=pytest.mark.slow(
        reason="the Gram route in float16; bfloat16 runs by default")),
    pytest.param(jnp.float32, (4, 5), 1.0, "gram", marks=pytest.mark.slow(
        reason="the Gram route in float32; bfloat16 runs by default")),
])
def test_ghost_terms_within_c_for_tiny_c_and_sequences(dtype, shape, C, route):
  """The ghost path's terms stay ≤ C (exactly, over the stored values) with a tiny C and on
  both sequence routes, and equal the vmap path's (where C is not tiny) to the dtype's
  rounding — on the Gram route to that and the slack of its proven norm bound (at most about
  ½(a + b + T)·T·u relative: a clipped term is that much shorter; docs/algorithms.md §6.1.1)."""
  apply_fn, params, batch = _models(dtype, shape=shape, sizes=(shape[-1], 6, 3), seed=40)
  steps = shape[0] if len(shape) == 2 else 1
  assert route == ("vector" if steps == 1 else "gram" if steps ** 2 < shape[-1] * 6
                   else "direct")
  fast, ref = _both_terms(apply_fn, C, "clip")
  out = fast(params, batch)
  if C < 1e-3:
    y = _check_terms(out, C, dtype, "tiny")
    assert np.sum(_exact_norms(y) >= C * 0.75) >= _MODELS * _ROWS // 2   # still near C
  else:
    u = float(jnp.finfo(jnp.float32).eps) / 2             # the bound is in float32
    slack = (shape[-1] + 6 + 2 * steps) * steps * u if route == "gram" else 0.0
    _check_terms(out, C, dtype, "clip", reference=_check_terms(ref(params, batch), C, dtype,
                                                                "clip"), slack=slack)


def _scan_rnn(params, x, *, dense):
  """A recurrent cell in ``lax.scan`` whose body closes over the parameters, then a readout."""
  def step(h, xt):
    h = jnp.tanh(dense(params["cell"], jnp.concatenate([h, xt])))
    return h, None
  h, _ = jax.lax.scan(step, jnp.zeros(4, x.dtype), x)
  return dense(params["out"], h)


def _checkpointed(params, x, *, dense):
  """``dense`` inside ``jax.checkpoint`` (closing over the parameters) and at the top level."""
  h = jax.checkpoint(lambda x: jnp.tanh(dense(params["l0"], x)))(x)
  return dense(params["l1"], h)


def test_dense_inside_scan_or_checkpoint_falls_back_to_vmap_grad():
  """Issue 34 §5: ``dense`` inside a lax.scan body (parameters closed over) or jax.checkpoint
  used to raise UnexpectedTracerError; now those leaves fall back to vmap(grad) as documented
  (a UserWarning names them), the top-level layers keep ghost norms, and the sum equals the
  vmap path's."""
  rnn = {"cell": {"w": normal(50, (7, 4)) / 2, "b": normal(51, (4,)) * 0.1},
         "out": {"w": normal(52, (4, 3)) / 2}}
  mlp = _params(53, [5, 6, 3])
  for apply_fn, params, shape, names in (
      (_scan_rnn, rnn, (6, 3), r"\['cell'\]\['b'\], \['cell'\]\['w'\] are not"),
      (_checkpointed, mlp, (5,), r"\['l0'\]\['b'\], \['l0'\]\['w'\] are not")):
    batch = _batch(54, 5, shape, 3)
    batch = batch[0], batch[1][:, 0] if len(shape) == 2 else batch[1]
    mask = jnp.arange(5) != 3
    fast, ref = _both(apply_fn, clip_norm=0.3)
    with pytest.warns(UserWarning, match=names):
      out = fast(params, batch, mask)
    np.testing.assert_allclose(_flat(out), _flat(ref(params, batch, mask)), rtol=1e-5,
                               atol=1e-7)


@pytest.mark.parametrize("clip", [{"l0": 0.3, "l1": 0.2}, {"l0": {"w": 0.3, "b": 0.05}, "l1": 0.2},
                                  "uniform", "by_size"])
def test_per_layer_clipping_equals_the_vmap_path_and_bounds_each_group(clip):
  """Ghost clipping per layer (issue 52 §2): each group clipped by its own ghost norms at C_g;
  the sum equals clipped_grad_sum's per-layer sum, the carried Δ is the same, and every
  example's term has each group within C_g (one example at a time, rows scaled up to 10⁴)."""
  kwargs = ({"clip_norm": 0.4, "per_layer": clip} if isinstance(clip, str)
            else {"clip_norm": clip})
  params = _params(3, [5, 6, 3])
  X, y = _batch(8, 12, (5,), 3)
  X = X * jnp.logspace(-2, 4, 12)[:, None]
  mask = jnp.arange(12) % 5 != 2
  fast, ref = _both(_mlp(2), **kwargs)
  np.testing.assert_allclose(_flat(fast(params, (X, y), mask)), _flat(ref(params, (X, y), mask)),
                             rtol=1e-5, atol=1e-6)
  grad_fn = ghost.ghost_clipped_grad_sum(_mlp(2), _xent, **kwargs)
  assert grad_fn.l2_norm_bound == pe.clipped_grad_sum(_xent, **kwargs).l2_norm_bound
  clip_tree, _ = pe.layer_clip_norms(kwargs["clip_norm"], kwargs.get("per_layer"))
  groups, norms = pe.leaf_groups(params, clip_tree)
  one = jax.jit(lambda i: fast(params, (jax.lax.dynamic_slice_in_dim(X, i, 1),
                                        jax.lax.dynamic_slice_in_dim(y, i, 1)), jnp.ones(1, bool)))
  for i in range(12):
    leaves = jax.tree_util.tree_leaves(one(i))
    for g, c in enumerate(norms):
      sq = sum(float(np.sum(np.square(np.asarray(x, np.float64))))
               for x, gi in zip(leaves, groups) if gi == g)
      assert np.sqrt(sq) <= c * (1 + 1e-6)
  with pytest.raises(ValueError, match="per_layer"):
    ghost.ghost_clipped_grad_sum(_mlp(2), _xent, embedding_clip=1.0, residual_clip=1.0,
                                 per_layer="uniform")
