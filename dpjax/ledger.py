"""A running record of privacy releases under one neighbouring relation, with a hard budget."""

from __future__ import annotations

import math
from typing import NamedTuple

import dp_accounting
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax.accounting import ACCOUNTANTS, PrivacySpend, _accountant, dpsgd_event, quiet_rdp_logs


class BudgetExceededError(ValueError):
  """A release would take the ledger past its declared (ε, δ) budget; nothing was recorded."""


class LedgerEntry(NamedTuple):
  label: str
  kind: str                     # "approx_dp" (ε, δ) or "dp_event" (a dp_accounting event)
  epsilon: float | None
  delta: float | None
  event: dp_accounting.DpEvent | None


class PrivacyLedger:
  """A running record of releases under one neighbouring relation, with a hard budget.

  Releases described by a ``dp_accounting`` event (DP-SGD, Gaussian, Laplace) are composed by the
  accountant; approximate-DP releases with no event (DPASE, the stability histogram, GAP-MAX)
  are composed with them by basic composition. The running guarantee is

      ε = Σ ε_approx + ε_accountant(δ − Σ δ_approx),   δ = the declared δ

  when there are accountant events, and ``(Σ ε_approx, Σ δ_approx)`` otherwise. A release that
  would exceed the declared budget raises :class:`BudgetExceededError` and is not recorded: call
  the ledger before running the mechanism (dpjax's learners do).

  Example::

      ledger = PrivacyLedger(epsilon=2.0, delta=1e-5)      # add/remove-one (the default)
      ledger.record_approx_dp(0.5, 1e-6, label="dpase subspace")
      ledger.record_dpsgd(noise_multiplier=1.1, sampling_prob=0.01, steps=1000)
      ledger.spent  # PrivacySpend(epsilon=..., delta=1e-05, neighbouring=ADD_OR_REMOVE_ONE)

  Args:
    epsilon, delta: the budget.
    neighbouring: the ``dp_accounting.NeighboringRelation`` every recorded guarantee must hold
      under: ``ADD_OR_REMOVE_ONE`` (default; DP-SGD's) or ``REPLACE_ONE``.
    accountant: ``"rdp"`` (default) or ``"pld"``, for the recorded ``dp_accounting`` events.
  """

  def __init__(self, epsilon: float, delta: float, *,
               neighbouring: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE,
               accountant: str = "rdp"):
    self.epsilon = v.check_epsilon(epsilon)
    self.delta = v.check_delta(delta)
    self.neighbouring = v.check_neighbouring(neighbouring)
    self.accountant = v.check_choice(accountant, "accountant", ACCOUNTANTS)
    self._entries: list[LedgerEntry] = []

  def copy(self) -> "PrivacyLedger":
    """An independent ledger with the same budget and entries (to try a plan first)."""
    other = PrivacyLedger(self.epsilon, self.delta, neighbouring=self.neighbouring,
                          accountant=self.accountant)
    other._entries = list(self._entries)
    return other

  @property
  def entries(self) -> tuple[LedgerEntry, ...]:
    return tuple(self._entries)

  @property
  def spent(self) -> PrivacySpend:
    """The running (ε, δ) of everything recorded."""
    return self._total(self._entries)

  @property
  def remaining_epsilon(self) -> float:
    return max(0.0, self.epsilon - self.spent.epsilon)

  def record_approx_dp(self, epsilon: float, delta: float, *, label: str = "",
                       neighbouring: NeighboringRelation | None = None) -> PrivacySpend:
    """Records an (ε, δ)-DP release; raises :class:`BudgetExceededError` if over budget.

    ``neighbouring`` is the relation the release's guarantee holds under (default: the ledger's);
    it must match the ledger's.
    """
    epsilon = v.check_positive(epsilon, "epsilon", allow_zero=True)
    delta = v.check_positive(delta, "delta", allow_zero=True)
    self._check_relation(neighbouring)
    return self._add(LedgerEntry(label, "approx_dp", epsilon, delta, None))

  def record_event(self, event: dp_accounting.DpEvent, *, label: str = "",
                   neighbouring: NeighboringRelation | None = None) -> PrivacySpend:
    """Records a release described by a ``dp_accounting`` event."""
    if not isinstance(event, dp_accounting.DpEvent):
      raise TypeError(f"event must be a dp_accounting.DpEvent, got {type(event).__name__}.")
    self._check_relation(neighbouring)
    return self._add(LedgerEntry(label, "dp_event", None, None, event))

  def record_dpsgd(self, *, noise_multiplier: float, sampling_prob: float, steps: int,
                   label: str = "dp-sgd") -> PrivacySpend:
    """Records Poisson-sampled DP-SGD steps (add/remove-one; refused by a replace-one ledger)."""
    return self.record_event(dpsgd_event(noise_multiplier, sampling_prob, steps), label=label,
                             neighbouring=NeighboringRelation.ADD_OR_REMOVE_ONE)

  def _check_relation(self, neighbouring):
    if neighbouring is not None and v.check_neighbouring(neighbouring) != self.neighbouring:
      raise ValueError(f"this ledger composes guarantees under {self.neighbouring.name}; a "
                       f"release stated under {neighbouring.name} must be converted first.")

  def _add(self, entry: LedgerEntry) -> PrivacySpend:
    total = self._total(self._entries + [entry])
    if total.epsilon > self.epsilon * (1 + 1e-9) or total.delta > self.delta * (1 + 1e-9):
      raise BudgetExceededError(
          f"release {entry.label!r} refused: it would bring the total to "
          f"(ε={total.epsilon:.4g}, δ={total.delta:.3g}), over the budget "
          f"(ε={self.epsilon:.4g}, δ={self.delta:.3g}).")
    self._entries.append(entry)
    return total

  @quiet_rdp_logs()
  def _total(self, entries) -> PrivacySpend:
    eps = sum(e.epsilon for e in entries if e.kind == "approx_dp")
    delta = sum(e.delta for e in entries if e.kind == "approx_dp")
    events = [e.event for e in entries if e.kind == "dp_event"]
    if not events:
      return PrivacySpend(eps, delta, self.neighbouring)
    left = self.delta - delta
    if left <= 0:
      return PrivacySpend(math.inf, self.delta, self.neighbouring)
    acc = _accountant(self.accountant).compose(dp_accounting.ComposedDpEvent(events))
    return PrivacySpend(eps + float(acc.get_epsilon(left)), self.delta, self.neighbouring)
