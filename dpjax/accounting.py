"""Privacy accounting on Google's ``dp_accounting`` (ALGORITHMS.md §1.8, §6).

No RDP or PLD formula is written here: DP-SGD steps are described as ``dp_accounting`` events and
composed by its accountants. Approximate-DP steps that have no event of their own (DPASE, the
stability histogram) are composed with the SGD part by basic composition.

Neighbouring relation: DP-SGD with Poisson sampling is accounted under **add/remove-one**, the
relation ``dp_accounting`` supports for ``PoissonSampledDpEvent``. DPASE run with
``partition="random_labels"`` is (ε, δ)-DP under add/remove-one as well, so a private gradient
subspace and the SGD steps compose under that single relation (ALGORITHMS.md §6.2 route (c)).
:func:`replace_one_from_add_remove` converts a final statement when replace-one is needed.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import dp_accounting

from dpjax import _validation as v

ADD_REMOVE = "add_remove"
REPLACE_ONE = "replace_one"
ACCOUNTANTS = ("rdp", "pld")


class PrivacySpend(NamedTuple):
  """An (ε, δ) guarantee and the neighbouring relation it holds under."""
  epsilon: float
  delta: float
  neighbouring: str


def _accountant(name: str) -> dp_accounting.PrivacyAccountant:
  v.check_choice(name, "accountant", ACCOUNTANTS)
  if name == "rdp":
    return dp_accounting.rdp.RdpAccountant()
  return dp_accounting.pld.PLDAccountant()


def _check_sgd(noise_multiplier, sampling_prob, steps) -> tuple[float, float, int]:
  noise_multiplier = v.check_positive(noise_multiplier, "noise_multiplier")
  sampling_prob = v.check_probability(sampling_prob, "sampling_prob")
  steps = v.check_int(steps, "steps", low=1)
  return noise_multiplier, sampling_prob, steps


def dpsgd_event(noise_multiplier: float, sampling_prob: float,
                steps: int) -> dp_accounting.DpEvent:
  """The DP-SGD event: ``steps`` self-compositions of a Poisson-sampled Gaussian mechanism.

  Args:
    noise_multiplier: σ, the Gaussian noise std divided by the clip norm.
    sampling_prob: q ∈ (0, 1], each example's inclusion probability per step.
    steps: number of steps T ≥ 1.
  """
  noise_multiplier, sampling_prob, steps = _check_sgd(noise_multiplier, sampling_prob, steps)
  step = dp_accounting.PoissonSampledDpEvent(sampling_prob,
                                             dp_accounting.GaussianDpEvent(noise_multiplier))
  return dp_accounting.SelfComposedDpEvent(step, steps)


def dpsgd_epsilon(noise_multiplier: float, sampling_prob: float, steps: int, delta: float, *,
                  accountant: str = "rdp") -> float:
  """ε of DP-SGD at ``delta`` under add/remove-one, from ``dp_accounting``'s RDP or PLD accountant.

  Raises:
    ValueError: σ ≤ 0, q ∉ (0, 1], steps < 1, δ ∉ (0, 1), unknown accountant.
  """
  delta = v.check_delta(delta)
  event = dpsgd_event(noise_multiplier, sampling_prob, steps)
  return float(_accountant(accountant).compose(event).get_epsilon(delta))


def calibrate_noise_multiplier(target_epsilon: float, target_delta: float, sampling_prob: float,
                               steps: int, *, accountant: str = "rdp") -> float:
  """The smallest noise multiplier σ whose DP-SGD run meets ``(target_epsilon, target_delta)``.

  Uses ``dp_accounting.calibrate_dp_mechanism`` (bisection on σ); add/remove-one.

  Raises:
    ValueError: bad targets, q, steps, or no σ ≤ 10⁴ reaches the target.
  """
  target_epsilon = v.check_epsilon(target_epsilon, "target_epsilon")
  target_delta = v.check_delta(target_delta, "target_delta")
  _check_sgd(1.0, sampling_prob, steps)
  v.check_choice(accountant, "accountant", ACCOUNTANTS)
  upper = 1e4
  if dpsgd_epsilon(upper, sampling_prob, steps, target_delta, accountant=accountant) > \
      target_epsilon:
    raise ValueError(f"no noise_multiplier <= {upper:g} reaches target_epsilon="
                     f"{target_epsilon} at target_delta={target_delta}; lower the number of "
                     "steps or the sampling probability.")
  sigma = dp_accounting.calibrate_dp_mechanism(
      lambda: _accountant(accountant),
      lambda s: dpsgd_event(s, sampling_prob, steps),
      target_epsilon, target_delta,
      bracket_interval=dp_accounting.ExplicitBracketInterval(1e-3, upper), tol=1e-4)
  # calibrate_dp_mechanism returns a σ meeting the target; assert it (cheap) rather than trust.
  while dpsgd_epsilon(sigma, sampling_prob, steps, target_delta,
                      accountant=accountant) > target_epsilon:
    sigma *= 1.0 + 1e-4
  return float(sigma)


def compose_basic(*spends: PrivacySpend) -> PrivacySpend:
  """Basic sequential composition: ``(Σ ε_i, Σ δ_i)``; all spends must share one relation.

  Valid for adaptively chosen mechanisms (ALGORITHMS.md §1.8).
  """
  if not spends:
    raise ValueError("compose_basic needs at least one PrivacySpend.")
  relations = {s.neighbouring for s in spends}
  if len(relations) != 1:
    raise ValueError(f"cannot compose guarantees stated under different neighbouring relations "
                     f"{sorted(relations)}; convert first (replace_one_from_add_remove).")
  return PrivacySpend(sum(s.epsilon for s in spends), sum(s.delta for s in spends),
                      relations.pop())


def replace_one_from_add_remove(epsilon: float, delta: float) -> PrivacySpend:
  """(ε, δ) under add/remove-one ⇒ ``(2ε, (1 + e^ε) δ)`` under replace-one (§1.8, group of 2)."""
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  return PrivacySpend(2.0 * epsilon, (1.0 + math.exp(epsilon)) * delta, REPLACE_ONE)


class DPSGDBudget(NamedTuple):
  """How a total (ε, δ) is split between a private subspace and the DP-SGD steps.

  ``epsilon``/``delta`` are the composed totals, ``(subspace_epsilon + sgd_epsilon,
  subspace_delta + sgd_delta)``, under ``neighbouring`` (add/remove-one).
  """
  noise_multiplier: float
  sampling_prob: float
  steps: int
  subspace_epsilon: float
  subspace_delta: float
  sgd_epsilon: float
  sgd_delta: float
  epsilon: float
  delta: float
  neighbouring: str


def plan_dpsgd_budget(epsilon: float, delta: float, *, sampling_prob: float, steps: int,
                      subspace_epsilon: float = 0.0, subspace_delta: float = 0.0,
                      accountant: str = "rdp") -> DPSGDBudget:
  """Calibrates DP-SGD to what is left of ``(epsilon, delta)`` after a private subspace.

  The subspace step (approximate DP, e.g. DPASE) spends ``(ε_s, δ_s)``; the SGD steps get
  ``δ_sgd = δ − δ_s`` and a noise multiplier σ with ``ε_sgd(δ_sgd) ≤ ε − ε_s`` by the accountant.
  The total is ``(ε_s + ε_sgd, δ_s + δ_sgd) ≤ (ε, δ)`` by basic composition (the subspace is
  learned from the same rows and used adaptively), under add/remove-one.

  Raises:
    ValueError: ε ≤ 0, δ ∉ (0, 1), ``ε_s ∉ [0, ε)``, ``δ_s ∉ [0, δ)``, bad q or steps.
  """
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  subspace_epsilon = v.check_positive(subspace_epsilon, "subspace_epsilon", allow_zero=True)
  subspace_delta = v.check_positive(subspace_delta, "subspace_delta", allow_zero=True)
  if subspace_epsilon >= epsilon:
    raise ValueError(f"subspace_epsilon must lie in [0, epsilon={epsilon}), got "
                     f"{subspace_epsilon}.")
  if subspace_delta >= delta:
    raise ValueError(f"subspace_delta must lie in [0, delta={delta}), got {subspace_delta}.")
  sgd_delta = delta - subspace_delta
  sigma = calibrate_noise_multiplier(epsilon - subspace_epsilon, sgd_delta, sampling_prob, steps,
                                     accountant=accountant)
  sgd_epsilon = dpsgd_epsilon(sigma, sampling_prob, steps, sgd_delta, accountant=accountant)
  total = compose_basic(PrivacySpend(subspace_epsilon, subspace_delta, ADD_REMOVE),
                        PrivacySpend(sgd_epsilon, sgd_delta, ADD_REMOVE))
  return DPSGDBudget(sigma, float(sampling_prob), int(steps), subspace_epsilon, subspace_delta,
                     sgd_epsilon, sgd_delta, total.epsilon, total.delta, ADD_REMOVE)


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

      ledger = PrivacyLedger(epsilon=2.0, delta=1e-5, neighbouring="add_remove")
      ledger.record_approx_dp(0.5, 1e-6, label="dpase subspace")
      ledger.record_dpsgd(noise_multiplier=1.1, sampling_prob=0.01, steps=1000)
      ledger.spent  # PrivacySpend(epsilon=..., delta=1e-05, neighbouring='add_remove')
  """

  def __init__(self, epsilon: float, delta: float, *, neighbouring: str = ADD_REMOVE,
               accountant: str = "rdp"):
    self.epsilon = v.check_epsilon(epsilon)
    self.delta = v.check_delta(delta)
    self.neighbouring = v.check_choice(neighbouring, "neighbouring", (ADD_REMOVE, REPLACE_ONE))
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
                       neighbouring: str | None = None) -> PrivacySpend:
    """Records an (ε, δ)-DP release; raises :class:`BudgetExceededError` if over budget.

    ``neighbouring`` is the relation the release's guarantee holds under (default: the ledger's);
    it must match the ledger's.
    """
    epsilon = v.check_positive(epsilon, "epsilon", allow_zero=True)
    delta = v.check_positive(delta, "delta", allow_zero=True)
    self._check_relation(neighbouring)
    return self._add(LedgerEntry(label, "approx_dp", epsilon, delta, None))

  def record_event(self, event: dp_accounting.DpEvent, *, label: str = "",
                   neighbouring: str | None = None) -> PrivacySpend:
    """Records a release described by a ``dp_accounting`` event."""
    if not isinstance(event, dp_accounting.DpEvent):
      raise TypeError(f"event must be a dp_accounting.DpEvent, got {type(event).__name__}.")
    self._check_relation(neighbouring)
    return self._add(LedgerEntry(label, "dp_event", None, None, event))

  def record_dpsgd(self, *, noise_multiplier: float, sampling_prob: float, steps: int,
                   label: str = "dp-sgd") -> PrivacySpend:
    """Records Poisson-sampled DP-SGD steps (add/remove-one; refused by a replace-one ledger)."""
    return self.record_event(dpsgd_event(noise_multiplier, sampling_prob, steps), label=label,
                             neighbouring=ADD_REMOVE)

  def _check_relation(self, neighbouring):
    if neighbouring is not None and neighbouring != self.neighbouring:
      raise ValueError(f"this ledger composes guarantees under {self.neighbouring!r}; a release "
                       f"stated under {neighbouring!r} must be converted first.")

  def _add(self, entry: LedgerEntry) -> PrivacySpend:
    total = self._total(self._entries + [entry])
    if total.epsilon > self.epsilon * (1 + 1e-9) or total.delta > self.delta * (1 + 1e-9):
      raise BudgetExceededError(
          f"release {entry.label!r} refused: it would bring the total to "
          f"(ε={total.epsilon:.4g}, δ={total.delta:.3g}), over the budget "
          f"(ε={self.epsilon:.4g}, δ={self.delta:.3g}).")
    self._entries.append(entry)
    return total

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
