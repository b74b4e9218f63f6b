"""Correlated (BandMF) noise and cyclic Poisson sampling (issue 52 §1, §3; docs/algorithms.md
§6.6): the released noise is exactly C⁻¹ of the independent draws on every release map, the
T-step covariance is std²·C⁻¹C⁻ᵀ, the plan's event is jax_privacy's amplified BandMF event, and
the slips (a cycle below the bands, L·b > N, a strategy with truncation or adaptive clipping)
are refused; on a mesh the cyclic sample is the single-device one."""

import dataclasses

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax import sgd
from dpjax.ledger import PrivacyLedger
from dpjax.sgd import correlation, noise, sampling

T = 6
STRATEGY = sgd.banded_toeplitz([1.0, 0.6, 0.3])


def _linear(w, example):
  x, y = example
  return (x @ w["w"] + w["b"][0] - y) ** 2


GRAD_FN = sgd.clipped_grad_sum(_linear, clip_norm=1.0)
PARAMS = {"w": jnp.zeros(5), "b": jnp.zeros(1)}


def _released(tx, params, updates, steps=T):
  """The T updates of ``tx`` on the same ``updates`` (times L: the released sums)."""
  state = tx.init(params)
  update = jax.jit(tx.update)
  out = []
  for _ in range(steps):
    u, state = update(updates, state)
    out.append(u)
  return out, state


def _stack(updates, leaf):
  return np.stack([np.asarray(leaf(u)).reshape(-1) for u in updates])


@pytest.mark.parametrize("release", ["full", "flat", "layers", "embedding_residual"])
def test_correlated_noise_is_the_inverse_strategy_of_the_independent_draws(release):
  """C·Y (correlated) equals the independent release Y' drawn with the same key, on every
  release map: the same Z, fed through C⁻¹ (zero updates: only noise is released)."""
  params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
  kwargs = {}
  grad_fn = sgd.clipped_grad_sum(lambda p, ex: jnp.sum(p["w"]) + jnp.sum(p["b"]), clip_norm=1.0)
  updates = jax.tree_util.tree_map(jnp.zeros_like, params)
  if release == "flat":
    kwargs["basis"] = np.eye(15, 4, dtype=np.float32)
  elif release == "layers":
    kwargs["bases"] = {"w": np.eye(4, 2, dtype=np.float32), "b": None}
  elif release == "embedding_residual":
    kwargs["bases"] = {"w": np.eye(4, 2, dtype=np.float32), "b": None}
    grad_fn = sgd.embedding_residual_grad_sum(lambda p, ex: jnp.sum(p["w"]), embedding_clip=1.0,
                                              residual_clip=1.0)
    updates = {"embedding": {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)},
               "residual": {"w": jnp.zeros((4, 3)), "b": jnp.zeros((0,))}}
  common = dict(noise_multiplier=1.0, expected_batch_size=1.0, key=jax.random.key(3), steps=T)
  assert noise.release_of(grad_fn, kwargs.get("basis"), kwargs.get("bases")) == release
  corr, state = _released(noise.dp_noise(grad_fn, noise_strategy=STRATEGY, **common, **kwargs),
                          params, updates)
  iid, _ = _released(noise.dp_noise(grad_fn, **common, **kwargs), params, updates)
  C = STRATEGY.materialize(T)
  for leaf in (lambda u: u["w"], lambda u: u["b"]):
    np.testing.assert_allclose(C @ _stack(corr, leaf), _stack(iid, leaf), atol=2e-5)
  assert len(state.correlation) == {"full": 2, "flat": 1, "layers": 2,
                                    "embedding_residual": 3}[release]


def test_one_band_is_independent_noise_and_cyclic_sampling_of_one_is_poisson():
  """C = I: the same draws as no strategy; cycle 1: the same sample as Poisson sampling."""
  common = dict(noise_multiplier=1.0, expected_batch_size=1.0, key=jax.random.key(4), steps=T)
  updates = jax.tree_util.tree_map(jnp.zeros_like, PARAMS)
  one, _ = _released(noise.dp_noise(GRAD_FN, noise_strategy=sgd.banded_toeplitz([2.0]),
                                    **common), PARAMS, updates)
  iid, _ = _released(noise.dp_noise(GRAD_FN, **common), PARAMS, updates)
  np.testing.assert_allclose(_stack(one, lambda u: u["w"]), _stack(iid, lambda u: u["w"]),
                             rtol=1e-6)
  key, part = jax.random.split(jax.random.key(5))
  chosen = sampling.cyclic_poisson_chosen(key, part, 300, 0.2, 1, 7)
  assert np.array_equal(chosen, sampling.poisson_mask(key, 300, 0.2))


def test_the_noise_covariance_over_the_steps_is_that_of_the_inverse_strategy():
  """2,000 runs of 6 steps: cov(Y) = std²·C⁻¹C⁻ᵀ (std = σΔ = 2)."""
  tx = noise.dp_noise(GRAD_FN, noise_multiplier=2.0, expected_batch_size=1.0,
                      key=jax.random.key(0), steps=T, noise_strategy=STRATEGY)
  updates = jax.tree_util.tree_map(jnp.zeros_like, PARAMS)

  def run(key):
    state = dataclasses.replace(tx.init(PARAMS), key=key)

    def body(state, _):
      u, state = tx.update(updates, state)
      return state, u["w"][0]
    return jax.lax.scan(body, state, None, length=T)[1]
  Y = np.asarray(jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(1), 2000)))
  Cinv = np.linalg.inv(STRATEGY.materialize(T))
  expected = 4.0 * Cinv @ Cinv.T
  np.testing.assert_allclose(np.cov(Y.T), expected, atol=0.1 * np.abs(expected).max())


def test_materialize_matches_jax_privacy_and_has_unit_columns():
  C = STRATEGY.materialize(T)
  np.testing.assert_allclose(np.linalg.norm(C, axis=0), 1.0, rtol=1e-12)
  assert np.allclose(np.triu(C, 1), 0) and np.allclose(np.tril(C, -STRATEGY.bands), 0)
  from jax_privacy.matrix_factorization import streaming_matrix
  Cinv = np.asarray(streaming_matrix.StreamingMatrix.materialize(STRATEGY.noising_matrix(T), T))
  np.testing.assert_allclose(Cinv @ C, np.eye(T), atol=1e-5)


def test_optimal_strategy_is_unit_norm_and_beats_independent_noise_on_prefix_sums():
  strategy = sgd.optimal_banded_toeplitz(32, 4, max_optimizer_steps=50)
  assert strategy.bands == 4 and abs(np.linalg.norm(strategy.coefs) - 1) < 1e-9
  C = strategy.materialize(32)
  A = np.tril(np.ones((32, 32)))                     # the prefix-sum workload
  error = np.sum((A @ np.linalg.inv(C)) ** 2)        # at sensitivity 1 (unit columns)
  assert error < 0.8 * np.sum(A ** 2)                # independent noise: ‖A‖_F²
  assert sgd.optimal_banded_toeplitz(10, 1) == sgd.BandedToeplitz((1.0,))


def test_cyclic_sampling_draws_only_the_step_group_at_the_group_rate():
  key = jax.random.key(6)
  part = jax.random.key(7)
  n, b, q = 3000, 3, 0.5
  masks = np.stack([np.asarray(sampling.cyclic_poisson_chosen(k, part, n, q, b, t))
                    for t, k in enumerate(jax.random.split(key, 6))])
  group = np.asarray(jax.random.randint(part, (n,), 0, b))
  for t in range(6):
    assert not masks[t][group != t % b].any()
    rate = masks[t][group == t % b].mean()
    assert abs(rate - q) < 0.05
  assert abs(np.bincount(group, minlength=b) / n - 1 / b).max() < 0.03


def test_the_plan_event_is_jax_privacys_amplified_bandmf_event():
  from jax_privacy.experimental import accounting as jpa
  config = sgd.DPSGDConfig(num_examples=600, expected_batch_size=50, steps=20,
                           noise_multiplier=1.5, noise_strategy=STRATEGY)
  assert config.cycle_length == 3 and config.sampling_prob == pytest.approx(0.25)
  assert config.dp_event == jpa.amplified_bandmf_event(1.5, 20, num_bands=3, sampling_prob=0.25)
  assert config.batch_selection.compositions(20) == 7
  ledger = PrivacyLedger(epsilon=100.0, delta=1e-3)
  plan = config.make(GRAD_FN, key=jax.random.key(0), ledger=ledger)
  assert isinstance(plan.batch_selection, sampling.CyclicPoissonSampling)
  assert ledger.entries[-1].event == config.dp_event


def test_a_plan_with_correlated_noise_trains_on_every_release_and_counts_its_steps():
  rng = np.random.default_rng(0)
  X = rng.normal(size=(300, 5)).astype(np.float32)
  y = X @ np.arange(1.0, 6.0, dtype=np.float32)
  opt = optax.sgd(0.05)
  for kwargs in ({}, {"basis": np.eye(6, 3, dtype=np.float32)}):
    plan = sgd.dp_sgd_plan(GRAD_FN, num_examples=300, expected_batch_size=30, steps=8,
                           noise_multiplier=0.5, key=jax.random.key(1), noise_strategy=STRATEGY,
                           **kwargs)
    state = plan.init(PARAMS, opt)
    params, state = plan.run(PARAMS, state, plan.prepare((X, y)), opt, steps=4)
    params, state = plan.step(params, state, plan.prepare((X, y)), opt)
    assert plan.steps_taken(state) == 5 and np.all(np.isfinite(params["w"]))
  with pytest.raises(ValueError, match="budget"):
    plan.run(params, state, plan.prepare((X, y)), opt, steps=4)


def test_the_partition_is_the_runs_one_draw():
  """The groups come from the run's first key: the same at every step, another for another
  run's key; never from a step's key."""
  tx = noise.dp_noise(GRAD_FN, noise_multiplier=1.0, expected_batch_size=1.0,
                      key=jax.random.key(9), steps=T)
  state = tx.init(PARAMS)
  later = tx.update(jax.tree_util.tree_map(jnp.zeros_like, PARAMS), state)[1]
  first = noise.partition_key(state)
  assert np.array_equal(jax.random.key_data(first),
                        jax.random.key_data(noise.partition_key(later)))
  other = noise.partition_key(tx.init(PARAMS).__class__(**{**state.__dict__,
                                                           "key": jax.random.key(10),
                                                           "origin": noise.key_origin(
                                                               jax.random.key(10))}))
  assert not np.array_equal(jax.random.key_data(first), jax.random.key_data(other))
  legacy = dataclasses.replace(state, key=jax.random.PRNGKey(9),
                               origin=noise.key_origin(jax.random.PRNGKey(9)))
  assert np.array_equal(np.asarray(noise.partition_key(legacy)),
                        np.asarray(jax.random.key_data(first)))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(noise_strategy=STRATEGY, cycle_length=2), ValueError, "bands"),
    (dict(noise_strategy=STRATEGY, expected_batch_size=250), ValueError, "cycle_length"),
    (dict(noise_strategy=STRATEGY, max_batch_size=40), ValueError, "truncated"),
    (dict(noise_strategy=(1.0, 0.5)), TypeError, "BandedToeplitz"),
    (dict(cycle_length=0), ValueError, "cycle_length"),
])
def test_slips_are_refused(kwargs, error, match):
  args = dict(num_examples=600, expected_batch_size=50, steps=20, noise_multiplier=1.0) | kwargs
  with pytest.raises(error, match=match):
    sgd.DPSGDConfig(**args)


def test_refusals_at_make_and_in_dp_noise():
  config = sgd.DPSGDConfig(num_examples=600, expected_batch_size=50, steps=20,
                           noise_multiplier=1.0, noise_strategy=STRATEGY)
  quantile = sgd.quantile_clipped_grad_sum(_linear, initial_clip_norm=1.0)
  with pytest.raises(ValueError, match="noise_strategy"):
    config.make(quantile, key=jax.random.key(0))
  with pytest.raises(ValueError, match="steps"):
    noise.dp_noise(GRAD_FN, noise_multiplier=1.0, expected_batch_size=1.0,
                   key=jax.random.key(0), noise_strategy=STRATEGY)
  for bad in ([], [0.0, 1.0], [1.0, np.nan], [-1.0, 0.5]):
    with pytest.raises(ValueError, match="coefs"):
      sgd.banded_toeplitz(bad)
    with pytest.raises(ValueError, match="coefs"):
      sgd.BandedToeplitz(tuple(bad))           # built directly: the same check


def test_update_bases_keeps_the_buffers():
  basis = np.eye(6, 3, dtype=np.float32)
  tx = noise.dp_noise(GRAD_FN, noise_multiplier=1.0, expected_batch_size=1.0,
                      key=jax.random.key(2), steps=T, basis=basis, noise_strategy=STRATEGY)
  state = tx.init(PARAMS)
  _, state = tx.update(jax.tree_util.tree_map(jnp.zeros_like, PARAMS), state)
  swapped = noise.update_bases(state, basis=np.eye(6, 3, k=-1, dtype=np.float32))
  for a, b in zip(jax.tree_util.tree_leaves(state.correlation),
                  jax.tree_util.tree_leaves(swapped.correlation)):
    assert np.array_equal(a, b)
  assert correlation.BandedToeplitz((1.0,)).bands == 1


def test_cyclic_sampling_with_independent_noise():
  """cycle_length alone: cyclic Poisson groups, independent noise, ⌈T/b⌉ rounds at L·b/N."""
  config = sgd.DPSGDConfig(num_examples=600, expected_batch_size=50, steps=20,
                           noise_multiplier=1.0, cycle_length=3)
  assert config.noise_strategy is None and config.sampling_prob == pytest.approx(0.25)
  assert config.dp_event == dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(1.0)), 7)
  plan = config.make(GRAD_FN, key=jax.random.key(3))
  X = np.random.default_rng(1).normal(size=(600, 5)).astype(np.float32)
  data = plan.prepare((X, X[:, 0]))
  state = plan.init(PARAMS, optax.sgd(0.1))
  assert plan.clipped_sum(PARAMS, data, state)["w"].shape == (5,)
  assert noise.noise_state(state).correlation is None


# --------------------------------------------------- BLT: multi-epoch MF without amplification

BLT = correlation.buffered_toeplitz([0.8, 0.3], [0.5, 0.2], min_sep=2)


def _minsep_sensitivity_brute(C, min_sep):
  """max over every participation pattern (steps ≥ min_sep apart) of ‖Σ_{t∈π} C[:, t]‖ (all
  patterns, by enumeration; C ≥ 0 so aligned contributions are the worst)."""
  T = C.shape[1]
  best = 0.0

  def walk(start, total):
    nonlocal best
    best = max(best, float(np.linalg.norm(total)))
    for t in range(start, T):
      walk(t + min_sep, total + C[:, t])
  walk(0, np.zeros(T))
  return best


@pytest.mark.parametrize("min_sep", [1, 2, 3])
def test_blt_is_normalised_to_min_sep_sensitivity_one_over_every_pattern(min_sep):
  """The strategy C/s has sensitivity exactly 1 over EVERY participation pattern with steps at
  least min_sep apart (enumerated for T = 9), not only the evenly spaced one the bound uses."""
  strategy = dataclasses.replace(BLT, min_sep=min_sep)
  C = strategy.materialize(9)
  assert _minsep_sensitivity_brute(C, min_sep) == pytest.approx(1.0, rel=1e-8)
  assert _minsep_sensitivity_brute(C, min_sep) <= 1.0 + 1e-12
  np.testing.assert_allclose(strategy.coefficients(4),
                             [1.0, 0.7, 0.5 * 0.8 + 0.2 * 0.3, 0.5 * 0.64 + 0.2 * 0.09])


def test_blt_noise_is_s_times_the_inverse_strategy_of_the_independent_draws():
  """C·Y/s equals the independent release of the same keys (full and flat releases), and the
  streaming state is one buffer per decay, not T."""
  updates = jax.tree_util.tree_map(jnp.zeros_like, PARAMS)
  common = dict(noise_multiplier=1.0, expected_batch_size=1.0, key=jax.random.key(7), steps=T)
  for kwargs in ({}, {"basis": np.eye(6, 3, dtype=np.float32)}):
    corr, state = _released(noise.dp_noise(GRAD_FN, noise_strategy=BLT, **common, **kwargs),
                            PARAMS, updates)
    iid, _ = _released(noise.dp_noise(GRAD_FN, **common, **kwargs), PARAMS, updates)
    C = BLT.materialize(T)
    np.testing.assert_allclose(C @ _stack(corr, lambda u: u["w"]), _stack(iid, lambda u: u["w"]),
                               atol=2e-5)
    assert {b.shape[0] for b in jax.tree_util.tree_leaves(state.correlation)} == {2}


def test_the_blt_plan_is_one_gaussian_with_cyclic_participation():
  """The event of a BLT plan is the run's one Gaussian mechanism (no amplification), its cycle
  the strategy's min_sep, and ε is the Gaussian's at σ; a cycle below min_sep is refused."""
  config = sgd.DPSGDConfig(num_examples=600, expected_batch_size=300, steps=20,
                           noise_multiplier=3.0, noise_strategy=BLT, accountant="rdp")
  assert config.cycle_length == 2 and config.sampling_prob == 1.0
  assert config.dp_event == dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(3.0), 1)
  want = dp_accounting.rdp.RdpAccountant().compose(
      dp_accounting.GaussianDpEvent(3.0)).get_epsilon(1e-5)
  assert config.calibrate().epsilon == pytest.approx(want, rel=1e-9)
  one_epoch_blt = dataclasses.replace(BLT, min_sep=1)
  assert sgd.DPSGDConfig(num_examples=600, expected_batch_size=30, steps=20,
                         noise_multiplier=3.0, noise_strategy=one_epoch_blt).cycle_length == 1
  with pytest.raises(ValueError, match="min_sep"):
    sgd.DPSGDConfig(num_examples=600, expected_batch_size=50, steps=20, noise_multiplier=1.0,
                    noise_strategy=BLT, cycle_length=1)
  rng = np.random.default_rng(0)
  X = rng.normal(size=(600, 5)).astype(np.float32)
  y = X @ np.arange(1.0, 6.0, dtype=np.float32)
  plan = config.make(GRAD_FN, key=jax.random.key(2))
  opt = optax.sgd(0.002)
  params, state = plan.run(PARAMS, plan.init(PARAMS, opt), plan.prepare((X, y)), opt)
  assert plan.steps_taken(state) == 20 and np.all(np.isfinite(params["w"]))
  assert isinstance(plan.batch_selection, sampling.CyclicPoissonSampling)
  assert not plan.batch_selection.amplified


def test_optimal_blt_beats_independent_noise_on_the_prefix_sums_under_min_sep():
  """jax_privacy's optimiser: on T = 64 steps with min_sep 8 the normalised BLT's max error on
  the prefix sums (row norms of A·(C/s)⁻¹, A the prefix-sum matrix) is below independent
  noise's at the same sensitivity (C = I / √k)."""
  T_, b = 64, 8
  strategy = correlation.optimal_buffered_toeplitz(T_, b, max_buffers=3)
  A = np.tril(np.ones((T_, T_)))
  blt_error = np.linalg.norm(A @ np.linalg.inv(strategy.materialize(T_)), axis=1).max()
  independent_error = np.linalg.norm(A * np.sqrt(T_ // b), axis=1).max()
  assert blt_error < 0.8 * independent_error, (blt_error, independent_error)


@pytest.mark.parametrize("args,match", [
    (([0.5], [0.1, 0.2], 1), "one length"), (([1.2], [0.1], 1), r"\(0, 1\)"),
    (([0.5], [-0.9], 1), "non-negative|non-increasing"), (([0.5], [1.5], 1), "non-increasing"),
])
def test_bad_blts_are_refused(args, match):
  with pytest.raises(ValueError, match=match):
    correlation.buffered_toeplitz(*args)


def test_lambda_cgd_noise_is_the_previous_draw_subtracted():
  """DP-λCGD: step t's noise is s(z_t − λ z_{t−1}) of the independent draws z (one buffer)."""
  strategy = sgd.lambda_cgd(0.6, min_sep=1)
  assert strategy.coefficients(4) == pytest.approx([1.0, 0.6, 0.36, 0.216])
  updates = jax.tree_util.tree_map(jnp.zeros_like, PARAMS)
  common = dict(noise_multiplier=1.0, expected_batch_size=1.0, key=jax.random.key(8), steps=T)
  corr, state = _released(noise.dp_noise(GRAD_FN, noise_strategy=strategy, **common), PARAMS,
                          updates)
  iid, _ = _released(noise.dp_noise(GRAD_FN, **common), PARAMS, updates)
  z = _stack(iid, lambda u: u["w"])
  want = strategy.sensitivity(T) * (z - 0.6 * np.concatenate([np.zeros_like(z[:1]), z[:-1]]))
  np.testing.assert_allclose(_stack(corr, lambda u: u["w"]), want, rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="lam"):
    sgd.lambda_cgd(1.0, min_sep=1)


_MESH_SLOW = pytest.mark.slow(reason="a second and third sharded plan compile (30 s each); the "
                                     "shared chosen-sum path runs in the BandMF case")


@pytest.mark.parametrize("kwargs", [
    {"noise_strategy": STRATEGY}, pytest.param({"noise_strategy": BLT}, marks=_MESH_SLOW),
    pytest.param({"fixed_size": True, "accountant": "rdp"}, marks=_MESH_SLOW)])
def test_on_a_mesh_cyclic_and_fixed_size_samples_are_the_single_device_ones(kwargs):
  """A one-device mesh here (four devices in tests/sgd/test_distributed.py): the sharded clipped
  sum equals the unsharded one for the same state, at two steps (two groups of the cycle)."""
  rng = np.random.default_rng(0)
  X = rng.normal(size=(301, 5)).astype(np.float32)
  y = X @ np.arange(1.0, 6.0, dtype=np.float32)

  def plan(**more):
    return sgd.dp_sgd_plan(GRAD_FN, num_examples=301, expected_batch_size=30, steps=4,
                           noise_multiplier=1.0, key=jax.random.key(5), microbatch_size=16,
                           **kwargs, **more)
  meshed, single = plan(mesh=sgd.data_mesh()), plan()
  opt = optax.sgd(0.1)
  s_mesh, s_single = meshed.init(PARAMS, opt), single.init(PARAMS, opt)
  for _ in range(2):
    got = meshed.clipped_sum(PARAMS, meshed.prepare((X, y)), s_mesh)
    want = single.clipped_sum(PARAMS, single.prepare((X, y)), s_single)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    _, s_mesh = meshed.step(PARAMS, s_mesh, meshed.prepare((X, y)), opt)
    _, s_single = single.step(PARAMS, s_single, single.prepare((X, y)), opt)


def test_a_blt_whose_coefficients_rise_within_t_is_refused_at_the_config():
  """Built directly (no check at 1,000 steps), a BLT whose coefficients turn negative only after
  step 1,000 is refused when a config plans it for longer, not inside the jitted step."""
  strategy = correlation.BufferedToeplitz((0.999, 0.9995), (0.5, -0.25), min_sep=1)
  assert np.all(strategy.coefficients(1_000) >= 0) and strategy.coefficients(5_000).min() < 0
  with pytest.raises(ValueError, match="non-negative"):
    sgd.DPSGDConfig(num_examples=100_000, expected_batch_size=10, steps=5_000,
                    noise_multiplier=1.0, noise_strategy=strategy)
