"""Property test of the ledger (issue 36 §1): for random sequences of releases, the ledger's
running total is dp_accounting's own composition of the same events (RDP and PLD), with
approximate-DP releases added by basic composition, and the release that would overspend is
refused without being recorded."""

import math

import dp_accounting
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpjax.ledger import BudgetExceededError, PrivacyLedger

DELTA = 1e-5

_gaussian = st.builds(dp_accounting.GaussianDpEvent,
                      st.floats(0.7, 4.0, allow_nan=False, allow_infinity=False))
_laplace = st.builds(dp_accounting.LaplaceDpEvent,
                     st.floats(0.7, 4.0, allow_nan=False, allow_infinity=False))
_sampled = st.builds(lambda q, sigma, t: dp_accounting.SelfComposedDpEvent(
    dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), t),
    st.floats(0.001, 0.1), st.floats(0.8, 3.0), st.integers(1, 30))
_events = st.lists(st.one_of(_gaussian, _laplace, _sampled), min_size=1, max_size=4)
_approx = st.lists(st.tuples(st.floats(0.0, 0.5), st.sampled_from([0.0, 1e-7, 1e-6])),
                   max_size=2)


def _reference(accountant, events, approx):
  """dp_accounting's own composition of ``events`` at the δ the approx releases leave, plus
  their basic-composition (ε, δ)."""
  eps_a = sum(e for e, _ in approx)
  delta_a = sum(d for _, d in approx)
  if not events:
    return eps_a
  acc = (dp_accounting.rdp.RdpAccountant() if accountant == "rdp"
         else dp_accounting.pld.PLDAccountant())
  acc.compose(dp_accounting.ComposedDpEvent(list(events)))
  return eps_a + acc.get_epsilon(DELTA - delta_a)


_SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow])


_PLD = pytest.param("pld", marks=pytest.mark.slow(
    reason="PLD composition of random sequences (~1 min); the default run checks RDP"))


@pytest.mark.parametrize("accountant", ["rdp", _PLD])
def test_the_ledgers_total_is_dp_accountings_composition(accountant):
  @_SETTINGS
  @given(events=_events, approx=_approx)
  def check(events, approx):
    ledger = PrivacyLedger(1e6, DELTA, accountant=accountant)
    for eps, delta in approx:
      ledger.record_approx_dp(eps, delta)
    for i, event in enumerate(events):
      spent = ledger.record_event(event, label=f"release {i}")
      want = _reference(accountant, events[:i + 1], approx)
      assert spent.epsilon == pytest.approx(want, rel=1e-9, abs=1e-12)
      assert ledger.spent.epsilon == pytest.approx(want, rel=1e-9, abs=1e-12)
      assert spent.delta == DELTA
  check()


@pytest.mark.parametrize("accountant", ["rdp", _PLD])
def test_the_release_that_would_overspend_is_refused_and_not_recorded(accountant):
  @_SETTINGS
  @given(events=st.lists(st.one_of(_gaussian, _laplace, _sampled), min_size=2, max_size=4))
  def check(events):
    *first, last = events
    before = _reference(accountant, first, [])
    after = _reference(accountant, events, [])
    if not after > before * (1 + 1e-6):                 # the last release must cost something
      return
    budget = (before + after) / 2                        # room for all but the last
    ledger = PrivacyLedger(budget, DELTA, accountant=accountant)
    for event in first:
      ledger.record_event(event)
    with pytest.raises(BudgetExceededError, match="refused"):
      ledger.record_event(last, label="over")
    assert len(ledger.entries) == len(first)
    assert ledger.spent.epsilon == pytest.approx(before, rel=1e-9)
    # Negative control: with the budget at the full composition the same release is recorded.
    roomy = PrivacyLedger(after * (1 + 1e-6), DELTA, accountant=accountant)
    for event in events:
      roomy.record_event(event)
    assert len(roomy.entries) == len(events) and math.isfinite(roomy.spent.epsilon)
  check()
