"""The privacy ledger: one relation, a hard budget, totals as dp_accounting composes them."""

import dp_accounting
import pytest
from dp_accounting import NeighboringRelation

from dpjax import accounting
from dpjax import ledger as ledger_lib


def test_ledger_total_equals_dp_accounting_for_the_same_events():
  ledger = ledger_lib.PrivacyLedger(3.0, 1e-5, accountant="rdp")
  ledger.record_approx_dp(0.5, 1e-6, label="subspace")
  ledger.record_dpsgd(noise_multiplier=1.2, sampling_prob=0.02, steps=200)
  ledger.record_event(dp_accounting.GaussianDpEvent(20.0), label="a released mean")
  expected_acc = dp_accounting.rdp.RdpAccountant().compose(dp_accounting.ComposedDpEvent([
      accounting.dpsgd_event(1.2, 0.02, 200), dp_accounting.GaussianDpEvent(20.0)]))
  expected = 0.5 + expected_acc.get_epsilon(1e-5 - 1e-6)
  assert ledger.spent.epsilon == pytest.approx(expected, rel=1e-12)
  assert ledger.spent.delta == 1e-5 and len(ledger.entries) == 3


def test_ledger_refuses_overspending_and_records_nothing():
  ledger = ledger_lib.PrivacyLedger(1.0, 1e-5)
  ledger.record_approx_dp(0.6, 1e-6)
  with pytest.raises(ledger_lib.BudgetExceededError, match="refused"):
    ledger.record_approx_dp(0.6, 1e-6, label="second")
  with pytest.raises(ledger_lib.BudgetExceededError):
    ledger.record_dpsgd(noise_multiplier=0.5, sampling_prob=0.5, steps=100)
  assert len(ledger.entries) == 1 and ledger.spent.epsilon == 0.6
  assert ledger.remaining_epsilon == pytest.approx(0.4)


def test_ledger_enforces_one_relation():
  ledger = ledger_lib.PrivacyLedger(1.0, 1e-5, neighboring=NeighboringRelation.REPLACE_ONE)
  with pytest.raises(ValueError, match="ADD_OR_REMOVE_ONE"):
    ledger.record_dpsgd(noise_multiplier=5.0, sampling_prob=0.01, steps=10)
  with pytest.raises(TypeError, match="DpEvent"):
    ledger.record_event("gaussian")


@pytest.mark.slow(reason="dpase and train_dp_sgd record into a ledger; the default run records "
                         "streaming DPASE")
def test_dpase_and_training_record_into_a_ledger():
  import jax
  import jax.numpy as jnp
  import optax

  from dpjax import data, sgd
  from dpjax.subspace import dpase

  X, _ = data.approximate_subspace_data(jax.random.key(0), 2_000, 10, 1, gamma=1e-4)
  ledger = ledger_lib.PrivacyLedger(1.5, 1e-5, neighboring=NeighboringRelation.REPLACE_ONE)
  dpase(jax.random.key(1), X, epsilon=1.0, delta=1e-6, k=1, gamma=1e-4, ledger=ledger)
  assert ledger.spent == accounting.PrivacySpend(1.0, 1e-6, NeighboringRelation.REPLACE_ONE)
  with pytest.raises(ledger_lib.BudgetExceededError):
    dpase(jax.random.key(2), X, epsilon=1.0, delta=1e-6, k=1, gamma=1e-4, ledger=ledger)

  ledger = ledger_lib.PrivacyLedger(2.0, 1e-5)
  loss = lambda w, ex: optax.sigmoid_binary_cross_entropy(ex[0] @ w, ex[1])
  y = (X[:, 0] > 0).astype(jnp.float32)
  # The ledger composes with RDP (its default), so the run plans with RDP too: a PLD-calibrated
  # σ at ε = 2 would cost more than ε = 2 by the ledger's RDP accountant, and be refused.
  out = sgd.train_dp_sgd(jax.random.key(3), loss, jnp.zeros(10), (X, y), optax.sgd(0.1),
                         epsilon=2.0, delta=1e-5, steps=3, expected_batch_size=100,
                         clip_norm=1.0, ledger=ledger, accountant="rdp")
  assert ledger.spent.epsilon == pytest.approx(out.budget.epsilon, rel=1e-9)
  with pytest.raises(ledger_lib.BudgetExceededError):   # the ledger is full: refused up front
    sgd.train_dp_sgd(jax.random.key(3), loss, jnp.zeros(10), (X, y), optax.sgd(0.1),
                     epsilon=2.0, delta=1e-5, steps=3, expected_batch_size=100,
                     clip_norm=1.0, ledger=ledger, accountant="rdp")


# --- ledger= under JAX transformations (issue 49 §2) -------------------------------------------


def _analyze_gauss(key, X, **kw):
  import dpjax
  return dpjax.subspace.analyze_gauss(key, X, epsilon=2.0, delta=1e-6, k=1, clip_norm=1.0,
                                      secure=False, neighboring=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                      **kw)


def _rows():
  import numpy as np
  return np.random.default_rng(0).standard_normal((20, 3)).astype(np.float32)


def test_a_ledgered_call_under_jit_is_refused_not_recorded_once_per_trace():
  """Before: three jitted calls at ε = 2 against a budget of 2.5 made one record."""
  import jax
  ledger = ledger_lib.PrivacyLedger(2.5, 1e-5)
  X = _rows()
  run = jax.jit(lambda key: _analyze_gauss(key, X, ledger=ledger))
  for i in range(3):
    with pytest.raises(TypeError, match="transformation"):
      run(jax.random.key(i))
  closed = jax.jit(lambda: _analyze_gauss(jax.random.key(0), X, ledger=ledger))
  with pytest.raises(TypeError, match="once per release"):      # no traced argument at all
    closed()
  assert ledger.entries == ()
  # Recorded outside the transformation, once per release: the second is over the budget.
  released = jax.jit(lambda key: _analyze_gauss(key, X))(jax.random.key(0))
  ledger.record(released)
  with pytest.raises(ledger_lib.BudgetExceededError):
    ledger.record(jax.jit(lambda key: _analyze_gauss(key, X))(jax.random.key(1)))
  assert len(ledger.entries) == 1


def test_a_ledgered_call_under_vmap_is_refused_not_one_record_for_many_releases():
  """Before: a vmap over five keys made one record for five releases."""
  import jax
  ledger = ledger_lib.PrivacyLedger(20.0, 1e-5)
  X = _rows()
  keys = jax.random.split(jax.random.key(0), 5)
  with pytest.raises(TypeError, match="transformation"):
    jax.vmap(lambda key: _analyze_gauss(key, X, ledger=ledger))(keys)
  assert ledger.entries == ()
  results = jax.vmap(lambda key: _analyze_gauss(key, X))(keys)
  for _ in range(keys.shape[0]):
    ledger.record(results)
  five = dp_accounting.pld.PLDAccountant().compose(
      dp_accounting.ComposedDpEvent([results.dp_event] * 5)).get_epsilon(1e-5)
  assert len(ledger.entries) == 5 and ledger.spent.epsilon == pytest.approx(five, rel=1e-9)


def test_a_ledgered_eager_call_records_once_per_call():
  import jax
  ledger = ledger_lib.PrivacyLedger(2.5, 1e-5)
  X = _rows()
  _analyze_gauss(jax.random.key(0), X, ledger=ledger)
  with pytest.raises(ledger_lib.BudgetExceededError):
    _analyze_gauss(jax.random.key(1), X, ledger=ledger)
  assert len(ledger.entries) == 1 and ledger.spent.epsilon <= 2.0


@pytest.mark.filterwarnings("ignore:DPASE")
def test_dpase_with_a_ledger_is_refused_under_jit_and_vmap():
  """DPASE and DPASEB record without the with_ledger wrapper; the same refusal applies."""
  import jax
  import numpy as np
  import dpjax
  X = np.random.default_rng(0).standard_normal((400, 4)).astype(np.float32)
  ledger = ledger_lib.PrivacyLedger(100.0, 1e-3, neighboring=NeighboringRelation.REPLACE_ONE)
  dpase = lambda key: dpjax.subspace.dpase(key, X, epsilon=1.0, delta=1e-6, k=1,   # noqa: E731
                                           gamma=1.0, ledger=ledger)
  with pytest.raises(TypeError, match="transformation"):
    jax.vmap(dpase)(jax.random.split(jax.random.key(0), 3))
  with pytest.raises(TypeError, match="transformation"):
    jax.jit(dpase)(jax.random.key(0))
  assert ledger.entries == ()



# --- one accountant: the ledger books what was calibrated (issue 50 §4) ---------------------


def _linear_loss(w, example):
  x, y = example
  return (x @ w - y) ** 2


def _plan(**kw):
  import jax
  from dpjax import sgd
  return sgd.dp_sgd_plan(sgd.clipped_grad_sum(_linear_loss, clip_norm=1.0), num_examples=400,
                         expected_batch_size=20, steps=50, key=jax.random.key(0), **kw)


@pytest.mark.parametrize("ledger_accountant", ["pld", "rdp"])
def test_a_ledger_accepts_a_plan_of_its_own_budget_and_refuses_one_more_step(ledger_accountant):
  """Before: a (2, 1e-5) ledger (RDP by default) refused a (2, 1e-5) plan (PLD by default),
  booking it at ε = 2.479 with an error that did not say why. Now both default to PLD, and a
  plan calibrated by another accountant is booked as its (ε, δ)."""
  ledger = ledger_lib.PrivacyLedger(2.0, 1e-5, accountant=ledger_accountant)
  plan = _plan(epsilon=2.0, delta=1e-5, ledger=ledger)               # PLD, the default
  assert plan.accountant == "pld" and ledger.spent.epsilon <= 2.0 * (1 + 1e-9)
  with pytest.raises(ledger_lib.BudgetExceededError,
                     match=f"by the {ledger_accountant} accountant"):
    ledger.record_dpsgd(noise_multiplier=plan.noise_multiplier, sampling_prob=20 / 400, steps=1)
  assert len(ledger.entries) == 1


def test_the_default_ledger_composes_by_pld_and_by_rdp_where_pld_cannot():
  ledger = ledger_lib.PrivacyLedger(50.0, 1e-5)
  assert ledger.accountant == "pld"
  steps = accounting.dpsgd_event(1.0, 0.01, 100)
  ledger.record_event(steps)
  assert ledger.spent_accountant == "pld"
  assert ledger.spent.epsilon == pytest.approx(
      dp_accounting.pld.PLDAccountant().compose(steps).get_epsilon(1e-5), rel=1e-9)
  tuned = accounting.tuning_event(steps, accounting.HyperparameterTuning(3.0, 0.0))
  ledger.record_event(tuned)                                  # PLD cannot compose it
  assert ledger.spent_accountant == "rdp"
  assert ledger.spent.epsilon == pytest.approx(dp_accounting.rdp.RdpAccountant().compose(
      dp_accounting.ComposedDpEvent([steps, tuned])).get_epsilon(1e-5), rel=1e-9)
