"""Per-example gradients, global-norm clipping and the fused clipped sum (docs/algorithms.md §6.1)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from dpjax.sgd import per_example as pe
from helpers import normal


def _mlp_params(key):
  k1, k2 = jax.random.split(key)
  return {"hidden": {"w": normal(k1, (5, 4)), "b": jnp.zeros(4)},
          "out": {"w": normal(k2, (4, 3)), "b": jnp.zeros(3)}}


def _loss(params, example):
  x, y = example
  h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
  logits = h @ params["out"]["w"] + params["out"]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _batch(key, n=12):
  kx, ky = jax.random.split(key)
  return normal(kx, (n, 5)) * 3, jax.random.randint(ky, (n,), 0, 3)


@jax.jit
def _flat(tree):
  return jax.vmap(lambda g: ravel_pytree(g)[0])(tree)


# Jitted once for the module: op by op, each call of a new shape compiles tens of small programs.
_grads = jax.jit(pe.per_example_grads(_loss))
_norms = jax.jit(pe.global_norms)
_clip = jax.jit(pe.clip_per_example, static_argnums=1, static_argnames=("clipping", "stability"))
_sum = jax.jit(pe.clipped_grad_sum(_loss, clip_norm=0.7))           # C = 0.7: one program


def _flat_rows(tree):
  """``(B, p)`` NumPy matrix of the per-example pytrees, flattened."""
  return np.asarray(_flat(tree))


def test_vectorised_per_example_grads_equal_a_loop_of_single_example_grads():
  # Opacus-style: vmap(grad) against a Python loop of batch-of-one jax.grad, on a nested pytree.
  params, (X, y) = _mlp_params(jax.random.key(0)), _batch(jax.random.key(1))
  batched = _grads(params, (X, y))
  assert jax.tree_util.tree_structure(batched) == jax.tree_util.tree_structure(params)
  single_grad = jax.jit(jax.grad(_loss))
  # atol: the inputs (scale 3) saturate tanh, so some hidden-layer entries are (1 − h²)·O(10)
  # with h² within float32 rounding of 1, i.e. ~10⁻⁶ of rounding that the batched and single
  # programs round differently; a mixed-up example would be off by O(0.1).
  for i in range(X.shape[0]):
    single = single_grad(params, (X[i], y[i]))
    jax.tree_util.tree_map(
        lambda b, s: np.testing.assert_allclose(np.asarray(b[i]), np.asarray(s), rtol=1e-4,
                                                atol=1e-5), batched, single)


@pytest.mark.slow(reason="global_norms against flattened rows; the default clip tests rely on "
                         "it")
def test_global_norms_span_the_whole_pytree():
  params, batch = _mlp_params(jax.random.key(2)), _batch(jax.random.key(3))
  grads = pe.per_example_grads(_loss)(params, batch)
  expected = np.linalg.norm(_flat_rows(grads), axis=1)
  np.testing.assert_allclose(np.asarray(pe.global_norms(grads)), expected, rtol=1e-5)


def test_clipped_norms_are_bounded_and_small_ones_unchanged():
  params, batch = _mlp_params(jax.random.key(4)), _batch(jax.random.key(5))
  grads = _grads(params, batch)
  norms = np.asarray(_norms(grads))
  C = float(np.median(norms))
  clipped = _clip(grads, C)
  new = np.linalg.norm(_flat_rows(clipped), axis=1)
  assert np.all(new <= C * (1 + 1e-5))
  small = norms <= C
  assert small.any() and (~small).any()
  np.testing.assert_array_equal(_flat_rows(clipped)[small], _flat_rows(grads)[small])
  np.testing.assert_allclose(new[~small], C, rtol=1e-5)            # large ones land on C
  # Clipping scales: the direction of every gradient is kept.
  cos = np.sum(_flat_rows(clipped) * _flat_rows(grads), 1) / (new * norms)
  np.testing.assert_allclose(cos, 1.0, rtol=1e-5)


def test_edge_cases_zero_nonfinite_and_huge_gradients():
  g = {"a": jnp.array([[0.0, 0.0], [jnp.nan, 1.0], [jnp.inf, 0.0], [3e30, 4e30], [0.3, 0.4]]),
       "b": jnp.array([0.0, 0.0, 0.0, 0.0, 0.0])}
  out = _clip(g, 1.0)
  a = np.asarray(out["a"])
  assert np.all(np.isfinite(a)) and np.all(np.isfinite(np.asarray(out["b"])))
  np.testing.assert_array_equal(a[0], [0.0, 0.0])                  # zero stays zero, no NaN
  np.testing.assert_array_equal(a[1:3], 0.0)                       # non-finite → dropped (zero)
  np.testing.assert_allclose(a[3], [0.6, 0.8], rtol=1e-5)          # ‖g‖² overflows float32
  np.testing.assert_allclose(a[4], [0.3, 0.4], rtol=1e-6)          # below C: unchanged


def test_normalised_clipping_bounds_every_term_and_keeps_directions():
  """``C·g/(‖g‖ + γ)``: norm < C for every input (huge, tiny, zero, non-finite), direction kept."""
  g = {"a": jnp.array([[0.0, 0.0], [jnp.nan, 1.0], [jnp.inf, 0.0], [3e30, 4e30], [0.3, 0.4],
                       [3e-9, 4e-9]]),
       "b": jnp.zeros(6)}
  C, gamma = 2.0, 0.01
  a = np.asarray(_clip(g, C, clipping="normalize", stability=gamma)["a"])
  assert np.all(np.isfinite(a))
  norms = np.linalg.norm(a, axis=1)
  assert np.all(norms <= C * (1 + 1e-6))                           # = C up to rounding when huge
  np.testing.assert_array_equal(a[:3], 0.0)                        # zero, NaN, inf rows
  np.testing.assert_allclose(a[3], [1.2, 1.6], rtol=1e-5)          # huge: norm → C
  np.testing.assert_allclose(a[4], C * np.array([0.3, 0.4]) / (0.5 + gamma), rtol=1e-5)
  np.testing.assert_allclose(a[5], C * np.array([3e-9, 4e-9]) / (5e-9 + gamma), rtol=1e-4)
  # Unlike "clip", a gradient below C is rescaled (every example gets about the same weight).
  b = np.asarray(_clip(g, C)["a"])
  assert np.linalg.norm(a[4]) > 3 * np.linalg.norm(b[4])


_LEAVE_ONE_OUT = np.concatenate([np.ones((1, 12)), 1 - np.eye(12)]).astype(np.float32)


def test_normalised_clipped_sum_moves_by_at_most_c_when_one_example_goes():
  params, batch = _mlp_params(jax.random.key(15)), _batch(jax.random.key(16))
  fn = jax.jit(pe.clipped_grad_sum(_loss, clip_norm=0.7, clipping="normalize"))
  # Row 0: all examples; row i + 1: example i removed.
  sums = jax.vmap(fn, in_axes=(None, None, 0))(params, batch, _LEAVE_ONE_OUT)
  rows = np.asarray(_flat(sums), np.float64)
  moves = np.linalg.norm(rows[0] - rows[1:], axis=1)
  assert max(moves) <= 0.7 and min(moves) > 0.5                    # all near C, none above
  assert fn.l2_norm_bound == 0.7


def test_clipped_grad_sum_is_the_masked_sum_of_clipped_grads():
  params, batch = _mlp_params(jax.random.key(6)), _batch(jax.random.key(7))
  mask = np.arange(12) % 3 != 0
  fused = _sum(params, batch, mask)
  rows = _flat_rows(_clip(_grads(params, batch), 0.7))
  expected = rows[np.asarray(mask)].sum(0)
  np.testing.assert_allclose(np.asarray(ravel_pytree(fused)[0]), expected, atol=1e-5)


def test_padded_rows_are_ignored_whatever_they_hold():
  params, (X, y) = _mlp_params(jax.random.key(8)), _batch(jax.random.key(9))
  mask = np.arange(12) < 7
  garbage = np.asarray(X).copy()
  garbage[7:] = np.nan                                             # padded rows: NaN inputs
  a = _sum(params, (X, y), mask)
  b = _sum(params, (garbage, y), mask)
  # Without the padded rows: the sum of the first 7 clipped gradients (no 7-row program).
  c = _flat_rows(_clip(_grads(params, (X, y)), 0.7))[:7].sum(0)
  np.testing.assert_allclose(np.asarray(ravel_pytree(a)[0]), np.asarray(ravel_pytree(b)[0]),
                             atol=1e-6)
  np.testing.assert_allclose(np.asarray(ravel_pytree(a)[0]), c, atol=1e-6)


def test_one_example_moves_the_sum_by_at_most_c():
  # Add/remove-one sensitivity: removing any single example changes the sum by ≤ C.
  params, batch = _mlp_params(jax.random.key(10)), _batch(jax.random.key(11))
  full = np.asarray(ravel_pytree(_sum(params, batch, np.ones(12, np.float32)))[0])
  for i in range(12):
    without = np.asarray(ravel_pytree(_sum(params, batch, _LEAVE_ONE_OUT[i + 1]))[0])
    assert float(np.linalg.norm(full - without)) <= 0.7 * (1 + 1e-5)


def test_pre_clipping_transform_clips_after_projecting():
  params, batch = _mlp_params(jax.random.key(12)), _batch(jax.random.key(13))
  p = ravel_pytree(params)[0].size
  V = jnp.asarray(np.linalg.qr(np.asarray(normal(14, (p, 3))))[0])
  project = lambda g: V.T @ ravel_pytree(g)[0]
  fn = jax.jit(pe.clipped_grad_sum(_loss, clip_norm=0.1, pre_clipping_transform=project))
  out = fn(params, batch, jnp.ones(12))
  assert out.shape == (3,)
  coords = _flat_rows(_grads(params, batch)) @ np.asarray(V)
  norms = np.linalg.norm(coords, axis=1, keepdims=True)
  expected = (coords * np.minimum(1.0, 0.1 / norms)).sum(0)
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: pe.clip_per_example({"a": jnp.ones((2, 2))}, 0.0), ValueError, "clip_norm"),
    (lambda: pe.clip_per_example({"a": jnp.ones((2, 2))}, -1.0), ValueError, "clip_norm"),
    (lambda: pe.clip_per_example({"a": jnp.ones((2, 2))}, float("inf")), ValueError,
     "clip_norm"),
    (lambda: pe.clip_per_example({"a": jnp.ones((2, 2)), "b": jnp.ones(3)}, 1.0), ValueError,
     "leading batch axis"),
    (lambda: pe.clipped_grad_sum(_loss, clip_norm=-0.1), ValueError, "clip_norm"),
    (lambda: pe.clipped_grad_sum(_loss, clip_norm=1.0, pre_clipping_transform=3), TypeError,
     "pre_clipping_transform"),
    (lambda: pe.per_example_grads("loss"), TypeError, "loss_fn"),
    (lambda: pe.clipped_grad_sum(_loss, clip_norm=1.0, clipping="auto"), ValueError,
     "clipping"),
    (lambda: pe.clip_per_example({"a": jnp.ones((2, 2))}, 1.0, clipping="normalize",
                                 stability=0.0), ValueError, "stability"),
    (lambda: pe.global_norms({}), ValueError, "grads"),
])
def test_bad_inputs(call, exc, match):
  with pytest.raises(exc, match=match):
    call()


# ------------------------------------------------- low precision: every clipped term is ≤ C

_MODELS = 20


def _exact_rows(tree):
  """Rows as float64 NumPy (a 16-bit or float32 value converts exactly)."""
  leaves = jax.tree_util.tree_leaves(tree)
  return np.concatenate([np.asarray(x.astype(jnp.float32) if x.dtype != jnp.float64 else x,
                                    np.float64).reshape(x.shape[0], -1) for x in leaves], 1)


def _exact_norms(rows):
  """Row norms in float64 without overflow: rows scaled by exact powers of two first."""
  scale = np.exp2(np.frexp(np.abs(rows).max(1, initial=0))[1]).reshape(-1, 1)
  scale[scale == 0] = 1.0
  return np.linalg.norm(rows / scale, axis=1) * scale[:, 0]


def _scaled_mlp_grads(dtype):
  """Per-example gradients of 20 random MLPs (one program), rescaled in float64 and rounded
  once into ``dtype``: rows with norms ≈ 1e-3, 1 ± 2⁻⁶, 1e3, and largest entries at 1/16 of
  the dtype's max (norms within its range). Returns the pytree ``(4·20·12, ...)``."""
  rng = np.random.default_rng(100)
  params = {"hidden": {"w": normal(101, (_MODELS, 5, 4)), "b": normal(102, (_MODELS, 4)) * 0.1},
            "out": {"w": normal(103, (_MODELS, 4, 3)), "b": normal(104, (_MODELS, 3)) * 0.1}}
  batch = normal(105, (_MODELS, 12, 5)) * 3, jnp.asarray(rng.integers(0, 3, (_MODELS, 12)))
  grads = jax.jit(jax.vmap(pe.per_example_grads(_loss)))(params, batch)
  leaves, treedef = jax.tree_util.tree_flatten(grads)
  leaves = [np.asarray(x, np.float64).reshape((-1,) + x.shape[2:]) for x in leaves]
  norms = np.sqrt(sum(np.sum(x.reshape(len(x), -1) ** 2, 1) for x in leaves))
  amax = np.max([np.abs(x).reshape(len(x), -1).max(1) for x in leaves], axis=0)
  jitter = 1 + np.random.default_rng(0).uniform(-2 ** -6, 2 ** -6, len(norms))
  scales = [(1e-3 / norms, 1.0), (jitter / norms, 1.0), (1e3 / norms, 1.0),
            (1 / amax, float(jnp.finfo(dtype).max) / 16)]          # no overflow on the way
  return jax.tree_util.tree_unflatten(treedef, [
      jnp.asarray(np.concatenate([x * s.reshape((-1,) + (1,) * (x.ndim - 1)) * t
                                  for s, t in scales]), dtype) for x in leaves])


_clip_any = jax.jit(pe.clip_per_example, static_argnums=1,
                    static_argnames=("clipping", "stability"))


_WIDE = pytest.mark.slow(reason="float32 and float64 terms within C; the default run checks the "
                                "16-bit dtypes, where the old clipping overran C most")


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16,
                                   pytest.param(jnp.float32, marks=_WIDE),
                                   pytest.param(jnp.float64, marks=_WIDE)])
def test_clipped_terms_never_exceed_c_in_any_dtype(dtype):
  """Issue 34 §3: ‖clip(g)‖ ≤ C evaluated exactly (float64) over the materialised values, for
  gradients at 1e-3 C, ≈ C, 1e3 C and near the dtype's max, a tiny C (float16: subnormal
  outputs), both clippings; the norms match the float64 reference; no needless shrinking."""
  with jax.enable_x64(dtype == jnp.float64):
    grads = _scaled_mlp_grads(dtype)
    g = _exact_rows(grads)
    exact = _exact_norms(g)
    # Norms are accumulated in float32 (float64): accurate to ~1e-7 even for 16-bit rows.
    norms = np.asarray(_norms(grads), np.float64)
    assert norms.dtype == np.float64 and _norms(grads).dtype == pe.accumulation_dtype(dtype)
    np.testing.assert_allclose(norms, exact, rtol=4e-7 if dtype != jnp.float64 else 1e-14)
    u = float(jnp.finfo(dtype).eps) / 2
    tiny = 2.0 ** -20 if dtype == jnp.float16 else 1e-30
    for C, clipping in ((1.0, "clip"), (1.0, "normalize"), (tiny, "clip")):
      out = _clip_any(grads, C, clipping=clipping)
      assert all(a.dtype == dtype for a in jax.tree_util.tree_leaves(out))
      y = _exact_rows(out)
      assert np.all(np.isfinite(y))
      new = _exact_norms(y)
      assert new.max() <= C, (clipping, C, new.max() / C - 1)
      if C == tiny and dtype == jnp.float16:
        continue          # entries at float16's subnormal spacing: bounded, not accurate
      # Rounding towards zero loses < 1 ulp per entry (2u relative), the margin ~1e-6.
      target = C * exact / (exact + pe.DEFAULT_STABILITY) if clipping == "normalize" else (
          np.minimum(exact, C))
      np.testing.assert_allclose(new, target, rtol=2 * u + 1e-5)
      cos = np.sum(y * g, 1) / (new * exact)
      np.testing.assert_allclose(cos, 1.0, atol=4 * u)
      if clipping == "clip" and C == 1.0:                          # below the bound: untouched
        small = exact <= C * (1 - 1e-4)
        assert small.sum() > 240                                   # 1e-3 C and ~half of ≈ C
        np.testing.assert_array_equal(y[small], g[small])


def test_round_toward_zero_never_lengthens_and_stays_within_one_ulp():
  t = np.concatenate([np.random.default_rng(1).standard_normal(4000) * 10.0 ** k
                      for k in (-9, -6, 0, 4, 5)] + [[0.0, -0.0, 7e4, -7e4]]).astype(np.float32)
  for dtype in (jnp.float16, jnp.bfloat16):
    y = np.asarray(pe.round_toward_zero(jnp.asarray(t), dtype).astype(jnp.float32), np.float64)
    nearest = np.asarray(jnp.asarray(t).astype(dtype).astype(jnp.float32), np.float64)
    t64 = t.astype(np.float64)
    assert np.all(np.abs(y) <= np.abs(t64)) and np.all(y * t64 >= 0)   # never longer
    # The nearest value where it is not longer, else one step shorter (≤ 1 ulp from t).
    np.testing.assert_array_equal(y[np.abs(nearest) <= np.abs(t64)],
                                  nearest[np.abs(nearest) <= np.abs(t64)])
    finite = np.isfinite(nearest)
    eps, sub = float(jnp.finfo(dtype).eps), float(jnp.finfo(dtype).smallest_subnormal)
    assert np.all(np.abs(t64 - y)[finite] <= np.abs(t64[finite]) * eps + sub)
  np.testing.assert_array_equal(                                   # overflow: ±max, not ±inf
      np.asarray(pe.round_toward_zero(jnp.asarray([7e4, -7e4, np.inf], jnp.float32),
                                      jnp.float16), np.float64), [65504.0, -65504.0, np.inf])


def test_clip_factor_rounds_down_and_the_margin_is_small():
  norms = jnp.asarray(np.geomspace(1e-3, 1e3, 999), jnp.float32)
  for clipping in ("clip", "normalize"):
    factor, keep = pe.clip_factor(norms, 1.0, clipping, num_entries=10 ** 6)
    f = np.where(np.asarray(keep), 1.0, np.asarray(factor, np.float64))
    rho = pe.clip_margin(jnp.float32, 10 ** 6)
    assert 1e-6 < rho < 1e-5                                      # the utility cost
    # f·N̂ ≤ C(1 − ρ) exactly, and within a few ulps of it.
    n = np.asarray(norms, np.float64)
    gamma = pe.DEFAULT_STABILITY if clipping == "normalize" else 0.0
    ideal = (1 - rho) / (n + gamma) if clipping == "normalize" else np.minimum(1, (1 - rho) / n)
    kept = np.asarray(keep)
    assert np.all(f[~kept] * n[~kept] <= 1 - rho)                  # what the bound needs
    np.testing.assert_allclose(f, ideal, rtol=3e-7)
    assert clipping == "normalize" or (kept == (n <= 1 - rho)).all()
  bad = pe.clip_factor(jnp.asarray([np.nan, np.inf, 0.0, 2.0], jnp.float32), 1.0)
  np.testing.assert_array_equal(np.asarray(bad[0])[:2], 0.0)
  assert not np.asarray(bad[1])[:2].any()


# ---- Per-layer clipping (issue 52 §2). ------------------------------------------------------

_PER_LAYER = [({"hidden": 1.0, "out": 0.5}, None),                       # a prefix: per layer
              ({"hidden": {"w": 1.0, "b": 0.25}, "out": {"w": 0.5, "b": 2.0}}, None),  # per leaf
              (1.0, "uniform"), (1.0, "by_size")]


def _groups(tree, clip):
  """The groups' subtrees and norms that clip_layers used (uniform / by_size: per leaf)."""
  if isinstance(clip, float):
    return [(tree, clip)]
  if isinstance(clip, tuple) and not isinstance(clip, dict) and hasattr(clip, "per_layer"):
    leaves = jax.tree_util.tree_leaves(tree)
    sizes = np.asarray([np.prod(x.shape[1:]) for x in leaves], np.float64)
    share = (np.full(len(leaves), 1 / len(leaves)) if clip.per_layer == "uniform"
             else sizes / sizes.sum())
    return list(zip(leaves, clip.clip_norm * np.sqrt(share)))
  return [(tree[k], c) for k, c in clip.items()] if all(
      isinstance(c, float) for c in clip.values()) else [
      (tree[k][j], c) for k, sub in clip.items() for j, c in sub.items()]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("clip_norm, per_layer", _PER_LAYER)
def test_per_layer_clipping_bounds_each_group_and_the_term_by_the_carried_bound(
    dtype, clip_norm, per_layer):
  """Every group's clipped norm ≤ its C_g and every term ≤ Δ = √(Σ C_g²) (the bound the sum
  carries; C for a split), evaluated exactly over the materialised 16-bit values of gradients
  at 1e-3, ≈ 1, 1e3 times C and near the dtype's max, both clippings."""
  grads = _scaled_mlp_grads(dtype)
  clip, bound = pe.layer_clip_norms(clip_norm, per_layer)
  fn = pe.clipped_grad_sum(_loss, clip_norm=clip_norm, per_layer=per_layer)
  assert fn.l2_norm_bound == bound
  norms = [c for _, c in _groups(grads, clip)]
  assert bound >= np.sqrt(np.sum(np.square(norms))) * (1 - 1e-9)
  if per_layer is not None:
    assert bound == clip_norm
  for clipping in ("clip", "normalize"):
    out = jax.jit(jax.vmap(lambda g: pe.clip_layers(g, clip, clipping)))(grads)
    assert all(a.dtype == dtype for a in jax.tree_util.tree_leaves(out))
    assert _exact_norms(_exact_rows(out)).max() <= bound
    for (sub, c) in _groups(out, clip):
      assert _exact_norms(_exact_rows(sub)).max() <= c, (clipping, c)
    # Groups below their norm are untouched ("clip"): per-layer is not global clipping.
    if clipping == "clip":
      for (before, c), (after, _) in zip(_groups(grads, clip), _groups(out, clip)):
        small = _exact_norms(_exact_rows(before)) <= c * (1 - 1e-3)
        np.testing.assert_array_equal(_exact_rows(after)[small], _exact_rows(before)[small])


def test_per_layer_clipping_zeroes_a_non_finite_group_only_and_moves_the_sum_by_at_most_delta():
  params = _mlp_params(jax.random.key(3))
  X, y = _batch(jax.random.key(4), 6)
  fn = jax.jit(pe.clipped_grad_sum(_loss, clip_norm={"hidden": 1.0, "out": 0.5}))
  delta = pe.clipped_grad_sum(_loss, clip_norm={"hidden": 1.0, "out": 0.5}).l2_norm_bound
  assert delta == pytest.approx(np.sqrt(1.25), rel=1e-10) and delta >= np.sqrt(1.25)
  full = fn(params, (X * 50, y), jnp.ones(6))
  for i in range(6):
    mask = jnp.ones(6).at[i].set(0)
    moved = np.linalg.norm(np.asarray(_flat_rows(jax.tree_util.tree_map(
        lambda a, b: (a - b)[None], full, fn(params, (X * 50, y), mask))), np.float64))
    assert moved <= delta * (1 + 1e-5)
  grads = {"hidden": {"w": jnp.full((1, 5, 4), jnp.nan), "b": jnp.ones((1, 4))},
           "out": {"w": jnp.ones((1, 4, 3)), "b": jnp.ones((1, 3))}}
  clip, _ = pe.layer_clip_norms({"hidden": 1.0, "out": 0.5})
  out = jax.vmap(lambda g: pe.clip_layers(g, clip))(grads)
  assert not np.any(np.asarray(out["hidden"]["w"])) and not np.any(np.asarray(out["hidden"]["b"]))
  assert np.linalg.norm(_exact_rows(out["out"])) == pytest.approx(0.5, rel=1e-5)


def test_the_plan_noise_reads_the_per_layer_bound():
  import dpjax
  fn = pe.clipped_grad_sum(_loss, clip_norm={"hidden": 3.0, "out": 4.0})
  assert fn.l2_norm_bound == pytest.approx(5.0, rel=1e-10)
  plan = dpjax.sgd.dp_sgd_plan(fn, num_examples=100, expected_batch_size=10, steps=5,
                               noise_multiplier=1.0, key=jax.random.key(0))
  params = _mlp_params(jax.random.key(1))
  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  state = plan.init(params, optax.sgd(1.0))
  noisy, _ = plan.transform(optax.identity()).update(zeros, state, params)
  std = np.std(np.concatenate([np.asarray(x).ravel() for x in jax.tree_util.tree_leaves(noisy)]))
  assert std * 10 == pytest.approx(5.0, rel=0.15)    # the mean's std is σΔ/L with Δ = 5


@pytest.mark.parametrize("clip_norm, per_layer, match", [
    ({"hidden": 1.0, "out": -1.0}, None, "clip_norm"),
    ({"hidden": 1.0}, "uniform", "float"),
    (1.0, "per_leaf", "per_layer"),
    ({}, None, "at least one group"),
])
def test_bad_per_layer_norms(clip_norm, per_layer, match):
  with pytest.raises(ValueError, match=match):
    pe.clipped_grad_sum(_loss, clip_norm=clip_norm, per_layer=per_layer)


def test_per_layer_norms_that_are_not_a_prefix_are_refused_at_the_first_call():
  fn = pe.clipped_grad_sum(_loss, clip_norm={"hidden": 1.0, "output": 0.5})
  with pytest.raises(ValueError, match="prefix"):
    fn(_mlp_params(jax.random.key(0)), _batch(jax.random.key(1), 4), jnp.ones(4))
