"""Per-layer subspaces, one- and two-sided (dpjax/sgd/layer_subspaces.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.sgd import layer_subspaces as ls
from dpjax.sgd import transforms
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


def _noise(bases, sigma=1.0, key=1):
  return ls.layer_subspace_noise(bases, clip_norm=2.0, noise_multiplier=sigma,
                                 expected_batch_size=4.0, key=jax.random.key(key))


@pytest.mark.parametrize("two_sided", [False, True])
def test_identity_bases_give_plain_dp_sgd(two_sided):
  """Identity bases (U = I, or U = I and V = I): the same draws as dp_gaussian_noise."""
  params = _params()
  summed = jax.tree_util.tree_map(lambda p: jnp.ones_like(p) * 0.3, params)
  eye = {"layers": [{"w": jnp.eye(6), "b": None}, {"w": jnp.eye(4), "b": None}],
         "conv": jnp.eye(5)}
  if two_sided:
    eye = {"layers": [{"w": ls.TwoSidedBasis(jnp.eye(6), jnp.eye(4)), "b": None},
                      {"w": ls.TwoSidedBasis(jnp.eye(4), jnp.eye(3)), "b": None}],
           "conv": ls.TwoSidedBasis(jnp.eye(5), jnp.eye(4))}
  tx, plain = _noise(eye), transforms.dp_gaussian_noise(
      clip_norm=2.0, noise_multiplier=1.0, expected_batch_size=4.0, key=jax.random.key(1))
  s1, s2 = tx.init(params), plain.init(params)
  for _ in range(2):
    a, s1 = tx.update(summed, s1)
    b, s2 = plain.update(summed, s2)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6),
                           a, b)


def test_projected_leaves_lie_in_their_span_and_others_get_full_noise():
  params, bases = _params(), _bases()
  summed = jax.tree_util.tree_map(lambda p: jnp.ones_like(p), params)
  tx = jax.jit(_noise(bases).update)
  out, state = tx(summed, _noise(bases).init(params))
  U = bases["layers"][0]["w"]
  W = out["layers"][0]["w"]
  np.testing.assert_allclose(W - U @ (U.T @ W), 0, atol=1e-5)
  C = out["conv"].reshape(5, -1)
  np.testing.assert_allclose(C - bases["conv"] @ (bases["conv"].T @ C), 0, atol=1e-5)
  assert not np.allclose(out["layers"][1]["w"], 0.25)             # unprojected leaf: noisy
  for o, p in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(params)):
    assert o.shape == p.shape and o.dtype == p.dtype
  assert isinstance(state, ls.LayerSubspaceNoiseState)


@pytest.mark.slow(reason="the noise energy per projected leaf (r·b coordinates); the default run "
                         "checks its span")
def test_noise_energy_is_r_times_b_coordinates_per_projected_leaf():
  params, bases = _params(), _bases(r=2)
  zero = jax.tree_util.tree_map(jnp.zeros_like, params)
  tx = _noise(bases, sigma=1.5)
  state = tx.init(params)
  keys = jax.random.split(jax.random.key(5), 4000)
  outs = jax.vmap(lambda k: tx.update(zero, state._replace(key=k))[0])(keys)
  s = 1.5 * 2.0 / 4.0                                  # σC/L (ν̂ ≈ 1 for an orthonormal basis)
  energy = lambda x: float(jnp.mean(jnp.sum(x.reshape(x.shape[0], -1) ** 2, axis=1)))  # noqa
  assert energy(outs["layers"][0]["w"]) == pytest.approx(s**2 * 2 * 4, rel=0.05)
  assert energy(outs["conv"]) == pytest.approx(s**2 * 2 * 4, rel=0.05)
  assert energy(outs["layers"][1]["w"]) == pytest.approx(s**2 * 12, rel=0.05)


def test_the_noise_is_scaled_by_the_largest_basis_norm():
  params, bases = _params(), _bases()
  bases["conv"] = bases["conv"].at[:, 0].multiply(1.5)   # ‖U‖₂ = 1.5 (accepted with a loose tol)
  tx = ls.layer_subspace_noise(bases, clip_norm=2.0, noise_multiplier=1.0,
                               expected_batch_size=4.0, key=jax.random.key(1), tol=10.0)
  state = tx.init(params)
  norm = float(jnp.linalg.norm(bases["conv"], 2))
  assert norm == pytest.approx(1.5, rel=1e-5)
  assert float(state.noise_std) >= 2.0 * norm
  assert float(state.base_std) == pytest.approx(2.0)


def test_update_layer_bases_keeps_the_key_and_recomputes_the_std():
  params, bases = _params(), _bases()
  tx = optax.chain(_noise(bases), optax.sgd(0.1))
  opt_state = tx.init(params)
  new = _bases()
  new["conv"] = _orthonormal(jax.random.key(9), 5, 2)
  swapped = ls.update_layer_bases(opt_state, new)
  np.testing.assert_array_equal(jax.random.key_data(swapped[0].key),
                                jax.random.key_data(opt_state[0].key))
  np.testing.assert_array_equal(swapped[0].bases["conv"], new["conv"])
  assert float(swapped[0].noise_std) == pytest.approx(float(opt_state[0].noise_std), rel=1e-5)
  with pytest.raises(ValueError, match="None pattern|structure"):
    ls.update_layer_bases(opt_state, {**new, "conv": None})
  with pytest.raises(ValueError, match="shape"):
    ls.update_layer_bases(opt_state, {**new, "conv": _orthonormal(jax.random.key(9), 5, 3)})
  with pytest.raises(ValueError, match="no LayerSubspaceNoiseState"):
    ls.update_layer_bases(optax.sgd(0.1).init(params), new)


@pytest.mark.parametrize("change", ["rows", "vector_leaf", "structure", "none", "not_orthonormal"])
def test_bad_bases_raise_at_init(change):
  params, bases = _params(), _bases()
  if change == "rows":
    bases["conv"] = _orthonormal(jax.random.key(1), 4, 2)
  elif change == "vector_leaf":
    bases["layers"][0]["b"] = _orthonormal(jax.random.key(1), 4, 2)
  elif change == "structure":
    del bases["conv"]
  elif change == "none":
    bases = jax.tree_util.tree_map(lambda _: None, bases)
  else:
    bases["conv"] = bases["conv"] * 2.0
  with pytest.raises(ValueError):
    _noise(bases).init(params)


def test_trajectory_bases_find_the_column_space_of_a_released_update():
  # A released update whose first layer is rank one plus noise: the basis finds its column space.
  key1, key2 = jax.random.split(jax.random.key(3))
  u = normal(key1, (6,))
  released = jax.tree_util.tree_map(lambda p: 0.01 * normal(key2, p.shape), _params())
  released["layers"][0]["w"] = released["layers"][0]["w"] + jnp.outer(u, jnp.ones(4))
  bases = ls.trajectory_bases(released, 1)
  top = bases["layers"][0]["w"][:, 0]
  assert abs(float(top @ u)) / float(jnp.linalg.norm(u)) > 0.99
  assert bases["layers"][0]["b"] is None and bases["layers"][1]["w"].shape == (4, 1)
  _noise(bases).init(_params())                        # a valid input to the transform
  with pytest.raises(ValueError):
    ls.trajectory_bases({"b": jnp.zeros(3)}, 1)
  with pytest.raises(ValueError):
    ls.trajectory_bases(released, 0)


def test_trajectory_rank_rule_keeps_only_directions_above_the_noise_edge():
  # 64 x 32 release: a planted rank-2 signal (singular values 60 and 40, far above the pure
  # noise's edge s(√a + √b) ≈ 13.7 at s = 1) plus N(0, 1) noise; rank 6 asked.
  k_u, k_v, k_n = jax.random.split(jax.random.key(4), 3)
  U = _orthonormal(k_u, 64, 2)
  V = _orthonormal(k_v, 32, 2)
  noise = normal(k_n, (64, 32))
  signal = U @ jnp.diag(jnp.array([60.0, 40.0])) @ V.T
  out = ls.trajectory_bases({"w": signal + noise}, 6, noise_std=1.0, edge_scale=1.1)["w"]
  norms = np.linalg.norm(np.asarray(out), axis=0)
  np.testing.assert_allclose(norms, [1, 1, 0, 0, 0, 0], atol=1e-5)
  # The kept columns span the planted directions (principal angles' cosines near 1).
  np.testing.assert_allclose(np.linalg.svd(np.asarray(U.T @ out[:, :2]))[1], 1.0, atol=0.05)
  # Pure noise: nothing above the edge; without noise_std all 6 columns are kept.
  assert float(jnp.abs(ls.trajectory_bases({"w": noise}, 6, noise_std=1.0,
                                           edge_scale=1.1)["w"]).max()) == 0.0
  full = ls.trajectory_bases({"w": noise}, 6)["w"]
  np.testing.assert_allclose(np.asarray(full.T @ full), np.eye(6), atol=1e-5)
  # The same rule under jit with a traced noise level; the output feeds the transforms.
  jitted = jax.jit(lambda g, s: ls.trajectory_bases({"w": g}, 6, noise_std=s,
                                                    edge_scale=1.1)["w"])(signal + noise, 1.0)
  np.testing.assert_allclose(np.asarray(jitted), np.asarray(out), atol=1e-5)
  params = {"w": jnp.zeros((64, 32))}
  ls.layer_subspace_noise({"w": out}, clip_norm=1.0, noise_multiplier=1.0,
                          expected_batch_size=4, key=jax.random.key(0)).init(params)
  with pytest.raises(ValueError, match="noise_std"):
    ls.trajectory_bases({"w": noise}, 2, noise_std=-1.0)
  with pytest.raises(ValueError, match="edge_scale"):
    ls.trajectory_bases({"w": noise}, 2, noise_std=1.0, edge_scale=0.0)


def test_partial_isometry_bases_keep_the_split_orthogonal_and_are_checked_spectrally():
  # A basis with a zero column: U Uᵀ is still a projector, so each example's gradient splits
  # into orthogonal parts (‖U e‖² + ‖ρ‖² = ‖g‖²) and the clip norms bound the same quantities.
  Q = np.asarray(_orthonormal(jax.random.key(5), 6, 3))
  partial = Q * np.array([1.0, 0.0, 1.0])
  g = normal(6, (6, 4))
  e, rho = ls._split(g, jnp.asarray(partial), 1.0, 1.0)
  back = jnp.asarray(partial) @ e
  np.testing.assert_allclose(float(jnp.sum(back**2) + jnp.sum(rho**2)), float(jnp.sum(g**2)),
                             rtol=1e-5)
  transforms.check_basis(partial, partial=True)
  with pytest.raises(ValueError, match="orthonormal columns"):
    transforms.check_basis(partial)
  with pytest.raises(ValueError, match="orthonormal or zero"):   # a column of norm 0.5
    transforms.check_basis(Q * np.array([1.0, 0.5, 1.0]), partial=True)


# ------------------------------------------------------- projection before clipping (GEP style)

def _model():
  params = {"w": jnp.zeros((6, 3)), "b": jnp.zeros(3)}
  loss = lambda p, ex: jnp.sum((ex[0] @ p["w"] + p["b"] - ex[1]) ** 2)   # noqa: E731
  keys = jax.random.split(jax.random.key(11), 2)
  batch = (normal(keys[0], (9, 6)), normal(keys[1], (9, 3)))
  return params, loss, batch


@pytest.mark.slow(reason="embedding+residual on identity bases is DP-SGD; the default run checks "
                         "it for layer noise")
def test_embedding_residual_with_identity_bases_is_plain_dp_sgd():
  from dpjax.sgd import per_example
  params, loss, batch = _model()
  mask = jnp.ones(9).at[3].set(0)
  params = {"w": 0.3 * jnp.ones((6, 3)), "b": jnp.zeros(3)}
  eye = {"w": jnp.eye(6), "b": None}
  sums = ls.embedding_residual_grad_sum(loss, embedding_clip=2.0, residual_clip=0.5)(
      params, batch, mask, eye)
  plain_sum = per_example.clipped_grad_sum(loss, clip_norm=2.0)(params, batch, mask)
  tx = ls.embedding_residual_noise(eye, embedding_clip=2.0, residual_clip=0.5,
                                   noise_multiplier=1.3, expected_batch_size=4.0,
                                   key=jax.random.key(2))
  plain = transforms.dp_gaussian_noise(clip_norm=2.0, noise_multiplier=1.3,
                                       expected_batch_size=4.0, key=jax.random.key(2))
  a, _ = tx.update(sums, tx.init(params))
  b, _ = plain.update(plain_sum, plain.init(params))
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5),
                         a, b)


@pytest.mark.slow(reason="without noise or clipping nothing is dropped; the residual channel's "
                         "audit runs by default")
def test_without_noise_or_clipping_the_residual_channel_drops_nothing():
  params, loss, batch = _model()
  bases = {"w": _orthonormal(jax.random.key(4), 6, 2), "b": None}
  sums = ls.embedding_residual_grad_sum(loss, embedding_clip=1e4, residual_clip=1e4)(
      params, batch, jnp.ones(9), bases)
  tx = ls.embedding_residual_noise(bases, embedding_clip=1e4, residual_clip=1e4,
                                   noise_multiplier=0.0, expected_batch_size=3.0,
                                   key=jax.random.key(2))
  out, _ = tx.update(sums, tx.init(params))
  full = jax.tree_util.tree_map(lambda g: jnp.sum(g, 0) / 3.0,
                                jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, batch))
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4),
                         out, full)


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
  fn = ls.embedding_residual_grad_sum(loss, embedding_clip=1.0, residual_clip=0.1, joint=joint)
  bound = fn.l2_norm_bound
  assert bound == (1.0 if joint else pytest.approx(2**0.5))
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
  fn = ls.embedding_residual_grad_sum(loss, embedding_clip=1.0, residual_clip=0.1, joint=joint)
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
  sums = jax.jit(ls.embedding_residual_grad_sum(loss, embedding_clip=1.0, residual_clip=0.1))(
      params, batch, jnp.ones(9), bases)
  assert sums["embedding"]["w"].shape == (2, 3) and sums["embedding"]["b"].shape == (3,)
  assert sums["residual"]["w"].shape == (6, 3) and sums["residual"]["b"].shape == (0,)
  for bad in ({"embedding_clip": 0.0, "residual_clip": 1.0},
              {"embedding_clip": 1.0, "residual_clip": float("nan")}):
    with pytest.raises(ValueError):
      ls.embedding_residual_grad_sum(loss, **bad)
    with pytest.raises(ValueError):
      ls.embedding_residual_noise(bases, noise_multiplier=1.0, expected_batch_size=1.0,
                                  key=jax.random.key(0), **bad)


# ------------------------------------------------------------ two-sided bases (left and right)


def _two_sided(r=2, r_right=2, stretch=1.0):
  keys = jax.random.split(jax.random.key(7), 4)
  return {"layers": [{"w": ls.TwoSidedBasis(_orthonormal(keys[0], 6, r) * stretch,
                                            _orthonormal(keys[1], 4, r_right)), "b": None},
                     {"w": None, "b": None}],
          "conv": ls.TwoSidedBasis(_orthonormal(keys[2], 5, r), _orthonormal(keys[3], 4, 1))}


def test_two_sided_release_is_u_times_noisy_coefficients_times_v_transposed():
  """Without noise the update is U Uᵀ S V Vᵀ / L; with noise the released part lies in
  span(U) ⊗ span(V) with std σCν/L per coefficient and nothing outside."""
  params, bases = _params(), _two_sided()
  summed = jax.tree_util.tree_map(lambda p: normal(jax.random.key(3), p.shape), params)
  tx = _noise(bases, sigma=1.0)
  state = tx.init(params)
  update = jax.jit(tx.update)                   # one program, with and without noise
  quiet, _ = update(summed, state._replace(noise_std=jnp.zeros_like(state.noise_std)))
  quiet, summed_np = jax.tree_util.tree_map(np.asarray, (quiet, summed))   # NumPy from here
  U, V = map(np.asarray, bases["layers"][0]["w"])
  S = summed_np["layers"][0]["w"]
  np.testing.assert_allclose(quiet["layers"][0]["w"], U @ U.T @ S @ V @ V.T / 4.0, atol=1e-5)
  Uc, Vc = map(np.asarray, bases["conv"])
  Sc = summed_np["conv"].reshape(5, 4)
  np.testing.assert_allclose(quiet["conv"].reshape(5, 4), Uc @ Uc.T @ Sc @ Vc @ Vc.T / 4.0,
                             atol=1e-5)
  quiet = quiet["layers"][0]["w"]
  coefficients = []
  for _ in range(400):
    out, state = update(summed, state)
    noise = (np.asarray(out["layers"][0]["w"]) - quiet) * 4.0
    np.testing.assert_allclose(noise - U @ (U.T @ noise @ V) @ V.T, 0, atol=1e-4)
    coefficients.append(U.T @ noise @ V)
  std = float(np.std(np.stack(coefficients)))
  assert abs(std - float(state.noise_std)) < 0.06 * float(state.noise_std)
  assert float(state.noise_std) == pytest.approx(2.0, rel=1e-3)       # σC, orthonormal factors


def test_two_sided_noise_is_scaled_by_the_product_of_the_factor_norms():
  """‖UᵀSV‖_F ≤ ‖U‖₂‖S‖_F‖V‖₂: a left factor stretched 3× and a right one 2× give ν = 6."""
  params = {"w": jnp.zeros((6, 4)), "b": jnp.zeros(4)}
  U = jnp.eye(6)[:, :2].at[0, 0].set(3.0)
  V = jnp.eye(4)[:, :2].at[0, 0].set(2.0)
  tx = ls.layer_subspace_noise({"w": ls.TwoSidedBasis(U, V), "b": None}, clip_norm=2.0,
                               noise_multiplier=1.0, expected_batch_size=4.0,
                               key=jax.random.key(0), tol=10.0)
  assert float(tx.init(params).noise_std) == pytest.approx(2.0 * 6.0, rel=1e-5)
  # the bound is attained: the canary E₀₀ moves the coefficient (0, 0) by 6
  E = jnp.zeros((6, 4)).at[0, 0].set(1.0)
  assert float(jnp.linalg.norm(U.T @ E @ V)) == pytest.approx(6.0)


def test_two_sided_bases_are_checked_and_swapped():
  params, bases = _params(), _two_sided()
  tx = _noise(bases)
  state = tx.init(params)
  new = _two_sided(stretch=-1.0)     # same shapes, other signs: accepted
  swapped = ls.update_layer_bases(state, new)
  np.testing.assert_allclose(swapped.bases["layers"][0]["w"].left, new["layers"][0]["w"].left)
  assert swapped.key is state.key
  with pytest.raises(ValueError, match="right basis .* must have 4 rows"):
    _noise({**bases, "conv": ls.TwoSidedBasis(bases["conv"].left, jnp.eye(3)[:, :1])}).init(
        params)
  with pytest.raises(ValueError, match="left basis .* must have 6 rows"):
    _noise({**bases, "layers": [{"w": ls.TwoSidedBasis(jnp.eye(5)[:, :2],
                                                       bases["layers"][0]["w"].right),
                                 "b": None}, {"w": None, "b": None}]}).init(params)
  with pytest.raises(ValueError, match="one- or two-sided"):
    ls.update_layer_bases(state, {**new, "conv": new["conv"].left})
  with pytest.raises(ValueError, match="current shape"):
    ls.update_layer_bases(state, {**new, "conv": ls.TwoSidedBasis(new["conv"].left,
                                                                  jnp.eye(4)[:, :2])})


def test_two_sided_trajectory_bases_are_the_top_singular_pairs():
  rng = np.random.default_rng(0)
  G = rng.normal(size=(8, 5)) @ np.diag([5.0, 3.0, 0.1, 0.1, 0.1]) @ rng.normal(size=(5, 6))
  out = ls.trajectory_bases({"w": jnp.asarray(G, jnp.float32), "b": jnp.zeros(6)}, 2,
                            two_sided=True)
  assert isinstance(out["w"], ls.TwoSidedBasis) and out["b"] is None
  u, _, vt = np.linalg.svd(G)
  np.testing.assert_allclose(np.abs(out["w"].left.T @ u[:, :2]), np.eye(2), atol=1e-4)
  np.testing.assert_allclose(np.abs(out["w"].right.T @ vt[:2].T), np.eye(2), atol=1e-4)
  # the rank rule zeroes the same directions on both sides
  ruled = ls.trajectory_bases({"w": jnp.asarray(G, jnp.float32)}, 3, noise_std=0.5,
                              two_sided=True)["w"]
  np.testing.assert_allclose(np.linalg.norm(ruled.left, axis=0),
                             np.linalg.norm(ruled.right, axis=0), atol=1e-5)
  assert 0 < float(np.linalg.norm(ruled.left, axis=0).sum()) < 3


@pytest.mark.parametrize("joint", [True, False])
def test_two_sided_embedding_residual_split_is_orthogonal_and_bounded(joint):
  """GEP with two-sided bases: e = UᵀGV, ρ = G − U e Vᵀ, ‖e‖² + ‖ρ‖² = ‖G‖², and the noisy
  release maps back to the params' shapes; every example's scaled term is within Δ."""
  params = {"w": jnp.zeros((6, 4)), "b": jnp.zeros(4)}
  keys = jax.random.split(jax.random.key(2), 3)
  bases = {"w": ls.TwoSidedBasis(_orthonormal(keys[0], 6, 2), _orthonormal(keys[1], 4, 2)),
           "b": None}
  G = normal(keys[2], (6, 4))
  e, rho = ls._split(G, bases["w"], 1.0, 1.0)
  U, V = bases["w"]
  np.testing.assert_allclose(e, U.T @ G @ V, atol=1e-5)
  assert float(jnp.sum(e**2) + jnp.sum(rho**2)) == pytest.approx(float(jnp.sum(G**2)), rel=1e-4)
  X = normal(keys[2], (5, 6, 4)) * 10.0
  loss = lambda p, x: jnp.sum(p["w"] * x) + jnp.sum(p["b"])   # noqa: E731
  grad_sum = ls.embedding_residual_grad_sum(loss, embedding_clip=1.0, residual_clip=0.5,
                                            joint=joint)
  # Each example's term alone (one-hot masks, one program), then all of them.
  masks = np.concatenate([np.eye(5), np.ones((1, 5))]).astype(np.float32)
  sums = jax.jit(jax.vmap(grad_sum, in_axes=(None, None, 0, None)))(params, X, masks, bases)
  norms = np.sqrt(sum(np.sum(np.asarray(x, np.float64).reshape(6, -1) ** 2, axis=1)
                      for x in jax.tree_util.tree_leaves(sums)))
  assert np.all(norms[:5] <= grad_sum.l2_norm_bound * (1 + 1e-5)), norms
  tx = ls.embedding_residual_noise(bases, embedding_clip=1.0, residual_clip=0.5,
                                   noise_multiplier=1.0, expected_batch_size=4.0,
                                   key=jax.random.key(0), l2_norm_bound=grad_sum.l2_norm_bound)
  out, _ = tx.update(jax.tree_util.tree_map(lambda x: x[5], sums), tx.init(params))
  assert out["w"].shape == (6, 4) and out["b"].shape == (4,)
