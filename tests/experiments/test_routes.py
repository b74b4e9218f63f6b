"""dpjax.experiments.train_route (the research harness): shapes, determinism per key, σ from the
PLD accountant, the noise built from the route's grad sum (Δ read from it), the trajectory bases
reading released updates only, and clear errors."""

import functools
import inspect
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from dpjax import accounting, demo, experiments, sgd, subspace
from dpjax.experiments import routes
from dpjax.sgd import bases as bases_lib
from dpjax.sgd import gep, ghost, noise

D, N = 12, 400
_S = experiments.RouteSettings
INIT = functools.partial(demo.init_mlp, sizes=(D, 8, 3))
# One dense layer for the default tests: a training program compiles ~2.4 times faster than
# with INIT's hidden layer (the slow tests train INIT).
LINEAR = functools.partial(demo.init_mlp, sizes=(D, 8))


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(0)
  X = rng.normal(size=(N, D)).astype(np.float32)
  y = (X[:, 0] > 0).astype(np.int32) + (X[:, 1] > 0.1).astype(np.int32)   # majority 53%
  return X, y


def _sigma(epsilon, n, steps, accountant="rdp", subspace_event=None):
  """σ of the routes' config: DPSGDConfig at (ε, 1e-5), L = 32 of n rows, T steps."""
  return sgd.DPSGDConfig(num_examples=n, expected_batch_size=32, steps=steps, epsilon=epsilon,
                         delta=1e-5, accountant=accountant,
                         subspace_event=subspace_event).calibrate().noise_multiplier


def _run(route, data, keys, lrs=None, init=INIT, epsilon=2.0, **kw):
  """At ε = 2 (ε = 0.5 where a test's checks do not depend on it: its RDP calibration takes
  ~0.6 s, ~1.7 s at ε = 2), δ = 1e-5, L = 32, the RDP accountant (its calibration is the faster
  one; the PLD default is tested below); the public route's public rows are the first 40 (not
  trained on: the public gradient route takes them with their labels)."""
  lrs = np.full(len(keys), 0.05) if lrs is None else lrs
  public = {}
  if route in experiments.PUBLIC_ROUTES:
    name = "public_inputs" if route == "public_subspace" else "public_data"
    public = {name: data[0][:40] if route == "public_subspace" else (data[0][:40], data[1][:40])}
    data = (data[0][40:], data[1][40:])
  return experiments.train_route(route, keys, lrs, data, init_fn=init,
                                 loss_fn=demo.example_loss, epsilon=epsilon, delta=1e-5,
                                 steps=kw.pop("steps", 12), expected_batch_size=32,
                                 accountant=kw.pop("accountant", "rdp"), **public, **kw)


# Slow: dp_sgd runs stacked over keys in test_dp_sgd_route_learns, GEP's trajectory bases in
# test_trajectory_bases_read_only_released_updates, the denoising and public-subspace transforms
# have their own tests (test_denoise, test_subspace_sources). --run-slow runs them all.
@pytest.mark.slow(reason="every route stacked per key; by default only dp_sgd, GEP and the input "
                         "subspace train")
@pytest.mark.parametrize("route", experiments.ROUTES)
def test_each_route_runs_stacked_deterministic_per_key(route, data):
  """Params stacked over the runs, equal for equal keys, σ from the accountant for the route's
  private rows, the subspace rank and bases."""
  keys = jnp.stack([jax.random.key(0), jax.random.key(1), jax.random.key(0)])
  run = _run(route, data, keys, settings=experiments.RouteSettings(
      gep_rank=3, public_rank=4, gep_refreshes=2, input_rank=4, public_gradient_rank=5,
      public_gradient_refresh=4))
  shapes = [(3, *x.shape) for x in jax.tree_util.tree_leaves(INIT(jax.random.key(0)))]
  assert [x.shape for x in jax.tree_util.tree_leaves(run.params)] == shapes
  leaves = jax.tree_util.tree_leaves(run.params)
  assert all(np.all(np.isfinite(x)) for x in leaves)
  for x in leaves:
    np.testing.assert_array_equal(x[0], x[2])         # same key, same run
  assert any(not np.array_equal(x[0], x[1]) for x in leaves)
  assert run.rank == {"gep_trajectory": 3, "public_subspace": 4,
                      "private_input_subspace": 4, "public_gradient_subspace": 5}.get(route)
  n = N - 40 if route in experiments.PUBLIC_ROUTES else N
  # private_input_subspace: Analyze Gauss at a stand-alone (0.2, 1e-6), its Gaussian event
  # composed with the steps by the accountant.
  event = (routes.input_basis_event(0.2, 0.1e-5) if route == "private_input_subspace"
           else None)
  expected = 0.0 if route == "non_private" else _sigma(2.0, n, 12, subspace_event=event)
  assert run.noise_multiplier == expected
  if route == "non_private":
    assert run.epsilon is None and run.all_runs_epsilon is None
  else:
    assert run.num_runs == 3 and run.all_runs_epsilon == pytest.approx(6.0)
  if route == "gep_trajectory":
    assert run.bases.shape == (3, D, 3)
    gram = np.einsum("kdr,kds->krs", run.bases, run.bases)
    np.testing.assert_allclose(gram, np.broadcast_to(np.eye(3), gram.shape), atol=1e-4)
  elif route == "public_subspace":
    assert run.bases.shape == (D, 4)
  elif route == "private_input_subspace":
    assert run.bases.shape == (3, D, 4)
    np.testing.assert_array_equal(run.bases[0], run.bases[2])
  else:
    assert run.bases is None


def test_train_route_defaults_to_the_pld_accountant():
  assert inspect.signature(experiments.train_route).parameters["accountant"].default == "pld"


@pytest.mark.slow(reason="σ by the PLD accountant meets (ε, δ) in a run; the default run checks "
                         "PLD is the default")
def test_noise_multiplier_meets_the_budget_by_the_pld_accountant(data):
  """σ meets (ε, δ) for q = L/N and T under add/remove-one, and not by much more; train_route
  uses it by default."""
  sigma = _sigma(2.0, N, 12, accountant="pld")
  eps = accounting.dpsgd_epsilon(sigma, 32 / N, 12, 1e-5, accountant="pld")
  assert 1.8 < eps <= 2.0
  run = _run("dp_sgd", data, jnp.stack([jax.random.key(0)]), steps=12, accountant="pld")
  assert run.noise_multiplier == sigma          # train_route's default accountant is PLD


@pytest.mark.slow(reason="dp_sgd learns above the majority class; the routes' privacy tests run "
                         "by default")
def test_dp_sgd_route_learns(data):
  """Above the majority class (0.53) at ε = 2 (measured mean 0.64 over these keys)."""
  keys = jnp.stack([jax.random.key(i) for i in range(4)])
  run = _run("dp_sgd", data, keys, steps=60)
  acc = jax.vmap(lambda p: demo.accuracy(p, *map(jnp.asarray, data)))(run.params)
  assert float(jnp.mean(acc)) > 0.6


def test_trajectory_bases_read_only_released_updates(data, monkeypatch):
  """With noise transforms that release a fixed update whatever they are given (the plans' own
  dp_noise, its output replaced), the GEP route's bases (and the params) must not change when
  the private data change; bases computed from clipped or per-example gradients would. The
  noise-edge rank rule is on (the release's singular values are far above the edge, so the
  bases are the plain top-3 ones)."""
  params = LINEAR(jax.random.key(1))
  released = jax.tree_util.tree_map(lambda p: helpers.normal(2, p.shape), params)
  real = noise.dp_noise

  def fixed_release(grad_fn, **kwargs):
    tx = real(grad_fn, **kwargs)

    def update(updates, state, params=None):
      return released, tx.update(updates, state, params)[1]
    return optax.GradientTransformation(tx.init, update)

  monkeypatch.setattr(noise, "dp_noise", fixed_release)
  settings = experiments.RouteSettings(gep_rank=3, gep_refreshes=2, gep_edge_scale=1.0)

  def bases_after(X, y):
    run = experiments.train_route("gep_trajectory", jnp.stack([jax.random.key(3)]), [0.05],
                                  (X, y), init_fn=LINEAR, loss_fn=demo.example_loss,
                                  epsilon=2.0, delta=1e-5, steps=10, expected_batch_size=32,
                                  accountant="rdp", settings=settings)
    return np.asarray(run.bases[0])

  X, y = data
  first = bases_after(X, y)
  np.testing.assert_array_equal(first, bases_after(X[::-1] * 0.5, y[::-1]))
  expected = np.asarray(sgd.trajectory_bases([released[0]], 3)[0]["w"])
  np.testing.assert_allclose(np.abs(first), np.abs(expected), atol=1e-5)
  assert np.all(np.linalg.norm(first, axis=0) > 0.99)       # every direction above the edge


@pytest.mark.parametrize("route, release, delta, nu", [
    ("dp_sgd", "full", 0.7, False), ("oracle_subspace", "full", 0.7, False),
    ("dp_sgd_denoise", "full", 0.7, False), ("public_subspace", "layers", 0.7, True),
    ("private_input_subspace", "full", 0.7, False),
    ("public_gradient_subspace", "full", 0.7, False),
    ("gep_trajectory", "embedding_residual", np.sqrt(2.0), False)])
def test_each_routes_noise_reads_its_bound_from_the_routes_grad_sum(route, release, delta, nu):
  """Every DP route's plan is made from the grad sum the program sums with (the same object), so
  its noise std is σ·Δ·ν with Δ read from that sum: C for the clipped sums, √2 for GEP's split
  clipped per part (not C: with Δ passed as C the GEP release would be under-noised by √2), ν
  the per-layer basis's norm bound. One plan per run, each with its run's key, all of one config
  (σ calibrated once). No training: the host-built plans only."""
  settings = experiments.RouteSettings(clip_norm=0.7, gep_rank=3, public_rank=4, input_rank=4)
  template = LINEAR(jax.random.key(0))
  basis = np.linalg.qr(helpers.normal(4, (D, 4)))[0].astype(np.float32)
  sigma = 1.3
  config = sgd.DPSGDConfig(num_examples=N, expected_batch_size=32, steps=5,
                           noise_multiplier=sigma)
  streams = [routes.run_keys(jax.random.key(i)) for i in range(2)]
  plans, gep_plans = routes.route_plans(route, config, streams, template, settings,
                                        demo.example_loss, basis)
  grad_fns = routes._grad_fns(route, demo.example_loss, settings)
  last = plans if gep_plans is None else gep_plans       # GEP: the split's plan (after warm-up)
  state = noise.noise_state(last[0].init(template, optax.sgd(0.1)))
  assert state.release == release
  assert last[0].grad_fn is grad_fns[-1] and plans[0].grad_fn is grad_fns[0]
  assert grad_fns[-1].l2_norm_bound == pytest.approx(delta, rel=1e-12)
  assert isinstance(grad_fns[-1], gep.EmbeddingResidualGradSum) == (release ==
                                                                    "embedding_residual")
  bound = 1.0
  if nu:
    bound = max(1.0, bases_lib.basis_norm_bound(state.bases[0]["w"]))
  if route == "public_subspace":
    np.testing.assert_allclose(state.bases[0]["w"], basis)
  expected = sigma * delta * bound
  # Rounded up to float32 twice at most (σΔ, then σΔν): within 2 relative ulps above.
  assert expected <= float(state.noise_std) <= expected * (1 + 2.5e-7)
  other = noise.noise_state(last[1].init(template, optax.sgd(0.1)))
  assert not np.array_equal(jax.random.key_data(other.key), jax.random.key_data(state.key))
  assert all(p.config is config for p in plans + (gep_plans or []))
  if route == "gep_trajectory":                  # the warm-up: plain DP-SGD at Δ = C
    warm = noise.noise_state(plans[0].init(template, optax.sgd(0.1)))
    assert warm.release == "full" and grad_fns[0].l2_norm_bound == pytest.approx(0.7)
    assert sigma * 0.7 <= float(warm.noise_std) <= sigma * 0.7 * (1 + 2.5e-7)
  # The program sums with the very objects the noise was built from (one per configuration).
  assert routes._grad_fns(route, demo.example_loss, settings) is grad_fns


@pytest.mark.slow(reason="the rank rule at both extremes in the GEP route; test_layer_subspaces "
                         "tests it by default")
def test_gep_rank_rule_drops_directions_below_the_public_noise_edge(data):
  """RouteSettings.gep_edge_scale: the bases are partial isometries (columns of norm 0 or 1),
  all kept at a tiny edge, none at a huge one."""
  keys = jnp.stack([jax.random.key(0), jax.random.key(1)])
  norms = {}
  for scale in (1e-6, 1e6):
    run = _run("gep_trajectory", data, keys, settings=experiments.RouteSettings(
        gep_rank=3, gep_refreshes=2, gep_edge_scale=scale))
    norms[scale] = np.linalg.norm(np.asarray(run.bases), axis=1)
    assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(run.params))
  np.testing.assert_allclose(norms[1e-6], 1.0, atol=1e-4)
  np.testing.assert_array_equal(norms[1e6], 0.0)


@pytest.mark.slow(reason="the NOT private oracle route trained at full and low rank; by default "
                         "test_oracle_projection_is_the_top_left_right_projector checks its "
                         "projection")
def test_oracle_at_full_rank_is_dp_sgd_and_at_low_rank_is_not(data):
  """The NOT private oracle diagnostic: with r at least every side of every matrix the projection
  is the identity, so the run is dp_sgd's (same keys, float tolerance); at r = 1 it differs, and
  so do two refresh periods (the reference is recomputed)."""
  keys = jnp.stack([jax.random.key(0), jax.random.key(1)])
  base = _run("dp_sgd", data, keys, init=LINEAR, epsilon=0.5)
  full = _run("oracle_subspace", data, keys, init=LINEAR, epsilon=0.5,
              settings=experiments.RouteSettings(oracle_rank=D))
  assert full.rank == D and full.bases is None
  assert full.noise_multiplier == base.noise_multiplier
  for a, b in zip(jax.tree_util.tree_leaves(full.params), jax.tree_util.tree_leaves(base.params)):
    np.testing.assert_allclose(a, b, atol=2e-5)
  low = {every: _run("oracle_subspace", data, keys, init=LINEAR, epsilon=0.5,
                     settings=experiments.RouteSettings(oracle_rank=1, oracle_refresh=every))
         for every in (1, 100)}
  for a, b, c in zip(*(jax.tree_util.tree_leaves(r.params)
                       for r in (base, low[1], low[100]))):
    assert np.all(np.isfinite(b)) and np.all(np.isfinite(c))
  first = [jax.tree_util.tree_leaves(r.params)[1] for r in (base, low[1], low[100])]
  assert np.abs(first[0] - first[1]).max() > 1e-3
  assert np.abs(first[1] - first[2]).max() > 1e-3


def test_oracle_projection_is_the_top_left_right_projector():
  """_project_top: ``U Uᵀ G V Vᵀ`` for each weight matrix (rank capped at the sides), idempotent,
  biases untouched."""
  rng = np.random.default_rng(0)
  ref = [{"w": jnp.asarray(rng.normal(size=(6, 4))), "b": jnp.zeros(4)},
         {"w": jnp.asarray(rng.normal(size=(4, 2))), "b": jnp.zeros(2)}]
  g = [{"w": jnp.asarray(rng.normal(size=(6, 4))), "b": jnp.asarray(rng.normal(size=4))},
       {"w": jnp.asarray(rng.normal(size=(4, 2))), "b": jnp.asarray(rng.normal(size=2))}]
  project = jax.jit(routes._project_top, static_argnums=2)   # as in _train (op by op: ~27)
  out = project(g, ref, 3)
  u, _, vt = np.linalg.svd(np.asarray(ref[0]["w"]))
  expected = u[:, :3] @ u[:, :3].T @ np.asarray(g[0]["w"]) @ vt[:3].T @ vt[:3]
  np.testing.assert_allclose(out[0]["w"], expected, atol=1e-5)    # float32 (x64 off)
  # (4, 2): rank 3 keeps 3 of 4 left directions and both right ones.
  u, _, vt = np.linalg.svd(np.asarray(ref[1]["w"]))
  np.testing.assert_allclose(out[1]["w"], u[:, :3] @ u[:, :3].T @ np.asarray(g[1]["w"]),
                             atol=1e-5)
  full = project(g, ref, 6)                                           # rank ≥ every side
  for a, b in zip(jax.tree_util.tree_leaves(full), jax.tree_util.tree_leaves(g)):
    np.testing.assert_allclose(a, b, atol=1e-5)
  np.testing.assert_array_equal(out[0]["b"], g[0]["b"])
  again = project(out, ref, 3)
  np.testing.assert_allclose(again[0]["w"], out[0]["w"], atol=1e-5)


@pytest.mark.slow(reason="GEP's two-sided option trained; by default the two-sided per-layer "
                         "step is audited and test_layer_subspaces checks two-sided bases")
def test_gep_two_sided_bases_are_orthonormal_factor_pairs(data):
  """RouteSettings.gep_two_sided: the first layer's trajectory bases are TwoSidedBasis pairs
  ((K, D, r) left, (K, 8, r) right, orthonormal columns), the run finite and paired by key."""
  keys = jnp.stack([jax.random.key(0), jax.random.key(0)])
  run = _run("gep_trajectory", data, keys, init=LINEAR, epsilon=0.5,
             settings=experiments.RouteSettings(gep_rank=3, gep_refreshes=2,
                                                gep_two_sided=True))
  assert isinstance(run.bases, sgd.TwoSidedBasis)
  assert run.bases.left.shape == (2, D, 3) and run.bases.right.shape == (2, 8, 3)
  for factor in run.bases:
    gram = np.einsum("kdr,kds->krs", factor, factor)
    np.testing.assert_allclose(gram, np.broadcast_to(np.eye(3), gram.shape), atol=1e-4)
  for x in jax.tree_util.tree_leaves(run.params):
    assert np.all(np.isfinite(x))
    np.testing.assert_array_equal(x[0], x[1])


def test_private_input_subspace_pays_its_share_and_releases_one_basis_per_run(data):
  """private_input_subspace: σ is the smallest for which the Analyze Gauss release (continuous
  noise at a stand-alone (ε_s, δ_s): GaussianDpEvent(z_s), add/remove-one) composed with the
  sampled steps by the accountant is (ε, δ)-DP — checked by dp_accounting's own RDP composition,
  with 1% less noise overspending (negative control); each run's basis is Analyze Gauss on
  the rows' inputs with the run's own subspace stream (routes.run_keys; orthonormal, equal for equal keys,
  different otherwise); its noise std is σC times that basis's norm bound. At ε = 0.5:
  (ε_s, δ_s) = (0.1, 0.3e-5)."""
  settings = experiments.RouteSettings(input_rank=3, input_epsilon_fraction=0.2,
                                       input_delta_fraction=0.3, input_scaling="clip",
                                       input_clip_norm=2.0)
  keys = jnp.stack([jax.random.key(0), jax.random.key(1)])
  run = _run("private_input_subspace", data, keys, init=LINEAR, epsilon=0.5, settings=settings,
             steps=4)
  import dp_accounting
  z_s = accounting.analytic_gaussian_sigma(0.1, 0.3e-5)       # the release's own multiplier

  def total(sigma):
    event = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z_s),
                                           accounting.dpsgd_event(sigma, 32 / N, 4)])
    return dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)

  assert 0.499 < total(run.noise_multiplier) <= 0.5 + 1e-9
  assert total(0.99 * run.noise_multiplier) > 0.5
  # Tighter than the ε split it replaces: less noise than DP-SGD at (ε − ε_s, δ − δ_s).
  split = accounting.calibrate_noise_multiplier(0.4, 0.7e-5, 32 / N, 4, accountant="rdp")
  assert run.noise_multiplier < split
  # Each run is (ε, δ)-DP; releasing both costs 2ε by basic composition (issue 34 §5).
  assert (run.epsilon, run.delta, run.num_runs) == (0.5, 1e-5, 2)
  assert run.all_runs_epsilon == pytest.approx(1.0) and run.all_runs_delta == pytest.approx(2e-5)
  expected = subspace.analyze_gauss(
      routes.run_keys(keys[1]).subspace, data[0], epsilon=0.1, delta=0.3e-5, k=3, clip_norm=2.0,
      secure=False, neighboring=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE).basis
  np.testing.assert_allclose(run.bases[1], expected, atol=1e-6)
  assert not np.allclose(np.abs(run.bases[0]), np.abs(run.bases[1]), atol=1e-2)
  gram = np.einsum("kdr,kds->krs", run.bases, run.bases)
  np.testing.assert_allclose(gram, np.broadcast_to(np.eye(3), gram.shape), atol=1e-4)
  # Trained in the basis (Abadi et al.): the returned first kernel is B W_k, in span(B) ...
  w = np.asarray(run.params[0]["w"], np.float64)
  B = np.asarray(run.bases, np.float64)
  off = w - np.einsum("kdr,ksr,ksh->kdh", B, B, w)     # (I − BBᵀ) W per run
  assert np.abs(off).max() < 1e-5 * np.abs(w).max()
  # ... and the k-input model sees Bᵀx: the per-run rows the program trains on.
  rows, bases = routes._private_input_bases(keys, np.asarray(data[0]), 0.1, 0.3e-5, settings,
                                            routes.input_basis_event(0.1, 0.3e-5))
  np.testing.assert_array_equal(bases, run.bases)
  np.testing.assert_allclose(rows, np.einsum("nd,kdr->knr", data[0], bases), rtol=1e-6,
                             atol=1e-6)


def test_private_input_subspace_scales_rows_to_unit_norm_for_its_release(data):
  """input_scaling="unit" (the default, Abadi et al.): the release is Analyze Gauss on the rows
  scaled to norm 1 with C_x = 1 (a zero row stays 0); the init maps W₀ to √(d/k)·BᵀW₀ and the
  returned kernel B W_k, so a round trip is √(d/k) times the projection BBᵀW₀."""
  import dp_accounting
  X = np.asarray(data[0]).copy()
  X[0] = 0.0
  keys = jnp.stack([jax.random.key(5)])
  settings = experiments.RouteSettings(input_rank=3)
  event = routes.input_basis_event(0.1, 1e-6)
  _, bases = routes._private_input_bases(keys, X, 0.1, 1e-6, settings, event)
  unit = np.zeros_like(X, dtype=np.float64)
  rows = X[1:].astype(np.float64)
  unit[1:] = rows / np.linalg.norm(rows, axis=1, keepdims=True)
  np.testing.assert_allclose(routes._unit_rows(X), unit, atol=1e-12)
  expected = subspace.analyze_gauss(
      routes.run_keys(keys[0]).subspace, unit, epsilon=0.1, delta=1e-6, k=3, clip_norm=1.0,
      secure=False, neighboring=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE).basis
  np.testing.assert_allclose(bases[0], expected, atol=1e-6)
  with pytest.raises(RuntimeError, match="calibrated"):      # the accounted release is checked
    routes._private_input_bases(keys, X, 0.1, 1e-6, settings, routes.input_basis_event(0.2, 1e-6))
  params = LINEAR(jax.random.key(0))
  B = jnp.asarray(bases[0])
  inner = routes._into_basis(params, B)
  assert inner[0]["w"].shape == (3, 8) and inner[1:] == params[1:]
  back = routes._from_basis(inner, B)[0]["w"]
  np.testing.assert_allclose(back, np.sqrt(D / 3) * (B @ (B.T @ params[0]["w"])), rtol=1e-5,
                             atol=1e-6)


def test_public_gradient_refresh_is_the_public_gradients_top_subspace(data):
  """public_gradient_subspace's refresh: exact at the first step (dpjax.sgd.
  public_gradient_subspace), then warm-started subspace iteration whose fixed point is that
  subspace; the release is projected by V Vᵀ (a projector on the flattened update)."""
  params = LINEAR(jax.random.key(0))
  public = (jnp.asarray(data[0][:40]), jnp.asarray(data[1][:40]))
  refresh = routes._public_projection(demo.example_loss, public, 4)
  p = sum(x.size for x in jax.tree_util.tree_leaves(params))
  zeros = jnp.zeros((p, 4))
  exact = refresh(params, zeros, True)
  expected = sgd.public_gradient_subspace(demo.example_loss, params, public, k=4).basis
  np.testing.assert_allclose(np.abs(exact.T @ expected), np.eye(4), atol=1e-4)
  again = refresh(params, exact, False)                       # a fixed point of the iteration
  np.testing.assert_allclose(np.abs(np.asarray(again).T @ np.asarray(exact)), np.eye(4),
                             atol=1e-3)
  start = jnp.linalg.qr(helpers.normal(3, (p, 4)))[0]
  near = refresh(params, start, False)
  assert np.linalg.matrix_rank(np.asarray(near)) == 4 and np.all(np.isfinite(near))
  updates = jax.tree_util.tree_map(lambda x: helpers.normal(1, x.shape), params)
  once = routes._project_flat(updates, exact)
  twice = routes._project_flat(once, exact)
  for a, b in zip(jax.tree_util.tree_leaves(once), jax.tree_util.tree_leaves(twice)):
    np.testing.assert_allclose(a, b, atol=1e-5)
  flat = jax.flatten_util.ravel_pytree(once)[0]
  np.testing.assert_allclose(exact @ (exact.T @ flat), flat, atol=1e-5)


@pytest.mark.slow(reason="the public gradient route learns (60 steps); by default "
                         "test_routes_outside_the_dense_ones_train_any_params_pytree trains it")
def test_public_gradient_route_learns_at_dp_sgds_noise(data):
  """The public gradient route releases dp_sgd's sum at dp_sgd's σ (the projection is
  post-processing), trains on the private rows only, is deterministic per key and learns the toy
  task above its majority class (0.53; measured 0.56–0.57 over these keys)."""
  keys = jnp.stack([jax.random.key(0), jax.random.key(1), jax.random.key(0)])
  settings = experiments.RouteSettings(public_gradient_rank=4, public_gradient_refresh=5)
  run = _run("public_gradient_subspace", data, keys, lrs=np.full(3, 0.2), init=LINEAR,
             steps=60, settings=settings)
  assert run.noise_multiplier == _sigma(2.0, N - 40, 60)
  for x in jax.tree_util.tree_leaves(run.params):
    np.testing.assert_array_equal(x[0], x[2])
  acc = jax.vmap(lambda p: demo.accuracy(p, *map(jnp.asarray, data)))(run.params)
  assert float(jnp.min(acc)) > 0.545


def test_gep_edge_noise_std_is_the_stated_public_bound():
  s = experiments.RouteSettings(clip_norm=2.0, gep_residual_clip=0.5, gep_filter=0.8)
  expected = 3.0 * 2.0 / 64 * np.sqrt(2 * (1 + 0.25)) * np.sqrt(0.2 / 1.8)
  assert experiments.gep_edge_noise_std(3.0, 64, s) == pytest.approx(expected, rel=1e-12)


def test_oracle_settings_must_be_integers(data):
  with pytest.raises(TypeError, match="oracle_refresh"):
    experiments.train_route("oracle_subspace", jnp.stack([jax.random.key(0)]), [0.1], data,
                            init_fn=INIT, loss_fn=demo.example_loss, epsilon=1.0, delta=1e-5,
                            steps=4, expected_batch_size=32,
                            settings=experiments.RouteSettings(oracle_refresh=2.5))


@pytest.mark.parametrize("route, kwargs, match", [
    ("adam", {}, "route must be one of"),
    ("dp_sgd", {"learning_rates": [0.1, 0.1]}, "pair up"),
    ("dp_sgd", {"learning_rates": [-0.1]}, "pair up"),
    ("dp_sgd", {"expected_batch_size": N + 1}, "exceeds"),
    ("dp_sgd", {"public_inputs": np.zeros((40, D))}, "public_inputs"),
    ("dp_sgd", {"public_data": (np.zeros((40, D)), np.zeros(40, int))}, "public_data"),
    ("public_gradient_subspace", {}, "public_data"),
    ("public_gradient_subspace", {"public_data": (np.zeros((40, D + 1)), np.zeros(40, int))},
     "public_data must be"),
    ("public_gradient_subspace", {"public_data": (np.zeros((4, D)), np.zeros(4, int))},
     "public_gradient_rank"),
    ("public_gradient_subspace", {"public_data": (np.zeros((40, D)), np.zeros(40, int)),
                                  "settings": _S(public_gradient_refresh=0)},
     "public_gradient_refresh"),
    ("private_input_subspace", {"settings": _S(input_rank=2, input_scaling="none")},
     "input_scaling"),
    ("public_subspace", {}, "public_inputs"),
    ("public_subspace", {"public_inputs": np.zeros((40, D + 1))}, "public_inputs must be"),
    ("public_subspace", {"public_inputs": np.zeros((8, D))}, "public_rank"),
    ("gep_trajectory", {"init_fn": lambda k: {"w": jnp.zeros((D, 3))}}, "list of dense layers"),
    ("private_input_subspace", {"init_fn": lambda k: {"w": jnp.zeros((D, 3))}}, "dense layers"),
    ("dp_sgd", {"init_fn": functools.partial(demo.init_mlp, sizes=(D + 1, 3))}, "inputs"),
    ("gep_trajectory", {"settings": _S(gep_edge_scale=0.0)}, "gep_edge_scale"),
    ("gep_trajectory", {"settings": _S(gep_edge_scale=-1.0)}, "gep_edge_scale"),
    ("oracle_subspace", {"settings": _S(oracle_rank=0)}, "oracle_rank"),
    ("private_input_subspace", {"settings": _S(input_rank=D + 1)}, "input_rank"),
    ("private_input_subspace", {"settings": _S(input_rank=2, input_epsilon_fraction=0.0)},
     "input_epsilon_fraction"),
    ("private_input_subspace", {"settings": _S(input_rank=2, input_delta_fraction=1.0)},
     "input_delta_fraction"),
    ("private_input_subspace", {"settings": _S(input_rank=2, input_scaling="clip",
                                               input_clip_norm=0.0)},
     "input_clip_norm"),
    ("oracle_subspace", {"settings": _S(oracle_refresh=0)}, "oracle_refresh"),
    ("dp_sgd", {"tuning": accounting.HyperparameterTuning(3.0)}, "accountant='rdp'"),
    ("dp_sgd", {"tuning": accounting.HyperparameterTuning(0.5), "accountant": "rdp"},
     "tuning.mean"),
    ("private_input_subspace", {"tuning": accounting.HyperparameterTuning(3.0),
                                "accountant": "rdp",
                                "settings": _S(input_rank=2)}, "subspace release"),
])
def test_bad_arguments_raise_clear_errors(route, kwargs, match, data):
  args = {"learning_rates": [0.1], "init_fn": INIT, "expected_batch_size": 32,
          "public_inputs": None, "public_data": None, **kwargs}
  with pytest.raises(ValueError, match=match):
    experiments.train_route(route, jnp.stack([jax.random.key(0)]), args["learning_rates"],
                            data, init_fn=args["init_fn"], loss_fn=demo.example_loss,
                            epsilon=1.0, delta=1e-5, steps=4,
                            expected_batch_size=args["expected_batch_size"],
                            public_inputs=args["public_inputs"],
                            public_data=args["public_data"], settings=args.get("settings", experiments.RouteSettings()),
                            accountant=args.get("accountant", "pld"), tuning=args.get("tuning"))


def test_a_tuned_route_states_the_tunings_guarantee_and_what_all_runs_cost(data):
  """With a Papernot–Steinke tuning, σ is the tuning's (RDP) and the stated (ε, δ) covers the
  released best run; all K runs together cost K times one run's ε at that σ (issue 34 §5; the
  untuned K·ε is checked in the private input subspace's test)."""
  keys = jnp.stack([jax.random.key(0), jax.random.key(1)])
  tuning = accounting.HyperparameterTuning(3.0)
  tuned = _run("dp_sgd", data, keys, init=LINEAR, epsilon=0.5, steps=2, tuning=tuning)
  assert tuned.noise_multiplier == accounting.calibrate_noise_multiplier(
      0.5, 1e-5, 32 / N, 2, tuning=tuning) > _sigma(0.5, N, 2)
  assert (tuned.epsilon, tuned.delta, tuned.num_runs) == (0.5, 1e-5, 2)
  one = accounting.dpsgd_epsilon(tuned.noise_multiplier, 32 / N, 2, 1e-5)
  assert one < 0.5 and tuned.all_runs_epsilon == pytest.approx(2 * one)
  assert tuned.all_runs_delta == pytest.approx(2e-5)


def test_the_harness_is_outside_the_public_namespace():
  """dpjax.experiments is a research harness: ``import dpjax`` (and dpjax.sgd) does not load it,
  dpjax.sgd holds none of its names, and its own __all__ names exist."""
  code = ("import sys, dpjax, dpjax.sgd; print('dpjax.experiments' in sys.modules, "
          "[n for n in ('train_route', 'RouteSettings', 'ROUTES', 'routes') "
          "if hasattr(dpjax.sgd, n)])")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       timeout=300).stdout.split()
  assert out == ["False", "[]"]
  assert all(hasattr(experiments, name) for name in experiments.__all__)
  assert not set(experiments.__all__) & set(sgd.__all__)


def test_routes_outside_the_dense_ones_train_any_params_pytree(data):
  """dp_sgd and the public gradient route take any params pytree (here a Flax NNX State of
  nnx.split): the same σ as for a dense list, params stacked per run, deterministic per key; the
  routes that act on a first dense layer refuse it with the reason."""
  nnx = pytest.importorskip("flax.nnx")
  graphdef = nnx.split(nnx.Linear(D, 3, rngs=nnx.Rngs(0)))[0]

  def init(key):
    return nnx.split(nnx.Linear(D, 3, rngs=nnx.Rngs(key)))[1]

  def loss(params, example):
    x, y = example
    return optax.softmax_cross_entropy_with_integer_labels(nnx.merge(graphdef, params)(x), y)

  keys = jnp.stack([jax.random.key(0), jax.random.key(1), jax.random.key(0)])
  settings = experiments.RouteSettings(public_gradient_rank=4, public_gradient_refresh=3)
  for route in ("dp_sgd", "public_gradient_subspace"):
    public = ({"public_data": (data[0][:40], data[1][:40])}
              if route == "public_gradient_subspace" else {})
    rows = (data[0][40:], data[1][40:]) if public else data
    run = experiments.train_route(route, keys, np.full(3, 0.1), rows, init_fn=init, loss_fn=loss,
                                  epsilon=2.0, delta=1e-5, steps=6, expected_batch_size=32,
                                  accountant="rdp", settings=settings, **public)
    assert run.noise_multiplier == _sigma(2.0, len(rows[1]), 6)
    leaves = jax.tree_util.tree_leaves(run.params)
    assert [x.shape for x in leaves] == [(3, *x.shape) for x in
                                         jax.tree_util.tree_leaves(init(jax.random.key(0)))]
    for x in leaves:
      assert np.all(np.isfinite(x))
      np.testing.assert_array_equal(x[0], x[2])
  for route in experiments.DENSE_ROUTES:
    with pytest.raises(ValueError, match="list of dense layers"):
      experiments.train_route(route, keys, np.full(3, 0.1), data, init_fn=init, loss_fn=loss,
                              epsilon=2.0, delta=1e-5, steps=6, expected_batch_size=32,
                              public_inputs=data[0][:40] if route == "public_subspace" else None)


def test_the_routes_step_is_the_plans_update(data, monkeypatch):
  """Issue 50 §5: the harness has no step loop of its own: every DP route's steps are
  ``DPSGDPlan.update`` of plans made by ``DPSGDConfig.make`` (one config per call, one plan per
  run, each plan's own key), and non_private makes none (negative control)."""
  made, traced = [], []
  real_make, real_update = sgd.DPSGDConfig.make, sgd.DPSGDPlan.update
  monkeypatch.setattr(sgd.DPSGDConfig, "make",
                      lambda self, *a, **k: made.append(self) or real_make(self, *a, **k))
  monkeypatch.setattr(sgd.DPSGDPlan, "update",
                      lambda self, *a: traced.append(self) or real_update(self, *a))
  keys = jnp.stack([jax.random.key(5), jax.random.key(6)])
  _run("dp_sgd", data, keys, init=LINEAR, epsilon=0.5, steps=2,
       settings=experiments.RouteSettings(clip_norm=0.3))   # a fresh program: traced here
  assert len(made) == 2 and made[0] is made[1]                # one config, one plan per run
  assert traced and all(p.config is made[0] for p in traced)
  made.clear(), traced.clear()
  _run("non_private", data, keys, init=LINEAR, steps=2)
  assert made == [] and traced == []


@pytest.mark.parametrize("route", ["dp_sgd", "gep_trajectory"])
def test_a_model_written_with_dense_is_clipped_by_ghost_norms(route):
  """The main job's MLP loss is a ModelLoss: the routes clip it by ghost norms (no per-example
  gradients), the same sum as the vmap path to float rounding and the same bound; a plain
  function loss of the same model takes the vmap path. The non-private sum is the gradient of
  the masked loss, equal to the per-example gradients summed over the mask."""
  settings = experiments.RouteSettings(clip_norm=0.7, gep_rank=3)
  assert isinstance(demo.example_loss, ghost.ModelLoss)
  fast = routes._grad_fns(route, demo.example_loss, settings)
  plain = routes._grad_fns(route, lambda p, e: demo.example_loss(p, e), settings)
  params = INIT(jax.random.key(1))
  rng = np.random.default_rng(3)
  X = rng.normal(size=(40, D)).astype(np.float32)
  X[0] *= 50.0                                # one example far above the clip norm
  y = rng.integers(0, 3, 40).astype(np.int32)
  mask = (jnp.arange(40) % 3 != 0).astype(jnp.float32)
  args = (params, (jnp.asarray(X), jnp.asarray(y)), mask)
  if route == "gep_trajectory":
    basis = np.linalg.qr(helpers.normal(5, (D, 3)))[0].astype(np.float32)
    args += (routes.first_layer_bases(params, basis),)
  for a, b in zip(fast, plain):
    assert a.l2_norm_bound == pytest.approx(b.l2_norm_bound)
  got, want = fast[-1](*args), plain[-1](*args)
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)
  total = routes._unclipped_sum(demo.example_loss)(*args[:3])
  per = jax.vmap(jax.grad(demo.example_loss), in_axes=(None, 0))(params, args[1])
  expected = jax.tree_util.tree_map(lambda g: jnp.tensordot(mask, g, axes=1), per)
  for g, w in zip(jax.tree_util.tree_leaves(total), jax.tree_util.tree_leaves(expected)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_noise_bands_run_bandmf_noise_with_cyclic_sampling_on_the_amplified_event(data):
  """settings.noise_bands = 2: the route's plans draw BandMF noise (optimal 2-band strategy for
  T) with cyclic Poisson sampling; σ is the config's, calibrated on the amplified event; GEP's
  two plans and tuning are refused."""
  run = _run("dp_sgd", data, jnp.stack([jax.random.key(0), jax.random.key(1)]), epsilon=0.5,
             settings=_S(noise_bands=2))
  config = sgd.DPSGDConfig(num_examples=N, expected_batch_size=32, steps=12, epsilon=0.5,
                           delta=1e-5, accountant="rdp",
                           noise_strategy=sgd.optimal_banded_toeplitz(12, 2))
  assert run.noise_multiplier == pytest.approx(config.calibrate().noise_multiplier, rel=1e-9)
  assert run.noise_multiplier > _sigma(0.5, N, 12)
  assert np.all(np.isfinite(jax.tree_util.tree_leaves(run.params)[0]))
  with pytest.raises(ValueError, match="noise_bands"):
    _run("gep_trajectory", data, jnp.stack([jax.random.key(0)]), epsilon=0.5,
         settings=_S(noise_bands=2))
