"""Host-side releases that stay callable under ``jit`` and ``vmap``, and float64 stages.

Two tools, one rule: a ``jax.pure_callback`` runs plain NumPy only.

* :func:`host_call` runs a NumPy function on the host: exact integer samplers with Python
  integers (the discrete Gaussian, whose rejection step needs rationals far beyond 64 bits),
  snapping's float64 bit manipulation, learners whose candidate sets have data-independent but
  not static sizes. It calls the function directly when its inputs are concrete, and through
  ``jax.pure_callback`` when they are traced; either way the function receives a NumPy
  ``Generator`` seeded from the key's data (:func:`host_rng`) and NumPy arrays, so the eager call,
  ``jax.jit(f)`` and each row of ``jax.vmap(f)`` over keys give the same output per key. The
  callback compiles and runs no JAX: JAX work inside a callback competes with the program that is
  waiting for it (the thread pool that runs both, the device, XLA's compiler).
* :func:`float64` runs JAX work in float64 whatever JAX's x64 flag, without a callback: eagerly
  under ``jax.enable_x64(True)``, and under ``jit`` / ``vmap`` staged inline in the caller's
  program, which must then be traced with x64 on (a float32 program cannot hold the stage: XLA
  lowers it with the program's own x64 setting, which breaks float64 random sampling).
"""

from __future__ import annotations

import random
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dpjax._validation import is_traced


def host_rng(key) -> np.random.Generator:
  """A NumPy ``Generator`` (PCG64) seeded with all the data of ``key``, deterministic per key.

  Args:
    key: a concrete JAX PRNG key (typed or legacy ``uint32[2]``), or its key data as a NumPy
      integer array (what a callback receives).

  Returns:
    ``np.random.Generator``: its ``SeedSequence`` hashes every word of the key's data, so
    distinct keys give independent streams (the key must not also feed other randomness: a
    release owns its key, as everywhere in dpjax).
  """
  if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  words = np.asarray(key).astype(np.uint32).ravel()
  return np.random.default_rng([int(w) for w in words])


def python_random(rng: np.random.Generator) -> random.Random:
  """A Python ``random.Random`` seeded with 128 bits of ``rng`` (for exact samplers on Python
  integers: ``randrange`` draws exactly uniform integers of any size, by rejection)."""
  return random.Random(int.from_bytes(rng.bytes(16), "little"))


def host_call(fn: Callable, result_shape_dtypes: Any, key: jax.Array, *args) -> Any:
  """``fn(host_rng(key), *args)`` on the host, eagerly or (when anything is traced) as a pure
  callback.

  Args:
    fn: ``fn(rng, *numpy_args) -> pytree of arrays`` shaped like ``result_shape_dtypes``, plain
      NumPy/SciPy/Python (no JAX: it may run inside a callback), deterministic given its
      arguments, never raising (validate every argument before calling).
    result_shape_dtypes: pytree of ``jax.ShapeDtypeStruct`` (the output's static structure).
      Under tracing, float64/int64 outputs become JAX's canonical dtypes (float32/int32 without
      x64; integers saturate at the range) — a post-processing of what ``fn`` computed.
    key: a PRNG key (typed or legacy ``uint32[2]``).
    *args: arrays (concrete or traced); ``fn`` receives them as NumPy arrays.

  Returns:
    Eagerly: whatever ``fn`` returns (NumPy arrays, full precision). Traced: JAX arrays.
  """
  if not is_traced(key, args):
    with jax.ensure_compile_time_eval():      # concrete inside someone's trace: still eager
      rng = host_rng(key)
    return fn(rng, *(np.asarray(a) for a in args))
  data = (jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
          else key)
  shapes = jax.tree_util.tree_map(
      lambda s: jax.ShapeDtypeStruct(s.shape, jax.dtypes.canonicalize_dtype(s.dtype)),
      result_shape_dtypes)
  # 64-bit arrays cross the callback as pairs of uint32 words: JAX converts a callback's inputs
  # and outputs to the canonical dtypes of the thread that runs it, and XLA may run it on a
  # worker thread that does not see a `with jax.enable_x64(True):` of the tracing thread
  # (float64 inputs would arrive as float32, float64 outputs be refused).
  args = [jnp.asarray(a) for a in args]
  in_dtypes = [a.dtype for a in args]
  wire_args = [jax.lax.bitcast_convert_type(a, jnp.uint32) if _wide(a.dtype) else a for a in args]
  wire = jax.tree_util.tree_map(
      lambda s: jax.ShapeDtypeStruct(s.shape + (2,), np.uint32) if _wide(s.dtype) else s, shapes)
  key_ndim = data.ndim                       # per example: vmap's batch axes come in front

  def one(key_data, host_args):
    host_args = [_unwords(a, t) for a, t in zip(host_args, in_dtypes)]
    out = fn(host_rng(key_data), *host_args)
    return jax.tree_util.tree_map(lambda o, s: _words(_cast(o, s)), out, shapes)

  def callback(key_data, *host_args):
    # Under vmap every argument arrives with the batch axes in front ("broadcast_all"): one
    # callback for the whole batch, and a Python loop over its examples (the same per-example
    # computation as unbatched, so the same output per key).
    key_data, host_args = np.asarray(key_data), [np.asarray(a) for a in host_args]
    batch = key_data.shape[:key_data.ndim - key_ndim]
    if not batch:
      return one(key_data, host_args)
    outs = [one(key_data[i], [a[i] for a in host_args]) for i in np.ndindex(batch)]
    if not outs:
      return jax.tree_util.tree_map(lambda s: np.zeros(batch + s.shape, s.dtype), wire)
    return jax.tree_util.tree_map(
        lambda *xs: np.stack(xs).reshape(batch + np.shape(xs[0])), *outs)

  out = jax.pure_callback(callback, wire, data, *wire_args, vmap_method="broadcast_all")
  return jax.tree_util.tree_map(
      lambda o, s: jax.lax.bitcast_convert_type(o, s.dtype) if _wide(s.dtype) else o, out, shapes)


def _wide(dtype) -> bool:
  """A 64-bit real or integer dtype (what JAX narrows without x64)."""
  return np.dtype(dtype).kind in "fiu" and np.dtype(dtype).itemsize == 8


def _words(value: np.ndarray) -> np.ndarray:
  """A 64-bit array as ``uint32`` words (trailing axis of 2, native order); others unchanged."""
  if not _wide(value.dtype):
    return value
  return np.ascontiguousarray(value).view(np.uint32).reshape(value.shape + (2,))


def _unwords(value: np.ndarray, dtype) -> np.ndarray:
  """The inverse of :func:`_words` for an array that is ``dtype`` in the program."""
  if not _wide(dtype):
    return value
  return np.ascontiguousarray(value, np.uint32).view(np.dtype(dtype)).reshape(value.shape[:-1])


def x64_enabled() -> bool:
  """True when JAX's x64 mode is on here (globally or inside ``jax.enable_x64(True)``)."""
  return jax.dtypes.canonicalize_dtype(np.float64) == np.float64


def float64(name: str, fn: Callable, *args, **kwargs) -> Any:
  """``fn(*args, **kwargs)`` in JAX with x64 mode on and float array arguments cast to float64.

  For releases that are computed in float64 whatever JAX's x64 flag, in JAX (not in a callback):

  * eagerly (no traced argument): ``fn`` runs under ``jax.enable_x64(True)`` and its outputs come
    back as NumPy arrays in full precision;
  * traced (``jit`` / ``vmap``) with x64 on: ``fn`` is staged inline in the caller's program;
  * traced with x64 off: ``TypeError`` at trace time. A float32 program cannot hold this float64
    stage (XLA lowers it with the program's x64 setting), and running it in a host callback would
    compile JAX inside the callback; the message says to trace inside ``jax.enable_x64(True)``
    or call eagerly.

  Args:
    name: the public function's name (for the error message).
    fn: a traceable JAX function.
    *args, **kwargs: its arguments (float arrays are cast to float64).

  Raises:
    TypeError: traced with x64 off.
  """
  if is_traced(args, kwargs):
    if not x64_enabled():
      raise TypeError(
          f"{name} computes in float64 whatever JAX's x64 flag; under jit/vmap that needs x64 "
          f"mode: trace it inside `with jax.enable_x64(True):` (or set jax_enable_x64), or call "
          f"it eagerly.")
    return fn(*(_as64(a) for a in args), **kwargs)
  with jax.enable_x64(True), jax.ensure_compile_time_eval():   # concrete inside a trace too
    return jax.tree_util.tree_map(np.asarray, fn(*(_as64(a) for a in args), **kwargs))


def eager_only(name: str, *args, cores: str = "") -> None:
  """Raises ``TypeError`` if any of ``args`` is traced: for learners orchestrated on the host
  (their steps' shapes depend on released values), which neither a ``jit`` program nor a host
  callback (no JAX inside one) can hold. ``cores`` names the traceable pieces to use instead."""
  if is_traced(args):
    raise TypeError(f"{name} is orchestrated on the host (its steps' shapes or branches depend on "
                    f"released values): call it eagerly, outside jit/vmap."
                    + (f" Its traceable pieces: {cores}." if cores else ""))


def _as64(a):
  if isinstance(a, (jax.Array, np.ndarray)) and jnp.issubdtype(a.dtype, jnp.floating):
    return jnp.asarray(a, jnp.float64)
  return a


def _cast(value, spec) -> np.ndarray:
  """``value`` in ``spec.dtype``; integers saturate instead of wrapping."""
  value = np.asarray(value)
  if np.issubdtype(spec.dtype, np.integer) and np.issubdtype(value.dtype, np.integer):
    info = np.iinfo(spec.dtype)
    value = np.clip(value, info.min, info.max)
  return value.astype(spec.dtype)
