"""Gradient-subspace routes as complete, jitted DP-SGD training programs (a research harness).

NOT dpjax's public API (see :mod:`dpjax.experiments`): it is a client of it. One function,
:func:`train_route`, trains a model by one of the routes below for many (key, learning rate)
pairs in a single compiled program (``lax.map`` over the pairs, ``lax.scan`` over the steps).
Every DP route runs on the DP-SGD plan users call: one :class:`dpjax.sgd.DPSGDConfig` per call
(σ calibrated once), one plan per run (:func:`route_plans`; the run's key, its samples, noise
and step count are the plan's), the loop ``plan.update`` — the route's clipped-gradient sum,
Poisson batch selection summed in micro-batches, never truncated, and the plan's noise
transform built FROM that sum (it reads Δ). The routes' extras are optax transforms chained
after the noise (denoising, the oracle's and PDP-SGD's projections, GEP's filter of the
releases) and, for GEP, a between-steps hook (:func:`gep_refresh`, the form of
:meth:`dpjax.sgd.DPSGDPlan.run`'s ``hook``). The main job (``python -m dpjax.demo``) and
``benchmarks/gradient_subspace.py`` both run it.

Routes (:data:`ROUTES`); the DP ones release T Poisson-sampled Gaussian sums at the same noise
multiplier σ and are accounted as DP-SGD (:func:`dpjax.accounting.plan_dpsgd_budget`):

* ``non_private``: the same optimiser, sampling and weight averaging without clipping or noise.
* ``dp_sgd``: per-example clipping (``RouteSettings.clipping``, normalised by default), Gaussian
  noise in all p coordinates (``dp_noise``'s ``"full"`` release), Adam, an EMA of the iterates
  (evaluated; post-processing). docs/algorithms.md §6.1.
* ``dp_sgd_denoise``: ``dp_sgd`` followed by :func:`dpjax.sgd.low_rank_denoise` (EMA filter and
  per-layer singular-value shrinkage at the public noise level σΔ/L): post-processing. §6.3.
* ``gep_trajectory`` (no public data): ``dp_sgd`` for a warm-up, then the first layer's
  per-example gradients are split BEFORE clipping by an input-side basis into an embedding and a
  residual, each clipped on its own (:func:`dpjax.sgd.embedding_residual_grad_sum` with
  ``joint=False``: Δ = √2 in scaled units, read by ``dp_noise`` from the grad sum) and noised at
  the same σ. The basis is :func:`dpjax.sgd.trajectory_bases` of an EMA of the RELEASED updates,
  refreshed periodically inside the program (:func:`dpjax.sgd.update_bases` with
  ``check=False``): a function of releases already paid for (post-processing, free). §6.4.
* ``private_input_subspace`` (no public data): DP-PCA of the inputs as Abadi et al. (2016, §5)
  do it. The private rows' inputs are scaled to unit norm (``input_scaling="unit"``, a public
  per-row map; ``"clip"`` clips them to ``input_clip_norm`` instead) and their second moment is
  released by Analyze Gauss with continuous noise under add/remove-one
  (:func:`dpjax.sgd.private_input_basis`, one release per run from its own stream of the run's
  key, :func:`run_keys`); its top-``input_rank`` eigenvectors B ``(d, k)`` are a release. The
  first layer is then TRAINED IN THAT BASIS: the model sees ``Bᵀx`` (k features), its first
  kernel is ``(k, h)`` (initialised as ``√(d/k)·Bᵀ W₀`` from ``init_fn``'s ``W₀``, which keeps
  He scaling), so per-example gradients are clipped and noised in the k·h coordinates only, and
  the returned kernel is ``B W_k`` (d-space: the model takes raw x). The release's σ_p is set by
  its stand-alone ``(input_epsilon_fraction·ε, input_delta_fraction·δ)`` (the PCA's share of the
  noise, a public choice), and its ``GaussianDpEvent(σ_p)`` is composed with the T steps by the
  accountant (:func:`dpjax.accounting.plan_dpsgd_budget`), so the total is (ε, δ) and DP-SGD's σ
  is barely above plain DP-SGD's (Abadi et al. composed their DP-PCA the same way). §6.5.
* ``public_subspace`` (public data): the first layer's noise lives in the top principal
  directions of the public rows' inputs (:func:`dpjax.sgd.public_input_basis`; ``dp_noise``'s
  ``"layers"`` release, after clipping; the basis is public, so its norm bound is a public fact).
  The public rows must not be among ``data``.
* ``public_gradient_subspace`` (public data; PDP-SGD, Zhou, Wu & Banerjee 2021): every
  ``public_gradient_refresh`` steps, V ``(p, k)`` = the top-``public_gradient_rank`` right
  singular vectors of the PUBLIC examples' per-example gradients at the current parameters
  (:func:`dpjax.sgd.public_gradient_subspace`, all parameters flattened); each released noisy
  gradient (``dp_sgd``'s release) is projected to ``V Vᵀ g̃``: post-processing of a DP release by
  a public basis. The public examples ``public_data`` must not be among ``data``.

A diagnostic that is NOT private (:data:`DIAGNOSTIC_ROUTES`, not in :data:`ROUTES`):

* ``oracle_subspace``: ``dp_sgd``'s release with each weight matrix's update projected onto
  ``U Uᵀ (·) V Vᵀ``, U and V the top-``oracle_rank`` left and right singular vectors of the mean
  clipped gradient over ALL of ``data``, recomputed every ``oracle_refresh`` steps. The bases read
  the private rows directly, so the run has no privacy guarantee; it measures how much an exact
  low-rank gradient subspace of a given age could gain (the room a private subspace estimate
  competes for). docs/algorithms.md §6.5.

Privacy: ``(ε, δ)``-DP under add/remove-one of a row of ``data`` for every route but
``non_private`` and the diagnostic, by the PLD (default) or RDP accountant over ``steps``
Poisson-sampled Gaussian releases with sampling rate ``L/N``. Choosing the learning rate on a
tuning split (as the demo and the benchmark do) is not accounted here unless ``tuning`` is given;
the callers say so.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from dpjax import _validation as v
from dpjax import accounting, linalg, sgd
from dpjax.sgd import ghost, noise, sampling, sources

__all__ = ["DENSE_ROUTES", "DIAGNOSTIC_ROUTES", "INPUT_SCALINGS", "PUBLIC_ROUTES", "ROUTES",
           "RouteRun", "RouteSettings", "RunKeys", "first_layer_bases", "gep_edge_noise_std",
           "gep_refresh", "input_basis_event", "route_plans", "route_rank", "run_keys",
           "train_route"]

ROUTES = ("non_private", "dp_sgd", "dp_sgd_denoise", "gep_trajectory", "private_input_subspace",
          "public_subspace", "public_gradient_subspace")
PUBLIC_ROUTES = ("public_subspace", "public_gradient_subspace")
# Routes that act on the first dense layer (a list of dense layers); the others train any params
# pytree (a Flax NNX State, Linen params, an Equinox partition, plain dicts).
DENSE_ROUTES = ("gep_trajectory", "private_input_subspace", "public_subspace", "oracle_subspace")
INPUT_SCALINGS = ("unit", "clip")
DIAGNOSTIC_ROUTES = ("oracle_subspace",)   # not private: see the module docstring


@dataclasses.dataclass(frozen=True)
class RouteSettings:
  """The routes' public hyperparameters (defaults: docs/algorithms.md §6.5).

  Attributes:
    clip_norm: C, the per-example clip norm (the embedding's clip norm for GEP).
    clipping: ``"normalize"`` (``C g/max(‖g‖, stability)``) or ``"clip"``.
    stability: γ of normalised clipping.
    weight_ema: decay of the averaged iterates that are returned (0 returns the last iterate).
    denoise_decay: ``low_rank_denoise``'s EMA filter.
    gep_rank: r of the trajectory basis of the first layer.
    gep_residual_clip: C_ρ / C, the residual's clip norm relative to C.
    gep_warmup: share of the steps run as plain DP-SGD before the projection starts.
    gep_refreshes: number of basis refreshes after the warm-up.
    gep_filter: decay of the EMA of released updates the trajectory bases read.
    gep_edge_scale: None keeps all ``gep_rank`` directions; a number turns on
      :func:`dpjax.sgd.trajectory_bases`' rank rule: a direction is kept only if its singular
      value in the filtered releases exceeds ``gep_edge_scale`` times the noise's bulk edge (the
      public noise std: :func:`gep_edge_noise_std`), so the rank adapts to the noise
      (≤ ``gep_rank``).
    gep_two_sided: the trajectory bases get an output-side factor too
      (:class:`dpjax.sgd.TwoSidedBasis` of the top left and right singular vectors): the
      embedding is ``UᵀGV`` (r × r) and the rest goes to the residual.
    input_rank: rank k of ``private_input_subspace``'s basis (≤ the number of input features;
      Abadi et al. used 60 on MNIST).
    input_epsilon_fraction: the basis release's stand-alone ε as a share of ε (it sets the
      basis's noise; composed with the steps by the accountant it costs DP-SGD far less;
      PROPOSED 0.1; in (0, 1)).
    input_delta_fraction: its stand-alone δ as a share of δ (PROPOSED 0.1; in (0, 1)).
    input_scaling: the public per-row map applied to the inputs for the basis release only:
      ``"unit"`` (default; Abadi et al.) scales every row to norm 1 (C_x = 1; a zero row stays
      0), ``"clip"`` clips rows to ``input_clip_norm``.
    input_clip_norm: with ``input_scaling="clip"``, the public row-norm bound C_x of Analyze
      Gauss (rows above it are scaled down for the basis only; PROPOSED 4, about the norm of a
      digits row scaled to [0, 1]).
    public_rank: rank of the public input subspace.
    public_gradient_rank: k of ``public_gradient_subspace``'s basis of the flattened gradients
      (≤ the public examples and ≤ p; PROPOSED 32).
    public_gradient_refresh: steps between its recomputations (PROPOSED 10; 1: every step).
    oracle_rank: r of ``oracle_subspace``'s left and right bases (capped at each matrix's sides;
      r ≥ both sides of every matrix reproduces ``dp_sgd``).
    oracle_refresh: steps between ``oracle_subspace``'s recomputations of its bases (1: fresh
      every step).
    noise_bands: b ≥ 1; above 1 the runs' noise is BandMF correlated noise with
      :func:`dpjax.sgd.optimal_banded_toeplitz` ``(T, b)`` and cyclic Poisson sampling of cycle b
      (docs/algorithms.md §6.7; not for ``gep_trajectory`` or with tuning).
  """
  clip_norm: float = 1.0
  clipping: str = "normalize"
  stability: float = 0.01
  weight_ema: float = 0.99
  denoise_decay: float = 0.5
  gep_rank: int = 8
  gep_residual_clip: float = 0.3
  gep_warmup: float = 0.2
  gep_refreshes: int = 10
  gep_filter: float = 0.9
  gep_edge_scale: float | None = None
  gep_two_sided: bool = False
  input_rank: int = 16
  input_epsilon_fraction: float = 0.1
  input_delta_fraction: float = 0.1
  input_scaling: str = "unit"
  input_clip_norm: float = 4.0
  public_rank: int = 16
  public_gradient_rank: int = 32
  public_gradient_refresh: int = 10
  oracle_rank: int = 3
  oracle_refresh: int = 1
  noise_bands: int = 1


class RouteRun(NamedTuple):
  """What :func:`train_route` returns.

  Attributes:
    params: the returned (averaged) parameters, each leaf stacked over the (key, learning rate)
      pairs: ``(K, ...)``.
    noise_multiplier: σ (0 for ``non_private``).
    rank: the projected layer's subspace rank (None for routes without a subspace).
    bases: the first layer's basis ``(d, rank)`` at the end: stacked ``(K, d, rank)`` for
      ``gep_trajectory`` (released-only, post-processing; with ``gep_two_sided`` a
      :class:`dpjax.sgd.TwoSidedBasis` of stacked factors), the public basis for
      ``public_subspace``, the released Analyze Gauss bases ``(K, d, rank)`` for
      ``private_input_subspace``, else None (``public_gradient_subspace``'s ``(p, k)`` bases
      change every refresh and are not kept).
    epsilon, delta: the guarantee of ONE run (add/remove-one; None for ``non_private``) — or,
      with ``tuning``, of the tuning's one released run (the best of a drawn number of runs).
    num_runs: K, the runs trained (one per key) on the same rows.
    all_runs_epsilon, all_runs_delta: what releasing all K runs costs, ``(K·ε_1, K·δ)`` by
      basic composition with ε_1 one run's ε at δ (an accountant may give less); None for
      ``non_private``. The K runs are K releases of the same rows: compare them only on data
      the guarantee does not cover, and publish one (or account for all).
  """
  params: Any
  noise_multiplier: float
  rank: int | None
  bases: Any = None
  epsilon: float | None = None
  delta: float | None = None
  num_runs: int = 1
  all_runs_epsilon: float | None = None
  all_runs_delta: float | None = None


def route_rank(route: str, settings: RouteSettings = RouteSettings()) -> int | None:
  """The first layer's subspace rank of ``route`` (None where the noise is in all p)."""
  return {"gep_trajectory": settings.gep_rank, "public_subspace": settings.public_rank,
          "private_input_subspace": settings.input_rank,
          "public_gradient_subspace": settings.public_gradient_rank,
          "oracle_subspace": settings.oracle_rank}.get(route)


def _gep_grad_sum(loss_fn, settings):
  """GEP's clipped-gradient sum of the routes: C_e = C, C_ρ = ``gep_residual_clip``·C, one clip
  per part (``joint=False``: Δ = √2, carried by the returned sum); by ghost norms for a
  :class:`dpjax.sgd.ghost.ModelLoss`."""
  clips = dict(embedding_clip=settings.clip_norm,
               residual_clip=settings.gep_residual_clip * settings.clip_norm, joint=False,
               clipping=settings.clipping, stability=settings.stability)
  if isinstance(loss_fn, ghost.ModelLoss):
    return sgd.ghost_clipped_grad_sum(loss_fn.apply_fn, loss_fn.example_loss, **clips)
  return sgd.embedding_residual_grad_sum(loss_fn, **clips)


def _no_loss(params, example):
  """A placeholder loss: only for reading a grad sum's bound, never called."""
  raise AssertionError("a placeholder loss, only for reading a grad sum's l2_norm_bound")


def gep_edge_noise_std(noise_multiplier: float, expected_batch_size: float,
                       settings: RouteSettings = RouteSettings()) -> float:
  """An upper bound on the per-entry noise std of the filtered releases that ``gep_trajectory``'s
  bases read (public: σ, C, L and the settings only).

  A released first-layer update has i.i.d. noise of std ``σC/L`` in the warm-up (DP-SGD) and, in
  the GEP phase, ``σΔC_ρ/L`` outside the basis and ``σΔ√(C² + C_ρ²)/L`` inside it (Δ = √2, the
  bound GEP's grad sum carries with one clip per part, read from it); the larger of these, times
  the stationary EMA factor ``√((1 − β)/(1 + β))`` (which bounds the EMA's factor from a zero
  start at every step), is returned. With that isotropic bound the rank rule keeps fewer
  directions, never more.
  """
  c, rho, beta = settings.clip_norm, settings.gep_residual_clip, settings.gep_filter
  delta = _gep_grad_sum(_no_loss, settings).l2_norm_bound
  step = noise_multiplier * c / expected_batch_size * max(1.0, delta * math.sqrt(1.0 + rho**2))
  return step * math.sqrt((1.0 - beta) / (1.0 + beta))


def first_layer_bases(params, basis):
  """A bases pytree for a list of dense layers (:func:`dpjax.sgd.bases_like`): ``basis`` for
  ``params[0]["w"]``, None elsewhere."""
  first = (jax.tree_util.SequenceKey(0), jax.tree_util.DictKey("w"))
  return sgd.bases_like(params, lambda path, _: basis if tuple(path) == first else None)


def input_basis_event(eps_s: float, delta_s: float) -> dp_accounting.DpEvent:
  """The event of ``private_input_subspace``'s release at a stand-alone (ε_s, δ_s): Analyze
  Gauss with continuous noise under add/remove-one (:func:`dpjax.sgd.private_input_basis` with
  ``secure=False``), ``GaussianDpEvent(σ(ε_s, δ_s))`` (analytic σ, sensitivity 1 in units of
  C_x²). :func:`train_route` checks that each release states exactly this event."""
  return dp_accounting.GaussianDpEvent(accounting.analytic_gaussian_sigma(eps_s, delta_s))


class RunKeys(NamedTuple):
  """The disjoint streams of one run: one ``split`` of the run's key into named purposes.

  ``plan`` is the key of the run's DP-SGD plan (it draws every step's Poisson sample and noise
  itself, :class:`dpjax.sgd.noise.StepKeys`; ``non_private`` draws its samples from it);
  ``gep_plan`` the key of GEP's second plan (the split phase after the warm-up); ``subspace``
  seeds ``private_input_subspace``'s Analyze Gauss release, a release of its own: it must not
  share randomness with the plans or the initialisation (``init``). Never derive another stream
  from the run's key by ``fold_in``: with JAX's partitionable threefry ``fold_in(key, i)`` is
  ``split(key, n)[i]``.
  """
  init: jax.Array
  plan: jax.Array
  gep_plan: jax.Array
  subspace: jax.Array


def run_keys(key: jax.Array) -> RunKeys:
  """:class:`RunKeys` of a run's key (traceable)."""
  return RunKeys(*jax.random.split(key, 4))


def _unclipped_sum(loss_fn):
  """``non_private``'s sum: the gradient of the mask-weighted sum of the losses, that is the
  per-example gradients summed over the mask without forming them, unclipped (no bound, so no
  noise can be built from it)."""
  def total(params, batch, mask):
    losses = jax.vmap(loss_fn, in_axes=(None, 0))(params, batch)
    return jnp.sum(jnp.where(mask, losses, 0.0))

  return jax.grad(total)


@functools.lru_cache(maxsize=None)
def _grad_fns(route, loss_fn, settings):
  """The route's gradient sums, one per phase (GEP: warm-up, then the split), one object per
  configuration so that repeated calls reuse one compilation."""
  if route == "non_private":
    return (_unclipped_sum(loss_fn),)
  clips = dict(clip_norm=settings.clip_norm, clipping=settings.clipping,
               stability=settings.stability)
  # A model written with dpjax.sgd.dense is clipped by ghost norms (no per-example gradients:
  # 10-100x faster on dense layers; the same sum to float rounding, the same bound C).
  clipped = (sgd.ghost_clipped_grad_sum(loss_fn.apply_fn, loss_fn.example_loss, **clips)
             if isinstance(loss_fn, ghost.ModelLoss) else sgd.clipped_grad_sum(loss_fn, **clips))
  if route == "gep_trajectory":
    return (clipped, _gep_grad_sum(loss_fn, settings))
  return (clipped,)


def _project_top(updates, reference, rank):
  """Each dense layer's ``w`` (a, b) update projected to ``U Uᵀ w V Vᵀ`` with U the top
  ``min(rank, a)`` left and V the top ``min(rank, b)`` right singular vectors of ``reference``'s
  ``w`` (a full SVD, so a rank ≥ a side is the identity on that side); other leaves unchanged."""
  def one(g, ref):
    u, _, vt = jnp.linalg.svd(ref, full_matrices=True)
    left, right = u[:, :rank].astype(g.dtype), vt[:rank].T.astype(g.dtype)
    coefficients = linalg.matmul(linalg.matmul(left.T, g), right)
    return linalg.matmul(linalg.matmul(left, coefficients), right.T)
  return [{name: one(g, reference[i][name]) if name == "w" else g for name, g in layer.items()}
          for i, layer in enumerate(updates)]


def _into_basis(params, basis):
  """A list of dense layers whose first kernel ``W₀ (d, h)`` becomes ``√(d/k)·Bᵀ W₀ (k, h)``,
  the kernel of a model that takes ``Bᵀx`` (``basis`` B ``(d, k)`` orthonormal; the factor keeps
  an init of variance c/d at c/k, He's scaling for k inputs)."""
  d, k = basis.shape
  w = math.sqrt(d / k) * linalg.matmul(basis.T.astype(params[0]["w"].dtype), params[0]["w"])
  return [{**params[0], "w": w}, *params[1:]]


def _from_basis(params, basis):
  """The inverse map for the returned model: first kernel ``B W_k (d, h)`` (takes raw x)."""
  w = linalg.matmul(basis.astype(params[0]["w"].dtype), params[0]["w"])
  return [{**params[0], "w": w}, *params[1:]]


def _public_projection(loss_fn, public, rank):
  """``public_gradient_subspace``'s refresh ``(params, previous, exact) -> (p, rank)``: the top-
  ``rank`` right singular vectors of the public examples' flattened per-example gradients G at
  ``params`` — exactly (:func:`dpjax.sgd.public_gradient_subspace`) when ``exact``, else by two
  steps of subspace iteration ``orth(Gᵀ G V)`` warm-started at the previous basis (PDP-SGD's power
  method; 2·m·p·rank flops instead of an SVD). The previous basis is kept if the result is not
  finite: public data, so the branch reveals nothing private."""
  def exact(params, previous):
    result = sgd.public_gradient_subspace(loss_fn, params, public, k=rank)
    return jnp.where(result.ok, result.basis.astype(previous.dtype), previous)

  def power(params, previous):
    G = sources.flat_per_example_grads(loss_fn, params, public).astype(previous.dtype)
    G = G / jnp.maximum(jnp.max(jnp.abs(G)), jnp.finfo(G.dtype).tiny)   # scale-safe Gram
    basis = previous
    for _ in range(2):
      basis = jnp.linalg.qr(linalg.matmul(G.T, linalg.matmul(G, basis)))[0]
    return jnp.where(jnp.all(jnp.isfinite(basis)), basis, previous)

  def refresh(params, previous, first):
    return jax.lax.cond(first, exact, power, params, previous)
  return refresh


def _project_flat(updates, basis):
  """``V Vᵀ g`` of the flattened update (``basis`` V ``(p, k)``)."""
  flat, unravel = ravel_pytree(updates)
  return unravel(linalg.matmul(basis, linalg.matmul(basis.T, flat)))


class _OracleState(NamedTuple):
  count: jax.Array
  reference: Any


def _oracle_projection(grad_sum, data, rank: int, refresh: int,
                       microbatch_size: int) -> optax.GradientTransformation:
  """``oracle_subspace``'s projection (NOT private: it reads every row of ``data``): each weight
  matrix's update onto ``U Uᵀ (·) V Vᵀ`` of the all-rows mean clipped gradient at the current
  params, recomputed every ``refresh`` updates (:func:`_project_top`)."""
  n = jax.tree_util.tree_leaves(data)[0].shape[0]

  def init(params):
    return _OracleState(jnp.zeros((), jnp.int32), jax.tree_util.tree_map(jnp.zeros_like, params))

  def update(updates, state, params=None):
    def fresh():         # q = 1: every row, whatever the (fixed) key
      total = sampling.poisson_clipped_sum(grad_sum, params, data, jax.random.key(0),
                                           sampling_prob=1.0, microbatch_size=microbatch_size)
      return jax.tree_util.tree_map(lambda s: s / n, total)
    reference = jax.lax.cond(state.count % refresh == 0, fresh, lambda: state.reference)
    return (_project_top(updates, reference, rank),
            _OracleState(state.count + 1, reference))
  return optax.GradientTransformation(init, update)


class _BasisState(NamedTuple):
  count: jax.Array
  basis: jax.Array


def _public_gradient_projection(loss_fn, public, rank: int, every: int, num_params: int
                                ) -> optax.GradientTransformation:
  """PDP-SGD's projection of each release onto ``V Vᵀ`` (post-processing by a public basis):
  V ``(p, rank)`` from the public examples' gradients at the current params, refreshed every
  ``every`` updates (:func:`_public_projection`; exact at the first)."""
  refresh = _public_projection(loss_fn, public, rank)

  def init(params):
    del params
    return _BasisState(jnp.zeros((), jnp.int32), jnp.zeros((num_params, rank), jnp.float32))

  def update(updates, state, params=None):
    basis = jax.lax.cond(state.count % every == 0,
                         lambda: refresh(params, state.basis, state.count == 0),
                         lambda: state.basis)
    return _project_flat(updates, basis), _BasisState(state.count + 1, basis)
  return optax.GradientTransformation(init, update)


class _FilterState(NamedTuple):
  average: Any


def _released_filter(decay: float) -> optax.GradientTransformation:
  """An EMA of the RELEASED updates (passed through unchanged): what GEP's trajectory bases
  read; post-processing."""
  def init(params):
    return _FilterState(jax.tree_util.tree_map(jnp.zeros_like, params))

  def update(updates, state, params=None):
    del params
    return updates, _FilterState(jax.tree_util.tree_map(
        lambda m, x: decay * m + (1 - decay) * x, state.average, updates))
  return optax.GradientTransformation(init, update)


def _filtered(opt_state):
  """The :func:`_released_filter` average inside a chain's state."""
  is_filter = lambda x: isinstance(x, _FilterState)                        # noqa: E731
  found, = [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_filter)
            if is_filter(x)]
  return found.average


def gep_refresh(settings: RouteSettings, edge_std=None):
  """``gep_trajectory``'s between-steps hook ``(params, opt_state) -> opt_state`` (the form of
  :meth:`dpjax.sgd.DPSGDPlan.run`'s ``hook``): the first layer's bases from the EMA of the
  released updates (:func:`dpjax.sgd.trajectory_bases`; the rank rule at ``edge_std`` when
  ``settings.gep_edge_scale`` is set), swapped into GEP's noise state. A function of releases
  already paid for: post-processing, free."""
  def hook(params, opt_state):
    del params
    filt = _filtered(opt_state)
    bases = first_layer_bases(filt, sgd.trajectory_bases(
        [filt[0]], settings.gep_rank, two_sided=settings.gep_two_sided,
        noise_std=None if settings.gep_edge_scale is None else edge_std)[0]["w"])
    return sgd.update_bases(opt_state, bases=bases, check=False)
  return hook


def _optimizer(route, lr, settings, data, public, *, sigma, batch, grad_fn, microbatch_size,
               num_params, loss_fn):
  """The route's optax chain after the plan's noise: its extras as transforms (denoising, the
  oracle's or PDP-SGD's projection, GEP's filter of the releases), Adam at ``lr``, the EMA of
  the iterates (``settings.weight_ema > 0``). ``lr``, ``data`` and ``public`` may be traced."""
  parts = []
  if route == "dp_sgd_denoise":
    # The released noise per entry of the averaged update: σΔ/L (Δ = C, the grad sum's bound).
    parts.append(sgd.low_rank_denoise(sigma * grad_fn.l2_norm_bound / batch,
                                      decay=settings.denoise_decay))
  elif route == "oracle_subspace":
    parts.append(_oracle_projection(grad_fn, data, settings.oracle_rank,
                                    settings.oracle_refresh, microbatch_size))
  elif route == "public_gradient_subspace":
    parts.append(_public_gradient_projection(loss_fn, public,
                                             settings.public_gradient_rank,
                                             settings.public_gradient_refresh, num_params))
  elif route == "gep_trajectory":
    parts.append(_released_filter(settings.gep_filter))
  parts.append(optax.adam(lr))
  if settings.weight_ema > 0:
    parts.append(sgd.iterate_average(settings.weight_ema))
  return optax.chain(*parts)


def _returned(params, opt_state, settings):
  """The run's returned params: the EMA of the iterates, or the last iterate."""
  return sgd.averaged_params(opt_state) if settings.weight_ema > 0 else params


@functools.partial(jax.jit, static_argnames=("plan", "gep_plan", "route", "steps", "settings",
                                             "loss_fn"))
def _train(lrs, X, y, params, states, gep_noise, run_data, public, edge_std, *, plan, gep_plan,
           route, steps, settings, loss_fn):
  """The DP runs, one after another (``lax.map``), each a loop of ``plan.update`` (run k's state
  holds run k's plan key: the K plans of one config share their step code). ``gep_noise``: GEP's
  second plan's noise states; ``run_data``: ``private_input_subspace``'s per-run ``(Bᵀx rows,
  B)``, else None; ``public``: the public examples of ``public_gradient_subspace``, else None."""
  num_params = sum(math.prod(x.shape[1:]) for x in jax.tree_util.tree_leaves(params))

  def one(lr, params, state, gep_state, run):
    data = (X, y) if run is None else (run[0], y)
    optimizer = _optimizer(route, lr, settings, data, public, sigma=plan.noise_multiplier,
                           batch=plan.batch_selection.expected_batch_size, grad_fn=plan.grad_fn,
                           microbatch_size=plan.batch_selection.microbatch_size,
                           num_params=num_params, loss_fn=loss_fn)

    def steps_of(p, count):
      def body(carry, _):
        return p.update(*carry, data, optimizer), None
      return lambda carry: jax.lax.scan(body, carry, None, length=count)[0]

    if route != "gep_trajectory":
      params, state = steps_of(plan, steps)((params, state))
      out = _returned(params, state, settings)
      return (out if run is None else _from_basis(out, run[1])), None
    warm_steps, period, periods = _gep_phases(steps, settings)
    params, state = steps_of(plan, warm_steps)((params, state))
    # The split phase: GEP's plan's noise state, the optimiser's states carried on.
    state = (gep_state,) + tuple(state[1:])
    hook = gep_refresh(settings, edge_std)

    def period_body(carry, _):
      params, state = carry
      return steps_of(gep_plan, period)((params, hook(params, state))), None

    (params, state), _ = jax.lax.scan(period_body, (params, state), None, length=periods)
    return _returned(params, state, settings), noise.noise_state(state).bases[0]["w"]

  # Runs one after another inside the program (lax.map), not vmapped: on XLA:CPU (jaxlib
  # 0.10.2) a vmapped while_loop (the Poisson sum) next to an SVD in one scan body deadlocked.
  return jax.lax.map(lambda a: one(*a), (lrs, params, states, gep_noise, run_data))


def _gep_phases(steps: int, settings: RouteSettings) -> tuple[int, int, int]:
  """GEP's warm-up steps, refresh period and number of periods (≤ T steps in all)."""
  warm_steps = max(1, round(settings.gep_warmup * steps))
  period = max(1, (steps - warm_steps) // settings.gep_refreshes)
  return warm_steps, period, max(1, (steps - warm_steps) // period)


@functools.partial(jax.jit, static_argnames=("steps", "settings", "loss_fn", "selection"))
def _train_non_private(keys, lrs, X, y, params, *, steps, settings, loss_fn, selection):
  """``non_private``: the same sampling, optimiser and averaging, unclipped and noiseless (not
  DP: no plan); each run's samples from its ``plan`` stream."""
  grad_sum = _unclipped_sum(loss_fn)
  batch = selection.expected_batch_size

  def one(key, lr, params):
    optimizer = _optimizer("non_private", lr, settings, None, None, sigma=0.0, batch=batch,
                           grad_fn=None, microbatch_size=None, num_params=None, loss_fn=loss_fn)

    def body(carry, k):
      params, state = carry
      total = selection.clipped_sum(grad_sum, params, (X, y), k)
      g = jax.tree_util.tree_map(lambda s: s / batch, total)
      updates, state = optimizer.update(g, state, params)
      return (optax.apply_updates(params, updates), state), None

    (params, state), _ = jax.lax.scan(body, (params, optimizer.init(params)),
                                      jax.random.split(run_keys(key).plan, steps))
    return _returned(params, state, settings)
  return jax.lax.map(lambda a: one(*a), (keys, lrs, params))


class _Tree(NamedTuple):
  """The hashable description of a params pytree that is not a list of dense layers."""
  treedef: Any
  leaves: tuple


def _template(shapes):
  """float32 zeros shaped as :func:`_shapes` describes."""
  if isinstance(shapes, _Tree):
    return jax.tree_util.tree_unflatten(shapes.treedef,
                                        [jnp.zeros(s, jnp.float32) for s in shapes.leaves])
  return [{name: jnp.zeros(shape, jnp.float32) for name, shape in layer} for layer in shapes]


def _shapes(params, route: str = "dense") -> tuple:
  """A hashable description of a list of dense layers ``[{"w": (a, b), "b": (b,)}, ...]``, or for
  a route outside :data:`DENSE_ROUTES` of any params pytree (a :class:`_Tree`)."""
  if not (isinstance(params, (list, tuple)) and params
          and all(isinstance(layer, dict) and "w" in layer for layer in params)):
    if route not in DENSE_ROUTES and jax.tree_util.tree_leaves(params):
      leaves, treedef = jax.tree_util.tree_flatten(params)
      return _Tree(treedef, tuple(tuple(jnp.shape(x)) for x in leaves))
    raise ValueError("the routes train a list of dense layers [{'w': (a, b), 'b': (b,)}, ...] "
                     f"({', '.join(DENSE_ROUTES)} act on the first one; the others take any "
                     f"params pytree); init_fn returned {type(params).__name__}.")
  if jnp.ndim(params[0]["w"]) != 2:
    raise ValueError(f"the first layer's 'w' must be a matrix, got shape "
                     f"{jnp.shape(params[0]['w'])}.")
  return tuple(tuple(sorted((name, tuple(jnp.shape(x))) for name, x in layer.items()))
               for layer in params)


def _unit_rows(X: np.ndarray) -> np.ndarray:
  """Each row scaled to norm 1 (a zero row stays 0): a public per-row map (float64, host)."""
  X = np.asarray(X, np.float64)
  norms = np.linalg.norm(X, axis=1, keepdims=True)
  return np.divide(X, norms, out=np.zeros_like(X), where=norms > 0)


def _private_input_bases(keys, X, eps_s, delta_s, settings, event):
  """One Analyze Gauss release per run (:func:`dpjax.sgd.private_input_basis` from the run's
  ``subspace`` stream, continuous noise: the Gaussian ``event`` σ was calibrated with), on the
  rows scaled by ``settings.input_scaling``; returns ``(Bᵀx rows (K, N, k), B (K, d, k))``,
  float32, the projections of the raw rows the model trains on."""
  unit = settings.input_scaling == "unit"
  rows = _unit_rows(X) if unit else X
  clip = 1.0 if unit else settings.input_clip_norm
  bases = []
  for key in keys:
    release = sgd.private_input_basis(run_keys(key).subspace, rows, settings.input_rank,
                                      epsilon=eps_s, delta=delta_s, clip_norm=clip, secure=False)
    if release.dp_event != event:            # the accounted release is the one made
      raise RuntimeError(f"the release is {release.dp_event}, σ was calibrated for {event}.")
    bases.append(np.asarray(release.basis, np.float32))
  bases = np.stack(bases)
  X = np.asarray(X, np.float32)
  # One BLAS product per run (np.einsum's default path is a plain loop: 112 s against ~6 s
  # for the main job's 54,000 × 3,969 rows and rank 2,048).
  return np.stack([X @ B for B in bases]), bases


def train_route(route: str, keys: jax.Array, learning_rates, data, *, init_fn: Callable,
                loss_fn: Callable, epsilon: float | None, delta: float | None, steps: int,
                expected_batch_size: int, public_inputs=None, public_data=None,
                settings: RouteSettings = RouteSettings(),
                accountant: str = "pld",
                tuning: accounting.HyperparameterTuning | None = None) -> RouteRun:
  """Trains one route (see the module docstring) once per (key, learning rate) pair.

  Each run: ``params = init_fn(k_init)``; ``steps`` steps of its plan (:func:`route_plans`):
  Poisson sampling (rate ``L/N``) summed in micro-batches (never truncated) by the route's
  clipped-gradient sum, the plan's noise (σΔν, division by L), the route's extras, Adam;
  returns the EMA of the iterates. Keys: one split of each run's key into init, plan, GEP's
  second plan and subspace streams (:func:`run_keys`); each plan draws its samples and noise
  from its own key.

  Privacy: every route of :data:`ROUTES` but ``non_private`` is ``(ε, δ)``-DP under add/remove-one
  of a row of ``data`` (σ calibrated by ``accountant`` over ``steps`` Poisson-sampled Gaussian
  releases; the noise reads Δ from the route's grad sum — GEP's two clipped parts are noised at
  σ times their joint sensitivity √2; the trajectory bases read released updates only; the
  public basis reads ``public_inputs`` only; ``private_input_subspace``'s basis is an Analyze
  Gauss release (add/remove-one, sensitivity C_x² on the scaled rows) whose
  ``GaussianDpEvent`` the accountant composes with the steps to a total ``(ε, δ)``, and the model
  trained in that basis is post-processing of it; ``public_gradient_subspace``'s bases read
  ``public_data`` only). ``oracle_subspace`` (:data:`DIAGNOSTIC_ROUTES`) is NOT private: its bases read
  all of ``data``.

  The guarantee is per run. The K runs are K releases of the same rows: releasing all of them,
  or choosing among them by anything computed from ``data``, costs more — up to ``K·ε`` by basic
  composition (``RouteRun.all_runs_epsilon``). The learning rates are public inputs: choosing
  them on private rows is a cost this function does not account, except through ``tuning``:
  then σ is calibrated (RDP) so that Papernot & Steinke's random-stopping tuning — draw K by
  :func:`dpjax.accounting.tuning_repetitions`, train K runs with learning rates drawn from a
  public distribution, release only the best by a score on rows the guarantee does not cover —
  is (ε, δ)-DP as a whole (:func:`dpjax.accounting.tuning_event`). The caller draws K and the
  rates; this function trains whatever runs it is given.

  Args:
    route: one of :data:`ROUTES` or :data:`DIAGNOSTIC_ROUTES`.
    keys: ``(K,)`` typed PRNG keys, one per run.
    learning_rates: ``(K,)`` Adam learning rates, one per run.
    data: ``(X (N, d) float32, y (N,) int)``, the private rows.
    init_fn: ``key -> params``: for :data:`DENSE_ROUTES` a list of dense layers
      ``[{"w": (a, b), "b": (b,)}, ...]`` whose first ``w`` takes the inputs (``a = d``); for the
      other routes any params pytree (a Flax NNX ``State``, Linen params, ...; traceable in the
      key). Pass the same object to reuse the compilation.
    loss_fn: ``loss_fn(params, (x, y)) -> ()`` for one example.
    epsilon, delta: the total budget (ignored, may be None, for ``non_private``).
    steps: T.
    expected_batch_size: L (``L ≤ N``).
    public_inputs: ``(n_pub, d)`` public rows for ``public_subspace`` (disjoint from ``data``).
    public_data: ``(X_pub (m, d), y_pub (m,))`` public examples for
      ``public_gradient_subspace`` (disjoint from ``data``; ``m ≥ public_gradient_rank``).
    settings: the routes' hyperparameters.
    accountant: ``"pld"`` or ``"rdp"``.
    tuning: optional :class:`dpjax.accounting.HyperparameterTuning` (above; needs
      ``accountant="rdp"``; not for ``private_input_subspace``, whose basis is released once
      per run and would be repeated with it).

  Returns:
    :class:`RouteRun` (params stacked over the K runs, σ, the subspace rank, one run's
    guarantee and what all K cost together).

  Raises:
    ValueError: an unknown route, mismatched keys and learning rates, ``public_subspace``
      without ``public_inputs`` or ``public_gradient_subspace`` without ``public_data`` (or
      another route with them; bad shapes, a rank above the public examples or above p), for
      :data:`DENSE_ROUTES` a model that is not a list of dense layers,
      bad sizes, ``settings.gep_edge_scale`` not None and not > 0, ``settings.oracle_rank`` or
      ``settings.oracle_refresh`` < 1; for ``private_input_subspace`` ``settings.input_rank``
      outside ``[1, d]``, a fraction outside (0, 1), ``input_scaling`` not in
      :data:`INPUT_SCALINGS` or ``input_clip_norm`` not > 0.
      With ``tuning``: a bad mean or shape, ``accountant="pld"``, or ``private_input_subspace``.
    TypeError: ``settings.oracle_rank``, ``settings.oracle_refresh`` or ``settings.input_rank``
      not an integer; ``tuning`` not a :class:`dpjax.accounting.HyperparameterTuning`.
  """
  if route not in ROUTES + DIAGNOSTIC_ROUTES:
    raise ValueError(f"route must be one of {ROUTES + DIAGNOSTIC_ROUTES}, got {route!r}.")
  X, y = (np.asarray(a) for a in data)
  if X.ndim != 2 or y.shape != (X.shape[0],):
    raise ValueError(f"data must be (X (N, d), y (N,)), got shapes {X.shape} and {y.shape}.")
  n, d = X.shape
  steps = v.check_int(steps, "steps", low=1)
  batch = v.check_int(expected_batch_size, "expected_batch_size", low=1)
  if batch > n:
    raise ValueError(f"expected_batch_size={batch} exceeds the {n} rows of data.")
  lrs = np.asarray(learning_rates, np.float32).reshape(-1)
  if keys.shape[:1] != lrs.shape or not np.all(np.isfinite(lrs) & (lrs > 0)):
    raise ValueError(f"keys {keys.shape} and learning_rates {lrs.shape} must pair up, with "
                     "learning rates > 0.")
  if (route == "public_subspace") != (public_inputs is not None):
    raise ValueError("public_inputs is needed by public_subspace and only by it.")
  if (route == "public_gradient_subspace") != (public_data is not None):
    raise ValueError("public_data is needed by public_gradient_subspace and only by it.")
  shapes = _shapes(jax.eval_shape(init_fn, keys[0]), route)
  if not isinstance(shapes, _Tree) and dict(shapes[0])["w"][0] != d:
    raise ValueError(f"the first layer takes {dict(shapes[0])['w'][0]} inputs, data has {d}.")
  basis = np.zeros((d, settings.public_rank), np.float32)
  if route == "public_subspace":
    public_inputs = np.asarray(public_inputs, np.float32)
    if public_inputs.ndim != 2 or public_inputs.shape[1] != d:
      raise ValueError(f"public_inputs must be (n_pub, {d}), got {public_inputs.shape}.")
    if not settings.public_rank <= min(public_inputs.shape):
      raise ValueError(f"public_rank={settings.public_rank} exceeds the public rows' "
                       f"{public_inputs.shape}.")
    basis = sgd.public_input_basis(public_inputs, settings.public_rank)
  if route == "public_gradient_subspace":
    X_pub, y_pub = (np.asarray(a) for a in public_data)
    if X_pub.ndim != 2 or X_pub.shape[1] != d or y_pub.shape != X_pub.shape[:1]:
      raise ValueError(f"public_data must be (X_pub (m, {d}), y_pub (m,)), got shapes "
                       f"{X_pub.shape} and {y_pub.shape}.")
    p = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(_template(shapes)))
    v.check_int(settings.public_gradient_rank, "settings.public_gradient_rank", low=1,
                high=min(len(y_pub), p))
    v.check_int(settings.public_gradient_refresh, "settings.public_gradient_refresh", low=1)
    public_data = (jnp.asarray(X_pub, jnp.float32), jnp.asarray(y_pub))
  v.check_int(settings.oracle_rank, "settings.oracle_rank", low=1)
  v.check_int(settings.oracle_refresh, "settings.oracle_refresh", low=1)
  scale = settings.gep_edge_scale
  if scale is not None:
    scale = v.check_positive(scale, "settings.gep_edge_scale")
  private_input = route == "private_input_subspace"
  if private_input:
    v.check_int(settings.input_rank, "settings.input_rank", low=1, high=d)
    for name in ("input_epsilon_fraction", "input_delta_fraction"):
      if not 0.0 < float(getattr(settings, name)) < 1.0:
        raise ValueError(f"settings.{name} must lie in (0, 1), got {getattr(settings, name)}.")
    if settings.input_scaling not in INPUT_SCALINGS:
      raise ValueError(f"settings.input_scaling must be one of {INPUT_SCALINGS}, got "
                       f"{settings.input_scaling!r}.")
    v.check_positive(settings.input_clip_norm, "settings.input_clip_norm")
  # The basis's stand-alone (ε_s, δ_s) (private_input_subspace only); its Gaussian event is
  # composed with the SGD steps by the accountant.
  eps_s = settings.input_epsilon_fraction * float(epsilon) if private_input else 0.0
  delta_s = settings.input_delta_fraction * float(delta) if private_input else 0.0
  sub_event = input_basis_event(eps_s, delta_s) if private_input else None
  if tuning is not None:
    tuning = accounting.check_tuning(tuning)
    if route == "non_private":
      tuning = None                       # nothing private to tune: the argument is ignored
    if private_input:
      raise ValueError("tuning cannot repeat private_input_subspace's subspace release: each "
                       "run releases its own basis, and a tuned config composes one release "
                       "once; run the route untuned.")
  selection = sampling.poisson_sampling(n, batch)
  static = dataclasses.replace(settings, gep_edge_scale=None if scale is None else 1.0)
  X32, y = jnp.asarray(X, jnp.float32), jnp.asarray(y)
  streams = [run_keys(key) for key in keys]
  strategy = None
  if v.check_int(settings.noise_bands, "settings.noise_bands", low=1) > 1 and (
      route != "non_private"):
    if route == "gep_trajectory" or tuning is not None:
      raise ValueError("settings.noise_bands > 1 (BandMF noise) runs on one plan a run, "
                       "untuned: not for gep_trajectory (two plans) or with tuning.")
    strategy = sgd.optimal_banded_toeplitz(steps, settings.noise_bands)
  if route == "non_private":
    sigma, bases = 0.0, None
    params = _train_non_private(keys, jnp.asarray(lrs), X32, y,
                                _stack([init_fn(s.init) for s in streams]), steps=steps,
                                settings=static, loss_fn=loss_fn, selection=selection)
  else:
    # The privacy settings, calibrated once for all K runs (each run is a plan of this config).
    config = sgd.DPSGDConfig(num_examples=n, expected_batch_size=batch, steps=steps,
                             epsilon=float(epsilon), delta=float(delta), accountant=accountant,
                             subspace_event=sub_event, tuning=tuning,
                             noise_strategy=strategy)
    sigma = config.calibrate().noise_multiplier
    # The edge's scale is folded into the traced noise level (a scale sweep compiles once).
    edge_std = jnp.float32(0.0 if route != "gep_trajectory" else
                           (1.0 if scale is None else scale)
                           * gep_edge_noise_std(float(sigma), batch, settings))
    run_data = None
    inits = [init_fn(s.init) for s in streams]
    if private_input:      # the model trained in the basis: its first kernel is (k, h)
      run_data = _private_input_bases(keys, X, eps_s, delta_s, settings, sub_event)
      inits = [_into_basis(p, B) for p, B in zip(inits, run_data[1])]
    plans, gep_plans = route_plans(route, config, streams, inits[0], static, loss_fn, basis)
    host = [_optimizer(route, lr, static, (X32, y), public_data, sigma=sigma, batch=batch,
                       grad_fn=plans[0].grad_fn, microbatch_size=plans[0].batch_selection
                       .microbatch_size, num_params=_num_params(inits[0]), loss_fn=loss_fn)
            for lr in lrs]
    states = [plan.init(p, opt) for plan, p, opt in zip(plans, inits, host)]
    gep_plan, gep_noise = None, None
    if route == "gep_trajectory":
      gep_plan = gep_plans[0]
      gep_noise = _stack([noise.noise_state(p.init(q, opt))
                          for p, q, opt in zip(gep_plans, inits, host)])
      warm, period, periods = _gep_phases(steps, static)
      if warm + period * periods > config.steps:     # pragma: no cover - by construction
        raise RuntimeError("GEP's two phases would take more steps than the config covers.")
    params, bases = _train(jnp.asarray(lrs), X32, y, _stack(inits), _stack(states), gep_noise,
                           run_data, public_data, edge_std, plan=plans[0], gep_plan=gep_plan,
                           route=route, steps=steps, settings=static, loss_fn=loss_fn)
  if route == "public_subspace":
    bases = jnp.asarray(basis)
  elif private_input:
    bases = jnp.asarray(run_data[1])
  guarantee = {} if route == "non_private" else _run_guarantee(
      float(epsilon), float(delta), len(lrs), sigma, batch / n, steps, accountant, tuning,
      private=route in ROUTES)
  return RouteRun(params, float(sigma), route_rank(route, settings), bases, num_runs=len(lrs),
                  **guarantee)


def route_plans(route: str, config, streams, params, settings: RouteSettings, loss_fn,
                basis=None):
  """The DP-SGD plans of a route's runs, one per run (its ``RunKeys.plan`` key) from ONE config
  (σ calibrated once): the route's clipped-gradient sum, and the public input basis on the first
  layer for ``public_subspace``; for ``gep_trajectory`` also the split phase's plans (GEP's grad
  sum, a public placeholder basis that the released trajectory bases replace in the trace, keys
  ``RunKeys.gep_plan``). The warm-up and the split take T steps in all, the config's T: one run's
  releases are T sampled Gaussian steps at σ, as the config accounts them. Returns ``(plans,
  gep_plans)`` (``gep_plans`` None for the other routes)."""
  grad_fns = _grad_fns(route, loss_fn, settings)
  layer_bases = first_layer_bases(params, basis) if route == "public_subspace" else None
  plans = [config.make(grad_fns[0], key=s.plan, bases=layer_bases) for s in streams]
  if route != "gep_trajectory":
    return plans, None
  placeholder = first_layer_bases(params, _gep_placeholder(_shapes(params), settings))
  return plans, [config.make(grad_fns[1], key=s.gep_plan, bases=placeholder) for s in streams]


def _stack(trees):
  """The runs' pytrees stacked on a leading axis (``lax.map``'s)."""
  return jax.tree_util.tree_map(lambda *x: jnp.stack(x), *trees)


def _num_params(params) -> int:
  return sum(math.prod(jnp.shape(x)) for x in jax.tree_util.tree_leaves(params))


def _gep_placeholder(shapes, settings):
  """The public placeholder basis GEP's plan is made with; the released trajectory bases replace
  it in the trace (``update_bases(check=False)``: the GEP release's noise σΔ does not depend on
  the bases)."""
  in_dim, out_dim = dict(shapes[0])["w"]
  rank = min(settings.gep_rank, out_dim)     # trajectory_bases' column count
  placeholder = np.eye(in_dim, rank, dtype=np.float32)
  if settings.gep_two_sided:
    placeholder = sgd.TwoSidedBasis(placeholder, np.eye(out_dim, rank, dtype=np.float32))
  return placeholder


def _run_guarantee(epsilon, delta, runs, sigma, q, steps, accountant, tuning, *, private):
  """``RouteRun``'s guarantee fields: one run's (or the tuning's) (ε, δ) and all runs' cost by
  basic composition (one run alone: ε_1 at σ and δ; with a subspace share, the target ε)."""
  if not private:                            # oracle_subspace: no guarantee at all
    return {}
  one = epsilon if tuning is None else accounting.dpsgd_epsilon(sigma, q, steps, delta,
                                                                accountant=accountant)
  return dict(epsilon=epsilon, delta=delta, all_runs_epsilon=runs * one,
              all_runs_delta=min(1.0, runs * delta))
