"""The DP-SGD plan: one object that binds clipping, batch selection, noise, keys and accounting
(docs/algorithms.md §6; shaped on ``jax_privacy``'s ``DPExecutionPlan``).

A :class:`DPSGDPlan` is one run of a :class:`dpjax.sgd.DPSGDConfig` (the privacy settings,
calibrated once) with

* ``grad_fn``: a sensitivity-bearing clipped-gradient function (:func:`dpjax.sgd.clipped_grad_sum`
  by ``vmap(grad)``, :func:`dpjax.sgd.ghost_clipped_grad_sum`, GEP's
  :func:`dpjax.sgd.embedding_residual_grad_sum`, or ``jax_privacy.clipping.clipped_grad``) that
  carries its ℓ2 bound Δ;
* ``batch_selection``: :class:`dpjax.sgd.sampling.PoissonSampling`, whose ``dp_event`` is each
  step's piece of the plan's event;
* ``noise``: :func:`dpjax.sgd.dp_noise` built from ``grad_fn`` (so it reads Δ) with the release
  map the bases ask for (full, flat basis, per-layer one- or two-sided bases, GEP's embedding and
  residual) — C, σ, Δ and ν cannot disagree between clipping, noise and accountant — holding the
  run's key and step count in its state;
* ``dp_event`` (the config's one event), ``budget`` (ε, δ) and the neighboring relation
  (add/remove-one), and optionally a mesh for data parallelism.

The plan owns its randomness: every step's Poisson sample and noise come from the noise state's
key, split once per step into named purposes (:class:`dpjax.sgd.noise.StepKeys`); users never
pass a per-step key. It owns its step count: :meth:`DPSGDPlan.step` and :meth:`DPSGDPlan.run`
refuse a step past T, an update past T inside a user's own jitted loop is all NaN, and a plan
starts one run only (:meth:`DPSGDPlan.init` once).

It works with any optax optimiser and any params pytree (dicts, Flax NNX ``nnx.split`` state,
Flax Linen params, Equinox arrays): the user's loop calls ``plan.clipped_sum`` and
``plan.transform(optimizer)``, or the jitted :meth:`DPSGDPlan.step` / whole-run
:meth:`DPSGDPlan.run` (one ``lax.scan``).

Privacy (add/remove-one of one example): the released updates of up to T steps — each
``clipped_sum`` with the state it is given, followed by the transform's update of that state —
are ``(plan.epsilon, plan.delta)``-DP: each is the sampled Gaussian mechanism with noise
multiplier σ relative to the sum's sensitivity Δ (times the release map's ν), composed by
``dp_accounting`` with a private subspace release (``dp_event``). Reusing an old optimiser
state, or bases computed non-privately from the training rows, voids it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from typing import Any

import dp_accounting
import jax
import numpy as np
import optax
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import accounting
from dpjax._core.deprecation import renamed_attribute
from dpjax.sgd import config as config_lib
from dpjax.sgd import distributed, gep, noise, quantile_clipping, sampling

_LOG = logging.getLogger("dpjax")    # silent unless the user enables INFO

__all__ = ["DPSGDPlan", "dp_sgd_plan"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPSGDPlan:
  """One DP-SGD run (:meth:`dpjax.sgd.DPSGDConfig.make` or :func:`dp_sgd_plan` makes it; see the
  module docstring).

  Attributes:
    config: the :class:`dpjax.sgd.DPSGDConfig` (privacy settings, calibrated once).
    grad_fn: the clipped-gradient sum (carries Δ as ``l2_norm_bound``).
    batch_selection: the :class:`dpjax.sgd.sampling.PoissonSampling` (N, L, micro-batch size).
    release: the noise's release map (one of :data:`dpjax.sgd.noise.RELEASES`).
    noise: the optax privatiser (:func:`dpjax.sgd.dp_noise`): release map, noise std σΔν,
      division by L; the run's key, step count and bases live in its state.
    mesh: optional ``jax.sharding.Mesh`` the examples are sharded over (data parallelism).
    data_axis: the mesh axis of the examples.

  Two plans are equal (and hash equal, so a jitted step compiled for one serves the other) when
  their programs are: the same config, grad fn, batch selection, release map and mesh. Their
  keys and bases live in the state that :meth:`init` builds, not in the step's code, so the K
  plans of one config (K runs, K keys) compile once.

  Properties read from the config: ``budget``, ``dp_event`` (the event of everything the plan
  releases: a private subspace release composed with the T sampled steps, the tuning's
  repeat-and-select event with ``tuning``; ``NonPrivateDpEvent`` for σ = 0), ``epsilon`` and
  ``delta`` (computed from ``dp_event``), ``noise_multiplier`` σ, ``steps`` T, ``accountant``.
  """
  config: config_lib.DPSGDConfig
  grad_fn: Any
  batch_selection: (sampling.PoissonSampling | sampling.TruncatedPoissonSampling
                    | sampling.CyclicPoissonSampling)
  release: str
  noise: optax.GradientTransformation = dataclasses.field(compare=False)
  mesh: jax.sharding.Mesh | None = None
  data_axis: str = distributed.DATA_AXIS
  # Host-side record of the one run: [steps taken] once init has run (not part of the value).
  _runs: list = dataclasses.field(default_factory=list, compare=False, repr=False)
  # Host-side: the notices already given for this plan (each once).
  _notices: set = dataclasses.field(default_factory=set, compare=False, repr=False)
  # What the noise was made for: (σ, T, N, L) and the run's key data (make_plan sets them).
  _made_for: tuple | None = dataclasses.field(default=None, compare=False, repr=False)
  _origin: tuple | None = dataclasses.field(default=None, compare=False, repr=False)

  def __post_init__(self):
    if self._made_for is None:
      return
    now = (self.noise_multiplier, self.config.steps, self.batch_selection.num_examples,
           self.batch_selection.expected_batch_size)
    if now != self._made_for or (self.config.num_examples, self.config.expected_batch_size) \
        != now[2:]:
      raise ValueError(
          f"this plan's noise was made for (σ, T, N, L) = {self._made_for}, its config and batch "
          f"selection now say {now}: a plan's parts cannot be replaced one by one (the noise would "
          "not match the budget). Make a new plan from the new config.")

  def __repr__(self):
    """One line: the guarantee, σ, T, the batch selection, the release map and Δ (calibrates
    on first use, as ``budget``)."""
    budget = self.budget
    selection = self.batch_selection
    relation = {"ADD_OR_REMOVE_ONE": "add/remove-one", "REPLACE_ONE": "replace-one"}.get(
        budget.neighboring.name, budget.neighboring.name)
    strategy = self.config.noise_strategy
    noise_kind = "independent" if strategy is None else type(strategy).__name__
    return (f"DPSGDPlan(ε={budget.epsilon:.4g}, δ={budget.delta:g} {relation}, "
            f"σ={budget.noise_multiplier:.4g}, T={self.steps}, "
            f"L={selection.expected_batch_size:g} of N={selection.num_examples}, "
            f"{type(selection).__name__}, release={self.release}, noise={noise_kind}, "
            f"Δ={noise.l2_norm_bound(self.grad_fn):g}"
            + ("" if self.mesh is None else f", mesh={dict(self.mesh.shape)}") + ")")

  def __copy__(self):
    return self          # one run: a copy is the same run (its host record included)

  def __deepcopy__(self, memo):
    return self

  @property
  def budget(self) -> accounting.DPSGDBudget:
    return self.config.calibrate()

  @property
  def dp_event(self) -> dp_accounting.DpEvent:
    return self.budget.dp_event

  @property
  def noise_multiplier(self) -> float:
    return self.budget.noise_multiplier

  @property
  def steps(self) -> int:
    return self.config.steps

  @property
  def accountant(self) -> str:
    return self.config.accountant

  @property
  def neighboring(self) -> NeighboringRelation:
    """The relation the guarantee is stated under: add/remove-one (replace-one for fixed-size
    sampling; the config's)."""
    return self.config.neighboring

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
    (post-processing). Its ``init`` is :meth:`init`'s: it starts the plan's one run."""
    _check_optimizer(optimizer)
    if isinstance(self.grad_fn, quantile_clipping.QuantileClippedGradSum):
      # Adaptive clipping: the released count moves C_t after the noise (post-processing).
      chain = optax.chain(self.noise, quantile_clipping.quantile_clip_update(self.grad_fn),
                          optimizer)
    else:
      chain = optax.chain(self.noise, optimizer)

    def init(params):
      self._start_run()
      return chain.init(params)
    return optax.GradientTransformation(init, chain.update)

  def init(self, params, optimizer: optax.GradientTransformation):
    """The optimiser state of :meth:`transform`, which starts this plan's one run (its key
    stream and step count; checks the bases against ``params``). ``plan.transform(opt).init``
    is the same call.

    Raises:
      RuntimeError: the plan's run was started already (a second state would replay its keys:
        the same samples and noise again). Make a new plan, with a new key, from a new budget.
    """
    return self.transform(optimizer).init(params)

  def _log_compile(self, method: str) -> None:
    """An INFO line (logger ``"dpjax"``) before a method's first jitted call, which compiles."""
    if f"compile {method}" not in self._notices:
      self._notices.add(f"compile {method}")
      _LOG.info("plan.%s: compiling the DP-SGD step on its first call (later calls reuse it)…",
                method)

  def _warn_eager(self, method: str, *trees) -> None:
    """Warns once per plan when ``method`` runs op by op outside ``jit`` (issue 53: 3.37 s
    against 0.016 s a step on a small transformer, in silence)."""
    if "eager" in self._notices or v.is_traced(*trees):
      return
    self._notices.add("eager")
    warnings.warn(
        f"plan.{method} is running eagerly (op by op, outside jax.jit): a step this way is "
        "typically 100–200× slower than compiled. Use plan.step / plan.run, or call "
        f"plan.{method} inside your own jitted step function. (Shown once per plan.)",
        UserWarning, stacklevel=3)

  def _start_run(self) -> None:
    if self._runs:
      raise RuntimeError(
          "this plan's run was started already: a second init would replay its key stream (the "
          "same samples and noise). Make another plan (config.make(..., key=new_key)), paid "
          "from its own budget, for another run.")
    self._runs.append(0)             # the steps the plan has taken (host side)

  def _taken(self, steps: int) -> None:
    if self._runs:
      self._runs[0] += steps

  def prepare(self, data):
    """``data`` laid out for :meth:`clipped_sum`: device arrays, sharded over the mesh (padded
    with rows the sampling never draws) when the plan has one. Call once, outside ``jit``."""
    n = self.batch_selection.num_examples
    sizes = {jax.numpy.shape(x)[0] if jax.numpy.ndim(x) else None
             for x in jax.tree_util.tree_leaves(data)}
    if sizes != {n}:
      raise ValueError(f"data must have a leading example axis of num_examples={n} on every "
                       f"leaf, got {sorted(str(s) for s in sizes)}.")
    v.check_no_pixels(data)
    if self.mesh is None:
      return jax.tree_util.tree_map(jax.numpy.asarray, data)
    return distributed.shard_examples(data, self.mesh, self.data_axis)[0]

  def clipped_sum(self, params, data, opt_state):
    """One step's clipped-gradient sum over a fresh Poisson sample (traceable). Feed it to
    :meth:`transform`'s update of the same ``opt_state``.

    The sample is drawn from ``opt_state``'s key (its ``sample`` purpose,
    :class:`dpjax.sgd.noise.StepKeys`); the update then moves the key on, so each step's sample
    is fresh without a key from the user. ``data`` as :meth:`prepare` returns it; ``opt_state``
    from :meth:`init` (GEP's grad sum also splits by the bases held in it, so the split and the
    lift always use the same bases).
    """
    if v.is_key(opt_state):
      raise TypeError("clipped_sum(params, data, opt_state): the plan draws every step's sample "
                      "from its own key stream in opt_state; it takes no key.")
    self._warn_eager("clipped_sum", params, opt_state)
    n = self.batch_selection.num_examples
    v.check_no_pixels(data)                    # dtypes are static: checked under a trace too
    rows = {jax.numpy.shape(x)[0] if jax.numpy.ndim(x) else None
            for x in jax.tree_util.tree_leaves(data)}
    if self.mesh is None and rows != {n}:   # with a mesh, prepare() pads to a multiple
      raise ValueError(f"data must have a leading example axis of num_examples={n} on every "
                       f"leaf, got {sorted(str(r) for r in rows)} (q = L/N is planned for N).")
    state = noise.noise_state(opt_state)
    key = noise.step_keys(state.key).sample
    extra = ((state.bases,) if isinstance(self.grad_fn, gep.EmbeddingResidualGradSum) else
             (quantile_clipping.quantile_clip_state(opt_state).clip_norm,)
             if isinstance(self.grad_fn, quantile_clipping.QuantileClippedGradSum) else ())
    selection = self.batch_selection
    cyclic = isinstance(selection, sampling.CyclicPoissonSampling)
    where = {"step": state.step, "partition_key": noise.partition_key(state)} if cyclic else {}
    if self.mesh is None:
      return selection.clipped_sum(self.grad_fn, params, data, key, *extra, **where)
    return distributed.sharded_chosen_sum(
        self.grad_fn, params, data, selection.chosen(key, **where),
        microbatch_size=selection.microbatch_size, mesh=self.mesh, data_axis=self.data_axis,
        extra_args=extra)

  def update(self, params, opt_state, data, optimizer):
    """One DP-SGD step, traceable: :meth:`clipped_sum`, the transform's update, the new
    params; returns ``(params, opt_state)``. The body of :meth:`step` and :meth:`run`, for a
    user's own ``jit``, ``lax.scan`` or ``vmap`` over the states of several plans.

    Nothing here is recorded on the host: the state it is given names the keys, so give it the
    state the last update returned, once, and under ``vmap`` give every lane its own plan's
    state (an unbatched state would give every lane the same sample and noise)."""
    self._warn_eager("update", params, opt_state)
    summed = self.clipped_sum(params, data, opt_state)
    updates, opt_state = self.transform(optimizer).update(summed, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def step(self, params, opt_state, data, optimizer):
    """One DP-SGD step, jitted: ``(params, opt_state)`` after a fresh Poisson sample.

    ``opt_state`` from :meth:`init` with the same ``optimizer``; ``data`` from :meth:`prepare`.
    The plan and the optimiser are static arguments of the jit: build the optimiser once, not
    inside the loop (a new ``optax.adam(...)`` object compiles the step again).

    Raises:
      ValueError: the budget's T steps were all taken (checked on the host before the step).
    """
    _check_optimizer(optimizer)
    state = noise.noise_state(opt_state)
    self._check_steps_left(state, int(state.step), 1)
    self._log_compile("step")
    out = self._jitted("step")(self, optimizer, params, opt_state, data)
    self._taken(1)
    return out

  def run(self, params, opt_state, data, optimizer, *, steps: int | None = None,
          hook=None, hook_every: int | None = None, progress=False):
    """``steps`` DP-SGD steps (default: all the budget still covers) as one jitted
    ``lax.scan``; returns ``(params, opt_state)``.

    ``progress``: False (default: silent), True (a tqdm bar, which says "compiling" until the
    first chunk has run; needs ``tqdm``, in the ``examples`` extra), or a callable
    ``progress(steps_done, steps_total)`` called on the host. With progress the run is a few
    jitted scans of about T/50 steps each (the same steps, keys and result; a hook keeps its
    schedule), so the host can report between them.

    Calling it again continues the run; the budget covers T steps in all, and a call that would
    go past T raises ``ValueError`` (as :meth:`step` does), before anything runs.

    ``hook(params, opt_state) -> opt_state``, if given, runs after every ``hook_every`` steps
    (default 1) inside the scan: a between-steps change of the state that must be
    post-processing of the releases (e.g. :func:`dpjax.sgd.update_bases` with bases from the
    released updates, ``check=False``); traceable, and it must not read ``data``.
    """
    _check_optimizer(optimizer)
    state = noise.noise_state(opt_state)
    taken = int(state.step)                 # one host read of the count
    steps = (max(self.steps - taken, 1) if steps is None
             else v.check_int(steps, "steps", low=1, high=self.steps))
    self._check_steps_left(state, taken, steps)
    every = 1 if hook_every is None else v.check_int(hook_every, "hook_every", low=1)
    if hook is not None and not callable(hook):
      raise TypeError(f"hook must be callable, got {type(hook).__name__}.")
    if progress is not False and progress is not None:
      return self._run_in_chunks(params, opt_state, data, optimizer, steps, hook, every,
                                 progress)
    self._log_compile("run")
    out = self._jitted("run")(self, optimizer, params, opt_state, data, steps=steps,
                              hook=hook, hook_every=every)
    self._taken(steps)
    return out

  def _run_in_chunks(self, params, opt_state, data, optimizer, steps, hook, every, progress):
    """:meth:`run` as scans of ``chunk`` steps (a multiple of ``hook_every``), reporting after
    each on the host."""
    if progress is True:
      report = _TqdmReport(steps)
    elif callable(progress):
      report = progress
    else:
      raise TypeError(f"progress must be a bool or a callable (done, total), got "
                      f"{type(progress).__name__}.")
    chunk = every * max(1, steps // (50 * every))
    done = 0
    self._log_compile("run")
    try:
      while done < steps:
        size = min(chunk, steps - done)
        params, opt_state = self._jitted("run")(self, optimizer, params, opt_state, data,
                                                steps=size, hook=hook, hook_every=every)
        jax.block_until_ready(params)
        self._taken(size)
        done += size
        report(done, steps)
    finally:
      close = getattr(report, "close", None)
      if close is not None:
        close()
    return params, opt_state

  def steps_taken(self, opt_state) -> int:
    """The updates released so far with ``opt_state`` (host side; read from the noise state, so
    it waits for the step that produced ``opt_state``)."""
    return int(noise.noise_state(opt_state).step)

  def _check_steps_left(self, state, taken: int, steps: int) -> None:
    """Refuses another run's state, a state older than the plan's last step, and steps past T
    (``state`` the noise state, ``taken`` its count read once on the host)."""
    if self._origin is not None and (state.origin is None or tuple(
        int(x) for x in np.asarray(state.origin).reshape(-1)) != self._origin):
      raise RuntimeError(
          "this state is another run's (its key is not this plan's): stepping it here would "
          "replay that run's samples and noise. Pass each plan its own state.")
    if self._runs and taken < self._runs[0]:
      raise RuntimeError(
          f"this state is older than the plan's last step ({taken} steps taken in it, "
          f"{self._runs[0]} by the plan): its keys were used, and stepping it again would "
          "replay a sample and its noise. Pass the state the last step returned.")
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
    return _make_jits()


class _TqdmReport:
  """``report(done, total)`` on a tqdm bar that reads "compiling" until the first chunk ran."""

  def __init__(self, total: int):
    try:
      from tqdm.auto import tqdm
    except ImportError as err:  # an optional extra: say how to get it
      raise ImportError("plan.run(progress=True) draws a tqdm bar: pip install tqdm (or "
                        "'dpjax[examples]'), or pass progress=callable(done, total).") from err
    self.bar = tqdm(total=total, desc="DP-SGD (compiling the step)", unit="step", leave=False)

  def __call__(self, done: int, total: int) -> None:
    del total
    self.bar.set_description("DP-SGD")
    self.bar.update(done - self.bar.n)

  def close(self) -> None:
    self.bar.close()


def _check_optimizer(optimizer):
  if v.is_key(optimizer):
    raise TypeError("the plan draws its own keys from its state: call plan.step(params, "
                    "opt_state, data, optimizer) / plan.run(params, opt_state, data, optimizer) "
                    "without a key.")
  if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
    raise TypeError("optimizer must be an optax GradientTransformation (with init and update), "
                    f"got {type(optimizer).__name__}.")


def _step_impl(plan, optimizer, params, opt_state, data):
  return plan.update(params, opt_state, data, optimizer)


def _run_impl(plan, optimizer, params, opt_state, data, *, steps, hook, hook_every):
  def body(carry, t):
    params, opt_state = plan.update(*carry, data, optimizer)
    if hook is not None:
      opt_state = jax.lax.cond((t + 1) % hook_every == 0,
                               lambda s: _keep_stream(s, hook(params, s)), lambda s: s, opt_state)
    return (params, opt_state), None

  return jax.lax.scan(body, (params, opt_state), jax.numpy.arange(steps))[0]


def _keep_stream(before, after):
  """``after`` (a hook's state) with the noise state's key, step count and origin of
  ``before``: a between-steps hook may swap bases, never move the run's key stream or count."""
  old = noise.noise_state(before)
  return jax.tree_util.tree_map(
      lambda x: dataclasses.replace(x, key=old.key, step=old.step, origin=old.origin)
      if isinstance(x, noise.NoiseState) else x, after,
      is_leaf=lambda x: isinstance(x, noise.NoiseState))


def _make_jits():
  return {"step": jax.jit(_step_impl, static_argnums=(0, 1)),
          "run": jax.jit(_run_impl, static_argnums=(0, 1),
                         static_argnames=("steps", "hook", "hook_every"))}


_STATIC_JIT = _make_jits()


def make_plan(config: config_lib.DPSGDConfig, grad_fn, *, key: jax.Array, basis=None,
              bases=None, microbatch_size: int | None = None,
              mesh: jax.sharding.Mesh | None = None, data_axis: str = distributed.DATA_AXIS,
              ledger=None, tol: float = 1e-3) -> DPSGDPlan:
  """:meth:`dpjax.sgd.DPSGDConfig.make` (its docstring)."""
  noise.l2_norm_bound(grad_fn)
  v.check_key(key)
  if config.tuning is not None and ledger is not None:
    raise ValueError("tuning with a ledger: a plan is one run of the tuning, whose cost is the "
                     "whole tuning's; record accounting.tuning_event(...) in the ledger once.")
  devices = 1 if mesh is None else distributed.check_mesh(mesh, data_axis)
  if config.max_batch_size is not None:
    if mesh is not None or microbatch_size is not None:
      raise ValueError("truncated Poisson sampling sums one static batch of max_batch_size "
                       "rows on one device: give no mesh and no microbatch_size.")
    selection = config.batch_selection
  elif config.fixed_size:
    selection = sampling.fixed_size_sampling(config.num_examples,
                                             int(config.expected_batch_size),
                                             microbatch_size=microbatch_size)
  elif config.cycle_length is not None:
    selection = sampling.cyclic_poisson_sampling(
        config.num_examples, config.expected_batch_size, config.cycle_length,
        microbatch_size=microbatch_size, amplified=config.batch_selection.amplified)
  else:
    selection = sampling.poisson_sampling(config.num_examples, config.expected_batch_size,
                                          microbatch_size=microbatch_size, devices=devices)
  basis, bases, events = _released_bases(basis, bases)
  if isinstance(grad_fn, quantile_clipping.QuantileClippedGradSum) and (
      basis is not None or bases is not None or config.noise_strategy is not None):
    raise ValueError("adaptive clipping releases its count beside the gradient sum in the full "
                     "release with independent noise: give no basis, bases or noise_strategy.")
  if events and tuple(events) != _leaves(config.subspace_event):
    raise ValueError(
        "a basis given as its private release must have its event in the config (σ is "
        f"calibrated with it): the release(s) state {events}, the config's subspace_event is "
        f"{config.subspace_event}. Use DPSGDConfig(..., subspace_event=release), or "
        "dp_sgd_plan(..., basis=release), which does.")
  if events and config.tuning is not None:
    # A tuned config composes its release once, outside the tuning's repetition: every run
    # must use that one release (a release per run would be K releases the event omits).
    given = jax.tree_util.tree_leaves((basis, bases))
    first = config.__dict__.setdefault("_tuned_release", given)
    if len(first) != len(given) or any(a is not b for a, b in zip(first, given)):
      raise ValueError("this config is tuned: its subspace release is composed once, outside "
                       "the tuning's repetition, so every run must use the same release; this "
                       "plan was given another. Release once before the tuning, or do not tune.")
  budget = config.calibrate()
  transform = noise.dp_noise(grad_fn, noise_multiplier=budget.noise_multiplier,
                             expected_batch_size=selection.expected_batch_size, key=key,
                             basis=basis, bases=bases, tol=tol, steps=config.steps,
                             noise_strategy=config.noise_strategy)
  if ledger is not None:
    record_budget(ledger.copy(), budget, config.accountant, selection)   # check the plan first
    record_budget(ledger, budget, config.accountant, selection)
  made_for = (budget.noise_multiplier, config.steps, selection.num_examples,
              selection.expected_batch_size)
  origin = tuple(int(x) for x in np.asarray(noise.key_origin(key)))
  return DPSGDPlan(config=config, grad_fn=grad_fn, batch_selection=selection,
                   release=noise.release_of(grad_fn, basis, bases), noise=transform, mesh=mesh,
                   data_axis=data_axis, _made_for=made_for, _origin=origin)


def _leaves(event) -> tuple:
  """The releases a subspace event stands for (a composition's parts; none for NoOp)."""
  if isinstance(event, dp_accounting.NoOpDpEvent):
    return ()
  if isinstance(event, dp_accounting.ComposedDpEvent):
    return tuple(event.events)
  return (event,)


def dp_sgd_plan(grad_fn, *, num_examples: int, expected_batch_size: float, steps: int,
                key: jax.Array, epsilon: float | None = None, delta: float = 1e-5,
                noise_multiplier: float | None = None, basis=None, bases=None,
                subspace_epsilon: float = 0.0, subspace_delta: float = 0.0,
                subspace_event=None, accountant: str = "pld",
                tuning: accounting.HyperparameterTuning | None = None,
                max_batch_size: int | None = None, noise_strategy=None,
                cycle_length: int | None = None, fixed_size: bool = False,
                microbatch_size: int | None = None, mesh: jax.sharding.Mesh | None = None,
                data_axis: str = distributed.DATA_AXIS, ledger=None,
                tol: float = 1e-3) -> DPSGDPlan:
  """Plans DP-SGD on N examples in one call: ``DPSGDConfig(...).make(...)``.

  >>> import jax, dpjax
  >>> loss = lambda w, ex: (ex[0] @ w - ex[1]) ** 2
  >>> plan = dpjax.sgd.dp_sgd_plan(dpjax.sgd.clipped_grad_sum(loss, clip_norm=1.0),
  ...                              num_examples=1000, expected_batch_size=100, steps=100,
  ...                              noise_multiplier=1.0, accountant="rdp", key=jax.random.key(0))
  >>> plan
  DPSGDPlan(ε=7.904, δ=1e-05 add/remove-one, σ=1, T=100, L=100 of N=1000, PoissonSampling, ...)

  Then train (any params pytree: for a Flax NNX model ``graphdef, params = nnx.split(model,
  nnx.Param)`` and a loss that calls ``nnx.merge(graphdef, p)``)::

      opt = optax.adam(1e-3)      # build once: the optimiser is a static argument of the jit
      opt_state = plan.init(params, opt)
      params, opt_state = plan.run(params, opt_state, plan.prepare((X, y)), opt)

  Give ``epsilon`` (σ calibrated so that the T steps, composed with a private subspace release —
  a release given as a basis, ``subspace_event`` or ``(subspace_epsilon, subspace_delta)`` —
  are ``(epsilon, delta)``-DP) or ``noise_multiplier`` (σ given; the budget is what the
  accountant certifies at ``delta``).

  Privacy: ``(plan.epsilon, plan.delta)``-DP under add/remove-one of one example (replace-one
  with ``fixed_size``: ``plan.budget.neighboring``) for everything computed from the T released
  updates — provided each step's ``clipped_sum`` and transform update share the state the
  previous update returned (as :meth:`DPSGDPlan.step` and :meth:`~DPSGDPlan.run` do; the plan
  draws the keys), at most T times (enforced: ``step`` and ``run`` refuse a call past T, and an
  update past T is all NaN), and the bases are public, a DP release accounted in the config, or
  functions of this run's releases. Each step is the sampled Gaussian mechanism of sensitivity
  Δν (Δ = ``grad_fn.l2_norm_bound``, ν the release map's norm) with noise std σΔν (Abadi et al.
  2016), composed by ``dp_accounting`` (:func:`dpjax.accounting.dpsgd_plan_event`;
  docs/algorithms.md §6.0).

  Args:
    grad_fn: sensitivity-bearing clipped-gradient sum (module docstring).
    num_examples, expected_batch_size, steps: N, L and T (:class:`dpjax.sgd.DPSGDConfig`).
    epsilon, delta, noise_multiplier, accountant: the budget (or σ) and its accountant.
    subspace_event, subspace_epsilon, subspace_delta: a private basis's cost, composed in.
    tuning: a Papernot–Steinke tuning σ is calibrated for (:class:`dpjax.sgd.DPSGDConfig`).
    max_batch_size: B: truncated Poisson sampling, one static batch of B rows a step.
    noise_strategy, cycle_length: correlated (BandMF or BLT) noise with cyclic Poisson
      sampling of cycle ``cycle_length``, default the strategy's bands or min_sep.
    fixed_size: exactly ``expected_batch_size`` examples a step (every figure replace-one; RDP).
    key: the run's PRNG key (every step's sample and noise are drawn from it).
    basis, bases: optional flat basis ``V (p, k)`` or per-layer bases (required by GEP's grad
      sum); :func:`dpjax.sgd.dp_noise`. A private release (e.g.
      :func:`dpjax.sgd.private_input_basis`'s, under add/remove-one) may stand for a basis: its
      ``dp_event`` is composed into the plan, so it cannot be used without its cost (⊥ is
      refused); a public basis is a plain array.
    microbatch_size, mesh, data_axis, ledger, tol: :meth:`dpjax.sgd.DPSGDConfig.make`.

  Returns:
    A :class:`DPSGDPlan`.

  Raises:
    TypeError / ValueError: as :class:`dpjax.sgd.DPSGDConfig` and its ``make``; a release given
      as a basis together with ``subspace_event`` or ``subspace_epsilon/delta``.
    dpjax.ledger.BudgetExceededError: the plan does not fit ``ledger`` (nothing has run).
  """
  events = _released_bases(basis, bases)[2]
  if events:
    if subspace_event is not None or subspace_epsilon > 0 or subspace_delta > 0:
      raise ValueError("a basis given as its release carries its own event: pass it as the "
                       "basis (its cost is composed in) or give subspace_event, not both.")
    subspace_event = accounting.compose_events(*events) if len(events) > 1 else events[0]
  config = config_lib.DPSGDConfig(
      num_examples=num_examples, expected_batch_size=expected_batch_size, steps=steps,
      epsilon=epsilon, delta=delta, noise_multiplier=noise_multiplier, accountant=accountant,
      subspace_event=subspace_event, subspace_epsilon=subspace_epsilon,
      subspace_delta=subspace_delta, tuning=tuning, max_batch_size=max_batch_size,
      noise_strategy=noise_strategy, cycle_length=cycle_length, fixed_size=fixed_size)
  return config.make(grad_fn, key=key, basis=basis, bases=bases,
                     microbatch_size=microbatch_size, mesh=mesh, data_axis=data_axis,
                     ledger=ledger, tol=tol)


def _released_bases(basis, bases):
  """``(basis, bases, events)`` with any private release given as a basis source (a result with
  a ``dp_event``, e.g. :func:`dpjax.sgd.private_input_basis`'s) replaced by its basis, and the
  releases' events (NoOp ones dropped): a private basis cannot lose its cost."""
  events = []

  def unwrap(x):
    if not config_lib.is_release(x):
      return x
    config_lib.check_add_remove(x)
    if not bool(x.ok):
      raise ValueError("the basis release returned ⊥ (its cost is spent; its basis is zeros): "
                       "train without it, or release it again with more rows or budget.")
    if not isinstance(x.dp_event, dp_accounting.NoOpDpEvent):
      events.append(x.dp_event)
    return x.basis

  basis = unwrap(basis)
  if bases is not None:
    bases = jax.tree_util.tree_map(unwrap, bases, is_leaf=config_lib.is_release)
  return basis, bases, events


def record_budget(ledger, budget: accounting.DPSGDBudget, accountant: str | None = None,
                  batch_selection=None) -> None:
  """Records a DP-SGD budget in a :class:`dpjax.ledger.PrivacyLedger`: its subspace release (its
  event) and its T steps (the DP-SGD event); refused, recording nothing, if over budget. Pass
  ``ledger.copy()`` to check a plan before anything runs.

  ``accountant``: the one σ was calibrated with. When it is not the ledger's, the plan is booked
  as its (ε, δ) (an explicit conversion: the ledger's accountant would certify another ε for
  the same events, so a (2, 1e-5) plan calibrated by PLD would not fit a (2, 1e-5) RDP ledger).
  ``batch_selection``: the plan's; a scheme other than Poisson sampling books its own steps'
  event (:func:`dpjax.accounting.dpsgd_event` with it)."""
  if accountant is not None and accountant != ledger.accountant and budget.noise_multiplier > 0:
    ledger.record_approx_dp(budget.epsilon, budget.delta,
                            label=f"DP-SGD plan, its (ε, δ) by the {accountant} accountant",
                            neighboring=budget.neighboring)
    return
  if not isinstance(budget.subspace_event, dp_accounting.NoOpDpEvent):
    ledger.record_event(budget.subspace_event,
                        label="private subspace (composed into the DP-SGD plan)",
                        neighboring=NeighboringRelation.ADD_OR_REMOVE_ONE)
  if budget.noise_multiplier <= 0:
    ledger.record_event(dp_accounting.NonPrivateDpEvent(), label="DP-SGD with σ = 0")
  elif batch_selection is not None and not isinstance(batch_selection, sampling.PoissonSampling):
    ledger.record_event(accounting.dpsgd_event(budget.noise_multiplier, budget.sampling_prob,
                                               budget.steps, batch_selection=batch_selection),
                        label="dp-sgd", neighboring=budget.neighboring)
  else:
    ledger.record_dpsgd(noise_multiplier=budget.noise_multiplier,
                        sampling_prob=budget.sampling_prob, steps=budget.steps)
