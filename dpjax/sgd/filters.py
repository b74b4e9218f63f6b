"""Low-pass filters of the released updates (DOPPLER; docs/algorithms.md §6.8): post-processing.

DP noise is white across steps, while the gradient signal changes slowly: an IIR low-pass filter
of the noisy updates keeps the signal and averages the noise down (Zhang, Bu, Hong & Razaviyayn,
"DOPPLER: Differentially private optimizers with low-pass filter for privacy noise reduction",
NeurIPS 2024). :func:`low_pass` is an optax transform placed AFTER the plan's noise, so it reads
released updates only and costs no privacy::

    tx = plan.transform(optax.chain(dpjax.sgd.low_pass(), optax.sgd(0.5)))

It is not a second privacy mechanism and changes no event: the plan's ``dp_event`` is the same
with or without it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["LowPassState", "low_pass"]


class LowPassState(NamedTuple):
  """:func:`low_pass`'s state: the last ``n_a`` outputs ``m`` and ``n_b`` inputs ``g`` (newest
  first, each a pytree like the updates, stacked on a leading axis), and the bias-correction
  recursion's last ``n_a`` values ``c`` and last ``n_b`` inputs (1 for a step that happened, 0
  before the first)."""
  outputs: Any
  inputs: Any
  corrections: jax.Array
  presence: jax.Array


def low_pass(a=(-0.9,), b=(0.1,)) -> optax.GradientTransformation:
  """DOPPLER's low-pass filter of the updates, with its bias correction.

  ``m_t = −Σ_{τ=1}^{n_a} a_τ m_{t−τ} + Σ_{τ=0}^{n_b} b_τ g_{t−τ}``, ``c_t`` the same recursion
  fed 1 at every step (``m``, ``c`` zero before the first step), and the update is
  ``m_t / c_t``: a filter with DC gain 1 at every step (a constant input passes unchanged from
  the first step). The default ``a = (−0.9,)``, ``b = (0.1,)`` is the first-order filter
  ``m_t = 0.9 m_{t−1} + 0.1 g_t`` (``optax.ema(0.9, debias=True)``); higher orders are the
  paper's general form.

  Usage: after the plan's noise, before the optimiser (a chain inside ``plan.transform``).

  Args:
    a: ``(a_1, …, a_{n_a})``, the feedback coefficients (``n_a ≥ 0``).
    b: ``(b_0, …, b_{n_b})``, the feed-forward coefficients (at least one).

  Returns:
    An ``optax.GradientTransformation`` with state :class:`LowPassState`; updates keep their
    structure and dtypes.

  Raises:
    ValueError: no ``b``, non-finite coefficients, or a filter whose bias correction ``c_t``
      leaves (0, ∞) in its first 10,000 steps or whose DC gain ``Σ b / (1 + Σ a)`` is not
      finite and positive (the update divides by ``c_t``).

  References:
    Zhang, Bu, Hong & Razaviyayn, NeurIPS 2024 (arXiv 2408.13460), the filtered update and its
    bias correction.
  """
  a = tuple(float(x) for x in np.asarray(a, np.float64).reshape(-1))
  b = tuple(float(x) for x in np.asarray(b, np.float64).reshape(-1))
  if not b or not all(np.isfinite(a + b)):
    raise ValueError(f"b needs at least one coefficient and all must be finite; got a={a}, "
                     f"b={b}.")
  n_a, n_b = len(a), len(b) - 1
  if not 1.0 + sum(a) > 0 or not sum(b) > 0 or not _corrections_positive(a, b):
    raise ValueError(f"the filter's bias correction c_t (its response to a constant 1) must stay "
                     f"finite and positive, and its DC gain Σb/(1 + Σa) too; got a={a}, b={b}.")

  def history(params, n):
    return jax.tree_util.tree_map(lambda x: jnp.zeros((n,) + x.shape, x.dtype), params)

  def init_fn(params):
    return LowPassState(history(params, n_a), history(params, n_b),
                        jnp.zeros((n_a,), jnp.float32), jnp.zeros((n_b,), jnp.float32))

  def update_fn(updates, state, params=None):
    del params
    a_ = jnp.asarray(a, jnp.float32)
    b_ = jnp.asarray(b, jnp.float32)
    c = b_[0] + jnp.dot(b_[1:], state.presence) - jnp.dot(a_, state.corrections)

    def one(g, m_hist, g_hist):
      dtype = jnp.promote_types(g.dtype, jnp.float32)
      m = b_[0] * g.astype(dtype)
      if n_b:
        m = m + jnp.tensordot(b_[1:], g_hist.astype(dtype), axes=1)
      if n_a:
        m = m - jnp.tensordot(a_, m_hist.astype(dtype), axes=1)
      return m

    m = jax.tree_util.tree_map(one, updates, state.outputs, state.inputs)
    out = jax.tree_util.tree_map(lambda x, g: (x / c).astype(g.dtype), m, updates)
    new = LowPassState(jax.tree_util.tree_map(_push, state.outputs, m),
                       jax.tree_util.tree_map(_push, state.inputs, updates),
                       _push(state.corrections, c), _push(state.presence, 1.0))
    return out, new

  return optax.GradientTransformation(init_fn, update_fn)


def _corrections_positive(a, b, steps: int = 10_000) -> bool:
  """``c_t > 0`` and finite for the first ``steps`` steps (host, float64): the divisor of every
  update (after its transient a stable filter's ``c_t`` settles at its DC gain)."""
  c = np.zeros(len(a))
  for t in range(steps):
    value = sum(b[:t + 1]) - float(np.dot(a, c)) if a else sum(b[:t + 1])
    if not (np.isfinite(value) and value > 0):
      return False
    c = np.concatenate([[value], c[:-1]]) if a else c
  return True


def _push(hist, x):
  """``hist`` with ``x`` as its newest (first) entry and the oldest dropped."""
  if hist.shape[0] == 0:
    return hist
  return jnp.concatenate([jnp.asarray(x, hist.dtype)[None], hist[:-1]])
