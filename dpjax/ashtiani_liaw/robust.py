"""Robust private estimators for corrupted Gaussian samples ([AL22] §6–7; docs/algorithms.md §3.7).

Model: an η_c-corrupted sample (an adversary sees the i.i.d. rows and replaces up to an η_c
fraction arbitrarily). PPME runs a robust non-private estimator on every group
(``filtering.py``); with a public random partition each group receives about an η_c fraction of
the corrupted rows, which the filter tolerates, and groups that receive many more behave as bad
candidates that PPME's weights ignore while they stay a minority (below ``1 − b`` of the groups).

Privacy is that of PPME, whatever the estimator: the estimator only has to be a deterministic
function of its group's rows. Both learners are therefore (ε, δ)-DP under replace-one, exactly
as :func:`~dpjax.ashtiani_liaw.ppme_mean` and
:func:`~dpjax.ashtiani_liaw.al_covariance`.
"""

from __future__ import annotations

import functools

import jax

from dpjax import _validation as v
from dpjax.ashtiani_liaw.covariance import al_covariance
from dpjax.robust_stats import filtered_covariance, filtered_mean
from dpjax.ashtiani_liaw.populous_mean import ppme_mean
from dpjax.results import EstimateResult
from dpjax.ledger import with_ledger

__all__ = ["robust_covariance", "robust_mean"]


@with_ledger
def robust_mean(key: jax.Array, X, *, epsilon: float, delta: float, corruption: float,
                num_groups: int, radius: float, **ppme_kwargs) -> EstimateResult:
  """Private robust mean of ``N(μ, I)`` from an η_c-corrupted sample ([AL22] Algorithm 5).

  Euclidean PPME with :func:`~dpjax.robust_stats.filtered_mean` on every group and the
  Gaussian masking mechanism ([AL22] Lemma 7.2; σ the analytic Gaussian σ for ℓ2-sensitivity
  ``γ = (4 + 2/(b − a))·2r/W_min``, 28r/W_min with the default thresholds).

  Privacy guarantee: (ε, δ)-DP under replace-one (as :func:`ppme_mean`).

  Args:
    key: PRNG key.
    X: ``(n, d)`` rows: an η_c-corrupted sample of N(μ, I) (whiten first for other known
      covariances; μ unbounded).
    epsilon, delta: the budget.
    corruption: η_c ∈ [0, 0.5), the fraction the per-group filter is tuned for (public).
    num_groups: k (public).
    radius: closeness radius r for group estimates (public): about twice the filtered estimate's
      error, ``2·(√(d/m) + C·η_c·√ln(1/η_c))`` for groups of m rows.
    **ppme_kwargs: :func:`ppme_mean`'s ``test_fraction``, ``thresholds``, ``radius_margin``.

  Returns:
    :class:`~dpjax.results.EstimateResult` with ``estimate (d,)`` (as :func:`ppme_mean`:
    traceable with JAX's x64 mode on, ``TypeError`` under a float32 trace);
    ``info["corruption"]`` is η_c.

  References:
    [AL22] Algorithm 5, Thm 7.4, Lemma 7.2; docs/algorithms.md §3.7.
  """
  corruption = v.check_corruption(corruption)
  estimator = _group_estimator(filtered_mean, corruption)
  res = ppme_mean(key, X, epsilon=epsilon, delta=delta, num_groups=num_groups, radius=radius,
                  estimator=estimator, **ppme_kwargs)
  return res.replace(info=res.info.replace(corruption=corruption))


@with_ledger
def robust_covariance(key: jax.Array, X, *, epsilon: float, delta: float, corruption: float,
                      **covariance_kwargs) -> EstimateResult:
  """Private robust covariance of ``N(0, Σ)`` from an η_c-corrupted sample ([AL22] Algorithm 4).

  :func:`~dpjax.ashtiani_liaw.al_covariance` with
  :func:`~dpjax.robust_stats.filtered_covariance` as the group estimator; Σ unbounded.
  The calibration is the non-robust one (its group-size rule simulates clean data: pass
  ``min_group_size`` large enough for the filter's error at η_c to stay well inside the radius).

  Privacy guarantee: (ε, δ)-DP under replace-one (as :func:`al_covariance`).

  Args:
    key: PRNG key.
    X: ``(n, d)`` rows, an η_c-corrupted sample of N(0, Σ).
    epsilon, delta: the budget.
    corruption: η_c ∈ [0, 0.5) (public).
    **covariance_kwargs: :func:`al_covariance` arguments (``radius``, ``num_groups``,
      ``min_group_size``, ...).

  Returns:
    :class:`~dpjax.results.EstimateResult` with ``estimate (d, d)`` (as :func:`al_covariance`:
    traceable with JAX's x64 mode on, ``TypeError`` under a float32 trace);
    ``info["corruption"]`` is η_c.

  References:
    [AL22] Algorithm 4, Thm 6.3, Prop 6.2; docs/algorithms.md §3.7.
  """
  corruption = v.check_corruption(corruption)
  estimator = _group_estimator(filtered_covariance, corruption)
  res = al_covariance(key, X, epsilon=epsilon, delta=delta, estimator=estimator,
                      **covariance_kwargs)
  return res.replace(info=res.info.replace(corruption=corruption))


@functools.lru_cache(maxsize=64)
def _group_estimator(filter_fn, corruption: float):
  """One partial per (filter, η): the jitted PPME bodies take the estimator as a static argument,
  so an equal object on every call reuses the compiled program instead of recompiling."""
  return functools.partial(filter_fn, corruption=corruption)
