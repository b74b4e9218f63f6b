"""Subspace bases: their checks, their norm bounds, bases_like and the trajectory source
(dpjax/sgd/bases.py; docs/algorithms.md §6.2, §6.4)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.sgd import bases as bases_lib
from dpjax.sgd.bases import TwoSidedBasis
from helpers import normal


def _params():
  return {"layers": [{"w": jnp.zeros((6, 4)), "b": jnp.zeros(4)},
                     {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}],
          "conv": jnp.zeros((5, 2, 2))}


def _orthonormal(key, a, r):
  return jnp.asarray(np.linalg.qr(np.asarray(normal(key, (a, r))))[0])   # NumPy: no compile


def _bases(r=2):
  keys = jax.random.split(jax.random.key(0), 3)
  return {"layers": [{"w": _orthonormal(keys[0], 6, r), "b": None},
                     {"w": None, "b": None}],
          "conv": _orthonormal(keys[2], 5, r)}


# ------------------------------------------------------------------------- flat: check_basis

def test_basis_norm_bound_is_an_upper_bound():
  rng = np.random.default_rng(1)
  for p, k in [(10, 3), (200, 50), (5_000, 20)]:
    V = rng.standard_normal((p, k)) / math.sqrt(p)
    exact = np.linalg.norm(V, 2)
    bound = bases_lib.basis_norm_bound(V)
    assert exact <= bound <= exact * (1 + 1e-6)
    V32 = V.astype(np.float32)
    assert np.linalg.norm(V32.astype(np.float64), 2) <= bound


def test_partial_isometries_are_accepted_only_when_asked_and_checked_spectrally():
  """A basis with a zero column (the trajectory rank rule's) is a partial isometry: accepted with
  ``partial=True``; a column of norm 0.5 is neither orthonormal nor zero."""
  Q = np.asarray(_orthonormal(jax.random.key(5), 6, 3))
  partial = Q * np.array([1.0, 0.0, 1.0])
  assert bases_lib.check_basis(partial, partial=True) is not None
  assert bases_lib.basis_norm_bound(partial) == pytest.approx(1.0, rel=1e-6)
  with pytest.raises(ValueError, match="orthonormal columns"):
    bases_lib.check_basis(partial)
  with pytest.raises(ValueError, match="orthonormal or zero"):
    bases_lib.check_basis(Q * np.array([1.0, 0.5, 1.0]), partial=True)


@pytest.mark.parametrize("basis,exc,match", [
    (jnp.ones((5, 2)), ValueError, "orthonormal"),
    (jnp.eye(3)[:, 0], ValueError, "basis"),
    (jnp.ones((2, 3)) / 2, ValueError, "1 <= k <= p"),
    (jnp.zeros((3, 0)), ValueError, "1 <= k <= p"),
    (jnp.eye(3, dtype=jnp.int32), TypeError, "float"),
    (jnp.eye(3).at[0, 0].set(jnp.nan), ValueError, "NaN"),
    ("basis", TypeError, "float array"),
])
def test_check_basis_refuses_bad_bases(basis, exc, match):
  with pytest.raises(exc, match=match):
    bases_lib.check_basis(basis)


# ------------------------------------------------------------------- per-layer: check_layer_bases

def test_check_layer_bases_returns_arrays_and_keeps_none_and_two_sided_leaves():
  params = _params()
  bases = _bases()
  bases["layers"][1]["w"] = TwoSidedBasis(np.eye(4, 2), np.eye(3, 1))
  checked = bases_lib.check_layer_bases(bases, params)
  assert checked["layers"][0]["b"] is None and checked["layers"][1]["b"] is None
  assert isinstance(checked["layers"][1]["w"], TwoSidedBasis)
  assert isinstance(checked["layers"][1]["w"].left, jax.Array)
  np.testing.assert_array_equal(checked["conv"], bases["conv"])
  # A TwoSidedBasis is one leaf of a bases pytree, not two.
  assert len(jax.tree_util.tree_leaves(checked, is_leaf=bases_lib.is_basis)) == 5


@pytest.mark.parametrize("change,match", [
    ("rows", "must have 5 rows"), ("vector_leaf", "at least two axes"),
    ("structure", "structure"), ("none", "no projected leaf"),
    ("not_orthonormal", "orthonormal or zero"),
    ("right_rows", "right basis .* must have 4 rows"),
    ("left_rows", "left basis .* must have 6 rows")])
def test_bad_layer_bases_are_refused(change, match):
  params, bases = _params(), _bases()
  if change == "rows":
    bases["conv"] = _orthonormal(jax.random.key(1), 4, 2)
  elif change == "vector_leaf":
    bases["layers"][0]["b"] = _orthonormal(jax.random.key(1), 4, 2)
  elif change == "structure":
    del bases["conv"]
  elif change == "none":
    bases = jax.tree_util.tree_map(lambda _: None, bases)
  elif change == "not_orthonormal":
    bases["conv"] = bases["conv"] * 2.0
  elif change == "right_rows":
    bases["conv"] = TwoSidedBasis(bases["conv"], jnp.eye(3)[:, :1])
  else:
    bases["layers"][0]["w"] = TwoSidedBasis(jnp.eye(5)[:, :2], jnp.eye(4)[:, :2])
  with pytest.raises(ValueError, match=match):
    bases_lib.check_layer_bases(bases, params)


def test_bases_norm_bound_is_the_largest_block_and_at_least_one():
  """The per-layer release map is block diagonal: ν = max(1, max_ℓ ν̂_ℓ); a two-sided block
  ``‖UᵀSV‖_F ≤ ‖U‖₂‖S‖_F‖V‖₂`` is bounded by the product, attained by the canary E₀₀."""
  assert bases_lib.bases_norm_bound(_bases()) == pytest.approx(1.0, rel=1e-5)
  assert bases_lib.bases_norm_bound({"w": 0.5 * jnp.eye(6, 2), "b": None}) == 1.0
  stretched = _bases()
  stretched["conv"] = stretched["conv"].at[:, 0].multiply(1.5)
  assert bases_lib.bases_norm_bound(stretched) == pytest.approx(1.5, rel=1e-5)
  U = jnp.eye(6)[:, :2].at[0, 0].set(3.0)
  V = jnp.eye(4)[:, :2].at[0, 0].set(2.0)
  assert bases_lib.bases_norm_bound({"w": TwoSidedBasis(U, V), "b": None}) == pytest.approx(
      6.0, rel=1e-5)
  E = jnp.zeros((6, 4)).at[0, 0].set(1.0)
  assert float(jnp.linalg.norm(U.T @ E @ V)) == pytest.approx(6.0)


def test_bases_like_selects_leaves_by_path():
  params = _params()
  U = _orthonormal(jax.random.key(2), 6, 2)
  bases = bases_lib.bases_like(
      params, lambda path, w: U if "layers" in jax.tree_util.keystr(path)
      and w.ndim == 2 and w.shape[0] == 6 else None)
  assert jax.tree_util.tree_structure(
      jax.tree_util.tree_map(lambda _: 0, bases, is_leaf=bases_lib.is_basis)
  ) == jax.tree_util.tree_structure(params)
  assert bases["layers"][0]["w"] is U
  assert all(b is None for b in (bases["layers"][0]["b"], bases["layers"][1]["w"],
                                 bases["layers"][1]["b"], bases["conv"]))
  bases_lib.check_layer_bases(bases, params)               # the noise's check accepts it
  with pytest.raises(TypeError, match="select must be callable"):
    bases_lib.bases_like(params, U)


# -------------------------------------------------------------- trajectory bases (free source)

_trajectory = jax.jit(bases_lib.trajectory_bases,                  # one program per call shape
                      static_argnames=("rank", "min_dim", "edge_scale", "two_sided"))


def test_trajectory_bases_find_the_column_space_of_a_released_update():
  # A released update whose first layer is rank one plus noise: the basis finds its column space.
  key1, key2 = jax.random.split(jax.random.key(3))
  u = normal(key1, (6,))
  released = jax.tree_util.tree_map(lambda p: 0.01 * normal(key2, p.shape), _params())
  released["layers"][0]["w"] = released["layers"][0]["w"] + jnp.outer(u, jnp.ones(4))
  bases = _trajectory(released, rank=1)
  top = bases["layers"][0]["w"][:, 0]
  assert abs(float(top @ u)) / float(jnp.linalg.norm(u)) > 0.99
  assert bases["layers"][0]["b"] is None and bases["layers"][1]["w"].shape == (4, 1)
  assert bases["conv"].shape == (5, 1)
  bases_lib.check_layer_bases(bases, _params())            # a valid input to the noise
  with pytest.raises(ValueError, match="no leaf"):
    bases_lib.trajectory_bases({"b": jnp.zeros(3)}, 1)
  with pytest.raises(ValueError, match="rank"):
    bases_lib.trajectory_bases(released, 0)


def test_trajectory_rank_rule_keeps_only_directions_above_the_noise_edge():
  # 64 x 32 release: a planted rank-2 signal (singular values 60 and 40, far above the pure
  # noise's edge s(√a + √b) ≈ 13.7 at s = 1) plus N(0, 1) noise; rank 6 asked.
  k_u, k_v, k_n = jax.random.split(jax.random.key(4), 3)
  U = _orthonormal(k_u, 64, 2)
  V = _orthonormal(k_v, 32, 2)
  noise = normal(k_n, (64, 32))
  signal = U @ jnp.diag(jnp.array([60.0, 40.0])) @ V.T
  # A traced noise level: the rule runs under jit (shapes stay static).
  out = _trajectory({"w": signal + noise}, rank=6, noise_std=1.0, edge_scale=1.1)["w"]
  norms = np.linalg.norm(np.asarray(out), axis=0)
  np.testing.assert_allclose(norms, [1, 1, 0, 0, 0, 0], atol=1e-5)
  # The kept columns span the planted directions (principal angles' cosines near 1).
  np.testing.assert_allclose(np.linalg.svd(np.asarray(U.T @ out[:, :2]))[1], 1.0, atol=0.05)
  # Pure noise: nothing above the edge; without noise_std all 6 columns are kept.
  assert float(jnp.abs(_trajectory({"w": noise}, rank=6, noise_std=1.0,
                                   edge_scale=1.1)["w"]).max()) == 0.0
  full = _trajectory({"w": noise}, rank=6)["w"]
  np.testing.assert_allclose(np.asarray(full.T @ full), np.eye(6), atol=1e-5)
  # The same rule op by op (a concrete noise level) gives the same basis.
  eager = bases_lib.trajectory_bases({"w": signal + noise}, 6, noise_std=1.0, edge_scale=1.1)
  np.testing.assert_allclose(np.asarray(eager["w"]), np.asarray(out), atol=1e-5)
  bases_lib.check_layer_bases({"w": out}, {"w": jnp.zeros((64, 32))})   # a partial isometry
  with pytest.raises(ValueError, match="noise_std"):
    bases_lib.trajectory_bases({"w": noise}, 2, noise_std=-1.0)
  with pytest.raises(ValueError, match="edge_scale"):
    bases_lib.trajectory_bases({"w": noise}, 2, noise_std=1.0, edge_scale=0.0)


def test_two_sided_trajectory_bases_are_the_top_singular_pairs():
  rng = np.random.default_rng(0)
  G = rng.normal(size=(8, 5)) @ np.diag([5.0, 3.0, 0.1, 0.1, 0.1]) @ rng.normal(size=(5, 6))
  out = _trajectory({"w": jnp.asarray(G, jnp.float32), "b": jnp.zeros(6)}, rank=2,
                    two_sided=True)
  assert isinstance(out["w"], TwoSidedBasis) and out["b"] is None
  u, _, vt = np.linalg.svd(G)
  np.testing.assert_allclose(np.abs(out["w"].left.T @ u[:, :2]), np.eye(2), atol=1e-4)
  np.testing.assert_allclose(np.abs(out["w"].right.T @ vt[:2].T), np.eye(2), atol=1e-4)
  # the rank rule zeroes the same directions on both sides
  ruled = _trajectory({"w": jnp.asarray(G, jnp.float32)}, rank=3, noise_std=0.5,
                      two_sided=True)["w"]
  np.testing.assert_allclose(np.linalg.norm(ruled.left, axis=0),
                             np.linalg.norm(ruled.right, axis=0), atol=1e-5)
  assert 0 < float(np.linalg.norm(ruled.left, axis=0).sum()) < 3
  bases_lib.check_layer_bases({"w": ruled}, {"w": jnp.zeros((8, 6))})


def test_equinox_out_in_kernels_take_an_input_basis_by_layout():
  """Issue 53: Equinox stores kernels (out, in); README (b)'s select matched no leaf and the
  error did not lead to the fix. layout='out_in' projects their input side, and the errors name
  the fix."""
  import equinox as eqx
  import optax
  from dpjax import sgd
  model = eqx.nn.MLP(12, 3, width_size=8, depth=1, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  U = np.linalg.qr(np.random.default_rng(0).normal(size=(12, 4)))[0].astype(np.float32)
  assert params.layers[0].weight.shape == (8, 12)

  def loss(p, example):
    logits = eqx.combine(p, static)(example[0])
    return optax.softmax_cross_entropy_with_integer_labels(logits, example[1])
  grad_fn = sgd.clipped_grad_sum(loss, clip_norm=1.0)
  common = dict(num_examples=64, expected_batch_size=16, steps=2, noise_multiplier=1.0,
                key=jax.random.key(1))
  with pytest.raises(ValueError, match=r"layout='out_in'"):       # the README's select
    sgd.dp_sgd_plan(grad_fn, bases=sgd.bases_like(
        params, lambda _, w: U if w.ndim == 2 and w.shape[0] == 12 else None), **common).init(
            params, optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"TwoSidedBasis\(jnp.eye\(8\), U\)"):   # U on in_out
    sgd.dp_sgd_plan(grad_fn, bases=sgd.bases_like(
        params, lambda _, w: U if w.ndim == 2 and w.shape[-1] == 12 else None), **common).init(
            params, optax.sgd(0.1))
  bases = sgd.bases_like(params, lambda _, w: U if w.ndim == 2 and w.shape[-1] == 12 else None,
                         layout="out_in")
  assert isinstance(bases.layers[0].weight, sgd.TwoSidedBasis)
  plan = sgd.dp_sgd_plan(grad_fn, bases=bases, **common)
  X = np.random.default_rng(1).normal(size=(64, 12)).astype(np.float32)
  y = np.random.default_rng(2).integers(0, 3, 64)
  opt = optax.sgd(0.1)
  state = plan.init(params, opt)
  new, _ = plan.step(params, state, plan.prepare((X, y)), opt)
  change = np.asarray(new.layers[0].weight - params.layers[0].weight)
  np.testing.assert_allclose(change, change @ U @ U.T, atol=1e-5)   # every row in span(U)
  with pytest.raises(ValueError, match="layout"):
    sgd.bases_like(params, lambda _, w: None, layout="torch")
