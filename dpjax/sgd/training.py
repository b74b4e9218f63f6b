"""A ready-made private training loop over the DP-SGD plan (§6): a thin loop around
:class:`dpjax.sgd.DPSGDConfig` (calibrated once) and its plan, for users who do not write
their own.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple

import jax
import optax
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import accounting
from dpjax.sgd import averaging, config as config_lib, distributed, per_example, sources
from dpjax.sgd import plan as plan_lib

__all__ = ["SUBSPACES", "TrainResult", "train_dp_sgd"]

SUBSPACES = ("none", "private", "public")


class TrainResult(NamedTuple):
  """Output of :func:`train_dp_sgd`.

  Attributes:
    params: the trained parameters.
    budget: the :class:`dpjax.accounting.DPSGDBudget` spent (totals under add/remove-one).
    subspace_ok: None for plain DP-SGD; True/False for whether the subspace was used (False: the
      private subspace answered ⊥ and training ran as plain DP-SGD).
    history: one dict per evaluation: ``{"step": ..., **eval_fn(params)}`` (of the averaged
      weights when ``weight_ema`` is set).
    averaged_params: the exponential moving average of the iterates (``weight_ema``), else None.
  """
  params: Any
  budget: accounting.DPSGDBudget
  subspace_ok: bool | None
  history: list
  averaged_params: Any = None


def train_dp_sgd(key: jax.Array, loss_fn: Callable, params, data, optimizer, *,
                 epsilon: float, delta: float, steps: int, expected_batch_size: float,
                 clip_norm: float, subspace: str = "none", k: int | None = None,
                 subspace_epsilon_fraction: float = 0.1,
                 subspace_delta_fraction: float = 0.1, public_data=None,
                 gamma: float | None = None, refresh_every: int | None = None,
                 microbatch_size: int | None = None,
                 eval_fn: Callable | None = None, eval_every: int | None = None,
                 progress: bool = False, dpase_kwargs: dict | None = None,
                 accountant: str = "pld", ledger=None, clipping: str = "clip",
                 stability: float = per_example.DEFAULT_STABILITY,
                 weight_ema: float | None = None, mesh: jax.sharding.Mesh | None = None,
                 data_axis: str = distributed.DATA_AXIS,
                 tuning: accounting.HyperparameterTuning | None = None) -> TrainResult:
  """Trains ``params`` with DP-SGD at a total (ε, δ), the subspace's cost included.

  A thin loop over :class:`dpjax.sgd.DPSGDConfig` (σ calibrated once) and its plan (clipping by
  :func:`dpjax.sgd.clipped_grad_sum`, the plan's :meth:`~dpjax.sgd.DPSGDPlan.step`, its noise and
  keys): write your own loop with the plan for
  anything it does not offer (ghost clipping, per-layer bases, GEP). Each step is one jitted
  program: Poisson sampling with rate ``q = L/N`` drawn on the device and
  laid out as fixed-size micro-batches (never truncated), the sum of clipped per-example
  gradients, Gaussian noise (in all p coordinates, or only in the k coordinates of a subspace),
  division by the expected batch size L, then ``optimizer``. With ``mesh``, the examples are
  sharded over the mesh's ``data_axis``: each device sums the clipped gradients of the sampled
  examples it holds, the sums are added across devices, and the noise is added once
  (:mod:`dpjax.sgd.distributed`); the sample, the sensitivity and the guarantee are the
  single-device ones, and the result agrees with it up to the order of float additions.

  Subspace sources (``subspace``):

  * ``"none"``: plain DP-SGD; σ calibrated to the whole (ε, δ).
  * ``"private"``: DPASE on the per-example gradients at the initial ``params`` with
    ``(ε_s, δ_s) = (fraction·ε, fraction·δ)``, then SGD calibrated to the rest. If DPASE returns
    ⊥, training continues as plain DP-SGD with that σ (the subspace budget is spent either way)
    and a warning says so. It never falls back to a non-private subspace.
  * ``"public"``: the top-k subspace of the gradients of ``public_data`` (no privacy cost: the
    data are public and must not overlap ``data``), recomputed at the current parameters every
    ``refresh_every`` steps if given (PDP-SGD style; still free, the data being public).

  Guarantee: ``(budget.epsilon, budget.delta)``-DP under add/remove-one for the rows of ``data``:
  the SGD steps are the Poisson-sampled Gaussian mechanism composed by ``dp_accounting``; the
  private subspace is (ε_s, δ_s)-DP under add/remove-one (DPASE with random labels) and is composed
  by basic composition (docs/algorithms.md §6.2 route (c)). The initial ``params`` must not depend on
  ``data``. The dataset size N is treated as public: it sets q = L/N and, with
  ``subspace="private"``, DPASE's public parameters (subset count and size, cell length, label
  capacity), which is how DPASE with random labels holds under add/remove-one.

  Args:
    key: PRNG key.
    loss_fn: ``loss_fn(params, example) -> scalar`` for one example.
    params: initial parameters (a pytree).
    data: pytree of arrays with a leading example axis N (the private training set).
    optimizer: an optax ``GradientTransformation`` applied to the privatised gradient.
    epsilon, delta: the total budget.
    steps: number of steps T.
    expected_batch_size: L, with ``L ≤ N``.
    clip_norm: per-example clip norm C.
    subspace: "none", "private" or "public".
    k: subspace dimension (required unless ``subspace == "none"``).
    subspace_epsilon_fraction, subspace_delta_fraction: shares of ε and δ for the private
      subspace, in (0, 1).
    public_data: pytree like ``data`` (for ``subspace == "public"``).
    gamma: DPASE's gap parameter (for ``subspace == "private"``; or ``cell_length`` in
      ``dpase_kwargs``).
    refresh_every: for ``subspace == "public"`` only: recompute the subspace every this many
      steps (a private refresh would cost budget each time and is not offered here).
    microbatch_size: rows per jitted micro-batch (default ``⌈L' + 4√L'⌉`` with ``L' = L/D`` the
      expected sample per device, D the devices of ``mesh`` (1 without); usually one).
    eval_fn: optional ``eval_fn(params) -> dict`` recorded every ``eval_every`` steps.
    progress: show a tqdm progress bar (needs the ``examples`` extra).
    dpase_kwargs: extra arguments for DPASE.
    accountant: "pld" (default) or "rdp".
    ledger: optional :class:`dpjax.ledger.PrivacyLedger` (add/remove-one) that records the
      subspace release and the SGD steps, refusing them before they run if over its budget.
    clipping, stability: "clip" or "normalize" (automatic clipping ``C·g/(‖g‖ + γ)``) and its γ
      (:func:`dpjax.sgd.clipped_grad_sum`); both bound every term by C.
    weight_ema: optional decay β ∈ (0, 1) of an exponential moving average of the iterates,
      ``w̄_t = β_t w̄_{t−1} + (1 − β_t) w_t`` with ``β_t = min(β, (1 + t)/(10 + t))`` (a warm-up,
      as TensorFlow's ``ExponentialMovingAverage``), starting from the initial params: returned
      as ``averaged_params`` and evaluated by ``eval_fn``. Post-processing of the released
      iterates, so it costs no privacy. A low-pass filter of the privatised GRADIENTS (DOPPLER,
      momentum) is the optimiser's job: e.g. ``optax.chain(optax.ema(0.9), optax.adam(lr))``.
    mesh: optional ``jax.sharding.Mesh`` (e.g. :func:`dpjax.sgd.data_mesh`) to shard the
      examples over (data parallelism; above). The privacy unit is still one example.
    data_axis: the mesh axis the examples are sharded over (default "data").
    tuning: optional :class:`dpjax.accounting.HyperparameterTuning`: σ is calibrated (RDP) for
      one run of a Papernot–Steinke private tuning, so that the best of a drawn number K of
      runs (:func:`dpjax.accounting.tuning_repetitions`; hyperparameters drawn from a public
      distribution, the best chosen on rows the guarantee does not cover) is
      ``(budget.epsilon, budget.delta)``-DP as a whole. Call this function once per run; this
      run alone then costs less than ε. Needs ``accountant="rdp"``, ``subspace != "private"``
      and no ``ledger`` (record :func:`dpjax.accounting.tuning_event` once for the tuning).

  Returns:
    :class:`TrainResult`.

  Raises:
    TypeError: ``key`` not a PRNG key, ``loss_fn`` not callable, ``optimizer`` not an optax
      transformation, non-integer ``steps`` / ``k`` / ``microbatch_size``, ``mesh`` not a
      ``jax.sharding.Mesh``.
    ValueError: ``data_axis`` not an axis of ``mesh``; NaN/inf in ``data`` or ``public_data``;
      ε ≤ 0, δ ∉ (0, 1); ``L > N``; C ≤ 0; an unknown ``clipping`` or γ ≤ 0; ``weight_ema ∉ (0, 1)``;
      ``k ∉ [1, p]``; fractions ∉ (0, 1); missing ``k`` / ``public_data`` / ``gamma``; an
      unknown ``subspace``; ``refresh_every`` without a public subspace; no σ meets the budget;
      ``tuning`` with ``accountant="pld"``, a private subspace or a ledger.
    dpjax.ledger.BudgetExceededError: the plan does not fit ``ledger`` (nothing has run).

  References:
    Abadi et al., "Deep Learning with Differential Privacy", CCS 2016 (DP-SGD); Singhal &
    Steinke, NeurIPS 2021 (DPASE); Zhou, Wu & Banerjee, ICLR 2021 (PDP-SGD, public subspace).
  """
  key = v.check_key(key)
  v.check_choice(subspace, "subspace", SUBSPACES)
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
    raise TypeError("optimizer must be an optax GradientTransformation (with init and update), "
                    f"got {type(optimizer).__name__}.")
  n = sources.num_examples(data)
  v.check_finite_tree(data, "data")
  if public_data is not None:
    v.check_finite_tree(public_data, "public_data")
  clip_norm = v.check_positive(clip_norm, "clip_norm")
  clipping, stability = per_example.check_clipping(clipping, stability)
  if weight_ema is not None:
    weight_ema = v.check_probability(weight_ema, "weight_ema", open_low=True, open_high=True)
  if subspace != "none":
    p = sum(x.size for x in jax.tree_util.tree_leaves(params))
    k = v.check_int(k, "k", low=1, high=p)
  if subspace == "public" and public_data is None:
    raise ValueError("subspace='public' needs public_data.")
  sub_eps = sub_delta = 0.0
  if subspace == "private":
    sub_eps = epsilon * v.check_probability(subspace_epsilon_fraction,
                                            "subspace_epsilon_fraction", open_high=True)
    sub_delta = delta * v.check_probability(subspace_delta_fraction, "subspace_delta_fraction",
                                            open_high=True)
  dpase_kwargs = dict(dpase_kwargs or {})
  if subspace == "private" and gamma is None and dpase_kwargs.get("cell_length") is None:
    raise ValueError("subspace='private' needs gamma (DPASE's public gap parameter) or "
                     "dpase_kwargs={'cell_length': ...}.")
  if dpase_kwargs.get("partition", "random_labels") != "random_labels":
    raise ValueError("dpase_kwargs['partition'] must be 'random_labels' (the add/remove-one "
                     f"guarantee needs it), got {dpase_kwargs['partition']!r}.")
  if refresh_every is not None:
    if subspace != "public":
      raise ValueError("refresh_every is only supported with subspace='public'.")
    refresh_every = v.check_int(refresh_every, "refresh_every", low=1)
  if mesh is not None:
    distributed.check_mesh(mesh, data_axis)
  if tuning is not None and ledger is not None:
    raise ValueError("tuning with a ledger: one call is one run of the tuning, whose cost is "
                     "the whole tuning's; record accounting.tuning_event(...) in the ledger once "
                     "instead of passing it here.")
  # The privacy settings, validated here and calibrated once (the plan reads the same budget).
  config = config_lib.DPSGDConfig(
      num_examples=n, expected_batch_size=expected_batch_size, steps=steps, epsilon=epsilon,
      delta=delta, accountant=accountant, subspace_epsilon=sub_eps, subspace_delta=sub_delta,
      tuning=tuning)
  eval_every = v.check_int(eval_every or config.steps, "eval_every", low=1)
  grad_fn = per_example.clipped_grad_sum(loss_fn, clip_norm=clip_norm, clipping=clipping,
                                         stability=stability)
  budget = config.calibrate()
  if ledger is not None:
    # Check the whole plan against the ledger before anything runs (the subspace included).
    plan_lib.record_budget(ledger.copy(), budget, accountant)
  k_subspace, k_plan = jax.random.split(key)

  basis, subspace_ok = None, None
  if subspace == "private":
    result = sources.private_gradient_subspace(
        k_subspace, loss_fn, params, data, k=k, epsilon=budget.subspace_epsilon,
        delta=budget.subspace_delta, gamma=gamma, **dpase_kwargs)
    if result.neighboring != NeighboringRelation.ADD_OR_REMOVE_ONE:  # pragma: no cover
      raise RuntimeError("the private subspace must hold under add/remove-one to compose with "
                         f"DP-SGD, got {result.neighboring!r}.")
    subspace_ok = bool(result.ok)
    if subspace_ok:
      basis = result                    # its event is the config's subspace_event (checked)
    else:
      warnings.warn(
          f"the private gradient subspace (DPASE) returned ⊥; training continues as plain "
          f"DP-SGD with the remaining budget (the subspace's ε={budget.subspace_epsilon:.3g}, "
          f"δ={budget.subspace_delta:.2g} is spent).", stacklevel=2)
  elif subspace == "public":
    basis = sources.public_gradient_subspace(loss_fn, params, public_data, k=k).basis
    subspace_ok = True

  plan = config.make(grad_fn, key=k_plan, basis=basis, microbatch_size=microbatch_size,
                     mesh=mesh, data_axis=data_axis, ledger=ledger)
  chain = [optimizer] + ([averaging.iterate_average(weight_ema)] if weight_ema else [])
  optimizer = optax.chain(*chain) if len(chain) > 1 else optimizer
  opt_state = plan.init(params, optimizer)
  data = plan.prepare(data)
  history = []
  for step in _progress(range(steps), progress):
    params, opt_state = plan.step(params, opt_state, data, optimizer)
    if refresh_every is not None and (step + 1) % refresh_every == 0 and step + 1 < steps:
      opt_state = plan.update_bases(
          opt_state, basis=sources.public_gradient_subspace(loss_fn, params, public_data,
                                                            k=k).basis)
    if eval_fn is not None and ((step + 1) % eval_every == 0 or step + 1 == steps):
      shown = params if weight_ema is None else averaging.averaged_params(opt_state)
      history.append({"step": step + 1, **eval_fn(shown)})
  averaged = None if weight_ema is None else averaging.averaged_params(opt_state)
  return TrainResult(params, plan.budget, subspace_ok, history, averaged)


def _progress(iterable, enabled: bool):
  if not enabled:
    return iterable
  try:
    from tqdm.auto import tqdm
  except ImportError:  # tqdm is an optional extra; run without a bar
    return iterable
  return tqdm(iterable, leave=False, desc="DP-SGD")
