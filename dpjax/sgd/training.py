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

  Usage::

      res = dpjax.sgd.train_dp_sgd(key, loss_fn, params, (X, y), optax.adam(1e-3), epsilon=2.0,
                                   delta=1e-5, steps=T, expected_batch_size=256, clip_norm=1.0)

  A thin loop over :class:`dpjax.sgd.DPSGDConfig` (σ calibrated once) and its plan, clipping by
  :func:`dpjax.sgd.clipped_grad_sum`; each step, one jitted program, divides the noised clipped
  sum of a Poisson sample at ``q = L/N`` by L (docs/algorithms.md §6.0, §6.1). For ghost
  clipping, per-layer bases or GEP write the loop with :func:`dpjax.sgd.dp_sgd_plan`.

  Guarantee: ``(budget.epsilon, budget.delta)``-DP under add/remove-one for the rows of ``data``:
  the steps are the Poisson-sampled Gaussian mechanism composed by ``dp_accounting``; a private
  subspace (DPASE with random labels, (ε_s, δ_s)-DP under add/remove-one) is added by basic
  composition (docs/algorithms.md §6.2 route (c)). The initial ``params`` must not depend on
  ``data``; N is treated as public (it sets q and DPASE's public parameters).

  Args:
    key: PRNG key.
    loss_fn: ``loss_fn(params, example) -> scalar`` for one example.
    params, data: the initial parameters (a pytree) and the private training set (a pytree of
      arrays with a leading example axis N).
    optimizer: an optax ``GradientTransformation`` applied to the privatised gradient.
    epsilon, delta, steps, expected_batch_size, clip_norm: the total budget, T, L ≤ N and C.
    subspace, k: ``"none"``; ``"private"`` (DPASE on the per-example gradients at the initial
      params, then SGD on the rest; on ⊥, plain DP-SGD at that σ with a warning, the subspace
      budget spent, never a non-private subspace); or ``"public"`` (from the gradients of
      ``public_data``, free; it must not overlap ``data``); and the subspace's dimension k.
    subspace_epsilon_fraction, subspace_delta_fraction, gamma, dpase_kwargs: ``"private"``'s
      shares of ε and δ in (0, 1), DPASE's gap (or ``cell_length`` in ``dpase_kwargs``) and
      extra DPASE arguments.
    public_data, refresh_every: ``"public"``'s data (like ``data``) and optional refresh period
      in steps (a private refresh would cost budget each time and is not offered).
    microbatch_size: rows per micro-batch (default ``⌈L' + 4√L'⌉``, ``L' = L/D`` for D devices:
      usually one micro-batch).
    eval_fn, eval_every, progress: optional ``eval_fn(params) -> dict`` recorded every
      ``eval_every`` steps; a tqdm progress bar (the ``examples`` extra).
    accountant: ``"pld"`` (default) or ``"rdp"``.
    ledger: optional :class:`dpjax.ledger.PrivacyLedger` (add/remove-one) recording the subspace
      release and the steps, refusing them before they run if over its budget.
    clipping, stability: ``"clip"`` or ``"normalize"`` (``C·g/(‖g‖ + γ)``) and its γ; both
      bound every term by C.
    weight_ema: optional β ∈ (0, 1): an EMA of the iterates from the initial params (warm-up
      ``min(β, (1 + t)/(10 + t))``), returned as ``averaged_params`` and evaluated by
      ``eval_fn``; post-processing, free (docs/algorithms.md §6.8).
    mesh, data_axis: optional ``jax.sharding.Mesh`` (:func:`dpjax.sgd.data_mesh`) and its axis
      (default "data") to shard the examples over: the same guarantee (docs/algorithms.md §6.6).
    tuning: optional :class:`dpjax.accounting.HyperparameterTuning`: σ for one run (call once
      per run) of a Papernot–Steinke tuning whose best of K runs — K drawn by
      :func:`dpjax.accounting.tuning_repetitions`, hyperparameters from a public distribution,
      the best chosen on rows the guarantee does not cover — is (ε, δ)-DP as a whole. Needs
      ``accountant="rdp"``, no private subspace and no ``ledger`` (record
      :func:`dpjax.accounting.tuning_event` once).

  Returns:
    :class:`TrainResult`.

  Raises:
    TypeError: ``key`` not a PRNG key, ``loss_fn`` not callable, ``optimizer`` not an optax
      transformation, ``mesh`` not a Mesh; non-integer ``steps`` / ``k`` / ``microbatch_size``.
    ValueError: NaN/inf in ``data`` or ``public_data``; ε ≤ 0, δ ∉ (0, 1), ``L > N``, C ≤ 0, γ ≤ 0,
      ``weight_ema ∉ (0, 1)``, ``k ∉ [1, p]``, fractions ∉ (0, 1); an unknown ``clipping`` or
      ``subspace``; missing ``k`` / ``public_data`` / ``gamma``; ``refresh_every`` without a
      public subspace; ``data_axis`` not an axis of ``mesh``; no σ meets the budget; ``tuning``
      with ``accountant="pld"``, a private subspace or a ledger.
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
