"""Subspace sources (dpjax/sgd/sources.py): per-example gradient matrices, public and private
(DPASE) gradient bases, public and private (Analyze Gauss) input bases."""

import functools

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_accounting import NeighboringRelation
from jax.flatten_util import ravel_pytree

from dpjax import accounting, data, metrics, sgd
from dpjax.sgd import per_example, sources as ss
from dpjax.subspace import baselines
from helpers import normal

# The private source runs the real DPASE (written alongside); skip only if that module is absent.
approximate = pytest.importorskip("dpjax.subspace.approximate")


def _loss(w, example):
  x, y = example
  return optax.sigmoid_binary_cross_entropy(x @ w, y)


def _tree_loss(params, example):
  x, y = example
  return optax.sigmoid_binary_cross_entropy(x @ params["w"] + params["b"], y)


# Same shapes and DPASE parameters as tests/sgd/test_training.py (one compilation).
EPS_S, DELTA_S = 1.0, 1e-5 * 0.1


@functools.lru_cache(maxsize=None)
def _logistic(n, d=20, k=3, seed=0):
  # Gradients lie in span(B). Jitted: the values of op by op, with less compilation.
  X, B = jax.jit(data.exact_subspace_data, static_argnums=(1, 2, 3))(
      jax.random.key(seed), n, d, k)
  y = (X @ B[:, 0] > 0).astype(jnp.float32)
  return X, y, B


@pytest.mark.slow(reason="flat gradients vs vmap, chunks of 8 and 256; the public subspace test "
                         "uses them by default")
def test_flat_per_example_grads_match_vmap_and_do_not_depend_on_chunking():
  X, y, _ = _logistic(37)
  params = {"w": normal(1, (20,)) * 0.1, "b": jnp.ones(())}
  G = ss.flat_per_example_grads(_tree_loss, params, (X, y), chunk_size=8)
  assert G.shape == (37, 21) and G.dtype == jnp.float32
  batched = per_example.per_example_grads(_tree_loss)(params, (X, y))
  expected = jax.vmap(lambda g: ravel_pytree(g)[0])(batched)
  np.testing.assert_allclose(np.asarray(G), np.asarray(expected), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(ss.flat_per_example_grads(_tree_loss, params, (X, y))),
                             np.asarray(G), rtol=1e-6, atol=1e-7)


def test_public_subspace_captures_an_exactly_low_rank_gradient_space():
  X, y, B = _logistic(100)
  res = ss.public_gradient_subspace(_loss, jnp.zeros(20), (X, y), k=3)
  assert bool(res.ok) and res.epsilon == 0.0 and res.delta == 0.0
  assert res.neighboring is None and res.info == {"num_public": 100}
  assert res.basis.shape == (20, 3)
  np.testing.assert_allclose(np.asarray(res.basis.T @ res.basis), np.eye(3), atol=1e-4)
  assert float(metrics.projection_distance(res.basis, B)) < 1e-3


@pytest.mark.slow(reason="private_gradient_subspace finds span(B); by default only its argument "
                         "checks run")
def test_private_subspace_finds_an_exactly_low_rank_gradient_space_under_add_remove():
  X, y, B = _logistic(8_000)
  res = ss.private_gradient_subspace(jax.random.key(5), _loss, jnp.zeros(20), (X, y), k=3,
                                     epsilon=EPS_S, delta=DELTA_S, gamma=1e-6)
  assert res.neighboring == NeighboringRelation.ADD_OR_REMOVE_ONE and res.info["partition"] == "random_labels"
  assert (res.epsilon, res.delta) == (EPS_S, DELTA_S)
  assert bool(res.ok) and float(metrics.projection_distance(res.basis, B)) < 0.1


@pytest.mark.slow(reason="private_gradient_subspace's ⊥ on isotropic gradients; by default only "
                         "argument checks run")
def test_private_subspace_is_bottom_on_isotropic_gradients_and_still_pays():
  X = normal(6, (8_000, 20))
  y = (X[:, 0] > 0).astype(jnp.float32)
  res = ss.private_gradient_subspace(jax.random.key(7), _loss, jnp.zeros(20), (X, y), k=3,
                                     epsilon=EPS_S, delta=DELTA_S, gamma=1e-6)
  assert not bool(res.ok) and (res.epsilon, res.delta) == (EPS_S, DELTA_S)
  assert float(jnp.abs(res.basis).max()) == 0.0            # ⊥ carries no information


@pytest.mark.slow(reason="non-finite and clipped gradient rows; by default only the argument "
                         "checks run")
def test_private_subspace_survives_non_finite_gradients_and_clips_rows():
  X, y, B = _logistic(8_000)
  X = X.at[:3].set(jnp.inf)                                   # a few poisoned rows
  res = ss.private_gradient_subspace(jax.random.key(8), _loss, jnp.zeros(20), (X, y), k=3,
                                     epsilon=EPS_S, delta=DELTA_S, gamma=1e-6, clip_norm=0.5)
  assert bool(res.ok) and float(metrics.projection_distance(res.basis, B)) < 0.1
  G = ss._sanitise_rows(jnp.array([[3.0, 4.0], [jnp.nan, 1.0], [0.3, 0.4]]), 1.0, True)
  np.testing.assert_allclose(np.asarray(G), [[0.6, 0.8], [0.0, 0.0], [0.3, 0.4]], rtol=1e-6)


@pytest.mark.slow(reason="the streamed release equals DPASE on the stacked matrix; by default "
                         "only argument checks run")
def test_private_subspace_streams_the_same_dpase_as_the_materialised_gradient_matrix():
  """The gradients are made subset by subset (dpase on a gather function), never as an (N, p)
  matrix; the release equals DPASE with random labels on the stacked, sanitised matrix (same
  key)."""
  X, y, _ = _logistic(3_000)
  X = X.at[:2].set(jnp.inf)                                   # sanitised rows, both ways
  clip_norm = 0.5
  kwargs = dict(epsilon=EPS_S, delta=DELTA_S, k=3, gamma=1e-6)
  res = ss.private_gradient_subspace(jax.random.key(4), _loss, jnp.zeros(20), (X, y),
                                     clip_norm=clip_norm, **kwargs)
  G = ss._sanitise_rows(ss.flat_per_example_grads(_loss, jnp.zeros(20), (X, y)),
                        1.0 if clip_norm is None else clip_norm, clip_norm is not None)
  ref = approximate.dpase(jax.random.key(4), G, partition="random_labels", **kwargs)
  assert bool(res.ok) == bool(ref.ok) and bool(res.ok)
  assert int(res.released["winning_count"]) == int(ref.released["winning_count"])
  np.testing.assert_allclose(np.asarray(res.basis), np.asarray(ref.basis), atol=1e-4)
  assert res.info == ref.info and res.neighboring == ref.neighboring


@pytest.mark.parametrize("call,exc,match", [
    (lambda X, y: ss.public_gradient_subspace(_loss, jnp.zeros(20), (X, y), k=21), ValueError,
     "k"),
    (lambda X, y: ss.public_gradient_subspace(_loss, jnp.zeros(20), (X[:2], y[:2]), k=3),
     ValueError, "public_data"),
    (lambda X, y: ss.public_gradient_subspace(_loss, jnp.zeros(20), (X, y), k=1.5), TypeError,
     "k"),
    (lambda X, y: ss.private_gradient_subspace(jax.random.key(0), _loss, jnp.zeros(20), (X, y),
                                               k=0, epsilon=1.0, delta=1e-6, gamma=0.1),
     ValueError, "k"),
    (lambda X, y: ss.private_gradient_subspace(jax.random.key(0), _loss, jnp.zeros(20), (X, y),
                                               k=2, epsilon=1.0, delta=1e-6, gamma=0.1,
                                               partition="permutation"), ValueError,
     "random_labels"),
    (lambda X, y: ss.private_gradient_subspace(jax.random.key(0), _loss, jnp.zeros(20), (X, y),
                                               k=2, epsilon=1.0, delta=1e-6, gamma=0.1,
                                               clip_norm=0.0), ValueError, "clip_norm"),
    (lambda X, y: ss.private_gradient_subspace(0, _loss, jnp.zeros(20), (X, y), k=2,
                                               epsilon=1.0, delta=1e-6, gamma=0.1), TypeError,
     "key"),
    (lambda X, y: ss.flat_per_example_grads(_loss, jnp.zeros(20), (X, y[:5])), ValueError,
     "leading"),
    (lambda X, y: ss.flat_per_example_grads(_loss, jnp.zeros(20), (X, y), chunk_size=0),
     ValueError, "chunk_size"),
])
def test_bad_inputs(call, exc, match):
  X, y, _ = _logistic(100)                       # the public test's data (built once)
  with pytest.raises(exc, match=match):
    call(X, y)


# ----------------------------------------------------------------------------- input bases

def test_public_input_basis_is_the_top_right_singular_subspace_of_the_public_rows():
  X, _, B = _logistic(100)                       # rows in span(B), d = 20, k = 3
  U = sgd.public_input_basis(np.asarray(X), 3)
  assert U.shape == (20, 3) and U.dtype == np.float32
  np.testing.assert_allclose(U.T @ U, np.eye(3), atol=1e-5)
  assert float(metrics.projection_distance(jnp.asarray(U), B)) < 1e-3
  # Rotating the rows' coordinates rotates the basis (uncentred PCA is equivariant).
  Q = np.linalg.qr(np.random.default_rng(2).standard_normal((20, 20)))[0]
  rotated = sgd.public_input_basis(np.asarray(X, np.float64) @ Q, 3)
  np.testing.assert_allclose(rotated @ rotated.T, Q.T @ (U @ U.T) @ Q, atol=1e-4)


@pytest.mark.parametrize("inputs,rank,exc,match", [
    (np.ones(5), 1, ValueError, "public_inputs"),
    (np.full((4, 3), np.nan), 1, ValueError, "public_inputs"),
    (np.ones((4, 3)), 0, ValueError, "rank"),
    (np.ones((4, 3)), 4, ValueError, "rank"),
    (np.ones((2, 3)), 3, ValueError, "rank"),
    (np.ones((4, 3)), 1.5, TypeError, "rank"),
])
def test_public_input_basis_bad_inputs(inputs, rank, exc, match):
  with pytest.raises(exc, match=match):
    sgd.public_input_basis(inputs, rank)


def test_private_input_basis_is_analyze_gauss_on_the_inputs():
  """The release is Analyze Gauss under add/remove-one with the same key (an orthonormal (d, r)
  basis, its (ε, δ), relation and event), so it composes into the plan as its ``dp_event``: the
  (ε, δ) event (secure, default) or a Gaussian event (``secure=False``)."""
  X, _, B = _logistic(100)
  X = np.asarray(X)
  kw = dict(epsilon=2.0, delta=1e-6, clip_norm=10.0)
  add_remove = NeighboringRelation.ADD_OR_REMOVE_ONE
  res = sgd.private_input_basis(jax.random.key(3), X, 3, **kw)
  ref = baselines.analyze_gauss(jax.random.key(3), X, k=3, neighboring=add_remove, **kw)
  np.testing.assert_array_equal(np.asarray(res.basis), np.asarray(ref.basis))
  assert res.basis.shape == (20, 3) and bool(res.ok)
  np.testing.assert_allclose(np.asarray(res.basis.T @ res.basis), np.eye(3), atol=1e-5)
  assert (res.epsilon, res.delta) == (2.0, 1e-6) and res.neighboring == add_remove
  assert res.dp_event == accounting.EpsilonDeltaDpEvent(2.0, 1e-6)
  fast = sgd.private_input_basis(jax.random.key(3), X, 3, secure=False, **kw)
  assert fast.dp_event == dp_accounting.GaussianDpEvent(
      pytest.approx(accounting.analytic_gaussian_sigma(2.0, 1e-6)))
  other = sgd.private_input_basis(jax.random.key(4), X, 3, **kw)
  assert not np.array_equal(np.asarray(other.basis), np.asarray(res.basis))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(rank=0), ValueError, "k"),
    (dict(rank=21), ValueError, "k"),
    (dict(epsilon=0.0), ValueError, "epsilon"),
    (dict(delta=1.0), ValueError, "delta"),
    (dict(clip_norm=0.0), ValueError, "clip_norm"),
    (dict(key=3), TypeError, "key"),
])
def test_private_input_basis_bad_inputs(kwargs, exc, match):
  X = _logistic(100)[0]
  args = dict(key=jax.random.key(0), rank=2, epsilon=1.0, delta=1e-6, clip_norm=1.0) | kwargs
  key, rank = args.pop("key"), args.pop("rank")
  with pytest.raises(exc, match=match):
    sgd.private_input_basis(key, X, rank, **args)
