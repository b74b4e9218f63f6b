"""Clipped-gradient sums without per-example gradients: ghost norms and book-keeping.

For a dense layer ``z = x W + b`` the gradient of ONE example's loss is ``x_iᵀ δ_i`` (and
``Σ_t δ_it`` for the bias), where ``x_i (T, a)`` is the layer's input and ``δ_i = ∂ℓ_i/∂z_i
(T, b)`` the gradient at its output (T = 1 for a vector input). So its squared norm is
``‖x_i‖²‖δ_i‖²`` when T = 1, and ``⟨x_i x_iᵀ, δ_i δ_iᵀ⟩`` (T² < a·b) or ``‖x_iᵀ δ_i‖²_F`` for a
sequence, without forming the ``(B, a, b)`` per-example gradients (Goodfellow 2015; Li et al.
2022's ghost norm; on the Gram route the clip uses a proven upper bound of the norm that covers
its rounding, docs/algorithms.md §6.1.1). Book-keeping (Bu et al. 2023) keeps every layer's
``(x_i, δ_i)`` from ONE forward and ONE backward pass, so after the clip factors ``c_i`` are
known the clipped sum of a layer is one matmul, ``Σ_i c_i mask_i x_iᵀ δ_i``: no second backward
pass.

The model is written once with its dense layers passed in, ``apply_fn(params, x, *, dense)``,
so no global state is needed: the user's own training calls it with :func:`dense`, and
:func:`ghost_clipped_grad_sum` calls it with a recording ``dense`` that adds a zero "tap" ``τ``
to each layer's output (the gradient w.r.t. ``τ_i`` is ``δ_i``) and keeps the layer's input.
Other layers go through :func:`layer` with their kind, each an exact identity for one
example's gradient from its input and output gradient (Flax models need no rewriting:
:mod:`dpjax.sgd.flax_layers` intercepts their layers):

=======================  =====================================================================
kind                     one example's gradient (ghost norm; book-keeping total)
=======================  =====================================================================
:class:`DenseLayer`      ``Σ_t x_tᵀδ_t``, the contracted axes flattened (above)
:class:`ConvLayer`       the same on the input's patches (the unfold identity: T = output
                         positions, ``a = c_in·Π window``; Gram or direct by the same rule)
:class:`EmbedLayer`      ``onehot(ids)ᵀδ``: one row per distinct token, the sum of its
                         positions' ``δ_t``, materialised ``(T, d)`` (``O(T² + T·d)``);
                         total by scatter-add
:class:`ScaleLayer`      ``Σ_t x̂_t ⊙ δ_t`` (a normalisation's scale on its normalised input),
                         materialised ``(d,)``
=======================  =====================================================================

The clipping is the same map as :mod:`dpjax.sgd.per_example` (its edge-case table), applied to the
same global norm over all parameters of one example, with the same clip factor
(:func:`dpjax.sgd.per_example.clip_factor`: C' = C(1 − ρ), the factor rounded down):

=========================================  ==================================================
one example's gradient ``g`` (never formed)  contribution to the sum
=========================================  ==================================================
``‖g‖ ≤ C'`` (``"clip"``)                   ``g``
``‖g‖ > C'`` (finite)                       ``g · C'/‖g‖``; no overflow or underflow: every
                                            layer's ``x_i`` and ``δ_i`` are scaled by exact
                                            powers of two before any product, the exponents
                                            are kept as integers
``g = 0``                                   ``0`` (no 0/0)
``‖g‖`` not finite (a NaN or ±inf in any    ``0`` for the whole example, as with the vmap
``x_i``, ``δ_i`` or gradient, or a norm     path (``‖g‖`` beyond the float range is inf
beyond the float32 / float64 range)         there too)
=========================================  ==================================================

``"normalize"`` gives ``C'·g/(‖g‖ + γ)``, as :func:`dpjax.sgd.per_example.clip_per_example`. Norms, factors
and the book-keeping matmuls run in float32 (float64 for float64 models) whatever the model's
dtype, and each summed leaf is converted back rounding towards zero
(:func:`ghost_clipped_grad_sum`, "Floating point").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Mapping
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dpjax import _validation as v
from dpjax import linalg
from dpjax.sgd import bases as bases_lib
from dpjax.sgd import gep, per_example
from dpjax.sgd.per_example import DEFAULT_STABILITY

__all__ = ["ConvLayer", "DenseLayer", "EmbedLayer", "ModelLoss", "ScaleLayer", "dense",
           "ghost_clipped_grad_sum", "layer", "model_loss"]

_NO_EXPONENT = -(2 ** 20)   # the exponent of a zero partial norm (below every float's range)


def _layer_params(params):
  """``(w, b or None)`` of a dense layer's parameters ``{"w": (a, b), "b": (b,)}``."""
  if not isinstance(params, Mapping) or "w" not in params or not set(params) <= {"w", "b"}:
    keys = sorted(params) if isinstance(params, Mapping) else type(params).__name__
    raise ValueError("dense params must be a mapping {'w': (a, b)} or {'w': (a, b), 'b': (b,)}, "
                     f"got {keys}.")
  return params["w"], params.get("b")


def dense(params, x):
  """A dense layer ``x @ w + b``, the layer :func:`ghost_clipped_grad_sum` can clip cheaply.

  Write the model with it passed in, ``apply_fn(params, x, *, dense=dpjax.sgd.dense)``, and call
  it as usual for a non-private step or evaluation; the DP path substitutes its recording copy.

  Args:
    params: ``{"w": (a, b)}`` or ``{"w": (a, b), "b": (b,)}`` (floats).
    x: ``(..., a)`` input (any leading axes: a sequence ``(T, a)`` shares ``w`` across T).

  Returns:
    ``(..., b)`` array, ``x @ w (+ b)`` at ``precision=HIGHEST``, in the promoted dtype.

  Raises:
    ValueError: other keys than ``w`` and ``b``; ``w`` not 2-D; ``x.shape[-1] != a``;
      ``b.shape != (b,)``.
  """
  w, b = _check_dense(params, x)
  out = jnp.matmul(x, w, precision=linalg.HIGHEST)
  return out if b is None else out + b


def _check_dense(params, x):
  w, b = _layer_params(params)
  if jnp.ndim(w) != 2:
    raise ValueError(f"dense params['w'] must be 2-D (a, b), got shape {jnp.shape(w)}.")
  if jnp.ndim(x) < 1 or jnp.shape(x)[-1] != jnp.shape(w)[0]:
    raise ValueError(f"dense input must have shape (..., {jnp.shape(w)[0]}) to match w of shape "
                     f"{jnp.shape(w)}, got {jnp.shape(x)}.")
  if b is not None and jnp.shape(b) != (jnp.shape(w)[1],):
    raise ValueError(f"dense params['b'] must have shape ({jnp.shape(w)[1]},), got "
                     f"{jnp.shape(b)}.")
  return w, b


class DenseLayer(NamedTuple):
  """A dense layer whose kernel ``w`` has shape ``(*in_dims, *out_dims)`` with ``in_ndim``
  input axes: ``z = x ⋅ w + b``, contracting ``x``'s last ``in_ndim`` axes with ``w``'s first
  (Flax's ``Dense``, ``Linear``, and ``DenseGeneral`` / ``LinearGeneral`` on trailing axes),
  the bias of shape ``out_dims``. One example's kernel gradient is ``Σ_t x_tᵀδ_t`` with
  ``x_t`` the rows of ``x`` flattened to ``(T, a)``, ``a = Π in_dims``."""
  in_ndim: int = 1

  def matrices(self, x, delta, w_shape):
    """``(B, T, a)`` inputs and ``(B, T, b)`` output gradients of a batch of calls."""
    a = math.prod(w_shape[:self.in_ndim])
    return (jnp.reshape(x, (x.shape[0], -1, a)),
            jnp.reshape(delta, (delta.shape[0], -1, math.prod(w_shape[self.in_ndim:]))))

  def kernel(self, total, w_shape):
    """The ``(a, b)`` total as the kernel's shape."""
    return jnp.reshape(total, w_shape)


class ConvLayer(NamedTuple):
  """A convolution ``z = conv(x, w) + b`` with channels last (Flax's ``Conv``): ``x (..., *spatial,
  c_in)``, ``w (*window, c_in, c_out)``, one feature group, ``padding`` ``"SAME"``, ``"VALID"``
  or explicit ``((lo, hi), ...)``. A convolution is a dense layer on the input's patches (the
  unfold identity): ``T`` = output positions, ``a = c_in · Π window``
  (``jax.lax.conv_general_dilated_patches``, its features ordered ``(c_in, *window)``)."""
  strides: tuple
  padding: str | tuple
  lhs_dilation: tuple
  rhs_dilation: tuple

  def matrices(self, x, delta, w_shape):
    window, c_in = tuple(w_shape[:-2]), w_shape[-2]
    letters = "XYZ"[:len(window)]
    flat = jnp.reshape(x, (-1,) + x.shape[x.ndim - len(window) - 1:])
    patches = jax.lax.conv_general_dilated_patches(
        flat, window, self.strides, self.padding, lhs_dilation=self.lhs_dilation,
        rhs_dilation=self.rhs_dilation, precision=linalg.HIGHEST,
        dimension_numbers=(f"N{letters}C", f"{letters}IO", f"N{letters}C"))
    return (jnp.reshape(patches, (x.shape[0], -1, c_in * math.prod(window))),
            jnp.reshape(delta, (delta.shape[0], -1, w_shape[-1])))

  def kernel(self, total, w_shape):
    window = tuple(w_shape[:-2])
    total = jnp.reshape(total, (w_shape[-2],) + window + (w_shape[-1],))
    return jnp.moveaxis(total, 0, len(window))


class EmbedLayer(NamedTuple):
  """An embedding lookup ``z = w[x]`` (Flax's ``Embed``, ``jnp.take(w, x, axis=0)``): integer
  ``x (...)``, table ``w (V, d)``, no bias. One example's gradient is ``onehot(x)ᵀδ``: its
  nonzero rows are, for each distinct token, the sum of ``δ_t`` over the positions holding it."""


class ScaleLayer(NamedTuple):
  """A feature-wise affine map ``z = x ⊙ w (+ b)`` on the last axis, ``w`` and ``b`` of shape
  ``(d,)``: a normalisation layer's scale and bias applied to its normalised input ``x̂``
  (Flax's ``LayerNorm``, ``RMSNorm``, ``GroupNorm``). One example's gradient of ``w`` is
  ``Σ_t x_t ⊙ δ_t`` over its other positions, materialised ``(d,)`` per example."""

  def matrices(self, x, delta, w_shape):
    return (jnp.reshape(x, (x.shape[0], -1, w_shape[-1])),
            jnp.reshape(delta, (delta.shape[0], -1, w_shape[-1])))


def layer(dense: Callable, kind, params, x, forward: Callable):
  """Calls a layer of a known kind so :func:`ghost_clipped_grad_sum` can clip it by ghost norms.

  ``forward(params, x)`` is the layer's own computation (a Flax module's, with its dtypes and
  precision); ``kind`` (:class:`DenseLayer`, :class:`ConvLayer`, :class:`EmbedLayer` or
  :class:`ScaleLayer`) says which exact identity gives its per-example gradient from its input
  ``x`` and the gradient at its output, and must describe ``forward`` (``forward``'s gradient
  with respect to ``w`` must be that identity's). A kind that does not describe ``forward``
  gives a wrong gradient, not a privacy loss: each example's term is the block computed by the
  kind's identity from the recorded ``x`` and output gradient, and its clip factor comes from
  that block's norm. With the plain :func:`dense` (a non-private step, evaluation) this is
  ``forward(params, x)``; given the ``dense`` that :func:`ghost_clipped_grad_sum` passes to
  ``apply_fn``, the call is recorded. :mod:`dpjax.sgd.flax_layers` calls it for Flax layers.

  Args:
    dense: the ``dense`` ``apply_fn`` received.
    kind: the layer's kind.
    params: ``{"w": kernel}`` or ``{"w": kernel, "b": bias}``, the layer's parameter leaves as
      ``apply_fn`` received them (unchanged, so the ghost path can find them).
    x: the layer's input (one example; any leading axes).
    forward: ``forward(params, x) -> output``.

  Returns:
    ``forward(params, x)``.
  """
  record = getattr(dense, "record_layer", None)
  return forward(params, x) if record is None else record(kind, params, x, forward)


class _Hook:
  """The ``dense`` passed to ``apply_fn`` on the ghost path: a dense call is a recorded layer of
  kind ``DenseLayer()``; :func:`layer` records other kinds through ``record_layer``."""

  def __init__(self, record_layer):
    self.record_layer = record_layer

  def __call__(self, params, x):
    _check_dense(params, x)
    return self.record_layer(DenseLayer(), params, x, dense)


@dataclasses.dataclass(frozen=True)
class ModelLoss:
  """``loss_fn(params, (x, y)) = example_loss(apply_fn(params, x, dense=dense), y)``, the one
  example's loss of a model written with :func:`dense`, which remembers that form: a consumer
  that receives it (``dpjax.experiments.train_route``) can clip by
  :func:`ghost_clipped_grad_sum` instead of ``vmap(grad)``. Built by :func:`model_loss`; two
  built from the same functions compare equal (a jit's static argument compiles once)."""
  apply_fn: Callable
  example_loss: Callable

  def __call__(self, params, example):
    x, y = example
    return self.example_loss(self.apply_fn(params, x, dense=dense), y)


def model_loss(apply_fn: Callable, example_loss: Callable) -> ModelLoss:
  """``loss_fn(params, (x, y)) = example_loss(apply_fn(params, x, dense=dense), y)``.

  The one-example loss of the same model for :func:`dpjax.sgd.clipped_grad_sum` (the vmap
  path) or a non-private step; a :class:`ModelLoss`, which keeps ``apply_fn`` and
  ``example_loss`` for a consumer that clips by ghost norms. Not private by itself.

  Raises:
    TypeError: ``apply_fn`` or ``example_loss`` not callable.
  """
  _check_callables(apply_fn, example_loss)
  return ModelLoss(apply_fn, example_loss)


def _check_callables(apply_fn, example_loss):
  if not callable(apply_fn):
    raise TypeError(f"apply_fn must be callable, got {type(apply_fn).__name__}.")
  if not callable(example_loss):
    raise TypeError(f"example_loss must be callable, got {type(example_loss).__name__}.")


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Which parameter leaves the ghost path covers, found by tracing one example abstractly.

  ``calls[j] = (w, b, out, kind)``: the j-th recorded layer call's covered leaf indices
  (None: not covered), its output's shape and its kind; ``uncovered``: leaves used otherwise
  (per-example gradients by ``vmap(grad)``); ``unused``: leaves the loss does not depend on
  (zero gradient).
  """
  calls: tuple
  uncovered: tuple
  unused: tuple


def _split_batch(batch):
  if not isinstance(batch, (tuple, list)) or len(batch) != 2:
    raise TypeError("batch must be a pair (inputs, targets) of pytrees with a leading batch "
                    f"axis, got {type(batch).__name__}.")
  leaves = jax.tree_util.tree_leaves(batch)
  sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
  if not leaves or None in sizes or len(sizes) != 1:
    raise ValueError("all leaves of batch must share a leading batch axis, got leading sizes "
                     f"{sorted(str(s) for s in sizes)}.")
  return batch[0], batch[1], sizes.pop()


def _plan(apply_fn, example_loss, leaves, treedef, inputs, targets) -> _Plan:
  """Traces one example with ShapeDtypeStructs; a leaf is covered when exactly one ``dense``
  call receives it and nothing else in the traced loss reads it."""
  def spec(x, lead=0):
    return jax.ShapeDtypeStruct(jnp.shape(x)[lead:], jnp.result_type(x))

  records = []

  def traced(leaves, inputs_i, targets_i, taps=None):
    index = {id(x): i for i, x in enumerate(leaves)}

    def recording(kind, params, x, forward):
      w, b = _layer_params(params)
      iw, ib = index.get(id(w)), (None if b is None else index.get(id(b)))
      # A leaf seen here is replaced by zeros, so any other read of it stays in the jaxpr.
      zeros = {"w": w if iw is None else jnp.zeros(jnp.shape(w), jnp.result_type(w))}
      if b is not None:
        zeros["b"] = b if ib is None else jnp.zeros(jnp.shape(b), jnp.result_type(b))
      out = forward(zeros, x)
      j = len(records)
      records.append((iw, ib, spec(out), kind))
      if taps is not None:
        if j >= len(taps) or spec(out) != spec(taps[j]):
          raise RuntimeError("apply_fn must call dense on the same layers in the same order "
                             "every time it is traced.")
        out = out + taps[j]
      return out

    return example_loss(apply_fn(jax.tree_util.tree_unflatten(treedef, leaves), inputs_i,
                                 dense=_Hook(recording)), targets_i)

  args = ([spec(x) for x in leaves], jax.tree_util.tree_map(lambda x: spec(x, 1), inputs),
          jax.tree_util.tree_map(lambda x: spec(x, 1), targets))
  closed = jax.make_jaxpr(traced)(*args)
  out = closed.out_avals[0]
  if len(closed.out_avals) != 1 or out.shape != () or not jnp.issubdtype(out.dtype,
                                                                        jnp.floating):
    raise TypeError("example_loss(apply_fn(params, x), y) must return a real scalar for one "
                    f"example, got {closed.out_avals}.")
  # Second trace with a zero "tap" added to each dense output, passed in as an argument: a call
  # made at apply_fn's top level adds its tap there (an `add` of the output's shape in the
  # outer jaxpr); one made inside a lax.scan / cond / while body, jax.checkpoint, a nested jit
  # or an inner vmap hands it to that construct instead. Only top-level calls can be tapped
  # and have their (x, δ) kept; the others' leaves fall back to vmap(grad).
  taps = [r[2] for r in records]
  first, records[:] = list(records), []
  if taps:
    closed = jax.make_jaxpr(traced)(*args, taps)
    if [(r[:2], type(r[3]), r[3]) for r in records] != [(r[:2], type(r[3]), r[3])
                                                          for r in first]:
      raise RuntimeError("apply_fn must call dense on the same layers in the same order "
                         "every time it is traced.")
  jaxpr = closed.jaxpr
  tap_vars = jaxpr.invars[len(jaxpr.invars) - len(taps):] if taps else []
  top_level = [any(eqn.primitive.name == "add" and any(v is var for v in eqn.invars)
                   and eqn.outvars[0].aval.shape == spec_.shape for eqn in jaxpr.eqns)
               for var, spec_ in zip(tap_vars, taps)]
  read = {id(var) for eqn in jaxpr.eqns for var in eqn.invars} | {id(var) for var in
                                                                   jaxpr.outvars}
  counts, nested = [0] * len(leaves), set()
  for (iw, ib, _, _), top in zip(records, top_level):
    for i in (iw, ib):
      if i is not None:
        counts[i] += 1
        if not top:
          nested.add(i)
  leaf_vars = jaxpr.invars[:len(leaves)]
  covered = {i for i, var in enumerate(leaf_vars)
             if counts[i] == 1 and i not in nested and id(var) not in read}
  unused = tuple(i for i, var in enumerate(leaf_vars) if counts[i] == 0 and id(var) not in read)
  uncovered = tuple(i for i in range(len(leaves)) if i not in covered and i not in unused)
  calls = tuple((iw if iw in covered else None, ib if ib in covered else None, out, kind)
                for iw, ib, out, kind in records)
  return _Plan(calls, uncovered, unused)


def _warn_uncovered(params, plan, reasons=None):
  """One warning naming the leaves that fall back to ``vmap(grad)``, why, whether it matters and
  how to avoid it, pointed at the user's call. ``reasons``: ``{leaf index: why}`` for leaves
  moved there for another reason than coverage (GEP's bases)."""
  if not plan.uncovered:
    return
  reasons = reasons or {}
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  uncovered = [paths[i] for i in plan.uncovered if i not in reasons]
  parts = []
  if uncovered:
    parts.append(
        ", ".join(uncovered) + " " + ("is" if len(uncovered) == 1 else "are") + " not read by "
        "exactly one recorded layer call at apply_fn's top level (weight tying, a table indexed "
        "directly, a layer inside lax.scan/cond/checkpoint/jit/vmap). To cover it, call the "
        "layer through dpjax.sgd.dense or dpjax.sgd.ghost.layer once, at the top level (Flax: "
        "nnx.Linear/LinearGeneral/Conv/Embed, e.g. nnx.Embed for a position table, instead of "
        "indexing a raw nnx.Param)")
  for i, why in sorted(reasons.items()):
    parts.append(f"{paths[i]} {why}")
  warnings.warn("ghost clipping: per-example gradients by vmap(grad) for " + "; ".join(parts)
                + ". Safe to ignore: the result and its privacy are exact and the same; only "
                "these leaves cost per-example memory and time.",
                stacklevel=v.user_stacklevel())


def _forward_backward(apply_fn, example_loss, plan, leaves, treedef, inputs, targets, size,
                      divisor=None):
  """One vmapped forward and backward: ``(δ per tapped call, x per tapped call, per-example
  gradients of the uncovered leaves)``, each with a leading batch axis; of the loss divided by
  ``divisor`` (a public scalar) if given."""
  tapped = [out for iw, ib, out, _ in plan.calls if iw is not None or ib is not None]
  taps = [jnp.zeros((size,) + s.shape, s.dtype) for s in tapped]
  free = [leaves[i] for i in plan.uncovered]

  def one(taps_i, free_i, inputs_i, targets_i):
    full = list(leaves)
    for i, leaf in zip(plan.uncovered, free_i):
      full[i] = leaf
    count, kept = [0], []

    def recording(kind, params, x, forward):
      j = count[0]
      count[0] += 1
      w, b = _layer_params(params)
      iw, ib, _, planned = plan.calls[j] if j < len(plan.calls) else (None,) * 4
      if (j >= len(plan.calls) or (iw is not None and w is not leaves[iw])
          or (ib is not None and b is not leaves[ib]) or (type(kind), kind) != (
              type(planned), planned)):
        raise RuntimeError("apply_fn must call dense on the same layers in the same order "
                           "every time it is traced.")
      out = forward(params, x)
      if iw is None and ib is None:
        return out
      kept.append(x)
      return out + taps_i[len(kept) - 1]

    loss = example_loss(apply_fn(jax.tree_util.tree_unflatten(treedef, full), inputs_i,
                                 dense=_Hook(recording)), targets_i)
    if divisor is not None:
      loss = loss / jnp.asarray(divisor, loss.dtype)
    if count[0] != len(plan.calls):
      raise RuntimeError("apply_fn must call dense on the same layers in the same order "
                         "every time it is traced.")
    return loss, kept

  grad = jax.grad(one, argnums=(0, 1), has_aux=True)
  (deltas, free_grads), xs = jax.vmap(grad, in_axes=(0, None, 0, 0))(taps, free, inputs,
                                                                      targets)
  return deltas, xs, free_grads


_ldexp = per_example.ldexp
_normalised = per_example.normalised


def _toward_zero(coef, like):
  """``coef`` in ``like``'s dtype, never rounded up (a float64 coefficient for a float32
  block of a mixed model)."""
  return per_example.round_toward_zero(coef, like.dtype)


def _sqnorm(x):
  """Per-row sum of squares (rows: the first axis) in a fixed tree
  (:func:`per_example.sum_squares`: a proven rounding bound, whatever XLA's reduction order)."""
  return per_example.sum_squares(x.reshape(x.shape[0], -1))


class _Partial(NamedTuple):
  """One block of the per-example gradient: its norm ``norm · 2^exponent`` (``(B,)`` each),
  ``total(coef, ok)``, its sum weighted by per-example coefficients ``(B,)`` (rows with ``ok``
  False skipped), and ``size``, its number of entries."""
  norm: jax.Array
  exponent: jax.Array
  total: Callable
  size: int


def _dense_block(xt, dt, ex, ed, out_dtype) -> _Partial:
  """The block ``Σ_t x_tᵀδ_t`` of one dense call, from its exactly rescaled inputs
  ``xt (B, T, a) = x / 2^ex`` and output gradients ``dt (B, T, b) = δ / 2^ed`` (accumulation
  dtype): its per-example norm and its weighted total ``(a, b)``, converted to ``out_dtype``
  rounding towards zero. Vector inputs (T = 1): ``‖x‖‖δ‖`` of the same numbers as the term;
  T² ≥ a·b: the ``(a, b)`` gradient is formed once for both; else the Gram route."""
  steps, a, width = xt.shape[1], xt.shape[-1], dt.shape[-1]
  if steps > 1 and steps * steps >= a * width:
    # Direct route (T² ≥ a·b): the (a, b) per-example gradients are formed anyway, so the
    # norm and the term are both of this one materialised array.
    eg, gt = _normalised(jnp.einsum("nta,ntb->nab", xt, dt, precision=linalg.HIGHEST))
    norm, exp = jnp.sqrt(_sqnorm(gt)), ex + ed + eg

    def total(coef, ok):
      summed = jnp.tensordot(_toward_zero(coef, gt), jnp.where(ok[:, None, None], gt, 0),
                             axes=1, precision=linalg.HIGHEST)
      return per_example.round_toward_zero(summed, out_dtype)
    return _Partial(norm, exp, total, a * width)
  if steps == 1:
    # ‖x_iᵀδ_i‖_F = ‖x_i‖‖δ_i‖ exactly, of the same numbers as the term (coef_i x_i)ᵀδ_i.
    norm = jnp.sqrt(_sqnorm(xt)) * jnp.sqrt(_sqnorm(dt))
  else:
    # Gram route: ‖Σ_t x_tᵀδ_t‖² = ⟨x xᵀ, δ δᵀ⟩, never forming the (a, b) gradient. The norm
    # and the book-keeping matmul are two float evaluations of Σ_t x_tᵀδ_t that can differ by
    # far more than ‖G‖ when the tokens' gradients cancel, so the "norm" is a proven upper
    # bound of the term's (_gram_norm_bound; docs/algorithms.md §6.1.1).
    norm = _gram_norm_bound(xt, dt)

  def total(coef, ok):
    keep = ok[:, None, None]
    xk = jnp.where(keep, _toward_zero(coef, xt)[:, None, None] * xt, 0)
    summed = jnp.tensordot(xk, jnp.where(keep, dt, 0), axes=((0, 1), (0, 1)),
                           precision=linalg.HIGHEST)
    return per_example.round_toward_zero(summed, out_dtype)
  return _Partial(norm, ex + ed, total, a * width)


def _up(value: float, dtype) -> float:
  """``value`` as a float of ``dtype``, rounded UP (a constant of a proven upper bound)."""
  out = np.asarray(value, dtype)
  return out if float(out) >= value else np.nextafter(out, np.asarray(np.inf, dtype))


def _gram_norm_bound(xt, dt):
  """``U (B,)`` ≥ ``‖G‖ + γ_{T+1}·S`` for every input, from the Gram matrices: ``G = Σ_t x_tᵀδ_t``
  of the rescaled ``xt (B, T, a)``, ``dt (B, T, b)`` (accumulation dtype, ``max|·| < 1``), ``S =
  Σ_t ‖x_t‖‖δ_t‖`` and ``γ_k = ku/(1 − ku)``, so that the book-keeping term of an example with
  coefficient ``c`` (``fl(c·x)`` then a float matmul over its T tokens) has norm ≤ ``c·U``.

  With ``P̂, Q̂`` the computed ``x xᵀ``, ``δ δᵀ`` (any summation order: entrywise within
  ``γ_a ‖x_t‖‖x_s‖``, ``γ_b ‖δ_t‖‖δ_s‖``) and ``ŝ`` their product summed by rows in any order,
  then over the rows in a fixed tree (within ``γ_{T+λ}Σ|P̂ ⊙ Q̂|``, λ = ⌈log2 T⌉):
  ``‖G‖² ≤ ŝ + K·S̄² + τ`` with ``K ≈ γ_a + γ_b + γ_{T+λ}``, ``S̄ ≥ S`` from upper bounds of the
  token norms and τ for results below the float's normal range; every non-negative quantity is
  inflated by its count of roundings. The proof is docs/algorithms.md §6.1.1. Costs ``O(T(a +
  b))`` per example beyond the two Gram matrices, whose only consumer stays their product (so
  XLA:CPU keeps them in one fused loop: 1.1× the unbounded norm's time, against 4× for a bound
  that also read ``|P̂|``, ``|Q̂|``). Where the tokens do not cancel ``U`` exceeds ``‖G‖`` by
  ``½K·S²/‖G‖²`` relative, at most about ``½(a + b + T)·T·u`` (0.06% at T = 64, a = b = 128).
  """
  dtype = xt.dtype
  size, steps, a = xt.shape
  b = dt.shape[-1]
  info = jnp.finfo(dtype)
  u, tiny = float(info.eps) / 2, float(info.tiny)
  if max(a, b, steps) * u >= 0.01:
    raise ValueError(f"ghost clipping's Gram route needs a, b, T < {0.01 / u:.0f} in "
                     f"{dtype.name} (got a = {a}, b = {b}, T = {steps}).")

  def gamma(k):
    return k * u / (1 - k * u)

  def inflate(k):                   # covers k roundings of a non-negative result, and one more
    return _up(1 + 2 * (k + 1) * u, dtype)

  def token_norms(v):               # ‖v_t‖ from above (any summation order), then underflow
    width = v.shape[-1]
    return jnp.sqrt(jnp.sum(v * v, axis=-1) * inflate(width)
                    + _up(4 * (width + 1) * tiny, dtype)) * inflate(2)

  gx = jnp.einsum("nta,nsa->nts", xt, xt, precision=linalg.HIGHEST)
  gd = jnp.einsum("ntb,nsb->nts", dt, dt, precision=linalg.HIGHEST)
  # Row sums in any order, then a fixed tree over the rows: |ŝ − Σ P̂Q̂| ≤ γ_{T+λ}·Σ|P̂Q̂|.
  s_hat = per_example.tree_sum(jnp.sum(gx * gd, axis=2))
  g_sum, g_a, g_b = gamma(steps + per_example.sum_levels(steps)), gamma(a), gamma(b)
  k = g_sum * (1 + g_a) * (1 + g_b) + g_a * (1 + g_b) + g_b * (1 + g_a) + g_a * g_b
  s = jnp.sum(token_norms(xt) * token_norms(dt), axis=1)
  tau = _up((16 * a * b + 16) * steps * steps * tiny, dtype)
  squared = jnp.maximum(s_hat, 0) + (s * s) * _up(k, dtype) * inflate(steps + 2) + tau
  term = s * _up(gamma(steps + 1), dtype) * inflate(steps + 1)
  return (jnp.sqrt(squared) + term) * _up(1 + 8 * u, dtype)


def _bias_block(dt, ed, out_dtype) -> _Partial:
  """The bias block ``Σ_t δ_t`` of one dense call (``dt``, ``ed`` as :func:`_dense_block`)."""
  size, steps, width = dt.shape
  eb, dsum = (jnp.zeros((size,), jnp.int32), dt[:, 0]) if steps == 1 else _normalised(
      jnp.sum(dt, axis=1))

  def total(coef, ok):
    summed = jnp.tensordot(_toward_zero(coef, dsum), jnp.where(ok[:, None], dsum, 0), axes=1,
                           precision=linalg.HIGHEST)
    return per_example.round_toward_zero(summed, out_dtype)
  return _Partial(jnp.sqrt(_sqnorm(dsum)), ed + eb, total, width)


def _free_block(g, out_dtype) -> _Partial:
  """A block given by its materialised per-example gradients ``g (B, ...)``."""
  e, gt = _normalised(g.astype(per_example.accumulation_dtype(g.dtype)))

  def total(coef, ok):
    keep = ok.reshape((-1,) + (1,) * (gt.ndim - 1))
    summed = jnp.tensordot(_toward_zero(coef, gt), jnp.where(keep, gt, 0), axes=1,
                           precision=linalg.HIGHEST)
    return per_example.round_toward_zero(summed, out_dtype)
  return _Partial(jnp.sqrt(_sqnorm(gt)), e, total, max(g[0].size, 1))


def _layer_inputs(plan, deltas, xs, leaves):
  """Per tapped call: ``(iw, ib, kind, x, δ)`` with ``x (B, T, a)`` (its patches for a
  convolution; the ``(B, T)`` token ids for an embedding) and ``δ (B, T, b)`` upcast (exactly)
  to the call's accumulation dtype."""
  tapped = [(iw, ib, kind) for iw, ib, _, kind in plan.calls if iw is not None or ib is not None]
  for (iw, ib, kind), delta, x in zip(tapped, deltas, xs):
    dtype = per_example.accumulation_dtype(
        delta.dtype, *(jnp.result_type(leaves[i]) for i in (iw, ib) if i is not None),
        *(() if isinstance(kind, EmbedLayer) else (x.dtype,)))
    delta = delta.astype(dtype)
    if isinstance(kind, EmbedLayer):
      yield iw, ib, kind, jnp.reshape(x, (x.shape[0], -1)), jnp.reshape(
          delta, (delta.shape[0], -1, delta.shape[-1]))
      continue
    if iw is None:          # only the bias is covered: its gradient needs δ alone
      yield iw, ib, kind, None, jnp.reshape(delta, (delta.shape[0], -1,
                                                   math.prod(jnp.shape(leaves[ib]))))
      continue
    x, delta = kind.matrices(x.astype(dtype), delta, jnp.shape(leaves[iw]))
    yield iw, ib, kind, x, delta


def _reshaped(part, fn):
  """``part`` with its total passed through ``fn`` (a reshape to the leaf's shape)."""
  return part._replace(total=lambda coef, ok: fn(part.total(coef, ok)))


def _layer_blocks(iw, ib, kind, x, delta, leaves, parts):
  """The blocks of one recorded call's covered leaves (kernel and bias) into ``parts``."""
  ed, dt = _normalised(delta)
  if iw is not None:
    shape, dtype = jnp.shape(leaves[iw]), jnp.result_type(leaves[iw])
    if isinstance(kind, EmbedLayer):
      parts[iw] = _embed_block(x, dt, ed, shape[0], dtype)
    elif isinstance(kind, ScaleLayer):
      ex, xt = _normalised(x)
      part = _free_block(jnp.sum(xt * dt, axis=1), dtype)
      parts[iw] = part._replace(exponent=part.exponent + ex + ed)
    else:
      ex, xt = _normalised(x)
      parts[iw] = _reshaped(_dense_block(xt, dt, ex, ed, dtype),
                            functools.partial(kind.kernel, w_shape=shape))
  if ib is not None:
    shape = jnp.shape(leaves[ib])
    parts[ib] = _reshaped(_bias_block(dt, ed, jnp.result_type(leaves[ib])),
                          lambda t: jnp.reshape(t, shape))


def _embed_block(ids, dt, ed, num_rows, out_dtype) -> _Partial:
  """The block ``onehot(ids)ᵀδ`` of one embedding lookup, from token ids ``(B, T)`` and the
  rescaled output gradients ``dt (B, T, d) = δ / 2^ed``: each example's gradient rows are
  materialised as ``(T, d)`` (position s holds the sum of ``δ_t`` over the positions t whose
  token first occurs at s, zero elsewhere; the token-equality matrix gives the grouping), so
  the norm and the term are of the same numbers; the total is their scatter-add into the
  ``(V, d)`` table. Equal in exact arithmetic to the one-hot Gram form
  ``⟨[x_t = x_s], δ δᵀ⟩``, at ``O(T² + T·d)`` per example. Ids outside ``[−V, V)`` (which
  ``jnp.take`` fills with NaN, dropping their gradient) contribute nothing."""
  steps = ids.shape[1]
  ids = jnp.where(ids < 0, ids + num_rows, ids)
  valid = (ids >= 0) & (ids < num_rows)
  first = jnp.argmax(ids[:, :, None] == ids[:, None, :], axis=-1)
  rows = jax.vmap(lambda d, f: jax.ops.segment_sum(d, f, num_segments=steps))(
      jnp.where(valid[..., None], dt, 0), first)
  eg, rt = _normalised(rows)
  target = jnp.where(valid, ids, num_rows).reshape(-1)      # out of range: dropped

  def total(coef, ok):
    terms = jnp.where(ok[:, None, None], _toward_zero(coef, rt)[:, None, None] * rt, 0)
    table = jnp.zeros((num_rows, rt.shape[-1]), rt.dtype).at[target].add(
        terms.reshape(-1, rt.shape[-1]), mode="drop")
    return per_example.round_toward_zero(table, out_dtype)
  return _Partial(jnp.sqrt(_sqnorm(rt)), ed + eg, total, num_rows * rt.shape[-1])


def _partials(plan, deltas, xs, free_grads, leaves):
  """The blocks: each covered leaf, and each uncovered leaf (its per-example gradient).

  Everything is computed in :func:`per_example.accumulation_dtype` (float32 for 16-bit models)
  from exactly rescaled (powers of two) layer inputs ``x`` and output gradients ``δ``, and
  every total is converted to its leaf's dtype rounding towards zero
  (:func:`per_example.round_toward_zero`), so the term of example i has entries
  ``|y| ≤ coef_i·|G_i|(1 + u)²`` (u of float32 / float64) for the gradient ``G_i`` the norm is
  of: ``x_iᵀδ_i`` exactly for a vector input (two roundings: ``coef·x`` then ``·δ``), the
  materialised ``Σ_t x_itᵀδ_it`` on the direct route (a convolution's patches included), the
  materialised token rows of an embedding, ``Σ_t δ_it`` for a bias, the materialised
  per-example gradient of an uncovered leaf (one rounding each).
  """
  parts = {}
  for iw, ib, kind, x, delta in _layer_inputs(plan, deltas, xs, leaves):
    _layer_blocks(iw, ib, kind, x, delta, leaves, parts)
  for i, g in zip(plan.uncovered, free_grads):
    parts[i] = _free_block(g, jnp.result_type(leaves[i]))
  return parts


def _global_norm(parts):
  """``(m, E)`` with the per-example global norm ``m · 2^E`` (no overflow in m), the blocks
  combined in the widest accumulation dtype by :func:`per_example.sum_squares`."""
  dtype = per_example.accumulation_dtype(*(p.norm.dtype for p in parts))
  exps = [jnp.where(p.norm > 0, p.exponent, _NO_EXPONENT) for p in parts]
  top = functools.reduce(jnp.maximum, exps)
  scaled = jnp.stack([_ldexp(p.norm.astype(dtype), e - top) for p, e in zip(parts, exps)],
                     axis=-1)
  return jnp.sqrt(per_example.sum_squares(scaled)), top


def _ghost(apply_fn, example_loss, params, batch, divisor=None):
  inputs, targets, size = _split_batch(batch)
  leaves, treedef = jax.tree_util.tree_flatten(params)
  plan = _plan(apply_fn, example_loss, leaves, treedef, inputs, targets)
  _warn_uncovered(params, plan)
  deltas, xs, free_grads = _forward_backward(apply_fn, example_loss, plan, leaves, treedef,
                                             inputs, targets, size, divisor)
  return plan, leaves, treedef, size, _partials(plan, deltas, xs, free_grads, leaves)


def ghost_norms(apply_fn: Callable, example_loss: Callable) -> Callable:
  """``fn(params, batch)`` → the ``(B,)`` per-example gradient norms, by ghost norms.

  Equal (to float rounding) to ``per_example.global_norms(per_example_grads(model_loss(...)))``
  but without per-example gradients of the dense layers. Private values: a diagnostic, not for
  release.

  Args:
    apply_fn, example_loss: as :func:`ghost_clipped_grad_sum`.

  Returns:
    A jittable ``fn(params, batch)``, ``batch = (inputs, targets)``, returning ``(B,)`` norms in
    :func:`dpjax.sgd.per_example.accumulation_dtype` of the gradients (float32 for a 16-bit or
    float32 model, float64 for float64), where they are accumulated: inf or NaN for an example
    with a non-finite entry or a norm beyond that dtype's range.

  Raises:
    TypeError: ``apply_fn`` or ``example_loss`` not callable (at once); at trace time a batch
      that is not a pair, a loss that is not a real scalar.
  """
  _check_callables(apply_fn, example_loss)

  def fn(params, batch):
    _, _, _, size, parts = _ghost(apply_fn, example_loss, params, batch)
    if not parts:
      return jnp.zeros((size,))
    m, top = _global_norm(list(parts.values()))
    return _ldexp(m, top)

  return fn


def ghost_clipped_grad_sum(apply_fn: Callable, example_loss: Callable, *,
                           clip_norm: float | None = None, clipping: str = "clip",
                           stability: float = DEFAULT_STABILITY,
                           embedding_clip: float | None = None,
                           residual_clip: float | None = None,
                           joint: bool = True,
                           per_layer: str | None = None) -> per_example.ClippedGradSum:
  """``fn(params, batch, mask)`` = ``Σ_i mask_i · clip_C(∇ loss_i)`` by ghost clipping.

  Usage (``apply_fn`` sees ONE example and builds its dense layers with the ``dense`` given)::

      def apply_fn(params, x, *, dense):
        return dense(params["out"], jax.nn.relu(dense(params["hidden"], x)))
      grad_fn = dpjax.sgd.ghost_clipped_grad_sum(apply_fn, example_loss, clip_norm=1.0)

  The sum of ``clipped_grad_sum(model_loss(apply_fn, example_loss), ...)`` (to float rounding)
  from one forward and one backward pass and one matmul per dense layer, without per-example
  gradients (Bu et al. 2023; about a non-private step's cost). Other layers go through
  :func:`layer`, Flax models unchanged through :mod:`dpjax.sgd.flax_layers`. Leaves that no
  single top-level layer call owns (tied weights, layers in ``lax.scan``, ``jax.checkpoint``, a
  nested ``jit`` or ``vmap``) fall back to ``vmap(grad)`` (exact, slower; a ``UserWarning``
  names them); one global norm covers all leaves (docs/algorithms.md §6.1).

  Privacy: every term has ℓ2 norm ≤ C whatever the example (non-finite examples and masked rows
  give 0), so the sum has ℓ2-sensitivity C under add/remove-one; ``fn.l2_norm_bound = C``.
  Floating point: "≤ C" holds exactly over each term as materialised, on every route (for
  sequences with T² < a·b by a proven upper bound of the norm, so terms are a little shorter);
  not covered: the rounding of the sum over the batch (docs/algorithms.md §6.1.1).

  GEP (``embedding_clip``, ``residual_clip`` instead of ``clip_norm``): the output of
  :func:`dpjax.sgd.embedding_residual_grad_sum`, ``fn(params, batch, mask, bases)``, an
  :class:`dpjax.sgd.gep.EmbeddingResidualGradSum`; leaves not split by ghost norms fall back to
  ``vmap(grad)`` (a ``UserWarning`` names them; docs/algorithms.md §6.4).

  Args:
    apply_fn: ``apply_fn(params, x, *, dense)`` (one example).
    example_loss: ``example_loss(outputs, y) -> scalar`` (one example).
    clip_norm: C > 0 (None with GEP's clips), or per-layer norms: a prefix tree of the params,
      group g clipped at C_g (Δ = √(Σ C_g²)), as :func:`dpjax.sgd.clipped_grad_sum`'s.
    per_layer: None, ``"uniform"`` or ``"by_size"``: one C split over the leaves (Δ = C).
    clipping: ``"clip"`` (``g / max(1, ‖g‖/C)``) or ``"normalize"`` (``C·g/(‖g‖ + γ)``).
    stability: γ > 0 of ``"normalize"`` (default 0.01).
    embedding_clip, residual_clip: ``C_e, C_ρ > 0``: GEP instead of plain clipping.
    joint: GEP's one clip of the scaled pair (Δ = 1) or one per part (Δ = √2).

  Returns:
    A :class:`dpjax.sgd.per_example.ClippedGradSum` ``fn(params, batch, mask)`` (for
    :func:`dpjax.sgd.dp_sgd_plan` and :mod:`dpjax.sgd.sampling`'s sums): ``batch = (inputs,
    targets)``, pytrees with a shared leading axis B; ``mask (B,)`` bool or float (1: a real,
    sampled example; 0: padding); returns a pytree like ``params`` in its leaves' dtypes.

  Raises:
    ValueError: C ≤ 0 or not finite (any group's); γ ≤ 0; an unknown ``clipping``; both or
      neither of ``clip_norm`` and GEP's clips, or one GEP clip alone; at trace time, per-layer
      norms not a prefix of the params, batch leaves without a shared leading axis, a mask not
      of shape ``(B,)``, bad dense shapes; ``per_layer`` together with GEP's clips.
    TypeError: ``apply_fn`` or ``example_loss`` not callable; at trace time, a batch that is not
      a pair or a loss that is not a real scalar.
    RuntimeError: ``apply_fn``'s ``dense`` calls differ from one trace to the next.

  References:
    Bu, Wang, Zha & Karypis, ICML 2023 (book-keeping); Goodfellow 2015 (per-example norms); Li,
    Tramèr, Liang & Hashimoto, ICLR 2022 (ghost norm of sequences); Abadi et al., CCS 2016.
  """
  clipping, stability = per_example.check_clipping(clipping, stability)
  _check_callables(apply_fn, example_loss)
  split = embedding_clip is not None or residual_clip is not None
  if split == (clip_norm is not None) or (split and (embedding_clip is None
                                                     or residual_clip is None)):
    raise ValueError("give clip_norm (plain clipping) or both embedding_clip and residual_clip "
                     f"(GEP), got clip_norm={clip_norm!r}, embedding_clip={embedding_clip!r}, "
                     f"residual_clip={residual_clip!r}.")
  if split and per_layer is not None:
    raise ValueError("per_layer splits a plain clip norm; GEP's ghost clipping takes "
                     "embedding_clip and residual_clip.")
  if split:
    return _ghost_gep(apply_fn, example_loss,
                      v.check_positive(embedding_clip, "embedding_clip"),
                      v.check_positive(residual_clip, "residual_clip"), bool(joint), clipping,
                      stability)
  clip, bound = per_example.layer_clip_norms(clip_norm, per_layer)

  def fn(params, batch, mask):
    _check_mask(batch, mask)
    plan, leaves, treedef, size, parts = _ghost(apply_fn, example_loss, params, batch)
    out = [jnp.zeros(jnp.shape(x), jnp.result_type(x)) for x in leaves]
    groups, norms = per_example.leaf_groups(params, clip)
    for g, c in enumerate(norms):        # one clip per group (one group: global clipping)
      members = {i: p for i, p in parts.items() if groups[i] == g}
      if not members:
        continue
      m, top = _global_norm(list(members.values()))
      factor, keep = per_example.clip_factor(
          m, c, clipping, stability, exponents=top,
          num_entries=sum(p.size for p in members.values()))
      out = _totals(members, out, factor, keep, top, mask)
    return jax.tree_util.tree_unflatten(treedef, out)

  return per_example.ClippedGradSum(fn, bound)


def _check_mask(batch, mask):
  size = _split_batch(batch)[2]
  if jnp.shape(mask) != (size,):
    raise ValueError(f"mask must have shape ({size},), got {jnp.shape(mask)}.")


def scaled_clipped_sum(apply_fn: Callable, example_loss: Callable, clipping: str = "clip",
                       stability: float = DEFAULT_STABILITY) -> Callable:
  """``fn(params, batch, mask, scale)`` → ``(Σ_i mask_i·clip₁(∇loss_i / s), below)`` by ghost
  clipping, ``below (B,)`` bool: ``‖∇loss_i / s‖ ≤ 1`` as computed (False for a non-finite
  norm). The ghost path of adaptive clipping (:mod:`dpjax.sgd.quantile_clipping`): the loss is
  divided by the public scale ``s = C_t`` before the backward pass, so every term is the
  clipped gradient of a loss, clipped at the static norm 1 — :func:`ghost_clipped_grad_sum`'s
  proof (``‖term‖ ≤ 1`` over the values as materialised) holds unchanged for any traced s.
  Global clipping only. Arguments as :func:`ghost_clipped_grad_sum`'s."""
  clipping, stability = per_example.check_clipping(clipping, stability)
  _check_callables(apply_fn, example_loss)

  def fn(params, batch, mask, scale):
    _check_mask(batch, mask)
    _, leaves, treedef, size, parts = _ghost(apply_fn, example_loss, params, batch,
                                             divisor=scale)
    out = [jnp.zeros(jnp.shape(x), jnp.result_type(x)) for x in leaves]
    if not parts:
      return jax.tree_util.tree_unflatten(treedef, out), jnp.ones((size,), bool)
    m, top = _global_norm(list(parts.values()))
    factor, keep = per_example.clip_factor(m, 1.0, clipping, stability, exponents=top,
                                           num_entries=sum(p.size for p in parts.values()))
    out = _totals(parts, out, factor, keep, top, mask)
    return jax.tree_util.tree_unflatten(treedef, out), _ldexp(m, top) <= 1.0

  return fn


def _totals(parts, out, factor, keep, top, mask, scale=1.0):
  """Each block's weighted total into ``out`` (by leaf index). The block's coefficient:
  ``2^e·scale`` where kept, else ``factor·2^(e − top)·scale`` (the block is stored as
  ``‖g_block‖/2^e``); below the normal range (a block ≪ the example's norm) or not finite: 0,
  never rounded up."""
  ok = keep | (factor > 0)
  weights = jnp.asarray(mask).astype(factor.dtype)
  for i, p in parts.items():
    coef = jnp.where(keep, _ldexp(jnp.ones_like(factor), p.exponent),
                     _ldexp(factor, p.exponent - top)) * jnp.asarray(scale, factor.dtype)
    usable = jnp.isfinite(coef) & (coef >= jnp.finfo(coef.dtype).tiny) & (p.norm > 0)
    out[i] = p.total(*_materialised(jnp.where(ok & usable, coef, 0) * weights, ok))
  return out


def _materialised(*rows):
  """``rows`` (``(B,)`` each) unchanged, computed once. XLA's fusion otherwise re-evaluates
  their whole elementwise chain (every block's exponent, the global norm, the clip factor)
  inside every element of each block's ``(B, T, a)`` book-keeping product: measured +50% on a
  transformer step on CPU. A sort by an already sorted key is the identity, and XLA never
  fuses a sort into its consumers (``optimization_barrier`` is removed before fusion on CPU)."""
  keys = jax.lax.iota(jnp.int32, rows[0].shape[0])
  return jax.lax.sort((keys,) + rows, num_keys=1)[1:]


# --------------------------------------------------------------- GEP by ghost clipping


def _gep_plan(plan, leaf_bases, leaves):
  """``plan`` with the leaves of two-sided bases, and the kernels with a basis of layers other
  than a 2-D dense one, moved to the ``vmap(grad)`` fallback (their split is not a pair of
  dense blocks of the same form)."""
  two = {i for i, b in enumerate(leaf_bases) if isinstance(b, bases_lib.TwoSidedBasis)}
  two |= {iw for iw, _, _, kind in plan.calls
          if iw is not None and leaf_bases[iw] is not None
          and not (type(kind) is DenseLayer and jnp.ndim(leaves[iw]) == 2)}
  two -= set(plan.unused)
  if not two:
    return plan
  calls = tuple((None if iw in two else iw, ib, out, kind) for iw, ib, out, kind in plan.calls)
  return _Plan(calls, tuple(sorted(set(plan.uncovered) | two)), plan.unused)


def _gep_reasons(plain, plan, leaf_bases, leaves) -> dict:
  """Why GEP moved covered leaves to the fallback: a two-sided basis, or a basis on a kernel
  that is not a 2-D dense one (a 3-D attention kernel, a convolution, an embedding)."""
  kinds = {iw: kind for iw, _, _, kind in plain.calls if iw is not None}
  out = {}
  for i in set(plan.uncovered) - set(plain.uncovered):
    if isinstance(leaf_bases[i], bases_lib.TwoSidedBasis):
      out[i] = ("has a two-sided basis: GEP splits it from its materialised gradient (a "
                "one-sided basis on a 2-D dense kernel is split without one)")
    else:
      out[i] = (f"is a {type(kinds.get(i)).__name__} kernel of shape {jnp.shape(leaves[i])} "
                "with a basis: GEP's ghost split covers 2-D dense kernels only (its basis acts "
                "on the leaf's first axis, split from the materialised gradient)")
  return out


def _gep_blocks(plan, deltas, xs, free_grads, leaves, leaf_bases):
  """``(embedding blocks, residual blocks)`` by leaf index (module docstring of the GEP path in
  :func:`ghost_clipped_grad_sum`): a covered kernel with basis U gives the blocks of inputs
  ``xU`` (coefficients ``(r, b)``) and ``x − xUUᵀ``; without a basis, the kernel and biases are
  whole embedding blocks; fallback leaves are split from their materialised gradients."""
  emb, res = {}, {}
  for iw, ib, kind, x, delta in _layer_inputs(plan, deltas, xs, leaves):
    U = None if iw is None else leaf_bases[iw]
    if U is None:
      _layer_blocks(iw, ib, kind, x, delta, leaves, emb)
      continue
    ed, dt = _normalised(delta)
    U = jnp.asarray(U).astype(x.dtype)
    xe = jnp.einsum("nta,ar->ntr", x, U, precision=linalg.HIGHEST)
    xr = x - jnp.einsum("ntr,ar->nta", xe, U, precision=linalg.HIGHEST)
    ee, xet = _normalised(xe)
    er, xrt = _normalised(xr)
    emb[iw] = _dense_block(xet, dt, ee, ed, x.dtype)
    res[iw] = _dense_block(xrt, dt, er, ed, x.dtype)
    if ib is not None:
      emb[ib] = _bias_block(dt, ed, jnp.result_type(leaves[ib]))
  for i, g in zip(plan.uncovered, free_grads):
    U = leaf_bases[i]
    if U is None:
      emb[i] = _free_block(g, jnp.result_type(leaves[i]))
      continue
    dtype = jnp.promote_types(g.dtype, jnp.float32)
    G = g.reshape(g.shape[0], g.shape[1], -1).astype(dtype)
    e = jax.vmap(lambda M, U=U: bases_lib.embed(M, U))(G)
    rest = G - jax.vmap(lambda c, U=U: bases_lib.lift(c, U))(e)
    emb[i] = _free_block(e, dtype)
    res[i] = _free_block(rest.reshape(g.shape), dtype)
  return emb, res


def _ghost_gep(apply_fn, example_loss, c_e, c_r, joint, clipping, stability):
  def fn(params, batch, mask, bases):
    inputs, targets, size = _split_batch(batch)
    if jnp.shape(mask) != (size,):
      raise ValueError(f"mask must have shape ({size},), got {jnp.shape(mask)}.")
    leaves, treedef = jax.tree_util.tree_flatten(params)
    leaf_bases = treedef.flatten_up_to(bases)
    plain = _plan(apply_fn, example_loss, leaves, treedef, inputs, targets)
    plan = _gep_plan(plain, leaf_bases, leaves)
    _warn_uncovered(params, plan, _gep_reasons(plain, plan, leaf_bases, leaves))
    deltas, xs, free_grads = _forward_backward(apply_fn, example_loss, plan, leaves, treedef,
                                               inputs, targets, size)
    emb, res = _gep_blocks(plan, deltas, xs, free_grads, leaves, leaf_bases)
    out_e = [jnp.zeros(_embedding_shape(x, U), _gep_dtype(x, U))
             for x, U in zip(leaves, leaf_bases)]
    out_r = [jnp.zeros(jnp.shape(x) if U is not None else (0,), _gep_dtype(x, U))
             for x, U in zip(leaves, leaf_bases)]
    groups = [(blocks, clip, out) for blocks, clip, out in ((emb, c_e, out_e), (res, c_r, out_r))
              if blocks]
    scaled = []            # each part's norm in scaled units, ‖part‖/C_part = m·2^top
    for blocks, clip, _ in groups:
      m, top = _global_norm(list(blocks.values()))
      scaled.append((m / jnp.asarray(clip, m.dtype), top,
                     4 * sum(b.size for b in blocks.values())))
    if joint and scaled:
      m, top = _global_norm([_Partial(m_, t_, None, n_) for m_, t_, n_ in scaled])
      factor, keep = per_example.clip_factor(m, 1.0, clipping, stability, exponents=top,
                                             num_entries=sum(n_ for _, _, n_ in scaled))
      factors = [(factor, keep, top)] * len(scaled)
    else:
      factors = [per_example.clip_factor(m_, 1.0, clipping, stability, exponents=t_,
                                         num_entries=n_) + (t_,) for m_, t_, n_ in scaled]
    for (blocks, clip, out), (factor, keep, top) in zip(groups, factors):
      _totals(blocks, out, factor, keep, top, mask, scale=1.0 / clip)
    return {"embedding": jax.tree_util.tree_unflatten(treedef, out_e),
            "residual": jax.tree_util.tree_unflatten(treedef, out_r)}

  return gep.EmbeddingResidualGradSum(fn, 1.0 if joint else math.sqrt(2.0),
                                      embedding_clip=c_e, residual_clip=c_r, joint=joint)


def _embedding_shape(leaf, basis):
  """The embedding's shape for a leaf: the leaf's (no basis), ``(r, b)`` or ``(r, r')``."""
  shape = jnp.shape(leaf)
  if basis is None:
    return shape
  if isinstance(basis, bases_lib.TwoSidedBasis):
    return (basis.left.shape[1], basis.right.shape[1])
  return (basis.shape[1], math.prod(shape[1:]))


def _gep_dtype(leaf, basis):
  """The leaf's dtype without a basis, else at least float32 (as the vmap path's split)."""
  dtype = jnp.result_type(leaf)
  return dtype if basis is None else jnp.promote_types(dtype, jnp.float32)
