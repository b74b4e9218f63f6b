"""The Ashtiani–Liaw covariance learner ([AL22] Algorithm 3, Thm 5.4; docs/algorithms.md §3.5).

PPME (``populous_mean.py``) over the affine-invariant semimetric (``semimetric.py``) with the
empirical covariance of each group as candidate and the covariance masking mechanism
(``masking.py``) as mask. No bound on the condition number or the scale of Σ is needed: every
step is affine equivariant. The output Σ̃ is a constant-factor approximation (a preconditioner);
:func:`learn_covariance` refines it with CoinPress on a disjoint batch of rows. The public
calibration (groups, group size, η, required rows) is in ``calibration.py``.
"""

from __future__ import annotations

import functools
import math

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import linalg
from dpjax._host import float64
from dpjax.ashtiani_liaw import masking, semimetric
from dpjax.ashtiani_liaw.calibration import (COVARIANCE_RADIUS, CovarianceCalibration,
                                             _candidate_accuracy, _TooFewRows,
                                             covariance_calibration,
                                             simulated_candidate_accuracy)
from dpjax.ashtiani_liaw.populous_mean import (DEFAULT_RADIUS_MARGIN, PPMECalibration,
                                               PopulousThresholds, check_thresholds,
                                               populous_mean, ppme_calibration, split_groups)
from dpjax.coinpress import coinpress_covariance, covariance_required_n
from dpjax.results import EstimateResult
from dpjax.ledger import with_ledger

__all__ = ["LearnCovariancePlan", "al_covariance", "learn_covariance", "learn_covariance_plan",
           "learn_covariance_required_n"]


def second_moment(rows: jax.Array) -> jax.Array:
  """``(1/m) Σ x xᵀ`` of ``rows (m, d)``: the empirical covariance of mean-zero rows."""
  return rows.T @ rows / rows.shape[0]


def pair_differences(X: jax.Array) -> jax.Array:
  """``(x_{2i} − x_{2i+1})/√2`` for consecutive pairs: mean-zero rows with the same covariance.

  One replaced row changes one difference, so a replace-one guarantee on the differences is one
  on ``X``. An odd last row is dropped.
  """
  half = X.shape[0] // 2
  return (X[0:2 * half:2] - X[1:2 * half:2]) / math.sqrt(2.0)


@with_ledger
def al_covariance(key: jax.Array, X, *, epsilon: float, delta: float,
                  radius: float = COVARIANCE_RADIUS,
                  num_groups: int | None = None, min_group_size: int | None = None,
                  unknown_mean: bool = False, estimator=None, **calibration_kwargs
                  ) -> EstimateResult:
  """A constant-factor private approximation of an unbounded covariance ([AL22] Algorithm 3).

  Usage::

      n = dpjax.ashtiani_liaw.required_n(d, 1.0, 1e-6)       # rows the calibration needs
      result = dpjax.ashtiani_liaw.al_covariance(key, X, epsilon=1.0, delta=1e-6)  # X (n, d)
      result.ok, result.estimate              # the ⊥ flag, Σ̃ (d, d) float64 (zeros on ⊥)

  PPME over groups of rows (candidate: each group's empirical covariance; the semimetric of
  §3.1), then the covariance masking mechanism, with the public calibration (module docstring).
  Guarantee: (ε, δ)-DP under replace-one (n public): the PPME test is ``(ε1, δ1)``-DP via
  ``TLap(2/k, ε1, δ1)``; on a pass the weighted average moves by semimetric distance ≤ γ, and
  ``M_η`` with ``η ≥ η_min(γ)`` is a (γ, ε2, δ2)-masking mechanism (docs/algorithms.md §3.2,
  §3.4, §3.5). Everything runs in float64 (JAX's x64 mode). Floating point: the masked release's
  low-order bits are not protected (``masking.py``, §3.4); the PPME test bit is float-safe up to
  float64's 2^-53 resolution of the TLap tail. Utility: on ``N(0, Σ)`` data with
  ``n ≥ required_n``, ``Σ/(1+C) ⪯ Σ̃ ⪯ (1+C)Σ`` w.p. ≥ 1 − 3β with
  ``1 + C = (1 + candidate_accuracy)(1 + mask_accuracy)`` ([AL22] Thm 5.4 with our constants;
  derivation in §3.5).

  Args:
    key: PRNG key.
    X: ``(n, d)`` rows ~ N(0, Σ) (or N(μ, Σ) with ``unknown_mean=True``: consecutive pairs are
      differenced, see :func:`pair_differences`).
    epsilon, delta: the budget.
    radius, num_groups, min_group_size: see :func:`covariance_calibration`.
    unknown_mean: difference pairs of rows first.
    estimator: non-private ``(m, d) -> (d, d)`` candidate (default :func:`second_moment`; the
      robust variant passes a robust covariance estimator).
    **calibration_kwargs: further :func:`covariance_calibration` arguments.

  Returns:
    :class:`~dpjax.results.EstimateResult` (neighboring ``REPLACE_ONE``) with ``estimate
    (d, d)`` (zeros on ⊥) — float64 NumPy eagerly, whatever JAX's x64 flag (the masked
    preconditioner of a covariance with condition number up to 1e12 needs float64); ``info``
    holds the calibration and the group size. Traceable in ``key`` and ``X`` inside
    ``with jax.enable_x64(True):``: float64 output, the eager call's per key up to rounding (XLA
    fuses differently; symmetric only up to rounding); a non-finite traced ``X`` gives ⊥.

  Raises:
    TypeError: traced with JAX's x64 mode off (call it eagerly, or trace inside
      ``jax.enable_x64(True)``); a bad key or non-numeric ``X``.
    ValueError: bad input (NaN/inf in a concrete X included), or ``n`` below the calibration's
      ``required_n`` (the message gives it with d, ε, δ and the groups); a hopeless ``n`` (below
      ``k·(d + 1)``, k the number of groups) is refused at once, before the group-size
      simulation; :func:`required_n` gives the exact figure.

  References:
    [AL22] Algorithm 3, Lemma 5.1/5.2, Thm 5.4; docs/algorithms.md §3.5.
  """
  key = v.check_key(key)
  X = v.check_data64(X, "X")
  n, d = X.shape
  plan = _al_plan(n, d, epsilon, delta, radius=radius, num_groups=num_groups,
                  min_group_size=min_group_size, unknown_mean=unknown_mean, **calibration_kwargs)
  release = functools.partial(_al_covariance_release, plan=plan, estimator=estimator,
                              unknown_mean=unknown_mean)
  ok, estimate = float64("al_covariance", release, key, X)
  return EstimateResult(ok=jnp.asarray(ok), estimate=estimate, epsilon=float(epsilon),
                        delta=float(delta), neighboring=NeighboringRelation.REPLACE_ONE,
                        info=plan.info)


class _ALPlan(NamedTuple):
  """The public constants of one :func:`al_covariance` call."""
  calibration: CovarianceCalibration
  ppme: PPMECalibration
  thresholds: PopulousThresholds
  info: dict


def _al_plan(n, d, epsilon, delta, *, radius, num_groups, min_group_size, unknown_mean,
             **calibration_kwargs) -> _ALPlan:
  """Calibrates :func:`al_covariance` from public numbers; raises ``_TooFewRows`` for small n."""
  # n (public) goes in so that a hopeless n fails before the group-size simulation runs.
  cal = covariance_calibration(d, epsilon, delta, radius=radius, num_groups=num_groups,
                               min_group_size=min_group_size, unknown_mean=unknown_mean,
                               n=n, **calibration_kwargs)
  if n < cal.required_n:
    raise _TooFewRows(n=n, d=d, epsilon=float(epsilon), delta=float(delta),
                      num_groups=cal.num_groups, group_size=cal.min_group_size,
                      pairs=2 if unknown_mean else 1, exact=True)
  thresholds = check_thresholds(cal.thresholds, cal.num_groups)
  ppme = ppme_calibration(cal.num_groups, cal.radius, cal.epsilon_test, cal.delta_test,
                          space="covariance", thresholds=thresholds,
                          radius_margin=calibration_kwargs.get("radius_margin",
                                                               DEFAULT_RADIUS_MARGIN),
                          sensitivity_bound=calibration_kwargs.get("ppme_bound", "tight"))
  info = dict(cal._asdict(), group_size=(n // (2 if unknown_mean else 1)) // cal.num_groups)
  return _ALPlan(cal, ppme, thresholds, info)


def _al_covariance_release(key, X, *, plan: _ALPlan, estimator, unknown_mean):
  """al_covariance's release, traceable JAX in float64 (run through ``float64``): ``(ok,
  estimate (d, d))``. A non-finite X (reachable only traced: a concrete X is validated) lies
  outside the domain and gives ⊥; it is zeroed first, a fixed map, so that no estimator iterates
  on NaN."""
  vectorize = estimator is None                 # a user estimator may iterate: one group at a time
  estimator = second_moment if estimator is None else estimator
  cal = plan.calibration
  ok, estimate = _al_covariance(key, jnp.where(v.all_finite(X), X, 0.0), cal.radius, cal.eta,
                                plan.ppme, plan.thresholds, k=cal.num_groups, estimator=estimator,
                                unknown_mean=unknown_mean, vectorize=vectorize)
  return v.domain_bottom(X, ok, linalg.symmetrize(estimate))     # symmetric: post-processing


@functools.partial(jax.jit, static_argnames=("k", "estimator", "unknown_mean", "vectorize"))
def _al_covariance(key, X, radius, eta, ppme, thresholds, *, k, estimator, unknown_mean,
                   vectorize):
  """al_covariance's jitted body. The public scalars (radius, η, the PPME calibration and
  thresholds) are traced, so an ε sweep compiles once per shape."""
  d = X.shape[1]
  rows = pair_differences(X) if unknown_mean else X
  k_split, k_run = jax.random.split(key)
  groups = split_groups(k_split, rows, k)
  return populous_mean(
      k_run, groups, estimator=estimator,
      neighbour_counts=lambda Y: semimetric.neighbour_counts(Y, radius),
      mask=lambda k_mask, S: masking.mask_covariance(k_mask, S, eta),
      calibration=ppme, thresholds=thresholds, placeholder=jnp.eye(d, dtype=X.dtype),
      vectorize=vectorize)


# [PROPOSED] learn_covariance's defaults: the refinement's typical-error target, and no cap on
# the mask's η (CoinPress needs about as many rows at κ = 1500 as at κ = 16, while the cap adds
# 21% to the AL step's rows at d = 10; docs/algorithms.md §3.5).
REFINE_ACCURACY = 0.1
LEARN_COVARIANCE_ETA_ACCURACY = None


class LearnCovariancePlan(NamedTuple):
  """The public constants of one :func:`learn_covariance` call (a function of n, d, ε, δ and the
  arguments only).

  Attributes:
    coarse_rows: rows of the AL step (the first rows of X).
    refine_rows: rows of the CoinPress refinement (the rest; 0 without refinement).
    refine_min_rows: rows the refinement needs for ``refine_accuracy`` (0 when unchecked).
    preconditioner_factor: K with ``Σ/K ⪯ Σ̃ ⪯ KΣ`` w.p. ≥ 1 − 3β on N(0, Σ) data, K =
      ``(1 + c)(1 + α)`` (c = candidate accuracy at the AL step's group size, α = mask accuracy).
    al: the AL step's plan.
  """
  coarse_rows: int
  refine_rows: int
  refine_min_rows: int
  preconditioner_factor: float
  al: _ALPlan


def learn_covariance_plan(n: int, d: int, *, epsilon: float, delta: float,
                          coarse_rows: int | None = None, coarse_fraction: float | None = None,
                          refine: bool = True, refine_accuracy: float | None = REFINE_ACCURACY,
                          unknown_mean: bool = False,
                          eta_accuracy: float | None = LEARN_COVARIANCE_ETA_ACCURACY,
                          **al_kwargs) -> LearnCovariancePlan:
  """The row split and constants of :func:`learn_covariance` for ``n`` rows (public numbers only).

  Default split [PROPOSED]: the AL step gets exactly the rows its calibration needs
  (``required_n``; more rows would not tighten the preconditioner, whose error is the mask's)
  and the CoinPress refinement all the rest, which must be at least
  :func:`~dpjax.coinpress.covariance_required_n` at ``κ = K²`` and ``refine_accuracy`` (the
  refinement's accuracy keeps improving with its rows). ``coarse_rows`` or ``coarse_fraction``
  (``int(n·coarse_fraction)``) fix the AL step's share instead.

  Args:
    n: rows available (public).
    d: dimension.
    epsilon, delta, coarse_rows, coarse_fraction, refine, refine_accuracy, unknown_mean,
      eta_accuracy, **al_kwargs: as in :func:`learn_covariance`.

  Returns:
    :class:`LearnCovariancePlan`.

  Raises:
    ValueError: bad arguments; too few rows for the AL step or the refinement (the message names
      n, d, ε, δ and the rows each step needs).
  """
  n = v.check_int(n, "n", low=1)
  d = v.check_int(d, "d", low=1)
  if coarse_rows is not None and coarse_fraction is not None:
    raise ValueError("pass at most one of coarse_rows and coarse_fraction.")
  if refine_accuracy is not None:
    refine_accuracy = v.check_positive(refine_accuracy, "refine_accuracy")
  pairs = 2 if unknown_mean else 1
  al_args = dict(radius=al_kwargs.pop("radius", COVARIANCE_RADIUS),
                 num_groups=al_kwargs.pop("num_groups", None),
                 min_group_size=al_kwargs.pop("min_group_size", None), unknown_mean=unknown_mean,
                 eta_accuracy=eta_accuracy, **al_kwargs)
  if not refine:
    if coarse_rows is not None or coarse_fraction is not None:
      raise ValueError("coarse_rows / coarse_fraction split the rows for the refinement; "
                       "with refine=False the AL step uses all n rows.")
    plan = _al_plan(n, d, epsilon, delta, **al_args)
    return LearnCovariancePlan(n, 0, 0, _preconditioner_factor(plan), plan)
  if coarse_fraction is not None:
    frac = v.check_probability(coarse_fraction, "coarse_fraction", open_high=True)
    coarse_rows = int(n * frac)
  elif coarse_rows is not None:
    coarse_rows = v.check_int(coarse_rows, "coarse_rows", low=1)
    if coarse_rows >= n:
      raise ValueError(f"coarse_rows={coarse_rows} leaves no rows of n={n} for the refinement.")
  coarse_given = coarse_rows
  try:
    if coarse_rows is None:
      # n goes in for the calibration's fail-fast check only: the AL step gets required_n rows.
      cal = covariance_calibration(d, epsilon, delta, n=n, **al_args)
      coarse_rows = min(cal.required_n, n)
    plan = _al_plan(coarse_rows, d, epsilon, delta, **al_args)
  except _TooFewRows as err:
    if refine and coarse_fraction is None and coarse_given is None:
      # The default split: quote the helper's exact total (issue 53: the cheap lower bound
      # here and al_covariance's required_n were 140× apart, and neither was this learner's).
      total = learn_covariance_required_n(
          d, epsilon, delta, refine_accuracy=refine_accuracy, unknown_mean=unknown_mean,
          eta_accuracy=eta_accuracy, radius=al_args["radius"], num_groups=al_args["num_groups"],
          min_group_size=al_args["min_group_size"], **al_kwargs)
      raise ValueError(
          f"learn_covariance needs n >= {total:,} rows for d={d}, epsilon={epsilon:g}, "
          f"delta={delta:g}, got n={n}: learn_covariance_required_n({d}, {epsilon:g}, "
          f"{delta:g}) = {total:,} (its AL step's groups plus the CoinPress refinement; "
          "al_covariance alone is a different learner with its own required_n). Collect more "
          "rows, raise epsilon, or pass num_groups/min_group_size to trade accuracy for "
          "rows.") from None
    refine_text = ("" if refine_accuracy is None else
                   ", plus rows for the CoinPress refinement (learn_covariance_plan)")
    split = "" if err.n == n else f"; the AL step gets {err.n} of the n={n} rows"
    raise ValueError(
        f"learn_covariance needs n >= {err.rows} rows{'' if err.exact else ' at the very least'}"
        f" for its AL step alone{refine_text}, for d={d}, epsilon={err.epsilon:g}, "
        f"delta={err.delta:g} ({err.groups_text()}), got n={n}{split}. Collect more rows, "
        "raise epsilon, or pass num_groups/min_group_size to trade accuracy for rows.") from None
  K = _preconditioner_factor(plan)
  if not math.isfinite(K):
    raise ValueError(f"the AL step's preconditioner factor K = (1 + c)(1 + α) is not finite at "
                     f"d={d}, epsilon={epsilon:g}, delta={delta:g} (α = "
                     f"{plan.calibration.mask_accuracy:g}): pass eta_accuracy to cap the mask's η.")
  n_refine = n - coarse_rows
  need = 2
  if refine_accuracy is not None:
    need = max(need, covariance_required_n(d, kappa=K * K, epsilon=epsilon, delta=delta,
                                           accuracy=refine_accuracy))
  if n_refine // pairs < need:
    raise ValueError(
        f"learn_covariance needs n >= {coarse_rows + need * pairs} rows for d={d}, "
        f"epsilon={epsilon:g}, delta={delta:g}: {coarse_rows} for its AL step "
        f"({plan.calibration.num_groups} groups{', paired' if pairs == 2 else ''}) and "
        f"{need * pairs} for the CoinPress refinement (typical error {refine_accuracy} at "
        f"kappa={K * K:.3g}; covariance_required_n), got n={n} ({n_refine} left for the "
        "refinement). Collect more rows, raise epsilon or refine_accuracy, or pass "
        "num_groups/min_group_size to trade accuracy for rows.")
  return LearnCovariancePlan(coarse_rows, n_refine, need if refine_accuracy is not None else 0,
                             K, plan)


def learn_covariance_required_n(d: int, epsilon: float, delta: float, **kwargs) -> int:
  """Rows :func:`learn_covariance` needs at its default split: the AL step's ``required_n`` plus
  the refinement's :func:`~dpjax.coinpress.covariance_required_n` (doubled with
  ``unknown_mean``). Keyword arguments as in :func:`learn_covariance_plan` (not
  ``coarse_rows`` / ``coarse_fraction``). Public numbers only; takes the calibration's time
  (seconds at d = 13, half a minute at d = 60), remembered per arguments. It is the number
  :func:`learn_covariance`'s refusal quotes. Not :func:`dpjax.ashtiani_liaw.required_n`, which
  is :func:`al_covariance`'s (a different learner, at its own, more conservative defaults).
  """
  return _learn_covariance_required_n(d, epsilon, delta, tuple(sorted(kwargs.items())))


@functools.lru_cache(maxsize=32)
def _learn_covariance_required_n(d, epsilon, delta, items) -> int:
  kwargs = dict(items)
  if "coarse_rows" in kwargs or "coarse_fraction" in kwargs:
    raise ValueError("learn_covariance_required_n is the default split's requirement; it takes "
                     "no coarse_rows / coarse_fraction.")
  pairs = 2 if kwargs.get("unknown_mean", False) else 1
  if not kwargs.get("refine", True):
    al_kwargs = dict(kwargs, eta_accuracy=kwargs.get("eta_accuracy",
                                                     LEARN_COVARIANCE_ETA_ACCURACY))
    al_kwargs.pop("refine"), al_kwargs.pop("refine_accuracy", None)
    return covariance_calibration(d, epsilon, delta, **al_kwargs).required_n
  plan = learn_covariance_plan(10**15, d, epsilon=epsilon, delta=delta, **kwargs)
  return plan.coarse_rows + max(plan.refine_min_rows, 2) * pairs


def _preconditioner_factor(plan: _ALPlan) -> float:
  """K = (1 + c)(1 + α): c the groups' candidate accuracy at the AL step's actual group size.

  Where the Gaussian bound says nothing (``c = ∞``: groups of a few rows, at large ε or a small
  ``min_group_size``), c is simulated instead (utility only): the largest, over 100 public
  replicates, of ``max_i dist(Ŷ_i, I)`` over k Wishart(m, I)/m candidates — exact in law for
  every N(0, Σ) by affine invariance.
  """
  cal = plan.calibration
  d, m, k = cal.d, plan.info["group_size"], cal.num_groups
  c = _candidate_accuracy(d, m, k, cal.beta)
  if not math.isfinite(c):
    c = simulated_candidate_accuracy(d, m, k)
  return (1.0 + c) * (1.0 + cal.mask_accuracy)


@with_ledger
def learn_covariance(key: jax.Array, X, *, epsilon: float, delta: float,
                     coarse_rows: int | None = None, coarse_fraction: float | None = None,
                     refine: bool = True, refine_accuracy: float | None = REFINE_ACCURACY,
                     unknown_mean: bool = False,
                     eta_accuracy: float | None = LEARN_COVARIANCE_ETA_ACCURACY,
                     **al_kwargs) -> EstimateResult:
  """Unbounded covariance to small error: AL preconditioner, then CoinPress ([AL22] Thm 5.4–5.6).

  Usage::

      n = dpjax.ashtiani_liaw.learn_covariance_required_n(d, 1.0, 1e-6)   # rows needed in all
      result = dpjax.ashtiani_liaw.learn_covariance(key, X, epsilon=1.0, delta=1e-6)  # X (n, d)
      result.ok, result.estimate              # the ⊥ flag, Σ̂ (d, d) float64 (zeros on ⊥)

  :func:`al_covariance` on a coarse batch (the first ``coarse_rows``: a split by position, public;
  :func:`learn_covariance_plan`) gives Σ̃ with ``Σ/K ⪯ Σ̃ ⪯ KΣ`` w.p. ≥ 1 − 3β; the other rows,
  whitened by Σ̃, are refined by :func:`dpjax.coinpress.coinpress_covariance` at ``κ = K²``.
  Guarantee: (ε, δ)-DP under replace-one: each step is (ε, δ)-DP on its own batch, the batches
  are disjoint and fixed by position, and the refinement sees the coarse batch only through the
  DP release Σ̃ (adaptive parallel composition; docs/algorithms.md §3.5). Σ̃ is not float-safe
  (§3.4). Utility: the typical ``‖Σ^{-1/2}Σ̂Σ^{-1/2} − I‖_2`` is at most ``refine_accuracy`` at
  the minimum n and falls as n grows (measurements in §3.5).

  Args:
    key: PRNG key.
    X: ``(n, d)`` rows ~ N(0, Σ) (N(μ, Σ) with ``unknown_mean``).
    epsilon, delta: the budget (each batch spends all of it).
    coarse_rows: rows of the AL step (default: its ``required_n``).
    coarse_fraction: or the AL step's share of n (``int(n·coarse_fraction)`` rows); at most one
      of the two.
    refine: False returns the AL step alone, on all n rows.
    refine_accuracy: the refinement's typical-error target that sets its minimum rows
      (:func:`~dpjax.coinpress.covariance_required_n`; > 0; None: any 2 or more rows, or pairs).
    unknown_mean: difference consecutive pairs in both batches.
    eta_accuracy: passed to :func:`covariance_calibration`; None here (0.2 in
      :func:`al_covariance`): the fewest groups privacy allows (CoinPress barely cares, §3.5).
    **al_kwargs: further :func:`al_covariance` arguments.

  Returns:
    :class:`~dpjax.results.EstimateResult` (neighboring ``REPLACE_ONE``; ⊥ when the AL step
    answers ⊥) with ``estimate (d, d)`` — float64 NumPy eagerly (as :func:`al_covariance`) —
    and ``info`` with ``coarse`` (the AL step's public calibration), ``coarse_rows``,
    ``refine`` and, when refining, ``preconditioner_factor`` K, ``refine_rows`` (rows, or pairs
    with ``unknown_mean``, of the refinement) and ``refine_min_rows``. Traceable in ``key`` and
    ``X`` with JAX's x64 mode on, as :func:`al_covariance` (on ⊥ the refinement still runs, on
    the identity preconditioner, and its output is discarded).

  Raises:
    TypeError: traced with JAX's x64 mode off (call it eagerly, or trace inside
      ``jax.enable_x64(True)``).
    ValueError: too few rows for the AL step or the refinement (the message names the user's n
      and the rows each step needs; :func:`learn_covariance_required_n` gives the total), both
      ``coarse_rows`` and ``coarse_fraction``, or as :func:`al_covariance`.

  References:
    [AL22] Algorithm 3, Thm 5.4–5.6; Biswas, Dong, Kamath & Ullman (2020); docs/algorithms.md §3.5.
  """
  key = v.check_key(key)
  X = v.check_data64(X, "X")
  n, d = X.shape
  estimator = al_kwargs.pop("estimator", None)
  lc = learn_covariance_plan(n, d, epsilon=epsilon, delta=delta, coarse_rows=coarse_rows,
                             coarse_fraction=coarse_fraction, refine=refine,
                             refine_accuracy=refine_accuracy, unknown_mean=unknown_mean,
                             eta_accuracy=eta_accuracy, **al_kwargs)
  plan, n_coarse, K = lc.al, lc.coarse_rows, lc.preconditioner_factor
  info = {"coarse": plan.info, "coarse_rows": n_coarse, "refine": bool(refine)}
  if refine:
    info.update(preconditioner_factor=K,
                refine_rows=lc.refine_rows // (2 if unknown_mean else 1),
                refine_min_rows=lc.refine_min_rows)

  def release(key, X):
    k_coarse, k_refine = jax.random.split(key)
    ok, coarse = _al_covariance_release(k_coarse, X[:n_coarse], plan=plan, estimator=estimator,
                                        unknown_mean=unknown_mean)
    if not refine:
      return ok, coarse
    rows = X[n_coarse:]
    if unknown_mean:
      rows = pair_differences(rows)
    # ok is the AL step's DP output: the refinement runs either way (with the identity as
    # preconditioner on ⊥) and its output is discarded on ⊥, a post-processing of both releases.
    root, inv_root = _sqrt_and_inverse_sqrt(jnp.where(ok, coarse, jnp.eye(d, dtype=X.dtype)))
    whitened = math.sqrt(K) * rows @ inv_root
    # A row that overflows in the whitening becomes 0: a fixed row-wise map given the released
    # preconditioner, so the refinement's guarantee is unchanged (never an error on data).
    whitened = jnp.where(jnp.all(jnp.isfinite(whitened), axis=1, keepdims=True), whitened, 0.0)
    fine = coinpress_covariance(k_refine, whitened, epsilon=epsilon, delta=delta, kappa=K * K)
    estimate = root @ jnp.asarray(fine.estimate, X.dtype) @ root / K
    ok = ok & fine.ok
    return ok, jnp.where(ok, (estimate + estimate.T) / 2, 0.0)

  ok, estimate = float64("learn_covariance", release, key, X)
  return EstimateResult(ok=jnp.asarray(ok), estimate=estimate, epsilon=float(epsilon),
                        delta=float(delta), neighboring=NeighboringRelation.REPLACE_ONE,
                        info=info)


def _sqrt_and_inverse_sqrt(S):
  """Symmetric square root and inverse square root of a released PD matrix (post-processing):
  NumPy in, NumPy out (the eager learners' host arithmetic); JAX in, JAX out (traceable)."""
  xp = np if isinstance(S, np.ndarray) else jnp
  w, V = xp.linalg.eigh((S + S.T) / 2)
  w = xp.maximum(w, xp.finfo(S.dtype).tiny)
  return (V * xp.sqrt(w)) @ V.T, (V / xp.sqrt(w)) @ V.T
