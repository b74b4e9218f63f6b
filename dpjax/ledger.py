"""A running record of privacy releases under one neighboring relation, with a hard budget."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from typing import NamedTuple

import dp_accounting
import jax
import jax.numpy as jnp
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax._core.deprecation import renamed_argument, renamed_attribute
from dpjax import accounting
from dpjax.accounting import ACCOUNTANTS, PrivacySpend, dpsgd_event, quiet_rdp_logs

__all__ = ["BudgetExceededError", "LedgerEntry", "PrivacyLedger", "check_untraced", "with_ledger"]


class BudgetExceededError(ValueError):
  """A release would take the ledger past its declared (ε, δ) budget; nothing was recorded."""


class LedgerEntry(NamedTuple):
  label: str
  kind: str                     # "approx_dp" (ε, δ) or "dp_event" (a dp_accounting event)
  epsilon: float | None
  delta: float | None
  event: dp_accounting.DpEvent | None


class PrivacyLedger:
  """A running record of releases under one neighboring relation, with a hard budget.

  Releases described by a ``dp_accounting`` event (DP-SGD, Gaussian, Laplace) are composed by the
  accountant — PLD by default, as the plan and the learners calibrate, or RDP where PLD cannot
  compose the events (a tuning's repeat-and-select event; ``spent_accountant`` says which) —
  and approximate-DP releases with no event (DPASE, the stability histogram, GAP-MAX) are
  composed with them by basic composition. The running guarantee is

      ε = Σ ε_approx + ε_accountant(δ − Σ δ_approx),   δ = the declared δ

  when there are accountant events, and ``(Σ ε_approx, Σ δ_approx)`` otherwise. A release that
  would exceed the declared budget raises :class:`BudgetExceededError` and is not recorded: call
  the ledger before running the mechanism (dpjax's learners do).

  Example::

      ledger = PrivacyLedger(epsilon=2.0, delta=1e-5)      # add/remove-one (the default)
      ledger.record_approx_dp(0.5, 1e-6, label="dpase subspace")
      ledger.record_dpsgd(noise_multiplier=1.1, sampling_prob=0.01, steps=1000)
      ledger.spent  # PrivacySpend(epsilon=..., delta=1e-05, neighboring=ADD_OR_REMOVE_ONE)

  Args:
    epsilon, delta: the budget.
    neighboring: the ``dp_accounting.NeighboringRelation`` every recorded guarantee must hold
      under: ``ADD_OR_REMOVE_ONE`` (default; DP-SGD's) or ``REPLACE_ONE``.
    accountant: ``"pld"`` (default; RDP for events PLD cannot compose) or ``"rdp"``, for the
      recorded ``dp_accounting`` events. A DP-SGD plan calibrated by another accountant is
      booked as its (ε, δ) (:func:`dpjax.sgd.plan.record_budget`), so a (ε, δ) ledger accepts a
      (ε, δ) plan either way.
  """

  neighbouring = renamed_attribute("neighboring", "neighbouring")

  def __init__(self, epsilon: float, delta: float, *,
               neighboring: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE,
               neighbouring: NeighboringRelation | None = None,
               accountant: str = "pld"):
    self.epsilon = v.check_epsilon(epsilon)
    self.delta = v.check_delta(delta)
    neighboring = renamed_argument(neighboring, neighbouring, new="neighboring",
                                   old="neighbouring",
                                   default=NeighboringRelation.ADD_OR_REMOVE_ONE)
    self.neighboring = v.check_neighboring(neighboring)
    self.accountant = v.check_choice(accountant, "accountant", ACCOUNTANTS)
    self._entries: list[LedgerEntry] = []

  def copy(self) -> "PrivacyLedger":
    """An independent ledger with the same budget and entries (to try a plan first)."""
    other = PrivacyLedger(self.epsilon, self.delta, neighboring=self.neighboring,
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
                       neighboring: NeighboringRelation | None = None,
                       neighbouring: NeighboringRelation | None = None) -> PrivacySpend:
    """Records an (ε, δ)-DP release; raises :class:`BudgetExceededError` if over budget.

    ``neighboring`` is the relation the release's guarantee holds under (default: the ledger's);
    it must match the ledger's.
    """
    epsilon = v.check_positive(epsilon, "epsilon", allow_zero=True)
    delta = v.check_positive(delta, "delta", allow_zero=True)
    self._check_relation(renamed_argument(neighboring, neighbouring, new="neighboring",
                                          old="neighbouring"))
    return self._add(LedgerEntry(label, "approx_dp", epsilon, delta, None))

  def record(self, release, *, label: str = "") -> PrivacySpend:
    """Records a learner's result (its ``dp_event`` under its ``neighboring``) or a
    ``dp_accounting`` event (under the ledger's relation); raises
    :class:`BudgetExceededError`, recording nothing, if over budget.

    A result that saw only public data (``NoOpDpEvent``) is recorded at no cost.

    Raises:
      TypeError: neither a result nor an event.
      ValueError: a result stated under another relation (or under none, while not free).
    """
    if isinstance(release, dp_accounting.DpEvent):
      return self.record_event(release, label=label)
    event = getattr(release, "dp_event", None)
    if not isinstance(event, dp_accounting.DpEvent):
      raise TypeError("record takes a dpjax result (with a dp_event) or a dp_accounting.DpEvent, "
                      f"got {type(release).__name__}.")
    relation = getattr(release, "neighboring", None)
    if relation is None and not isinstance(event, dp_accounting.NoOpDpEvent):
      raise ValueError("a result with no neighboring relation is not private (ε = ∞); a "
                       "ledger cannot record it.")
    return self.record_event(event, label=label or type(release).__name__,
                             neighboring=relation)

  def record_event(self, event: dp_accounting.DpEvent, *, label: str = "",
                   neighboring: NeighboringRelation | None = None,
                   neighbouring: NeighboringRelation | None = None) -> PrivacySpend:
    """Records a release described by a ``dp_accounting`` event (under ``neighboring``, default
    the ledger's; ``neighbouring`` is its deprecated spelling)."""
    if not isinstance(event, dp_accounting.DpEvent):
      raise TypeError(f"event must be a dp_accounting.DpEvent, got {type(event).__name__}.")
    self._check_relation(renamed_argument(neighboring, neighbouring, new="neighboring",
                                          old="neighbouring"))
    accounting.split_event(event)                 # refuses what cannot be composed, early
    return self._add(LedgerEntry(label, "dp_event", None, None, event))

  def record_dpsgd(self, *, noise_multiplier: float, sampling_prob: float, steps: int,
                   label: str = "dp-sgd") -> PrivacySpend:
    """Records Poisson-sampled DP-SGD steps (add/remove-one; refused by a replace-one ledger)."""
    return self.record_event(dpsgd_event(noise_multiplier, sampling_prob, steps), label=label,
                             neighboring=NeighboringRelation.ADD_OR_REMOVE_ONE)

  def _check_relation(self, neighboring):
    if neighboring is not None and v.check_neighboring(neighboring) != self.neighboring:
      raise ValueError(f"this ledger composes guarantees under {self.neighboring.name}; a "
                       f"release stated under {neighboring.name} must be converted first.")

  def _add(self, entry: LedgerEntry) -> PrivacySpend:
    entries = self._entries + [entry]
    total = self._total(entries)
    if total.epsilon > self.epsilon * (1 + 1e-9) or total.delta > self.delta * (1 + 1e-9):
      what = (f"its event {entry.event!r}" if entry.kind == "dp_event" else
              f"its (ε={entry.epsilon:.4g}, δ={entry.delta:.3g})")
      raise BudgetExceededError(
          f"release {entry.label!r} refused: {what} would bring the total to "
          f"(ε={total.epsilon:.4g}, δ={total.delta:.3g}), composed by the "
          f"{self._accountant_for(entries)} accountant (and basic composition for (ε, δ) "
          f"releases), over the budget (ε={self.epsilon:.4g}, δ={self.delta:.3g}).")
    self._entries.append(entry)
    return total

  @property
  def spent_accountant(self) -> str:
    """The accountant :attr:`spent` composes the recorded events with: the ledger's, or RDP where
    PLD cannot compose them."""
    return self._accountant_for(self._entries)

  def _accountant_for(self, entries) -> str:
    events = [e.event for e in entries if e.kind == "dp_event"]
    parts = accounting.split_event(accounting.compose_events(*events)) if events else None
    if parts is None or not parts.accountable or self.accountant == "rdp":
      return self.accountant
    composed = dp_accounting.ComposedDpEvent(list(parts.accountable))
    return "pld" if accounting.make_accountant("pld").supports(composed) else "rdp"

  @quiet_rdp_logs()
  def _total(self, entries) -> PrivacySpend:
    # Every entry as an event: (ε, δ) releases are EpsilonDeltaDpEvent leaves, composed by basic
    # composition with the accountant's composition of the others (accounting.split_event).
    events = [accounting.release_event(e.epsilon, e.delta) if e.kind == "approx_dp" else e.event
              for e in entries]
    composed = accounting.compose_events(*events)
    parts = accounting.split_event(composed)
    if not parts.accountable:
      return PrivacySpend(parts.epsilon, parts.delta, self.neighboring)
    return PrivacySpend(accounting.event_epsilon(composed, self.delta,
                                                 accountant=self._accountant_for(entries)),
                        self.delta, self.neighboring)


_LEDGER_DOC = """

  Ledger: ``ledger=`` (optional :class:`dpjax.ledger.PrivacyLedger`) records the result's
  ``dp_event`` under its relation before the result is returned; a result that would overspend
  the ledger raises :class:`dpjax.ledger.BudgetExceededError` and is never returned (nothing is
  recorded). The check runs after the learner has computed its result (the refused result is
  discarded: no privacy is lost, the computation is). A call with ``ledger=`` inside
  ``jax.jit``, ``jax.vmap`` or any other transformation raises ``TypeError`` (a traced call
  runs once per trace, not once per release): call the learner without it there and record
  each release outside, ``ledger.record(result)`` once per release.
"""


def _traced(*trees) -> bool:
  """Whether a JAX transformation is tracing this call: a leaf of ``trees`` is a tracer (``vmap``
  and ``grad`` trace the arguments), or a fresh constant is (``jit`` stages every operation)."""
  # An iterator (a streamed row source) is a leaf, not a tree: it is never traced.
  leaves = jax.tree_util.tree_leaves(trees, is_leaf=lambda x: isinstance(x, Iterator))
  return any(isinstance(x, jax.core.Tracer) for x in leaves + [jnp.zeros((), jnp.int8)])


def check_untraced(name: str, *trees) -> None:
  """Raises ``TypeError`` when a release that records in a ledger is being traced.

  A ledger records in Python, once per call it sees: under ``jax.jit`` that is once per trace
  (three calls, one record) and under ``jax.vmap`` one record for a batch of releases. Every
  learner that takes ``ledger=`` calls this with its array arguments before recording.

  Args:
    name: the learner, for the message.
    trees: its arguments (any pytrees; a tracer among their leaves means a transformation).

  Raises:
    TypeError: inside ``jax.jit``, ``jax.vmap``, ``jax.grad``, ``lax.map`` or another
      transformation.
  """
  if _traced(*trees):
    raise _traced_error(name)


def with_ledger(learner):
  """Gives a learner a keyword argument ``ledger=`` (see ``_LEDGER_DOC``): the one way every
  dpjax learner records its release. The wrapped function keeps its name, docstring (with the
  ledger paragraph appended) and signature (plus ``ledger``); without ``ledger`` it is as
  traceable as the learner. With it the call must not be traced: recording is a side effect in
  Python, so under ``jax.jit`` it would happen once per trace (three calls, one record) and under
  ``jax.vmap`` once for a batch of releases; such a call raises ``TypeError`` before the learner
  runs."""
  signature = inspect.signature(learner)
  if "ledger" in signature.parameters:
    raise TypeError(f"{learner.__name__} already takes a ledger.")

  @functools.wraps(learner)
  def wrapped(*args, ledger: PrivacyLedger | None = None, **kwargs):
    if ledger is not None and not isinstance(ledger, PrivacyLedger):
      raise TypeError(f"ledger must be a dpjax.ledger.PrivacyLedger, got {type(ledger).__name__}.")
    if ledger is not None:
      check_untraced(learner.__name__, args, kwargs)
    result = learner(*args, **kwargs)
    if ledger is not None:
      check_untraced(learner.__name__, result)
      ledger.record(result, label=learner.__name__)
    return result

  parameter = inspect.Parameter("ledger", inspect.Parameter.KEYWORD_ONLY, default=None)
  params = list(signature.parameters.values())
  at = next((i for i, p in enumerate(params) if p.kind == p.VAR_KEYWORD), len(params))
  wrapped.__signature__ = signature.replace(parameters=params[:at] + [parameter] + params[at:])
  wrapped.__doc__ = (learner.__doc__ or "").rstrip() + _LEDGER_DOC
  return wrapped


def _traced_error(name: str) -> TypeError:
  return TypeError(
      f"{name}(..., ledger=...) was called inside a JAX transformation (jax.jit, jax.vmap, "
      "jax.grad, lax.map, ...). A ledger records in Python, once per call it sees: under jit "
      "that is once per trace, not once per release, and under vmap one record for a whole "
      "batch of releases. Call it without ledger= inside the transformation and record outside "
      "it, once per release: ledger.record(result) (n times for a vmap over n keys).")
