"""DP-SGD's one noise transform: a linear release map of the clipped sum plus Gaussian noise
(docs/algorithms.md §6.1–§6.4).

:func:`dp_noise` is an optax ``GradientTransformation`` that takes the SUM of clipped
per-example gradients and returns a noisy average divided by the public expected batch size L,
so it chains with any optax optimiser. It is built FROM the clipped-gradient function, whose
``l2_norm_bound`` Δ it reads, and it reads the release map's norm bound ν from its own state, so
the clip norm, the noise and the accountant's σ cannot disagree. The release map is one of:

==================  ======================================  ==================================
release             what one step releases                  ν (noise std σΔν)
==================  ======================================  ==================================
``"full"``          ``S + N(0, σ²Δ² I)``, every coordinate  1
``"flat"``          ``Vᵀ ravel(S) + N(0, s² I_k)``, then     ``max(1, ν̂(V))``
                    lifted by V (``basis=V (p, k)``)
``"layers"``        per leaf ``U_ℓᵀ S_ℓ [V_ℓ] + N(0, s²)``,  ``max(1, max_ℓ ν̂_ℓ)``
                    lifted by ``U_ℓ (·) [V_ℓᵀ]``; leaves
                    without a basis get full noise
                    (``bases=`` pytree)
``"embedding_       GEP's scaled embedding and residual     1 (the split happens before
residual"``         sums, each coordinate ``N(0, σ²Δ²)``,   clipping: Δ bounds the pair
                    lifted by ``C_e U_ℓ (·) [V_ℓᵀ]`` and    whatever the bases)
                    ``C_ρ`` (needs GEP's grad sum and
                    ``bases=``)
==================  ======================================  ==================================

Privacy (add/remove-one): the clipped sum S has ℓ2-sensitivity Δ (the grad sum's
``l2_norm_bound``), the release map M has ``‖M‖₂ ≤ ν``, so ``M S + N(0, σ²Δ²ν² I)`` is the
Gaussian mechanism with noise multiplier σ; with Poisson sampling each step is the sampled
Gaussian mechanism of :func:`dpjax.accounting.dpsgd_event`. Lifting back, dividing by L and the
optimiser are post-processing. The noise is drawn in the gradients' dtype (at least float32 for
the coefficients of a basis); the floating-point caveat of §1.10 is not addressed inside DP-SGD,
as in every DP-SGD library. Bases must be public, DP releases whose cost is composed in, or
functions of earlier releases of this run (:func:`dpjax.sgd.trajectory_bases`).

Keys: the state's key is split once per update into named purposes (:class:`StepKeys`: the
next state's key, the noise, GEP's residual noise, and the step's Poisson sample, which
:meth:`dpjax.sgd.DPSGDPlan.clipped_sum` draws from the same state before the update), never
reused; every release map splits alike. With every leaf given an identity basis (or a flat
identity basis) the draws equal the full release's (tested).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from dpjax import _validation as v
from dpjax import linalg
from dpjax.sgd import bases as bases_lib
from dpjax.sgd import correlation, gep

__all__ = ["RELEASES", "NoiseState", "StepKeys", "check_noise_strategy", "dp_noise",
           "l2_norm_bound", "noise_state", "partition_key", "release_of", "step_keys",
           "update_bases"]

RELEASES = ("full", "flat", "layers", "embedding_residual")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["key", "bases", "base_std", "noise_std", "step", "origin",
                                "correlation"],
                   meta_fields=["release", "steps", "noise_strategy"])
@dataclasses.dataclass(frozen=True)
class NoiseState:
  """The state of :func:`dp_noise` (one type for every release map).

  Attributes:
    key: PRNG key, split at every update (never reused; :func:`update_bases` keeps it).
    bases: None (``"full"``), the flat basis ``V (p, k)`` (``"flat"``), or a per-layer bases
      pytree (``"layers"``, ``"embedding_residual"``).
    base_std: float32 scalar ``σΔ`` (rounded up).
    noise_std: float32 scalar ``σΔν`` (rounded up): the std of every released coordinate.
    release: one of :data:`RELEASES` (static).
    step: int32 scalar, the updates released so far.
    steps: T, the updates the budget covers (static; None: not limited). An update past T
      is all NaN (and ``step`` counts on past T): it cannot pass unnoticed.
    origin: uint32 key data of the key the state started from (names the run: a plan refuses
      another run's state); drawn from only through :func:`partition_key`.
    correlation: None (independent noise), or one ``jax_privacy`` ``StreamingMatrix`` state per
      noised block of the release (the buffers of ``C⁻¹``: earlier steps' noise, never data).
    noise_strategy: None or the :class:`dpjax.sgd.correlation.BandedToeplitz` (static).
  """
  key: jax.Array
  bases: Any
  base_std: jax.Array
  noise_std: jax.Array
  release: str = "full"
  step: Any = 0
  steps: int | None = None
  origin: Any = None
  correlation: Any = None
  noise_strategy: Any = None


class StepKeys(NamedTuple):
  """One step's streams: one ``split`` of the noise state's key into named purposes.

  ``next`` becomes the state's key after the update; ``noise`` (and GEP's ``residual_noise``)
  draw the update's Gaussian noise; ``sample`` draws the step's Poisson sample; ``partition`` is
  used only from the run's first key (:func:`partition_key`: cyclic Poisson sampling's groups).
  Nothing else is derived from the state's key (never ``fold_in``: under partitionable threefry
  ``fold_in(k, i)`` is ``split(k, n)[i]``; appending a purpose leaves the others' keys as they
  were, since ``split(k, n)[i]`` does not depend on n).
  """
  next: jax.Array
  noise: jax.Array
  residual_noise: jax.Array
  sample: jax.Array
  partition: jax.Array


def step_keys(key: jax.Array) -> StepKeys:
  """:class:`StepKeys` of a noise state's key (traceable)."""
  return StepKeys(*jax.random.split(key, len(StepKeys._fields)))


def partition_key(state: NoiseState) -> jax.Array:
  """The run's one partition key (traceable): the ``partition`` purpose of the key the state
  started from (its ``origin``), the same at every step of the run."""
  if jnp.issubdtype(state.key.dtype, jax.dtypes.prng_key):
    shape = jax.random.key_data(state.key).shape
    first = jax.random.wrap_key_data(jnp.asarray(state.origin).reshape(shape),
                                      impl=jax.random.key_impl(state.key))
  else:
    first = jnp.asarray(state.origin).reshape(state.key.shape)
  return step_keys(first).partition


def key_origin(key: jax.Array) -> jax.Array:
  """The uint32 data of ``key`` (a typed or legacy key): the name of the run it starts."""
  data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
  return jnp.asarray(data, jnp.uint32).reshape(-1)


def l2_norm_bound(grad_fn) -> float:
  """The ℓ2 bound Δ carried by a sensitivity-bearing clipped-gradient function.

  Reads ``grad_fn.l2_norm_bound`` (dpjax's :class:`~dpjax.sgd.per_example.ClippedGradSum` and
  ``jax_privacy``'s ``BoundedSensitivityCallable`` both carry it).

  Raises:
    TypeError: ``grad_fn`` carries no finite positive ``l2_norm_bound``.
  """
  bound = getattr(grad_fn, "l2_norm_bound", None)
  if bound is None or not callable(grad_fn):
    raise TypeError("grad_fn must be a sensitivity-bearing clipped-gradient function (with an "
                    "l2_norm_bound), e.g. dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=C); got "
                    f"{type(grad_fn).__name__}.")
  return v.check_positive(bound, "grad_fn.l2_norm_bound")


def round_up_float32(value: float) -> np.float32:
  """``value`` as float32, rounded UP (a noise std is never below the accounted one)."""
  out = np.float32(value)
  if float(out) < value:
    out = np.nextafter(out, np.float32(np.inf))
  return out


def release_of(grad_fn, basis=None, bases=None) -> str:
  """The release map (one of :data:`RELEASES`) :func:`dp_noise` uses for these arguments.

  Raises:
    ValueError: as :func:`dp_noise` (both ``basis`` and ``bases``; GEP without ``bases``).
  """
  if isinstance(grad_fn, gep.EmbeddingResidualGradSum):
    if basis is not None or bases is None:
      raise ValueError("GEP's embedding_residual_grad_sum needs per-layer bases= (the bases it "
                       "splits by), not a flat basis=.")
    return "embedding_residual"
  if basis is not None and bases is not None:
    raise ValueError("give a flat basis= (p, k) or per-layer bases=, not both.")
  return "flat" if basis is not None else "layers" if bases is not None else "full"


def dp_noise(grad_fn, *, noise_multiplier: float, expected_batch_size: float, key: jax.Array,
             basis=None, bases=None, tol: float = 1e-3, steps: int | None = None,
             noise_strategy=None) -> optax.GradientTransformation:
  """The DP-SGD privatiser for ``grad_fn``'s sums: release map, Gaussian noise, division by L.

  Usage::

      grad_fn = dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=1.0)
      tx = optax.chain(dpjax.sgd.dp_noise(grad_fn, noise_multiplier=1.1,
                                          expected_batch_size=256, key=key), optax.adam(1e-3))

  ``update(S)``: S is one step's sum of clipped per-example gradients from ``grad_fn`` (over a
  Poisson sample; :meth:`dpjax.sgd.DPSGDPlan.clipped_sum`); the update returned is
  ``lift(M S + N(0, σ²Δ²ν²)) / L`` with the release map M of the module table, Δ =
  ``grad_fn.l2_norm_bound`` and ν from the state's bases.

  Guarantee: each update is the Gaussian mechanism with noise multiplier σ for a statistic of
  ℓ2-sensitivity Δ under add/remove-one (the release map has spectral norm ≤ ν); with Poisson
  sampling at rate q, T updates are :func:`dpjax.accounting.dpsgd_event` ``(σ, q, T)``, whatever
  the release map (docs/algorithms.md §6.0). With a ``noise_strategy`` C the releases are
  post-processing of ``C·(M S) + σΔν Z``, and with cyclic Poisson sampling of cycle ≥ b they are
  the event of :class:`dpjax.sgd.sampling.CyclicPoissonSampling` (§6.7); with another selection
  the plan refuses the strategy.

  Args:
    grad_fn: the sensitivity-bearing clipped-gradient function whose sums this privatises
      (:func:`dpjax.sgd.clipped_grad_sum`, :func:`dpjax.sgd.ghost_clipped_grad_sum`,
      :func:`dpjax.sgd.embedding_residual_grad_sum`, or ``jax_privacy``'s ``clipped_grad``).
    noise_multiplier: σ ≥ 0 (0: no privacy; for tests).
    expected_batch_size: L > 0, the public expected batch size q·N.
    key: PRNG key, kept in the state and split at every update.
    basis: optional flat basis ``V (p, k)`` with orthonormal columns (p = the number of
      parameters, checked at ``init``).
    bases: optional per-layer bases pytree (:func:`dpjax.sgd.bases.check_layer_bases`, checked
      against the params at ``init``); required by GEP's grad sum.
    tol: accepted spectral distance from orthonormality of every basis (a usability check:
      privacy holds for any accepted basis through ν).
    steps: optional T, the updates the budget covers (:func:`dpjax.sgd.dp_sgd_plan` passes
      its T): every update past T is released as NaN, so a step the budget does not cover
      cannot pass unnoticed, even inside a user's own jitted loop.
    noise_strategy: optional :class:`dpjax.sgd.correlation.BandedToeplitz` (needs ``steps``;
      ``jax_privacy`` installed): correlated noise ``σΔν·C⁻¹Z``, each block of released
      coordinates with its own buffer of ``b − 1`` earlier draws (§6.7). Independent noise when
      None.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`NoiseState`; updates have the
    params' structure and dtypes. :func:`update_bases` swaps in new bases.

  Raises:
    TypeError: ``grad_fn`` without an ``l2_norm_bound``; a bad key; non-numeric arguments.
    ValueError: σ < 0, L ≤ 0; both ``basis`` and ``bases``; GEP's grad sum without ``bases``;
      a bad basis (at once for a flat one, at ``init`` against the params for per-layer ones).
  """
  delta = l2_norm_bound(grad_fn)
  v.check_key(key)
  sigma = v.check_positive(noise_multiplier, "noise_multiplier", allow_zero=True)
  batch = v.check_positive(expected_batch_size, "expected_batch_size")
  tol = v.check_positive(tol, "tol")
  steps = None if steps is None else v.check_int(steps, "steps", low=1)
  release = release_of(grad_fn, basis, bases)
  noise_strategy = check_noise_strategy(noise_strategy, steps)
  if release == "flat":
    basis = bases_lib.check_basis(basis, tol=tol)
  base_std = round_up_float32(sigma * delta)
  scales = ((grad_fn.embedding_clip, grad_fn.residual_clip) if release == "embedding_residual"
            else None)

  def init_fn(params):
    checked = None
    nu = 1.0
    if release == "flat":
      p = ravel_pytree(params)[0].shape[0]
      if p != basis.shape[0]:
        raise ValueError(f"basis must have one row per parameter: p={p}, got basis of shape "
                         f"{tuple(basis.shape)}.")
      checked, nu = jnp.asarray(basis), bases_lib.basis_norm_bound(basis)
    elif release in ("layers", "embedding_residual"):
      checked = bases_lib.check_layer_bases(bases, params, tol=tol)
      if release == "layers":
        nu = bases_lib.bases_norm_bound(checked)
    state = NoiseState(key, checked, jnp.asarray(base_std, jnp.float32),
                       jnp.asarray(_noise_std(base_std, nu), jnp.float32), release,
                       jnp.zeros((), jnp.int32), steps, key_origin(key), None, noise_strategy)
    if noise_strategy is None:
      return state
    like = gep.sum_shapes(params, checked) if release == "embedding_residual" else params
    return dataclasses.replace(state, correlation=_initial_buffers(state, like, batch, scales))

  def update_fn(updates, state, params=None):
    del params
    out, new = _release(state, updates, batch, scales)
    if state.steps is not None:       # past T: not covered by the budget, so released as NaN
      over = jnp.asarray(state.step) >= state.steps
      out = jax.tree_util.tree_map(lambda x: jnp.where(over, jnp.full_like(x, jnp.nan), x), out)
    return out, dataclasses.replace(new, step=jnp.asarray(state.step, jnp.int32) + 1)

  return optax.GradientTransformation(init_fn, update_fn)


def check_noise_strategy(noise_strategy, steps):
  """None, or a :class:`dpjax.sgd.correlation.BandedToeplitz` or
  :class:`~dpjax.sgd.correlation.BufferedToeplitz` with the T it is planned for.

  Raises:
    TypeError: another kind of strategy. ValueError: a strategy without ``steps``.
  """
  if noise_strategy is None:
    return None
  if not isinstance(noise_strategy, (correlation.BandedToeplitz,
                                     correlation.BufferedToeplitz)):
    raise TypeError("noise_strategy must be a dpjax.sgd.BandedToeplitz (banded_toeplitz(...) or "
                    "optimal_banded_toeplitz(...)) or a dpjax.sgd.BufferedToeplitz "
                    f"(optimal_buffered_toeplitz(...)), got {type(noise_strategy).__name__}.")
  if steps is None:
    raise ValueError("a noise_strategy is built for T steps (it is normalised to sensitivity 1 "
                     "over T): give steps=T.")
  if isinstance(noise_strategy, correlation.BufferedToeplitz):
    noise_strategy.sensitivity(steps)     # its bound's conditions over T: now, not in a trace
  return noise_strategy


def _noise_std(base_std, nu: float) -> np.float32:
  return round_up_float32(float(base_std) * max(1.0, nu))


def _full(updates, state, batch, scales, draw):
  del scales
  next_key, noise_key = step_keys(state.key)[:2]
  leaves, treedef = jax.tree_util.tree_flatten(updates)
  keys = jax.random.split(noise_key, len(leaves))
  noisy = [_noised_leaf(g, state.noise_std, k, batch, draw) for g, k in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(treedef, noisy), dataclasses.replace(state, key=next_key)


def _noised_leaf(g, noise_std, key, batch, draw):
  """``(g + s·N(0, I)) / L`` for one unprojected leaf, computed in at least float32: the std s
  (float32, rounded up) is never rounded to a 16-bit value below it, nor the draws to 16-bit
  values; casting the noisy result back to g's dtype is post-processing."""
  dtype = jnp.promote_types(g.dtype, jnp.float32)
  out = g.astype(dtype) + noise_std.astype(dtype) * draw(key, g.shape, dtype)
  return (out / jnp.asarray(batch, dtype)).astype(g.dtype)


def _flat(updates, state, batch, scales, draw):
  del scales
  next_key, noise_key = step_keys(state.key)[:2]
  flat, unravel = ravel_pytree(updates)
  # The released k-vector is computed with V as stored (at least float32), never with V cast
  # down to 16-bit gradients: ν̂ covers V's own values (and a float32 cast), not a 16-bit
  # rounding of them. Casting the noisy result back is post-processing.
  dtype = jnp.promote_types(jnp.promote_types(flat.dtype, state.bases.dtype), jnp.float32)
  V = state.bases.astype(dtype)
  noise = draw(noise_key, (V.shape[1],), dtype)
  coefficients = linalg.matmul(V.T, flat.astype(dtype)) + state.noise_std.astype(dtype) * noise
  out = (linalg.matmul(V, coefficients) / jnp.asarray(batch, dtype)).astype(flat.dtype)
  return unravel(out), dataclasses.replace(state, key=next_key)


def _coefficient_dtype(g, basis):
  """At least float32 and the basis's own dtype: ν̂ covers the basis as stored."""
  return functools.reduce(jnp.promote_types, [x.dtype for x in jax.tree_util.tree_leaves(basis)],
                          jnp.promote_types(g.dtype, jnp.float32))


def _layers(updates, state, batch, scales, draw):
  del scales
  next_key, noise_key = step_keys(state.key)[:2]
  leaves, treedef = jax.tree_util.tree_flatten(updates)
  leaf_bases = treedef.flatten_up_to(state.bases)
  keys = jax.random.split(noise_key, len(leaves))
  out = []
  for g, U, k in zip(leaves, leaf_bases, keys):
    if U is None:
      out.append(_noised_leaf(g, state.noise_std, k, batch, draw))
      continue
    dtype = _coefficient_dtype(g, U)
    coefficients = bases_lib.embed(g.reshape(g.shape[0], -1).astype(dtype), U)
    coefficients = coefficients + state.noise_std.astype(dtype) * draw(
        k, coefficients.shape, dtype)
    out.append((bases_lib.lift(coefficients, U) / jnp.asarray(batch, dtype))
               .reshape(g.shape).astype(g.dtype))
  return jax.tree_util.tree_unflatten(treedef, out), dataclasses.replace(state, key=next_key)


def _embedding_residual(updates, state, batch, scales, draw):
  c_e, c_r = scales
  # The one split into named streams (StepKeys): the embedding draws from the full release's
  # noise stream (identity bases: the same draws), the residual from its own.
  next_key, noise_key, residual_key = step_keys(state.key)[:3]
  emb, treedef = jax.tree_util.tree_flatten(updates["embedding"])
  res = treedef.flatten_up_to(updates["residual"])
  leaf_bases = treedef.flatten_up_to(state.bases)
  keys = jax.random.split(noise_key, len(emb))
  residual_keys = jax.random.split(residual_key, len(emb))
  out = []
  for e, r, U, k, k_r in zip(emb, res, leaf_bases, keys, residual_keys):
    dtype = jnp.promote_types(e.dtype, jnp.float32)
    std = state.noise_std.astype(dtype)
    noisy_e = e.astype(dtype) + std * draw(k, e.shape, dtype)
    if U is None:
      out.append((c_e * noisy_e / batch).astype(e.dtype))
      continue
    back = (c_e * bases_lib.lift(noisy_e, U)).reshape(r.shape)
    if not bases_lib.is_full(U):            # a full basis leaves no residual: nothing to release
      back = back + c_r * (r.astype(dtype) + std * draw(k_r, r.shape, dtype))
    out.append((back / batch).astype(r.dtype))
  return jax.tree_util.tree_unflatten(treedef, out), dataclasses.replace(state, key=next_key)


_RELEASE_FNS = {"full": _full, "flat": _flat, "layers": _layers,
                "embedding_residual": _embedding_residual}


class _Draws:
  """A step's Gaussian draws, block by block in the release's fixed order: ``jax.random.normal``
  of the block's key, or with a noise strategy the block's next ``(C⁻¹ Z)_t`` — the i.i.d. draw
  ``Z_t`` fed to ``C⁻¹`` through the block's own buffer (``new`` collects the buffers)."""

  def __init__(self, matrix=None, buffers=None):
    self.matrix, self.buffers, self.new = matrix, buffers, []

  def __call__(self, key, shape, dtype):
    z = jax.random.normal(key, shape, dtype)
    if self.matrix is None:
      return z
    w, buffer = self.matrix.multiply_next(z, self.buffers[len(self.new)])
    self.new.append(buffer)
    return w.astype(dtype)


def _release(state, updates, batch, scales):
  """The state's release map on ``updates``, its noise correlated by its strategy if any."""
  if state.noise_strategy is None:
    return _RELEASE_FNS[state.release](updates, state, batch, scales, jax.random.normal)
  draws = _Draws(state.noise_strategy.noising_matrix(state.steps), state.correlation)
  out, new = _RELEASE_FNS[state.release](updates, state, batch, scales, draws)
  return out, dataclasses.replace(new, correlation=draws.new)


def _initial_buffers(state, like, batch, scales):
  """One zero buffer of ``C⁻¹`` per block the release draws (shapes from an abstract run)."""
  blocks = []

  def record(key, shape, dtype):
    del key
    blocks.append(jax.ShapeDtypeStruct(shape, dtype))
    return jnp.zeros(shape, dtype)

  jax.eval_shape(lambda u, st: _RELEASE_FNS[st.release](u, st, batch, scales, record)[0],
                 like, state)
  matrix = state.noise_strategy.noising_matrix(state.steps)
  return [matrix.init_multiply(jnp.zeros(b.shape, b.dtype)) for b in blocks]


def _is_state(x):
  return isinstance(x, NoiseState)


def noise_state(opt_state) -> NoiseState:
  """The :class:`NoiseState` inside an optimiser state (e.g. of ``optax.chain(dp_noise(...),
  optimiser)``).

  Raises:
    ValueError: none, or more than one.
  """
  found = [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_state) if _is_state(x)]
  if len(found) != 1:
    raise ValueError(f"opt_state must hold exactly one dp_noise state, found {len(found)}.")
  return found[0]


def update_bases(opt_state, *, basis=None, bases=None, tol: float = 1e-3, check: bool = True):
  """Swaps new bases into the :class:`NoiseState` of ``opt_state``; the key stream is kept.

  For a refreshed subspace (a new public basis, a new DP release whose cost is composed in, or
  :func:`dpjax.sgd.trajectory_bases` of this run's releases): the transformation, its compiled
  update and its key stream stay; only the bases and the noise std ``σΔ·max(1, ν̂)`` change.
  The new bases must have the current kind, shapes and ``None`` pattern (so the compiled update
  is reused).

  Host side (``check=True``): validates the bases in float64 and recomputes ν̂; call it between
  jitted steps. Traceable (``check=False``): only for GEP's release, whose noise does not depend
  on the bases (its sensitivity comes from clipping the split): e.g. inside a ``lax.scan``.

  Args:
    opt_state: an optimiser state holding one :class:`NoiseState`.
    basis: the new flat basis (``"flat"`` release).
    bases: the new per-layer bases (``"layers"`` / ``"embedding_residual"``).
    tol: as :func:`dp_noise`.
    check: validate on the host (default); False only for GEP (traceable).

  Returns:
    ``opt_state`` with the new bases (and noise std).

  Raises:
    ValueError: no NoiseState; the wrong argument for its release (or ``"full"``, which has no
      bases); another shape, structure or kind; ``check=False`` for a release whose noise
      depends on the bases; as :func:`dpjax.sgd.bases.check_basis`.
  """
  state = noise_state(opt_state)
  release = state.release
  if release == "full":
    raise ValueError("this dp_noise has no bases to update (it was built without basis/bases).")
  if (release == "flat") != (basis is not None) or (bases is None) == (basis is None):
    want = "basis=" if release == "flat" else "bases="
    raise ValueError(f"a {release!r} release takes {want} (exactly one of basis and bases).")
  if not check:
    if release != "embedding_residual":
      raise ValueError("check=False is only for GEP's release, whose noise does not depend on "
                       f"the bases; a {release!r} release must recompute its bound (check=True).")
    new = dataclasses.replace(state, bases=bases)
  elif release == "flat":
    new_basis = bases_lib.check_basis(basis, tol=tol)
    if new_basis.shape != state.bases.shape:
      raise ValueError(f"the new basis must have the current shape {tuple(state.bases.shape)}, "
                       f"got {tuple(new_basis.shape)}.")
    new = dataclasses.replace(
        state, bases=new_basis.astype(state.bases.dtype),
        noise_std=jnp.asarray(_noise_std(state.base_std,
                                         bases_lib.basis_norm_bound(new_basis)), jnp.float32))
  else:
    checked = _check_like(bases, state.bases, tol)
    nu = bases_lib.bases_norm_bound(checked) if release == "layers" else 1.0
    new = dataclasses.replace(state, bases=checked,
                              noise_std=jnp.asarray(_noise_std(state.base_std, nu), jnp.float32))
  return jax.tree_util.tree_map(lambda x: new if _is_state(x) else x, opt_state,
                                is_leaf=_is_state)


def _check_like(bases, current, tol):
  """``bases`` validated against the current ones: structure, None pattern, kinds, shapes."""
  is_basis = bases_lib.is_basis
  if (jax.tree_util.tree_structure(bases, is_leaf=is_basis)
      != jax.tree_util.tree_structure(current, is_leaf=is_basis)):
    raise ValueError("the new bases must have the current structure and None pattern.")

  def side(new, cur):
    new = bases_lib.check_basis(new, tol=tol, partial=True)
    if new.shape != cur.shape:
      raise ValueError(f"a new basis must have the current shape {tuple(cur.shape)}, got "
                       f"{tuple(new.shape)}.")
    return new.astype(cur.dtype)

  def check(new, cur):
    two = bases_lib.TwoSidedBasis
    if (new is None) != (cur is None) or isinstance(new, two) != isinstance(cur, two):
      raise ValueError("the new bases must have the current None pattern and kinds (one- or "
                       "two-sided).")
    if new is None:
      return None
    if isinstance(new, two):
      return two(side(new.left, cur.left), side(new.right, cur.right))
    return side(new, cur)

  return jax.tree_util.tree_map(check, bases, current, is_leaf=is_basis)
