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
from dpjax._host import host_call
from dpjax.ashtiani_liaw import masking, semimetric
from dpjax.ashtiani_liaw.calibration import (COVARIANCE_RADIUS, CovarianceCalibration,
                                             _TooFewRows, covariance_calibration)
from dpjax.ashtiani_liaw.populous_mean import (DEFAULT_RADIUS_MARGIN, PPMECalibration,
                                               PopulousThresholds, check_thresholds,
                                               populous_mean, ppme_calibration, split_groups)
from dpjax.results import EstimateResult


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


def al_covariance(key: jax.Array, X, *, epsilon: float, delta: float,
                  radius: float = COVARIANCE_RADIUS,
                  num_groups: int | None = None, min_group_size: int | None = None,
                  unknown_mean: bool = False, estimator=None, **calibration_kwargs
                  ) -> EstimateResult:
  """A constant-factor private approximation of an unbounded covariance ([AL22] Algorithm 3).

  PPME over groups of rows with the empirical covariance as candidate, the semimetric of §3.1
  and the covariance masking mechanism with the public calibration (module docstring).

  Privacy guarantee: (ε, δ)-DP under replace-one (n public): the PPME test is
  ``(ε1, δ1)``-DP via ``TLap(2/k, ε1, δ1)``; on a pass the weighted average moves by semimetric
  distance ≤ γ (``populous_mean.py``), and ``M_η`` with ``η ≥ η_min(γ)`` is a (γ, ε2, δ2)-masking
  mechanism (``masking.py``). Everything runs in float64 (under ``jax.enable_x64``). Floating
  point: the masked release's low-order bits are not protected (see ``masking.py``: the mask's
  noise is multiplicative, so the grid-and-integer-noise fix of the additive mechanisms does not
  apply); the PPME test bit is float-safe up to float64's 2^-53 resolution of the TLap tail.

  Utility ([AL22] Thm 5.4 with our constants): on ``N(0, Σ)`` data with ``n ≥ required_n``, the
  test passes w.p. ≥ 1 − β at the simulated neighbour fraction (calibration step 3), PPME's
  output, a convex combination of the groups' covariances, is within ``c =
  candidate_accuracy`` of Σ w.p. 1 − β, and the mask moves it by at most ``α = mask_accuracy``
  w.p. 1 − β, so ``dist(Σ̃, Σ) ≤ (1 + c)(1 + α) − 1`` (the semimetric's multiplicative triangle
  inequality), i.e. ``Σ/(1+C) ⪯ Σ̃ ⪯ (1+C)Σ`` for that constant C, w.p. ≥ 1 − 3β. In practice the
  average of the k groups is far closer to Σ than c, and the mask's α dominates.

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
    :class:`~dpjax.results.EstimateResult` (neighbouring ``REPLACE_ONE``) with ``estimate
    (d, d)`` (zeros on ⊥) — float64 NumPy eagerly: the masked preconditioner of a covariance with
    condition number up to 1e12 needs float64 whatever JAX's x64 flag —; ``info`` holds the
    calibration and the group size. Traceable in ``key`` and ``X``: under ``jit`` / ``vmap`` the
    float64 computation runs on the host as a ``jax.pure_callback`` (same output per key),
    returned in JAX's default float dtype; a non-finite traced ``X`` gives ⊥.

  Raises:
    ValueError: bad input (NaN/inf in a concrete X included), or ``n`` below the calibration's
      ``required_n`` (the message gives it with d, ε, δ and the groups). A hopeless ``n`` (below ``k·(d + 1)``, k the number of
      groups, found without simulation) is refused at once, before the group-size simulation,
      with that lower bound; :func:`required_n` gives the exact figure.

  References:
    [AL22] Algorithm 3, Lemma 5.1/5.2, Thm 5.4; docs/algorithms.md §3.5.
  """
  key = v.check_key(key)
  X = v.check_data64(X, "X")
  n, d = X.shape
  plan = _al_plan(n, d, epsilon, delta, radius=radius, num_groups=num_groups,
                  min_group_size=min_group_size, unknown_mean=unknown_mean, **calibration_kwargs)
  release = functools.partial(_al_covariance_host, plan=plan, estimator=estimator,
                              unknown_mean=unknown_mean)
  ok, estimate = host_call(release, (jax.ShapeDtypeStruct((), np.bool_),
                                     jax.ShapeDtypeStruct((d, d), np.float64)), key, X)
  return EstimateResult(ok=jnp.asarray(ok), estimate=estimate, epsilon=float(epsilon),
                        delta=float(delta), neighbouring=NeighboringRelation.REPLACE_ONE,
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


def _al_covariance_host(key, X, *, plan: _ALPlan, estimator, unknown_mean):
  """al_covariance's release on the host in float64: ``(ok, estimate (d, d))``."""
  X = np.asarray(X, np.float64)
  d = X.shape[1]
  if not np.all(np.isfinite(X)):                  # traced only: outside the domain
    return False, np.zeros((d, d))
  vectorize = estimator is None                 # a user estimator may iterate: one group at a time
  estimator = second_moment if estimator is None else estimator
  cal = plan.calibration
  with jax.enable_x64(True):
    ok, estimate = _al_covariance(key, jnp.asarray(X), cal.radius, cal.eta, plan.ppme,
                                  plan.thresholds, k=cal.num_groups, estimator=estimator,
                                  unknown_mean=unknown_mean, vectorize=vectorize)
    estimate = linalg.symmetrize(estimate)          # exactly symmetric (post-processing)
    return bool(ok), np.asarray(estimate, np.float64)


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


def learn_covariance(key: jax.Array, X, *, epsilon: float, delta: float,
                     coarse_fraction: float = 0.5, refine: bool = True,
                     unknown_mean: bool = False, eta_accuracy: float | None = 0.5,
                     **al_kwargs) -> EstimateResult:
  """Unbounded covariance to small error: AL preconditioner, then CoinPress ([AL22] Thm 5.4–5.6).

  The rows are split by position (public) into a coarse batch (the first ``coarse_fraction``)
  and a refinement batch. :func:`al_covariance` on the coarse batch gives Σ̃ with
  ``dist(Σ̃, Σ) ≤ c`` (``c = (1 + r)(1 + α) − 1``, r the closeness radius, α the mask's
  concentration; a practical, not worst-case, constant); the refinement batch is whitened by Σ̃
  and :func:`dpjax.coinpress.coinpress_covariance` (the practical stand-in for
  [AL22] Thm 5.5, Biswas et al. 2020) refines it with ``κ = (1 + c)²``, after which the
  estimate is mapped back. ``eta_accuracy`` defaults to 0.5 here (vs 0.2 in
  :func:`al_covariance`): a looser preconditioner is enough before refinement and halves the
  groups needed.

  Privacy guarantee: (ε, δ)-DP under replace-one. Each step is (ε, δ)-DP on its own batch; the
  batches are disjoint and fixed by position, and the refinement only sees the coarse batch
  through the DP release Σ̃ (adaptive parallel composition).

  Args:
    key: PRNG key.
    X: ``(n, d)`` rows ~ N(0, Σ) (N(μ, Σ) with ``unknown_mean``).
    epsilon, delta: the budget (each batch spends all of it).
    coarse_fraction: share of rows for the AL step.
    refine: False returns the AL step alone (on ``coarse_fraction`` of the rows).
    unknown_mean: difference consecutive pairs in both batches.
    eta_accuracy: passed to :func:`covariance_calibration`.
    **al_kwargs: further :func:`al_covariance` arguments.

  Returns:
    :class:`~dpjax.results.EstimateResult` (neighbouring ``REPLACE_ONE``; ⊥ when the AL step
    answers ⊥) with ``estimate (d, d)`` — float64 NumPy eagerly (as :func:`al_covariance`) —
    and ``info`` with ``coarse`` (the AL step's public calibration), ``coarse_rows``,
    ``refine`` and, when refining, ``preconditioner_factor`` K and ``refine_rows``. Traceable
    in ``key`` and ``X`` (the host pipeline runs as a ``jax.pure_callback`` under tracing).

  Raises:
    ValueError: too few rows for the AL step (the message names the user's n, the coarse
      fraction and the total rows needed; with ``refine=False`` it is :func:`al_covariance`'s),
      too few refinement rows, or as :func:`al_covariance`.

  References:
    [AL22] Algorithm 3, Thm 5.4–5.6; Biswas, Dong, Kamath & Ullman (2020); docs/algorithms.md §3.5.
  """
  from dpjax.coinpress import coinpress_covariance     # refinement is optional
  key = v.check_key(key)
  X = v.check_data64(X, "X")
  frac = v.check_probability(coarse_fraction, "coarse_fraction", open_high=not refine)
  n, d = X.shape
  n_coarse = int(n * frac) if refine else n
  estimator = al_kwargs.pop("estimator", None)
  al_args = dict(radius=al_kwargs.pop("radius", COVARIANCE_RADIUS),
                 num_groups=al_kwargs.pop("num_groups", None),
                 min_group_size=al_kwargs.pop("min_group_size", None), unknown_mean=unknown_mean,
                 eta_accuracy=eta_accuracy, **al_kwargs)
  try:
    plan = _al_plan(n_coarse, d, epsilon, delta, **al_args)
  except _TooFewRows as err:
    if not refine:
      raise
    # Restate the requirement in the user's terms: the AL step sees only int(n·frac) rows.
    total = math.ceil(err.rows / frac)
    while int(total * frac) < err.rows:
      total += 1
    raise ValueError(
        f"learn_covariance needs n >= {total} rows{'' if err.exact else ' at the very least'} "
        f"for d={d}, epsilon={err.epsilon:g}, delta={err.delta:g}: its AL step runs on "
        f"coarse_fraction={frac:g} of the rows and needs {err.rows} of them "
        f"({err.groups_text()}), got n={n} (int(n·coarse_fraction) = {n_coarse} rows for that "
        "step). Collect more rows, raise epsilon or coarse_fraction, or pass "
        "num_groups/min_group_size to trade accuracy for rows (required_n(d, epsilon, delta, "
        f"eta_accuracy={eta_accuracy}) gives the AL step's exact figure).") from None
  info = {"coarse": plan.info, "coarse_rows": n_coarse, "refine": bool(refine)}
  n_refine = (n - n_coarse) // (2 if unknown_mean else 1)
  if refine and n_refine < 2:
    raise ValueError("learn_covariance has no rows left for the refinement step.")
  c = (1.0 + plan.info["radius"]) * (1.0 + plan.info["mask_accuracy"]) - 1.0
  K = 1.0 + c
  if refine:
    info.update(preconditioner_factor=K, refine_rows=n_refine)

  def release(key, X):
    X = np.asarray(X, np.float64)
    k_coarse, k_refine = jax.random.split(key)
    ok, coarse = _al_covariance_host(k_coarse, X[:n_coarse], plan=plan, estimator=estimator,
                                     unknown_mean=unknown_mean)
    if not refine or not ok:
      return ok, coarse
    rows = X[n_coarse:]
    if unknown_mean:
      rows = pair_differences(rows)
    root, inv_root = _sqrt_and_inverse_sqrt(coarse)
    whitened = math.sqrt(K) * rows @ inv_root
    # A row that overflows in the whitening becomes 0: a fixed row-wise map given the released
    # preconditioner, so the refinement's guarantee is unchanged (never an error on data).
    whitened = np.where(np.all(np.isfinite(whitened), axis=1, keepdims=True), whitened, 0.0)
    fine = coinpress_covariance(k_refine, whitened, epsilon=epsilon, delta=delta, kappa=K * K)
    estimate = root @ np.asarray(fine.estimate) @ root / K
    return True, (estimate + estimate.T) / 2

  ok, estimate = host_call(release, (jax.ShapeDtypeStruct((), np.bool_),
                                     jax.ShapeDtypeStruct((d, d), np.float64)), key, X)
  return EstimateResult(ok=jnp.asarray(ok), estimate=estimate, epsilon=float(epsilon),
                        delta=float(delta), neighbouring=NeighboringRelation.REPLACE_ONE,
                        info=info)


def _sqrt_and_inverse_sqrt(S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Symmetric square root and inverse square root of a released PD matrix (post-processing)."""
  w, V = np.linalg.eigh((S + S.T) / 2)
  w = np.maximum(w, np.finfo(np.float64).tiny)
  return (V * np.sqrt(w)) @ V.T, (V / np.sqrt(w)) @ V.T
