"""Privacy accounting on Google's ``dp_accounting`` (docs/algorithms.md §1.8, §6).

No RDP or PLD formula is written here: DP-SGD steps are described as ``dp_accounting`` events
(data, not code) and composed by its accountants. Approximate-DP steps that have no event of their
own (DPASE, the stability histogram) are composed with the SGD part by basic composition.

Neighboring relation: DP-SGD with Poisson sampling is accounted under **add/remove-one**
(``NeighboringRelation.ADD_OR_REMOVE_ONE``: datasets differ by adding or removing one row), the
only relation under which ``dp_accounting``'s RDP accountant supports ``PoissonSampledDpEvent``. DPASE run with
``partition="random_labels"`` is (ε, δ)-DP under add/remove-one as well, so a private gradient
subspace and the SGD steps compose under that single relation (docs/algorithms.md §6.2 route (c)).
:func:`replace_one_from_add_remove` converts a final (ε, δ) statement when replace-one
(``NeighboringRelation.REPLACE_ONE``: same n, one row changed) is needed. Never double an RDP
curve, and never use ``dp_accounting``'s ``REPLACE_SPECIAL`` as replace-one (it can understate ε by up to ≈ 2×).

References:
  Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
  Mironov, Talwar & Zhang, "Rényi Differential Privacy of the Sampled Gaussian Mechanism", 2019.
  Doroshenko et al., "Connect the Dots: Tighter Discrete Approximations of Privacy Loss
  Distributions", PETS 2022 (the PLD accountant).
  Google, ``dp_accounting`` (https://github.com/google/differential-privacy/tree/main/python).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import NamedTuple

import attr
import dp_accounting
import numpy as np
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax._core.deprecation import renamed_attribute

__all__ = ["DPSGDBudget", "EpsilonDeltaDpEvent", "HyperparameterTuning", "PrivacySpend",
           "analytic_gaussian_sigma", "calibrate_gaussian_composition",
           "calibrate_noise_multiplier", "classic_gaussian_sigma", "compose_basic",
           "compose_events", "dpsgd_budget", "dpsgd_epsilon", "dpsgd_event", "dpsgd_plan_event",
           "event_epsilon", "event_neighboring",
           "gaussian_composition_epsilon", "plan_dpsgd_budget", "rdp_gaussian_sigma",
           "release_event", "split_event", "tuning_event", "tuning_repetitions"]

ACCOUNTANTS = ("rdp", "pld")

# σ is searched in [_SIGMA_FLOOR, _SIGMA_CEILING]. Below 0.1 DP-SGD offers no meaningful privacy
# (ε in the tens at best), and the PLD accountant's memory grows without bound as σ → 0.
_SIGMA_FLOOR = 0.1
_SIGMA_CEILING = 1e4


class PrivacySpend(NamedTuple):
  """An (ε, δ) guarantee and the neighboring relation it holds under.

  Attributes:
    epsilon: ε ≥ 0 in nats.
    delta: δ ∈ [0, 1].
    neighboring: a ``dp_accounting.NeighboringRelation``.
  """
  epsilon: float
  delta: float
  neighboring: NeighboringRelation

  neighbouring = renamed_attribute("neighboring", "neighbouring")


class _DropRdpOrderWarnings(logging.Filter):
  """Drops dp_accounting's per-order RDP warnings ("Excluding this order …"): an order whose
  series does not converge is left out, and ε stays an upper bound over the remaining orders."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.pathname.endswith("rdp_privacy_accountant.py")


@contextlib.contextmanager
def quiet_rdp_logs():
  """Context manager (and decorator) silencing dp_accounting's per-order RDP log lines.

  Every dpjax entry point that runs the RDP accountant is wrapped in it, so a training loop's
  output stays readable; other absl log records pass. Adds a filter to the ``absl`` logger for
  the duration only.
  """
  logger = logging.getLogger("absl")
  drop = _DropRdpOrderWarnings()
  logger.addFilter(drop)
  try:
    yield
  finally:
    logger.removeFilter(drop)


def make_accountant(name: str, neighboring: NeighboringRelation = NeighboringRelation.
                    ADD_OR_REMOVE_ONE) -> dp_accounting.PrivacyAccountant:
  """A fresh ``dp_accounting`` accountant: ``"rdp"`` (RDP) or ``"pld"`` (PLD), under
  ``neighboring`` (default add/remove-one).

  Raises:
    ValueError: another name.
  """
  v.check_choice(name, "accountant", ACCOUNTANTS)
  if name == "rdp":
    return dp_accounting.rdp.RdpAccountant(neighboring_relation=neighboring)
  return dp_accounting.pld.PLDAccountant(neighboring_relation=neighboring)


def event_neighboring(event: dp_accounting.DpEvent) -> NeighboringRelation:
  """The relation an event is composed under: ``REPLACE_ONE`` when it holds a fixed-size sample
  (``SampledWithoutReplacementDpEvent``, which ``dp_accounting`` composes under replace-one
  only: :class:`dpjax.sgd.sampling.FixedSizeSampling`), ``ADD_OR_REMOVE_ONE`` otherwise. The
  event is the one source of the relation: every ε of it is computed under this relation."""
  stack = [event]
  while stack:
    e = stack.pop()
    if isinstance(e, dp_accounting.SampledWithoutReplacementDpEvent):
      return NeighboringRelation.REPLACE_ONE
    if isinstance(e, dp_accounting.ComposedDpEvent):
      stack.extend(e.events)
    elif hasattr(e, "event") and isinstance(e.event, dp_accounting.DpEvent):
      stack.append(e.event)
  return NeighboringRelation.ADD_OR_REMOVE_ONE


def _accountant(name: str, event: dp_accounting.DpEvent) -> dp_accounting.PrivacyAccountant:
  """A fresh accountant for ``event``, under the event's relation (:func:`event_neighboring`)."""
  return make_accountant(name, event_neighboring(event))


# --------------------------------------------------------------------------------------------
# Every release is a dp_accounting event.
# --------------------------------------------------------------------------------------------

@attr.s(frozen=True, slots=True, auto_attribs=True)
class EpsilonDeltaDpEvent(dp_accounting.DpEvent):
  """A release known only by its (ε, δ)-DP guarantee (DPASE, the stability histogram, a
  float-safe discrete Gaussian stated by its (ε, δ), ...).

  ``dp_accounting`` has no event for this: its accountants raise ``UnsupportedEventError`` on it.
  dpjax composes it with everything else by basic composition (:func:`event_epsilon`,
  :class:`dpjax.ledger.PrivacyLedger`): the ε of such events add up, their δ come off the δ left
  to the accountant's events (Dwork & Roth 2014, Thm 3.16; docs/algorithms.md §1.8).

  Attributes:
    epsilon: ε ≥ 0 (nats).
    delta: δ ∈ [0, 1).
  """
  epsilon: float
  delta: float


def release_event(epsilon: float, delta: float) -> dp_accounting.DpEvent:
  """The event of a release known by its (ε, δ) only: ``NoOpDpEvent`` for (0, 0) (public data
  alone), ``NonPrivateDpEvent`` for ε = ∞, else :class:`EpsilonDeltaDpEvent`."""
  epsilon = float(epsilon)
  delta = float(delta)
  if math.isinf(epsilon) or delta >= 1.0:
    return dp_accounting.NonPrivateDpEvent()
  if epsilon == 0.0 and delta == 0.0:
    return dp_accounting.NoOpDpEvent()
  return EpsilonDeltaDpEvent(v.check_positive(epsilon, "epsilon", allow_zero=True),
                             v.check_probability(delta, "delta", open_low=False))


def compose_events(*events: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
  """``ComposedDpEvent`` of ``events`` (adaptive composition), as a hashable tuple of events.

  Raises:
    TypeError: an argument that is not a ``dp_accounting.DpEvent``.
  """
  for event in events:
    if not isinstance(event, dp_accounting.DpEvent):
      raise TypeError(f"events must be dp_accounting.DpEvent, got {type(event).__name__}.")
  return dp_accounting.ComposedDpEvent(tuple(events))


class EventParts(NamedTuple):
  """An event split for composition: the basic-composition part and the accountant's part.

  Attributes:
    epsilon, delta: the sums of the :class:`EpsilonDeltaDpEvent` leaves (ε = ∞ when a
      ``NonPrivateDpEvent`` is among them).
    accountable: the other leaves, for a ``dp_accounting`` accountant (a tuple).
  """
  epsilon: float
  delta: float
  accountable: tuple


def split_event(event: dp_accounting.DpEvent) -> EventParts:
  """Splits ``event`` into its (ε, δ) leaves and its accountant leaves (:class:`EventParts`).

  ``ComposedDpEvent`` and ``SelfComposedDpEvent`` are flattened (an (ε, δ) leaf repeated c times
  counts c times); ``NoOpDpEvent`` leaves are dropped; a ``NonPrivateDpEvent`` makes ε = ∞. An
  event that contains an :class:`EpsilonDeltaDpEvent` inside sampling or tuning cannot be split
  (no amplification of an (ε, δ) guarantee is applied here): ``ValueError``.
  """
  eps, delta, accountable = [0.0], [0.0], []

  def walk(e, count):
    if isinstance(e, dp_accounting.ComposedDpEvent):
      for child in e.events:
        walk(child, count)
    elif isinstance(e, dp_accounting.SelfComposedDpEvent) and _has_epsilon_delta(e.event):
      walk(e.event, count * e.count)
    elif isinstance(e, EpsilonDeltaDpEvent):
      eps[0] += count * e.epsilon
      delta[0] += count * e.delta
    elif isinstance(e, dp_accounting.NoOpDpEvent):
      pass
    elif isinstance(e, dp_accounting.NonPrivateDpEvent):
      eps[0] = math.inf
    elif _has_epsilon_delta(e):
      raise ValueError(f"cannot compose {type(e).__name__} around an (ε, δ) release: dpjax "
                       "applies no amplification to an (ε, δ) guarantee.")
    else:
      accountable.extend([e] * count if count > 1 else [e])

  if not isinstance(event, dp_accounting.DpEvent):
    raise TypeError(f"event must be a dp_accounting.DpEvent, got {type(event).__name__}.")
  walk(event, 1)
  return EventParts(eps[0], delta[0], tuple(accountable))


def _has_epsilon_delta(event) -> bool:
  if isinstance(event, EpsilonDeltaDpEvent):
    return True
  return any(_has_epsilon_delta(x) for x in attr.astuple(event, recurse=False)
             if isinstance(x, dp_accounting.DpEvent)) or any(
                 _has_epsilon_delta(x) for x in getattr(event, "events", ()))


@quiet_rdp_logs()
def event_epsilon(event: dp_accounting.DpEvent, delta: float, *,
                  accountant: str = "pld") -> float:
  """ε at total ``delta`` of any event, (ε, δ) leaves included (:func:`split_event`).

  ``ε = Σ ε_i + ε_accountant(δ − Σ δ_i)`` (basic composition of the (ε, δ) leaves with the
  accountant's composition of the rest); ``Σ ε_i`` alone when there is no other leaf; ∞ when
  ``Σ δ_i ≥ δ`` or a leaf is not private. The neighboring relation is the one the events are
  stated under (:func:`event_neighboring`: add/remove-one for the accountants' Poisson-sampled
  events, replace-one for a fixed-size sample).

  Raises:
    ValueError: δ ∉ (0, 1), an unknown accountant, or an event the accountant cannot compose.
  """
  delta = v.check_delta(delta)
  parts = split_event(event)
  if not parts.accountable:
    return parts.epsilon if parts.delta <= delta else math.inf
  left = delta - parts.delta
  if left <= 0 or math.isinf(parts.epsilon):
    return math.inf
  composed = dp_accounting.ComposedDpEvent(list(parts.accountable))
  acc = _accountant(accountant, composed)
  if not acc.supports(composed):
    raise ValueError(f"the {accountant!r} accountant cannot compose {composed!r}; use the "
                     "other accountant, or state the release by its (ε, δ).")
  return parts.epsilon + float(acc.compose(composed).get_epsilon(left))


# --------------------------------------------------------------------------------------------
# Gaussian σ for a target (ε, δ): one release (analytic, classic, Rényi).
# --------------------------------------------------------------------------------------------

def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
  """The smallest σ for which ``N(0, σ²)`` noise is (ε, δ)-DP at ℓ2-sensitivity Δ.

  Solves Balle & Wang's exact condition (2018, Thm 8)

    ``Φ(Δ/(2σ) − εσ/Δ) − e^ε Φ(−Δ/(2σ) − εσ/Δ) ≤ δ``

  with ``dp_accounting``'s solver on the host in float64 (the left side decreases in σ):
  ``dp_accounting.get_sigma_gaussian`` (dp-accounting ≥ 0.6: Brent's method on the condition in
  log space with SciPy's log Φ, run to its relative tolerance of 4 ulps, so σ is the root to
  float64 precision, and σ·(1 − 1e-12) does not meet the condition for ordinary ε, δ); on
  dp-accounting 0.5, which lacks it, ``GaussianPrivacyLoss.from_privacy_guarantee`` (bisection on
  the same hockey-stick divergence, returning the end that meets it, within 1e-7 of the root in
  σ/Δ). Valid for every ε > 0, unlike the classic calibration.

  Args:
    epsilon: ``ε > 0``.
    delta: ``δ ∈ (0, 1)``.
    sensitivity: ℓ2-sensitivity ``Δ > 0`` (default 1).

  Returns:
    σ as a Python float (``Δ`` times the σ of Δ = 1: the condition depends on σ/Δ only).

  Raises:
    ValueError: ε not finite and > 0, δ ∉ (0, 1), Δ not finite and > 0 (NaN included), σ
      overflows float64, or the solver fails in float64 (ε ≳ 1e155).
    TypeError: a non-real argument.

  References:
    docs/algorithms.md §1.2; Balle & Wang, "Improving the Gaussian mechanism for differential
    privacy: analytical calibration and optimal denoising", ICML 2018, Thm 8.
  """
  # The condition depends on σ/Δ only: solve at Δ = 1 and scale, so that tiny or huge Δ can
  # neither underflow the search nor overflow it.
  return _scaled_sigma(_analytic_unit_sigma, epsilon, delta, sensitivity)


def _scaled_sigma(unit_sigma, epsilon, delta, sensitivity) -> float:
  """``Δ · unit_sigma(ε, δ)`` after validating the arguments; raises if it overflows."""
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  sensitivity = v.check_positive(sensitivity, "sensitivity")
  sigma = sensitivity * unit_sigma(epsilon, delta)
  if not math.isfinite(sigma):
    raise ValueError(f"the Gaussian noise std for sensitivity={sensitivity!r} overflows float64.")
  return sigma


@functools.lru_cache(maxsize=512)
def _analytic_unit_sigma(epsilon: float, delta: float) -> float:
  """:func:`analytic_gaussian_sigma` at Δ = 1, by ``dp_accounting`` (cached per ``(ε, δ)``)."""
  solve = getattr(dp_accounting, "get_sigma_gaussian", None)          # dp-accounting >= 0.6
  try:
    with np.errstate(all="ignore"):     # log δ = −inf where the two terms round equal: meant
      if solve is not None:
        # ``tol`` is brentq's absolute tolerance: a negligible one leaves its relative one in
        # charge (4 ulps), whatever the scale of σ.
        sigma = solve(epsilon, delta, tol=1e-300)
      else:
        guarantee = dp_accounting.pld.common.DifferentialPrivacyParameters(epsilon, delta)
        loss = dp_accounting.pld.privacy_loss_mechanism.GaussianPrivacyLoss
        sigma = loss.from_privacy_guarantee(guarantee).standard_deviation
  except (ArithmeticError, ValueError, RuntimeError) as err:
    raise ValueError(f"dp_accounting cannot calibrate the analytic Gaussian at "
                     f"epsilon={epsilon!r}, delta={delta!r} in float64.") from err
  return float(sigma)


def classic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
  """``σ = Δ sqrt(2 ln(1.25/δ))/ε``, the classic calibration (Dwork–Roth Thm A.1), for ε < 1.

  Args:
    epsilon: ``ε ∈ (0, 1)``.
    delta: ``δ ∈ (0, 1)``.
    sensitivity: ℓ2-sensitivity ``Δ > 0`` (default 1).

  Returns:
    σ as a Python float (always larger than :func:`analytic_gaussian_sigma`).

  Raises:
    ValueError: ε ≥ 1 (the classic bound is not valid there; use the analytic calibration), or
      bad ε, δ, Δ.

  References:
    docs/algorithms.md §1.2; Dwork & Roth (2014), Thm A.1.
  """
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  sensitivity = v.check_positive(sensitivity, "sensitivity")
  if epsilon >= 1.0:
    raise ValueError(f"the classic Gaussian calibration needs epsilon < 1, got "
                     f"epsilon={epsilon}; use calibration='analytic'.")
  return sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def rdp_gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
  """The smallest σ for which the Gaussian mechanism's Rényi DP implies (ε, δ)-DP.

  A Gaussian mechanism with noise multiplier ``z = σ/Δ`` is ``(α, α/(2z²))``-RDP for every
  α > 1 (ρ-zCDP with ρ = 1/(2z²)); ``dp_accounting``'s RDP accountant converts that to (ε, δ)
  (the conversion of Canonne, Kamath & Steinke 2020, Prop. 12) and
  ``dp_accounting.calibrate_dp_mechanism`` finds the smallest z. This is the calibration that is
  valid for the **discrete** Gaussian too (its Rényi divergences are at most the continuous
  ones, CKS 2020 Thm 4), so :func:`gaussian_mechanism` uses it with ``secure=True``. It costs
  5–15% more σ than :func:`analytic_gaussian_sigma` (e.g. 4.05 vs 3.73 at ε = 1, δ = 1e-5).

  Args:
    epsilon: ``ε > 0``.
    delta: ``δ ∈ (0, 1)``.
    sensitivity: ℓ2-sensitivity ``Δ > 0`` (default 1).

  Returns:
    σ as a Python float (results are cached per ``(ε, δ)``).

  Raises:
    ValueError: bad ε, δ or Δ, or no multiplier in ``[1e-3, 1e7]`` reaches (ε, δ).
    TypeError: a non-real argument.

  References:
    Mironov, "Rényi differential privacy", CSF 2017; Bun & Steinke, "Concentrated differential
    privacy", TCC 2016; Canonne, Kamath & Steinke, NeurIPS 2020, Prop. 12 and Thm 4.
  """
  return _scaled_sigma(_rdp_noise_multiplier, epsilon, delta, sensitivity)


@functools.lru_cache(maxsize=512)
@quiet_rdp_logs()
def _rdp_noise_multiplier(epsilon: float, delta: float) -> float:
  def make_event(z):
    return dp_accounting.GaussianDpEvent(z)

  low, high = 1e-3, 1e7
  epsilon_at = lambda z: dp_accounting.rdp.RdpAccountant().compose(  # noqa: E731
      make_event(z)).get_epsilon(delta)
  if epsilon_at(high) > epsilon:
    raise ValueError(f"no Gaussian noise multiplier up to 1e7 reaches epsilon={epsilon}, "
                     f"delta={delta}.")
  if epsilon_at(low) <= epsilon:
    return low
  z = float(dp_accounting.calibrate_dp_mechanism(
      dp_accounting.rdp.RdpAccountant, make_event, epsilon, delta,
      bracket_interval=dp_accounting.ExplicitBracketInterval(low, high), tol=1e-9))
  while epsilon_at(z) > epsilon:             # calibrate_dp_mechanism returns a valid end; check
    z = math.nextafter(z, math.inf) * (1.0 + 1e-12)
  return z



def _check_sgd(noise_multiplier, sampling_prob, steps) -> tuple[float, float, int]:
  noise_multiplier = v.check_positive(noise_multiplier, "noise_multiplier")
  sampling_prob = v.check_probability(sampling_prob, "sampling_prob")
  steps = v.check_int(steps, "steps", low=1)
  return noise_multiplier, sampling_prob, steps


def dpsgd_event(noise_multiplier: float, sampling_prob: float, steps: int, *,
                batch_selection=None) -> dp_accounting.DpEvent:
  """The DP-SGD event: ``steps`` self-compositions of a sampled Gaussian mechanism.

  ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), T)``: each step includes
  every example independently with probability q and releases the clipped sum (ℓ2-sensitivity
  C under add/remove-one) plus ``N(0, σ²C²)`` noise per coordinate. Meaningful under
  add/remove-one (``NeighboringRelation.ADD_OR_REMOVE_ONE``). With ``batch_selection``, its
  ``dp_event(GaussianDpEvent(σ))`` is the step instead (the batch selection states its own piece
  of the argument; :class:`dpjax.sgd.sampling.PoissonSampling`'s is the event above), composed
  ``batch_selection.compositions(T)`` times where it has that method (cyclic Poisson sampling:
  ``⌈T/b⌉``), so every calibration and every plan built from it follows the scheme by itself.

  Args:
    noise_multiplier: σ > 0, the Gaussian noise std divided by the clip norm C.
    sampling_prob: q ∈ (0, 1], each example's inclusion probability per step (must be the
      ``batch_selection``'s when both are given).
    steps: number of steps T ≥ 1.
    batch_selection: optional object with ``sampling_prob`` and ``dp_event(step_event)`` (and
      optionally ``compositions(steps)``).

  Returns:
    A ``dp_accounting.DpEvent``.

  Raises:
    ValueError: σ ≤ 0, q ∉ (0, 1], T < 1.
    TypeError: ``steps`` not an integer, or a non-numeric argument.

  References:
    Abadi et al., CCS 2016; Mironov, Talwar & Zhang 2019.
  """
  noise_multiplier, sampling_prob, steps = _check_sgd(noise_multiplier, sampling_prob, steps)
  gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
  if batch_selection is None:
    step = dp_accounting.PoissonSampledDpEvent(sampling_prob, gaussian)
  else:
    _check_selection(batch_selection, sampling_prob)
    step = batch_selection.dp_event(gaussian)
    compositions = getattr(batch_selection, "compositions", None)
    if compositions is not None:          # a scheme whose examples take part in fewer rounds
      steps = compositions(steps)
  return dp_accounting.SelfComposedDpEvent(step, steps)


def _check_selection(batch_selection, sampling_prob: float) -> None:
  """A batch selection must state its event and agree with the q it is accounted at."""
  if not callable(getattr(batch_selection, "dp_event", None)):
    raise TypeError("batch_selection must have a dp_event(step_event) method (e.g. "
                    f"dpjax.sgd.sampling.PoissonSampling), got {type(batch_selection).__name__}.")
  if float(batch_selection.sampling_prob) != float(sampling_prob):
    raise ValueError(f"sampling_prob={sampling_prob} is not the batch selection's "
                     f"{batch_selection.sampling_prob}.")


def _selection_prob(sampling_prob, batch_selection) -> float:
  """q from ``sampling_prob`` or the batch selection (which must agree when both are given)."""
  if batch_selection is None:
    if sampling_prob is None:
      raise ValueError("give sampling_prob or batch_selection.")
    return sampling_prob
  if sampling_prob is None:
    sampling_prob = batch_selection.sampling_prob
  _check_selection(batch_selection, sampling_prob)
  return sampling_prob


@quiet_rdp_logs()
def dpsgd_epsilon(noise_multiplier: float, sampling_prob: float, steps: int, delta: float, *,
                  accountant: str = "rdp", tuning: HyperparameterTuning | None = None,
                  batch_selection=None) -> float:
  """ε of T steps of Poisson-sampled DP-SGD at ``delta``, under add/remove-one.

  >>> import dpjax
  >>> round(dpjax.accounting.dpsgd_epsilon(1.1, 0.01, 1000, 1e-5), 2)    # σ, q, T, δ (RDP)
  1.71

  The figure is exactly ``dp_accounting``'s: the RDP accountant (fast; an upper bound through the
  [BBGHS20] conversion) or the PLD accountant (tighter, slower, memory grows as σ shrinks). With
  ``tuning``, ε of the best of a random number of such runs (:func:`tuning_event`; RDP only).

  Args:
    noise_multiplier: σ > 0.
    sampling_prob: q ∈ (0, 1].
    steps: T ≥ 1.
    delta: δ ∈ (0, 1).
    accountant: "rdp" or "pld".
    tuning: optional :class:`HyperparameterTuning` (needs ``accountant="rdp"``).
    batch_selection: optional batch selection stating each step's event (:func:`dpsgd_event`).

  Returns:
    ε ≥ 0 (nats) as a Python float; the run (with ``tuning``: the tuning's selected run) is
    (ε, δ)-DP under add/remove-one.

  Raises:
    ValueError: σ ≤ 0, q ∉ (0, 1], T < 1, δ ∉ (0, 1), unknown accountant, ``tuning`` with
      ``accountant="pld"`` or with a bad mean or shape.
    TypeError: non-numeric arguments, non-integer ``steps``, ``tuning`` of another type.

  References:
    Mironov, Talwar & Zhang 2019 (RDP of the sampled Gaussian mechanism); Balle et al.,
    "Hypothesis Testing Interpretations and Rényi DP", AISTATS 2020 (conversion);
    Doroshenko et al., PETS 2022 (PLD); Papernot & Steinke, ICLR 2022 (tuning).
  """
  delta = v.check_delta(delta)
  v.check_choice(accountant, "accountant", ACCOUNTANTS)
  tuning = _check_tuning_accountant(tuning, accountant)
  event = dpsgd_event(noise_multiplier, sampling_prob, steps, batch_selection=batch_selection)
  if tuning is not None:
    event = tuning_event(event, tuning)
  return float(_accountant(accountant, event).compose(event).get_epsilon(delta))


# --------------------------------------------------------------------------------------------
# Private hyperparameter tuning (Papernot & Steinke 2022): repeat a random number of times,
# release the best run.
# --------------------------------------------------------------------------------------------


class HyperparameterTuning(NamedTuple):
  """Papernot–Steinke random stopping: how many runs a private tuning makes.

  The tuning draws ``K`` from the distribution below (:func:`tuning_repetitions`), makes ``K``
  independent runs of one DP mechanism on the same data — each with hyperparameters drawn
  afresh from a PUBLIC distribution (e.g. uniform over a grid of learning rates) and scored by a
  function of the run's own output and of data the guarantee does not cover (or of a DP score
  the run releases) — and releases only the best run. ``K`` must be drawn, not chosen: a fixed
  number of runs with selection is not covered. The whole tuning is then as private as
  :func:`tuning_event` says: with the RDP accountant, about 2–3 times one run's ε for a mean of
  a few runs, far less than composing the runs.

  Attributes:
    mean: E[K] ≥ 1, the mean number of runs.
    shape: η ≥ 0, the law of K: 0 logarithmic (the default: ``P(K = k) ∝ (1 − γ)^k/k``,
      k ≥ 1), 1 geometric (k ≥ 1), ``math.inf`` Poisson (``K = 0`` has probability
      ``e^{−mean}``: nothing is released, ⊥), any other η > 0 the truncated negative binomial
      ``P(K = k) ∝ C(k + η − 1, k)(1 − γ)^k``, k ≥ 1. γ ∈ (0, 1) is set by the mean.
  """
  mean: float
  shape: float = 0.0


def check_tuning(tuning) -> HyperparameterTuning:
  """Validates a :class:`HyperparameterTuning` (mean finite and ≥ 1; shape ≥ 0 or inf)."""
  if not isinstance(tuning, HyperparameterTuning):
    raise TypeError(f"tuning must be a dpjax.accounting.HyperparameterTuning, got "
                    f"{type(tuning).__name__}.")
  mean = v.check_positive(tuning.mean, "tuning.mean")
  if mean < 1.0:
    raise ValueError(f"tuning.mean must be >= 1 (runs), got {tuning.mean!r}.")
  shape = float(tuning.shape)
  if math.isnan(shape) or shape < 0.0:
    raise ValueError(f"tuning.shape must be >= 0 (0 logarithmic, 1 geometric, inf Poisson), "
                     f"got {tuning.shape!r}.")
  if not math.isinf(shape) and mean == 1.0:
    raise ValueError("tuning.mean must exceed 1 for a truncated negative binomial (K ≥ 1 with "
                     "mean 1 is one run: no tuning).")
  return HyperparameterTuning(mean, shape)


def tuning_event(event: dp_accounting.DpEvent,
                 tuning: HyperparameterTuning) -> dp_accounting.DpEvent:
  """The event of a private tuning of ``event``: ``RepeatAndSelectDpEvent(event, mean, η)``.

  Papernot & Steinke (2022), Theorems 2 and 6: if one run is (λ, ε(λ))-RDP, the best of K runs
  with K drawn from :class:`HyperparameterTuning`'s law is RDP with the curve
  ``dp_accounting``'s RDP accountant computes for this event (it is the only accountant that
  supports it). The neighboring relation is the run's.

  Raises:
    TypeError / ValueError: as :func:`check_tuning`; ``event`` not a ``DpEvent``.

  References:
    Papernot & Steinke, "Hyperparameter tuning with Rényi differential privacy", ICLR 2022.
  """
  if not isinstance(event, dp_accounting.DpEvent):
    raise TypeError(f"event must be a dp_accounting.DpEvent, got {type(event).__name__}.")
  tuning = check_tuning(tuning)
  return dp_accounting.dp_event.RepeatAndSelectDpEvent(event, tuning.mean, tuning.shape)


def tuning_gamma(tuning: HyperparameterTuning) -> float | None:
  """γ ∈ (0, 1) of the truncated negative binomial with the tuning's mean (None for Poisson).

  The mean of ``P(K = k) ∝ C(k + η − 1, k)(1 − γ)^k`` on k ≥ 1 is ``η(1 − γ)/(γ(1 − γ^η))``
  for η > 0 and ``(1 − γ)/(γ ln(1/γ))`` for η = 0; both fall from ∞ to 1 as γ rises from 0 to 1,
  so the root is found by bisection on ``ln γ`` (host, float64).
  """
  tuning = check_tuning(tuning)
  eta = tuning.shape
  if math.isinf(eta):
    return None

  def mean_at(log_gamma: float) -> float:
    gamma = math.exp(log_gamma)
    if eta == 0.0:
      return -math.expm1(log_gamma) / (gamma * -log_gamma)
    return eta * -math.expm1(log_gamma) / (gamma * -math.expm1(eta * log_gamma))

  lo, hi = -700.0, -1e-12                      # mean_at(lo) is huge, mean_at(hi) is ~1
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if mean_at(mid) > tuning.mean else (lo, mid)
  return math.exp(0.5 * (lo + hi))


def tuning_repetitions(key, tuning: HyperparameterTuning) -> int:
  """Draws the number of runs K of a private tuning (host, NumPy seeded from ``key``).

  Poisson: ``Generator.poisson(mean)`` (0 possible: release ⊥). Logarithmic (η = 0):
  ``Generator.logseries(1 − γ)``. Truncated negative binomial (η > 0, geometric at η = 1):
  ``Generator.negative_binomial(η, γ)`` (``P(k) = C(k + η − 1, k) γ^η (1 − γ)^k``) redrawn
  while 0 — exactly the law conditioned on K ≥ 1. γ from :func:`tuning_gamma`.

  Args:
    key: a concrete PRNG key, owned by this draw (derive it by one split from the tuning's key).
    tuning: the :class:`HyperparameterTuning`.

  Returns:
    K as a Python int (≥ 1 unless Poisson).

  Raises:
    TypeError / ValueError: a bad key or tuning.
  """
  from dpjax._host import host_rng        # pylint: disable=import-outside-toplevel
  v.check_key(key)
  tuning = check_tuning(tuning)
  rng = host_rng(key)
  if math.isinf(tuning.shape):
    return int(rng.poisson(tuning.mean))
  gamma = tuning_gamma(tuning)
  if tuning.shape == 0.0:
    return int(rng.logseries(1.0 - gamma))
  while True:
    k = int(rng.negative_binomial(tuning.shape, gamma))
    if k >= 1:
      return k


def _check_tuning_accountant(tuning, accountant: str) -> HyperparameterTuning | None:
  if tuning is None:
    return None
  tuning = check_tuning(tuning)
  if accountant != "rdp":
    raise ValueError("tuning needs accountant='rdp': only dp_accounting's RDP accountant "
                     f"composes a RepeatAndSelectDpEvent, got accountant={accountant!r}.")
  return tuning


@quiet_rdp_logs()
def calibrate_noise_multiplier(target_epsilon: float, target_delta: float, sampling_prob: float,
                               steps: int, *, accountant: str = "rdp",
                               tuning: HyperparameterTuning | None = None,
                               batch_selection=None) -> float:
  """The smallest noise multiplier σ whose DP-SGD run is (target_ε, target_δ)-DP (add/remove-one).

  ``dp_accounting.calibrate_dp_mechanism`` searches on the host, from a lower end where ε is
  above the target (``LowerEndpointAndGuess``: it widens the upper end while ε is still above,
  then runs Brent's method to a relative precision of about 1e-5): for "rdp" from σ = 0.1 with
  the guess σ = 1; for "pld" from the RDP-calibrated σ (an upper bound up to PLD's
  discretisation, the RDP figure being the looser one) with the lower end 1.25 times below it,
  or twice below it if that still meets the target — so the slow PLD accountant, whose memory
  grows without bound as σ → 0, never runs far below the answer. The returned σ always meets the
  target: ``calibrate_dp_mechanism`` re-evaluates its root and guarantees a non-positive ε-gap.
  Results are cached per ``(target_ε, target_δ, q, T, accountant, tuning)``. With ``tuning``
  the target is met by the best of the tuning's random number of runs (:func:`tuning_event`),
  each run at the returned σ.

  Edge cases: σ is searched in ``[0.1, 1e4]``. If σ = 0.1 already meets the target (a very
  loose ε), 0.1 is returned — a valid σ that is not the smallest one, since smaller σ offer no
  meaningful privacy. If σ = 1e4 does not, ``ValueError`` is raised. For "pld", if half the RDP
  σ already meets the target (never seen: PLD's σ was 2–15% below RDP's wherever measured),
  that valid σ is returned rather than searching lower.

  Args:
    target_epsilon: ε > 0.
    target_delta: δ ∈ (0, 1).
    sampling_prob: q ∈ (0, 1].
    steps: T ≥ 1.
    accountant: "rdp" or "pld".
    tuning: optional :class:`HyperparameterTuning` (needs ``accountant="rdp"``).
    batch_selection: optional batch selection stating each step's event (:func:`dpsgd_event`):
      σ is calibrated on the event it builds.

  Returns:
    σ as a Python float, with ``dpsgd_epsilon(σ, q, T, δ, accountant=..., tuning=...) ≤
    target_epsilon``.

  Raises:
    ValueError: bad targets, q, T, accountant or tuning (or tuning with "pld"), or no σ ≤ 1e4
      reaches the target.
    TypeError: non-numeric arguments, non-integer ``steps``.

  References:
    ``dp_accounting.calibrate_dp_mechanism``; Abadi et al., CCS 2016.
  """
  target_epsilon = v.check_epsilon(target_epsilon, "target_epsilon")
  target_delta = v.check_delta(target_delta, "target_delta")
  sampling_prob, steps = _check_sgd(1.0, sampling_prob, steps)[1:]
  v.check_choice(accountant, "accountant", ACCOUNTANTS)
  tuning = _check_tuning_accountant(tuning, accountant)
  if batch_selection is not None:
    _check_selection(batch_selection, sampling_prob)
  return _calibrate_noise_multiplier(target_epsilon, target_delta, sampling_prob, steps,
                                     accountant, tuning, batch_selection)


# A pure function of its arguments, and PLD's search takes seconds to minutes at small σ (each ε
# evaluation builds a PLD of up to ~10⁷ points): a run that trains several routes or seeds on one
# budget calibrates once.
@functools.lru_cache(maxsize=256)
def _calibrate_noise_multiplier(target_epsilon, target_delta, sampling_prob, steps, accountant,
                                tuning=None, batch_selection=None):
  def event_at(sigma: float) -> dp_accounting.DpEvent:
    event = dpsgd_event(sigma, sampling_prob, steps, batch_selection=batch_selection)
    return event if tuning is None else tuning_event(event, tuning)

  def eps_at(sigma: float) -> float:
    event = event_at(sigma)
    return float(_accountant(accountant, event).compose(event).get_epsilon(target_delta))

  if accountant == "pld":
    # RDP's ε is the looser bound, so PLD's σ lies below RDP's (2–15% below, where measured).
    # The PLD accountant's memory grows without bound as σ → 0: never search below half of it.
    try:
      guess = _calibrate_noise_multiplier(target_epsilon, target_delta, sampling_prob, steps,
                                          "rdp", None, batch_selection)
    except dp_accounting.UnsupportedEventError:
      # A selection RDP cannot compose (truncated Poisson): guess from the Poisson-sampled step
      # at the same q; the search below widens upward from it if the selection needs more σ.
      guess = _calibrate_noise_multiplier(target_epsilon, target_delta, sampling_prob, steps,
                                          "rdp", None, None)
    lower_ends = sorted({max(guess / 1.25, _SIGMA_FLOOR), max(guess / 2.0, _SIGMA_FLOOR)},
                        reverse=True)
  else:
    if eps_at(_SIGMA_CEILING) > target_epsilon:
      raise ValueError(f"no noise_multiplier <= {_SIGMA_CEILING:g} reaches "
                       f"target_epsilon={target_epsilon}; lower the number of steps or the "
                       "sampling probability, or raise the budget.")
    guess, lower_ends = 1.0, (_SIGMA_FLOOR,)
  upper = guess
  for low in lower_ends:
    if eps_at(low) > target_epsilon:
      break
    upper = low
  else:                                       # the lowest σ searched already meets the target
    return upper
  # dp_accounting widens [low, upper] upward while ε(upper) is still above the target (PLD's
  # discretisation can put it there), then runs Brent's method.
  relation = event_neighboring(event_at(1.0))
  return float(dp_accounting.calibrate_dp_mechanism(
      lambda: make_accountant(accountant, relation),
      event_at, target_epsilon, target_delta,
      bracket_interval=dp_accounting.LowerEndpointAndGuess(low, max(upper, 1.25 * low)),
      tol=1e-5 * low))


def compose_basic(*spends: PrivacySpend) -> PrivacySpend:
  """Basic sequential composition: ``(Σ ε_i, Σ δ_i)``, all under one neighboring relation.

  Valid for adaptively chosen mechanisms run on the same data (docs/algorithms.md §1.8). This is how
  an approximate-DP step with no ``dp_accounting`` event (DPASE) is composed with the DP-SGD
  steps' (ε, δ).

  Args:
    *spends: one or more :class:`PrivacySpend`.

  Returns:
    The composed :class:`PrivacySpend` under the shared relation.

  Raises:
    ValueError: no spends, or spends stated under different neighboring relations (convert
      first with :func:`replace_one_from_add_remove`).
    TypeError: an argument that is not a :class:`PrivacySpend`.

  References:
    Dwork & Roth, "The Algorithmic Foundations of Differential Privacy", 2014,
    Thm 3.16 (basic composition); docs/algorithms.md §1.8.
  """
  if not spends:
    raise ValueError("compose_basic needs at least one PrivacySpend.")
  for s in spends:
    if not isinstance(s, PrivacySpend):
      raise TypeError(f"spends must be PrivacySpend, got {type(s).__name__}.")
  relations = {s.neighboring for s in spends}
  if len(relations) != 1:
    raise ValueError(f"cannot compose guarantees stated under different neighboring relations "
                     f"{sorted(r.name for r in relations)}; convert first (replace_one_from_add_remove).")
  return PrivacySpend(math.fsum(s.epsilon for s in spends), math.fsum(s.delta for s in spends),
                      relations.pop())


def replace_one_from_add_remove(epsilon: float, delta: float) -> PrivacySpend:
  """Converts (ε, δ)-DP under add/remove-one to ``(2ε, (1 + e^ε) δ)``-DP under replace-one.

  A replacement is a removal followed by an addition: group privacy for a group of two
  (docs/algorithms.md §1.8). Apply it to the final (ε, δ), never to an RDP curve.

  Args:
    epsilon: ε ≥ 0 under add/remove-one.
    delta: δ ∈ [0, 1) under add/remove-one.

  Returns:
    :class:`PrivacySpend` under ``NeighboringRelation.REPLACE_ONE`` (δ capped at 1).

  Raises:
    ValueError: ε < 0 or not finite, δ ∉ [0, 1).

  References:
    Dwork & Roth, "The Algorithmic Foundations of Differential Privacy", 2014 (group privacy).
  """
  epsilon = v.check_positive(epsilon, "epsilon", allow_zero=True)
  delta = v.check_positive(delta, "delta", allow_zero=True)
  if delta >= 1.0:
    raise ValueError(f"delta must lie in [0, 1), got delta={delta!r}.")
  return PrivacySpend(2.0 * epsilon, min(1.0, (1.0 + math.exp(epsilon)) * delta),
                      NeighboringRelation.REPLACE_ONE)


class DPSGDBudget(NamedTuple):
  """How a total (ε, δ) is spent by a private subspace release and the DP-SGD steps.

  Attributes:
    noise_multiplier: σ calibrated for the SGD steps.
    sampling_prob: q, the Poisson sampling rate.
    steps: T.
    subspace_epsilon, subspace_delta: (ε_s, δ_s) of the subspace release's (ε, δ) leaves
      (:class:`EpsilonDeltaDpEvent`), composed by basic composition (0 if none).
    sgd_epsilon, sgd_delta: ε at δ_sgd = δ − δ_s of the accountant's part: the T steps composed
      with the subspace release's other leaves (e.g. a Gaussian Analyze Gauss release).
    epsilon, delta: the composed totals ``(ε_s + ε_sgd, δ_s + δ_sgd)``.
    neighboring: the relation of every figure above: ``ADD_OR_REMOVE_ONE``, or ``REPLACE_ONE``
      for fixed-size sampling (:func:`event_neighboring` of ``dp_event``).
    tuning: the :class:`HyperparameterTuning` σ was calibrated for (None: one run).
    subspace_event: the subspace release's ``dp_accounting`` event (``NoOpDpEvent`` if none).
    dp_event: the whole plan's event: the subspace release composed with the T steps (the
      tuning's event with ``tuning``; ``NonPrivateDpEvent`` for σ = 0).
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
  neighboring: NeighboringRelation
  tuning: HyperparameterTuning | None = None
  subspace_event: dp_accounting.DpEvent = dp_accounting.NoOpDpEvent()
  dp_event: dp_accounting.DpEvent | None = None

  neighbouring = renamed_attribute("neighboring", "neighbouring")


def subspace_release_event(subspace_epsilon: float = 0.0, subspace_delta: float = 0.0,
                           subspace_event: dp_accounting.DpEvent | None = None
                           ) -> dp_accounting.DpEvent:
  """The event of a private basis composed into DP-SGD: ``subspace_event`` (any
  ``dp_accounting`` event, e.g. a result's ``dp_event``), or the (ε_s, δ_s) given by number.

  Raises:
    ValueError: both forms given; bad ε_s, δ_s.
    TypeError: ``subspace_event`` not a ``dp_accounting.DpEvent``.
  """
  subspace_epsilon = v.check_positive(subspace_epsilon, "subspace_epsilon", allow_zero=True)
  subspace_delta = v.check_positive(subspace_delta, "subspace_delta", allow_zero=True)
  if subspace_event is None:
    return release_event(subspace_epsilon, subspace_delta)
  if subspace_epsilon > 0 or subspace_delta > 0:
    raise ValueError("give a private basis's cost once: subspace_event or "
                     "subspace_epsilon/subspace_delta, not both.")
  if not isinstance(subspace_event, dp_accounting.DpEvent):
    raise TypeError("subspace_event must be a dp_accounting.DpEvent (e.g. result.dp_event), got "
                    f"{type(subspace_event).__name__}.")
  return subspace_event


@quiet_rdp_logs()
def plan_dpsgd_budget(epsilon: float, delta: float, *, sampling_prob: float | None = None,
                      steps: int, subspace_epsilon: float = 0.0, subspace_delta: float = 0.0,
                      subspace_event: dp_accounting.DpEvent | None = None,
                      accountant: str = "rdp",
                      tuning: HyperparameterTuning | None = None,
                      batch_selection=None) -> DPSGDBudget:
  """Calibrates DP-SGD so that it and a private subspace release are together (ε, δ)-DP.

  >>> import dpjax
  >>> budget = dpjax.accounting.plan_dpsgd_budget(1.0, 1e-5, sampling_prob=0.01, steps=1000,
  ...                                             subspace_epsilon=0.2, subspace_delta=1e-6)
  >>> round(budget.noise_multiplier, 2), round(budget.sgd_epsilon, 2)    # σ, ε left to SGD
  (1.79, 0.8)

  The subspace release is an event (``subspace_event``, e.g. the ``dp_event`` of
  :func:`dpjax.sgd.private_input_basis`'s result) or an (ε_s, δ_s) given by number. Its (ε, δ)
  leaves (:class:`EpsilonDeltaDpEvent`: DPASE, a float-safe discrete Gaussian) take
  ``(ε_s, δ_s)`` off the total; its other leaves (a continuous Gaussian release) are composed
  with the T sampled steps by the accountant: σ is the smallest noise multiplier with
  ``ε_acc(δ − δ_s) ≤ ε − ε_s``. With no subspace this is plain DP-SGD calibration.

  Guarantee: the subspace release and the T steps are together (ε, δ)-DP under add/remove-one
  (replace-one for fixed-size batch selection, whose step event holds a fixed-size sample:
  ``DPSGDBudget.neighboring`` says which; adaptive composition: the subspace may come from the
  same rows). With ``tuning``, the best of
  the tuning's random number of runs is (ε, δ)-DP (:func:`tuning_event`, RDP; ``sgd_epsilon`` is
  then the tuning's ε) and a Gaussian subspace release is composed ONCE, outside the repetition:
  it must be made before the tuning and shared by all its runs — a release per run is not
  covered. Details: docs/algorithms.md §6.0, §6.1 (tuning), §6.2 (composition, route (c)).

  Args:
    epsilon: total ε > 0.
    delta: total δ ∈ (0, 1).
    sampling_prob: q ∈ (0, 1] (or None with ``batch_selection``).
    steps: T ≥ 1.
    subspace_epsilon: ε_s ∈ [0, ε) of a subspace release given by number.
    subspace_delta: δ_s ∈ [0, δ).
    subspace_event: the subspace release's event instead (stated under add/remove-one).
    accountant: "rdp" or "pld".
    tuning: optional :class:`HyperparameterTuning` (needs ``accountant="rdp"``; a subspace
      release only as a Gaussian event: an (ε_s, δ_s) release has no RDP curve).
    batch_selection: optional batch selection (``sampling_prob`` and ``dp_event(step_event)``,
      e.g. :class:`dpjax.sgd.sampling.PoissonSampling`) whose event each step is
      (:func:`dpsgd_event`); default Poisson sampling at ``sampling_prob``.

  Returns:
    :class:`DPSGDBudget`; ``budget.epsilon ≤ epsilon`` and ``budget.delta == delta`` (up to
    float rounding of ``δ_s + (δ − δ_s)``).

  Raises:
    ValueError: ε ≤ 0, δ ∉ (0, 1), ``ε_s ∉ [0, ε)``, ``δ_s ∉ [0, δ)``, both subspace forms,
      bad q, T or accountant, ``tuning`` with "pld" or with an (ε_s, δ_s) release, an event
      the accountant cannot compose, or no σ ≤ 1e4 meets the target.
    TypeError: non-numeric arguments, non-integer ``steps``, a subspace event that is not a
      ``dp_accounting.DpEvent``.

  References:
    Abadi et al., CCS 2016, Algorithm 1 and §3.1 (DP-PCA composed with DP-SGD in one
    accountant); Mironov, Talwar & Zhang (2019); docs/algorithms.md §6.1, §6.2.
  """
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  sub_event = subspace_release_event(subspace_epsilon, subspace_delta, subspace_event)
  parts = split_event(sub_event)
  if parts.epsilon >= epsilon:
    raise ValueError(f"subspace_epsilon must lie in [0, epsilon={epsilon}), got "
                     f"subspace_epsilon={parts.epsilon}.")
  if parts.delta >= delta:
    raise ValueError(f"subspace_delta must lie in [0, delta={delta}), got "
                     f"subspace_delta={parts.delta}.")
  sampling_prob = _selection_prob(sampling_prob, batch_selection)
  sampling_prob, steps = _check_sgd(1.0, sampling_prob, steps)[1:]
  tuning = _check_tuning_accountant(tuning, accountant)
  _check_tuned_release(tuning, parts)
  sgd_delta = delta - parts.delta
  if parts.accountable:
    sigma = _calibrate_composed(epsilon - parts.epsilon, sgd_delta, sampling_prob, steps,
                                accountant, parts.accountable, batch_selection, tuning)
  else:
    sigma = calibrate_noise_multiplier(epsilon - parts.epsilon, sgd_delta, sampling_prob, steps,
                                       accountant=accountant, tuning=tuning,
                                       batch_selection=batch_selection)
  return _budget(sigma, sampling_prob, steps, delta, sub_event, accountant, tuning,
                 batch_selection)


def dpsgd_budget(noise_multiplier: float, sampling_prob: float | None, steps: int, delta: float,
                 *, subspace_epsilon: float = 0.0, subspace_delta: float = 0.0,
                 subspace_event: dp_accounting.DpEvent | None = None, accountant: str = "rdp",
                 tuning: HyperparameterTuning | None = None,
                 batch_selection=None) -> DPSGDBudget:
  """The budget a GIVEN σ certifies at total ``delta``, a subspace release composed in as in
  :func:`plan_dpsgd_budget` (σ = 0: no privacy, ε = ∞).

  Raises:
    ValueError / TypeError: as :func:`plan_dpsgd_budget`; σ < 0.
  """
  sigma = v.check_positive(noise_multiplier, "noise_multiplier", allow_zero=True)
  delta = v.check_delta(delta)
  sampling_prob = _selection_prob(sampling_prob, batch_selection)
  sampling_prob, steps = _check_sgd(1.0, sampling_prob, steps)[1:]
  v.check_choice(accountant, "accountant", ACCOUNTANTS)
  tuning = _check_tuning_accountant(tuning, accountant)
  sub_event = subspace_release_event(subspace_epsilon, subspace_delta, subspace_event)
  _check_tuned_release(tuning, split_event(sub_event))
  if split_event(sub_event).delta >= delta:
    raise ValueError(f"the subspace release's δ must lie below delta={delta}.")
  return _budget(sigma, sampling_prob, steps, delta, sub_event, accountant, tuning,
                 batch_selection)


def dpsgd_plan_event(noise_multiplier: float, sampling_prob: float | None, steps: int, *,
                     subspace_event: dp_accounting.DpEvent = dp_accounting.NoOpDpEvent(),
                     tuning: HyperparameterTuning | None = None,
                     batch_selection=None) -> dp_accounting.DpEvent:
  """The one event of everything a DP-SGD plan releases, built from its parts: the subspace
  release(s) composed with T steps of the batch selection's sampled Gaussian step
  (:func:`dpsgd_event`), the steps wrapped in the tuning's repeat-and-select event with
  ``tuning``; ``NonPrivateDpEvent`` for σ = 0. :func:`plan_dpsgd_budget` calibrates σ on it and
  :class:`DPSGDBudget`'s ``dp_event`` is it (add/remove-one).

  Raises:
    ValueError / TypeError: as :func:`dpsgd_event` (σ < 0 instead of ≤ 0).
  """
  sigma = v.check_positive(noise_multiplier, "noise_multiplier", allow_zero=True)
  sampling_prob = _selection_prob(sampling_prob, batch_selection)
  if sigma <= 0:
    return dp_accounting.NonPrivateDpEvent()
  steps_event = dpsgd_event(sigma, sampling_prob, steps, batch_selection=batch_selection)
  if tuning is not None:
    steps_event = tuning_event(steps_event, tuning)
  if isinstance(subspace_event, dp_accounting.NoOpDpEvent):
    return steps_event
  return compose_events(subspace_event, steps_event)


@quiet_rdp_logs()
def _budget(sigma, q, steps, delta, sub_event, accountant, tuning,
            batch_selection=None) -> DPSGDBudget:
  parts = split_event(sub_event)
  sgd_delta = delta - parts.delta
  event = dpsgd_plan_event(sigma, q, steps, subspace_event=sub_event, tuning=tuning,
                           batch_selection=batch_selection)
  if sigma <= 0:
    sgd_epsilon = math.inf
  else:
    # The accountant's part of the one event: its leaves other than the (ε, δ) ones.
    sgd_epsilon = event_epsilon(compose_events(*split_event(event).accountable), sgd_delta,
                                accountant=accountant)
  relation = event_neighboring(event)
  total = compose_basic(PrivacySpend(parts.epsilon, parts.delta, relation),
                        PrivacySpend(sgd_epsilon, sgd_delta, relation))
  return DPSGDBudget(sigma, q, steps, parts.epsilon, parts.delta, sgd_epsilon, sgd_delta,
                     total.epsilon, total.delta, relation, tuning, sub_event, event)


def _check_tuned_release(tuning, parts: EventParts) -> None:
  """A tuning repeats the steps only; a release composed with them must have an RDP curve
  (a Gaussian one: released once, before the tuning, and shared by all its runs)."""
  if tuning is not None and (parts.epsilon > 0 or parts.delta > 0):
    raise ValueError("tuning cannot be composed with a subspace release known only by its "
                     "(ε_s, δ_s) (basic composition has no RDP curve): tune without it, or "
                     "release it by a Gaussian mechanism whose event the RDP accountant "
                     "composes.")


@functools.lru_cache(maxsize=64)
def _calibrate_composed(target_epsilon, target_delta, sampling_prob, steps, accountant,
                        other: tuple, batch_selection=None, tuning=None) -> float:
  """The smallest σ with ``ε(other ∘ T steps) ≤ target`` at ``target_delta`` (accountant's);
  with ``tuning`` the steps are its repeat-and-select event and ``other`` is composed once,
  outside the repetition."""
  def event_at(sigma):
    steps_event = dpsgd_event(sigma, sampling_prob, steps, batch_selection=batch_selection)
    if tuning is not None:
      steps_event = tuning_event(steps_event, tuning)
    return compose_events(*other, steps_event)

  relation = event_neighboring(event_at(1.0))
  if not make_accountant(accountant, relation).supports(event_at(1.0)):
    raise ValueError(f"the {accountant!r} accountant cannot compose the subspace event "
                     f"{other!r} with the DP-SGD steps; use the other accountant, or state the "
                     "release by its (ε, δ).")
  # The steps alone at the whole target need σ_0; composing another release can only raise ε,
  # so σ ≥ σ_0: bracket from σ_0 upward (dp_accounting widens the upper end as needed).
  low = _calibrate_noise_multiplier(target_epsilon, target_delta, sampling_prob, steps,
                                    accountant, tuning, batch_selection)
  if event_epsilon(event_at(_SIGMA_CEILING), target_delta, accountant=accountant) > \
      target_epsilon:
    raise ValueError(f"no noise_multiplier <= {_SIGMA_CEILING:g} reaches "
                     f"target_epsilon={target_epsilon} with the subspace release composed in; "
                     "it alone may spend the budget.")
  return float(dp_accounting.calibrate_dp_mechanism(
      lambda: make_accountant(accountant, relation), event_at, target_epsilon, target_delta,
      bracket_interval=dp_accounting.LowerEndpointAndGuess(low, 1.25 * low),
      tol=1e-5 * low))


# --------------------------------------------------------------------------------------------
# Compositions of unsampled Gaussian mechanisms (CoinPress's steps).
# --------------------------------------------------------------------------------------------

GAUSSIAN_ACCOUNTANTS = ("analytic", "pld", "rdp")
_SCALE_FLOOR = 1e-3          # common noise scales s are searched in [1e-3, 1e6]
_SCALE_CEILING = 1e6


def gaussian_composition_event(noise_multipliers) -> dp_accounting.DpEvent:
  """``ComposedDpEvent`` of one ``GaussianDpEvent(z_t)`` per unsampled Gaussian step.

  ``z_t = σ_t/Δ_t`` with Δ_t the ℓ2-sensitivity of step t's statistic under the relation the
  caller states (replace-one for CoinPress). ``GaussianDpEvent(z)`` means "a Gaussian of std z
  on a statistic that moves by at most 1 between neighbours": that is what the RDP accountant and
  the PLD accountant under ``ADD_OR_REMOVE_ONE`` compute for an unsampled Gaussian, and the right
  reading when Δ_t already is the sensitivity under the caller's relation. [CAUTION]
  ``dp_accounting``'s PLD accountant under ``REPLACE_ONE`` reads z relative to a per-record bound
  and doubles the shift (ε ≈ 2.1 instead of 1.0 at the same σ): never use it here.

  Raises:
    ValueError: an empty list or a multiplier not finite and > 0.
  """
  zs = [v.check_positive(z, "noise_multiplier") for z in noise_multipliers]
  if not zs:
    raise ValueError("noise_multipliers must not be empty.")
  return dp_accounting.ComposedDpEvent(tuple(dp_accounting.GaussianDpEvent(z) for z in zs))


@quiet_rdp_logs()
def gaussian_composition_epsilon(noise_multipliers, delta: float, *,
                                 accountant: str = "pld") -> float:
  """ε at ``delta`` of composed unsampled Gaussian mechanisms (:func:`gaussian_composition_event`).

  Args:
    noise_multipliers: ``z_t = σ_t/Δ_t > 0``, one per step.
    delta: δ ∈ (0, 1).
    accountant: "pld" (tight; default) or "rdp" (an upper bound, fast).

  Returns:
    ε as a Python float, under the relation the sensitivities Δ_t are stated for.
  """
  delta = v.check_delta(delta)
  v.check_choice(accountant, "accountant", ("pld", "rdp"))
  event = gaussian_composition_event(noise_multipliers)
  return float(_shift_one_accountant(accountant).compose(event).get_epsilon(delta))


@quiet_rdp_logs()
def calibrate_gaussian_composition(epsilon: float, delta: float, fractions, *,
                                   accountant: str = "pld") -> tuple[float, float]:
  """``(s, ε(s))``: the common scale for which ``z_t = s/sqrt(f_t)`` composes to (ε, δ)-DP.

  ``"analytic"``: the composition of Gaussian mechanisms with multipliers ``s/sqrt(f_t)``,
  ``Σ f_t = 1``, is exactly one Gaussian mechanism with multiplier ``(Σ z_t^{-2})^{-1/2} = s``
  (Dong, Roth & Su 2019), so s is the analytic Gaussian σ of (ε, δ) at sensitivity 1 (Balle &
  Wang 2018) — exact for continuous noise. ``"pld"`` / ``"rdp"``: ``dp_accounting.
  calibrate_dp_mechanism`` with its own bracket search from that σ. RDP is what a discrete
  Gaussian's guarantee rests on (its Rényi divergences are at most the continuous ones). Results
  are cached per ``(ε, δ, fractions, accountant)``.

  Args:
    epsilon: ε > 0.
    delta: δ ∈ (0, 1).
    fractions: per-step fractions ``f_t > 0`` summing to 1 (a tuple).
    accountant: "analytic", "pld" or "rdp".

  Returns:
    ``(s, ε(s))`` as Python floats, ``ε(s) ≤ ε``.

  Raises:
    ValueError: bad arguments, or no s in ``[1e-3, 1e6]`` reaches the target.
  """
  epsilon, delta = v.check_epsilon(epsilon), v.check_delta(delta)
  v.check_choice(accountant, "accountant", GAUSSIAN_ACCOUNTANTS)
  fractions = tuple(v.check_positive(f, "fraction") for f in fractions)
  return _calibrate_composition(epsilon, delta, fractions, accountant)


@functools.lru_cache(maxsize=256)
def _calibrate_composition(epsilon, delta, fractions, accountant):
  start = min(max(analytic_gaussian_sigma(epsilon, delta, 1.0), _SCALE_FLOOR), _SCALE_CEILING)
  if accountant == "analytic":
    return start, epsilon
  roots = [math.sqrt(f) for f in fractions]

  def make_event(scale):
    return gaussian_composition_event([scale / r for r in roots])

  def eps_at(scale):
    return float(_shift_one_accountant(accountant).compose(make_event(scale)).get_epsilon(delta))

  if eps_at(_SCALE_CEILING) > epsilon:
    raise ValueError(f"no noise scale <= {_SCALE_CEILING:g} reaches epsilon={epsilon}; raise "
                     "the budget.")
  # The composition is (up to PLD's discretisation) the analytic single Gaussian, and RDP is
  # looser, so s ≥ start·(1 − tiny): bracket from start/2 (never near s → 0, where the PLD
  # accountant's memory explodes) and let dp_accounting expand the upper end from start.
  low = max(0.5 * start, _SCALE_FLOOR)
  if eps_at(low) <= epsilon:              # pragma: no cover - not expected for Gaussians
    return low, eps_at(low)
  scale = float(dp_accounting.calibrate_dp_mechanism(
      lambda: _shift_one_accountant(accountant), make_event, epsilon, delta,
      bracket_interval=dp_accounting.LowerEndpointAndGuess(low, start),
      tol=1e-7 * start))                   # relative 1e-7 in s: ε within ~1e-6 of the target
  return scale, eps_at(scale)


def _shift_one_accountant(name: str) -> dp_accounting.PrivacyAccountant:
  """An accountant that reads ``GaussianDpEvent(z)`` as a shift-1 Gaussian (see
  :func:`gaussian_composition_event`)."""
  relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
  if name == "rdp":
    return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
  return dp_accounting.pld.PLDAccountant(neighboring_relation=relation)
