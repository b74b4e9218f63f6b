"""dp_sgd_plan: clipping, batch selection, noise and accounting bound in one object (C, σ, Δ and
L cannot disagree); the whole Poisson sample summed in one call; step and run (docs/algorithms.md
§6)."""

import copy
import dataclasses

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_accounting import NeighboringRelation

from dpjax import accounting, sgd
from dpjax.ledger import BudgetExceededError, PrivacyLedger
from dpjax.sgd import noise, sampling
from helpers import normal

N, D = 400, 5
_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.normal(size=(N, D)), jnp.float32)
W_TRUE = jnp.arange(1.0, D + 1.0)
DATA = (X, X @ W_TRUE)


def loss_fn(w, example):
  x, y = example
  return (x @ w - y) ** 2


# The reference masked sum at C = 1, jitted once for the module (op by op it compiles ~30 ops).
_masked_sum = jax.jit(sgd.clipped_grad_sum(loss_fn, clip_norm=1.0))


def _sample_key(opt_state):
  """The key the plan draws the next step's Poisson sample with (its state's ``sample``)."""
  return noise.step_keys(noise.noise_state(opt_state).key).sample


def _plan(grad_fn=None, **kw):
  """A plan on the module's data; σ given (no calibration) unless the test asks for ε."""
  grad_fn = sgd.clipped_grad_sum(loss_fn, clip_norm=1.0) if grad_fn is None else grad_fn
  args = dict(num_examples=N, expected_batch_size=40, steps=5, key=jax.random.key(0)) | kw
  if "epsilon" not in args:
    args.setdefault("noise_multiplier", 0.0)
  return sgd.dp_sgd_plan(grad_fn, **args)


@pytest.mark.slow(reason="a README-style loop learns within budget; test_docs runs the README's "
                         "own loop by default")
def test_the_readme_loop_learns_within_its_budget():
  """The user's own optax loop: plan.clipped_sum and plan.transform; σ calibrated by PLD."""
  params, steps = jnp.zeros(D), 150
  grad_fn = sgd.clipped_grad_sum(loss_fn, clip_norm=5.0)
  plan = sgd.dp_sgd_plan(grad_fn, epsilon=2.0, delta=1e-5, num_examples=N,
                         expected_batch_size=40, steps=steps, key=jax.random.key(0))
  tx = plan.transform(optax.adam(0.05))
  opt_state = plan.init(params, optax.adam(0.05))

  @jax.jit
  def step(params, opt_state):
    grads = plan.clipped_sum(params, DATA, opt_state)    # the sample's key is the plan's
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for _ in range(steps):
    params, opt_state = step(params, opt_state)
  assert float(jnp.linalg.norm(params - W_TRUE)) < 0.5          # from ‖W‖ = 7.4 at the start
  assert plan.epsilon <= 2.0 and plan.delta <= 1e-5 * (1 + 1e-12)
  assert plan.budget.neighboring == NeighboringRelation.ADD_OR_REMOVE_ONE
  assert plan.dp_event == accounting.dpsgd_event(plan.noise_multiplier, 40 / N, steps)
  assert plan.steps_taken(opt_state) == steps
  assert accounting.dpsgd_epsilon(plan.noise_multiplier, 40 / N, steps, 1e-5,
                                  accountant="pld") <= 2.0


@pytest.mark.slow(reason="the plan's clipped sum against the host-side micro-batch layout; "
                         "test_sampling checks the layout and test_engine_grid the plan's sums "
                         "by default")
def test_clipped_sum_equals_the_host_side_microbatch_layout():
  """Every sampled example once: the traceable sum over the Poisson sample of the key equals
  the masked sum over all rows and the host-side layout (poisson_microbatches) summed by
  accumulate_microbatches, whose padding micro-batches add nothing."""
  grad_fn = sgd.clipped_grad_sum(loss_fn, clip_norm=1.0)
  plan = _plan(grad_fn, expected_batch_size=50, microbatch_size=7)     # many micro-batches
  assert plan.batch_selection.microbatch_size == 7
  params = jnp.ones(D)
  state = plan.init(params, optax.sgd(1.0))
  key = _sample_key(state)
  mask = np.asarray(sampling.poisson_mask(key, N, 50 / N))
  expected = _masked_sum(params, DATA, jnp.asarray(mask))             # one pass over all rows
  got = plan.clipped_sum(params, plan.prepare(DATA), state)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
  indices, m = sampling.poisson_microbatches(key, N, 50 / N, 7)
  padded = sampling.accumulate_microbatches(
      grad_fn, params, DATA, jnp.concatenate([jnp.asarray(indices), jnp.zeros((3, 7),
                                                                              jnp.int32)]),
      jnp.concatenate([jnp.asarray(m), jnp.zeros((3, 7), bool)]))
  np.testing.assert_allclose(np.asarray(padded), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_a_step_divides_by_the_expected_not_the_realised_batch_size():
  """σ = 0 and SGD at rate 1: the step moves the params by −S/L with S the clipped sum over the
  sample and L the public expected batch size (never the realised size |sample|)."""
  plan = _plan(expected_batch_size=40)
  opt = optax.sgd(1.0)
  params = jnp.ones(D)
  state = plan.init(params, opt)
  new, _ = plan.step(params, state, plan.prepare(DATA), opt)
  mask = np.asarray(sampling.poisson_mask(_sample_key(state), N, 40 / N))
  summed = np.asarray(_masked_sum(params, DATA, jnp.asarray(mask)), np.float64)
  moved = np.asarray(params - new, np.float64)
  np.testing.assert_allclose(moved, summed / 40.0, rtol=1e-5, atol=1e-6)
  assert mask.sum() != 40 and not np.allclose(moved, summed / mask.sum())


def test_run_is_a_loop_of_steps_on_the_plans_own_key_stream():
  """``run`` (one lax.scan) = ``step`` T times: the samples and the noise come from the key in
  the optimiser state (one plan, one key: two plans made with the same key agree); a run asks
  for at most the planned steps."""
  plan, twin = (_plan(noise_multiplier=1.0, accountant="rdp", steps=3) for _ in range(2))
  opt = optax.sgd(0.05)
  params = jnp.zeros(D)
  data = plan.prepare(DATA)
  p, s = params, plan.init(params, opt)
  keys = []
  for _ in range(3):
    keys.append(jax.random.key_data(_sample_key(s)))
    p, s = plan.step(p, s, data, opt)
  state0 = twin.init(params, opt)
  with pytest.raises(ValueError, match="steps"):
    twin.run(params, state0, data, opt, steps=4)
  run_p, run_s = twin.run(params, state0, data, opt)
  np.testing.assert_allclose(np.asarray(run_p), np.asarray(p), rtol=1e-5, atol=1e-6)
  assert jnp.array_equal(jax.random.key_data(noise.noise_state(run_s).key),
                         jax.random.key_data(noise.noise_state(s).key))
  assert len({bytes(np.asarray(k)) for k in keys}) == 3        # a fresh sample every step
  assert not np.allclose(np.asarray(p), 0.0)


def test_prepare_places_the_data_and_checks_the_example_axis():
  plan = _plan()
  prepared = plan.prepare((np.asarray(X), np.asarray(DATA[1])))
  assert all(isinstance(x, jax.Array) for x in prepared)
  np.testing.assert_array_equal(prepared[0], X)
  with pytest.raises(ValueError, match="num_examples=400"):
    plan.prepare((X[:300], DATA[1][:300]))
  with pytest.raises(ValueError, match="num_examples=400"):
    plan.prepare((X, DATA[1][:300]))
  with pytest.raises(TypeError, match="optimizer"):
    plan.transform(0.1)
  # clipped_sum checks the same at trace time: q = L/N is planned for N rows.
  state = plan.init(jnp.zeros(D), optax.sgd(0.1))
  with pytest.raises(ValueError, match="num_examples=400"):
    jax.eval_shape(lambda d: plan.clipped_sum(jnp.zeros(D), d, state),
                   (X[:300], DATA[1][:300]))


def test_the_noise_is_sigma_times_the_carried_clip_norm():
  """C comes from the clipped function: the plan's noise std is σ·C / L."""
  C, sigma, L = 3.0, 2.0, 10.0
  grad_fn = sgd.clipped_grad_sum(loss_fn, clip_norm=C)
  plan = _plan(grad_fn, noise_multiplier=sigma, expected_batch_size=L, steps=1, accountant="rdp")
  zeros = jnp.zeros(2_000)
  state = plan.init(zeros, optax.identity())
  assert float(noise.noise_state(state).noise_std) == pytest.approx(sigma * C)
  out, _ = plan.noise.update(zeros, noise.noise_state(state))
  std = float(jnp.std(out))
  assert abs(std - sigma * C / L) < 0.05 * sigma * C / L
  assert noise.l2_norm_bound(grad_fn) == C and plan.noise_multiplier == sigma
  assert grad_fn.sensitivity() == C
  assert grad_fn.sensitivity(NeighboringRelation.REPLACE_ONE) == 2 * C


def test_a_basis_puts_the_noise_in_its_span_and_update_bases_refreshes_it():
  V = jnp.asarray(np.linalg.qr(np.asarray(normal(3, (D, 2))))[0])
  plan = _plan(noise_multiplier=1.0, accountant="rdp", steps=10, basis=V)
  tx = plan.transform(optax.sgd(0.1))
  state = plan.init(jnp.zeros(D), optax.sgd(0.1))
  assert noise.noise_state(state).release == "flat"
  updates, state = tx.update(plan.clipped_sum(jnp.zeros(D), DATA, state), state)
  u = np.asarray(updates, np.float64) / -0.1
  Vn = np.asarray(V, np.float64)
  np.testing.assert_allclose(u, Vn @ (Vn.T @ u), atol=1e-5)
  V2 = jnp.asarray(np.linalg.qr(np.asarray(normal(4, (D, 2))))[0])
  state = plan.update_bases(state, basis=V2)
  updates, _ = tx.update(plan.clipped_sum(jnp.zeros(D), DATA, state), state)
  u = np.asarray(updates, np.float64) / -0.1
  Vn = np.asarray(V2, np.float64)
  np.testing.assert_allclose(u, Vn @ (Vn.T @ u), atol=1e-5)
  assert not np.allclose(u, np.asarray(V, np.float64) @ (np.asarray(V, np.float64).T @ u),
                         atol=1e-3)


# ------------------------------------------------------------------------------------ accounting

def test_sigma_is_calibrated_by_pld_by_default_and_by_rdp_on_request():
  """q = 1, T = 1 (PLD calibrates in about a second there; at q ≈ 0.03 it takes tens)."""
  kw = dict(epsilon=1.0, delta=1e-5, expected_batch_size=N, steps=1)
  pld = _plan(**kw)
  assert pld.accountant == "pld"
  assert pld.noise_multiplier == accounting.calibrate_noise_multiplier(1.0, 1e-5, 1.0, 1,
                                                                       accountant="pld")
  assert accounting.dpsgd_epsilon(pld.noise_multiplier, 1.0, 1, 1e-5,
                                  accountant="pld") <= 1.0 + 1e-9
  assert pld.epsilon <= 1.0 + 1e-9 and pld.delta == pytest.approx(1e-5)
  rdp = _plan(accountant="rdp", **kw)
  assert rdp.accountant == "rdp"
  assert rdp.noise_multiplier == accounting.calibrate_noise_multiplier(1.0, 1e-5, 1.0, 1)
  assert rdp.noise_multiplier > pld.noise_multiplier          # PLD is the tighter accountant


def test_noise_multiplier_instead_of_epsilon_certifies_the_budget():
  kw = dict(noise_multiplier=2.0, expected_batch_size=40, steps=5)
  pld = _plan(**kw)
  rdp = _plan(accountant="rdp", **kw)
  assert pld.epsilon == pytest.approx(accounting.dpsgd_epsilon(2.0, 40 / N, 5, 1e-5,
                                                               accountant="pld"))
  assert rdp.epsilon == pytest.approx(accounting.dpsgd_epsilon(2.0, 40 / N, 5, 1e-5))
  assert pld.epsilon <= rdp.epsilon                                # PLD is the tighter one
  assert pld.noise_multiplier == 2.0 and pld.steps == 5
  assert pld.dp_event == accounting.dpsgd_event(2.0, 40 / N, 5)
  assert pld.neighboring == NeighboringRelation.ADD_OR_REMOVE_ONE
  shared = _plan(subspace_epsilon=0.25, subspace_delta=1e-7, **kw)   # δ is the total δ
  assert shared.epsilon == pytest.approx(
      0.25 + accounting.dpsgd_epsilon(2.0, 40 / N, 5, 1e-5 - 1e-7, accountant="pld"))
  assert shared.delta == pytest.approx(1e-5)
  free = _plan(noise_multiplier=0.0)                    # σ = 0: no privacy, for tests
  assert free.epsilon == float("inf") and free.dp_event == dp_accounting.NonPrivateDpEvent()


def test_a_private_subspace_cost_is_composed_into_the_total():
  # RDP: at ε = 1 (σ ≈ 3) its calibrations take ~0.7 s each (PLD's several seconds).
  kw = dict(epsilon=1.0, delta=1e-5, steps=50, accountant="rdp")
  alone = _plan(**kw)
  shared = _plan(subspace_epsilon=0.25, subspace_delta=2e-6, **kw)
  assert shared.noise_multiplier > alone.noise_multiplier
  assert shared.epsilon <= 1.0 + 1e-9 and shared.delta <= 1e-5 * (1 + 1e-9)
  assert shared.budget.subspace_epsilon == 0.25 and shared.budget.subspace_delta == 2e-6


def test_a_ledger_is_checked_before_anything_runs_then_records_the_plan():
  ledger = PrivacyLedger(1.0, 1e-5, accountant="rdp")         # RDP, as the plans below
  kw = dict(noise_multiplier=2.0, steps=5, accountant="rdp", subspace_epsilon=0.1,
            subspace_delta=1e-7)
  plan = _plan(ledger=ledger, **kw)
  assert len(ledger.entries) == 2                               # the subspace share, the steps
  assert ledger.spent.epsilon <= 1.0 and ledger.spent.epsilon >= plan.budget.sgd_epsilon
  before = (ledger.entries, ledger.spent)
  with pytest.raises(BudgetExceededError):
    _plan(ledger=ledger, **kw)                                  # a second one does not fit
  assert (ledger.entries, ledger.spent) == before               # and nothing was recorded


# ------------------------------------------------------------------------------ other grad fns

def test_jax_privacy_clipped_grad_carries_its_bound_into_the_noise():
  clipping = pytest.importorskip("jax_privacy.clipping")
  theirs = clipping.clipped_grad(lambda w, batch: jnp.sum(jax.vmap(loss_fn, (None, 0))(w, batch)),
                                 l2_clip_norm=2.0, batch_argnums=1)
  plan = _plan(theirs, noise_multiplier=1.5, accountant="rdp")
  state = noise.noise_state(plan.init(jnp.zeros(D), optax.sgd(0.1)))
  assert float(state.base_std) == pytest.approx(1.5 * 2.0)


@pytest.mark.slow(reason="jax_privacy's clipped_grad drives a plan step; the default run checks "
                         "that its bound reaches the noise")
def test_interoperates_with_jax_privacy_clipped_grad():
  """jax_privacy's clipped_grad drives the plan (C read from its l2_norm_bound, padding passed
  as is_padding_example), its clipped sum equals dpjax's on the same sample, and a jitted step
  runs with it."""
  clipping = pytest.importorskip("jax_privacy.clipping")
  C = 2.0
  theirs = clipping.clipped_grad(lambda w, batch: jnp.sum(jax.vmap(loss_fn, (None, 0))(w, batch)),
                                 l2_clip_norm=C, batch_argnums=1)
  ours = sgd.clipped_grad_sum(loss_fn, clip_norm=C)
  params = jnp.ones(D)
  np.testing.assert_allclose(np.asarray(theirs(params, DATA)),
                             np.asarray(ours(params, DATA, jnp.ones(N))), rtol=1e-4, atol=1e-4)
  plan_theirs = _plan(theirs, noise_multiplier=1.0, accountant="rdp")
  plan_ours = _plan(ours, noise_multiplier=1.0, accountant="rdp")       # the same key
  opt = optax.sgd(0.01)
  states = [plan.init(params, opt) for plan in (plan_theirs, plan_ours)]
  np.testing.assert_allclose(np.asarray(plan_theirs.clipped_sum(params, DATA, states[0])),
                             np.asarray(plan_ours.clipped_sum(params, DATA, states[1])),
                             rtol=1e-4, atol=1e-4)
  assert theirs.sensitivity(NeighboringRelation.ADD_OR_REMOVE_ONE) == ours.sensitivity()
  steps = [plan.step(params, state, plan.prepare(DATA), opt)[0]
           for plan, state in zip((plan_theirs, plan_ours), states)]
  np.testing.assert_allclose(np.asarray(steps[0]), np.asarray(steps[1]), rtol=1e-4, atol=1e-4)


def test_gep_clipped_sum_splits_by_the_bases_in_the_noise_state():
  """GEP's sum splits by the bases the noise state lifts by: swapping the state's bases changes
  the split (the embedding of a zero-basis direction is empty)."""
  loss = lambda p, ex: loss_fn(p["w"][:, 0], ex)                  # noqa: E731
  fn = sgd.embedding_residual_grad_sum(loss, embedding_clip=1.0, residual_clip=0.5)
  plan = _plan(fn, bases={"w": jnp.eye(D, 2)})
  params = {"w": jnp.zeros((D, 1))}
  state = plan.init(params, optax.sgd(0.1))
  first = plan.clipped_sum(params, DATA, state)
  assert first["embedding"]["w"].shape == (2, 1)
  other = plan.update_bases(state, bases={"w": jnp.eye(D, 2)[::-1]})
  second = plan.clipped_sum(params, DATA, other)
  assert not np.allclose(np.asarray(first["embedding"]["w"]),
                         np.asarray(second["embedding"]["w"]))


# ------------------------------------------------------------------------------- bad arguments

@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(noise_multiplier=None), ValueError, "exactly one"),
    (dict(epsilon=1.0, noise_multiplier=1.0), ValueError, "exactly one"),
    (dict(epsilon=1.0, expected_batch_size=N + 1), ValueError, "num_examples"),
    (dict(epsilon=-1.0), ValueError, "epsilon"),
    (dict(epsilon=1.0, delta=0.0), ValueError, "delta"),
    (dict(noise_multiplier=-1.0), ValueError, "noise_multiplier"),
    (dict(steps=0), ValueError, "steps"),
    (dict(key=0), TypeError, "key"),
    (dict(accountant="gdp"), ValueError, "accountant"),
    (dict(microbatch_size=0), ValueError, "microbatch_size"),
    (dict(mesh="cpu"), TypeError, "Mesh"),
    (dict(basis=jnp.ones((D, 2))), ValueError, "orthonormal"),
    (dict(basis=jnp.eye(D, 2), bases={"w": None}), ValueError, "not both"),
    (dict(epsilon=1.0, tuning=accounting.HyperparameterTuning(3.0), accountant="rdp",
          ledger=PrivacyLedger(1.0, 1e-5)), ValueError, "tuning_event"),
    (dict(epsilon=1.0, tuning=accounting.HyperparameterTuning(3.0)), ValueError,
     "accountant='rdp'"),
])
def test_bad_arguments_raise_clear_errors(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    _plan(**kwargs)


def test_a_function_without_a_sensitivity_is_refused():
  plain = sgd.clipped_grad_sum(loss_fn, clip_norm=1.0).fun       # C dropped
  with pytest.raises(TypeError, match="l2_norm_bound"):
    _plan(plain, epsilon=1.0)
  forged = dataclasses.replace(sgd.clipped_grad_sum(loss_fn, clip_norm=1.0),
                               l2_norm_bound=float("nan"))
  with pytest.raises(ValueError, match="l2_norm_bound"):
    _plan(forged, epsilon=1.0)


# --- one event per plan (issue 50 §1) ---------------------------------------------------------


def _pld(event, delta):
  return dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(delta)


def test_the_plans_event_is_everything_it_releases_and_its_epsilon_comes_from_it():
  """Before: plan.dp_event covered the T steps only (a subspace share of 0.2 was missing from
  it) while plan.epsilon counted it. Each ε is recomputed here by dp_accounting directly."""
  q, T = 40 / N, 5
  steps = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(2.0)), T)
  plain = _plan(noise_multiplier=2.0)
  assert plain.dp_event == steps
  assert plain.epsilon == pytest.approx(_pld(steps, 1e-5), rel=1e-9)
  shared = _plan(noise_multiplier=2.0, subspace_epsilon=0.2, subspace_delta=1e-7)
  assert shared.dp_event == shared.budget.dp_event == dp_accounting.ComposedDpEvent(
      (accounting.EpsilonDeltaDpEvent(0.2, 1e-7), steps))
  assert shared.epsilon == pytest.approx(0.2 + _pld(steps, 1e-5 - 1e-7), rel=1e-9)
  gauss = dp_accounting.GaussianDpEvent(30.0)
  composed = _plan(noise_multiplier=2.0, subspace_event=gauss)
  assert composed.dp_event == dp_accounting.ComposedDpEvent((gauss, steps))
  assert composed.epsilon == pytest.approx(_pld(composed.dp_event, 1e-5), rel=1e-9)
  tuning = accounting.HyperparameterTuning(3.0, 0.0)
  tuned = _plan(noise_multiplier=2.0, accountant="rdp", tuning=tuning)
  direct = dp_accounting.rdp.RdpAccountant().compose(
      accounting.tuning_event(steps, tuning)).get_epsilon(1e-5)
  assert tuned.dp_event == accounting.tuning_event(steps, tuning)
  assert tuned.epsilon == pytest.approx(direct, rel=1e-9)
  calibrated = _plan(epsilon=2.0, subspace_epsilon=0.2, subspace_delta=1e-7)
  assert calibrated.epsilon == pytest.approx(2.0, rel=1e-4) and calibrated.epsilon <= 2.0 + 1e-9


def test_a_private_basis_given_as_its_release_brings_its_cost():
  """Before: the release object as a basis gave an unrelated structure error, and its basis
  array without subspace_event left plan.epsilon at 2.00 though the basis spent more. Now the
  release composes its own event; ⊥ and a second event are refused."""
  release = sgd.private_input_basis(jax.random.key(3), np.asarray(X), 2, epsilon=0.5,
                                    delta=1e-7, clip_norm=3.0, secure=False)
  assert bool(release.ok)
  params = jnp.zeros(D)
  by_release = _plan(noise_multiplier=2.0, basis=release)
  by_event = _plan(noise_multiplier=2.0, basis=release.basis, subspace_event=release)
  forgotten = _plan(noise_multiplier=2.0, basis=release.basis)           # the slip, by array
  assert by_release.dp_event == by_event.dp_event
  assert by_release.epsilon == pytest.approx(by_event.epsilon, rel=1e-12)
  assert by_release.epsilon > forgotten.epsilon                           # its cost is counted
  state = by_release.noise.init(params)
  np.testing.assert_array_equal(noise.noise_state(state).bases, release.basis)
  layered = _plan(noise_multiplier=2.0, bases=release)                    # a per-layer leaf
  assert layered.dp_event == by_event.dp_event
  with pytest.raises(ValueError, match="not both"):
    _plan(noise_multiplier=2.0, basis=release, subspace_event=release)
  failed = dataclasses.replace(release, ok=jnp.asarray(False))
  with pytest.raises(ValueError, match="⊥"):
    _plan(noise_multiplier=2.0, basis=failed)


# --- the plan counts its steps (issue 50 §2, the step count) ---------------------------------


def test_a_step_past_the_planned_T_is_refused_on_the_host():
  """Before: plan.step ran 3T times on a T-step plan and plan.run ran twice, in silence."""
  plan = _plan(noise_multiplier=1.0, steps=3)
  opt = optax.sgd(0.05)
  params, data = jnp.zeros(D), plan.prepare(DATA)
  state = plan.init(params, opt)
  for _ in range(3):
    params, state = plan.step(params, state, data, opt)
  assert plan.steps_taken(state) == 3 and np.all(np.isfinite(np.asarray(params)))
  with pytest.raises(ValueError, match="covers T = 3 steps and 3 were taken"):
    plan.step(params, state, data, opt)
  other = _plan(noise_multiplier=1.0, steps=3, key=jax.random.key(1))
  p, s = other.run(jnp.zeros(D), other.init(jnp.zeros(D), opt), data, opt, steps=2)
  p, s = other.run(p, s, data, opt)                             # the one step left
  assert other.steps_taken(s) == 3
  with pytest.raises(ValueError, match="were taken"):
    other.run(p, s, data, opt)                                  # a second whole run
  with pytest.raises(RuntimeError, match="started already"):
    other.init(jnp.zeros(D), opt)                               # a fresh state: refused


def test_an_update_past_T_in_a_users_own_jitted_step_is_nan():
  """Inside the user's own jitted loop the host cannot check: the update past T is all NaN
  (params become NaN) and the state's count says T + 1; the T covered steps are untouched."""
  plan = _plan(noise_multiplier=1.0, steps=2)
  tx = plan.transform(optax.sgd(0.05))
  data = plan.prepare(DATA)

  @jax.jit
  def step(params, opt_state):
    updates, opt_state = tx.update(plan.clipped_sum(params, data, opt_state), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, state = jnp.zeros(D), plan.init(jnp.zeros(D), optax.sgd(0.05))
  for _ in range(2):
    params, state = step(params, state)
    assert np.all(np.isfinite(np.asarray(params)))               # negative control: within T
  params, state = step(params, state)
  assert np.all(np.isnan(np.asarray(params))) and plan.steps_taken(state) == 3
  unlimited = sgd.dp_noise(sgd.clipped_grad_sum(loss_fn, clip_norm=1.0), noise_multiplier=1.0,
                           expected_batch_size=40, key=jax.random.key(0))     # no T: no limit
  s = unlimited.init(jnp.zeros(D))
  for _ in range(3):
    out, s = unlimited.update(jnp.ones(D), s)
  assert np.all(np.isfinite(np.asarray(out)))


# --- the plan owns its keys; config → calibrate → make (issue 50 §1–§3) -----------------------


def test_one_key_to_every_step_cannot_be_expressed():
  """Before: one key passed to every plan.step ran (accuracy 0.362 against 0.374), the same
  sample every step. Now the plan takes no per-step key: each form of the slip is refused, and
  the samples of consecutive steps come from the state's own stream (the negative control:
  they differ, and the same state gives the same sample)."""
  plan = _plan(noise_multiplier=1.0, steps=4)
  opt = optax.sgd(0.05)
  params, data = jnp.zeros(D), plan.prepare(DATA)
  state = plan.init(params, opt)
  key = jax.random.key(1)
  with pytest.raises(TypeError, match="takes no key"):
    plan.clipped_sum(params, data, key)
  with pytest.raises(TypeError, match="without a key"):
    plan.step(params, state, data, key)
  with pytest.raises(TypeError):
    plan.step(params, state, data, key, opt)                     # the old signature
  with pytest.raises(TypeError, match="without a key"):
    plan.run(params, state, data, key)
  masks = []
  for _ in range(3):
    masks.append(np.asarray(sampling.poisson_mask(_sample_key(state), N, 40 / N)))
    params, state = plan.step(params, state, data, opt)
  assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])
  np.testing.assert_array_equal(np.asarray(plan.clipped_sum(params, data, state)),
                                np.asarray(plan.clipped_sum(params, data, state)))


def test_a_stale_state_is_refused_by_step_and_run():
  """A state older than the plan's last step would replay its keys (the same sample and noise):
  step and run refuse it on the host; the current state goes on (negative control)."""
  plan = _plan(noise_multiplier=1.0, steps=4)
  opt = optax.sgd(0.05)
  params, data = jnp.zeros(D), plan.prepare(DATA)
  first = plan.init(params, opt)
  p, state = plan.step(params, first, data, opt)
  with pytest.raises(RuntimeError, match="older"):
    plan.step(params, first, data, opt)
  with pytest.raises(RuntimeError, match="older"):
    plan.run(params, first, data, opt, steps=1)
  p, state = plan.step(p, state, data, opt)
  assert plan.steps_taken(state) == 2


def test_the_config_calibrates_once_and_performance_flags_leave_the_guarantee(monkeypatch):
  """Before: train_dp_sgd calibrated σ by PLD twice (training.py, then plan.py). Now a config
  calibrates once, however many plans it makes; micro-batch size, mesh and data axis are set
  at make and do not touch σ or the event."""
  calls = []
  real = accounting.plan_dpsgd_budget
  monkeypatch.setattr(accounting, "plan_dpsgd_budget",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  config = sgd.DPSGDConfig(num_examples=N, expected_batch_size=40, steps=5, epsilon=2.0,
                           accountant="rdp")
  grad_fn = sgd.clipped_grad_sum(loss_fn, clip_norm=1.0)
  small = config.make(grad_fn, key=jax.random.key(0), microbatch_size=7)
  large = config.make(grad_fn, key=jax.random.key(1), microbatch_size=64)
  assert len(calls) == 1
  assert small.batch_selection.microbatch_size == 7 and large.batch_selection.microbatch_size == 64
  assert small.dp_event == large.dp_event == config.dp_event
  assert small.noise_multiplier == large.noise_multiplier == config.calibrate().noise_multiplier
  calls.clear()
  sgd.train_dp_sgd(jax.random.key(2), loss_fn, jnp.zeros(D), DATA, optax.sgd(0.01),
                   epsilon=2.0, delta=1e-5, steps=2, expected_batch_size=40, clip_norm=1.0,
                   accountant="rdp")
  assert len(calls) == 1                                        # train_dp_sgd: once


def test_sigma_is_calibrated_on_the_batch_selections_own_event(monkeypatch):
  """The batch selection states its piece of the event; a scheme with another event changes σ
  and the plan's event by itself (negative control: Poisson's own event gives the default)."""

  class NoAmplification(sampling.PoissonSampling):
    def dp_event(self, step_event):                 # as if every step saw every example
      return step_event

  kw = dict(num_examples=N, expected_batch_size=40, steps=5, epsilon=2.0, accountant="rdp")
  poisson = sgd.DPSGDConfig(**kw).calibrate()
  assert poisson.dp_event == accounting.dpsgd_event(poisson.noise_multiplier, 40 / N, 5)
  monkeypatch.setattr(sgd.DPSGDConfig, "batch_selection",
                      property(lambda self: NoAmplification(N, 40.0, 41)))
  unsampled = sgd.DPSGDConfig(**kw).calibrate()
  assert unsampled.noise_multiplier > 2 * poisson.noise_multiplier
  assert unsampled.dp_event == dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(unsampled.noise_multiplier), 5)
  direct = dp_accounting.rdp.RdpAccountant().compose(unsampled.dp_event).get_epsilon(1e-5)
  assert unsampled.epsilon == pytest.approx(direct, rel=1e-9) and direct <= 2.0 + 1e-9


def test_a_release_whose_event_is_not_in_the_config_is_refused_at_make():
  """σ is calibrated when the config is: a private release handed to make() without its event
  in the config would go unpaid; it is refused (the config that carries it is accepted)."""
  release = sgd.private_input_basis(jax.random.key(3), np.asarray(X), 2, epsilon=0.5,
                                    delta=1e-7, clip_norm=3.0, secure=False)
  grad_fn = sgd.clipped_grad_sum(loss_fn, clip_norm=1.0)
  kw = dict(num_examples=N, expected_batch_size=40, steps=5, noise_multiplier=2.0)
  with pytest.raises(ValueError, match="event in the config"):
    sgd.DPSGDConfig(**kw).make(grad_fn, key=jax.random.key(0), basis=release)
  paid = sgd.DPSGDConfig(subspace_event=release, **kw)
  plan = paid.make(grad_fn, key=jax.random.key(0), basis=release)
  assert plan.dp_event == dp_accounting.ComposedDpEvent(
      (release.dp_event, accounting.dpsgd_event(2.0, 40 / N, 5)))
  with pytest.raises(ValueError, match="exactly one"):
    sgd.DPSGDConfig(num_examples=N, expected_batch_size=40, steps=5)


def test_a_tuned_config_takes_one_release_for_every_run():
  """With a tuning, the release is composed once, outside the repetition: the runs of one tuned
  config may share one release (each plan made with it), and a plan given another release of
  the same event is refused — that would be K releases paid as one."""
  tuning = accounting.HyperparameterTuning(2.0)
  release = sgd.private_input_basis(jax.random.key(3), np.asarray(X), 2, epsilon=0.5,
                                    delta=1e-7, clip_norm=3.0, secure=False)
  other = sgd.private_input_basis(jax.random.key(4), np.asarray(X), 2, epsilon=0.5,
                                  delta=1e-7, clip_norm=3.0, secure=False)
  assert other.dp_event == release.dp_event
  grad_fn = sgd.clipped_grad_sum(loss_fn, clip_norm=1.0)
  config = sgd.DPSGDConfig(num_examples=N, expected_batch_size=40, steps=5, epsilon=2.0,
                           accountant="rdp", subspace_event=release, tuning=tuning)
  runs = [config.make(grad_fn, key=jax.random.key(i), basis=release) for i in range(2)]
  assert runs[0].dp_event == runs[1].dp_event == dp_accounting.ComposedDpEvent((
      release.dp_event, accounting.tuning_event(
          accounting.dpsgd_event(runs[0].noise_multiplier, 40 / N, 5), tuning)))
  with pytest.raises(ValueError, match="every run must use the same release"):
    config.make(grad_fn, key=jax.random.key(2), basis=other)
  # Untuned, each plan is one run: another config may take another release.
  untuned = sgd.DPSGDConfig(num_examples=N, expected_batch_size=40, steps=5, epsilon=2.0,
                            accountant="rdp", subspace_event=release)
  untuned.make(grad_fn, key=jax.random.key(0), basis=release)
  untuned.make(grad_fn, key=jax.random.key(1), basis=other)


def test_run_calls_its_hook_between_steps():
  """A between-steps hook (post-processing of the state; GEP's trajectory refresh is one): every
  hook_every steps, inside the scan. Here it swaps GEP's bases in after the first step."""
  loss = lambda p, ex: loss_fn(p["w"][:, 0], ex)                  # noqa: E731
  fn = sgd.embedding_residual_grad_sum(loss, embedding_clip=1.0, residual_clip=0.5)
  first, second = jnp.eye(D, 2), jnp.eye(D, 2)[::-1]
  plan = _plan(fn, noise_multiplier=1.0, steps=3, bases={"w": first})
  opt = optax.sgd(1.0)
  data = plan.prepare(DATA)
  params = {"w": jnp.zeros((D, 1))}
  state = plan.init(params, opt)
  hook = lambda params, s: sgd.update_bases(s, bases={"w": second}, check=False)  # noqa: E731
  p1, s1 = plan.run(params, state, data, opt, steps=1, hook=hook)
  np.testing.assert_array_equal(np.asarray(noise.noise_state(s1).bases["w"]), np.asarray(second))
  back = lambda params, s: sgd.update_bases(s, bases={"w": first}, check=False)   # noqa: E731
  _, s2 = plan.run(p1, s1, data, opt, steps=1, hook=back, hook_every=2)    # not due: no call
  np.testing.assert_array_equal(np.asarray(noise.noise_state(s2).bases["w"]), np.asarray(second))
  _, s3 = plan.run(p1, s2, data, opt, steps=1, hook=back)
  np.testing.assert_array_equal(np.asarray(noise.noise_state(s3).bases["w"]), np.asarray(first))


def test_the_states_of_several_plans_vmap_over_one_plans_update():
  """Runs vectorised over keys: K plans of one config (σ calibrated once), their states
  stacked, one plan's traceable update vmapped; each run equals its own plan's step."""
  config = sgd.DPSGDConfig(num_examples=N, expected_batch_size=40, steps=3,
                           noise_multiplier=1.0)
  grad_fn = sgd.clipped_grad_sum(loss_fn, clip_norm=1.0)
  plans = [config.make(grad_fn, key=k) for k in jax.random.split(jax.random.key(5), 3)]
  opt = optax.sgd(0.05)
  data = plans[0].prepare(DATA)
  states = [plan.init(jnp.zeros(D), opt) for plan in plans]
  stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *states)
  params = jnp.zeros((3, D))
  vmapped = jax.jit(jax.vmap(lambda p, s: plans[0].update(p, s, data, opt)))(params, stacked)[0]
  for i, (plan, state) in enumerate(zip(plans, states)):
    own = plan.step(jnp.zeros(D), state, data, opt)[0]
    np.testing.assert_allclose(np.asarray(vmapped[i]), np.asarray(own), rtol=1e-5, atol=1e-6)
  assert not np.allclose(np.asarray(vmapped[0]), np.asarray(vmapped[1]))


def test_plans_of_one_config_share_one_compiled_step():
  """The K plans of one config (K keys) are equal as programs, so plan.step compiles once for
  them; their runs still differ (the keys are in the states). A plan with another grad fn or
  release is another program (negative control)."""
  config = sgd.DPSGDConfig(num_examples=N, expected_batch_size=40, steps=2, noise_multiplier=1.0)
  grad_fn = sgd.clipped_grad_sum(loss_fn, clip_norm=1.0)
  a, b = (config.make(grad_fn, key=jax.random.key(i)) for i in range(2))
  assert a == b and hash(a) == hash(b) and a is not b
  assert a != config.make(sgd.clipped_grad_sum(loss_fn, clip_norm=2.0), key=jax.random.key(0))
  assert a != config.make(grad_fn, key=jax.random.key(0), basis=jnp.eye(D, 2))
  opt = optax.sgd(0.05)
  data = a.prepare(DATA)
  traces = []
  real = a.update
  spy = lambda self, *args: traces.append(1) or real.__func__(self, *args)   # noqa: E731
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sgd.DPSGDPlan, "update", spy)
    pa, _ = a.step(jnp.zeros(D), a.init(jnp.zeros(D), opt), data, opt)
    pb, _ = b.step(jnp.zeros(D), b.init(jnp.zeros(D), opt), data, opt)
  assert len(traces) == 1                                   # b's step reused a's compilation
  assert not np.allclose(np.asarray(pa), np.asarray(pb))    # different keys, different runs


# --- an independent adversarial review's findings (issue 50), each a slip now refused ---------


def test_the_optax_idiom_of_init_starts_the_same_one_run():
  """``plan.transform(opt).init`` is ``plan.init``: a second one is refused, and a state it made
  is guarded by step/run like plan.init's (before: it bypassed every host-side check)."""
  plan = _plan(noise_multiplier=1.0, steps=3)
  opt = optax.sgd(0.05)
  tx = plan.transform(opt)
  s0 = tx.init(jnp.zeros(D))
  with pytest.raises(RuntimeError, match="started already"):
    tx.init(jnp.zeros(D))
  with pytest.raises(RuntimeError, match="started already"):
    plan.init(jnp.zeros(D), opt)
  data = plan.prepare(DATA)
  p, s1 = plan.step(jnp.zeros(D), s0, data, opt)
  with pytest.raises(RuntimeError, match="older"):
    plan.step(jnp.zeros(D), s0, data, opt)
  plan.step(p, s1, data, opt)                                    # the current state goes on


def test_another_plans_state_is_refused():
  """K plans of one config are equal programs but separate runs: plan B refuses plan A's state
  (before: B stepped it with A's key, then A stepped it again, the same sample and noise)."""
  config = sgd.DPSGDConfig(num_examples=N, expected_batch_size=40, steps=3, noise_multiplier=1.0)
  grad_fn = sgd.clipped_grad_sum(loss_fn, clip_norm=1.0)
  a, b = (config.make(grad_fn, key=jax.random.key(i)) for i in (1, 2))
  opt = optax.sgd(0.05)
  sa, sb = a.init(jnp.zeros(D), opt), b.init(jnp.zeros(D), opt)
  data = a.prepare(DATA)
  with pytest.raises(RuntimeError, match="another run's"):
    b.step(jnp.zeros(D), sa, data, opt)
  with pytest.raises(RuntimeError, match="another run's"):
    a.run(jnp.zeros(D), sb, data, opt)
  a.step(jnp.zeros(D), sa, data, opt)                            # its own state goes on


def test_a_plans_parts_cannot_be_replaced_one_by_one():
  """dataclasses.replace of a plan's config (a smaller ε) kept the old noise while the plan
  stated the new budget; now the plan checks that its noise was made for its config and batch
  selection. A deep copy is the same run (its record shared), so a used state stays refused."""
  config = sgd.DPSGDConfig(num_examples=N, expected_batch_size=40, steps=3, noise_multiplier=1.0)
  plan = config.make(sgd.clipped_grad_sum(loss_fn, clip_norm=1.0), key=jax.random.key(0))
  with pytest.raises(ValueError, match="made for"):
    dataclasses.replace(plan, config=dataclasses.replace(config, noise_multiplier=4.0))
  with pytest.raises(ValueError, match="made for"):
    dataclasses.replace(plan, batch_selection=sampling.poisson_sampling(N, 80))
  opt = optax.sgd(0.05)
  s0 = plan.init(jnp.zeros(D), opt)
  plan.step(jnp.zeros(D), s0, plan.prepare(DATA), opt)
  copied = copy.deepcopy(plan)
  assert copied is plan
  with pytest.raises(RuntimeError, match="older"):
    copied.step(jnp.zeros(D), s0, plan.prepare(DATA), opt)


def test_a_hook_cannot_move_the_key_stream_or_the_count():
  """A hook that rewinds the noise state's key and count (or re-initialises the transform) would
  replay samples and noise inside the scan: the key, count and origin are kept whatever the
  hook returns, and a re-init inside a hook is refused."""
  plan = _plan(noise_multiplier=1.0, steps=4)
  opt = optax.sgd(0.05)
  state = plan.init(jnp.zeros(D), opt)
  data = plan.prepare(DATA)
  first = noise.noise_state(state)
  rewind = lambda params, s: jax.tree_util.tree_map(                        # noqa: E731
      lambda x: dataclasses.replace(x, key=first.key, step=jnp.zeros((), jnp.int32))
      if isinstance(x, noise.NoiseState) else x, s,
      is_leaf=lambda x: isinstance(x, noise.NoiseState))
  _, s2 = plan.run(jnp.zeros(D), state, data, opt, steps=2, hook=rewind)
  assert plan.steps_taken(s2) == 2
  assert not np.array_equal(jax.random.key_data(noise.noise_state(s2).key),
                            jax.random.key_data(first.key))
  tx = plan.transform(opt)
  with pytest.raises(RuntimeError, match="started already"):
    plan.run(jnp.zeros(D), s2, data, opt, steps=1, hook=lambda p, s: tx.init(p))


def test_an_eager_clipped_sum_warns_once_per_plan_and_a_jitted_one_never():
  """Issue 53: plan.clipped_sum called op by op in a loop was ~200× slower than jitted, in
  silence. Now the first eager call (clipped_sum or update) warns, once per plan; a jitted step
  and plan.step never warn."""
  import warnings
  plan = _plan()
  opt = optax.sgd(0.1)
  state = plan.init(jnp.zeros(D), opt)
  with pytest.warns(UserWarning, match="eagerly.*plan.step / plan.run") as caught:
    plan.clipped_sum(jnp.zeros(D), DATA, state)
    plan.update(jnp.zeros(D), state, DATA, opt)
  assert sum("eagerly" in str(w.message) for w in caught) == 1
  quiet = _plan()
  state = quiet.init(jnp.zeros(D), opt)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.jit(lambda p, s: quiet.clipped_sum(p, DATA, s))(jnp.zeros(D), state)
    quiet.step(jnp.zeros(D), state, DATA, opt)


def test_run_reports_progress_and_logs_what_it_is_doing(caplog):
  """Issue 53: 45–65 s of silence before a transformer's first step. With progress the run is
  reported between chunks (a callable, or a tqdm bar) and gives the same result; the "dpjax"
  logger says at INFO when σ is calibrated and the step compiled (silent by default)."""
  import logging
  calls = []
  with caplog.at_level(logging.INFO, logger="dpjax"):
    plan = _plan(epsilon=2.0, steps=120, accountant="rdp")
    plan.budget
  assert any("calibrating σ" in r.message and "RDP" in r.message for r in caplog.records)
  opt = optax.sgd(0.01)
  state = plan.init(jnp.zeros(D), opt)
  with caplog.at_level(logging.INFO, logger="dpjax"):
    chunked, s1 = plan.run(jnp.zeros(D), state, DATA, opt,
                           progress=lambda done, total: calls.append((done, total)))
  assert any("compiling the DP-SGD step" in r.message for r in caplog.records)
  assert calls[-1] == (120, 120) and len(calls) >= 40
  assert [c[0] for c in calls] == sorted(c[0] for c in calls)
  whole = _plan(epsilon=2.0, steps=120, accountant="rdp")
  plain, s2 = whole.run(jnp.zeros(D), whole.init(jnp.zeros(D), opt), DATA, opt)
  np.testing.assert_allclose(chunked, plain, rtol=1e-5, atol=1e-6)
  assert plan.steps_taken(s1) == 120
  with pytest.raises(ValueError, match="budget"):
    plan.run(chunked, s1, DATA, opt, steps=1, progress=True)
  bar = _plan(steps=10)
  out, _ = bar.run(jnp.zeros(D), bar.init(jnp.zeros(D), opt), DATA, opt, progress=True)
  assert np.all(np.isfinite(out))
  with pytest.raises(TypeError, match="progress"):
    other = _plan(steps=3)
    other.run(jnp.zeros(D), other.init(jnp.zeros(D), opt), DATA, opt, progress="yes")
