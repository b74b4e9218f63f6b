"""Per-example gradients and their clipping (docs/algorithms.md §6.1).

The clipping map ``g ↦ ḡ = g / max(1, ‖g‖₂/C)`` uses the global ℓ2 norm over the whole gradient
pytree of one example. It is what bounds DP-SGD's sensitivity, so it must be bounded for EVERY
input, including the pathological ones:

=========================================  ==================================================
per-example gradient ``g``                 clipped ``ḡ``
=========================================  ==================================================
``‖g‖ ≤ C(1 − ρ)``                          ``g`` unchanged
``‖g‖ > C(1 − ρ)`` (finite)                 ``g · C(1 − ρ)/‖g‖``, the factor rounded down
                                            (norm ≤ C); no overflow even when ``‖g‖²``
                                            exceeds the float range (norm computed on
                                            ``g / 2^e``, ``max|g / 2^e| ∈ [1/2, 1)``)
``g = 0``                                   ``0`` (no 0/0)
any NaN or ±inf entry, or ``‖g‖`` beyond    ``0`` for the whole example (a NaN would otherwise
the float32 (float64) range                 poison the sum and reveal the example)
=========================================  ==================================================

so ``‖ḡ‖ ≤ C`` always, and the sum over a batch has ℓ2-sensitivity C under add/remove-one.

Floating point. "Always" means: for the values as materialised, in every float dtype (float16,
bfloat16, float32, float64 with x64), ``‖ḡ‖`` evaluated exactly is ≤ C. Rounding would otherwise
break it (a bfloat16 term at 1.008 C when the norm is accumulated in bfloat16, measured), so
(:func:`clip_factor`): norms and factors are computed in float32 (float64 for float64
gradients) from exactly rescaled entries, summed in a fixed tree with a proven error bound
(:func:`sum_squares`); the clip is at ``C(1 − ρ)`` with ``ρ = (2λ + 12)u`` (u = 2⁻²⁴, or 2⁻⁵³;
λ = ⌈log2 P⌉ for P entries: ρ ≈ 3.1·10⁻⁶ for 10⁶ entries, the whole utility cost), which
covers the norm's rounding and that of ``factor · g``; the factor is rounded down; and
``factor · g`` is converted to a 16-bit dtype rounding TOWARDS ZERO, which never lengthens
a term (to nearest, a float16 term can reach 1.18 C when its entries are subnormal, measured).
Not covered: the rounding of the SUM of the terms in the output dtype (a property of any
floating-point DP-SGD, not of one term), and clip norms below ~10⁻³³ (float32's normal range).

Normalised ("automatic") clipping, ``clipping="normalize"``: ``ḡ = C·g/(‖g‖ + γ)`` with a
stability constant γ > 0 (Bu et al., "Automatic Clipping", NeurIPS 2023, AUTO-S; Yang et al.,
DP-NSGD, 2022). Every example gets about the same weight C, so C only scales the learning rate
and needs no tuning; ``‖ḡ‖ = C‖g‖/(‖g‖ + γ) < C`` for every finite g, and the non-finite rows of
the table above become 0 as well, so the sensitivity is the same C (computed as
``C(1 − ρ)·g/(‖g‖ + γ)``, the same safeguards).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import linalg

__all__ = ["ClippedGradSum", "clip_per_example", "clipped_grad_sum", "global_norms",
           "per_example_grads"]


def per_example_grads(loss_fn: Callable) -> Callable:
  """``fn(params, batch)`` → the gradient of ``loss_fn`` for every example (``vmap`` of ``grad``).

  Not private by itself: per-example gradients are the private quantities DP-SGD clips and
  noises. Prefer :func:`clipped_grad_sum`, which never materialises them.

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar`` for ONE example (a pytree of arrays without
      a batch axis).

  Returns:
    A jittable function of ``(params, batch)``, ``batch`` a pytree whose leaves share a leading
    axis B, returning a pytree like ``params`` whose leaves carry a leading axis B (same dtypes).
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  return jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))


CLIPPINGS = ("clip", "normalize")
DEFAULT_STABILITY = 0.01


def accumulation_dtype(*dtypes) -> jnp.dtype:
  """The dtype norms and clip factors are computed in: float32 for 16-bit (and 32-bit) floats,
  float64 for float64 (with ``jax_enable_x64``): ``promote_types(*dtypes, float32)``."""
  return functools.reduce(jnp.promote_types, dtypes, jnp.dtype(jnp.float32))


# ---------------------------------------------------------------- exact powers of two (no libm)


def _bits(dtype):
  info = jnp.finfo(dtype)
  return info, {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[info.dtype.itemsize]


def _exp2(e, dtype):
  """``2^e`` exactly, for integer ``e`` in the dtype's normal range (built from its bits; the
  generic ``jnp.ldexp`` / ``jnp.frexp`` triple XLA's compile time here)."""
  info, ints = _bits(dtype)
  return jax.lax.bitcast_convert_type((e.astype(ints) + (info.maxexp - 1)) << info.nmant, dtype)


def pow2_factors(e, dtype):
  """``(2^⌊e/2⌋, 2^(e−⌊e/2⌋))``: two normal factors whose product is ``2^e`` (``e`` int32,
  clipped to twice the normal range), so ``x · f1 · f2`` is exact but for over/underflow of
  the result."""
  lim = jnp.finfo(dtype).maxexp - 2
  e = jnp.clip(e, -2 * lim, 2 * lim)
  h = jax.lax.shift_right_arithmetic(e, jnp.ones_like(e))            # ⌊e/2⌋
  return _exp2(h, dtype), _exp2(e - h, dtype)


def ldexp(x, e):
  """``x · 2^e`` (``e`` int32, broadcast against ``x``): exact but for over/underflow of the
  result, in two factors that stay in the normal range."""
  f1, f2 = pow2_factors(e, x.dtype)
  return x * f1 * f2


def exponent(amax):
  """``e`` with ``amax < 2^e`` and ``amax ≥ 2^(e−1)`` for a normal ``amax > 0`` (frexp's)."""
  info, ints = _bits(amax.dtype)
  biased = (jax.lax.bitcast_convert_type(amax, ints) >> info.nmant) & (2 * info.maxexp - 1)
  return (biased - (info.maxexp - 2)).astype(jnp.int32)


def normalised(x, batch_dims: int = 1):
  """``(e, x / 2^e)``: per row of the first ``batch_dims`` axes, ``max|x / 2^e| ∈ [1/2, 1)``
  (exact, but for entries below the float range after scaling); ``e = 0`` (int32) for a zero or
  non-finite row, which stays non-finite."""
  axes = tuple(range(batch_dims, x.ndim))
  amax = jnp.max(jnp.abs(x), axis=axes, initial=0)
  ok = jnp.isfinite(amax) & (amax > 0)
  e = jnp.where(ok, exponent(jnp.where(ok, amax, 1)), 0)
  return e, ldexp(x, -e.reshape(e.shape + (1,) * len(axes)))


# ------------------------------------------------------------------ sums with a rounding bound

_FAN_IN = 16   # terms added per stage of sum_squares, in a balanced tree (depth 4)


def _balanced_sum(parts):
  """Σ of same-shaped arrays as a balanced binary tree of explicit additions (⌈log2 k⌉ deep)."""
  while len(parts) > 1:
    parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i]
             for i in range(0, len(parts), 2)]
  return parts[0]


def sum_levels(n: int) -> int:
  """λ(n): the most roundings one term passes through in :func:`sum_squares` of ``n`` terms:
  ``⌈log2 n⌉`` (each stage adds a depth of 4 and divides the count by 16, rounding up)."""
  levels = 0
  while n > _FAN_IN:
    m, tail = divmod(n, _FAN_IN)
    levels += max((_FAN_IN - 1).bit_length(), (tail - 1).bit_length() if tail else 0)
    n = m + (1 if tail else 0)
  return levels + max(n - 1, 0).bit_length()


def tree_sum(x, square: bool = False, scale=None):
  """``Σ_j x_j`` (``square``: ``Σ_j (x_j · scale)²``) over the last axis of ``x (..., n)``, in a
  fixed tree.

  Every addition is explicit, in stages that each add 16 slices of the previous stage in a
  balanced tree (the first stage scales and squares its slices inside the same fused loop, so
  neither the squares nor a padded copy are materialised), so each term passes through at most
  λ(n) = :func:`sum_levels` ``(n)`` = ``⌈log2 n⌉`` roundings whatever XLA does: it does not
  reassociate explicit additions (no fast-math), and no ``reduce`` is involved, whose order is
  unspecified (``jnp.sum`` guarantees only ``n − 1``). Rounded to nearest, the result is within
  ``γ_λ·Σ_j|x_j|`` of the exact sum (``γ_k = ku/(1 − ku)``), and ``≥ (1 − u)^λ`` times it for
  non-negative terms (but for results below the float's normal range).

  Args:
    x: ``(..., n)`` float array.
    square: square each term (after ``scale``) before summing.
    scale: None, or a tuple of arrays broadcasting against ``x[..., :1]`` (e.g. ``(..., 1)``;
      powers of two such as :func:`pow2_factors`): each entry is multiplied by them in turn
      (before squaring, with ``square``).

  Returns:
    ``(...)`` array in ``x``'s dtype.
  """
  def first_stage(v):
    for factor in scale or ():
      v = v * factor
    return jnp.square(v) if square else v

  n = x.shape[-1]
  if n == 0:
    return jnp.zeros(x.shape[:-1], x.dtype)
  v, first = x, True
  while True:
    n = v.shape[-1]
    f = first_stage if first else (lambda w: w)
    if n <= _FAN_IN:
      return _balanced_sum([f(v[..., j:j + 1]) for j in range(n)])[..., 0]
    m, tail = divmod(n, _FAN_IN)
    parts = [_balanced_sum([f(v[..., i * m:(i + 1) * m]) for i in range(_FAN_IN)])]
    if tail:
      parts.append(_balanced_sum([f(v[..., j:j + 1]) for j in range(_FAN_IN * m, n)]))
    v, first = jnp.concatenate(parts, axis=-1), False


def sum_squares(x, scale=None):
  """``Σ_j (x_j · scale)²`` over the last axis of ``x (..., n)``: :func:`tree_sum` of the
  squares, so for these non-negative terms rounded to nearest the result is ≥ the exact sum
  times ``(1 − u)^λ(n)`` (:func:`sum_levels`, ``⌈log2 n⌉``), whatever XLA does.

  Args:
    x: ``(..., n)`` float array.
    scale: as :func:`tree_sum`'s.

  Returns:
    ``(...)`` array in ``x``'s dtype.
  """
  return tree_sum(x, square=True, scale=scale)


# ------------------------------------------------------------------------ the clip factor


def clip_margin(dtype, num_entries: int) -> float:
  """ρ = (2λ + 12)·u: :func:`clip_factor` clips at ``C(1 − ρ)``.

  ``u`` is the unit roundoff of ``accumulation_dtype(dtype)`` (2⁻²⁴ for float32 and the 16-bit
  floats, 2⁻⁵³ for float64) and ``λ = sum_levels(num_entries) = ⌈log2 P⌉``; e.g.
  ρ = 52u ≈ 3.1·10⁻⁶ in float32 for P = 10⁶ entries (the utility cost: terms at the bound are
  shorter by that fraction).
  """
  u = float(jnp.finfo(accumulation_dtype(dtype)).eps) / 2
  return (2 * sum_levels(max(int(num_entries), 1)) + 12) * u


def clip_factor(norms, clip_norm: float, clipping: str = "clip",
                stability: float = DEFAULT_STABILITY, *, exponents=None,
                num_entries: int = 1):
  """Per-example clip factors computed so that a clipped term can never exceed C.

  With ``N̂_i = norms_i · 2^exponents_i`` the computed norm of example i's materialised
  gradient ``g_i`` (float32, or float64 for float64 gradients), returns ``(factor, keep)``
  (``(B,)`` each, ``norms``' dtype and bool): the clipped term is ``g_i`` itself where
  ``keep_i``, else ``factor_i · (g_i · 2^−exponents_i)`` (``0`` where ``factor_i = 0``), with

  * ``keep_i`` only for ``"clip"`` and ``N̂_i ≤ C'``, where ``C' ≤ C(1 − ρ)`` (ρ =
    :func:`clip_margin`);
  * otherwise ``factor_i · 2^−exponents_i ≤ C'/N̂_i`` exactly ("clip": ``C'/N̂_i``;
    "normalize": ``C'/(N̂_i + γ)``), the quotient rounded DOWN (to nearest, then one ulp
    towards zero), and ``factor_i = 0`` where ``N̂_i`` is not finite (NaN or ±inf entries, or a
    norm beyond the float range: the example is dropped).

  Guarantee (``‖·‖`` exact, over the values as materialised). Suppose (i) every square,
  addition of non-negative numbers, square root and product on the way to ``N̂`` is rounded to
  nearest in a float with unit roundoff u, powers of two are applied exactly, and each squared
  entry passes through at most ``2λ`` additions, ``λ = sum_levels(num_entries)`` (the callers
  sum with :func:`sum_squares`, per block and then over blocks); then ``N̂ ≥ N(1 − η)``,
  ``η = (2λ + 8)u`` (with room for the square roots, products of two norms and results below
  the float range). Suppose (ii) each materialised entry obeys ``|y_j| ≤ f|g_j|(1 + u)²``
  (``f`` the factor applied, at most two roundings to nearest in this dtype; then a rounding
  TOWARDS ZERO into a narrower storage dtype, :func:`round_toward_zero`, which never adds).
  Then ``‖y‖ ≤ (1 + u)²·C'·N/N̂ ≤ C(1 − η − 4u)(1 + 3u)/(1 − η) ≤ C``; a kept term has norm
  ``N ≤ N̂/(1 − η) ≤ C``. Results below the accumulation float's normal range (2⁻¹²⁶ in
  float32) are rounded or flushed in absolute terms, so C must exceed ``√P·2⁻¹²⁰``
  (≈ 10⁻³³ for float32 and P = 10⁶ entries): any real clip norm.

  Args:
    norms: ``(B,)`` float32/float64: ``N̂`` (``exponents`` None) or its mantissa.
    clip_norm: C > 0.
    clipping, stability: as :func:`clip_per_example`.
    exponents: ``(B,)`` int32 or None (0).
    num_entries: P, the number of gradient entries of one example (static; sets ρ).

  Returns:
    ``(factor, keep)`` as above.
  """
  dtype = jnp.result_type(norms)
  norms = jnp.asarray(norms, dtype)
  e = jnp.zeros(norms.shape, jnp.int32) if exponents is None else jnp.asarray(exponents,
                                                                                jnp.int32)
  bound = float(clip_norm) * (1.0 - clip_margin(dtype, num_entries))
  low = np.asarray(bound, dtype)                       # C', rounded down to the dtype
  if float(low) > bound:
    low = np.nextafter(low, np.asarray(0, dtype))
  f1, f2 = pow2_factors(e, dtype)
  valid = jnp.isfinite(norms * f1 * f2)                # N̂ within the float range
  denominator = norms
  if clipping == "normalize":
    g1, g2 = pow2_factors(-e, dtype)
    denominator = norms + jnp.asarray(stability, dtype) * g1 * g2   # ≥ norms (monotone)
  factor = _next_toward_zero(jnp.asarray(low, dtype) / denominator)  # ≤ C'/denominator
  factor = jnp.where(valid & (denominator > 0), factor, jnp.zeros((), dtype))
  if clipping == "clip":
    keep = valid & (factor >= f1 * f2)                 # f·2^−e ≥ 1 ⇒ N̂ ≤ C'
  else:
    keep = jnp.zeros(norms.shape, bool)
  return factor, keep


def _next_toward_zero(x):
  """The float next to a finite or infinite ``x ≥ 0`` towards zero (0 stays 0; inf → max):
  the bit pattern minus one."""
  _, ints = _bits(x.dtype)
  down = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, ints) - 1, x.dtype)
  return jnp.where(x > 0, down, x)


def round_toward_zero(t, dtype):
  """``t`` converted to ``dtype`` rounding TOWARDS ZERO (``|result| ≤ |t|``), not to nearest.

  XLA converts to nearest; where that came out larger in magnitude the result steps one ulp
  towards zero (the bit pattern of a nonzero float minus one), which also maps an overflow to
  ±max. NaN stays NaN. The identity when ``dtype`` is ``t``'s.
  """
  dtype = jnp.dtype(dtype)
  if dtype == t.dtype:
    return t
  y = t.astype(dtype)
  if jnp.finfo(dtype).bits >= jnp.finfo(t.dtype).bits:
    return y
  _, ints = _bits(dtype)
  over = jnp.abs(y.astype(t.dtype)) > jnp.abs(t)
  down = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(y, ints) - 1, dtype)
  return jnp.where(over, down, y)


def _tree_norm_parts(tree):
  """``(m, e, P)``: one example's global norm ``m · 2^e`` in :func:`accumulation_dtype`, from
  exactly rescaled entries (``max ∈ [1/2, 1)``) summed by :func:`sum_squares` per leaf and
  over the leaves; non-finite if any entry is; P the number of entries."""
  leaves = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
  acc = accumulation_dtype(*(x.dtype for x in leaves))
  if not leaves:
    return jnp.zeros((), acc), jnp.zeros((), jnp.int32), 0
  flat = [x.astype(acc).reshape(-1) for x in leaves]
  amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), initial=0) for x in flat])
  ok = jnp.isfinite(amax) & (amax > 0)
  e = jnp.where(ok, exponent(jnp.where(ok, amax, 1)), 0)
  f1, f2 = pow2_factors(-e, acc)
  total = _balanced_sum([sum_squares(x, (f1, f2)) for x in flat])
  return jnp.sqrt(total), e, sum(x.size for x in flat)


def _tree_norm(tree) -> jax.Array:
  """Global ℓ2 norm of one example's pytree in :func:`accumulation_dtype`, without overflow
  of the squares; non-finite if any entry is or the norm is beyond the float range."""
  m, e, _ = _tree_norm_parts(tree)
  return ldexp(m, e)


def _clip_one(tree, clip_norm: float, clipping: str = "clip",
              stability: float = DEFAULT_STABILITY):
  """Clips one example's pytree (the module's edge-case table) with :func:`clip_factor`:
  ``round_toward_zero(factor · (g · 2^−e))`` per entry, computed in the accumulation dtype."""
  m, e, size = _tree_norm_parts(tree)
  factor, keep = clip_factor(m, clip_norm, clipping, stability, exponents=e, num_entries=size)
  f1, f2 = pow2_factors(-e, factor.dtype)

  def scale(x):
    x = jnp.asarray(x)
    t = factor * (x.astype(factor.dtype) * f1 * f2)
    y = jnp.where(factor > 0, round_toward_zero(t, x.dtype), jnp.zeros_like(x))
    return jnp.where(keep, x, y)

  return jax.tree_util.tree_map(scale, tree)


def batch_size(grads, name: str = "grads") -> int:
  """B, the leading axis every leaf of a per-example pytree shares.

  Raises:
    ValueError: no leaves; leaves without a shared leading axis (e.g. already averaged).
  """
  return _check_batched(grads, name)


def _check_batched(grads, name: str) -> int:
  leaves = jax.tree_util.tree_leaves(grads)
  if not leaves:
    raise ValueError(f"{name} must be a non-empty pytree of arrays.")
  sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
  if None in sizes or len(sizes) != 1:
    raise ValueError(f"all leaves of {name} must share a leading batch axis, got leading sizes "
                     f"{sorted(str(s) for s in sizes)}.")
  return sizes.pop()


def global_norms(grads) -> jax.Array:
  """``(B,)`` global ℓ2 norms of per-example gradients (all leaves of one example together).

  Args:
    grads: pytree whose leaves share a leading batch axis B.

  Returns:
    ``(B,)`` array in :func:`accumulation_dtype` of the leaves (float32 for 16-bit and float32
    leaves, float64 for float64), accumulated there from exactly rescaled entries (relative
    error ≤ (2λ + 8)u, :func:`clip_factor`); NaN/inf for examples with non-finite entries or a
    norm beyond that dtype's range. Private values: a diagnostic, not for release.

  Raises:
    ValueError: empty pytree or leaves without a shared leading axis.
  """
  _check_batched(grads, "grads")
  return jax.vmap(_tree_norm)(grads)


def clip_per_example(grads, clip_norm: float, *, clipping: str = "clip",
                     stability: float = DEFAULT_STABILITY):
  """Scales each example's gradient to global ℓ2 norm ≤ C: ``ḡ = g / max(1, ‖g‖/C')``.

  ``C' = C(1 − ρ)`` with ρ = :func:`clip_margin` (≈ 10⁻⁶ relative in float32, 10⁻¹⁴ in float64:
  covers the rounding of the norm and of ``factor · g``). Edge cases (module table): within
  the bound unchanged; a zero gradient stays zero; an example with any NaN/inf entry becomes
  zero. Hence ``‖ḡ_i‖ ≤ C`` for every input and every float dtype, evaluated exactly over the
  returned values (module docstring, "Floating point"; :func:`clip_factor` has the proof).

  Args:
    grads: pytree of per-example gradients, leaves with a leading batch axis B.
    clip_norm: C > 0 (finite).
    clipping: "clip" (above) or "normalize": ``ḡ = C·g/(‖g‖ + γ)`` (module docstring).
    stability: γ > 0 of "normalize", in gradient-norm units (default 0.01, Bu et al.).

  Returns:
    A pytree like ``grads`` (same shapes and dtypes): each entry ``factor · g`` computed in
    float32 (float64) and converted rounding towards zero; kept examples bit for bit.

  Raises:
    ValueError: C ≤ 0 or not finite; γ ≤ 0; an unknown ``clipping``; leaves without a shared
      leading axis.
  """
  clip_norm = v.check_positive(clip_norm, "clip_norm")
  clipping, stability = check_clipping(clipping, stability)
  _check_batched(grads, "grads")
  return jax.vmap(lambda g: _clip_one(g, clip_norm, clipping, stability))(grads)


def check_clipping(clipping: str, stability: float) -> tuple[str, float]:
  """Validates ``clipping`` ∈ :data:`CLIPPINGS` and γ > 0 (finite); returns them."""
  v.check_choice(clipping, "clipping", CLIPPINGS)
  return clipping, v.check_positive(stability, "stability")


PER_LAYER = ("uniform", "by_size")
# C_ℓ is computed in float64 (a few roundings to nearest, relative error < 1e-15) and then
# shrunk by this factor, so that Σ C_ℓ² ≤ C² holds exactly for a split C; a carried bound from
# given norms is grown by it, so that it is ≥ √(Σ C_g²) exactly.
_SPLIT_SLACK = 1e-12


class _Split(NamedTuple):
  """One clip norm C split over the leaves (``per_layer``), resolved when the gradient is seen."""
  per_layer: str
  clip_norm: float


def layer_clip_norms(clip_norm, per_layer: str | None = None):
  """``(clip, bound)``: validated clipping norms and the ℓ2 bound Δ of one clipped term.

  ``clip`` is a float C (global clipping), a pytree of floats (per-layer norms, a prefix of the
  gradient's structure) or a split of C (``per_layer``, resolved per leaf by :func:`clip_layers`).
  Δ is C, √(Σ_g C_g²) rounded up, or C for a split (whose C_ℓ are rounded down).
  """
  if per_layer is not None:
    v.check_choice(per_layer, "per_layer", PER_LAYER)
    if not isinstance(clip_norm, (int, float, np.floating, np.integer)):
      raise ValueError(f"per_layer={per_layer!r} splits one clip norm C over the leaves; give "
                       f"clip_norm as a float, not per-layer norms.")
    c = v.check_positive(clip_norm, "clip_norm")
    return _Split(per_layer, c), c
  if not (np.ndim(clip_norm) == 0 and np.isscalar(np.asarray(clip_norm).item())):
    leaves = jax.tree_util.tree_leaves(clip_norm)
    if not leaves:
      raise ValueError("clip_norm: per-layer norms need at least one group.")
    norms = [v.check_positive(c, "clip_norm (a group's)") for c in leaves]
    bound = float(np.sqrt(np.sum(np.square(np.asarray(norms, np.float64))))) * (1 + _SPLIT_SLACK)
    return jax.tree_util.tree_map(float, clip_norm), bound
  c = v.check_positive(clip_norm, "clip_norm")
  return c, c


def _split_norms(clip, leaves) -> np.ndarray:
  """A split C's per-leaf norms C_ℓ, rounded down so that Σ C_ℓ² ≤ C²."""
  split, c = clip
  sizes = np.asarray([max(np.size(x), 1) for x in leaves], np.float64)
  share = (np.full(len(leaves), 1.0 / len(leaves)) if split == "uniform"
           else sizes / sizes.sum())
  return c * np.sqrt(share) * (1 - _SPLIT_SLACK)


def leaf_groups(params, clip) -> tuple[list[int], list[float]]:
  """``(group of each leaf, norm C_g of each group)`` for ``clip`` from :func:`layer_clip_norms`
  on a pytree shaped like ``params`` (leaves in ``tree_flatten`` order): one group for a float
  C, one per leaf for a split C, one per subtree of a prefix tree of norms — the groups
  :func:`clip_layers` clips, for clipping that works group by group (ghost clipping)."""
  leaves = jax.tree_util.tree_leaves(params)
  if isinstance(clip, float):
    return [0] * len(leaves), [clip]
  if isinstance(clip, _Split):
    return list(range(len(leaves))), [float(n) for n in _split_norms(clip, leaves)]
  norms = []

  def tag(c, sub):
    norms.append(float(c))
    return jax.tree_util.tree_map(lambda _: len(norms) - 1, sub)
  try:
    groups = jax.tree_util.tree_leaves(jax.tree_util.tree_map(tag, clip, params))
  except ValueError as e:
    raise ValueError(f"clip_norm's per-layer norms must be a prefix of the gradient's pytree "
                     f"structure: {e}") from None
  return groups, norms


def clip_layers(tree, clip, clipping: str = "clip", stability: float = DEFAULT_STABILITY):
  """One example's pytree clipped by ``clip`` from :func:`layer_clip_norms`: globally (a float),
  per group (a prefix tree of norms: each subtree by :func:`_clip_one` at its own norm), or per
  leaf at a split C (C_ℓ rounded down so that Σ C_ℓ² ≤ C²)."""
  if isinstance(clip, float):
    return _clip_one(tree, clip, clipping, stability)
  if isinstance(clip, _Split):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    norms = _split_norms(clip, leaves)
    return jax.tree_util.tree_unflatten(
        treedef, [_clip_one(x, float(n), clipping, stability) for x, n in zip(leaves, norms)])
  try:
    return jax.tree_util.tree_map(lambda c, sub: _clip_one(sub, c, clipping, stability),
                                  clip, tree)
  except ValueError as e:
    raise ValueError(f"clip_norm's per-layer norms must be a prefix of the gradient's pytree "
                     f"structure: {e}") from None


@dataclasses.dataclass(frozen=True)
class ClippedGradSum:
  """A clipped-gradient sum that carries its ℓ2 bound (a sensitivity-bearing callable).

  Field names follow ``jax_privacy.clipping.BoundedSensitivityCallable`` so either library's
  object can drive the other's noise: ``fun(params, batch, mask)`` is the sum,
  ``l2_norm_bound`` = C bounds every term.
  """
  fun: Callable
  l2_norm_bound: float
  has_aux: bool = False

  def __call__(self, *args, **kwargs):
    return self.fun(*args, **kwargs)

  def sensitivity(self, neighboring: NeighboringRelation = (
      NeighboringRelation.ADD_OR_REMOVE_ONE)) -> float:
    """ℓ2-sensitivity of the sum: C under add/remove-one, 2C under replace-one."""
    if neighboring == NeighboringRelation.ADD_OR_REMOVE_ONE:
      return self.l2_norm_bound
    if neighboring == NeighboringRelation.REPLACE_ONE:
      return 2.0 * self.l2_norm_bound
    raise ValueError(f"unsupported neighboring relation {neighboring!r}.")


def clipped_grad_sum(loss_fn: Callable, *, clip_norm, per_layer: str | None = None,
                     pre_clipping_transform: Callable | None = None, clipping: str = "clip",
                     stability: float = DEFAULT_STABILITY) -> ClippedGradSum:
  """``fn(params, batch, mask)`` = ``Σ_i mask_i · clip_C(T(∇ loss_fn(params, example_i)))``.

  >>> import jax.numpy as jnp, dpjax
  >>> loss = lambda w, ex: (ex[0] @ w - ex[1]) ** 2           # one example's loss
  >>> grad_fn = dpjax.sgd.clipped_grad_sum(loss, clip_norm=1.0)
  >>> X, y = jnp.array([[3.0, 0.0], [0.0, 0.1]]), jnp.array([0.0, 1.0])
  >>> s = grad_fn(jnp.array([1.0, 1.0]), (X, y), jnp.array([True, True]))
  >>> [round(float(v), 4) for v in s], grad_fn.l2_norm_bound   # each term clipped to norm ≤ 1
  ([1.0, -0.18], 1.0)

  The sum of clipped per-example gradients, fused in one jittable function: ``vmap`` of
  grad → optional transform T → clip, then the masked sum. Per-example values and the realised
  batch size are never returned (both are private).

  Privacy: every term has ℓ2 norm ≤ C whatever the example (module edge-case table), in every
  float dtype, exactly over the term as materialised (module docstring, "Floating point"), so
  the sum has ℓ2-sensitivity C under add/remove-one (one example adds or removes one term), which
  the noise of :func:`dpjax.sgd.dp_noise` (built from it) is calibrated to. Divide by a public
  expected batch size after adding noise, never by ``sum(mask)``. Per-layer clipping (McMahan
  et al. 2018; Opacus' ``clipping="per_layer"``) clips each group of leaves at its own C_g by the
  same float-safe map, so a term has norm ≤ Δ = √(Σ_g C_g²), the bound the function carries; a
  non-finite entry zeroes its group only (docs/algorithms.md §6.1).

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar`` for one example.
    clip_norm: C > 0 (a float), or per-layer norms: a pytree of floats > 0 that is a PREFIX of
      the (transformed) gradient's structure (``{"dense1": 1.0, "dense2": 0.5}`` clips each
      layer's kernel and bias together; a full tree clips every leaf alone).
    per_layer: None (one global norm, or the norms ``clip_norm`` gives), ``"uniform"``
      (C_ℓ = C/√K for K leaves) or ``"by_size"`` (C_ℓ = C·√(P_ℓ/P), P_ℓ the leaf's entries;
      optax's ``per_example_layer_norm_clip(uniform=False)``): split a float C so that Δ = C.
    pre_clipping_transform: optional map of ONE example's gradient pytree to another pytree
      (e.g. a projection ``g ↦ Vᵀ ravel(g)``: "clip after projecting"), applied before
      clipping. It must not look at other examples (it is vmapped).
    clipping: "clip" (``g / max(1, ‖g‖/C)``) or "normalize" (``C·g/(‖g‖ + γ)``, automatic
      clipping; module docstring). Both bound every term by C.
    stability: γ > 0 of "normalize" (default 0.01).

  Returns:
    A :class:`ClippedGradSum` ``fn(params, batch, mask)`` carrying ``fn.l2_norm_bound = C``
    (per-layer: Δ), which :func:`dpjax.sgd.dp_sgd_plan` reads: ``batch`` a pytree with leading
    axis B, ``mask`` ``(B,)`` with 1 (True) for real, sampled examples and 0 (False) for padding;
    returns a pytree like ``params`` (or like the transform's output), in the gradients' dtypes.

  Raises:
    ValueError: C ≤ 0 or not finite (any group's); γ ≤ 0; an unknown ``clipping`` or
      ``per_layer``; ``per_layer`` with per-layer norms; norms that are not a prefix of the
      gradient's structure (at the first call).
    TypeError: ``loss_fn`` or ``pre_clipping_transform`` not callable.

  References:
    Abadi et al., CCS 2016 (DP-SGD); the fused design follows ``jax_privacy.clipped_grad`` (sum
    of clipped gradients, normalised by a public size); Bu et al., "Automatic Clipping", NeurIPS
    2023 (``clipping="normalize"``); McMahan et al., ICLR 2018 (per-layer clipping).
  """
  clip, bound = layer_clip_norms(clip_norm, per_layer)
  clipping, stability = check_clipping(clipping, stability)
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  if pre_clipping_transform is not None and not callable(pre_clipping_transform):
    raise TypeError("pre_clipping_transform must be callable or None, got "
                    f"{type(pre_clipping_transform).__name__}.")
  grad_fn = jax.grad(loss_fn)

  def one(params, example):
    g = grad_fn(params, example)
    if pre_clipping_transform is not None:
      g = pre_clipping_transform(g)
    return clip_layers(g, clip, clipping, stability)

  def fn(params, batch, mask):
    grads = jax.vmap(one, in_axes=(None, 0))(params, batch)
    return jax.tree_util.tree_map(
        lambda g: jnp.tensordot(jnp.asarray(mask).astype(g.dtype), g, axes=1,
                                precision=linalg.HIGHEST), grads)

  return ClippedGradSum(fn, bound)
