"""Public calibration of the Ashtiani–Liaw covariance learner ([AL22] Thm 5.4; docs/algorithms.md §3.5).

Everything here is a function of public quantities (d, ε, δ and the options): the number of
groups, the group size, the mask's η and the rows the learner needs. [PROPOSED] end-to-end
calibration (:func:`covariance_calibration`):

1. ε1 = 0.3ε for the test, ε2 = 0.7ε for the mask, δ1 = δ2 = δ/2; r = 0.7; (a, b, c0) =
   (0.3, 0.75, 0.9) (:data:`COVARIANCE_THRESHOLDS`). Any split and any thresholds meeting
   :func:`~dpjax.ashtiani_liaw.check_thresholds` are private (the proofs hold for each; r > 0.414
   needs PPME's tight sensitivity bound). These minimise the rows on a grid (r ∈ {0.4, 0.55,
   0.7, 0.85, 1}, ε1/ε ∈ {0.3, 0.4}, five threshold triples; d = 5, ε = 1; issue 16, research
   note al-sample-complexity.md §2.3–2.4); the spec's ε/4, r = 1/4, (0.6, 0.8, 0.9) ask 2–5×
   more. A lower c0 lowers the neighbour-fraction target (smaller groups); a lower a and a wider
   ramp b − a lower PPME's sensitivity; a larger r needs smaller groups (m ∝ 1/r²) but raises
   PPME's sensitivity like ((1+r)⁴ − 1)/2.
2. The smallest number of groups k for which, with ``γ = γ_PPME(k)``: the thresholds' constraints
   hold, ``γ ≤ ½``, ``C_0(γ) < ε2``, η_min(γ) (the smallest private η of
   :func:`~dpjax.ashtiani_liaw.calibrate_masking`, exact Rényi accounting by default) is at most
   the accuracy cap's η, and step 3's pass target is below 1 (with a user ``min_group_size`` or
   the concentration rule, k ≥ :func:`~dpjax.ashtiani_liaw.min_groups_for_test` instead: a
   sure pass). η = η_min(γ). The cap ``eta_accuracy`` (default 0.2) promises
   ``α = masking_concentration(d, cap/(2√d + √(2 ln(1/β))), β)`` (0.56: the mask moves its input
   by at most that distance w.p. 1 − β); ``mask_accuracy_rule="simulation"`` (default, PROPOSED)
   lets η go up to the η whose simulated (1 − β)-quantile of the mask's distance is that α
   (:func:`~dpjax.ashtiani_liaw.simulated_masking_eta`; about 2× the bound's η, hence about half
   the groups), ``"bound"`` keeps the bound's η. With the simulation rule of step 3, k is then
   raised (on a 2^{1/4} grid, up to 16×) while that lowers ``k·m``: near the smallest admissible
   k the pass target nears 1 and m explodes.
3. A group size m. ``group_size_rule="concentration"`` (the spec's rule): ``√(d/m) +
   √(2 ln(2k/β)/m) ≤ r''/3``, ``r'' = r/(2 + r)``, so every group's empirical covariance is within
   r'' of Σ w.p. 1 − β (Gaussian singular-value bounds), all pairs are r-close and the test passes
   surely. It is a sufficient condition and very conservative (≈ 4·10⁴ rows per group at d = 5).
   ``group_size_rule="simulation"`` (default, PROPOSED): the smallest m (a 2^{1/4} grid, then
   bisection) at which the mean neighbour fraction of candidates simulated from N(0, I_d) reaches
   the pass target ``c0 + A1 + min(A1, λ ln(1/(2β))) + 0.02`` (λ, A1 the test's TLap scale and
   bound): at a fraction Q ≥ target − 0.02 the test ``Q̂ > c0 + A1`` fails w.p. ≤ β (the TLap
   tail is at most the Laplace tail ½e^{−t/λ}), and surely passes where the slack is A1. By affine
   invariance the law of the whitened candidates, hence of every pairwise predicate, is the same
   for every Σ, so the simulation is exact in distribution for Gaussian data; it uses only public
   quantities and a fixed public seed. About 40·d rows per group at the defaults.

:func:`required_n` reports the n these rules ask for, and the learner raises instead of running
underpowered. Step 2's accuracy cap and step 3 are about utility only: privacy needs just the
constraints on (a, b, c0, k), ``γ ≤ ½`` and ``η ≥ η_min(γ)``, so a user may pass ``num_groups``
and ``min_group_size`` to trade accuracy for rows.
"""

from __future__ import annotations

import functools
import math
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dpjax import _validation as v
from dpjax.ashtiani_liaw import masking, semimetric
from dpjax.ashtiani_liaw.populous_mean import (DEFAULT_RADIUS_MARGIN, PopulousThresholds,
                                               check_test_can_pass, check_thresholds,
                                               min_groups_for_test, ppme_calibration)

__all__ = ["CovarianceCalibration", "SPEC_CHOICES", "covariance_calibration", "required_n"]

# [PROPOSED] covariance-learner defaults (module docstring, step 1): PPME's thresholds, the
# closeness radius and the test's share of ε. PPME's own defaults (PopulousThresholds(), ε/4)
# stay those of the spec for the Euclidean mean.
COVARIANCE_THRESHOLDS = PopulousThresholds(a=0.3, b=0.75, c0=0.9)
COVARIANCE_RADIUS = 0.7
COVARIANCE_TEST_FRACTION = 0.3
# The spec's choices (docs/algorithms.md §3.5 as first written; the calibration shipped until
# 2026-11-26 but for the later bisection of m): ``covariance_calibration(d, ε, δ, **SPEC_CHOICES)``.
SPEC_CHOICES = types.MappingProxyType(dict(
    radius=0.25, thresholds=PopulousThresholds(0.6, 0.8, 0.9), test_fraction=0.25,
    mask_accounting="tail_bound", ppme_bound="spec", mask_accuracy_rule="bound",
    pass_target="sure"))


class CovarianceCalibration(NamedTuple):
  """The public constants of :func:`al_covariance` for ``(d, ε, δ)``.

  Attributes:
    d: dimension.
    num_groups: k.
    min_group_size: m from the concentration rule (or the user's override).
    required_n: ``k·m`` rows (``2·k·m`` with ``unknown_mean``).
    radius: closeness radius r.
    mask_sensitivity: γ, PPME's masking sensitivity.
    eta: the mask's noise level η.
    mask_accuracy: α with ``dist(M_η(Ŷ), Ŷ) ≤ α`` w.p. 1 − β.
    candidate_accuracy: c with every group's covariance within dist c of Σ w.p. 1 − β at m rows
      (Gaussian singular-value bounds, a union over the k groups; ``inf`` where they say nothing;
      at most r'' = r/(2 + r) under the concentration rule). PPME's output, a convex combination
      of the groups' covariances, is then within c of Σ too.
    epsilon_test, delta_test, epsilon_mask, delta_mask: the budget split.
    beta: failure probability used for the utility rules.
    smallest_num_groups: the smallest admissible k (privacy, the accuracy cap and the test); k
      is larger where more groups need fewer rows in all (the simulation rule), and
      ``smallest_num_groups·(d + 1)`` is the fail-fast lower bound on n.
    thresholds: PPME's ``(a, b, c0)``.
  """
  d: int
  num_groups: int
  min_group_size: int
  required_n: int
  radius: float
  mask_sensitivity: float
  eta: float
  mask_accuracy: float
  candidate_accuracy: float
  epsilon_test: float
  delta_test: float
  epsilon_mask: float
  delta_mask: float
  beta: float
  smallest_num_groups: int
  thresholds: PopulousThresholds


def covariance_calibration(d: int, epsilon: float, delta: float, *,
                           radius: float = COVARIANCE_RADIUS,
                           num_groups: int | None = None, min_group_size: int | None = None,
                           test_fraction: float = COVARIANCE_TEST_FRACTION,
                           eta_accuracy: float | None = 0.2,
                           beta: float = 0.05,
                           thresholds: PopulousThresholds = COVARIANCE_THRESHOLDS,
                           radius_margin: float = DEFAULT_RADIUS_MARGIN,
                           group_size_rule: str = "simulation",
                           unknown_mean: bool = False,
                           n: int | None = None,
                           mask_accounting: str = "rdp",
                           ppme_bound: str = "tight",
                           mask_accuracy_rule: str = "simulation",
                           pass_target: str = "p95") -> CovarianceCalibration:
  """Public calibration of the covariance learner (module docstring, steps 1–3).

  Usage::

      cal = dpjax.ashtiani_liaw.covariance_calibration(5, 1.0, 1e-6)     # d, ε, δ (seconds)
      cal.num_groups, cal.min_group_size, cal.required_n, cal.eta        # 2406, 221, 531726, …

  Step 2 (the number of groups k) is cheap; step 3's default simulates the group size (seconds
  to minutes for d ≳ 20), so pass ``n`` to fail fast: an ``n`` below ``k·(d + 1)`` raises first.
  Privacy needs only the thresholds' constraints, ``γ ≤ ½`` and ``η ≥ η_min(γ)``; every other
  choice is about utility (docs/algorithms.md §3.5).

  Args:
    d: dimension.
    epsilon, delta: the total budget.
    radius: closeness radius r > 0 (``2r + r² < 1`` with ``ppme_bound="spec"``); default 0.7.
    num_groups: k; default from step 2: the smallest admissible k, raised where more groups need
      fewer rows in all (a user value skips the accuracy cap but not the privacy constraints).
    min_group_size: m; default from ``group_size_rule`` (utility only; must be ≥ d + 1).
    test_fraction: ε1/ε (default 0.3).
    eta_accuracy: the cap on ``η·(2√d + √(2 ln(1/β)))`` (None: no cap).
    beta: failure probability for the utility rules.
    thresholds: PPME's ``(a, b, c0)`` (default :data:`COVARIANCE_THRESHOLDS`, (0.3, 0.75, 0.9)).
    radius_margin: relative slack on r for the floating-point predicate.
    group_size_rule: ``"simulation"`` or ``"concentration"`` (module docstring, step 3).
    unknown_mean: rows are paired into differences, doubling the rows needed.
    n: optional number of rows available (public): raise as soon as it is known to be too few
      (the message is phrased for :func:`al_covariance`, which passes its n here).
    mask_accounting: ``"rdp"`` (exact Rényi divergence, default) or ``"tail_bound"`` (the
      earlier bound F); see :func:`~dpjax.ashtiani_liaw.calibrate_masking`.
    ppme_bound: PPME's sensitivity bound, ``"tight"`` (default) or ``"spec"`` (the earlier one,
      3.6× larger); see :func:`~dpjax.ashtiani_liaw.ppme_calibration`.
    mask_accuracy_rule: how the cap and ``mask_accuracy`` are read (utility only; step 2):
      ``"simulation"`` (default, PROPOSED; :func:`~dpjax.ashtiani_liaw.simulated_masking_eta`,
      about 2× the bound's η) or ``"bound"``.
    pass_target: the simulation rule's target (utility only; step 3): ``"p95"`` (default,
      PROPOSED: a pass w.p. ≥ 1 − β) or ``"sure"`` (a sure pass, k ≥ ``min_groups_for_test``).

  Returns:
    :class:`CovarianceCalibration`.

  Raises:
    ValueError: bad arguments; no k up to 10⁹ meets the constraints; a ``num_groups`` with which
      even unanimous groups pass the test w.p. ≤ δ1 (⊥ certain); with ``n``, ``n`` below
      ``k·(d + 1)`` (every rule's groups have ≥ d + 1 rows; doubled with ``unknown_mean``) or
      below ``required_n`` when that is cheap (``min_group_size`` given or the concentration
      rule), in a message naming n, d, ε, δ, k and the bound.

  Warns:
    UnderpoweredWarning: ``num_groups`` below :func:`~dpjax.ashtiani_liaw.min_groups_for_test`
      (the test may fail even when every group agrees).
  """
  d = v.check_int(d, "d", low=1)
  epsilon, delta = v.check_epsilon(epsilon), v.check_delta(delta)
  radius = v.check_positive(radius, "radius")
  thresholds = PopulousThresholds(*(float(x) for x in thresholds))
  frac = v.check_probability(test_fraction, "test_fraction", open_high=True)
  beta = v.check_probability(beta, "beta", open_high=True)
  eps1, eps2, delta1, delta2 = epsilon * frac, epsilon * (1 - frac), delta / 2, delta / 2
  gamma_at = lambda k: ppme_calibration(k, radius, eps1, delta1, space="covariance",   # noqa: E731
                                        thresholds=thresholds, radius_margin=radius_margin,
                                        sensitivity_bound=ppme_bound).mask_sensitivity
  spread = 2.0 * math.sqrt(d) + math.sqrt(2.0 * math.log(1.0 / beta))
  v.check_choice(group_size_rule, "group_size_rule", ("simulation", "concentration"))
  v.check_choice(mask_accounting, "mask_accounting", masking.MASKING_ACCOUNTINGS)
  v.check_choice(mask_accuracy_rule, "mask_accuracy_rule", ("simulation", "bound"))
  v.check_choice(pass_target, "pass_target", ("p95", "sure"))
  needs_target = min_group_size is None and group_size_rule == "simulation"
  pairs = 2 if unknown_mean else 1
  if n is not None:
    n = v.check_int(n, "n", low=1)

  def _simulation_target(k):
    # The test passes iff Q + noise > c0 + A1 (noise TLap(λ) on [−A1, A1]). At Q ≥ c0 + A1 + t
    # it fails w.p. ≤ P[noise < −t] ≤ ½e^{−t/λ} (the truncation only thins the tail), which is
    # β at t = λ ln(1/(2β)); t = A1 makes the pass sure. 0.02 covers the spread of Q around the
    # simulated mean fraction.
    test = ppme_calibration(k, radius, eps1, delta1, space="covariance", thresholds=thresholds)
    slack = test.test_bound
    if pass_target == "p95":
      slack = min(slack, test.test_scale * math.log(1.0 / (2.0 * beta)))
    return thresholds.c0 + test.test_bound + slack + 0.02

  def feasible(k, cap):
    try:
      check_thresholds(thresholds, k)
      gamma = gamma_at(k)
      if gamma > 0.5:
        return None
      cal = masking.calibrate_masking(d, gamma, eps2, delta2, accounting=mask_accounting)
    except ValueError:
      return None
    if cap is not None and cal.eta > cap:
      return None
    if needs_target and _simulation_target(k) >= 1.0:
      return None                                       # the test could not pass w.p. 1 − β
    return cal

  if eta_accuracy is None:
    eta_cap = None
  elif mask_accuracy_rule == "bound":
    eta_cap = v.check_positive(eta_accuracy, "eta_accuracy") / spread
  else:
    promised = masking.masking_concentration(
        d, v.check_positive(eta_accuracy, "eta_accuracy") / spread, beta)
    eta_cap = math.inf                       # the cap only chooses k: unused with a user k
    if math.isfinite(promised) and num_groups is None:
      if n is not None and needs_target:    # (the floor of "sure" only raises k: still a bound)
        # Fail fast before the mask's simulation (seconds at d = 30): no cap means fewer groups,
        # so k without the cap times d + 1 rows is a lower bound on required_n.
        k_floor = _smallest_groups(lambda j: feasible(j, None), 2, d, epsilon, delta)
        if n < k_floor * (d + 1) * pairs:
          raise _TooFewRows(n=n, d=d, epsilon=epsilon, delta=delta, num_groups=k_floor,
                            group_size=d + 1, pairs=pairs, exact=False)
      eta_cap = masking.simulated_masking_eta(d, promised, beta)
  if num_groups is None:
    # The simulation rule's own target (< 1) replaces the sure-pass floor on k.
    start = (2 if needs_target and pass_target == "p95"
             else min_groups_for_test(eps1, delta1, thresholds))
    k = _smallest_groups(lambda j: feasible(j, eta_cap), start, d, epsilon, delta)
    mask_cal = feasible(k, eta_cap)
  else:
    k = v.check_int(num_groups, "num_groups", low=2)
    check_thresholds(thresholds, k)
    gamma = gamma_at(k)
    if gamma > 0.5:
      raise ValueError(f"num_groups={k} gives masking sensitivity {gamma:.3g} > 1/2; use "
                       "more groups.")
    mask_cal = masking.calibrate_masking(d, gamma, eps2, delta2, accounting=mask_accounting)
    check_test_can_pass(k, eps1, delta1, thresholds, learner="the covariance learner")
  if n is not None:
    # Fail fast on public numbers, before the simulation: every rule gives groups of at least
    # d + 1 rows (the simulation starts there), and the other two rules are closed-form.
    if min_group_size is not None:
      m_low, exact = v.check_int(min_group_size, "min_group_size", low=d + 1), True
    elif group_size_rule == "concentration":
      m_low, exact = _concentration_group_size(d, k, radius, beta), True
    else:
      m_low, exact = d + 1, False
    if n < k * m_low * pairs:
      raise _TooFewRows(n=n, d=d, epsilon=epsilon, delta=delta, num_groups=k,
                        group_size=m_low, pairs=pairs, exact=exact)
  k_smallest = k
  if num_groups is None and needs_target:
    # After the fail-fast check: k·(d + 1) with the smallest k is still a lower bound.
    k = _fewest_rows_groups(k, lambda j: simulated_group_size(d, radius, _simulation_target(j)),
                            simulated_group_size(d, radius, thresholds.c0 + 0.02))
    mask_cal = feasible(k, eta_cap)
  if min_group_size is None and group_size_rule == "concentration":
    m = _concentration_group_size(d, k, radius, beta)
  elif min_group_size is None:
    m = simulated_group_size(d, radius, _simulation_target(k))
  else:
    m = v.check_int(min_group_size, "min_group_size", low=d + 1)
  alpha = (masking.masking_concentration(d, mask_cal.eta, beta) if mask_accuracy_rule == "bound"
           else masking.simulated_masking_accuracy(d, mask_cal.eta, beta))
  rows = k * m * pairs
  return CovarianceCalibration(d, k, m, rows, float(radius), mask_cal.distance, mask_cal.eta,
                               alpha, _candidate_accuracy(d, m, k, beta), eps1, delta1, eps2,
                               delta2, beta, k_smallest,
                               thresholds)


def _smallest_groups(feasible, start: int, d, epsilon, delta) -> int:
  """The smallest k ≥ start with ``feasible(k)`` (not None): doubling, then bisection.

  Feasibility is monotone in k: γ_PPME, hence η_min(γ), and the test's pass target all fall as
  k grows.
  """
  return v.smallest_n(lambda k: feasible(k) is not None,
                      "no number of groups up to 1e9 meets the covariance calibration for "
                      f"d={d}, epsilon={epsilon}, delta={delta}", limit=10**9, start=start)


def _fewest_rows_groups(k_min: int, group_size, m_limit: int) -> int:
  """The k ≥ k_min (on a 2^{1/4} grid up to 16·k_min) with the fewest rows k·m(k).

  With the simulation rule m(k) is non-increasing in k (the pass target c0 + 2A1(k) + 0.02
  falls as the test's bound A1 ∝ 1/k does) down to ``m_limit``, the group size at A1 = 0; near
  the smallest admissible k the target nears 1 and m explodes, so the smallest k is not always
  the cheapest. Every k ≥ k_min meets the privacy constraints (γ_PPME falls with k), so the
  choice is a utility matter and uses public quantities only.
  """
  best_k, best_n = k_min, None
  for j in range(17):
    k = max(k_min, int(math.ceil(k_min * 2.0 ** (j / 4))))
    m = group_size(k)
    if best_n is None or k * m < best_n:
      best_k, best_n = k, k * m
    if m <= m_limit:
      break                                   # larger k only adds rows
  return best_k


def _candidate_accuracy(d: int, m: int, k: int, beta: float) -> float:
  """dist(group covariance, Σ) ≤ c for all k groups of m rows ~ N(0, Σ) w.p. ≥ 1 − β.

  The singular values of an m×d standard Gaussian matrix lie in ``√m(1 ± t)``, ``t = √(d/m) +
  √(2 ln(2k/β)/m)``, except w.p. β/k each (Davidson–Szarek), so the whitened group covariance has
  eigenvalues in ``[(1 − t)², (1 + t)²]``: ``c = max((1 + t)² − 1, (1 − t)⁻² − 1)``.
  """
  t = math.sqrt(d / m) + math.sqrt(2.0 * math.log(2.0 * k / beta) / m)
  return math.inf if t >= 1.0 else max((1.0 + t) ** 2 - 1.0, (1.0 - t) ** -2 - 1.0)


def _concentration_group_size(d: int, k: int, radius: float, beta: float) -> int:
  """Step 3's ``"concentration"`` rule: ``√(d/m) + √(2 ln(2k/β)/m) ≤ r''/3``, r'' = r/(2 + r)."""
  r_candidate = radius / (2.0 + radius)
  root = (math.sqrt(d) + math.sqrt(2.0 * math.log(2.0 * k / beta))) * 3.0 / r_candidate
  return math.ceil(root * root)


class _TooFewRows(ValueError):
  """``n`` below the rows the covariance calibration needs (a ValueError with the numbers).

  ``exact`` tells whether ``rows = num_groups·group_size·pairs`` is the exact ``required_n`` or
  a cheap lower bound (groups of d + 1 rows, before the group-size simulation).
  """

  def __init__(self, *, n, d, epsilon, delta, num_groups, group_size, pairs, exact):
    self.n, self.d, self.epsilon, self.delta = n, d, epsilon, delta
    self.num_groups, self.group_size, self.pairs, self.exact = num_groups, group_size, pairs, exact
    self.rows = num_groups * group_size * pairs
    least = "" if exact else " at the very least"
    super().__init__(
        f"al_covariance needs n >= {self.rows} rows{least} for d={d}, epsilon={epsilon:g}, "
        f"delta={delta:g} ({self.groups_text()}), got n={n}. Collect more rows, raise epsilon, "
        "or pass num_groups/min_group_size to trade accuracy for rows "
        f"({self.pointer_text()}).")

  def groups_text(self) -> str:
    size = (f"{self.group_size} rows" if self.exact
            else f"at least d + 1 = {self.group_size} rows; the simulated group size is larger")
    return f"{self.num_groups} groups of {size}{', paired' if self.pairs == 2 else ''}"

  def pointer_text(self) -> str:
    if self.exact:
      return "see required_n"
    return ("required_n(d, epsilon, delta, ...) gives the exact figure, after a simulation that "
            "takes a while at large d")


def simulated_group_size(d: int, radius: float, target: float, *, num_candidates: int = 192,
                         seed: int = 0) -> int:
  """Smallest m (a 2^{1/4} grid, then bisection) whose simulated mean neighbour fraction ≥ ``target``.

  Candidates are empirical covariances of m rows of N(0, I_d) (public, fixed seed); by affine
  invariance the result holds for every N(0, Σ). Returns the first m (from d + 1) where the
  fraction of r-close pairs, diagonal included, of ``num_candidates`` candidates is ≥ target.

  Raises:
    ValueError: ``target ≥ 1`` (unreachable) or no m up to 10⁷ reaches it.
  """
  if not target < 1.0:
    raise ValueError(f"the PPME test cannot pass at any group size: target neighbour fraction "
                     f"{target:.4f} >= 1; use more groups or a larger epsilon.")
  reaches = lambda rows: _simulated_fraction(d, float(radius), num_candidates, seed,  # noqa: E731
                                             rows) >= target
  with jax.enable_x64(True), jax.ensure_compile_time_eval():   # public: eager in a trace too
    m, below = float(d + 1), None
    while m <= 1e7:
      rows = int(math.ceil(m))
      if reaches(rows):
        # Bisect between the last grid point below the target and this one (the grid alone
        # overshoots by up to 19%); every returned m was itself simulated to reach the target.
        while below is not None and rows - below > 1:
          mid = (below + rows) // 2
          below, rows = (below, mid) if reaches(mid) else (mid, rows)
        return rows
      below, m = rows, m * 2.0 ** 0.25
  raise ValueError(f"no group size up to 1e7 reaches neighbour fraction {target:.4f}.")


@functools.lru_cache(maxsize=256)
def _simulated_fraction(d, radius, num_candidates, seed, rows):
  return float(_neighbour_fraction(jax.random.key(seed), rows, d, num_candidates, radius))


def _wishart_candidates(key, rows, d: int, num_candidates: int):
  """``num_candidates`` draws of Wishart(rows, I_d)/rows by Bartlett's decomposition: the law
  of a group's empirical covariance of ``rows`` rows ~ N(0, I_d) (float64; traceable)."""
  k_diag, k_low = jax.random.split(key)
  dof = rows - jnp.arange(d, dtype=jnp.float64)                # χ²_{m − i} on the diagonal
  diag = jnp.sqrt(2.0 * jax.random.gamma(k_diag, dof / 2.0, (num_candidates, d), jnp.float64))
  low = jnp.tril(jax.random.normal(k_low, (num_candidates, d, d), jnp.float64), -1)
  L = low + jax.vmap(jnp.diag)(diag)
  return L @ jnp.swapaxes(L, -1, -2) / rows


@functools.partial(jax.jit, static_argnames=("d", "num_candidates"))
def _neighbour_fraction(key, rows, d, num_candidates, radius):
  """Mean neighbour fraction of Wishart(rows, I_d)/rows candidates (one compile per shape)."""
  Y = _wishart_candidates(key, rows, d, num_candidates)
  return jnp.mean(semimetric.neighbour_counts(Y, radius)) / num_candidates


@functools.partial(jax.jit, static_argnames=("d", "num_candidates"))
def _largest_candidate_distances(keys, rows, d, num_candidates):
  """Per key, ``max_i dist(Y_i, I)`` over Wishart(rows, I_d)/rows candidates Y_i."""
  eye = jnp.eye(d, dtype=jnp.float64)

  def one(key):
    Y = _wishart_candidates(key, rows, d, num_candidates)
    return jnp.max(jax.vmap(lambda A: semimetric.psd_distance(A, eye))(Y))
  return jax.lax.map(one, keys)          # one replicate at a time: k·d² floats each


@functools.lru_cache(maxsize=64)
def simulated_candidate_accuracy(d: int, m: int, k: int, *, replicates: int = 100,
                                 seed: int = 0) -> float:
  """c with every one of k group covariances (m rows ~ N(0, Σ)) within dist c of Σ, simulated:
  the largest over ``replicates`` public replicates of ``max_i dist(Ŷ_i, I)`` (exact in law for
  every Σ by affine invariance). Utility only; used where :func:`_candidate_accuracy`'s Gaussian
  bound is infinite (groups of a few rows). ``inf`` if a candidate is singular (m ≤ d)."""
  with jax.enable_x64(True), jax.ensure_compile_time_eval():   # public: eager in a trace too
    keys = jax.random.split(jax.random.key(seed), replicates)
    return float(jnp.max(_largest_candidate_distances(keys, m, d, k)))


def required_n(d: int, epsilon: float, delta: float, **kwargs) -> int:
  """Rows :func:`dpjax.ashtiani_liaw.al_covariance` needs for ``(d, ε, δ)`` under the public
  calibration (the number its refusal quotes). For :func:`learn_covariance` (the AL step at its
  own defaults plus a CoinPress refinement) use :func:`learn_covariance_required_n`: a
  different learner, a different number (d = 13, ε = 1, δ = 1e-6: 2,483,868 here against
  1,142,781 there).

  ``covariance_calibration(d, ε, δ, **kwargs).required_n``; keyword arguments as there. Use it
  to plan a study before collecting data: with the conservative defaults it grows like
  ``d²·√ln(1/δ)/ε`` groups times ``O(d + ln k)`` rows per group ([AL22] Thm 5.4).
  """
  return covariance_calibration(d, epsilon, delta, **kwargs).required_n
