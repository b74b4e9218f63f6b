"""PPME — the Private Populous Mean Estimator ([AL22] Algorithm 1, Lemma 3.6; docs/algorithms.md §3.2).

Split the rows into k groups, run a non-private estimator on each (one ``vmap``), count for every
candidate the fraction ``q_i`` of candidates within distance r of it, test privately that the
average fraction ``Q`` is high, average the candidates with weights that ramp linearly from 0 at
``q = a`` to 1 at ``q = b``, and release a masked version of the average:

    Q̂ = Q + TLap(2/k, ε1, δ1);   ⊥ unless Q̂ > c0 + A1
    w̃_i = clip((q_i − a)/(b − a), 0, 1),   Ŷ = Σ w̃_i Y_i / Σ w̃_i,   output M(Ŷ)

Privacy [DERIVED for the thresholds; checked while implementing]. Under replace-one (one row
changes one group, the partition of rows into groups being public): Q moves by ≤ 2(k−1)/k² < 2/k,
so the test is (ε1, δ1)-DP and fails surely unless Q > c0 on one side (call it X; the changed
group is 1). Then, with the constraints ``(a + b − 1)k ≥ 2``, ``c0 > b``, ``k(c0 − b)/(1 − b) ≥ 1``,
``c0 − 2/k > a``:
(1) the ramp dominates ``(q − a)/(1 − a)``, so both weight sums exceed
``W_min = k(c0 − 2/k − a)/(1 − a)``; (2) more than one group has ``q ≥ b`` on X, so an unchanged
reference group c has ``q_c ≥ b − 1/k`` on both; (3) every group with positive weight shares a
neighbour with c (``N_i + N_c > (a + b − 1)k − 1 ≥ 1``), so it lies within two hops of ``Y_c``;
(4) two hops mean ``‖Y_i − Y_c‖ ≤ 2r`` (Euclidean) or ``(1+r)^{-2} ⪯ Z_i ⪯ (1+r)²`` for
``Z_i = Y_c^{-1/2} Y_i Y_c^{-1/2}`` (covariance), hence ``‖Z_i − c*I‖ ≤ h`` with c* and h the
midpoint and half-width of ``[(1+r)^{-2}, (1+r)²]``. (5) Since both weight vectors sum to 1,
``Ẑ − Ẑ' = Σ_{i≠1}(w_i − w'_i)(Z_i − c*I) + w_1(Z_1 − c*I) − w'_1(Z'_1 − c*I)`` (likewise with
``Y_i − Y_c``), so the averages differ by at most (2r or h)·T, ``T = Σ_{i≠1}|w_i − w'_i| + w_1 +
w'_1``. With ``D₋₁ = Σ_{i≠1}|w̃_i − w̃'_i|``: ``Σ_{i≠1}|w_i − w'_i| ≤ (D₋₁ + |W − W'|)/W``,
``|W − W'| ≤ D₋₁ + |w̃_1 − w̃'_1|`` and ``w_1 + w'_1 ≤ (w̃_1 + w̃'_1)/W_min``, so
``T ≤ (2D₋₁ + 2 max(w̃_1, w̃'_1))/W_min ≤ (2 + 2D₋₁)/W_min``. (6) A group i ≠ 1 changes weight only
if ``min(q_i, q'_i) < b``, so ``q_i(X) < b + 1/k``; as ``Σ_i (1 − q_i(X)) = k(1 − Q) < k(1 − c0)``,
fewer than ``k(1 − c0)/(1 − b − 1/k)`` groups do (when ``1 − b − 1/k > 0``; at most k − 1 anyway),
each by at most ``1/(k(b − a))``: ``D₋₁ ≤ min((k − 1)/k, (1 − c0)/(1 − b − 1/k))/(b − a)``.
(7) Covariance: Ẑ and Ẑ' are convex combinations of matrices ``⪰ (1+r)^{-2}I``, and
``dist(A, B) ≤ ‖B − A‖/min(λ_min(A), λ_min(B))``, so ``dist(Ŷ, Ŷ') = dist(Ẑ, Ẑ') ≤ (1+r)²·h·T``
with ``(1+r)²h = ((1+r)⁴ − 1)/2``. Hence the sensitivity handed to the masking mechanism is

    γ = (2 + 2·D₋₁max)·ρ/W_min,   ρ = 2r (Euclidean) or ((1+r)⁴ − 1)/2 (covariance),

7ρ/W_min for the default thresholds and large k, and PPME is (ε1 + ε2, δ1 + δ2)-DP when the mask
is a (γ, ε2, δ2)-masking mechanism. The earlier argument of docs/algorithms.md §3.2 (no centring,
``1 − ρ`` for λ_min, the cruder weight algebra, D < 1 + 1/(b − a)) gave ``(4 + 2/(b − a))·ρ/W_min``
and, for covariances, ``ρ = 2r + r²`` divided by ``1 − ρ`` (so r < 0.414): 3.6× larger at the
defaults (``sensitivity_bound="spec"`` keeps it). Where the predicate is evaluated in floating
point the radius used for γ is ``r(1 + radius_margin)`` (``semimetric.py``).

Floating point (docs/algorithms.md §1.10). The test releases one bit, ``Q + Z > c0 + A1``, with Z drawn
in float64 by inverse CDF from a 52-bit uniform: no float value is released, and the bit's
probabilities are those of the analysis up to 2^-52 per draw, far below δ. The Euclidean mask of
:func:`ppme_mean` is float-safe by default (an exact discrete Gaussian on a public grid); the
covariance mask is not (``masking.py`` says why and what it does not cover).

The module is generic over the non-private estimator, the neighbour-count function (semimetric)
and the mask; :func:`ppme_mean` is the Euclidean instance with Gaussian masking (§3.7's
robust-mean form when the estimator is robust); ``covariance.py`` holds the covariance instance.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import linalg
from dpjax._core.noise import truncated_laplace_sample
from dpjax._host import float64
from dpjax.ashtiani_liaw import semimetric
from dpjax.results import EstimateResult
from dpjax.mechanisms.gaussian import (analytic_gaussian_sigma, discretized_gaussian_mechanism,
                                       rdp_gaussian_sigma)
from dpjax.mechanisms.grid import discretization
from dpjax.mechanisms.truncated_laplace import truncated_laplace_params, truncated_laplace_survival
from dpjax.ledger import with_ledger

__all__ = ["PPMECalibration", "PopulousThresholds", "min_groups_for_test", "ppme_calibration",
           "ppme_mean"]

DEFAULT_RADIUS_MARGIN = 1e-2


class PopulousThresholds(NamedTuple):
  """PPME's thresholds [PROPOSED defaults, docs/algorithms.md §3.2]: weight ramp ``a → b``, test ``c0``.

  References:
    Ashtiani & Liaw, "Private and polynomial time algorithms for learning Gaussians and
    beyond", COLT 2022, Algorithm 1 (PPME), Lemma 3.6; docs/algorithms.md §3.2.
  """
  a: float = 0.6
  b: float = 0.8
  c0: float = 0.9


class PPMECalibration(NamedTuple):
  """Public constants of one PPME run.

  Attributes:
    num_groups: k.
    test_scale, test_bound: ``TLap(2/k, ε1, δ1)``'s scale λ and bound A1.
    pass_level: the test passes iff ``Q̂ > pass_level = c0 + A1``.
    weight_floor: ``W_min``.
    rho: the two-hop spread ρ of the sensitivity bound (module docstring): 2r (Euclidean);
      ``((1+r)⁴ − 1)/2`` (covariance), or with ``sensitivity_bound="spec"`` ``2r + r²``.
    mask_sensitivity: γ, the distance the masking mechanism must hide.
  """
  num_groups: int
  test_scale: float
  test_bound: float
  pass_level: float
  weight_floor: float
  rho: float
  mask_sensitivity: float


def check_thresholds(thresholds: PopulousThresholds, num_groups: int) -> PopulousThresholds:
  """Checks the constraints PPME's privacy proof needs; raises ``ValueError`` naming the one broken.

  ``0 ≤ a < b < c0 < 1``, ``(a + b − 1)k ≥ 2``, ``k(c0 − b)/(1 − b) ≥ 1``, ``c0 − 2/k > a``.
  """
  a, b, c0 = (float(x) for x in thresholds)
  k = v.check_int(num_groups, "num_groups", low=2)
  if not 0.0 <= a < b < c0 < 1.0:
    raise ValueError(f"PPME thresholds need 0 <= a < b < c0 < 1, got a={a}, b={b}, c0={c0}.")
  if (a + b - 1.0) * k < 2.0:
    raise ValueError(f"PPME needs (a + b - 1)·num_groups >= 2, got ({a} + {b} - 1)·{k}; use more "
                     "groups or larger thresholds.")
  if k * (c0 - b) / (1.0 - b) < 1.0:
    raise ValueError(f"PPME needs num_groups·(c0 - b)/(1 - b) >= 1, got {k}·({c0} - {b})/(1 - {b}).")
  if c0 - 2.0 / k <= a:
    raise ValueError(f"PPME needs c0 - 2/num_groups > a, got {c0} - 2/{k} <= {a}.")
  return PopulousThresholds(a, b, c0)


PPME_SENSITIVITY_BOUNDS = ("tight", "spec")


def ppme_calibration(num_groups: int, radius: float, epsilon_test: float, delta_test: float, *,
                     space: str, thresholds: PopulousThresholds = PopulousThresholds(),
                     radius_margin: float = DEFAULT_RADIUS_MARGIN,
                     sensitivity_bound: str = "tight") -> PPMECalibration:
  """The test constants and the masking sensitivity γ of PPME (module docstring; all public).

  Args:
    num_groups: k.
    radius: closeness radius r > 0 (covariance with ``sensitivity_bound="spec"``: ``2r + r² < 1``).
    epsilon_test, delta_test: the budget of the test (ε1, δ1).
    space: ``"euclidean"`` or ``"covariance"``.
    thresholds: :class:`PopulousThresholds`.
    radius_margin: relative slack for floating-point predicates (γ uses ``r(1 + margin)``).
    sensitivity_bound: ``"tight"`` (default: ``γ = (2 + 2·D₋₁max)·ρ/W_min``, module docstring
      steps 4–7) or ``"spec"`` (the earlier ``(4 + 2/(b − a))·ρ/W_min``, covariance
      ``ρ = 2r + r²`` over ``1 − ρ``; 3.6× larger at the defaults).

  Returns:
    :class:`PPMECalibration`.

  Raises:
    ValueError: broken threshold constraints, bad budget, an unknown ``sensitivity_bound``, or
      ``2r + r² ≥ 1`` (covariance with ``"spec"``).
  """
  a, b, c0 = check_thresholds(thresholds, num_groups)
  radius = v.check_positive(radius, "radius")
  v.check_choice(space, "space", ("euclidean", "covariance"))
  v.check_choice(sensitivity_bound, "sensitivity_bound", PPME_SENSITIVITY_BOUNDS)
  margin = v.check_positive(radius_margin, "radius_margin", allow_zero=True)
  k = num_groups
  tlap = truncated_laplace_params(2.0 / k, epsilon_test, delta_test)
  w_min = k * (c0 - 2.0 / k - a) / (1.0 - a)
  r = radius * (1.0 + margin)
  if sensitivity_bound == "spec":
    factor = 4.0 + 2.0 / (b - a)                      # 2 + 2D with D < 1 + 1/(b − a)
    if space == "euclidean":
      rho = 2.0 * r
      gamma = factor * rho / w_min
    else:
      rho = 2.0 * r + r * r
      if rho >= 1.0:
        raise ValueError(f"covariance PPME with sensitivity_bound='spec' needs 2r + r² < 1 "
                         f"(r < 0.414), got radius={radius}.")
      gamma = factor * rho / ((1.0 - rho) * w_min)
  else:
    # Step 6: fewer than k(1 − c0)/(1 − b − 1/k) unchanged groups can change weight.
    share = (k - 1.0) / k
    if 1.0 - b - 1.0 / k > 0.0:
      share = min(share, (1.0 - c0) / (1.0 - b - 1.0 / k))
    factor = 2.0 + 2.0 * share / (b - a)
    rho = 2.0 * r if space == "euclidean" else ((1.0 + r) ** 4 - 1.0) / 2.0
    gamma = factor * rho / w_min
  return PPMECalibration(k, tlap.scale, tlap.bound, c0 + tlap.bound, w_min, rho, gamma)


def min_groups_for_test(epsilon_test: float, delta_test: float,
                        thresholds: PopulousThresholds = PopulousThresholds()) -> int:
  """Smallest k with ``A1 ≤ (1 − c0)/2`` (utility: the test then passes surely when all
  candidates agree, [AL22] Lemma 3.6 with our constants): ``k ≥ 4 ln(1 + (e^{ε1}−1)/(2δ1))/((1 − c0)ε1)``.
  """
  epsilon_test = v.check_epsilon(epsilon_test, "epsilon_test")
  delta_test = v.check_delta(delta_test, "delta_test")
  unit = truncated_laplace_params(1.0, epsilon_test, delta_test).bound      # A for Δ = 1
  k = max(2, math.ceil(2.0 * unit * 2.0 / (1.0 - thresholds.c0) - 1e-9))
  while True:
    try:
      check_thresholds(thresholds, k)
      return k
    except ValueError:
      k += 1


def check_test_can_pass(num_groups: int, epsilon_test: float, delta_test: float,
                        thresholds: PopulousThresholds = PopulousThresholds(), *,
                        learner: str = "PPME") -> float:
  """Refuses or warns when PPME's test answers ⊥ from public parameters alone; returns the
  best-case pass probability.

  Q ≤ 1, so even unanimous groups pass only when the test noise ``Z ~ TLap(2/k, ε1, δ1)``
  exceeds ``A1 − (1 − c0)``. If that probability is ≤ δ1 (``k ≤ 2/(1 − c0)``) ⊥ is certain up to
  δ1: ``ValueError``. Below :func:`min_groups_for_test` the test can fail even when all groups
  agree: :class:`dpjax.UnderpoweredWarning` with the probability. Public numbers only: privacy is unchanged.

  Raises:
    ValueError: the best-case pass probability is ≤ δ1, or bad thresholds.
  """
  k = v.check_int(num_groups, "num_groups", low=2)
  c0 = check_thresholds(thresholds, k).c0
  test_noise = truncated_laplace_params(2.0 / k, epsilon_test, delta_test)
  best = truncated_laplace_survival(test_noise.bound - (1.0 - c0), test_noise.scale,
                                    test_noise.bound)
  recommended = min_groups_for_test(epsilon_test, delta_test, thresholds)
  needs = (f"min_groups_for_test(epsilon_test={epsilon_test:g}, delta_test={delta_test:g}) = "
           f"{recommended}")
  v.check_test_can_pass(
      best, delta_test, sure=k >= recommended,
      refusal=(f"{learner} would answer ⊥ (almost) surely: with num_groups={k} even unanimous "
               f"groups pass the test with probability {best:.3g} <= delta_test="
               f"{delta_test:g}; it needs num_groups > 2/(1 - c0) = {2.0 / (1.0 - c0):g} and "
               f"{needs} for a sure pass."),
      warning=(f"{learner}: with num_groups={k} < {needs}, the test passes with probability at "
               f"most {v.probability_text(best)} even when all groups agree (⊥ otherwise); use "
               f"num_groups >= {recommended} for a sure pass."))
  return best


def populous_mean(key: jax.Array, groups: jax.Array, *, estimator: Callable,
                  neighbour_counts: Callable, mask: Callable, calibration: PPMECalibration,
                  thresholds: PopulousThresholds, placeholder: jax.Array,
                  vectorize: bool = True):
  """Traceable generic PPME on rows already split into groups (no validation).

  Args:
    key: PRNG key.
    groups: ``(k, m, d)`` rows, one group per leading index.
    estimator: ``(m, d) -> Y`` (non-private; batched with one ``vmap``).
    neighbour_counts: ``(k, ...) -> (k,)`` int counts ``N_i`` (j = i included) under the
      semimetric's predicate.
    mask: ``(key, Ŷ) -> M(Ŷ)``, a (γ, ε2, δ2)-masking mechanism for ``calibration.mask_sensitivity``.
    calibration: :func:`ppme_calibration`.
    thresholds: the same :class:`PopulousThresholds` as the calibration.
    placeholder: a valid input for ``mask`` used on ⊥ (the output is then replaced by zeros).
    vectorize: batch the estimator with one ``vmap`` (direct computations such as means and
      second moments: each candidate's floats depend on its own group only). Pass False for
      estimators with data-dependent iterations (eigensolvers, filters): a batched iterative
      solver may run until every batch member converges, which would let one group's rows move
      another group's candidate at rounding level; :func:`dpjax.linalg.map_blocks` batches them
      only on backends where block independence is verified (``tests/test_batching.py``).

  Returns:
    ``(ok, estimate)``: a bool scalar and ``M(Ŷ)`` (zeros of the same shape on ⊥).
  """
  k = groups.shape[0]
  candidates = jax.vmap(estimator)(groups) if vectorize else linalg.map_blocks(estimator, groups)
  q = neighbour_counts(candidates).astype(candidates.dtype) / k
  k_test, k_mask = jax.random.split(key)
  noise = truncated_laplace_sample(k_test, (), calibration.test_scale, calibration.test_bound,
                                   candidates.dtype)
  ok = jnp.mean(q) + noise > calibration.pass_level
  weights = jnp.clip((q - thresholds.a) / (thresholds.b - thresholds.a), 0.0, 1.0)
  total = jnp.sum(weights)
  weights = weights / jnp.where(total > 0, total, 1.0)
  # A candidate of weight 0 must not enter the sum at all: 0·inf = NaN, so an overflowed
  # candidate (one replaced row can make a group's estimate inf) would otherwise turn a finite
  # release into NaN. Positive-weight candidates are neighbours of others, hence finite.
  used = (weights > 0).reshape((k,) + (1,) * (candidates.ndim - 1))
  average = jnp.tensordot(weights, jnp.where(used, candidates, 0.0), axes=1)
  released = mask(k_mask, jnp.where(ok, average, placeholder))
  return ok, jnp.where(ok, released, jnp.zeros_like(released))


def split_groups(key: jax.Array, X: jax.Array, num_groups: int) -> jax.Array:
  """Rows into ``(k, ⌊n/k⌋, d)`` groups by a public uniformly random permutation.

  Replace-one keeps ``n`` fixed, so the permutation (public randomness) sends the replaced row to
  exactly one group; the ``n mod k`` rows left over are dropped.
  """
  n, d = X.shape
  m = n // num_groups
  perm = jax.random.permutation(key, n)[: num_groups * m]
  return X[perm].reshape(num_groups, m, d)


@with_ledger
def ppme_mean(key: jax.Array, X, *, epsilon: float, delta: float, num_groups: int,
              radius: float, estimator: Callable | None = None, test_fraction: float = 0.25,
              thresholds: PopulousThresholds = PopulousThresholds(),
              radius_margin: float = DEFAULT_RADIUS_MARGIN, secure: bool = True,
              magnitude: float | None = None) -> EstimateResult:
  """Private mean with PPME in ℓ2 and Gaussian masking ([AL22] Algorithm 1; §3.7 Lemma 7.2).

  Usage::

      res = dpjax.ashtiani_liaw.ppme_mean(jax.random.key(0), X, epsilon=1.0, delta=1e-6,
                                          num_groups=2010, radius=4.0)  # X (20000, 5)
      res.ok, res.estimate          # False on ⊥; (d,) float64

  Each of the k groups of a public random partition gives ``Est(group) ∈ R^d`` (default the
  mean; a robust estimator, e.g. ``dpjax.robust_stats.filtered_mean``, gives the robust
  variant); a private test checks that most candidates lie within ``radius`` of each other (else
  ⊥), and their weighted average is masked. The mean is unbounded: no clipping bound on the data
  is needed, only that radius. Guarantee: (ε, δ)-DP under replace-one: ε1 = ``test_fraction``·ε
  and δ1 = δ/2 for the test, the rest for the Gaussian mask, a (γ, ε2, δ2)-masking mechanism for
  ``γ = (2 + 2·D₋₁max)·2r/W_min`` (the tight bound of :func:`ppme_calibration`, module
  docstring): by default the float-safe release of
  :func:`dpjax.mechanisms.discretized_gaussian_mechanism`; ``secure=False``: continuous noise
  with the analytic σ (less noise, but the low-order-bit leak of docs/algorithms.md §1.10).
  Utility ([AL22] Lemma 3.6), proofs and constants: docs/algorithms.md §3.2, §3.7.

  Args:
    key: PRNG key.
    X: ``(n, d)`` float rows (individuals); ``n ≥ 2·num_groups``.
    epsilon, delta: the budget (δ < 1).
    num_groups: k (public), satisfying the :class:`PopulousThresholds` constraints.
    radius: closeness radius r > 0 (public, in X's units).
    estimator: ``(m, d) -> (d,)`` non-private estimator, jittable (default: the mean).
    test_fraction: share of ε spent on the test.
    thresholds: ``(a, b, c0)``.
    radius_margin: slack on r for the float predicate.
    secure: float-safe discretized Gaussian mask (default) or raw continuous noise.
    magnitude: optional public bound on the mean's entries. The float-safe release clamps each
      entry to about ``2^40 γ/√d``: a mean beyond it saturates there, a silent error;
      ``magnitude`` coarsens the grid so that the clamp covers it (§3.2). Unused with
      ``secure=False``.

  Returns:
    :class:`~dpjax.results.EstimateResult` (neighboring ``REPLACE_ONE``): ``estimate (d,)``,
    float64 NumPy eagerly (JAX's x64 mode whatever the global flag: means of 1e6 keep their
    digits; secure: multiples of ``info["grid"]``); ``info``: k, m, r, γ, σ (the mask's std), the
    grid. Traceable in ``key`` and ``X`` inside ``with jax.enable_x64(True):`` (the secure mask
    as its mechanism's own NumPy host callback: the eager call's test bit per key, its estimate
    up to rounding of the unmasked average); a non-finite traced ``X`` gives ⊥.

  Raises:
    TypeError: traced with JAX's x64 mode off (call it eagerly, or trace inside
      ``jax.enable_x64(True)``).
    TypeError/ValueError: bad key or data (NaN/inf in a concrete X), ε ≤ 0, δ ∉ (0, 1), broken
      threshold constraints, fewer than 2 rows per group, or ``num_groups`` so small that even
      unanimous groups pass the test with probability ≤ δ1 (``num_groups ≤ 2/(1 − c0)``: ⊥
      would be certain).

  Warns:
    UnderpoweredWarning: ``num_groups < min_groups_for_test(ε1, δ1)``: the test can fail even
      when all groups agree; the message gives the largest pass probability and the
      recommended k.

  References:
    [AL22] Algorithm 1, Lemma 3.6, Lemma 7.2, Algorithm 5; docs/algorithms.md §3.2, §3.7.
  """
  key = v.check_key(key)
  X = v.check_data64(X, "X")
  epsilon, delta = v.check_epsilon(epsilon), v.check_delta(delta)
  n, d = X.shape
  k = v.check_int(num_groups, "num_groups", low=2)
  if n // k < 2:
    raise ValueError(f"ppme_mean needs at least 2 rows per group: n={n} < 2·num_groups={2 * k}.")
  frac = v.check_probability(test_fraction, "test_fraction", open_high=True)
  eps1, eps2, delta1, delta2 = epsilon * frac, epsilon * (1 - frac), delta / 2, delta / 2
  check_test_can_pass(k, eps1, delta1, thresholds, learner="ppme_mean")
  cal = ppme_calibration(k, radius, eps1, delta1, space="euclidean", thresholds=thresholds,
                         radius_margin=radius_margin)
  vectorize = estimator is None                 # a user estimator may iterate: one group at a time
  estimator = _group_mean if estimator is None else estimator
  r = float(radius)
  info = {"num_groups": k, "group_size": n // k, "radius": r,
          "mask_sensitivity": cal.mask_sensitivity,
          "pass_level": cal.pass_level, "secure": bool(secure)}
  if secure:
    # The jitted program returns the test bit and the UNMASKED average (never released: only
    # its masked version leaves this function); the mask is the discretized Gaussian release.
    z = rdp_gaussian_sigma(eps2, delta2)
    mask_sensitivity = cal.mask_sensitivity
    if magnitude is not None:
      # Δ = 2^-39·√d·M: the grid 2^⌊log2(Δ/(2^10 √d))⌋ ≥ 2^-50·M, so the clamp 2^50 Λ ≥ M.
      mask_sensitivity = max(mask_sensitivity, 2.0 ** -39 * math.sqrt(d)
                             * v.check_positive(magnitude, "magnitude"))
    grid = discretization(mask_sensitivity, d)
    mask_sigma = z * grid.grid_sensitivity * grid.grid
    info.update(sigma=mask_sigma, grid=grid.grid)
  else:
    mask_sigma = analytic_gaussian_sigma(eps2, delta2, cal.mask_sensitivity)
    info.update(sigma=mask_sigma)
  run = functools.partial(_ppme_mean_run, k=k, estimator=estimator, vectorize=vectorize,
                          mask=not secure)
  thresholds = check_thresholds(thresholds, k)

  def release(key, X):
    # A non-finite X (reachable only traced: a concrete X is validated) lies outside the domain
    # and gives ⊥; it is zeroed first (a fixed map) so that no estimator iterates on NaN.
    k_run, k_mask = jax.random.split(key)
    ok, estimate = run(k_run, jnp.where(v.all_finite(X), X, 0.0), r, mask_sigma, cal,
                       thresholds)
    if secure:
      # ok is the DP test's output, so discarding the mask's release on ⊥ is post-processing:
      # the host draw (the mechanism's own callback when traced) happens either way.
      estimate = discretized_gaussian_mechanism(k_mask, estimate, sensitivity=mask_sensitivity,
                                                noise_multiplier=z)
    return v.domain_bottom(X, ok, estimate)

  ok, estimate = float64("ppme_mean", release, key, X)
  return EstimateResult(ok=jnp.asarray(ok), estimate=estimate, epsilon=epsilon, delta=delta,
                        neighboring=NeighboringRelation.REPLACE_ONE, info=info)


def _group_mean(rows):
  return jnp.mean(rows, axis=0)


@functools.partial(jax.jit, static_argnames=("k", "estimator", "vectorize", "mask"))
def _ppme_mean_run(key, X, radius, sigma, calibration, thresholds, *, k, estimator, vectorize,
                   mask):
  """ppme_mean's jitted body. The public scalars (radius, σ, the calibration and thresholds)
  are traced, so an ε or radius sweep compiles once. ``mask=False``: the unmasked average
  (never released: the caller masks it with the discretized Gaussian)."""
  k_split, k_run = jax.random.split(key)
  groups = split_groups(k_split, X, k)
  if mask:
    add_mask = lambda k_mask, y: y + sigma * jax.random.normal(k_mask, y.shape, y.dtype)  # noqa
  else:
    add_mask = lambda k_mask, y: y                                   # noqa: E731
  return populous_mean(
      k_run, groups, estimator=estimator,
      neighbour_counts=lambda Y: semimetric.euclidean_neighbour_counts(Y, radius),
      mask=add_mask,
      calibration=calibration, thresholds=thresholds,
      placeholder=jnp.zeros((X.shape[1],), X.dtype), vectorize=vectorize)
