"""DP-SGD's privacy settings, apart from its performance settings: config → calibrate → make
(docs/algorithms.md §6.0; shaped on ``jax_privacy``'s config, calibration and execution plan).

A :class:`DPSGDConfig` holds everything the guarantee depends on — N, the expected batch size
L, T, the accountant, a private subspace release, a hyperparameter tuning, and (ε, δ) or σ — and
nothing else. It calibrates once (:meth:`DPSGDConfig.calibrate`, cached on the object): σ is the
smallest noise multiplier whose one event, built by :func:`dpjax.accounting.dpsgd_plan_event`
from these parts and the batch selection's own step event, is (ε, δ)-DP.
:meth:`DPSGDConfig.make` then binds a clipped-gradient function, the bases and the run's key
into a :class:`dpjax.sgd.DPSGDPlan`; the micro-batch size, a mesh and its data axis are
performance flags there that cannot change the guarantee.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import dp_accounting
import jax
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import accounting, results
from dpjax.sgd import distributed, sampling
from dpjax.sgd import noise as noise_lib

_LOG = logging.getLogger("dpjax")    # silent unless the user enables INFO (README)

__all__ = ["DPSGDConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPSGDConfig:
  """The privacy-relevant settings of one DP-SGD run (add/remove-one of one example;
  replace-one with ``fixed_size``).

  Usage::

      config = dpjax.sgd.DPSGDConfig(num_examples=N, expected_batch_size=256, steps=T,
                                     epsilon=2.0, delta=1e-5)
      config.calibrate().noise_multiplier       # σ, computed once for this config
      plan = config.make(dpjax.sgd.clipped_grad_sum(loss, clip_norm=1.0), key=key)

  Give exactly one of ``epsilon`` (σ calibrated) and ``noise_multiplier`` (σ given; the budget
  is what the accountant certifies at ``delta``; σ = 0 is no privacy, for tests). Every check
  runs at construction, before anything is calibrated. The events of the batch selections and
  noise strategies, and why they hold: docs/algorithms.md §6.0, §6.1, §6.7.

  Attributes:
    num_examples: N ≥ 1, the private training set's size (public).
    expected_batch_size: L ∈ (0, N]; the sampling rate is q = L/N.
    steps: T ≥ 1, the released updates the budget covers.
    epsilon: total ε > 0, or None.
    delta: total δ ∈ (0, 1).
    noise_multiplier: σ ≥ 0, or None.
    accountant: ``"pld"`` (default) or ``"rdp"``.
    subspace_event: a private basis release composed into the budget: its ``dp_accounting``
      event, or the release itself (a result with a ``dp_event`` stated under add/remove-one,
      e.g. :func:`dpjax.sgd.private_input_basis`'s), stored as the event. A Gaussian release is
      composed with the steps by the accountant, (ε, δ) ones by basic composition.
    subspace_epsilon, subspace_delta: a private basis's cost by number instead (basic
      composition); stored as ``subspace_event``.
    max_batch_size: optional B: truncated Poisson sampling (at most B examples a step, one
      static batch of B rows; :class:`dpjax.sgd.sampling.TruncatedPoissonSampling`: PLD only, no
      tuning, no mesh). None: Poisson sampling, never truncated.
    noise_strategy: optional correlated noise with cyclic Poisson sampling
      (:class:`dpjax.sgd.sampling.CyclicPoissonSampling`) of cycle ``cycle_length`` ≥ b (default
      b; needs ``L·b ≤ N``; not with ``max_batch_size``): a
      :class:`dpjax.sgd.correlation.BandedToeplitz` with b bands (BandMF, amplified: ⌈T/b⌉
      Poisson-sampled Gaussian rounds at the group rate ``L·b/N``) or a
      :class:`dpjax.sgd.correlation.BufferedToeplitz` with ``min_sep`` b (BLT: the run is ONE
      Gaussian mechanism at σ, no amplification). A mesh shards its sample like any other.
    cycle_length: optional b ≥ 1: cyclic Poisson sampling with or without a noise strategy
      (without one, independent noise; each example then takes part in at most ⌈T/b⌉ steps).
    fixed_size: True: each step a uniformly random batch of exactly ``expected_batch_size`` (an
      integer B) distinct examples (:class:`dpjax.sgd.sampling.FixedSizeSampling`), whose event
      ``dp_accounting`` states under REPLACE-ONE only, by RDP only: every figure of the plan is
      then replace-one (:attr:`neighboring`); needs ``accountant="rdp"``; no subspace release,
      tuning, truncation or cycle.
    tuning: optional :class:`dpjax.accounting.HyperparameterTuning`: σ for one run of a
      Papernot–Steinke tuning whose released best run is (ε, δ)-DP (RDP). A subspace event is
      then composed once, outside the repetition (a Gaussian release shared by all runs, never
      one per run); an (ε_s, δ_s) one is refused.

  Raises:
    TypeError: non-integer N or T; a subspace event that is neither an event nor a release.
    ValueError: neither or both of ``epsilon`` and ``noise_multiplier``; L ∉ (0, N]; bad ε, δ,
      σ, accountant or tuning; a release stated under another relation; a subspace given both
      ways; ``max_batch_size`` below 1, or with the RDP accountant or tuning; a cycle length
      below the strategy's bands, ``L·b > N``, or cyclic sampling with ``max_batch_size``.
  """
  num_examples: int
  expected_batch_size: float
  steps: int
  epsilon: float | None = None
  delta: float = 1e-5
  noise_multiplier: float | None = None
  accountant: str = "pld"
  subspace_event: Any = None
  subspace_epsilon: float = 0.0
  subspace_delta: float = 0.0
  tuning: accounting.HyperparameterTuning | None = None
  max_batch_size: int | None = None
  noise_strategy: Any = None
  cycle_length: int | None = None
  fixed_size: bool = False

  def __post_init__(self):
    set_ = functools.partial(object.__setattr__, self)
    selection = sampling.poisson_sampling(self.num_examples, self.expected_batch_size)
    set_("num_examples", selection.num_examples)
    set_("expected_batch_size", selection.expected_batch_size)
    set_("steps", v.check_int(self.steps, "steps", low=1))
    set_("delta", v.check_delta(self.delta))
    v.check_choice(self.accountant, "accountant", accounting.ACCOUNTANTS)
    if (self.epsilon is None) == (self.noise_multiplier is None):
      raise ValueError("give exactly one of epsilon (σ is calibrated) and noise_multiplier.")
    if self.epsilon is not None:
      set_("epsilon", v.check_epsilon(self.epsilon))
    else:
      set_("noise_multiplier", v.check_positive(self.noise_multiplier, "noise_multiplier",
                                                allow_zero=True))
    event = accounting.subspace_release_event(self.subspace_epsilon, self.subspace_delta,
                                              release_event(self.subspace_event))
    set_("subspace_event", event)
    set_("subspace_epsilon", 0.0)
    set_("subspace_delta", 0.0)
    if self.tuning is not None:
      set_("tuning", accounting.check_tuning(self.tuning))
    if self.max_batch_size is not None:
      set_("max_batch_size", v.check_int(self.max_batch_size, "max_batch_size", low=1))
      if self.accountant != "pld" or self.tuning is not None:
        raise ValueError("truncated Poisson sampling (max_batch_size) is accounted by PLD only "
                         "(dp_accounting's TruncatedSubsampledGaussianDpEvent has no RDP "
                         "curve, which tuning needs): use accountant='pld' and no tuning.")
    set_("noise_strategy", noise_lib.check_noise_strategy(self.noise_strategy, self.steps))
    strategy = self.noise_strategy
    bands = 1 if strategy is None else strategy.min_separation
    if self.cycle_length is None and (bands > 1 or (strategy is not None
                                                    and not strategy.amplified)):
      set_("cycle_length", bands)
    if self.cycle_length is not None:
      set_("cycle_length", v.check_int(self.cycle_length, "cycle_length", low=1))
      if self.cycle_length < min(bands, self.steps):
        what = ("bands: an example's contributions would share a band, which the amplified "
                "BandMF event does not cover" if strategy.amplified else
                "min_sep: its sensitivity is bounded for steps at least min_sep apart")
        raise ValueError(f"cycle_length={self.cycle_length} is below the strategy's {bands} "
                         f"{what}. Use cycle_length >= {bands}.")
      if self.max_batch_size is not None:
        raise ValueError("cyclic Poisson sampling (a noise strategy or cycle_length) with "
                         "max_batch_size: truncated cyclic sampling is not supported.")
      self.batch_selection                                          # raises for L·b > N
    if not isinstance(self.fixed_size, bool):
      raise TypeError(f"fixed_size must be a bool, got {type(self.fixed_size).__name__}.")
    if self.fixed_size:
      self._check_fixed_size()

  def _check_fixed_size(self):
    if not float(self.expected_batch_size).is_integer():
      raise ValueError("fixed-size sampling draws exactly expected_batch_size examples a step: "
                       f"give an integer, got {self.expected_batch_size}.")
    if self.accountant != "rdp":
      raise ValueError("fixed-size sampling is accounted by RDP only (dp_accounting composes "
                       "SampledWithoutReplacementDpEvent with its RDP accountant, under "
                       "replace-one): use accountant='rdp'.")
    others = {"a subspace release": not isinstance(self.subspace_event,
                                                   dp_accounting.NoOpDpEvent),
              "tuning": self.tuning is not None, "max_batch_size": self.max_batch_size
              is not None, "a noise strategy or cycle_length": self.cycle_length is not None}
    given = [name for name, on in others.items() if on]
    if given:
      raise ValueError(f"fixed-size sampling (replace-one) with {', '.join(given)}: not "
                       "supported (a subspace release's event is stated under add/remove-one; "
                       "the others are Poisson schemes).")

  @property
  def neighboring(self) -> NeighboringRelation:
    """The relation every figure is stated under: add/remove-one; replace-one for
    ``fixed_size`` (the batch selection's)."""
    return getattr(self.batch_selection, "neighboring", NeighboringRelation.ADD_OR_REMOVE_ONE)

  @property
  def batch_selection(self):
    """The batch selection whose ``dp_event`` each step's event is: Poisson sampling at
    q = L/N (its micro-batch size is a performance flag set by :meth:`make`), truncated to
    ``max_batch_size``, cyclic Poisson sampling of cycle ``cycle_length`` (q_g = L·b/N), or
    fixed-size sampling of B = L (``fixed_size``)."""
    if self.fixed_size:
      return sampling.fixed_size_sampling(self.num_examples, int(self.expected_batch_size))
    if self.cycle_length is not None:
      return sampling.cyclic_poisson_sampling(self.num_examples, self.expected_batch_size,
                                              self.cycle_length, amplified=self._amplified)
    if self.max_batch_size is not None:
      return sampling.truncated_poisson_sampling(self.num_examples, self.expected_batch_size,
                                                 self.max_batch_size)
    return sampling.poisson_sampling(self.num_examples, self.expected_batch_size)

  @property
  def _amplified(self) -> bool:
    """Whether the cyclic sampling's event is amplified (independent noise, BandMF) or one
    Gaussian mechanism for the run (a BLT strategy normalised to min-sep sensitivity 1)."""
    return self.noise_strategy is None or self.noise_strategy.amplified

  @property
  def sampling_prob(self) -> float:
    """q = L/N (cyclic Poisson sampling: the group rate L·b/N)."""
    return self.batch_selection.sampling_prob

  def calibrate(self) -> accounting.DPSGDBudget:
    """The :class:`dpjax.accounting.DPSGDBudget` of this config, computed once (cached on the
    object): σ, the event of everything the plan releases (``dp_event``,
    :func:`dpjax.accounting.dpsgd_plan_event`) and its (ε, δ) by the accountant.

    Raises:
      ValueError: a subspace share at or above the total, an event the accountant cannot
        compose, tuning with PLD or with an (ε_s, δ_s) release, no σ ≤ 1e4 meeting the target.
    """
    return self._budget

  @property
  def dp_event(self) -> dp_accounting.DpEvent:
    """The calibrated event of everything a plan of this config releases (calibrates on first
    use, as :meth:`calibrate`)."""
    return self._budget.dp_event

  @functools.cached_property
  def _budget(self) -> accounting.DPSGDBudget:
    what = (f"calibrating σ for (ε, δ) = ({self.epsilon:g}, {self.delta:g}) with the "
            f"{self.accountant.upper()} accountant" if self.epsilon is not None
            else f"accounting σ = {self.noise_multiplier:g}")
    _LOG.info("%s (%d steps)…", what, self.steps)
    start = time.perf_counter()
    budget = self._compute_budget()
    _LOG.info("%s: σ = %.4g, ε = %.4g (%.1f s)", what, budget.noise_multiplier, budget.epsilon,
              time.perf_counter() - start)
    return budget

  def _compute_budget(self) -> accounting.DPSGDBudget:
    event = None if isinstance(self.subspace_event, dp_accounting.NoOpDpEvent) else \
        self.subspace_event
    common = dict(steps=self.steps, subspace_event=event, accountant=self.accountant,
                  tuning=self.tuning, batch_selection=self.batch_selection)
    if self.epsilon is not None:
      return accounting.plan_dpsgd_budget(self.epsilon, self.delta, **common)
    return accounting.dpsgd_budget(self.noise_multiplier, None, delta=self.delta, **common)

  def make(self, grad_fn, *, key: jax.Array, basis=None, bases=None,
           microbatch_size: int | None = None, mesh: jax.sharding.Mesh | None = None,
           data_axis: str = distributed.DATA_AXIS, ledger=None, tol: float = 1e-3):
    """A :class:`dpjax.sgd.DPSGDPlan` of this config: one run, whose randomness is ``key``.

    Args:
      grad_fn: sensitivity-bearing clipped-gradient sum (:mod:`dpjax.sgd.plan`).
      key: the run's PRNG key: the plan draws every step's Poisson sample and noise from it
        (:class:`dpjax.sgd.noise.StepKeys`); a second run needs a second plan and key.
      basis, bases: optional flat basis ``V (p, k)`` or per-layer bases (required by GEP's grad
        sum); :func:`dpjax.sgd.dp_noise`. A public basis is a plain array. A private release
        (a result with a ``dp_event``) may stand for its basis only if its event is this
        config's ``subspace_event`` (σ was calibrated with it); ⊥ is refused.
      microbatch_size: rows per jitted micro-batch (per device with a mesh); performance only.
      mesh, data_axis: optional mesh to shard the examples over; performance only.
      ledger: optional :class:`dpjax.ledger.PrivacyLedger` (add/remove-one): the config's budget
        is checked against it, then recorded, before the plan exists.
      tol: accepted spectral distance of bases from orthonormality.

    Raises:
      TypeError: ``grad_fn`` without an ``l2_norm_bound``; a bad key or mesh.
      ValueError: bad bases (:func:`dpjax.sgd.dp_noise`); a release whose event is not this
        config's; ⊥; tuning with a ledger.
      dpjax.ledger.BudgetExceededError: the config does not fit ``ledger`` (nothing recorded).
    """
    from dpjax.sgd import plan as plan_lib   # the plan module builds on this one

    return plan_lib.make_plan(self, grad_fn, key=key, basis=basis, bases=bases,
                              microbatch_size=microbatch_size, mesh=mesh, data_axis=data_axis,
                              ledger=ledger, tol=tol)


def release_event(release) -> dp_accounting.DpEvent | None:
  """A subspace release's event: None, an event, or a result's ``dp_event`` (add/remove-one
  only; ⊥ still costs its event)."""
  if release is None or isinstance(release, dp_accounting.DpEvent):
    return release
  event = getattr(release, "dp_event", None)
  if event is None:
    raise TypeError("subspace_event must be a dp_accounting.DpEvent or a result with a "
                    f"dp_event, got {type(release).__name__}.")
  check_add_remove(release)
  return event


def check_add_remove(release) -> None:
  relation = getattr(release, "neighboring", None)
  if relation not in (None, NeighboringRelation.ADD_OR_REMOVE_ONE):
    raise ValueError(f"the subspace release is stated under {relation.name}; DP-SGD composes "
                     "under add/remove-one (release it under ADD_OR_REMOVE_ONE).")


def is_release(x) -> bool:
  """A private release standing for a basis (a :class:`dpjax.results.SubspaceResult`)."""
  return isinstance(x, results.SubspaceResult)
