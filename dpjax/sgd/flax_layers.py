"""Ghost clipping for Flax models as users write them: Linen and NNX layers, unchanged.

:func:`dpjax.sgd.ghost_clipped_grad_sum` clips by ghost norms the layers it sees through the
``dense`` hook it passes to ``apply_fn``. This module makes Flax models pass their layers
through that hook without rewriting them: :func:`linen_apply` wraps ``module.apply`` in
``flax.linen.intercept_methods``, and :func:`nnx_apply` re-types the layers of the model it
merges (a fresh copy each call; the user's model is never touched). Each covered layer runs its
own ``__call__`` (its dtypes, precision, padding), recorded by :func:`dpjax.sgd.ghost.layer`
with the kind whose exact identity gives its per-example gradient:

=============================================  =================================================
layer                                          per-example gradient (ghost norm, book-keeping)
=============================================  =================================================
``nn.Dense`` / ``nnx.Linear``                  dense (:class:`dpjax.sgd.ghost.DenseLayer`):
                                               ``‖x‖‖δ‖`` for a vector; Gram (T² < a·b: a
                                               proven upper bound of the norm) or
                                               direct for a sequence
``nn.DenseGeneral`` / ``nnx.LinearGeneral``    the same with the contracted axes flattened
(contracting trailing axes, no batch axes)
``nn.Conv`` / ``nnx.Conv`` (1-D, 2-D, 3-D;     dense on the input's patches
one feature group, no mask; padding ``SAME``,  (:class:`dpjax.sgd.ghost.ConvLayer`, the unfold
``VALID``, explicit or ``CAUSAL``)             identity)
``nn.Embed`` / ``nnx.Embed`` (``__call__``)    token rows (:class:`dpjax.sgd.ghost.EmbedLayer`)
``LayerNorm``, ``RMSNorm``, ``GroupNorm``      scale (and bias) on the normalised input x̂, the
(Linen and NNX; feature axis last, a scale,    layer's own output at unit scale and zero bias
no ``axis_name``)                              (:class:`dpjax.sgd.ghost.ScaleLayer`)
=============================================  =================================================

Everything else — a ``Conv`` with ``CIRCULAR`` or ``REFLECT`` padding, a mask or feature
groups, a custom ``dot_general``, an embedding also used by ``attend`` (weight tying),
subclasses of these layers, parameters read directly — gets its per-example gradients by
``vmap(grad)`` restricted to those leaves (``ghost_clipped_grad_sum`` warns which), with the
global norm over all leaves. Privacy is :func:`dpjax.sgd.ghost_clipped_grad_sum`'s (each
example's term has norm ≤ C, add/remove-one sensitivity C); the model must treat examples
independently (no batch statistics: ``BatchNorm`` mixes the examples of a batch and is not
supported).

Flax is an optional dependency (``pip install "dpjax[examples]"``), imported when a function
here is first called.

Equinox models are not intercepted: its idiom for a sequence, ``jax.vmap(self.linear)(x)``
(``eqx.nn.MultiheadAttention``'s projections too), calls the layer inside an inner ``vmap``,
where no tap can be taken at ``apply_fn``'s top level, so its layers would fall back anyway;
write such a model's layers with :func:`dpjax.sgd.ghost.layer` (any JAX model can).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from dpjax.sgd import ghost

__all__ = ["linen_apply", "nnx_apply", "nnx_model"]


def _flax():
  try:
    import flax.linen as nn  # pylint: disable=import-outside-toplevel  # optional dependency
    from flax import nnx  # pylint: disable=import-outside-toplevel
  except ImportError as exc:
    raise ImportError('Flax models need Flax: pip install "dpjax[examples]"') from exc
  return nn, nnx


def _tuple(value, n):
  value = 1 if value is None else value
  return (value,) * n if isinstance(value, int) else tuple(value)


def _conv_kind(module):
  """The :class:`ghost.ConvLayer` of a Flax ``Conv`` (Linen or NNX), or None when its gradient
  is not the unfold identity's (groups, a mask, a wrapping padding, a custom convolution)."""
  nn, _ = _flax()
  window = tuple(module.kernel_size)
  custom = getattr(module, "conv_general_dilated", None)
  if (module.feature_group_count != 1 or getattr(module, "mask", None) is not None
      or custom not in (None, jax.lax.conv_general_dilated)
      or getattr(module, "conv_general_dilated_cls", None) is not None):
    return None
  rhs_dilation = _tuple(module.kernel_dilation, len(window))
  padding = nn.linear.canonicalize_padding(module.padding, len(window))
  if padding == "CAUSAL" and len(window) == 1:
    padding = ((rhs_dilation[0] * (window[0] - 1), 0),)
  elif isinstance(padding, str) and padding not in ("SAME", "SAME_LOWER", "VALID"):
    return None
  elif not isinstance(padding, str):
    padding = tuple(tuple(int(p) for p in pair) for pair in padding)
  return ghost.ConvLayer(_tuple(module.strides, len(window)), padding,
                         _tuple(module.input_dilation, len(window)), rhs_dilation)


def _dense_kind(module, inputs, axis, batch):
  """The :class:`ghost.DenseLayer` of a Flax dense layer contracting ``axis`` of ``inputs``, or
  None (batch axes, non-trailing axes, a custom ``dot_general``)."""
  if (batch or getattr(module, "dot_general", None) not in (None, jax.lax.dot_general)
      or getattr(module, "dot_general_cls", None) is not None):
    return None
  axis = sorted(a % inputs.ndim for a in _tuple(axis, 1))
  if axis != list(range(inputs.ndim - len(axis), inputs.ndim)):
    return None
  return ghost.DenseLayer(len(axis))


def _layer(module, inputs, kind):
  """``(kind, kernel name)`` of a covered Flax layer (Linen or NNX) of class ``kind``, or
  ``(None, None)``."""
  nn, nnx = _flax()
  if kind in (nn.Dense, nnx.Linear):
    return _dense_kind(module, inputs, -1, ()), "kernel"
  if kind is nn.DenseGeneral:
    return _dense_kind(module, inputs, module.axis, module.batch_dims), "kernel"
  if kind is nnx.LinearGeneral:
    return _dense_kind(module, inputs, module.axis, tuple(module.batch_axis)), "kernel"
  if kind in (nn.Conv, nnx.Conv):
    return _conv_kind(module), "kernel"
  if kind in (nn.Embed, nnx.Embed) and module.num_embeddings > 1 and jnp.issubdtype(
      jnp.result_type(inputs), jnp.integer):
    return ghost.EmbedLayer(), "embedding"
  if kind in (nn.LayerNorm, nnx.LayerNorm, nn.RMSNorm, nnx.RMSNorm, nn.GroupNorm,
              nnx.GroupNorm) and module.use_scale and module.axis_name is None:
    features = getattr(module, "feature_axes", getattr(module, "feature_axis", -1))
    if [a % jnp.ndim(inputs) for a in _tuple(features, 1)] == [jnp.ndim(inputs) - 1]:
      return ghost.ScaleLayer(), "scale"
  return None, None


def _affine(p, xhat):
  """A normalisation layer's scale and bias on its normalised input ``x̂`` (computed by the layer
  itself with unit scale and zero bias), in ``x̂``'s dtype."""
  out = xhat * p["w"]
  return (out if "b" not in p else out + p["b"]).astype(jnp.result_type(xhat))


def _unit(p):
  """A normalisation layer's parameters with scale 1 and bias 0: its output is then ``x̂``."""
  return {k: (jnp.ones_like if k == "w" else jnp.zeros_like)(v) for k, v in p.items()}


def _one_example(model_call, x, batched):
  """``model_call`` on one example: with a batch axis of 1 added and removed when ``batched``
  (Flax models are written for batches)."""
  if not batched:
    return model_call(x)
  out = model_call(jax.tree_util.tree_map(lambda a: jnp.asarray(a)[None], x))
  return jax.tree_util.tree_map(lambda a: a[0], out)


def _check_batched(batched):
  if not isinstance(batched, bool):
    raise TypeError(f"batched must be a bool, got {type(batched).__name__}.")


def linen_apply(module, *, batched: bool = True, collections=None,
                method: str | Callable | None = None) -> Callable:
  """``apply_fn(params, x, *, dense=dpjax.sgd.dense)`` of a Flax Linen module, for
  :func:`dpjax.sgd.ghost_clipped_grad_sum` (and for evaluation and non-private steps, where
  ``dense`` is ignored).

  ``apply_fn(params, x) = module.apply({"params": params, **collections}, x[None],
  method=method)[0]`` for ONE example ``x`` (``batched=True``: the module is written for
  batches; ``False``: ``module.apply(..., x)``). On the ghost path the module's ``nn.Dense``,
  ``nn.DenseGeneral``, ``nn.Conv``, ``nn.Embed``, ``nn.LayerNorm``, ``nn.RMSNorm`` and
  ``nn.GroupNorm`` calls are intercepted
  (``flax.linen.intercept_methods``) and recorded with their exact per-example-gradient
  identities (module docstring's table); other parameters fall back to ``vmap(grad)``.

  Args:
    module: an unbound ``flax.linen.Module``.
    batched: whether the module expects a leading batch axis.
    collections: other variable collections (e.g. constants), passed unchanged; not trained.
    method: ``module.apply``'s ``method`` (default ``__call__``).

  Returns:
    ``apply_fn(params, x, *, dense)``; ``params`` is the ``"params"`` collection, ``x`` one
    example (a pytree of arrays); its output is the module's for that example.

  Raises:
    TypeError: ``module`` is not a Linen module; ``batched`` not a bool.
    ImportError: Flax is not installed.
  """
  nn, _ = _flax()
  if not isinstance(module, nn.Module):
    raise TypeError(f"module must be a flax.linen.Module, got {type(module).__name__}.")
  _check_batched(batched)
  extra = dict(collections or {})

  def apply_fn(params, x, *, dense=ghost.dense):
    def call(xb):
      return module.apply({"params": params, **extra}, xb, method=method)
    if getattr(dense, "record_layer", None) is None:
      return _one_example(call, x, batched)
    busy = []              # inside a recorded layer's own forward: no interception

    def interceptor(next_fun, args, kwargs, context):
      mod = context.module
      if busy or context.method_name != "__call__" or len(args) != 1 or kwargs:
        return next_fun(*args, **kwargs)
      kind, name = _layer(mod, args[0], type(mod))
      if kind is None:
        return next_fun(*args, **kwargs)
      layer_params = {"w": mod.get_variable("params", name)}
      if getattr(mod, "use_bias", False):
        layer_params["b"] = mod.get_variable("params", "bias")

      def forward(p, xin):
        variables = {name: p["w"], **({"bias": p["b"]} if "b" in p else {})}
        busy.append(True)
        try:
          return mod.clone(parent=None).apply({"params": variables}, xin)
        finally:
          busy.pop()
      if isinstance(kind, ghost.ScaleLayer):
        return ghost.layer(dense, kind, layer_params, forward(_unit(layer_params), args[0]),
                           _affine)
      return ghost.layer(dense, kind, layer_params, args[0], forward)

    with nn.intercept_methods(interceptor):
      return _one_example(call, x, batched)

  return apply_fn


@functools.cache
def _recording_class(base):
  """A subclass of the NNX layer ``base`` whose ``__call__`` goes through
  :func:`dpjax.sgd.ghost.layer` with the hook stored on the instance."""

  def __call__(self, inputs, *args, **kwargs):
    hook = self.__dict__.get("_dpjax_hook")
    # out_sharding (nnx.MultiHeadAttention passes it) places the output; the math is the same.
    plain = not args and set(kwargs) <= {"out_sharding"}
    kind, name = _layer(self, inputs, base) if plain and hook is not None else (None, None)
    if kind is None:
      return base.__call__(self, inputs, *args, **kwargs)
    variables = {"w": getattr(self, name)}
    if getattr(self, "bias", None) is not None:
      variables["b"] = self.bias
    layer_params = {k: var.get_value() for k, var in variables.items()}

    def forward(p, xin):
      for k, var in variables.items():
        var.set_value(p[k])
      try:
        return base.__call__(self, xin, **kwargs)
      finally:
        for k, var in variables.items():
          var.set_value(layer_params[k])
    if isinstance(kind, ghost.ScaleLayer):
      return ghost.layer(hook, kind, layer_params, forward(_unit(layer_params), inputs), _affine)
    return ghost.layer(hook, kind, layer_params, inputs, forward)

  return type(base)(f"Recording{base.__name__}", (base,), {"__call__": __call__,
                                                         "__module__": __name__})


def nnx_apply(graphdef, *states, batched: bool = True) -> Callable:
  """``apply_fn(params, x, *, dense=dpjax.sgd.dense)`` of a Flax NNX model split as
  ``graphdef, params, *states = nnx.split(model, nnx.Param, ...)``, for
  :func:`dpjax.sgd.ghost_clipped_grad_sum` (and for evaluation and non-private steps).

  ``apply_fn(params, x) = nnx.merge(graphdef, params, *states)(x[None])[0]`` for ONE example
  (``batched=False``: ``(...)(x)``). On the ghost path the merged copy's ``nnx.Linear``,
  ``nnx.LinearGeneral`` (so ``nnx.MultiHeadAttention``'s projections), ``nnx.Conv``,
  ``nnx.Embed``, ``nnx.LayerNorm``, ``nnx.RMSNorm`` and ``nnx.GroupNorm`` layers are recorded
  with their exact identities (module docstring); other parameters fall back to
  ``vmap(grad)``. Changes the model makes to its state in a call are
  discarded (``states`` are constants: no batch statistics, no dropout RNG streams).

  Args:
    graphdef: the model's ``GraphDef``.
    *states: the other states ``nnx.split`` returned (may be none).
    batched: whether the model expects a leading batch axis.

  Returns:
    ``apply_fn(params, x, *, dense)``, ``params`` the ``nnx.Param`` state.

  Raises:
    TypeError: ``batched`` not a bool.
    ImportError: Flax is not installed.
  """
  _, nnx = _flax()
  _check_batched(batched)

  def apply_fn(params, x, *, dense=ghost.dense):
    model = nnx.merge(graphdef, params, *states)
    if getattr(dense, "record_layer", None) is not None:
      for _, node in nnx.iter_graph(model):
        if type(node) in (nnx.Linear, nnx.LinearGeneral, nnx.Conv, nnx.Embed, nnx.LayerNorm,
                          nnx.RMSNorm, nnx.GroupNorm):
          node.__class__ = _recording_class(type(node))
          node.__dict__["_dpjax_hook"] = dense
    return _one_example(model, x, batched)

  return apply_fn


def nnx_model(model, *, batched: bool = True):
  """``(apply_fn, params)`` of a Flax NNX model: ``nnx.split(model, nnx.Param, ...)`` and
  :func:`nnx_apply` of it. ``params`` (an ``nnx.State``) is what DP-SGD trains; put it back
  with ``nnx.update(model, params)``.

  Raises:
    TypeError: ``model`` is not an ``nnx.Module``; ``batched`` not a bool.
    ImportError: Flax is not installed.
  """
  _, nnx = _flax()
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}.")
  graphdef, params, *states = nnx.split(model, nnx.Param, ...)
  return nnx_apply(graphdef, *states, batched=batched), params
