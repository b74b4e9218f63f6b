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
