"""The typed result of the Ashtiani–Liaw estimators (PPME, covariance, mean)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


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
