"""The DP-SGD plan: one object that binds clipping, batch selection, noise and accounting
(docs/algorithms.md §6; shaped on ``jax_privacy``'s ``DPExecutionPlan``).

A :class:`DPSGDPlan` holds

* ``grad_fn``: a sensitivity-bearing clipped-gradient function (:func:`dpjax.sgd.clipped_grad_sum`
  by ``vmap(grad)``, :func:`dpjax.sgd.ghost_clipped_grad_sum`, GEP's
  :func:`dpjax.sgd.embedding_residual_grad_sum`, or ``jax_privacy.clipping.clipped_grad``) that
  carries its ℓ2 bound Δ;
* ``batch_selection``: :class:`dpjax.sgd.sampling.PoissonSampling`, with its piece of the ``dp_event``;
* ``noise``: :func:`dpjax.sgd.dp_noise` built from ``grad_fn`` (so it reads Δ) with the release
  map the bases ask for (full, flat basis, per-layer one- or two-sided bases, GEP's embedding and
  residual) — C, σ, Δ and ν cannot disagree between clipping, noise and accountant;
* ``dp_event``, ``budget`` (ε, δ) and the neighboring relation (add/remove-one), and optionally
  a mesh for data parallelism.

It works with any optax optimiser and any params pytree (dicts, Flax NNX ``nnx.split`` state,
Flax Linen params, Equinox arrays): the user's loop calls ``plan.clipped_sum`` and
``plan.transform(optimizer)``, or the jitted :meth:`DPSGDPlan.step` / whole-run
:meth:`DPSGDPlan.run` (one ``lax.scan``).

Privacy (add/remove-one of one example): the released updates of ``steps`` calls of
``clipped_sum`` (each with a fresh key) followed by the transform are ``(budget.epsilon,
budget.delta)``-DP: each is the sampled Gaussian mechanism with noise multiplier σ relative to
the sum's sensitivity Δ (times the release map's ν), composed by ``dp_accounting`` over the
steps (``dp_event``), plus a private subspace's ``(ε_s, δ_s)`` by basic composition. Using a
sample more than once, more steps than planned, or bases computed non-privately from the
training rows voids it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import dp_accounting
import jax
import optax
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import accounting, results
from dpjax._core.deprecation import renamed_attribute
from dpjax.sgd import distributed, gep, noise, sampling

__all__ = ["DPSGDPlan", "dp_sgd_plan"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPSGDPlan:
  """One DP-SGD configuration (:func:`dp_sgd_plan` makes it; see the module docstring).

  Attributes:
    grad_fn: the clipped-gradient sum (carries Δ as ``l2_norm_bound``).
    batch_selection: the :class:`dpjax.sgd.sampling.PoissonSampling` (N, L, micro-batch size).
    noise: the optax privatiser (:func:`dpjax.sgd.dp_noise`): release map, noise std σΔν,
      division by L; its key and bases live in its state.
    noise_multiplier: σ.
    steps: T, the steps the budget covers.
    budget: the :class:`dpjax.accounting.DPSGDBudget` (ε, δ under add/remove-one).
    dp_event: the ``dp_accounting`` event of everything the plan releases: a private subspace
      release composed with the T sampled steps (the tuning's repeat-and-select event with
      ``tuning``; ``NonPrivateDpEvent`` for σ = 0). ``epsilon`` is computed from it.
    accountant: ``"pld"`` or ``"rdp"``.
    mesh: optional ``jax.sharding.Mesh`` the examples are sharded over (data parallelism).
    data_axis: the mesh axis of the examples.
  """
  grad_fn: Any
  batch_selection: sampling.PoissonSampling
  noise: optax.GradientTransformation
  noise_multiplier: float
  steps: int
  budget: accounting.DPSGDBudget
  dp_event: Any
  accountant: str
  mesh: jax.sharding.Mesh | None = None
  data_axis: str = distributed.DATA_AXIS

  @property
  def neighboring(self) -> NeighboringRelation:
    """The relation the guarantee is stated under: add/remove-one."""
    return NeighboringRelation.ADD_OR_REMOVE_ONE

  neighbouring = renamed_attribute("neighboring", "neighbouring")

  @property
  def epsilon(self) -> float:
    """ε at ``delta`` of :attr:`dp_event` by the plan's accountant: ``budget.epsilon``, which
    the calibration computed from that same event (``budget.dp_event``), not a second time."""
    return self.budget.epsilon

  @property
  def delta(self) -> float:
    return self.budget.delta

  def transform(self, optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """``optax.chain(plan.noise, optimizer)``: the privatiser, then any optax optimiser
    (post-processing)."""
    _check_optimizer(optimizer)
    return optax.chain(self.noise, optimizer)

  def init(self, params, optimizer: optax.GradientTransformation):
    """The optimiser state of :meth:`transform` (checks the bases against ``params``)."""
    return self.transform(optimizer).init(params)

  def prepare(self, data):
    """``data`` laid out for :meth:`clipped_sum`: device arrays, sharded over the mesh (padded
    with rows the sampling never draws) when the plan has one. Call once, outside ``jit``."""
    n = self.batch_selection.num_examples
    sizes = {jax.numpy.shape(x)[0] if jax.numpy.ndim(x) else None
             for x in jax.tree_util.tree_leaves(data)}
    if sizes != {n}:
      raise ValueError(f"data must have a leading example axis of num_examples={n} on every "
                       f"leaf, got {sorted(str(s) for s in sizes)}.")
    if self.mesh is None:
      return jax.tree_util.tree_map(jax.numpy.asarray, data)
    return distributed.shard_examples(data, self.mesh, self.data_axis)[0]

  def clipped_sum(self, params, data, key: jax.Array, opt_state=None):
    """One step's clipped-gradient sum over a fresh Poisson sample drawn with ``key``
    (traceable). Feed it to :meth:`transform`'s update; use a fresh key per step.

    ``data`` as :meth:`prepare` returns it. ``opt_state`` (the transform's state) is needed only
    by GEP's grad sum, which splits by the bases held in the noise state (so the split and the
    lift always use the same bases).
    """
    n = self.batch_selection.num_examples
    rows = {jax.numpy.shape(x)[0] if jax.numpy.ndim(x) else None
            for x in jax.tree_util.tree_leaves(data)}
    if self.mesh is None and rows != {n}:   # with a mesh, prepare() pads to a multiple
      raise ValueError(f"data must have a leading example axis of num_examples={n} on every "
                       f"leaf, got {sorted(str(r) for r in rows)} (q = L/N is planned for N).")
    extra = ()
    if isinstance(self.grad_fn, gep.EmbeddingResidualGradSum):
      if opt_state is None:
        raise ValueError("GEP's clipped sum needs opt_state (its bases live in the noise state).")
      extra = (noise.noise_state(opt_state).bases,)
    selection = self.batch_selection
    if self.mesh is None:
      return selection.clipped_sum(self.grad_fn, params, data, key, *extra)
    return distributed.sharded_poisson_clipped_sum(
        self.grad_fn, params, data, key, num_examples=selection.num_examples,
        sampling_prob=selection.sampling_prob, microbatch_size=selection.microbatch_size,
        mesh=self.mesh, data_axis=self.data_axis, extra_args=extra)

  def step(self, params, opt_state, data, key: jax.Array, optimizer):
    """One DP-SGD step, jitted: ``(params, opt_state)`` after the Poisson sample of ``key``.

    ``opt_state`` from :meth:`init` with the same ``optimizer``; ``data`` from :meth:`prepare`.
    The plan and the optimiser are static arguments of the jit: build the optimiser once, not
    inside the loop (a new ``optax.adam(...)`` object compiles the step again).
    """
    self._check_steps_left(self.steps_taken(opt_state), 1)
    return self._jitted("step")(self, optimizer, params, opt_state, data, key)

  def run(self, params, opt_state, data, key: jax.Array, optimizer, *,
          steps: int | None = None):
    """``steps`` DP-SGD steps (default: all the budget still covers) as one jitted ``lax.scan``,
    the step keys split from ``key``; returns ``(params, opt_state)``.

    Calling it again continues the run; the budget covers T steps in all, and a call that would
    go past T raises ``ValueError`` (as :meth:`step` does), before anything runs.
    """
    taken = self.steps_taken(opt_state)
    steps = (max(self.steps - taken, 1) if steps is None
             else v.check_int(steps, "steps", low=1, high=self.steps))
    self._check_steps_left(taken, steps)
    return self._jitted("run")(self, optimizer, params, opt_state, data, key, steps=steps)

  def steps_taken(self, opt_state) -> int:
    """The updates released so far with ``opt_state`` (host side; read from the noise state, so
    it waits for the step that produced ``opt_state``)."""
    return int(noise.noise_state(opt_state).step)

  def _check_steps_left(self, taken: int, steps: int) -> None:
    if taken + steps > self.steps:
      raise ValueError(
          f"this plan's budget covers T = {self.steps} steps and {taken} were taken: "
          f"{steps} more would release updates its (ε, δ) does not cover. Plan a new run (a "
          "new plan, paid from a new budget) instead of stepping on.")

  def update_bases(self, opt_state, *, basis=None, bases=None, tol: float = 1e-3):
    """New bases for the noise (host side; :func:`dpjax.sgd.update_bases`)."""
    return noise.update_bases(opt_state, basis=basis, bases=bases, tol=tol)

  def _jitted(self, which: str):
    try:
      hash(self)
    except TypeError:        # an unhashable grad_fn (e.g. jax_privacy's): one jit per plan
      return self._own_jit[which]
    return _STATIC_JIT[which]

  @functools.cached_property
  def _own_jit(self):
    return {"step": jax.jit(_step_impl, static_argnums=(0, 1)),
            "run": jax.jit(_run_impl, static_argnums=(0, 1), static_argnames=("steps",))}


def _check_optimizer(optimizer):
  if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
    raise TypeError("optimizer must be an optax GradientTransformation (with init and update), "
                    f"got {type(optimizer).__name__}.")


def _step_impl(plan, optimizer, params, opt_state, data, key):
  summed = plan.clipped_sum(params, data, key, opt_state)
  updates, opt_state = plan.transform(optimizer).update(summed, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _run_impl(plan, optimizer, params, opt_state, data, key, *, steps):
  def body(carry, step_key):
    return _step_impl(plan, optimizer, *carry, data, step_key), None

  return jax.lax.scan(body, (params, opt_state), jax.random.split(key, steps))[0]


_STATIC_JIT = {"step": jax.jit(_step_impl, static_argnums=(0, 1)),
               "run": jax.jit(_run_impl, static_argnums=(0, 1), static_argnames=("steps",))}


def dp_sgd_plan(grad_fn, *, num_examples: int, expected_batch_size: float, steps: int,
                key: jax.Array, epsilon: float | None = None, delta: float = 1e-5,
                noise_multiplier: float | None = None, basis=None, bases=None,
                subspace_epsilon: float = 0.0, subspace_delta: float = 0.0,
                subspace_event=None, accountant: str = "pld", tuning: accounting.HyperparameterTuning | None = None,
                microbatch_size: int | None = None, mesh: jax.sharding.Mesh | None = None,
                data_axis: str = distributed.DATA_AXIS, ledger=None,
                tol: float = 1e-3) -> DPSGDPlan:
  """Plans DP-SGD on N examples: calibration, batch selection, the noise for ``grad_fn``.

  Either ``epsilon`` (σ is calibrated so that the T steps, composed with a private subspace
  release — its ``subspace_event``, or ``(subspace_epsilon, subspace_delta)`` — are
  ``(epsilon, delta)``-DP) or ``noise_multiplier`` (σ given; the budget is what the accountant
  certifies at ``delta``).

  Privacy: ``(plan.epsilon, plan.delta)``-DP under add/remove-one of one example for everything
  computed from the T released updates — provided each step draws its sample with
  :meth:`DPSGDPlan.clipped_sum` (or :meth:`~DPSGDPlan.step`, :meth:`~DPSGDPlan.run`) with a
  fresh key, passes it to the plan's transform, at most T times (enforced: ``step`` and ``run``
  refuse a call past T, and an update past T is all NaN), and the bases are public, a DP
  release accounted in ``subspace_event`` or ``subspace_epsilon/delta``, or functions of this
  run's releases. Reason: each step is the sampled Gaussian mechanism with ℓ2-sensitivity
  Δ = ``grad_fn.l2_norm_bound`` times the release map's ν, noise std σΔν (Abadi et al. 2016),
  composed by ``dp_accounting`` (:func:`dpjax.accounting.dpsgd_event`).

  Example (a Flax NNX model, plain DP-SGD)::

      graphdef, params = nnx.split(model, nnx.Param)
      loss = lambda p, ex: xent(nnx.merge(graphdef, p)(ex[0][None])[0], ex[1])
      plan = dpjax.sgd.dp_sgd_plan(dpjax.sgd.clipped_grad_sum(loss, clip_norm=1.0),
                                   num_examples=N, expected_batch_size=256, steps=T,
                                   epsilon=2.0, delta=1e-5, key=key)
      opt = optax.adam(1e-3)      # build once: the optimiser is a static argument of the jit
      opt_state = plan.init(params, opt)
      params, opt_state = plan.run(params, opt_state, plan.prepare((X, y)), key2, opt)

  Args:
    grad_fn: sensitivity-bearing clipped-gradient sum (module docstring).
    num_examples: N ≥ 1, the private training set's size (public).
    expected_batch_size: L ∈ (0, N]; q = L/N.
    steps: T ≥ 1.
    key: PRNG key of the noise stream (kept in the noise state, split every step).
    epsilon: total ε > 0, or None when ``noise_multiplier`` is given.
    delta: total δ ∈ (0, 1).
    noise_multiplier: σ ≥ 0 instead of ``epsilon`` (σ = 0: no privacy, ε = ∞; for tests).
    basis: optional flat basis ``V (p, k)``; bases: optional per-layer bases (required by GEP's
      grad sum); see :func:`dpjax.sgd.dp_noise`. A private release may stand for a basis (the
      result of :func:`dpjax.sgd.private_input_basis` or any subspace learner, under
      add/remove-one): its basis is used and its ``dp_event`` composed into the plan, so a
      private basis cannot be used without its cost (⊥ is refused); a public basis is a plain
      array.
    subspace_epsilon, subspace_delta: a private basis's cost by number, composed into the total
      (basic composition, add/remove-one).
    subspace_event: a private basis's ``dp_accounting`` event instead (its result's
      ``dp_event``, or the result itself, under add/remove-one): a Gaussian release (e.g.
      :func:`dpjax.sgd.private_input_basis` with ``secure=False``) is composed with the steps by
      the accountant, which leaves DP-SGD far more of the budget than a split of ε
      (:func:`dpjax.accounting.plan_dpsgd_budget`); (ε, δ) events by basic composition.
    accountant: ``"pld"`` (default) or ``"rdp"``.
    tuning: optional :class:`dpjax.accounting.HyperparameterTuning`: σ for one run of a
      Papernot–Steinke tuning whose released best run is (ε, δ)-DP (RDP; no subspace share, no
      ledger).
    microbatch_size: rows per jitted micro-batch (per device with a mesh; default
      :func:`dpjax.sgd.sampling.poisson_sampling`'s).
    mesh, data_axis: optional mesh to shard the examples over (``plan.prepare`` shards them).
    ledger: optional :class:`dpjax.ledger.PrivacyLedger` (add/remove-one): the plan's subspace
      share and T steps are checked against it before anything runs, then recorded (record a
      private basis here or in the ledger yourself, not both).
    tol: accepted spectral distance of bases from orthonormality.

  Returns:
    A :class:`DPSGDPlan`.

  Raises:
    TypeError: ``grad_fn`` without an ``l2_norm_bound``; a bad key or mesh.
    ValueError: neither or both of ``epsilon`` and ``noise_multiplier``; L > N; bad sizes,
      budgets, bases (as :func:`dpjax.sgd.dp_noise`), tuning (as
      :func:`dpjax.accounting.plan_dpsgd_budget`), or tuning with a ledger.
    dpjax.ledger.BudgetExceededError: the plan does not fit ``ledger`` (nothing has run).
  """
  noise.l2_norm_bound(grad_fn)
  v.check_key(key)
  steps = v.check_int(steps, "steps", low=1)
  delta = v.check_delta(delta)
  v.check_choice(accountant, "accountant", accounting.ACCOUNTANTS)
  devices = 1 if mesh is None else distributed.check_mesh(mesh, data_axis)
  selection = sampling.poisson_sampling(num_examples, expected_batch_size,
                                        microbatch_size=microbatch_size, devices=devices)
  q = selection.sampling_prob
  if (epsilon is None) == (noise_multiplier is None):
    raise ValueError("give exactly one of epsilon (σ is calibrated) and noise_multiplier.")
  if tuning is not None and ledger is not None:
    raise ValueError("tuning with a ledger: a plan is one run of the tuning, whose cost is the "
                     "whole tuning's; record accounting.tuning_event(...) in the ledger once.")
  subspace_event = _subspace_event(subspace_event)
  basis, bases, subspace_event = _released_bases(basis, bases, subspace_event)
  if epsilon is not None:
    budget = accounting.plan_dpsgd_budget(
        v.check_positive(epsilon, "epsilon"), delta, sampling_prob=q, steps=steps,
        subspace_epsilon=subspace_epsilon, subspace_delta=subspace_delta,
        subspace_event=subspace_event, accountant=accountant, tuning=tuning)
  else:
    budget = accounting.dpsgd_budget(
        noise_multiplier, q, steps, delta, subspace_epsilon=subspace_epsilon,
        subspace_delta=subspace_delta, subspace_event=subspace_event, accountant=accountant,
        tuning=tuning)
  sigma = budget.noise_multiplier
  transform = noise.dp_noise(grad_fn, noise_multiplier=sigma,
                             expected_batch_size=selection.expected_batch_size, key=key,
                             basis=basis, bases=bases, tol=tol, steps=steps)
  if ledger is not None:
    record_budget(ledger.copy(), budget, accountant)   # check the whole plan, then record it
    record_budget(ledger, budget, accountant)
  return DPSGDPlan(grad_fn=grad_fn, batch_selection=selection, noise=transform,
                   noise_multiplier=sigma, steps=steps, budget=budget, dp_event=budget.dp_event,
                   accountant=accountant, mesh=mesh, data_axis=data_axis)


def _released_bases(basis, bases, subspace_event):
  """``(basis, bases, subspace_event)`` with any private release given as a basis source (a
  result with a ``dp_event``, e.g. :func:`dpjax.sgd.private_input_basis`'s) replaced by its basis
  and its event composed into ``subspace_event``: a private basis cannot lose its cost."""
  events = []

  def unwrap(x):
    if not isinstance(x, results.SubspaceResult):
      return x
    if x.neighboring not in (None, NeighboringRelation.ADD_OR_REMOVE_ONE):
      raise ValueError(f"the basis release is stated under {x.neighboring.name}; DP-SGD "
                       "composes under add/remove-one (release it under ADD_OR_REMOVE_ONE).")
    if not bool(x.ok):
      raise ValueError("the basis release returned ⊥ (its cost is spent; its basis is zeros): "
                       "train without it, or release it again with more rows or budget.")
    if not isinstance(x.dp_event, dp_accounting.NoOpDpEvent):
      events.append(x.dp_event)
    return x.basis

  is_result = lambda x: isinstance(x, results.SubspaceResult)                # noqa: E731
  basis = unwrap(basis)
  if bases is not None:
    bases = jax.tree_util.tree_map(unwrap, bases, is_leaf=is_result)
  if not events:
    return basis, bases, subspace_event
  if subspace_event is not None:
    raise ValueError("a basis given as its release carries its own event: pass it as the "
                     "basis (its cost is composed in) or give subspace_event, not both.")
  return basis, bases, accounting.compose_events(*events) if len(events) > 1 else events[0]


def _subspace_event(subspace_event):
  """A subspace release's event: an event, or a result's ``dp_event`` (add/remove-one only)."""
  if subspace_event is None or isinstance(subspace_event, dp_accounting.DpEvent):
    return subspace_event
  event = getattr(subspace_event, "dp_event", None)
  if event is None:
    raise TypeError("subspace_event must be a dp_accounting.DpEvent or a result with a "
                    f"dp_event, got {type(subspace_event).__name__}.")
  relation = getattr(subspace_event, "neighboring", None)
  if relation not in (None, NeighboringRelation.ADD_OR_REMOVE_ONE):
    raise ValueError(f"the subspace release is stated under {relation.name}; DP-SGD composes "
                     "under add/remove-one (release it under ADD_OR_REMOVE_ONE).")
  return event


def record_budget(ledger, budget: accounting.DPSGDBudget, accountant: str | None = None) -> None:
  """Records a DP-SGD budget in a :class:`dpjax.ledger.PrivacyLedger`: its subspace release (its
  event) and its T steps (the DP-SGD event); refused, recording nothing, if over budget. Pass
  ``ledger.copy()`` to check a plan before anything runs.

  ``accountant``: the one σ was calibrated with. When it is not the ledger's, the plan is booked
  as its (ε, δ) (an explicit conversion: the ledger's accountant would certify another ε for
  the same events, so a (2, 1e-5) plan calibrated by PLD would not fit a (2, 1e-5) RDP ledger)."""
  if accountant is not None and accountant != ledger.accountant and budget.noise_multiplier > 0:
    ledger.record_approx_dp(budget.epsilon, budget.delta,
                            label=f"DP-SGD plan, its (ε, δ) by the {accountant} accountant",
                            neighboring=NeighboringRelation.ADD_OR_REMOVE_ONE)
    return
  if not isinstance(budget.subspace_event, dp_accounting.NoOpDpEvent):
    ledger.record_event(budget.subspace_event,
                        label="private subspace (composed into the DP-SGD plan)",
                        neighboring=NeighboringRelation.ADD_OR_REMOVE_ONE)
  if budget.noise_multiplier <= 0:
    ledger.record_event(dp_accounting.NonPrivateDpEvent(), label="DP-SGD with σ = 0")
  else:
    ledger.record_dpsgd(noise_multiplier=budget.noise_multiplier,
                        sampling_prob=budget.sampling_prob, steps=budget.steps)
