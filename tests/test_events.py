"""Every release is a dp_accounting event (issue 36 §1): results carry their event, the ledger
records results, and a Gaussian subspace release is composed with DP-SGD by the accountant."""

import math

import dp_accounting
import jax
import numpy as np
import pytest
from dp_accounting import NeighboringRelation

from dpjax import accounting, results, sgd, subspace
from dpjax.ledger import BudgetExceededError, PrivacyLedger

ADD_REMOVE = NeighboringRelation.ADD_OR_REMOVE_ONE
Q, T, DELTA = 0.05, 200, 1e-5


def _rdp_epsilon(event, delta):
  return dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)


def test_release_event_and_split():
  assert accounting.release_event(0.0, 0.0) == dp_accounting.NoOpDpEvent()
  assert accounting.release_event(math.inf, 1.0) == dp_accounting.NonPrivateDpEvent()
  eps_delta = accounting.release_event(0.5, 1e-6)
  assert eps_delta == accounting.EpsilonDeltaDpEvent(0.5, 1e-6)
  steps = accounting.dpsgd_event(1.0, Q, T)
  event = accounting.compose_events(
      eps_delta, steps, dp_accounting.SelfComposedDpEvent(accounting.release_event(0.1, 0.0), 3),
      dp_accounting.NoOpDpEvent())
  hash(event)                                    # static metadata of results must hash
  parts = accounting.split_event(event)
  assert parts.epsilon == pytest.approx(0.8) and parts.delta == pytest.approx(1e-6)
  assert parts.accountable == (steps,)
  # ε = Σ ε_i + ε_acc(δ − Σ δ_i): compared with dp_accounting's own figure.
  assert accounting.event_epsilon(event, DELTA, accountant="rdp") == pytest.approx(
      0.8 + _rdp_epsilon(steps, DELTA - 1e-6), rel=1e-12)
  # No amplification of an (ε, δ) guarantee by sampling: refused, not mis-composed.
  with pytest.raises(ValueError, match="amplification"):
    accounting.split_event(dp_accounting.PoissonSampledDpEvent(0.1, eps_delta))
  # dp_accounting itself cannot compose it: the reason dpjax splits.
  assert not dp_accounting.rdp.RdpAccountant().supports(eps_delta)


def test_every_result_carries_its_event_and_replace_keeps_it_consistent():
  X = np.random.default_rng(0).normal(size=(200, 6))
  secure = subspace.analyze_gauss(jax.random.key(0), X, epsilon=1.0, delta=1e-5, k=2,
                                  clip_norm=3.0)
  assert secure.dp_event == accounting.EpsilonDeltaDpEvent(1.0, 1e-5)
  public = secure.replace(epsilon=0.0, delta=0.0)               # an event by number follows ε, δ
  assert public.dp_event == dp_accounting.NoOpDpEvent()
  with pytest.raises(TypeError, match="dp_event"):
    results.SubspaceResult(ok=True, basis=X[:2].T, epsilon=1.0, delta=0.0,
                           neighboring=ADD_REMOVE, dp_event=(1.0, 0.0))


def test_analyze_gauss_states_its_gaussian_event_under_either_relation():
  X = np.random.default_rng(1).normal(size=(300, 5))
  kw = dict(epsilon=1.0, delta=1e-5, k=2, clip_norm=2.0, secure=False)
  rep = subspace.analyze_gauss(jax.random.key(0), X, **kw)
  add = subspace.analyze_gauss(jax.random.key(0), X, neighboring=ADD_REMOVE, **kw)
  z = accounting.analytic_gaussian_sigma(1.0, 1e-5)
  # Δ = 2C² (replace-one) or C² (add/remove-one), in units of C²: the same multiplier z.
  assert rep.info["unit_sigma"] == pytest.approx(2 * z, rel=1e-12)
  assert add.info["unit_sigma"] == pytest.approx(z, rel=1e-12)
  assert rep.dp_event == add.dp_event == dp_accounting.GaussianDpEvent(pytest.approx(z))
  assert add.neighboring == ADD_REMOVE and rep.neighboring == NeighboringRelation.REPLACE_ONE
  # The event's ε is the release's stand-alone ε (the analytic σ is exact: PLD agrees).
  pld = dp_accounting.pld.PLDAccountant().compose(add.dp_event).get_epsilon(1e-5)
  assert pld == pytest.approx(1.0, rel=1e-2)


def test_a_gaussian_subspace_release_is_composed_by_the_accountant_not_by_an_epsilon_split():
  eps, z = 2.0, accounting.analytic_gaussian_sigma(0.2, 1e-6)   # stand-alone (0.1ε, 0.1δ)
  gauss = dp_accounting.GaussianDpEvent(z)
  split = accounting.plan_dpsgd_budget(eps, DELTA, sampling_prob=Q, steps=T,
                                       subspace_epsilon=0.2, subspace_delta=1e-6)
  composed = accounting.plan_dpsgd_budget(eps, DELTA, sampling_prob=Q, steps=T,
                                          subspace_event=gauss)
  alone = accounting.plan_dpsgd_budget(eps, DELTA, sampling_prob=Q, steps=T)
  assert alone.noise_multiplier < composed.noise_multiplier < split.noise_multiplier
  # The guarantee, checked by dp_accounting's own composition of the same two events ...
  sigma = composed.noise_multiplier
  both = lambda s: dp_accounting.ComposedDpEvent(  # noqa: E731
      [gauss, accounting.dpsgd_event(s, Q, T)])
  assert _rdp_epsilon(both(sigma), DELTA) <= eps * (1 + 1e-9)
  # ... and σ is the smallest (negative control: 1% less noise overspends).
  assert _rdp_epsilon(both(0.99 * sigma), DELTA) > eps
  assert composed.epsilon == pytest.approx(eps, rel=1e-4) and composed.delta == DELTA
  assert composed.subspace_epsilon == 0.0 and composed.dp_event == accounting.compose_events(
      gauss, accounting.dpsgd_event(sigma, Q, T))
  with pytest.raises(ValueError, match="once"):
    accounting.plan_dpsgd_budget(eps, DELTA, sampling_prob=Q, steps=T, subspace_event=gauss,
                                 subspace_epsilon=0.1)


def _loss(params, example):
  x, y = example
  return (x @ params["w"] - y) ** 2


def test_a_plan_takes_the_private_basis_result_and_the_ledger_records_both():
  rng = np.random.default_rng(2)
  X, y = rng.normal(size=(400, 4)).astype(np.float32), rng.normal(size=400).astype(np.float32)
  basis = sgd.private_input_basis(jax.random.key(1), X, 2, epsilon=0.2, delta=1e-6,
                                  clip_norm=2.0, secure=False)
  assert isinstance(basis.dp_event, dp_accounting.GaussianDpEvent)
  ledger = PrivacyLedger(1.0, DELTA, accountant="rdp")        # the plan's accountant
  plan = sgd.dp_sgd_plan(sgd.clipped_grad_sum(_loss, clip_norm=1.0), num_examples=400,
                         expected_batch_size=20, steps=50, key=jax.random.key(0), epsilon=1.0,
                         delta=DELTA, accountant="rdp", subspace_event=basis, ledger=ledger)
  assert [e.label for e in ledger.entries] == [
      "private subspace (composed into the DP-SGD plan)", "dp-sgd"]
  expected = _rdp_epsilon(dp_accounting.ComposedDpEvent(
      [basis.dp_event, accounting.dpsgd_event(plan.noise_multiplier, 20 / 400, 50)]), DELTA)
  assert ledger.spent.epsilon == pytest.approx(expected, rel=1e-9)
  assert ledger.spent.epsilon <= 1.0 * (1 + 1e-9)
  with pytest.raises(BudgetExceededError):                    # the budget is spent
    ledger.record(basis)
  # A replace-one result cannot be composed into add/remove-one DP-SGD.
  replace_one = subspace.analyze_gauss(jax.random.key(1), X, epsilon=0.2, delta=1e-6, k=2,
                                       clip_norm=2.0, secure=False)
  with pytest.raises(ValueError, match="REPLACE_ONE"):
    sgd.dp_sgd_plan(sgd.clipped_grad_sum(_loss, clip_norm=1.0), num_examples=400,
                    expected_batch_size=20, steps=5, key=jax.random.key(0),
                    noise_multiplier=1.0, subspace_event=replace_one)


def test_the_ledger_records_results_under_their_relation():
  X = np.random.default_rng(3).normal(size=(100, 4))
  result = subspace.analyze_gauss(jax.random.key(0), X, epsilon=0.5, delta=1e-6, k=1,
                                  clip_norm=1.0)
  ledger = PrivacyLedger(1.0, 1e-5, neighboring=NeighboringRelation.REPLACE_ONE)
  assert ledger.record(result).epsilon == pytest.approx(0.5)
  with pytest.raises(ValueError, match="not private"):
    ledger.record(subspace.pca_subspace(X, k=1))
  with pytest.raises(TypeError):
    ledger.record((0.5, 1e-6))
  add_remove = PrivacyLedger(1.0, 1e-5)
  with pytest.raises(ValueError, match="REPLACE_ONE"):
    add_remove.record(result)


LEARNERS = [("subspace", "dpese"), ("subspace", "dpase"), ("subspace", "dpaseb"),
            ("subspace", "analyze_gauss"), ("ashtiani_liaw", "al_subspace"),
            ("ashtiani_liaw", "al_covariance"), ("ashtiani_liaw", "learn_covariance"),
            ("ashtiani_liaw", "learn_gaussian"), ("ashtiani_liaw", "ppme_mean"),
            ("ashtiani_liaw", "robust_mean"), ("ashtiani_liaw", "robust_covariance"),
            ("coinpress", "coinpress_mean"), ("coinpress", "coinpress_covariance"),
            ("synthetic", "low_dimensional_synthetic_data"), ("classic", "mod_sulq"),
            ("classic", "ppca"), ("classic", "output_perturbation"),
            ("classic", "objective_perturbation"), ("classic", "one_vs_rest"),
            ("sgd", "private_input_basis"), ("sgd", "private_gradient_subspace"),
            ("sgd", "dp_sgd_plan"), ("sgd", "train_dp_sgd")]


@pytest.mark.parametrize("package,name", LEARNERS)
def test_every_learner_takes_a_ledger(package, name):
  import importlib
  import inspect
  learner = getattr(importlib.import_module(f"dpjax.{package}"), name)
  assert "ledger" in inspect.signature(learner).parameters
  assert "ledger" in learner.__doc__


def test_coinpress_states_its_steps_as_events():
  from dpjax import coinpress
  X = np.random.default_rng(4).normal(size=(2000, 3))
  kw = dict(epsilon=1.0, delta=1e-6, radius=10.0, center=np.zeros(3))
  secure = coinpress.coinpress_mean(jax.random.key(0), X, **kw)
  raw = coinpress.coinpress_mean(jax.random.key(0), X, secure=False, **kw)
  # Secure: the discrete Gaussians' zCDP; raw: one GaussianDpEvent per step. Each composes to
  # the result's ε (replace-one sensitivities; RDP reads a multiplier relative to them).
  assert isinstance(secure.dp_event, dp_accounting.ZCDpEvent)
  assert secure.dp_event.rho == pytest.approx(secure.info["zcdp_rho"])
  assert _rdp_epsilon(secure.dp_event, 1e-6) == pytest.approx(secure.epsilon, rel=1e-6)
  assert len(raw.dp_event.events) == raw.info["steps"]
  ledger = PrivacyLedger(1.2, 1e-5, neighboring=NeighboringRelation.REPLACE_ONE)
  coinpress.coinpress_mean(jax.random.key(1), X, ledger=ledger, **kw)
  assert ledger.spent.epsilon < 1.0               # its ε at the ledger's larger δ
  with pytest.raises(BudgetExceededError):          # a second one would overspend: refused
    coinpress.coinpress_mean(jax.random.key(2), X, ledger=ledger, **kw)
  assert len(ledger.entries) == 1


def test_neighboring_is_spelled_as_dp_accounting_spells_it_with_a_deprecated_alias():
  """``neighboring`` everywhere; ``neighbouring`` kept one release, warning (negative control:
  the new spelling does not warn)."""
  import warnings
  ledger = PrivacyLedger(1.0, 1e-5, neighboring=ADD_REMOVE)
  X = np.random.default_rng(5).normal(size=(50, 3))
  result = subspace.analyze_gauss(jax.random.key(0), X, epsilon=0.5, delta=1e-6, k=1,
                                  clip_norm=1.0)
  spend = accounting.PrivacySpend(1.0, 1e-5, ADD_REMOVE)
  with warnings.catch_warnings():
    warnings.simplefilter("error")                       # the new spelling never warns
    assert ledger.neighboring == spend.neighboring == ADD_REMOVE
    assert result.neighboring == NeighboringRelation.REPLACE_ONE
  for obj in (ledger, result, spend):
    with pytest.warns(DeprecationWarning, match="neighbouring"):
      assert obj.neighbouring == obj.neighboring
  with pytest.warns(DeprecationWarning, match="neighbouring"):
    old = PrivacyLedger(1.0, 1e-5, neighbouring=NeighboringRelation.REPLACE_ONE)
  assert old.neighboring == NeighboringRelation.REPLACE_ONE
  with pytest.warns(DeprecationWarning):
    old.record_approx_dp(0.1, 0.0, neighbouring=NeighboringRelation.REPLACE_ONE)
  with pytest.raises(TypeError, match="only"):
    PrivacyLedger(1.0, 1e-5, neighboring=NeighboringRelation.REPLACE_ONE, neighbouring=ADD_REMOVE)


def test_results_and_plans_print_in_one_screen():
  """Issue 53: a result printed every array in full. Now arrays show as dtype[shape], the info
  by its keys, and a plan prints its guarantee, σ, T, selection, release and Δ in one line."""
  import jax
  import numpy as np
  import dpjax
  X = np.random.default_rng(0).normal(size=(500, 40)) / 10
  result = dpjax.subspace.analyze_gauss(jax.random.key(0), X, epsilon=1.0, delta=1e-6, k=3,
                                        clip_norm=1.0)
  text = repr(result)
  assert "basis=float32[40, 3]" in text or "basis=float64[40, 3]" in text
  assert "ok=True" in text and "neighboring=REPLACE_ONE" in text and len(text) < 400
  assert "info={clip_norm" in text and "[[" not in text
  grad_fn = dpjax.sgd.clipped_grad_sum(lambda w, ex: (ex[0] @ w - ex[1]) ** 2, clip_norm=1.0)
  plan = dpjax.sgd.dp_sgd_plan(grad_fn, num_examples=1000, expected_batch_size=100, steps=50,
                               epsilon=2.0, key=jax.random.key(0), accountant="rdp")
  line = repr(plan)
  assert line.startswith("DPSGDPlan(ε=2, δ=1e-05 add/remove-one, σ=") and "\n" not in line
  assert "T=50, L=100 of N=1000, PoissonSampling, release=full" in line and len(line) < 200
