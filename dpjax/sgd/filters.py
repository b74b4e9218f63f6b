"""Filters of the released updates (DOPPLER's low-pass filter, DiSK's simplified Kalman filter;
docs/algorithms.md §6.8): post-processing.

DP noise is white across steps, while the gradient signal changes slowly: an IIR low-pass filter
of the noisy updates keeps the signal and averages the noise down (Zhang, Bu, Hong & Razaviyayn,
"DOPPLER: Differentially private optimizers with low-pass filter for privacy noise reduction",
NeurIPS 2024). :func:`low_pass` is an optax transform placed AFTER the plan's noise, so it reads
released updates only and costs no privacy::

    tx = plan.transform(optax.chain(dpjax.sgd.low_pass(), optax.sgd(0.5)))

It is not a second privacy mechanism and changes no event: the plan's ``dp_event`` is the same
with or without it. :func:`kalman_filter` (DiSK) wraps the optimiser instead::

    tx = plan.transform(dpjax.sgd.kalman_filter(optax.adam(1e-3), kappa=0.7))
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["KalmanFilterState", "LowPassState", "kalman_filter", "kalman_filter_iterate",
           "low_pass"]


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


class KalmanFilterState(NamedTuple):
  """:func:`kalman_filter`'s state: the gradient estimate ``g̃_{t−1}``, the inner optimiser's
  last update ``u_{t−1}`` (pytrees like the params), the inner optimiser's state, whether a
  step has happened (float32 0 or 1), and the extrapolation ``c = (1 − κ)/κ`` (float32)."""
  estimate: Any
  previous: Any
  inner: Any
  started: jax.Array
  extrapolation: jax.Array


def kalman_filter(optimizer: optax.GradientTransformation, kappa: float = 0.7
                  ) -> optax.GradientTransformation:
  """DiSK's simplified Kalman filter of the released gradients, wrapping an optimiser.

  Usage::

      tx = plan.transform(dpjax.sgd.kalman_filter(optax.adam(1e-3), kappa=0.7))
      # train as with any optimiser; the params it updates are the extrapolated points y_t
      x = dpjax.sgd.kalman_filter_iterate(params, opt_state)     # the model x_T

  The Kalman update of the gradient estimate with gain κ, ``g̃_t = (1 − κ)(g̃_{t−1} + H_t d_t)
  + κ ĝ(x_t)`` with ``d_t = x_t − x_{t−1}``, is ``(1 − κ) g̃_{t−1} + κ ĝ(x_t + c·d_t)`` to first
  order, ``c = (1 − κ)/κ``: one private gradient per step, at the extrapolated point
  ``y_t = x_t + c·d_t`` (DiSK's finite-difference form with γ = 1). This transform runs that
  scheme on ``y``: it receives the released ``ĝ(y_t)``, forms ``g̃_t`` (``g̃_0 = ĝ_0``), takes the
  inner update ``u_t = optimizer(g̃_t)`` at ``x_t = y_t − c·u_{t−1}``, and returns
  ``y_{t+1} − y_t = (1 + c)u_t − c·u_{t−1}``. The model is ``x_T = y_T − c·u_{T−1}``
  (:func:`kalman_filter_iterate`). Memory: two more copies of the params.

  Privacy: post-processing. The plan releases the clipped, noised gradient sum at whatever
  params the user passes; ``y_t`` is a function of earlier releases, so every step is the
  plan's step and the plan's event is unchanged.

  Args:
    optimizer: the inner optax optimiser (it sees the filtered gradients and the params x_t).
    kappa: the Kalman gain κ ∈ (0, 1] (1: no filter, y = x: the inner optimiser alone).

  Returns:
    An ``optax.GradientTransformation`` with state :class:`KalmanFilterState`.

  Raises:
    ValueError: κ outside (0, 1].
    TypeError: ``optimizer`` not an optax transformation.

  References:
    Zhang, Bu, Balle, Hong, Razaviyayn & Mirrokni, "DiSK: Differentially Private Optimizer with
    Simplified Kalman Filter for Noise Reduction", ICLR 2025 (arXiv 2410.03883);
    docs/algorithms.md §6.8 for the derivation.
  """
  if not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError(f"optimizer must be an optax.GradientTransformation, got "
                    f"{type(optimizer).__name__}.")
  kappa = float(kappa)
  if not 0.0 < kappa <= 1.0:
    raise ValueError(f"kappa (the Kalman gain) must be in (0, 1], got {kappa}.")
  c = (1.0 - kappa) / kappa

  def init_fn(params):
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return KalmanFilterState(zeros, zeros, optimizer.init(params), jnp.zeros((), jnp.float32),
                             jnp.asarray(c, jnp.float32))

  def update_fn(updates, state, params=None):
    fresh = state.started > 0
    estimate = jax.tree_util.tree_map(
        lambda e, g: jnp.where(fresh, (1 - kappa) * e + kappa * g, g).astype(g.dtype),
        state.estimate, updates)
    x = None if params is None else jax.tree_util.tree_map(
        lambda y, u: (y - c * u).astype(y.dtype), params, state.previous)
    step, inner = optimizer.update(estimate, state.inner, x)
    out = jax.tree_util.tree_map(lambda u, w: ((1 + c) * u - c * w).astype(u.dtype), step,
                                 state.previous)
    return out, state._replace(estimate=estimate, previous=step, inner=inner,
                               started=jnp.ones((), jnp.float32))

  return optax.GradientTransformation(init_fn, update_fn)


def kalman_filter_iterate(params, opt_state):
  """The model ``x_t = y_t − c·u_{t−1}`` from the extrapolated params ``y_t`` that
  :func:`kalman_filter` trains and its state inside ``opt_state`` (e.g. a plan's transform's
  chain). Post-processing, traceable.

  Raises:
    ValueError: ``opt_state`` holds no :class:`KalmanFilterState`, or more than one.
  """
  found = [x for x in jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, KalmanFilterState))
      if isinstance(x, KalmanFilterState)]
  if len(found) != 1:
    raise ValueError(f"opt_state must hold exactly one Kalman filter state, found {len(found)}.")
  state = found[0]
  return jax.tree_util.tree_map(lambda y, u: (y - state.extrapolation * u).astype(y.dtype),
                                params, state.previous)
