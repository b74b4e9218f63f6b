"""Low-rank denoising of privatised gradients, an optax post-processing (docs/algorithms.md §6.3).

DP-SGD's noise on the averaged gradient is isotropic, ``N(0, s² I)`` with ``s = σC/L``; a dense
layer's gradient matrix is close to low rank. Shrinking each noisy layer matrix's singular values
by the optimal rule for a known noise level keeps the directions that stand above the noise and
drops the rest. It reads only the released (noisy) updates and public constants, so it costs no
privacy.

References:
  Gavish & Donoho, "Optimal Shrinkage of Singular Values", IEEE Trans. Inf. Theory 63(4), 2017
  (the Frobenius-loss shrinker, known noise level); Dadsetan & Rudzicz, arXiv 2510.01137, 2025
  (random-matrix denoising of DP gradients); Zhang, Bu, Hong & Razaviyayn, "DOPPLER", NeurIPS 2024
  (a low-pass filter on the privatised gradients).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpjax import _validation as v
from dpjax import linalg

__all__ = ["LowRankDenoiseState", "low_rank_denoise"]


class LowRankDenoiseState(NamedTuple):
  """State of :func:`low_rank_denoise`: the filter's buffer (params-shaped) and step count."""
  count: jax.Array
  average: optax.Updates


def filtered_noise_std(noise_std, decay, count):
  """Per-entry noise std of the bias-corrected EMA after ``count ≥ 1`` updates.

  ``m_t = β m_{t−1} + (1 − β) g_t`` with ``m_0 = 0``, output ``m_t / (1 − β^t)``; with independent
  ``N(0, s²)`` noise in each ``g_t``, its std is
  ``s (1 − β) √((1 − β^{2t}) / (1 − β²)) / (1 − β^t)`` (``s`` at t = 1, falling to
  ``s √((1 − β)/(1 + β))``). Traceable in ``count``.
  """
  if decay == 0:
    return jnp.asarray(noise_std, jnp.float32)
  count = jnp.asarray(count, jnp.float32)
  b = jnp.float32(decay)
  return (noise_std * (1 - b) * jnp.sqrt((1 - b ** (2 * count)) / (1 - b * b))
          / (1 - b ** count))


def shrink_singular_values(G: jax.Array, noise_std, threshold_scale=1.0) -> jax.Array:
  """Frobenius-optimal singular-value shrinkage of ``G = X + noise`` (Gavish & Donoho 2017).

  ``G`` is ``(..., m, n)`` (a batch of matrices); the noise has i.i.d. entries of std
  ``s = threshold_scale · noise_std``. With ``a = min(m, n)``, ``b = max(m, n)``, ``β = a/b`` and
  ``y = σ_i / (s√b)``, each singular value becomes ``s√b · √((y² − β − 1)² − 4β) / y`` when
  ``y > 1 + √β`` (above the noise's bulk edge ``s(√a + √b)``) and 0 otherwise. ``s = 0`` returns
  ``G``. Traceable; computed in at least float32.
  """
  dtype = jnp.promote_types(G.dtype, jnp.float32)
  m, n = G.shape[-2:]
  a, b = min(m, n), max(m, n)
  beta = a / b
  U, sv, Vt = jnp.linalg.svd(G.astype(dtype), full_matrices=False)
  scale = jnp.asarray(threshold_scale * noise_std, dtype) * math.sqrt(b)
  y = sv / jnp.where(scale > 0, scale, 1)
  keep = (y > 1 + math.sqrt(beta)) & (scale > 0)
  safe_y = jnp.where(keep, y, 2 + math.sqrt(beta))
  shrunk = jnp.where(keep, scale * jnp.sqrt((safe_y**2 - beta - 1) ** 2 - 4 * beta) / safe_y, 0)
  shrunk = jnp.where(scale > 0, shrunk, sv)
  return linalg.matmul(U * shrunk[..., None, :], Vt).astype(G.dtype)


def low_rank_denoise(noise_std: float, *, decay: float = 0.0, threshold_scale: float = 1.0,
                     min_dim: int = 2) -> optax.GradientTransformation:
  """Filter, then shrink each layer matrix's singular values: post-processing of DP-SGD.

  Place it after the full-dimensional noise (:func:`dpjax.sgd.dp_noise` without a basis, whose
  output has i.i.d. ``N(0, s²)`` noise per entry with ``s = σΔ/L``, Δ the clipped-gradient
  function's ℓ2 bound) and before the optimiser::

      plan = dp_sgd_plan(grad_fn, ...)
      s = plan.noise_multiplier * grad_fn.l2_norm_bound / plan.batch_selection.expected_batch_size
      tx = optax.chain(plan.noise, low_rank_denoise(s, decay=0.5), optax.adam(lr))

  Each update: ``m_t = β m_{t−1} + (1 − β) g_t`` (bias-corrected; ``β = decay``, 0: no filter),
  then every leaf with at least two axes whose last axis and the product of the others are both
  ``≥ min_dim`` is reshaped to that matrix and its singular values are shrunk by
  :func:`shrink_singular_values` at the filtered noise level (:func:`filtered_noise_std`).
  Other leaves (biases, scalars) pass through filtered only.

  Privacy: a function of the released noisy updates and public constants only (s, β, the
  shapes), so it is post-processing and changes nothing in the accounting. ``noise_std`` must be
  the public per-entry std of the updates it receives; with a basis in the noise
  (:func:`dpjax.sgd.dp_noise`'s flat or per-layer releases) the noise is not i.i.d. and the rule
  does not apply.

  Args:
    noise_std: ``s ≥ 0``, the per-entry noise std of the incoming updates (``σΔ/L``).
    decay: ``β ∈ [0, 1)``, the EMA filter's decay (a low-pass filter; 0 turns it off).
    threshold_scale: ``> 0``, multiplies the noise level in the shrinker (1: the optimal rule;
      larger keeps fewer directions).
    min_dim: leaves whose matrix has a side below this pass through unshrunk (≥ 1).

  Returns:
    An ``optax.GradientTransformation`` whose updates have the structure and dtypes of its
    inputs; its state is :class:`LowRankDenoiseState`.

  Raises:
    ValueError: ``noise_std < 0``, ``decay ∉ [0, 1)``, ``threshold_scale ≤ 0``, ``min_dim < 1``
      (or a non-finite value).

  References:
    Gavish & Donoho, IEEE Trans. Inf. Theory 2017; Dadsetan & Rudzicz, arXiv 2510.01137, 2025;
    Zhang et al., "DOPPLER", NeurIPS 2024.
  """
  noise_std = v.check_positive(noise_std, "noise_std", allow_zero=True)
  decay = v.check_probability(decay, "decay", open_low=False, open_high=True)
  threshold_scale = v.check_positive(threshold_scale, "threshold_scale")
  min_dim = v.check_int(min_dim, "min_dim", low=1)

  def init_fn(params):
    return LowRankDenoiseState(jnp.zeros((), jnp.int32),
                               jax.tree_util.tree_map(jnp.zeros_like, params))

  def shrink(g, std):
    if g.ndim < 2 or g.shape[-1] < min_dim or math.prod(g.shape[:-1]) < min_dim:
      return g
    matrix = g.reshape(-1, g.shape[-1])
    return shrink_singular_values(matrix, std, threshold_scale).reshape(g.shape)

  def update_fn(updates, state, params=None):
    del params
    count = state.count + 1
    average = jax.tree_util.tree_map(
        lambda m, g: (decay * m + (1 - decay) * g).astype(g.dtype), state.average, updates)
    correction = 1 - decay ** count.astype(jnp.float32)
    filtered = jax.tree_util.tree_map(lambda m: (m / correction).astype(m.dtype), average)
    std = filtered_noise_std(noise_std, decay, count)
    out = jax.tree_util.tree_map(lambda g: shrink(g, std), filtered)
    return out, LowRankDenoiseState(count, average)

  return optax.GradientTransformation(init_fn, update_fn)
