"""Argument validation for the public API, run on the host before tracing.

Every public entry point calls these helpers first, so that bad input raises a clear
``ValueError`` / ``TypeError`` that names the argument and the allowed range, instead of an
opaque tracer error (or, worse, a silently wrong release) from inside ``jit``.
"""

from __future__ import annotations

import math
import numbers
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import NeighboringRelation


def check_epsilon(epsilon, name: str = "epsilon") -> float:
  """Returns ``epsilon`` as a float; raises unless it is a finite number > 0."""
  value = _real_scalar(epsilon, name)
  if not (value > 0.0 and math.isfinite(value)):
    raise ValueError(f"{name} must be a finite number > 0, got {name}={epsilon!r}.")
  return value


def check_delta(delta, name: str = "delta", *, upper: float = 1.0) -> float:
  """Returns ``delta`` as a float; raises unless ``0 < delta < upper``."""
  value = _real_scalar(delta, name)
  if not 0.0 < value < upper:
    raise ValueError(f"{name} must lie in (0, {upper:g}), got {name}={delta!r}.")
  return value


def check_positive(value, name: str, *, allow_zero: bool = False,
                   allow_inf: bool = False) -> float:
  """Returns ``value`` as a float; raises unless it is > 0 (or >= 0) and finite."""
  v = _real_scalar(value, name)
  ok = (v >= 0.0) if allow_zero else (v > 0.0)
  if not ok or math.isnan(v) or (math.isinf(v) and not allow_inf):
    bound = ">= 0" if allow_zero else "> 0"
    raise ValueError(f"{name} must be a finite number {bound}, got {name}={value!r}.")
  return v


def check_corruption(corruption, name: str = "corruption") -> float:
  """Returns the corrupted fraction η as a float; raises unless ``0 <= η < 0.5`` (with half of
  the rows the adversary can plant a second Gaussian)."""
  eta = check_positive(corruption, name, allow_zero=True)
  if not eta < 0.5:
    raise ValueError(f"{name} must lie in [0, 0.5) (with half of the rows the adversary can "
                     f"plant a second Gaussian), got {name}={corruption!r}.")
  return eta


def check_int(value, name: str, *, low: int | None = None,
              high: int | None = None) -> int:
  """Returns ``value`` as an int; raises unless it is an integer in ``[low, high]``."""
  if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
    raise TypeError(f"{name} must be an integer, got {name}={value!r} "
                    f"of type {type(value).__name__}.")
  v = int(value)
  if (low is not None and v < low) or (high is not None and v > high):
    lo = "-inf" if low is None else str(low)
    hi = "inf" if high is None else str(high)
    raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {name}={v}.")
  return v


def check_probability(value, name: str, *, open_low: bool = True,
                      open_high: bool = False) -> float:
  """Returns ``value`` as a float in (0, 1] (bounds configurable)."""
  v = _real_scalar(value, name)
  low_ok = v > 0.0 if open_low else v >= 0.0
  high_ok = v < 1.0 if open_high else v <= 1.0
  if not (low_ok and high_ok):
    interval = ("(" if open_low else "[") + "0, 1" + (")" if open_high else "]")
    raise ValueError(f"{name} must lie in {interval}, got {name}={value!r}.")
  return v


def check_choice(value, name: str, choices) -> str:
  if value not in choices:
    raise ValueError(f"{name} must be one of {sorted(choices)}, got {name}={value!r}.")
  return value


def check_neighboring(value, name: str = "neighboring", choices=None):
  """Returns ``value``, a ``dp_accounting.NeighboringRelation`` among ``choices`` (default: the
  add/remove-one and replace-one relations); raises ``TypeError`` / ``ValueError`` otherwise."""
  choices = choices or (NeighboringRelation.ADD_OR_REMOVE_ONE, NeighboringRelation.REPLACE_ONE)
  if not isinstance(value, NeighboringRelation):
    raise TypeError(f"{name} must be a dp_accounting.NeighboringRelation (e.g. "
                    f"NeighboringRelation.REPLACE_ONE), got {value!r}.")
  if value not in choices:
    raise ValueError(f"{name} must be one of {[c.name for c in choices]}, got {value.name}.")
  return value


def is_key(key) -> bool:
  """Whether ``key`` is a single JAX PRNG key (typed, or legacy uint32[2])."""
  return isinstance(key, jax.Array) and (
      (jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ())
      or (key.dtype == jnp.uint32 and key.shape == (2,)))


def check_key(key, name: str = "key") -> jax.Array:
  """Raises ``TypeError`` unless ``key`` is a JAX PRNG key (typed or legacy uint32[2])."""
  if is_key(key):
    return key
  raise TypeError(
      f"{name} must be a single JAX PRNG key (jax.random.key(seed) or "
      f"jax.random.PRNGKey(seed)), got {type(key).__name__} "
      f"{getattr(key, 'dtype', '')}{list(getattr(key, 'shape', ()))}.")


def check_data(X, name: str = "X", *, ndim: int = 2, min_rows: int = 1) -> jax.Array:
  """Validates a real-valued data array and returns it as a floating JAX array.

  Dtypes: float32 / float64 are kept (float64 needs JAX's x64 mode, as for any JAX array);
  integers become the default float dtype; 16-bit floats (float16, bfloat16) are upcast to
  float32, because the linear algebra the learners run (``eigh``, ``svd``, ``cholesky``) has no
  16-bit kernels in jaxlib's LAPACK bindings. The upcast is exact and elementwise (a function of
  each entry alone), so it changes no privacy argument.

  Raises:
    TypeError: if ``X`` is not numeric or has an integer/bool/complex dtype where a float is
      needed (integers are accepted and converted to the default float dtype).
    ValueError: wrong rank, fewer than ``min_rows`` rows, or NaN/inf entries.

  Under tracing (``X`` a tracer inside ``jit`` / ``vmap``) only the structure is checked: the
  values are unknown, and the learners turn a non-finite ``X`` into a typed ⊥ instead (a
  dataset with a NaN lies outside the domain ℝ^{n×d} on which their guarantees are stated).
  """
  try:
    arr = X if isinstance(X, jax.Array) else np.asarray(X)
  except Exception as exc:  # pragma: no cover - exotic inputs
    raise TypeError(f"{name} must be an array, got {type(X).__name__}.") from exc
  dtype = arr.dtype
  if dtype == bool or not (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)
                           or dtype == jnp.bfloat16):
    raise TypeError(f"{name} must have a real floating dtype, got dtype={dtype}.")
  check_not_pixels(arr, name)
  if arr.ndim != ndim:
    raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(arr.shape)}.")
  if arr.shape[0] < min_rows:
    raise ValueError(f"{name} must have at least {min_rows} rows, got {arr.shape[0]}.")
  if any(s == 0 for s in arr.shape[1:]):
    raise ValueError(f"{name} must not have an empty axis, got shape {tuple(arr.shape)}.")
  out = jnp.asarray(arr)
  if not jnp.issubdtype(out.dtype, jnp.floating):
    out = out.astype(jnp.result_type(float))
  elif jnp.finfo(out.dtype).bits < 32:
    out = out.astype(jnp.float32)                 # float16 / bfloat16: no LAPACK kernels
  if not is_traced(out) and not _concrete_all_finite(out):
    raise ValueError(f"{name} contains NaN or infinite entries; remove or impute them first.")
  return out


def check_not_pixels(x, name: str = "X") -> None:
  """Refuses ``uint8`` arrays: raw image pixels in 0–255, whose scale dpjax must not guess
  (issue 53: they were taken as 0–255 values, silently, by DP-SGD, DPASE and CoinPress, whose
  bounds and clip norms are then off by 255×).

  Raises:
    TypeError: ``x`` has dtype uint8, with the conversion to write instead.
  """
  if np.dtype(getattr(x, "dtype", np.float32)) == np.uint8:
    raise TypeError(
        f"{name} has dtype uint8 (raw pixels in 0–255?); dpjax does not guess their scale. "
        f"Convert explicitly: {name}.astype(np.float32) / 255 for values in [0, 1], or "
        f"{name}.astype(np.float32) to keep 0–255 (then set the public bounds, e.g. the clip "
        "norm or data_norm, for that range).")


def check_no_pixels(tree, name: str = "data") -> None:
  """:func:`check_not_pixels` for every leaf of a pytree of examples with two or more axes
  (``(N, …)`` features or images; 1-D uint8 leaves, e.g. class labels, are fine)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if np.ndim(leaf) >= 2:
      check_not_pixels(leaf, f"{name}{jax.tree_util.keystr(path)}")


def user_stacklevel() -> int:
  """The ``stacklevel`` that makes a warning point at the user's call: past the frames of dpjax
  and of the libraries that trace it (jax, optax, flax, equinox) and of Python's own helpers
  (functools, contextlib), counted from the caller of ``warnings.warn``. (Computed at each
  warning: rare, and a library imported after the first one is then known.)"""
  import contextlib
  import functools
  import os
  roots = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
  for name in ("jax", "jaxlib", "optax", "flax", "equinox"):
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None):
      roots.append(os.path.dirname(os.path.abspath(module.__file__)) + os.sep)
  roots = tuple(roots + [os.path.abspath(functools.__file__),
                         os.path.abspath(contextlib.__file__)])
  frame, level = sys._getframe(1), 1      # the frame that calls warnings.warn is level 1
  while frame is not None and frame.f_code.co_filename.startswith(roots):
    frame, level = frame.f_back, level + 1
  return level


def smallest_n(enough, message: str, limit: int = 10 ** 12, start: int = 1) -> int:
  """The smallest n ≥ start with ``enough(n)``, for ``enough`` monotone in n (false, then true):
  doubling, then bisection. Raises ``ValueError(message)`` when no n up to ``limit`` is."""
  if enough(start):
    return start
  lo, hi = start, 2 * start
  while not enough(hi):
    lo, hi = hi, hi * 2
    if hi > limit:
      raise ValueError(message + ".")
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if enough(mid) else (mid, hi)
  return hi


def is_traced(*trees) -> bool:
  """True if any leaf of ``trees`` is a JAX tracer (we are inside ``jit`` / ``vmap`` / ...)."""
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(trees))


@jax.jit
def all_finite(x: jax.Array) -> jax.Array:
  """``all(isfinite(x))`` as one fused reduction (no ``n·d`` temporary; one host sync)."""
  return jnp.all(jnp.isfinite(x))


def _concrete_all_finite(x: jax.Array) -> bool:
  """``all_finite`` of a concrete array, evaluated now even inside a ``jit`` trace (a dataset
  closed over by a jitted function is concrete, but jnp operations on it would be staged)."""
  with jax.ensure_compile_time_eval():
    return bool(all_finite(x))


def domain_bottom(X, ok, *outputs):
  """``(ok & all(isfinite(X)), *outputs zeroed unless ok)`` — traceable.

  The typed ⊥ for a traced dataset with a NaN/inf entry: such a dataset lies outside the domain
  ℝ^{n×d} on which the learners' guarantees are stated, so answering ⊥ on it changes no
  guarantee (a concrete ``X`` is rejected by :func:`check_data` instead).
  """
  ok = jnp.logical_and(ok, all_finite(X))
  return (ok,) + tuple(jnp.where(ok, out, jnp.zeros_like(out)) for out in outputs)


def check_data64(X, name: str = "X", *, ndim: int = 2, min_rows: int = 1) -> np.ndarray:
  """:func:`check_data` at full precision: float64 input stays float64 whatever JAX's x64 flag.

  Returns a float64 NumPy array (for estimators whose utility needs float64, e.g. covariances
  with condition numbers up to 1e12 or means of 1e6); under tracing, the tracer as
  :func:`check_data` returns it (the host computation converts it to float64).
  """
  if is_traced(X):
    return check_data(X, name, ndim=ndim, min_rows=min_rows)
  # A concrete X closed over by a jitted function stays concrete (jnp would stage operations).
  with jax.ensure_compile_time_eval(), jax.enable_x64(True):
    return np.asarray(check_data(X, name, ndim=ndim, min_rows=min_rows), np.float64)


def _real_scalar(value, name: str) -> float:
  if isinstance(value, bool):
    raise TypeError(f"{name} must be a real number, got {name}={value!r}.")
  if isinstance(value, (jax.Array, np.ndarray)):
    if value.ndim != 0:
      raise TypeError(f"{name} must be a scalar, got an array of shape {value.shape}.")
    value = value.item()
  if not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a real number, got {type(value).__name__}.")
  v = float(value)
  if math.isnan(v):
    raise ValueError(f"{name} must not be NaN.")
  return v


def check_finite_tree(tree, name: str) -> None:
  """Raises ``ValueError`` if any floating leaf of a pytree holds NaN or inf."""
  for leaf in jax.tree_util.tree_leaves(tree):
    arr = jnp.asarray(leaf)
    if jnp.issubdtype(arr.dtype, jnp.inexact) and not bool(jnp.all(jnp.isfinite(arr))):
      raise ValueError(f"{name} contains NaN or infinite entries; remove or impute them first.")


def check_scores(scores, name: str = "scores"):
  """Validates a ``(C,)`` vector of real or integer candidate scores, ``C >= 1``.

  Returns NumPy input as NumPy (so int64 values stay exact for range checks) and JAX input as is.

  Raises:
    TypeError: bool or non-numeric dtype.
    ValueError: not of shape ``(C,)`` with ``C >= 1``.
  """
  if not isinstance(scores, jax.Array):
    scores = np.asarray(scores)
  if scores.dtype == np.bool_ or not (np.issubdtype(scores.dtype, np.integer)
                                      or jnp.issubdtype(scores.dtype, jnp.floating)):
    raise TypeError(f"{name} must be real or integer, got dtype={scores.dtype}.")
  if scores.ndim != 1 or scores.shape[0] == 0:
    raise ValueError(f"{name} must have shape (C,) with C >= 1, got shape "
                     f"{tuple(scores.shape)}.")
  return scores


def probability_text(p: float) -> str:
  """A probability for a message: ``0.6073``, ``1.97e-05``, or ``1 - 3.2e-08`` near 1."""
  return f"1 - {1.0 - p:.2g}" if 0.999 < p < 1.0 else f"{p:.4g}"


def check_test_can_pass(pass_probability: float, delta: float, *, sure: bool,
                        refusal: str, warning: str) -> None:
  """Refuses or warns when a private test's best-case pass probability is small (public only).

  A learner whose noisy test, even on the most favourable data, passes with probability
  ``pass_probability`` (computed from public parameters) answers ⊥ silently in all but a
  negligible fraction of runs when that probability is ≤ δ: refuse up front instead. Between
  δ and 1 it still runs (the guarantee is unchanged) but warns. Nothing here sees data.

  Args:
    pass_probability: the best-case pass probability.
    delta: the refusal level (the test's δ).
    sure: True when the configuration is the recommended one (no warning).
    refusal: the ``ValueError`` message.
    warning: the :class:`dpjax.UnderpoweredWarning` message.

  Raises:
    ValueError: ``pass_probability <= delta`` (up to a relative 1e-9 for rounding).
  """
  if pass_probability <= delta * (1.0 + 1e-9):
    raise ValueError(refusal)
  if not sure:
    from dpjax.results import warn_underpowered
    warn_underpowered(warning)


def check_shape(shape, name: str = "shape") -> tuple[int, ...]:
  """Returns ``shape`` as a tuple of ints; raises unless it is one with entries ≥ 0."""
  if isinstance(shape, (numbers.Integral, np.integer)) and not isinstance(shape, bool):
    shape = (shape,)
  if not isinstance(shape, (tuple, list)) or any(
      isinstance(s, bool) or not isinstance(s, (numbers.Integral, np.integer)) for s in shape):
    raise TypeError(f"{name} must be a tuple of non-negative ints, got {name}={shape!r}.")
  if any(int(s) < 0 for s in shape):
    raise ValueError(f"{name} must be a tuple of non-negative ints, got {name}={shape!r}.")
  return tuple(int(s) for s in shape)


def check_float_dtype(dtype, name: str = "dtype"):
  """Returns the float dtype to sample in (JAX's default float for ``None``)."""
  if dtype is None:
    return jnp.dtype(jnp.result_type(float))
  try:
    dt = jnp.dtype(dtype)
  except TypeError as exc:
    raise TypeError(f"{name} must be a floating dtype, got {name}={dtype!r}.") from exc
  if not jnp.issubdtype(dt, jnp.floating):
    raise TypeError(f"{name} must be a floating dtype, got {name}={dtype!r}.")
  return dt


def sanitise_value(value, name: str = "value") -> jax.Array:
  """Returns ``value`` as a JAX float array with every NaN/inf entry replaced by 0.

  For a computed private statistic about to be released: raising on a non-finite entry would be
  a data-dependent branch outside any DP mechanism, so a fixed public map is applied instead
  (the guarantee then needs the stated sensitivity to bound the change of the sanitised value).
  Traceable.

  Raises:
    TypeError: a non-float dtype.
  """
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(f"{name} must be a float array, got dtype={value.dtype}.")
  return jnp.where(jnp.isfinite(value), value, jnp.zeros((), value.dtype))


def check_float_array(value, name: str = "value"):
  """Checks that ``value`` is a float array (JAX, tracer or NumPy) and returns it unchanged
  (NumPy stays NumPy, so that float64 survives whatever JAX's x64 flag).

  Raises:
    TypeError: a non-float dtype.
  """
  if not isinstance(value, jax.Array):
    value = np.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(f"{name} must be a float array, got dtype={value.dtype}.")
  return value


def sanitise_host_value(value) -> np.ndarray:
  """:func:`sanitise_value` on the host: a NumPy float array (its own precision, float64 kept
  whatever JAX's x64 flag) with every NaN/inf entry replaced by 0."""
  value = np.asarray(value)
  return np.where(np.isfinite(value), value, np.zeros((), value.dtype))
