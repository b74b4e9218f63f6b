"""Accounting equals dp_accounting's own figures; calibration is tight; budgets add up."""

import math

import dp_accounting
import dp_accounting.rdp
import pytest
from dp_accounting import NeighboringRelation

from dpjax import accounting
from dpjax.mechanisms import analytic_gaussian_sigma


def test_dpsgd_epsilon_equals_dp_accounting():
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.3)), 500)
  rdp = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
  pld = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(1e-5)
  assert accounting.dpsgd_epsilon(1.3, 0.01, 500, 1e-5) == rdp
  assert accounting.dpsgd_epsilon(1.3, 0.01, 500, 1e-5, accountant="pld") == pld


def test_reproduces_the_measured_reference_figure():
  # PEERS.md: σ=1.1, q=256/60000, 14,062 steps, δ=1e-5 → RDP ε ≈ 2.5966.
  eps = accounting.dpsgd_epsilon(1.1, 256 / 60000, 14_062, 1e-5)
  assert abs(eps - 2.5966) < 1e-3


def test_calibrated_noise_multiplier_is_the_smallest_meeting_the_target():
  sigma = accounting.calibrate_noise_multiplier(2.0, 1e-5, 0.05, 300)
  assert accounting.dpsgd_epsilon(sigma, 0.05, 300, 1e-5) <= 2.0
  assert accounting.dpsgd_epsilon(sigma * 0.99, 0.05, 300, 1e-5) > 2.0


def test_event_is_the_self_composed_poisson_sampled_gaussian():
  expected = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(0.9)), 40)
  assert accounting.dpsgd_event(0.9, 0.02, 40) == expected


@pytest.mark.parametrize("eps,q,steps", [(2.0, 0.05, 300), (0.05, 1.0, 1), (40.0, 1.0, 1),
                                         (1.0, 1.0, 1)])
def test_rdp_calibration_is_tight_far_from_its_guess(eps, q, steps):
  # σ ≈ 2.1, 96, 0.15 and 4.0: dp_accounting widens the bracket from the guess σ = 1 upward, or
  # searches down to the floor 0.1; the relative precision is about 1e-5.
  sigma = accounting.calibrate_noise_multiplier(eps, 1e-5, q, steps)
  assert accounting.dpsgd_epsilon(sigma, q, steps, 1e-5) <= eps
  assert accounting.dpsgd_epsilon(sigma * (1 - 2e-5), q, steps, 1e-5) > eps


def _record_pld_sigmas(monkeypatch) -> list:
  """Every σ the PLD accountant is run at (the event is Self(Poisson(Gaussian(σ)))); the
  calibration cache is emptied first so that the search runs."""
  accounting._calibrate_noise_multiplier.cache_clear()
  seen = []
  compose = dp_accounting.pld.PLDAccountant.compose

  def recording(self, event, count=1):
    seen.append(event.event.event.noise_multiplier)
    return compose(self, event, count)

  monkeypatch.setattr(dp_accounting.pld.PLDAccountant, "compose", recording)
  return seen


def test_pld_calibration_is_tight_and_below_rdp(monkeypatch):
  # One full-batch step (q = 1) keeps the PLD accountant fast; the Gaussian's PLD is exact. The
  # search never runs PLD below 1/1.25 of the RDP σ (its memory grows without bound as σ → 0).
  rdp = accounting.calibrate_noise_multiplier(1.0, 1e-5, 1.0, 1)
  seen = _record_pld_sigmas(monkeypatch)
  sigma = accounting.calibrate_noise_multiplier(1.0, 1e-5, 1.0, 1, accountant="pld")
  assert min(seen) >= rdp / 1.25 * (1 - 1e-12)
  assert accounting.dpsgd_epsilon(sigma, 1.0, 1, 1e-5, accountant="pld") <= 1.0
  assert accounting.dpsgd_epsilon(sigma * 0.99, 1.0, 1, 1e-5, accountant="pld") > 1.0
  assert sigma < rdp                                                        # PLD is tighter


@pytest.mark.parametrize("inflate", [1.8, 3.0])
def test_pld_calibration_when_the_rdp_start_is_far_above(monkeypatch, inflate):
  # Were PLD's σ more than 1.25× below RDP's, the search goes down to half the RDP σ, no lower:
  # it finds σ there (1.8×), or returns that valid σ (3×). One Gaussian step: PLD is exact.
  exact = analytic_gaussian_sigma(1.0, 1e-5)
  cached = accounting._calibrate_noise_multiplier

  def inflated_rdp(*args):                   # the PLD search's start, as the cache returns it
    sigma = cached.__wrapped__(*args)
    return inflate * sigma if args[4] == "rdp" else sigma

  seen = _record_pld_sigmas(monkeypatch)
  monkeypatch.setattr(accounting, "_calibrate_noise_multiplier", inflated_rdp)
  start = inflated_rdp(1.0, 1e-5, 1.0, 1, "rdp")
  sigma = accounting.calibrate_noise_multiplier(1.0, 1e-5, 1.0, 1, accountant="pld")
  assert min(seen) >= start / 2 * (1 - 1e-12)
  assert accounting.dpsgd_epsilon(sigma, 1.0, 1, 1e-5, accountant="pld") <= 1.0
  if start / 2 < exact:
    assert sigma == pytest.approx(exact, rel=1e-4)
  else:
    assert sigma == start / 2


def test_calibration_is_cached_per_arguments(monkeypatch):
  seen = _record_pld_sigmas(monkeypatch)
  first = accounting.calibrate_noise_multiplier(1.0, 1e-5, 1.0, 1, accountant="pld")
  searched = len(seen)
  assert searched > 0
  assert accounting.calibrate_noise_multiplier(1.0, 1e-5, 1.0, 1, accountant="pld") == first
  assert len(seen) == searched                               # the second call ran no accountant
  misses = accounting._calibrate_noise_multiplier.cache_info().misses
  accounting.calibrate_noise_multiplier(1.0, 1e-5, 1.0, 2)
  assert accounting._calibrate_noise_multiplier.cache_info().misses == misses + 1   # a new search


def test_calibration_edges_loose_and_impossible_targets():
  # A target so loose that σ = 0.1 meets it: 0.1 is returned (valid, documented floor).
  sigma = accounting.calibrate_noise_multiplier(500.0, 1e-5, 1.0, 1)
  assert sigma == 0.1 and accounting.dpsgd_epsilon(sigma, 1.0, 1, 1e-5) <= 500.0
  with pytest.raises(ValueError, match="target_epsilon"):
    accounting.calibrate_noise_multiplier(1e-3, 1e-5, 1.0, 100_000)


def test_plan_splits_and_totals_add_up():
  plan = accounting.plan_dpsgd_budget(2.0, 1e-5, sampling_prob=0.05, steps=300,
                                      subspace_epsilon=0.5, subspace_delta=1e-6)
  assert plan.sgd_epsilon <= 1.5 + 1e-12 and plan.sgd_delta == pytest.approx(9e-6)
  assert plan.epsilon == pytest.approx(0.5 + plan.sgd_epsilon)
  assert plan.delta == pytest.approx(1e-5) and plan.epsilon <= 2.0
  assert plan.neighboring == NeighboringRelation.ADD_OR_REMOVE_ONE
  plain = accounting.plan_dpsgd_budget(2.0, 1e-5, sampling_prob=0.05, steps=300)
  assert plain.noise_multiplier < plan.noise_multiplier       # the subspace's share costs noise


def test_compose_and_convert():
  a = accounting.PrivacySpend(0.5, 1e-6, NeighboringRelation.ADD_OR_REMOVE_ONE)
  b = accounting.PrivacySpend(1.0, 1e-6, NeighboringRelation.ADD_OR_REMOVE_ONE)
  assert accounting.compose_basic(a, b) == accounting.PrivacySpend(1.5, 2e-6, NeighboringRelation.ADD_OR_REMOVE_ONE)
  with pytest.raises(ValueError, match="neighboring"):
    accounting.compose_basic(a, accounting.PrivacySpend(1.0, 1e-6, NeighboringRelation.REPLACE_ONE))
  r = accounting.replace_one_from_add_remove(1.0, 1e-6)
  assert r == accounting.PrivacySpend(2.0, (1 + math.e) * 1e-6, NeighboringRelation.REPLACE_ONE)
  assert accounting.replace_one_from_add_remove(0.5, 0.0) == (1.0, 0.0, NeighboringRelation.REPLACE_ONE)
  with pytest.raises(TypeError, match="PrivacySpend"):
    accounting.compose_basic(a, (1.0, 1e-6, NeighboringRelation.ADD_OR_REMOVE_ONE))
  with pytest.raises(ValueError, match="at least one"):
    accounting.compose_basic()


@pytest.mark.parametrize("call,match", [
    (lambda: accounting.dpsgd_epsilon(0.0, 0.1, 10, 1e-5), "noise_multiplier"),
    (lambda: accounting.dpsgd_epsilon(1.0, 1.5, 10, 1e-5), "sampling_prob"),
    (lambda: accounting.dpsgd_epsilon(1.0, 0.1, 0, 1e-5), "steps"),
    (lambda: accounting.dpsgd_epsilon(1.0, 0.1, 10, 0.0), "delta"),
    (lambda: accounting.dpsgd_epsilon(1.0, 0.1, 10, 1e-5, accountant="gdp"), "accountant"),
    (lambda: accounting.plan_dpsgd_budget(1.0, 1e-5, sampling_prob=0.1, steps=10,
                                          subspace_epsilon=1.0), "subspace_epsilon"),
    (lambda: accounting.plan_dpsgd_budget(1.0, 1e-5, sampling_prob=0.1, steps=10,
                                          subspace_delta=2e-5), "subspace_delta"),
    (lambda: accounting.calibrate_noise_multiplier(-1.0, 1e-5, 0.1, 10), "target_epsilon"),
    (lambda: accounting.calibrate_noise_multiplier(1.0, 0.0, 0.1, 10), "target_delta"),
    (lambda: accounting.calibrate_noise_multiplier(1.0, 1e-5, 0.0, 10), "sampling_prob"),
    (lambda: accounting.calibrate_noise_multiplier(1.0, 1e-5, 0.1, 10, accountant="x"),
     "accountant"),
    (lambda: accounting.dpsgd_event(1.0, 0.1, 2.5), "steps"),
    (lambda: accounting.plan_dpsgd_budget(1.0, 1e-5, sampling_prob=0.1, steps=10,
                                          subspace_epsilon=-0.1), "subspace_epsilon"),
    (lambda: accounting.replace_one_from_add_remove(-1.0, 1e-6), "epsilon"),
    (lambda: accounting.replace_one_from_add_remove(1.0, 1.0), "delta"),
])
def test_bad_inputs(call, match):
  with pytest.raises((ValueError, TypeError), match=match):
    call()


def test_rdp_order_warnings_are_silenced_at_the_source(caplog):
  # q = 0.5, σ = 1: dp_accounting logs one line per fractional order it drops.
  event = accounting.dpsgd_event(1.0, 0.5, 100)
  with caplog.at_level("WARNING", logger="absl"):
    dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
  raw = [r for r in caplog.records if "Excluding this order" in r.getMessage()]
  assert raw                                         # the negative control: they exist
  caplog.clear()
  with caplog.at_level("WARNING", logger="absl"):
    accounting.dpsgd_epsilon(1.0, 0.5, 100, 1e-5)
    # (A loose target: the search still runs RDP at σ = 1 and q = 0.5, the orders logged above,
    # but ends sooner; each RDP evaluation at q = 0.5 costs ~0.2 s.)
    accounting.calibrate_noise_multiplier(50.0, 1e-5, 0.5, 100)
    with accounting.quiet_rdp_logs():
      import logging
      logging.getLogger("absl").warning("other absl records pass")
  messages = [r.getMessage() for r in caplog.records]
  assert messages == ["other absl records pass"]


# ----------------------------------------------------------------- private hyperparameter tuning

TUNING = accounting.HyperparameterTuning(3.0, 0.0)


def test_tuning_event_and_epsilon_are_dp_accountings_repeat_and_select():
  base = accounting.dpsgd_event(1.2, 0.05, 100)
  event = accounting.tuning_event(base, TUNING)
  assert event == dp_accounting.dp_event.RepeatAndSelectDpEvent(base, 3.0, 0.0)
  expected = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
  assert accounting.dpsgd_epsilon(1.2, 0.05, 100, 1e-5, tuning=TUNING) == expected
  # Tuning costs more than one run, far less than composing the mean number of runs.
  one = accounting.dpsgd_epsilon(1.2, 0.05, 100, 1e-5)
  three = dp_accounting.rdp.RdpAccountant().compose(base, 3).get_epsilon(1e-5)
  assert one < expected < three


def test_tuned_calibration_meets_the_target_for_the_whole_tuning():
  sigma = accounting.calibrate_noise_multiplier(2.0, 1e-5, 0.05, 100, tuning=TUNING)
  assert accounting.dpsgd_epsilon(sigma, 0.05, 100, 1e-5, tuning=TUNING) <= 2.0
  assert accounting.dpsgd_epsilon(0.99 * sigma, 0.05, 100, 1e-5, tuning=TUNING) > 2.0
  assert sigma > accounting.calibrate_noise_multiplier(2.0, 1e-5, 0.05, 100)
  budget = accounting.plan_dpsgd_budget(2.0, 1e-5, sampling_prob=0.05, steps=100,
                                        tuning=TUNING)
  assert budget.noise_multiplier == sigma and budget.tuning == TUNING
  assert budget.epsilon <= 2.0 and budget.sgd_epsilon == budget.epsilon


@pytest.mark.parametrize("call,error,match", [
    (lambda: accounting.dpsgd_epsilon(1.0, 0.1, 10, 1e-5, accountant="pld", tuning=TUNING),
     ValueError, "accountant='rdp'"),
    (lambda: accounting.calibrate_noise_multiplier(1.0, 1e-5, 0.1, 10, accountant="pld",
                                                   tuning=TUNING), ValueError, "rdp"),
    (lambda: accounting.plan_dpsgd_budget(1.0, 1e-5, sampling_prob=0.1, steps=10,
                                          subspace_epsilon=0.1, tuning=TUNING),
     ValueError, "subspace release"),
    (lambda: accounting.check_tuning(accounting.HyperparameterTuning(0.5)), ValueError,
     "mean must be >= 1"),
    (lambda: accounting.check_tuning(accounting.HyperparameterTuning(1.0, 0.0)), ValueError,
     "mean must exceed 1"),
    (lambda: accounting.check_tuning(accounting.HyperparameterTuning(3.0, -1.0)), ValueError,
     "shape"),
    (lambda: accounting.check_tuning(accounting.HyperparameterTuning(math.nan)), ValueError,
     "mean"),
    (lambda: accounting.check_tuning((3.0, 0.0)), TypeError, "HyperparameterTuning"),
    (lambda: accounting.tuning_event("event", TUNING), TypeError, "DpEvent"),
])
def test_tuning_bad_inputs(call, error, match):
  with pytest.raises(error, match=match):
    call()


def _tnb_pmf(k, eta, gamma):
  """Papernot & Steinke's truncated negative binomial (η > 0), logarithmic (η = 0)."""
  if eta == 0.0:
    return (1 - gamma) ** k / (k * math.log(1 / gamma))
  coef = math.exp(math.lgamma(k + eta) - math.lgamma(eta) - math.lgamma(k + 1))
  return coef * (1 - gamma) ** k / (gamma ** -eta - 1)


_OTHER_SHAPES = pytest.mark.slow(reason="the truncated negative binomial's other shapes; the "
                                         "default run checks the logarithmic and Poisson laws")


@pytest.mark.parametrize("shape", [0.0, pytest.param(0.5, marks=_OTHER_SHAPES),
                                   pytest.param(1.0, marks=_OTHER_SHAPES), math.inf])
def test_tuning_repetitions_follow_the_law_the_accountant_assumes(shape):
  """K's law, by a χ²-style check of the first counts against Papernot & Steinke's pmf
  (Poisson: e^{−μ}μ^k/k!), 2,000 draws; γ gives the requested mean exactly."""
  import jax
  import numpy as np
  from scipy import stats
  tuning = accounting.HyperparameterTuning(3.0, shape)
  if math.isinf(shape):
    assert accounting.tuning_gamma(tuning) is None
    pmf = lambda k: stats.poisson.pmf(k, 3.0)  # noqa: E731
    support = range(0, 8)
  else:
    gamma = accounting.tuning_gamma(tuning)
    assert sum(k * _tnb_pmf(k, shape, gamma) for k in range(1, 3000)) == pytest.approx(3.0,
                                                                                       rel=1e-6)
    pmf = lambda k: _tnb_pmf(k, shape, gamma)  # noqa: E731
    support = range(1, 8)
  draws = np.array([accounting.tuning_repetitions(k, tuning)
                    for k in jax.random.split(jax.random.key(7), 2000)])
  if not math.isinf(shape):
    assert draws.min() >= 1
  observed = np.array([np.sum(draws == k) for k in support] + [np.sum(draws > max(support))])
  probs = np.array([pmf(k) for k in support])
  expected = 2000 * np.append(probs, 1 - probs.sum())
  assert stats.chisquare(observed, expected).pvalue > 1e-3
  again = accounting.tuning_repetitions(jax.random.key(3), tuning)
  assert again == accounting.tuning_repetitions(jax.random.key(3), tuning)


def test_tuning_composes_a_gaussian_release_once_outside_the_repetition():
  """A Gaussian release made before a tuning (e.g. a private feature normalisation shared by
  every run) is composed once with the tuning's repeat-and-select event: σ meets (ε, δ) for
  exactly that event by dp_accounting's RDP accountant, and 1% less noise does not."""
  release = dp_accounting.GaussianDpEvent(8.0)
  budget = accounting.plan_dpsgd_budget(1.0, 1e-5, sampling_prob=0.05, steps=200,
                                        subspace_event=release, tuning=TUNING)
  alone = accounting.plan_dpsgd_budget(1.0, 1e-5, sampling_prob=0.05, steps=200, tuning=TUNING)
  assert budget.noise_multiplier > alone.noise_multiplier

  def eps(sigma):
    steps = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        0.05, dp_accounting.GaussianDpEvent(sigma)), 200)
    event = dp_accounting.ComposedDpEvent(
        [release, dp_accounting.dp_event.RepeatAndSelectDpEvent(steps, TUNING.mean,
                                                                TUNING.shape)])
    return dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)

  assert eps(budget.noise_multiplier) <= 1.0 * (1 + 1e-6)
  assert eps(0.99 * budget.noise_multiplier) > 1.0
  assert budget.dp_event == accounting.dpsgd_plan_event(
      budget.noise_multiplier, 0.05, 200, subspace_event=release, tuning=TUNING)
  # The config states the same event; an (ε_s, δ_s) release is still refused with a tuning.
  from dpjax import sgd
  config = sgd.DPSGDConfig(num_examples=2000, expected_batch_size=100, steps=200, epsilon=1.0,
                           delta=1e-5, accountant="rdp", subspace_event=release, tuning=TUNING)
  assert config.calibrate().noise_multiplier == pytest.approx(budget.noise_multiplier)
