"""A statistical privacy auditor: empirical lower bounds on ε from neighbouring datasets.

Run a mechanism many times on two neighbouring inputs ``X`` and ``X'`` with independent keys,
reduce each output to a number (``featurize``), and for a family of events ``S`` (thresholds and
buckets, or single values for discrete outputs) compare ``p = P[M(X) ∈ S]`` with
``p' = P[M(X') ∈ S]``. An (ε, δ)-DP mechanism satisfies ``p ≤ e^ε p' + δ`` in both directions, so
every event gives the lower bound ``ε ≥ ln((p − δ)/p')``. With Clopper–Pearson bounds (``p`` from
below, ``p'`` from above, Bonferroni-corrected over all events and both directions) the reported
bound is a valid lower bound with the stated confidence. The hockey-stick test in both directions
follows Google's DP statistical tester. Thresholds are chosen on a held-out fifth of the runs, so
selecting the events does not bias the estimate.

A correct mechanism gives ``epsilon_lower_bound <= epsilon_claimed``; a broken one (too little
noise, no threshold) exceeds it when the neighbours stress the broken step. Auditing a mechanism of
your own::

    report = dpjax.audit.audit(key, lambda k, x: my_mechanism(k, x), X, X_prime,
                               delta=1e-6, epsilon_claimed=1.0, trials=20_000,
                               featurize=lambda out: out[0])
    assert report.passed, report

The auditor can only *refute* a guarantee (a lower bound above the claim is evidence of a bug); a
pass is evidence for the chosen neighbours and events only.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from dpjax import _validation as v


class AuditReport(NamedTuple):
  """The outcome of :func:`audit`.

  Attributes:
    epsilon_lower_bound: the largest lower bound over events and both directions (≥ 0).
    epsilon_claimed: the claim being tested (None if not given).
    delta: the δ used in the bound.
    event: description of the event that achieved the bound.
    direction: "X vs X'" (``p`` from X) or "X' vs X".
    counts: ``(hits in the first, hits in the second)`` for that event on the evaluation runs.
    trials: runs per dataset (held-out runs included).
    passed: ``epsilon_lower_bound <= epsilon_claimed`` (None without a claim).
  """
  epsilon_lower_bound: float
  epsilon_claimed: float | None
  delta: float
  event: str
  direction: str
  counts: tuple[int, int]
  trials: int
  passed: bool | None


def sample_outputs(key: jax.Array, mechanism: Callable, data, trials: int, *,
                   featurize: Callable | None = None, vectorized: bool = True) -> np.ndarray:
  """Runs ``mechanism(key_i, data)`` for ``trials`` independent keys; returns ``(trials,)`` features.

  ``vectorized=True`` maps the mechanism over keys with ``jax.vmap`` (it must then be traceable:
  call the jittable core, not a wrapper that validates on the host); otherwise a Python loop.
  """
  keys = jax.random.split(key, trials)
  feat = featurize or (lambda out: out)
  if vectorized:
    out = jax.vmap(lambda k: feat(mechanism(k, data)))(keys)
    values = np.asarray(out)
  else:
    values = np.asarray([np.asarray(feat(mechanism(k, data))) for k in keys])
  if values.shape != (trials,):
    raise ValueError(f"featurize must reduce each output to a scalar, got shape "
                     f"{values.shape[1:]} per run.")
  return values


def epsilon_lower_bound(samples: np.ndarray, samples_prime: np.ndarray, *, delta: float,
                        num_buckets: int = 10, confidence: float = 0.95,
                        holdout_fraction: float = 0.2) -> tuple[float, str, str, tuple[int, int]]:
  """Lower-bounds ε from two samples of a mechanism's scalar output (see the module docstring).

  Returns:
    ``(epsilon_lower_bound, event, direction, counts)``.
  """
  delta = v.check_probability(delta, "delta", open_low=False, open_high=True)
  a, b = np.asarray(samples), np.asarray(samples_prime)
  n_hold = int(holdout_fraction * min(a.size, b.size))
  events = _events(np.concatenate([a[:n_hold], b[:n_hold]]), num_buckets)
  a, b = a[n_hold:], b[n_hold:]
  alpha = (1.0 - confidence) / (2 * len(events))       # Bonferroni: events × directions
  best = (0.0, "none", "X vs X'", (0, 0))
  for name, indicator in events:
    hits_a, hits_b = int(indicator(a).sum()), int(indicator(b).sum())
    for (h1, n1), (h2, n2), direction in (((hits_a, a.size), (hits_b, b.size), "X vs X'"),
                                          ((hits_b, b.size), (hits_a, a.size), "X' vs X")):
      p_low = _cp_lower(h1, n1, alpha)
      q_high = _cp_upper(h2, n2, alpha)
      if p_low - delta > 0 and q_high > 0:
        eps = math.log((p_low - delta) / q_high)
        if eps > best[0]:
          best = (eps, name, direction, (h1, h2))
  return best


def audit(key: jax.Array, mechanism: Callable, X: Any, X_prime: Any, *, delta: float,
          epsilon_claimed: float | None = None, trials: int = 10_000,
          featurize: Callable | None = None, vectorized: bool = True, num_buckets: int = 10,
          confidence: float = 0.95) -> AuditReport:
  """Audits ``mechanism`` on the neighbouring pair ``(X, X_prime)``.

  Args:
    key: PRNG key (split into independent keys for every run).
    mechanism: ``mechanism(key, data) -> output`` (any pytree).
    X, X_prime: neighbouring inputs under the relation the claim is stated for.
    delta: the claim's δ.
    epsilon_claimed: the claim's ε (sets ``passed``).
    trials: runs per dataset.
    featurize: ``output -> scalar`` (default: the output itself).
    vectorized: ``vmap`` over keys (True) or loop (False).
    num_buckets: number of threshold/bucket events for continuous outputs.
    confidence: joint confidence of the lower bound.

  Returns:
    :class:`AuditReport`.
  """
  v.check_key(key)
  trials = v.check_int(trials, "trials", low=20)
  k1, k2 = jax.random.split(key)
  a = sample_outputs(k1, mechanism, X, trials, featurize=featurize, vectorized=vectorized)
  b = sample_outputs(k2, mechanism, X_prime, trials, featurize=featurize, vectorized=vectorized)
  eps, event, direction, counts = epsilon_lower_bound(a, b, delta=delta, num_buckets=num_buckets,
                                                      confidence=confidence)
  passed = None if epsilon_claimed is None else bool(eps <= epsilon_claimed)
  return AuditReport(eps, epsilon_claimed, float(delta), event, direction, counts, trials, passed)


def _events(pilot: np.ndarray, num_buckets: int) -> list[tuple[str, Callable]]:
  values = np.unique(pilot)
  if values.size <= 2 * num_buckets or np.issubdtype(pilot.dtype, np.integer) or \
      pilot.dtype == bool:
    # Discrete outputs: each observed value, and one-sided thresholds between them.
    events = [(f"output == {x!r}", lambda s, x=x: s == x) for x in values[:50]]
    events += [(f"output <= {x!r}", lambda s, x=x: s <= x) for x in values[:-1][:50]]
    return events
  cuts = np.quantile(pilot, np.linspace(0, 1, num_buckets + 1)[1:-1])
  events = [(f"output <= {c:.6g}", lambda s, c=c: s <= c) for c in cuts]
  events += [(f"output in ({lo:.6g}, {hi:.6g}]", lambda s, lo=lo, hi=hi: (s > lo) & (s <= hi))
             for lo, hi in zip(cuts[:-1], cuts[1:])]
  # Extreme tails matter most for DP: add thresholds beyond the pilot's quantiles.
  lo_tail, hi_tail = np.quantile(pilot, [0.01, 0.99])
  events += [(f"output <= {lo_tail:.6g}", lambda s, c=lo_tail: s <= c),
             (f"output > {hi_tail:.6g}", lambda s, c=hi_tail: s > c)]
  return events


def _cp_lower(hits: int, n: int, alpha: float) -> float:
  return 0.0 if hits == 0 else float(stats.beta.ppf(alpha, hits, n - hits + 1))


def _cp_upper(hits: int, n: int, alpha: float) -> float:
  return 1.0 if hits == n else float(stats.beta.ppf(1 - alpha, hits + 1, n - hits))
