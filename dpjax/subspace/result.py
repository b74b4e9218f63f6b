"""The typed result every private subspace learner returns."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


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
