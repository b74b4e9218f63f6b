"""Host-side computations that stay callable under ``jit`` and ``vmap``.

Some releases must run on the host: exact integer samplers with Python integers (the discrete
Gaussian, whose rejection step needs rationals far beyond 64 bits), float64 estimators that must
keep float64 whatever JAX's x64 flag, and learners whose public candidate sets have
data-independent but not static sizes. :func:`host_call` runs such a function directly when its
inputs are concrete, and through ``jax.pure_callback`` when they are traced, so that
``jax.jit(f)`` and ``jax.vmap(f)`` over keys work and give the same output per key as the eager
call. The callback runs its JAX work on the CPU device (never on the accelerator that is waiting
for it) and must not raise: every argument is validated before tracing.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dpjax._validation import is_traced


def host_call(fn: Callable, result_shape_dtypes: Any, key: jax.Array, *args) -> Any:
  """``fn(key, *args)`` on the host, eagerly or (when anything is traced) as a pure callback.

  Args:
    fn: ``fn(key, *numpy_args) -> pytree of arrays`` shaped like ``result_shape_dtypes``; it may
      call JAX (on the CPU) and must be deterministic given its arguments.
    result_shape_dtypes: pytree of ``jax.ShapeDtypeStruct`` (the output's static structure).
      Under tracing, float64/int64 outputs become JAX's canonical dtypes (float32/int32 without
      x64; integers saturate at the range) — a post-processing of what ``fn`` computed.
    key: a PRNG key (typed or legacy ``uint32[2]``).
    *args: arrays (concrete or traced).

  Returns:
    Eagerly: whatever ``fn`` returns (NumPy arrays, full precision). Traced: JAX arrays.
  """
  if not is_traced(key, args):
    return fn(key, *args)
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  impl = jax.random.key_impl(key) if typed else None
  data = jax.random.key_data(key) if typed else key
  shapes = jax.tree_util.tree_map(
      lambda s: jax.ShapeDtypeStruct(s.shape, jax.dtypes.canonicalize_dtype(s.dtype)),
      result_shape_dtypes)

  def callback(key_data, *host_args):
    with jax.default_device(jax.devices("cpu")[0]):
      k = (jax.random.wrap_key_data(jnp.asarray(key_data), impl=impl) if typed
           else jnp.asarray(key_data))
      out = fn(k, *(np.asarray(a) for a in host_args))
    return jax.tree_util.tree_map(_cast, out, shapes)

  return jax.pure_callback(callback, shapes, data, *args, vmap_method="sequential")


def _cast(value, spec) -> np.ndarray:
  """``value`` in ``spec.dtype``; integers saturate instead of wrapping."""
  value = np.asarray(value)
  if np.issubdtype(spec.dtype, np.integer) and np.issubdtype(value.dtype, np.integer):
    info = np.iinfo(spec.dtype)
    value = np.clip(value, info.min, info.max)
  return value.astype(spec.dtype)
