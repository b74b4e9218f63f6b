"""The result types of dpjax's private learners (one module; see each type)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np


class SubspaceResult(NamedTuple):
  """Outcome of a private subspace learner (a pytree).

  Attributes:
    ok: bool scalar. ``False`` is the paper's ⊥ (NULL): the mechanism declined to answer. The
      decision is itself a DP release.
    basis: ``(d, k)`` orthonormal basis of the learned subspace when ``ok``; a fixed placeholder
      (all zeros) when not, so that ⊥ carries no information.
    epsilon: privacy loss spent (nats), whatever the outcome.
    delta: failure probability spent, whatever the outcome.
    neighbouring: the neighbouring relation under which ``(epsilon, delta)`` holds.
    info: public diagnostics (parameters t, m, q, ℓ, ...) and DP-released quantities only.
  """
  ok: jax.Array
  basis: jax.Array
  epsilon: float
  delta: float
  neighbouring: str
  info: dict[str, Any]

  @property
  def projection(self) -> jax.Array:
    """The ``(d, d)`` orthogonal projection ``V Vᵀ`` (zeros when ⊥)."""
    return self.basis @ self.basis.T


class PrivateEstimate(NamedTuple):
  """Outcome of a private estimator that may decline to answer (a pytree).

  Attributes:
    ok: bool scalar. ``False`` is the paper's ⊥: the private test failed. The decision is itself
      part of the DP release.
    estimate: the released estimate when ``ok`` (a mean ``(d,)`` or a covariance ``(d, d)``); a
      fixed placeholder (zeros) when not, so that ⊥ carries no information.
    epsilon: privacy loss spent (nats), whatever the outcome.
    delta: failure probability spent, whatever the outcome.
    neighbouring: the neighbouring relation under which ``(epsilon, delta)`` holds.
    info: public parameters (groups, radius, γ, η, ...) and DP-released quantities only.
  """
  ok: jax.Array
  estimate: jax.Array
  epsilon: float
  delta: float
  neighbouring: str
  info: dict[str, Any]


class CoinPressResult(NamedTuple):
  """Outcome of :func:`coinpress_mean` or :func:`coinpress_covariance` (a pytree).

  Attributes:
    estimate: float64 NumPy array, ``(d,)`` for the mean, ``(d, d)`` symmetric PSD for the
      covariance (NumPy, so that it keeps float64 whatever the global ``jax_enable_x64`` flag).
    epsilon: ε (nats) spent, as composed by the accountant (≤ the requested ε).
    delta: δ spent (the requested δ).
    neighbouring: ``"replace_one"``: datasets with the same public n that differ in one row.
    info: public quantities only — the step count, budget fractions, noise multipliers and
      standard deviations, clipping radii and the other public bounds, and (mean only) the
      released intermediate centres, which are DP releases accounted for in ``epsilon``.
  """
  estimate: np.ndarray
  epsilon: float
  delta: float
  neighbouring: str
  info: dict[str, Any]


class GaussianResult(NamedTuple):
  """Outcome of :func:`learn_gaussian`.

  Attributes:
    ok: False if any step returned ⊥.
    mean: ``(d,)`` float64 μ̃ (zeros on ⊥).
    covariance: ``(d, d)`` float64 Σ̃ (zeros on ⊥).
    failed_step: None, or the first step that returned ⊥ (one of :data:`STEPS`).
    epsilon, delta: the budget spent (the whole, whatever the outcome).
    neighbouring: ``"replace_one"``.
    info: batch sizes, each step's public parameters, the released rank.
  """
  ok: bool
  mean: np.ndarray
  covariance: np.ndarray
  failed_step: str | None
  epsilon: float
  delta: float
  neighbouring: str
  info: dict[str, Any]
