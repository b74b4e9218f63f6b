"""Non-private robust estimators for η-corrupted Gaussian samples (docs/algorithms.md §3.7).

NOTHING HERE IS PRIVATE. These are the non-private estimators ``Est`` that the robust private
learners of [AL22] (Algorithms 4 and 5) run on each of k groups inside subsample-and-aggregate;
privacy comes from the aggregation around them. Each is a pure JAX function of one group's rows,
so one call batches over groups::

    jax.vmap(lambda D: filtered_mean(D, corruption=0.1))(groups)        # (k, m, d) -> (k, d)

Model: an η-corrupted sample — n i.i.d. rows from a Gaussian, of which an adversary who sees
them replaces at most ``η n`` arbitrarily (``corruption`` = η ∈ [0, ½)).

Which to use:

* :func:`filtered_mean` — mean of ``N(μ, I_d)`` (identity covariance known, e.g. after
  whitening). Iterative weighted filtering along the top eigenvector of the weighted covariance;
  rate ``O(η sqrt(ln(1/η)))`` in theory. The ``Est`` for the robust mean learner.
* :func:`filtered_covariance` — covariance of ``N(0, Σ)`` (zero mean; for unknown mean pass pair
  differences ``(x_{2i} − x_{2i−1})/√2``). Filtering on the whitened second moments; affine
  equivariant; rate ``O(η ln(1/η))`` in relative Frobenius norm in theory. The ``Est`` for the
  robust covariance learner. Costs ``O(n d⁴)`` per iteration: meant for d ≲ 20.
* :func:`coordinatewise_median`, :func:`trimmed_covariance` — simple stand-ins for smoke tests.
  They do NOT achieve the filtering rates (the median's error grows like ``η sqrt(d)``; the trimmed
  covariance can be fooled by outliers that hide inside the bulk of the data).

All functions take ``X`` of shape ``(n, d)`` (rows are individuals) in float32 or float64, return
the estimate in ``X``'s dtype, are deterministic, and trace under ``jit``/``vmap`` (fixed iteration
counts, static shapes, no host callbacks). Validation runs on the host before tracing; under
``jit``/``vmap`` the values of ``X`` are not available, so only its shape and dtype are checked
(NaN/inf rows then give NaN estimates instead of an error).

References:
  [AL22] H. Ashtiani, C. Liaw. Private and polynomial time algorithms for learning Gaussians and
    beyond. COLT 2022.
  [DKKLMS16] I. Diakonikolas, G. Kamath, D. M. Kane, J. Li, A. Moitra, A. Stewart. Robust
    estimators in high dimensions without the computational intractability. FOCS 2016; SIAM J.
    Comput. 48(2), 2019.
  [DKKLMS17] Same authors. Being robust (in high dimensions) can be practical. ICML 2017.
  [DHL19] Y. Dong, S. B. Hopkins, J. Li. Quantum entropy scoring for fast robust mean estimation
    and improved outlier detection. NeurIPS 2019.
  [DK23] I. Diakonikolas, D. M. Kane. Algorithmic High-Dimensional Robust Statistics. Cambridge
    University Press, 2023 (Ch. 2: stability, certificates and (weighted) filters; Ch. 4:
    robust covariance estimation).
  [RV99] P. J. Rousseeuw, K. Van Driessen. A fast algorithm for the minimum covariance
    determinant estimator. Technometrics 41(3), 1999.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from dpjax import _validation as v
from dpjax import linalg

__all__ = ["FilterInfo", "coordinatewise_median", "filtered_covariance", "filtered_mean",
           "trimmed_covariance"]

#: Default constant C of the stopping certificates (see :func:`filtered_mean`).
DEFAULT_STOP_CONSTANT = 1.0

_MEDIAN_CHI2_1 = float(stats.chi2.median(1))
_REWEIGHT_QUANTILE = 0.975


class FilterInfo(NamedTuple):
  """Diagnostics of a filtering run (a pytree: ``vmap`` gives every field a leading k axis).

  Attributes:
    weights: ``(n,)`` final row weights in ``[0, 1]`` (1 = untouched, 0 = removed), X's dtype.
    top_eigenvalue: ``()`` top eigenvalue of the certificate matrix at the final weights (the
      weighted covariance for the mean; the weighted covariance of the whitened second moments
      for the covariance).
    stop_threshold: ``()`` the threshold it is compared with.
    certified: ``()`` bool, ``top_eigenvalue <= stop_threshold``: the filter ended in a state the
      analysis certifies. False means the iteration budget ran out, the removal budget ``2ηn``
      was spent, or no row scored above the score threshold (the filter stalled; always the case
      with ``corruption = 0``, where nothing is removed).
    steps: ``()`` int32, number of iterations that changed the weights.
  """
  weights: jax.Array
  top_eigenvalue: jax.Array
  stop_threshold: jax.Array
  certified: jax.Array
  steps: jax.Array


# ------------------------------------------------------------------------------------------------
# Host-side validation.


def _check_rows(X, name: str = "X", *, min_rows: int = 1):
  """``check_data`` for concrete arrays; shape/dtype checks only for tracers (jit/vmap)."""
  if isinstance(X, jax.core.Tracer):
    if X.ndim != 2:
      raise ValueError(f"{name} must have 2 dimensions, got shape {tuple(X.shape)}.")
    if X.dtype == jnp.bool_ or not (jnp.issubdtype(X.dtype, jnp.floating)
                                    or jnp.issubdtype(X.dtype, jnp.integer)):
      raise TypeError(f"{name} must have a real floating dtype, got dtype={X.dtype}.")
    if X.shape[0] < min_rows:
      raise ValueError(f"{name} must have at least {min_rows} rows, got {X.shape[0]}.")
    if X.shape[1] == 0:
      raise ValueError(f"{name} must not have an empty axis, got shape {tuple(X.shape)}.")
    if not jnp.issubdtype(X.dtype, jnp.floating):
      X = X.astype(jnp.result_type(float))
    return X
  return v.check_data(X, name, min_rows=min_rows)


def _check_iterations(iterations, default: int) -> int:
  if iterations is None:
    return default
  return v.check_int(iterations, "iterations", low=0)


def _work_dtype(dtype):
  """float32 for half precisions, else the input's float dtype."""
  return jnp.promote_types(dtype, jnp.float32)


def _log_inv(eta: float) -> float:
  """``ln(1/η)``; ``inf`` at η = 0."""
  return math.inf if eta == 0.0 else math.log(1.0 / eta)


def _check_score_threshold(score_threshold, default: float) -> float:
  if score_threshold is None:
    return default
  return v.check_positive(score_threshold, "score_threshold", allow_zero=True, allow_inf=True)


def _run_filter(core, X, score_threshold: float, stop_threshold: float, eta: float,
                iterations: int, return_info: bool):
  """Runs a jitted filter core in the working dtype; results come back in X's dtype."""
  dtype = X.dtype
  wd = _work_dtype(dtype)
  estimate, info = core(X.astype(wd), jnp.asarray(score_threshold, wd),
                        jnp.asarray(stop_threshold, wd), jnp.asarray(2.0 * eta * X.shape[0], wd),
                        iterations)
  estimate = estimate.astype(dtype)
  if estimate.ndim == 2:                      # a covariance: exactly symmetric (on the output)
    estimate = linalg.symmetrize(estimate)
  if return_info:
    return estimate, info._replace(weights=info.weights.astype(dtype))
  return estimate


# ------------------------------------------------------------------------------------------------
# Shared traced helpers.


def _weighted_median(a: jax.Array, w: jax.Array) -> jax.Array:
  """Lower weighted median of ``a`` (n,) under weights ``w`` >= 0 with positive sum."""
  order = jnp.argsort(a)
  cw = jnp.cumsum(w[order])
  k = jnp.argmax(cw >= 0.5 * cw[-1])
  return a[order][k]


def _capped_downweight(w: jax.Array, f: jax.Array, budget: jax.Array):
  """One capped multiplicative filter step: ``w_i ← w_i (1 − min(1, f_i / c))``.

  ``f >= 0`` are outlier scores. The cap ``c`` is the smallest score value with
  ``Σ_i w_i min(f_i, c) >= ½ Σ_i w_i f_i``. Let G and B be the inliers' and outliers' score mass
  ``Σ w_i f_i``. The removed inlier weight is at most ``G / c``; the removed outlier weight is at
  least ``(½ (G + B) − G) / c``; so whenever ``G <= B / 3`` the step removes at least as much
  outlier weight as inlier weight — the filter invariant of [DK23, Ch. 2], with the factor 3 in
  place of the 1 of the uncapped rule ``c = max f``. The cap lets one step remove a whole group of
  outliers instead of only the single most extreme row. The total removed weight
  ``Σ_i (1 − w_i)`` never exceeds ``budget`` (= 2ηn, the most a successful filter removes).

  Returns:
    ``(new_w, changed)``.
  """
  n = w.shape[0]
  f = jnp.where(w > 0, f, 0.0)
  total = jnp.sum(w * f)
  order = jnp.argsort(f)
  fs, ws = f[order], w[order]
  cw = jnp.cumsum(ws)
  kept_mass = jnp.cumsum(ws * fs) + fs * (cw[-1] - cw)     # Σ w min(f, fs[k]) for each k
  c = fs[jnp.argmax(kept_mass >= 0.5 * total)]
  c = jnp.where(c > 0, c, jnp.max(f))                      # guard against rounding
  active = total > 0
  r = jnp.where(active, jnp.minimum(1.0, f / jnp.where(c > 0, c, 1.0)), 0.0)
  removing = jnp.sum(w * r)
  left = jnp.maximum(budget - (n - jnp.sum(w)), 0.0)
  r = r * jnp.where(removing > left, left / jnp.where(removing > 0, removing, 1.0), 1.0)
  new_w = w * (1.0 - r)
  return new_w, jnp.any(new_w != w)


def _top_eigenpair(S: jax.Array):
  lam, V = jnp.linalg.eigh(0.5 * (S + S.T))
  return lam[-1], V[:, -1]


def _inverse_sqrt(S: jax.Array) -> jax.Array:
  """``S^{-1/2}`` of a PSD matrix, eigenvalues floored at ``d·eps·λ_max`` (and at ``tiny``)."""
  d = S.shape[0]
  e, U = jnp.linalg.eigh(0.5 * (S + S.T))
  finfo = jnp.finfo(S.dtype)
  floor = jnp.maximum(e[-1] * d * finfo.eps, finfo.tiny)
  return (U * jax.lax.rsqrt(jnp.maximum(e, floor))[None, :]) @ U.T


def _power_of_two_scale(X: jax.Array) -> jax.Array:
  """``2^round(log2(median_i max_j |x_ij|))`` (1 if that is 0).

  Dividing the rows by a power of two (and multiplying second moments back by its square) is
  exact in floating point, so results are unchanged except that sums of squares of data at
  extreme scales (|x| ~ 1e18 in float32) no longer overflow or underflow.
  """
  med = jnp.median(jnp.max(jnp.abs(X), axis=1))
  ok = jnp.isfinite(med) & (med > 0)
  return jnp.where(ok, jnp.exp2(jnp.round(jnp.log2(jnp.where(ok, med, 1.0)))), 1.0)


def _second_moment(X: jax.Array, w: jax.Array) -> jax.Array:
  S = (X * w[:, None]).T @ X / jnp.sum(w)
  return 0.5 * (S + S.T)


def _filter_loop(evaluate, n: int, init_estimate, score_threshold, stop_threshold, budget,
                 iterations: int):
  """The weighted filter shared by the mean and the covariance (fixed iteration count).

  ``evaluate(w) -> (estimate, λ, raw_scores)`` gives the estimate at weights w, the top
  eigenvalue of its certificate matrix and the rows' raw outlier scores. While ``λ`` exceeds
  ``stop_threshold``, scores above ``score_threshold`` are down-weighted by
  ``_capped_downweight``; the last of the ``iterations + 1`` passes only evaluates the final
  weights. Returns ``(estimate, FilterInfo)``.
  """
  def body(i, carry):
    w, steps, _, _ = carry
    estimate, lam, raw = evaluate(w)
    flag = (lam > stop_threshold) & (i < iterations)
    f = jnp.where(flag, jnp.maximum(raw - score_threshold, 0.0), 0.0)
    w, changed = _capped_downweight(w, f, budget)
    return w, steps + changed.astype(jnp.int32), estimate, lam

  dtype = init_estimate.dtype
  init = (jnp.ones(n, dtype), jnp.int32(0), init_estimate, jnp.zeros((), dtype))
  w, steps, estimate, lam = jax.lax.fori_loop(0, iterations + 1, body, init)
  return estimate, FilterInfo(weights=w, top_eigenvalue=lam, stop_threshold=stop_threshold,
                              certified=lam <= stop_threshold, steps=steps)


# ------------------------------------------------------------------------------------------------
# Robust mean.


def filtered_mean(X, *, corruption: float, iterations: int | None = None,
                  stop_constant: float = DEFAULT_STOP_CONSTANT,
                  score_threshold: float | None = None, return_info: bool = False):
  """Robust mean of an η-corrupted sample from ``N(μ, I_d)`` by iterative weighted filtering.

  NOT PRIVATE: the non-private ``Est`` of the robust private mean learner ([AL22] Algorithm 5).

  Usage::

      mu = dpjax.robust_stats.filtered_mean(X, corruption=0.1)            # (d,)
      mu, info = dpjax.robust_stats.filtered_mean(X, corruption=0.1, return_info=True)

  The weighted filter of [DK23, Ch. 2] ([DKKLMS16], [DKKLMS17]) with a fixed number of
  iterations, from weights 1: while the top eigenvalue λ of the weighted covariance exceeds the
  certificate ``λ_stop = (1 + sqrt(d/n))² + C η ln(1/η)``, down-weight the rows whose squared
  deviation along its eigenvector (from the weighted median) exceeds ``T = 2 ln(1/η)``, never
  removing more than ``2ηn`` of total weight; return the weighted mean. With ``corruption = 0``
  no row is down-weighted and the result is the empirical mean.

  Guarantee: for ``n = Ω̃(d/η²)`` Gaussian samples, a large enough constant C and enough
  iterations, ``‖μ̂ − μ‖ = O(η sqrt(ln(1/η)))`` w.h.p. ([DKKLMS16, DK23 Ch. 2], proved there for
  the uncapped rule; for the thresholded, capped rule here sketched, not proved). The defaults
  (C = 1, T, cap ½) are practical choices, not verified against the proof's constant: for them
  the rate is an empirical statement (measured errors 0.07–0.25 at d = 10, n = 2000, η = 0.1;
  its worst case, a cluster near distance ``sqrt(T)`` along one direction, is no better than
  the empirical mean).
  The loop must also reach the certificate (outliers spread over many directions take about one
  iteration each): check ``info.certified`` and raise ``iterations`` if it is False. Algorithm,
  argument and measurements: docs/algorithms.md §3.7.

  Args:
    X: ``(n, d)`` float32 or float64 rows (integers are converted to the default float dtype).
      The inliers must have identity covariance (whiten first, e.g. with
      :func:`filtered_covariance` on pair differences).
    corruption: η ∈ [0, 0.5), an upper bound on the fraction of corrupted rows.
    iterations: number of filter iterations (static; default ``2 d + 20``). Each costs
      ``O(n d² + d³ + n log n)``.
    stop_constant: C >= 0 of the certificate ``λ_stop`` (3: [DKKLMS17]'s more conservative
      ``1 + 3η ln(1/η)``, fewer false alarms, more residual outlier weight).
    score_threshold: T >= 0 (default ``2 ln(1/η)``; ``inf`` when η = 0).
    return_info: also return a :class:`FilterInfo` (static).

  Returns:
    ``(d,)`` estimate in X's dtype, or ``(estimate, FilterInfo)`` if ``return_info``.

  Raises:
    TypeError: non-numeric ``X``; non-real ``corruption``; non-integer ``iterations``.
    ValueError: ``X`` not 2-D, empty, or (outside ``jit``/``vmap``) with NaN/inf entries;
      ``corruption`` outside [0, 0.5); negative ``iterations``, ``stop_constant`` or
      ``score_threshold``.

  References: [DKKLMS16], [DKKLMS17], [DHL19], [DK23]; docs/algorithms.md §3.7 ([AL22] Algorithm 5).
  """
  X = _check_rows(X)
  eta = v.check_corruption(corruption)
  n, d = X.shape
  iterations = _check_iterations(iterations, 2 * d + 20)
  C = v.check_positive(stop_constant, "stop_constant", allow_zero=True)
  L = _log_inv(eta)
  T = _check_score_threshold(score_threshold, 2.0 * L)
  stop = (1.0 + math.sqrt(d / n)) ** 2 + (C * eta * L if eta > 0 else 0.0)
  return _run_filter(_filtered_mean_core, X, T, stop, eta, iterations, return_info)


@functools.partial(jax.jit, static_argnames=("iterations",))
def _filtered_mean_core(X, score_threshold, stop_threshold, budget, iterations):
  n, d = X.shape

  def evaluate(w):
    mu = (w @ X) / jnp.sum(w)
    Xc = X - mu
    lam, vec = _top_eigenpair(_second_moment(Xc, w))
    proj = Xc @ vec
    return mu, lam, (proj - _weighted_median(proj, w)) ** 2

  return _filter_loop(evaluate, n, jnp.zeros(d, X.dtype), score_threshold, stop_threshold,
                      budget, iterations)


# ------------------------------------------------------------------------------------------------
# Robust covariance.


def _svec_index(d: int):
  """Upper-triangle index pairs and the √2 scaling of the normalised symmetric basis."""
  rows, cols = np.triu_indices(d)
  diag = rows == cols
  scale = np.where(diag, 1.0, math.sqrt(2.0))
  return rows, cols, diag, scale


def filtered_covariance(X, *, corruption: float, iterations: int | None = None,
                        stop_constant: float = DEFAULT_STOP_CONSTANT,
                        score_threshold: float | None = None, return_info: bool = False):
  """Robust covariance of an η-corrupted sample from ``N(0, Σ)`` by filtering second moments.

  NOT PRIVATE: the non-private ``Est`` of the robust private covariance learner ([AL22]
  Algorithm 4).

  Usage::

      S = dpjax.robust_stats.filtered_covariance(X, corruption=0.1)       # (d, d)

  The covariance filter of [DKKLMS16] ([DK23, Ch. 4]) in weighted form, with a fixed number of
  iterations, from weights 1: whiten the rows by the weighted covariance ``Σ_w``, map each to
  ``y_i = svec(z_i z_iᵀ − I)`` (``D = d(d+1)/2`` coordinates), and while the top eigenvalue of
  their weighted second moment exceeds ``λ_stop = 2 (1 + sqrt(D/n))² + C η ln²(1/η)``
  down-weight the rows whose squared score along its eigenvector exceeds ``T = ln²(1/η)`` (as
  :func:`filtered_mean`, at most ``2ηn`` of total weight); return ``Σ_w``. It is symmetric PSD
  and affine equivariant (``filtered_covariance(X Bᵀ) = B filtered_covariance(X) Bᵀ`` up to
  rounding), so the accuracy does not depend on Σ's condition number. With ``corruption = 0`` the
  result is ``XᵀX / n``.

  Guarantee: [DKKLMS16] prove ``‖Σ^{-1/2} Σ̂ Σ^{-1/2} − I‖_F = O(η ln(1/η))`` w.h.p. from
  ``n = Ω̃(d²/η²)`` samples for their filter (hard removal), the estimator guarantee [AL22]
  Thm 6.3 plugs in; the weighted, capped form follows the same argument for a large enough C
  (sketched). With the defaults (C = 1, T, cap ½) the rate is an empirical statement: measured
  relative Frobenius errors 0.14–0.27 at d = 6, n = 2000, η = 0.1, but worse than the empirical
  covariance for outliers 2 standard deviations out, hidden by the corrupted whitening (0.52
  against 0.42), or at the origin (0.46 against 0.28), and ≈ 0.5 at η = 0.2. Algorithm,
  argument and measurements: docs/algorithms.md §3.7.

  Args:
    X: ``(n, d)`` float32 or float64 rows with mean zero (for unknown mean use pair differences
      ``(x_{2i} − x_{2i−1})/√2``). Σ should be non-singular; d up to about 20 (``D ≈ 200``).
    corruption: η ∈ [0, 0.5).
    iterations: number of filter iterations (static; default ``2 d + 20``). Each costs
      ``O(n D² + D³)``.
    stop_constant: C >= 0 of the certificate ``λ_stop``.
    score_threshold: T >= 0 (default ``ln²(1/η)``; ``inf`` when η = 0).
    return_info: also return a :class:`FilterInfo` (static).

  Returns:
    ``(d, d)`` symmetric PSD estimate in X's dtype, or ``(estimate, FilterInfo)``.

  Raises:
    TypeError: non-numeric ``X``; non-real ``corruption``; non-integer ``iterations``.
    ValueError: ``X`` not 2-D, with fewer than 2 rows, or (outside ``jit``/``vmap``) with NaN/inf
      entries; ``corruption`` outside [0, 0.5); negative ``iterations``, ``stop_constant`` or
      ``score_threshold``.

  References: [DKKLMS16], [DKKLMS17], [DK23]; docs/algorithms.md §3.7 ([AL22] Algorithm 4).
  """
  X = _check_rows(X, min_rows=2)
  eta = v.check_corruption(corruption)
  n, d = X.shape
  iterations = _check_iterations(iterations, 2 * d + 20)
  C = v.check_positive(stop_constant, "stop_constant", allow_zero=True)
  L = _log_inv(eta)
  T = _check_score_threshold(score_threshold, L ** 2)
  D = d * (d + 1) // 2
  stop = 2.0 * (1.0 + math.sqrt(D / n)) ** 2 + (C * eta * L ** 2 if eta > 0 else 0.0)
  return _run_filter(_filtered_covariance_core, X, T, stop, eta, iterations, return_info)


@functools.partial(jax.jit, static_argnames=("iterations",))
def _filtered_covariance_core(X, score_threshold, stop_threshold, budget, iterations):
  n, d = X.shape
  unit = _power_of_two_scale(X)
  X = X / unit
  rows, cols, diag, scale = _svec_index(d)
  diag = jnp.asarray(diag, X.dtype)
  scale = jnp.asarray(scale, X.dtype)

  def evaluate(w):
    S = _second_moment(X, w)
    Z = X @ _inverse_sqrt(S)
    Y = (Z[:, rows] * Z[:, cols] - diag) * scale          # (n, D) rows svec(z zᵀ − I)
    lam, a = _top_eigenpair(_second_moment(Y, w))
    p = Y @ a
    return S, lam, p * p

  S, info = _filter_loop(evaluate, n, jnp.zeros((d, d), X.dtype), score_threshold,
                         stop_threshold, budget, iterations)
  return S * unit**2, info


# ------------------------------------------------------------------------------------------------
# Simple stand-ins (do NOT achieve the filtering rates).


def coordinatewise_median(X) -> jax.Array:
  """Coordinate-wise median — a simple STAND-IN robust mean; does NOT achieve the filtering rate.

  For an η-corrupted sample from ``N(μ, I_d)`` each coordinate's median is off by ``Θ(η)`` in the
  worst case (plus ``O(1/sqrt(n))`` sampling error), so ``‖μ̂ − μ‖ = Θ(η sqrt(d))``: an adversary
  that shifts every coordinate at once gets a factor ``sqrt(d)`` more than against
  :func:`filtered_mean` (``O(η sqrt(ln(1/η)))``). Good enough for smoke tests of the robust
  learners' plumbing, not for their guarantees (docs/algorithms.md §3.7).

  Args:
    X: ``(n, d)`` float32 or float64 rows.

  Returns:
    ``(d,)`` medians in X's dtype (even n: the average of the two middle values).

  Raises:
    TypeError: non-numeric ``X``.
    ValueError: ``X`` not 2-D, empty, or (outside ``jit``/``vmap``) with NaN/inf entries.

  References:
    Diakonikolas, Kamath, Kane, Li, Moitra & Stewart, "Robust estimators in high dimensions
    without the computational intractability", FOCS 2016 (the filtering rate it does not reach);
    Ashtiani & Liaw, "Private and polynomial time algorithms for learning Gaussians and
    beyond", COLT 2022, §6–7.
  """
  X = _check_rows(X)
  dtype = X.dtype
  return jnp.median(X.astype(_work_dtype(dtype)), axis=0).astype(dtype)


def trimmed_covariance(X, *, corruption: float, iterations: int = 10) -> jax.Array:
  """Mahalanobis-trimmed second moment — a simple STAND-IN; does NOT achieve the filtering rate.

  For zero-mean rows: start from the robust diagonal estimate ``S_jj = median_i(x_ij²) /
  median(χ²_1)`` and repeat ``iterations`` times (the "concentration steps" of the MCD algorithm
  [RV99]): keep the ``h = n − ⌈ηn⌉`` rows with the smallest Mahalanobis norm ``x_iᵀ S^{-1} x_i``
  and set ``S`` to their second moment; then divide by the Gaussian consistency factor
  ``c = F_{d+2}(q) / (h/n)``, ``q = F_d^{-1}(h/n)`` (``F_k`` the χ²_k CDF; it undoes the shrinkage
  that trimming a clean sample causes). Finally reweight as in MCD: return the second moment of
  all rows inside the 97.5% χ²_d ellipsoid of that estimate, divided by its own consistency
  factor ``F_{d+2}(F_d^{-1}(0.975)) / 0.975``. With η = 0 nothing is trimmed and the result is
  ``XᵀX / n``.

  Removes gross outliers (far clusters: relative Frobenius error 0.16 at d = 6, n = 2000,
  η = 0.1, Σ of condition number 100, vs 60 for the empirical covariance). Outliers along Σ's
  smallest eigenvector — small in norm, so they look typical to the diagonal start, and then
  inflate ``S`` enough to stay inside its ellipsoid — survive the trimming: at ± 3 and ± 6
  standard deviations the error is 0.96 and 3.8, worse than the empirical covariance's 0.85 and
  3.5 (:func:`filtered_covariance`: 0.27 and 0.15). There is no ``O(η ln(1/η))`` guarantee, and
  the diagonal start makes the estimator not affine equivariant.

  Args:
    X: ``(n, d)`` float32 or float64 rows with mean zero.
    corruption: η ∈ [0, 0.5), the fraction of rows to trim.
    iterations: concentration steps (static, >= 0).

  Returns:
    ``(d, d)`` symmetric PSD estimate in X's dtype.

  Raises:
    TypeError: non-numeric ``X``; non-real ``corruption``; non-integer ``iterations``.
    ValueError: ``X`` not 2-D, with fewer than 2 rows, or (outside ``jit``/``vmap``) with NaN/inf
      entries; ``corruption`` outside [0, 0.5); negative ``iterations``.
  """
  X = _check_rows(X, min_rows=2)
  eta = v.check_corruption(corruption)
  iterations = v.check_int(iterations, "iterations", low=0)
  n, d = X.shape
  keep = n - math.ceil(eta * n - 1e-9)
  frac = keep / n
  consistency = 1.0 if keep == n else float(stats.chi2.cdf(stats.chi2.ppf(frac, d), d + 2) / frac)
  dtype = X.dtype
  wd = _work_dtype(dtype)
  radius = float(stats.chi2.ppf(_REWEIGHT_QUANTILE, d))
  reweight_consistency = float(stats.chi2.cdf(radius, d + 2) / _REWEIGHT_QUANTILE)
  S = _trimmed_core(X.astype(wd), jnp.asarray(consistency, wd), jnp.asarray(radius, wd),
                    jnp.asarray(reweight_consistency, wd), keep, iterations)
  return linalg.symmetrize(S.astype(dtype))


@functools.partial(jax.jit, static_argnames=("keep", "iterations"))
def _trimmed_core(X, consistency, reweight_radius, reweight_consistency, keep, iterations):
  n, _ = X.shape
  unit = _power_of_two_scale(X)
  X = X / unit
  if keep == n:                                             # η = 0: nothing to trim
    return _second_moment(X, jnp.ones(n, X.dtype)) * unit**2

  def body(_, S):
    Z = X @ _inverse_sqrt(S)
    dist = jnp.sum(Z * Z, axis=1)
    ranks = jnp.argsort(jnp.argsort(dist))                  # stable: ties keep row order
    return _second_moment(X, (ranks < keep).astype(X.dtype))

  # Robust diagonal start: per-coordinate scale median(x_j²) / med(χ²_1); median(χ²_1) ≈ 0.45494.
  S0 = jnp.diag(jnp.median(X * X, axis=0) / _MEDIAN_CHI2_1)
  S = jax.lax.fori_loop(0, iterations, body, S0) / consistency
  # Reweighting step: keep every row inside the 97.5% χ²_d ellipsoid of the corrected estimate.
  Z = X @ _inverse_sqrt(S)
  inside = (jnp.sum(Z * Z, axis=1) <= reweight_radius).astype(X.dtype)
  return _second_moment(X, inside) * (unit**2 / reweight_consistency)
