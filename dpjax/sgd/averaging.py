"""An exponential moving average of the iterates, as an optax piece (post-processing).

DP-SGD's iterates are released (each is a function of the noisy updates), so averaging them costs
no privacy; the average is often a better model than the last iterate at the same ε (Polyak–
Ruppert; De et al. 2022 use an EMA of the weights). Chain it LAST, after the optimiser:
``optax.chain(plan.noise, optax.adam(lr), iterate_average(0.99))``; it passes the updates through
unchanged and keeps the average in its state (:func:`averaged_params`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpjax import _validation as v

__all__ = ["IterateAverageState", "averaged_params", "iterate_average"]


class IterateAverageState(NamedTuple):
  """``count`` (int32 steps seen) and ``average`` (a params-shaped pytree)."""
  count: jax.Array
  average: Any


def iterate_average(decay: float) -> optax.GradientTransformation:
  """``w̄_t = β_t w̄_{t−1} + (1 − β_t) w_t`` with ``β_t = min(β, (1 + t)/(10 + t))`` (a warm-up,
  as TensorFlow's ``ExponentialMovingAverage``), ``w_t = params + updates`` the new iterate,
  starting from the initial params. The updates pass through unchanged.

  Privacy: post-processing of the released iterates (no cost), provided the chain before it is
  the plan's (the iterates are then functions of the privatised updates).

  Args:
    decay: β ∈ (0, 1).

  Returns:
    An ``optax.GradientTransformation`` (state :class:`IterateAverageState`); its ``update``
    needs ``params``.

  Raises:
    ValueError: β ∉ (0, 1). At ``update``: ``params`` missing.
  """
  decay = v.check_probability(decay, "decay", open_low=True, open_high=True)

  def init_fn(params):
    return IterateAverageState(jnp.zeros((), jnp.int32), jax.tree_util.tree_map(jnp.asarray,
                                                                                params))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("iterate_average needs params in update (chain it after the optimiser).")
    t = state.count.astype(jnp.float32)
    beta = jnp.minimum(decay, (1.0 + t) / (10.0 + t))
    new = optax.apply_updates(params, updates)
    average = jax.tree_util.tree_map(
        lambda m, w: (beta * m + (1.0 - beta) * w).astype(m.dtype), state.average, new)
    return updates, IterateAverageState(state.count + 1, average)

  return optax.GradientTransformation(init_fn, update_fn)


def averaged_params(opt_state):
  """The average held by the :func:`iterate_average` state inside ``opt_state``.

  Raises:
    ValueError: none, or more than one.
  """
  is_state = lambda x: isinstance(x, IterateAverageState)  # noqa: E731
  found = [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_state) if is_state(x)]
  if len(found) != 1:
    raise ValueError(f"opt_state must hold exactly one iterate_average state, found "
                     f"{len(found)}.")
  return found[0].average
