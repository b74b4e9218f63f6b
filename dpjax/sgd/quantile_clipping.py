"""Adaptive clipping: a clip norm that tracks a quantile of the per-example gradient norms
(Andrew, Thakkar, McMahan & Ramaswamy, "Differentially Private Learning with Adaptive
Clipping", NeurIPS 2021; docs/algorithms.md §6.1).

Each step t clips at a public C_t and also releases how many examples were clipped: with
``b_i = 1[‖g_i‖ ≤ C_t]``, the noised fraction ``b̄_t`` moves the norm geometrically towards the
target quantile γ, ``C_{t+1} = C_t · exp(−η (b̄_t − γ))``. dpjax releases the count INSIDE the
clipped sum, as one more coordinate, so the plan's one Gaussian release (and its one event)
covers both:

* every example contributes ``(clip₁(g_i / C_t), v·(2 b_i − 1))`` — its gradient scaled by
  ``1/C_t`` and clipped at 1 (the float-safe clip of :mod:`dpjax.sgd.per_example`), and ``±v``
  with ``v = r/2`` (``count_weight`` r) — whose ℓ2 norm is at most ``Δ = √(1 + v²)``, the bound
  the sum carries, so the plan's noise ``N(0, σ²Δ²)`` on every coordinate makes the step the
  sampled Gaussian mechanism at noise multiplier σ, whatever C_t is (C_t is a function of
  earlier releases: public);
* this is Andrew et al.'s mechanism: the gradient noise is σΔ (in units of C_t) and the count's
  ``σΔ/r`` (in examples); their effective noise multiplier ``(σ_g⁻² + (2σ_b)⁻²)^(−1/2)`` is σ.
  They suggest a count noise of about L/20: ``r ≈ 20σ/L``;
* after the noise (post-processing, :func:`quantile_clip_update`): ``b̄ = c/(2v) + ½`` from the
  released ``c = (Σ v(2b_i − 1) + noise)/L``, the gradient part times C_t goes to the optimiser,
  and C_{t+1} is stored for the next step.

``dpjax.sgd.dp_sgd_plan`` recognises the gradient sum: it passes the state's C_t to it and
chains :func:`quantile_clip_update` after its noise. Full release only (no bases, no GEP), and
the ``vmap(grad)`` path (ghost clipping clips one fixed norm).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax import _validation as v
from dpjax.sgd import ghost, per_example

__all__ = ["QuantileClipState", "QuantileClippedGradSum", "ghost_quantile_clipped_grad_sum",
           "quantile_clip_state", "quantile_clip_update", "quantile_clipped_grad_sum"]


@dataclasses.dataclass(frozen=True)
class QuantileClippedGradSum:
  """A clipped-gradient sum with an adaptive clip norm (a sensitivity-bearing callable).

  ``fun(params, batch, mask, clip_norm)`` returns ``{"grads": Σ_i mask_i clip₁(g_i/C),
  "count": Σ_i mask_i v(2·1[‖g_i‖ ≤ C] − 1)}``; ``l2_norm_bound`` = √(1 + v²) bounds every
  example's contribution to the pair (module docstring).
  """
  fun: Callable
  l2_norm_bound: float
  count_value: float
  initial_clip_norm: float
  target_quantile: float
  clip_learning_rate: float
  has_aux: bool = False

  def __call__(self, *args, **kwargs):
    return self.fun(*args, **kwargs)


class QuantileClipState(NamedTuple):
  """The adaptive clip norm C_t (float32 scalar) the next step clips at."""
  clip_norm: jax.Array


def quantile_clipped_grad_sum(loss_fn: Callable, *, initial_clip_norm: float,
                              target_quantile: float = 0.5, clip_learning_rate: float = 0.2,
                              count_weight: float = 0.05, clipping: str = "clip",
                              stability: float = per_example.DEFAULT_STABILITY
                              ) -> QuantileClippedGradSum:
  """Adaptive (quantile) clipping for DP-SGD on the plan (Andrew et al. 2021, Algorithm 1 with
  the geometric update).

  Usage::

      grad_fn = dpjax.sgd.quantile_clipped_grad_sum(loss, initial_clip_norm=1.0,
                                                    target_quantile=0.5)
      plan = dpjax.sgd.dp_sgd_plan(grad_fn, num_examples=N, expected_batch_size=L, steps=T,
                                   epsilon=2.0, delta=1e-5, key=key)
      # plan.clipped_sum / plan.transform / plan.run as for any grad fn: the plan passes the
      # current C_t and updates it after the noise (quantile_clip_state(opt_state).clip_norm).

  Privacy: (plan.epsilon, plan.delta)-DP under add/remove-one, the count included: every
  example moves the pair (gradient sum, count) by at most Δ = √(1 + v²) in ℓ2 (module
  docstring; proof in docs/algorithms.md §6.1), and Δ is the bound the plan's noise reads.

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar`` for one example.
    initial_clip_norm: C_0 > 0 (public).
    target_quantile: γ ∈ (0, 1), the fraction of examples to leave unclipped (0.5: the median).
    clip_learning_rate: η > 0 of the geometric update (Andrew et al. use 0.2).
    count_weight: r > 0: the count's noise std is σΔ/r examples (σ the plan's noise
      multiplier); r ≈ 20σ/L gives Andrew et al.'s L/20. Δ = √(1 + r²/4).
    clipping, stability: the clip of the scaled gradients, as :func:`dpjax.sgd.clipped_grad_sum`.

  Returns:
    A :class:`QuantileClippedGradSum`.

  Raises:
    ValueError: a bound out of range.
    TypeError: ``loss_fn`` not callable.
  """
  settings = _settings(initial_clip_norm, target_quantile, clip_learning_rate, count_weight)
  clipping, stability = per_example.check_clipping(clipping, stability)
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  value = settings[1]
  grad = jax.grad(loss_fn)

  def one(params, example, clip_norm):
    g = grad(params, example)
    scaled = jax.tree_util.tree_map(lambda x: x / clip_norm.astype(x.dtype), g)
    norm_sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                  for x in jax.tree_util.tree_leaves(scaled))
    below = norm_sq <= 1.0                             # NaN/inf: False (counted as clipped)
    clipped = per_example.clip_layers(scaled, 1.0, clipping, stability)
    return clipped, jnp.where(below, value, -value)

  def fn(params, batch, mask, clip_norm):
    clip_norm = jnp.asarray(clip_norm, jnp.float32)
    grads, counts = jax.vmap(one, in_axes=(None, 0, None))(params, batch, clip_norm)
    m = jnp.asarray(mask)
    total = jax.tree_util.tree_map(
        lambda g: jnp.tensordot(m.astype(g.dtype), g, axes=1, precision="highest"), grads)
    return {"grads": total, "count": jnp.sum(jnp.where(m, counts, 0.0))}

  return QuantileClippedGradSum(fn, *settings)


def _settings(initial_clip_norm, target_quantile, clip_learning_rate, count_weight):
  """``(Δ, v, C_0, γ, η)`` validated: ±v exactly representable (r/2 rounded toward zero to
  float32), Δ = √(1 + v²) from that v, rounded up."""
  c0 = v.check_positive(initial_clip_norm, "initial_clip_norm")
  gamma = v.check_probability(target_quantile, "target_quantile", open_high=True)
  eta = v.check_positive(clip_learning_rate, "clip_learning_rate")
  r = v.check_positive(count_weight, "count_weight")
  value = np.float32(r / 2)
  if float(value) > r / 2:
    value = np.nextafter(value, np.float32(0))
  bound = math.sqrt(1.0 + float(value) ** 2) * (1 + 1e-12)
  return bound, float(value), c0, gamma, eta


def ghost_quantile_clipped_grad_sum(apply_fn: Callable, example_loss: Callable, *,
                                    initial_clip_norm: float, target_quantile: float = 0.5,
                                    clip_learning_rate: float = 0.2, count_weight: float = 0.05,
                                    clipping: str = "clip",
                                    stability: float = per_example.DEFAULT_STABILITY
                                    ) -> QuantileClippedGradSum:
  """Adaptive (quantile) clipping by ghost clipping: :func:`quantile_clipped_grad_sum` for a
  model given as :func:`dpjax.sgd.ghost_clipped_grad_sum` takes it.

  Usage::

      grad_fn = dpjax.sgd.ghost_quantile_clipped_grad_sum(
          apply_fn, example_loss, initial_clip_norm=1.0, target_quantile=0.5)
      plan = dpjax.sgd.dp_sgd_plan(grad_fn, num_examples=N, expected_batch_size=L, steps=T,
                                   epsilon=2.0, delta=1e-5, key=key)

  ``fn(params, (inputs, targets), mask, C_t)`` returns ``{"grads": Σ_i mask_i clip₁(g_i/C_t),
  "count": Σ_i mask_i v(2·1[‖g_i/C_t‖ ≤ 1] − 1)}``. The gradients of the loss divided by the
  public C_t are clipped at 1 by ghost norms (one forward and one backward pass), so every term
  obeys ghost clipping's proven bound ``‖term‖ ≤ 1`` whatever C_t (the bound is over the values
  as materialised, of whichever loss); the count's bit reads the same ghost norm.

  Privacy: (plan.epsilon, plan.delta)-DP under add/remove-one, as
  :func:`quantile_clipped_grad_sum` (Δ = √(1 + v²); docs/algorithms.md §6.1).

  Args:
    apply_fn, example_loss: the model and loss, as :func:`dpjax.sgd.ghost_clipped_grad_sum`.
    initial_clip_norm, target_quantile, clip_learning_rate, count_weight, clipping, stability:
      as :func:`quantile_clipped_grad_sum`.

  Returns:
    A :class:`QuantileClippedGradSum` (global clipping; no per-layer norms, no GEP).

  Raises:
    ValueError: a bound out of range.
    TypeError: ``apply_fn`` or ``example_loss`` not callable.
  """
  settings = _settings(initial_clip_norm, target_quantile, clip_learning_rate, count_weight)
  terms = ghost.scaled_clipped_sum(apply_fn, example_loss, clipping, stability)
  value = settings[1]

  def fn(params, batch, mask, clip_norm):
    grads, below = terms(params, batch, mask, jnp.asarray(clip_norm, jnp.float32))
    counts = jnp.where(below, value, -value)
    return {"grads": grads, "count": jnp.sum(jnp.where(jnp.asarray(mask), counts, 0.0))}

  return QuantileClippedGradSum(fn, *settings)


def quantile_clip_state(opt_state) -> QuantileClipState:
  """The :class:`QuantileClipState` inside an optimiser state (of a plan's transform).

  Raises:
    ValueError: none, or more than one.
  """
  found = [x for x in jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, QuantileClipState))
      if isinstance(x, QuantileClipState)]
  if len(found) != 1:
    raise ValueError(f"opt_state must hold exactly one adaptive clip state, found {len(found)}.")
  return found[0]


def quantile_clip_update(grad_fn: QuantileClippedGradSum) -> optax.GradientTransformation:
  """The post-processing after the plan's noise: ``{"grads", "count"}`` (noised, divided by L)
  → the gradient part times C_t, and the state's C_{t+1} = C_t·exp(−η(b̄ − γ)) with
  ``b̄ = count/(2v) + ½``, clipped to [C_0·10⁻⁶, C_0·10⁶] (a public guard against a runaway
  norm). Free in privacy: it reads only released values."""
  if not isinstance(grad_fn, QuantileClippedGradSum):
    raise TypeError("quantile_clip_update needs the QuantileClippedGradSum it follows.")
  low, high = grad_fn.initial_clip_norm * 1e-6, grad_fn.initial_clip_norm * 1e6

  def init_fn(params):
    del params
    return QuantileClipState(jnp.asarray(grad_fn.initial_clip_norm, jnp.float32))

  def update_fn(updates, state, params=None):
    del params
    c = state.clip_norm
    fraction = updates["count"] / (2 * grad_fn.count_value) + 0.5
    new = jnp.clip(c * jnp.exp(-grad_fn.clip_learning_rate
                               * (fraction - grad_fn.target_quantile)), low, high)
    out = jax.tree_util.tree_map(lambda g: g * c.astype(g.dtype), updates["grads"])
    return out, QuantileClipState(jnp.asarray(new, jnp.float32))

  return optax.GradientTransformation(init_fn, update_fn)
