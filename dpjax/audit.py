"""A statistical privacy auditor: empirical lower bounds on ε from neighboring datasets.

Run a mechanism many times on two neighboring inputs ``X`` and ``X'`` with independent keys,
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

Floating-point leaks (Mironov 2012; docs/algorithms.md §1.10) need other events: the value ``c + Z`` of
a float noise sample can only take values whose set depends on ``c``, so a single output value may
identify the input. Two detectors look for this class of leak:

* :func:`float_noise_support` + :func:`exact_output_audit` (exhaustive): every value a JAX float32
  noise sampler can return (2^23 equally likely values, enumerated through JAX's own sampler code
  with a counter PRNG) is pushed through the release, and the exact output distributions on
  neighboring inputs are compared value by value. Raw float32 Laplace noise on a count leaves
  about a quarter of its output mass unreachable from the neighboring count: ε = ∞.
* :func:`grid_output_audit` (sampled, for samplers whose randomness cannot be enumerated, such as
  the exact integer samplers and snapping): every sampled output must lie on the mechanism's
  public grid, and the exact output values are audited as discrete events.
* :func:`low_bits` (sampled, for any float release): a ``featurize`` for :func:`audit` that
  keeps only the sign and the lowest mantissa bits of the output. In real arithmetic those bits
  carry no more than the value does, but the rounding of ``f + Z`` makes their law depend on the
  bits of ``f``; a release on a public power-of-two grid has them all zero.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from dpjax import _validation as v

__all__ = ["AuditReport", "DiracCanaries", "OneRunAuditReport", "OutputAuditReport", "audit",
           "canary_inclusions",
           "epsilon_lower_bound", "exact_output_audit", "float_noise_support", "grid_output_audit",
           "low_bits", "one_run_audit", "sample_outputs"]


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
                   featurize: Callable | None = None, vectorized: bool = True,
                   batch_size: int = 16_384) -> np.ndarray:
  """Runs ``mechanism(key_i, data)`` for ``trials`` independent keys; returns ``(trials,)`` features.

  ``vectorized=True`` maps the mechanism over the keys with ``jax.vmap``, ``batch_size`` keys at
  a time (the last batch padded with repeated keys, so every batch has one shape and reuses the
  compiled operations; memory is bounded by the batch; outputs per key do not depend on the
  batch size). The mechanism must then be traceable: call the jittable core, not a wrapper that
  validates on the host. ``vectorized=False`` loops in Python.

  Raises:
    ValueError: ``trials`` or ``batch_size`` below 1; a feature that is not a scalar per run.
  """
  trials = v.check_int(trials, "trials", low=1)
  batch_size = v.check_int(batch_size, "batch_size", low=1)
  keys = jax.random.split(key, trials)
  feat = featurize or (lambda out: out)
  if vectorized:
    size = min(batch_size, trials)
    padded = keys[np.arange(-(-trials // size) * size) % trials]
    run = jax.vmap(lambda k: feat(mechanism(k, data)))
    values = np.concatenate([np.asarray(run(padded[i:i + size]))
                             for i in range(0, padded.shape[0], size)])[:trials]
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
          confidence: float = 0.95, batch_size: int = 16_384) -> AuditReport:
  """Audits ``mechanism`` on the neighboring pair ``(X, X_prime)``.

  Args:
    key: PRNG key (split into independent keys for every run).
    mechanism: ``mechanism(key, data) -> output`` (any pytree).
    X, X_prime: neighboring inputs under the relation the claim is stated for.
    delta: the claim's δ.
    epsilon_claimed: the claim's ε (sets ``passed``).
    trials: runs per dataset.
    featurize: ``output -> scalar`` (default: the output itself).
    vectorized: ``jax.vmap`` over the keys in batches (True; the mechanism must be traceable)
      or a Python loop (False); see :func:`sample_outputs`.
    num_buckets: number of threshold/bucket events for continuous outputs.
    confidence: joint confidence of the lower bound.
    batch_size: runs vectorised at a time when ``vectorized`` (bounds memory; outputs per key
      do not depend on it).

  Returns:
    :class:`AuditReport`.
  """
  v.check_key(key)
  trials = v.check_int(trials, "trials", low=20)
  k1, k2 = jax.random.split(key)
  a, b = (sample_outputs(k, mechanism, data, trials, featurize=featurize, vectorized=vectorized,
                         batch_size=batch_size) for k, data in ((k1, X), (k2, X_prime)))
  eps, event, direction, counts = epsilon_lower_bound(a, b, delta=delta, num_buckets=num_buckets,
                                                      confidence=confidence)
  passed = None if epsilon_claimed is None else bool(eps <= epsilon_claimed)
  return AuditReport(eps, epsilon_claimed, float(delta), event, direction, counts, trials, passed)


# --------------------------------------------------------------------------------------------
# Auditing in one run (Steinke, Nasr & Jagielski 2023).
# --------------------------------------------------------------------------------------------

ONE_RUN_METHODS = ("one_run", "one_run_fdp")


class OneRunAuditReport(NamedTuple):
  """The outcome of :func:`one_run_audit`.

  Attributes:
    epsilon_lower_bound: ε' such that, with confidence ``1 - significance`` over the canaries'
      inclusion draws and the run's randomness, the run is not (ε'', δ)-DP for any ε'' < ε'
      (≥ 0; 0 when the guesses carry no evidence).
    epsilon_claimed: the claim being tested (None if not given).
    delta: the claim's δ.
    significance: the bound's error probability.
    canaries: m, the number of canaries drawn (in and out).
    included: how many were included.
    method: ``"one_run"`` or ``"one_run_fdp"``.
    passed: ``epsilon_lower_bound <= epsilon_claimed`` (None without a claim).
  """
  epsilon_lower_bound: float
  epsilon_claimed: float | None
  delta: float
  significance: float
  canaries: int
  included: int
  method: str
  passed: bool | None


def canary_inclusions(key: jax.Array, canaries: int) -> np.ndarray:
  """Which canaries a one-run audit trains on: each independently with probability ½.

  Usage::

    inclusion_key, run_key = jax.random.split(key)          # one split into named purposes
    included = dpjax.audit.canary_inclusions(inclusion_key, 1_000)
    scores = train_and_score(run_key, canaries[included], canaries)   # your run, one score each
    report = dpjax.audit.one_run_audit(scores, included, delta=1e-5, epsilon_claimed=2.0)

  The one-run bound (:func:`one_run_audit`) is valid only when the inclusions are independent
  fair coins that the run cannot see except through the canaries it trains on; draw them with
  a key of their own, never with a key the run also uses.

  Args:
    key: a PRNG key for the inclusion draws only.
    canaries: m ≥ 2, the number of canaries.

  Returns:
    ``(m,)`` bool NumPy array: True where canary i is included in the run.

  Raises:
    ValueError: ``canaries`` below 2; a key that is not a PRNG key.
  """
  v.check_key(key)
  canaries = v.check_int(canaries, "canaries", low=2)
  return np.asarray(jax.random.bernoulli(key, 0.5, (canaries,)))


@dataclasses.dataclass(frozen=True, eq=False)     # identity hash: it holds an array
class DiracCanaries:
  """White-box gradient canaries for auditing a DP-SGD run in one run (Steinke, Nasr & Jagielski
  2023, their white-box DP-SGD experiments).

  Usage (any per-example loss, any plan; the canaries are extra training examples)::

    inclusion_key, run_key = jax.random.split(key)
    canaries = dpjax.audit.DiracCanaries.draw(inclusion_key, 1_000, scale=clip_norm)
    loss_c = canaries.loss(loss)                          # loss_c(params_c, (example, index))
    params_c = canaries.params(params)                    # {"model": params, "canaries": 0s}
    data_c = canaries.data((X, y))                        # the rows, then the included canaries
    plan = dpjax.sgd.dp_sgd_plan(dpjax.sgd.clipped_grad_sum(loss_c, clip_norm=clip_norm),
                                 num_examples=canaries.num_examples(len(X)), ..., key=run_key)
    ... train params_c on data_c with the plan ...
    report = dpjax.audit.one_run_audit(canaries.scores(params_c, trained), canaries.included,
                                       delta=plan.delta, epsilon_claimed=plan.epsilon)

  Canary j is an example whose loss is ``scale · θ_j`` on a parameter leaf of its own (m zeros
  that the model never reads), so its gradient is ``scale · e_j``: orthogonal to every real
  example's gradient and to every other canary's, of norm ``scale`` (≤ C: clipping leaves it
  whole). Its score is how far gradient descent moved θ_j, ``θ_j(before) − θ_j(after)``. Each
  canary is one example under add/remove-one, the relation of the plan's guarantee, so the
  trained run is ``(plan.epsilon, plan.delta)``-DP with respect to each canary and
  :func:`one_run_audit` must not refute it. The model's own parameters get no canary
  gradient, so the canaries cost the model nothing but their share of the batch.

  Attributes:
    included: ``(m,)`` bool, from :func:`canary_inclusions`.
    scale: the canaries' gradient norm (default 1; set it to the clip norm C).
  """
  included: np.ndarray
  scale: float = 1.0

  @classmethod
  def draw(cls, key: jax.Array, canaries: int, *, scale: float = 1.0) -> "DiracCanaries":
    """m canaries, each included with probability ½ (:func:`canary_inclusions`)."""
    return cls(canary_inclusions(key, canaries), v.check_positive(scale, "scale"))

  @property
  def canaries(self) -> int:
    return int(self.included.size)

  def num_examples(self, rows: int) -> int:
    """The training set's size with the included canaries: ``rows + #included``."""
    return int(rows) + int(self.included.sum())

  def params(self, params) -> dict:
    """``{"model": params, "canaries": zeros (m,)}`` (float32)."""
    return {"model": params, "canaries": jnp.zeros((self.canaries,), jnp.float32)}

  def data(self, rows):
    """``(rows, index)``: the real rows (index −1) followed by one row per included canary
    (index j; its example is a copy of the first real row, which its loss ignores)."""
    n = jax.tree_util.tree_leaves(rows)[0].shape[0]
    chosen = np.flatnonzero(self.included)
    filler = jax.tree_util.tree_map(lambda a: jnp.repeat(a[:1], chosen.size, axis=0), rows)
    examples = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), rows, filler)
    index = jnp.concatenate([jnp.full((n,), -1, jnp.int32), jnp.asarray(chosen, jnp.int32)])
    return examples, index

  def loss(self, loss_fn: Callable) -> Callable:
    """``loss_c(params_c, (example, index))``: ``loss_fn(params_c["model"], example)`` for a
    real row (index −1), ``scale · params_c["canaries"][index]`` for canary ``index``."""
    scale = self.scale

    def loss_c(params_c, example_index):
      example, index = example_index
      real = loss_fn(params_c["model"], example)
      canary = scale * params_c["canaries"][jnp.maximum(index, 0)]
      return jnp.where(index < 0, real, canary.astype(jnp.result_type(real)))
    return loss_c

  def scores(self, params_before, params_after) -> np.ndarray:
    """``(m,)``: ``θ_j(before) − θ_j(after)`` on the canary leaf (higher: more likely in)."""
    return np.asarray(params_before["canaries"], np.float64) - np.asarray(
        params_after["canaries"], np.float64)


def one_run_audit(scores, included, *, delta: float, epsilon_claimed: float | None = None,
                  significance: float = 0.05, method: str = "one_run") -> OneRunAuditReport:
  """Lower-bounds ε from one training run with canaries (Steinke, Nasr & Jagielski 2023).

  Usage (after one run that trained on the canaries ``included`` marks, drawn by
  :func:`canary_inclusions`, and scored every canary, the higher the more "in")::

    report = dpjax.audit.one_run_audit(scores, included, delta=1e-5, epsilon_claimed=2.0)
    assert report.passed, report

  The auditor guesses "in" for the canaries with the highest scores, at every threshold (a
  Bonferroni correction over the thresholds), and converts the number of correct guesses into
  the largest ε that an (ε, δ)-DP run would make that unlikely (one-sided: only "in" guesses).
  Each canary is one individual: the bound is for add/remove-one of a canary, the relation
  dpjax's DP-SGD is stated under. Like :func:`audit` it can only *refute* a claim, and m sets
  its ceiling (perfect guesses give about 4.8 with 1,000 canaries and 6.4 with 10,000, δ =
  1e-5), so a pass says little about large ε.

  Args:
    scores: ``(m,)`` finite floats, one per canary (in and out alike).
    included: ``(m,)`` bool, from :func:`canary_inclusions`; at least one canary in and one out.
    delta: the claim's δ, in [0, 1).
    epsilon_claimed: the claim's ε (sets ``passed``).
    significance: the bound's error probability, in (0, 1).
    method: ``"one_run"``: Steinke, Nasr & Jagielski (2023, arXiv 2305.08846): a binomial
      tail on the correct guesses, by ``jax_privacy.auditing.CanaryScoreAuditor
      .epsilon_one_run``; ``"one_run_fdp"``: the tighter f-DP analysis of Mahloujifar, Melis &
      Chaudhuri (2024, arXiv 2410.22235), by its ``epsilon_one_run_fdp``. Both need
      ``jax_privacy`` (the ``interop`` extra).

  Returns:
    :class:`OneRunAuditReport`.

  Raises:
    ValueError: scores not finite or not one per canary; ``included`` not boolean, or all in
      or all out; ``delta``, ``significance`` or ``method`` out of range.
    ImportError: ``jax_privacy`` is not installed.
  """
  method = v.check_choice(method, "method", ONE_RUN_METHODS)
  delta = v.check_probability(delta, "delta", open_low=False, open_high=True)
  significance = v.check_probability(significance, "significance", open_high=True)
  if epsilon_claimed is not None:
    epsilon_claimed = v.check_epsilon(epsilon_claimed, "epsilon_claimed")
  scores = np.asarray(scores, dtype=np.float64)
  included = np.asarray(included)
  if scores.ndim != 1 or included.shape != scores.shape:
    raise ValueError(f"scores and included must both have shape (m,), one entry per canary; got "
                     f"{scores.shape} and {included.shape}.")
  if included.dtype != np.bool_:
    raise ValueError(f"included must be boolean (from canary_inclusions), got {included.dtype}.")
  if not np.all(np.isfinite(scores)):
    raise ValueError("scores must be finite.")
  n_in = int(included.sum())
  if n_in in (0, scores.size):
    raise ValueError(f"a one-run audit needs canaries both in and out of the run; got {n_in} of "
                     f"{scores.size} in.")
  try:
    from jax_privacy.auditing import CanaryScoreAuditor
  except ImportError as e:       # pragma: no cover - the test extra installs it
    raise ImportError("one_run_audit uses jax_privacy's CanaryScoreAuditor: pip install "
                      "'dpjax[interop]'.") from e
  auditor = CanaryScoreAuditor(scores[included], scores[~included])
  bound = (auditor.epsilon_one_run if method == "one_run" else auditor.epsilon_one_run_fdp)(
      significance, delta)
  eps = max(0.0, float(bound))
  passed = None if epsilon_claimed is None else bool(eps <= epsilon_claimed)
  return OneRunAuditReport(eps, epsilon_claimed, float(delta), float(significance), scores.size,
                           n_in, method, passed)


# --------------------------------------------------------------------------------------------
# Floating-point leak detectors.
# --------------------------------------------------------------------------------------------


class OutputAuditReport(NamedTuple):
  """The outcome of :func:`exact_output_audit`: exact, not statistical.

  Attributes:
    epsilon_lower_bound: the smallest ε for which the two exact output distributions are
      (ε, δ)-indistinguishable in both directions (``inf`` if none is: more than δ of one
      side's mass lies on outputs the other side never produces).
    unmatched_mass: the larger, over both directions, of the probability of outputs that the
      other input can never produce.
    delta_at_claim: the larger hockey-stick divergence ``Σ_y max(0, P(y) − e^ε P'(y))`` at
      ``epsilon_claimed`` (None without a claim).
    epsilon_claimed: the claim being tested (None if not given).
    delta: the δ used.
    num_outputs: distinct output values over both inputs.
    passed: ``delta_at_claim <= delta`` (None without a claim).
  """
  epsilon_lower_bound: float
  unmatched_mass: float
  delta_at_claim: float | None
  epsilon_claimed: float | None
  delta: float
  num_outputs: int
  passed: bool | None


def _counter_prng(shift: int):
  """A PRNG implementation whose ``random_bits`` returns ``iota << shift``: used once per shape,
  it hands a sampler every mantissa pattern exactly once (never for privacy, only for audits)."""
  from jax.extend import random as jex_random

  def random_bits(key, bit_width, shape):
    del key
    if bit_width != 32:
      raise ValueError(f"the counter PRNG only serves 32-bit draws, the sampler asked for "
                       f"{bit_width} bits.")
    size = math.prod(shape)
    return (jax.lax.iota(jnp.uint32, size) << jnp.uint32(shift)).reshape(shape)

  return jex_random.define_prng_impl(
      key_shape=(1,), seed=lambda seed: jnp.zeros((1,), jnp.uint32),
      split=lambda key, shape: jnp.zeros(tuple(shape) + (1,), jnp.uint32),
      random_bits=random_bits, fold_in=lambda key, data: key, name="dpjax_audit_counter",
      tag="dpjax_audit_counter")


def float_noise_support(sampler: Callable, *, check_samples: int = 1 << 16) -> np.ndarray:
  """Every value a JAX float32 noise sampler can return, each with probability 2^-23.

  JAX's float32 samplers (``jax.random.uniform``, ``laplace``, ``normal``, ...) turn one 32-bit
  word into a uniform float whose 23 mantissa bits are the word's top bits, then transform it.
  This runs ``sampler(key, (2^23,), jnp.float32)`` — JAX's own code, so the transformation and
  its rounding are exactly the library's — with a counter PRNG that supplies each of the 2^23
  mantissa patterns once. As a check, ``check_samples`` draws with a real key must all lie in
  the enumerated set.

  Args:
    sampler: ``sampler(key, shape, dtype) -> array`` drawing one 32-bit word per output (e.g.
      ``jax.random.laplace``, ``jax.random.normal``).
    check_samples: real draws verified against the enumeration (0 skips the check).

  Returns:
    ``(2^23,)`` float32 NumPy array: the sampler's outputs, one per equally likely word class.

  Raises:
    ValueError: the sampler uses other than one 32-bit word per output, or a real draw falls
      outside the enumeration (the sampler is not of the supported kind).
  """
  size = 1 << 23
  key = jax.random.key(0, impl=_counter_prng(9))
  values = np.asarray(sampler(key, (size,), jnp.float32), np.float32)
  if values.shape != (size,):
    raise ValueError(f"the sampler returned shape {values.shape}, expected ({size},).")
  if check_samples:
    drawn = np.asarray(sampler(jax.random.key(12345), (check_samples,), jnp.float32),
                       np.float32).view(np.uint32)
    known = np.sort(values.view(np.uint32))
    idx = np.minimum(np.searchsorted(known, drawn), known.size - 1)
    if not np.all(known[idx] == drawn):
      raise ValueError("a real draw of the sampler is not among the enumerated values: it does "
                       "not map one 32-bit word to one float32 output.")
  return values


def _pmf(outputs: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Exact output distribution: sorted distinct outputs (keyed by their bit patterns, so −0.0
  and 0.0 stay distinct) and their probabilities."""
  flat = np.ascontiguousarray(np.asarray(outputs)).reshape(outputs.shape[0], -1)
  width = flat.dtype.itemsize * flat.shape[1]
  if width in (1, 2, 4, 8):
    keys = flat.view(np.dtype(f"u{width}")).ravel()
  else:
    keys = flat.view(np.dtype((np.void, width))).ravel()
  order = np.argsort(keys, kind="stable")     # a sort: NumPy's hashed unique is far slower here
  keys, weights = keys[order], np.asarray(weights)[order]
  first = np.concatenate([[True], keys[1:] != keys[:-1]])
  return keys[first], np.add.reduceat(weights, np.flatnonzero(first))


def _matched(keys: np.ndarray, other_keys: np.ndarray, other_probs: np.ndarray) -> np.ndarray:
  """``Q(y)`` for every ``y`` in ``keys`` (0 where the other side never outputs y)."""
  idx = np.minimum(np.searchsorted(other_keys, keys), other_keys.size - 1)
  return np.where(other_keys[idx] == keys, other_probs[idx], 0.0)


def _hockey_stick(p: np.ndarray, q: np.ndarray, epsilon: float) -> float:
  """``Σ_y max(0, P(y) − e^ε Q(y))`` over aligned probability vectors."""
  factor = math.exp(min(epsilon, 700.0))
  return float(math.fsum(np.maximum(0.0, p - factor * q)))


def _smallest_epsilon(p: np.ndarray, q: np.ndarray, delta: float) -> float:
  """Smallest ε ≥ 0 with ``Σ max(0, P − e^ε Q) ≤ δ`` (inf if the mass Q never covers exceeds δ)."""
  if math.fsum(p[q == 0.0]) > delta:
    return math.inf
  if _hockey_stick(p, q, 0.0) <= delta:
    return 0.0
  lo, hi = 0.0, 1.0
  while _hockey_stick(p, q, hi) > delta:
    lo, hi = hi, 2.0 * hi
  for _ in range(60):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if _hockey_stick(p, q, mid) > delta else (lo, mid)
  return hi


def exact_output_audit(noise: np.ndarray, release: Callable, value, value_prime, *,
                       delta: float, epsilon_claimed: float | None = None,
                       weights: np.ndarray | None = None) -> OutputAuditReport:
  """Exact (ε, δ) of a release over an enumerated noise support, value by value.

  ``release(value, noise)`` must be vectorised over the leading axis of ``noise`` and reproduce
  the mechanism's arithmetic exactly (same dtype and operations). The output distribution on each
  input is computed exactly from ``noise`` (equally likely values unless ``weights`` is given), and
  the hockey-stick divergence is evaluated in both directions. Unlike :func:`audit` this is not a
  lower bound: it is the mechanism's true privacy for this pair and this noise sampler.

  Args:
    noise: ``(N, ...)`` every value the noise can take (e.g. :func:`float_noise_support`).
    release: ``(value, noise) -> (N, ...)`` outputs.
    value, value_prime: the statistic on two neighboring datasets.
    delta: the claim's δ.
    epsilon_claimed: the claim's ε (sets ``passed``).
    weights: ``(N,)`` probabilities of the noise values (default uniform).

  Returns:
    :class:`OutputAuditReport`.
  """
  delta = v.check_probability(delta, "delta", open_low=False, open_high=True)
  noise = np.asarray(noise)
  n = noise.shape[0]
  w = np.full(n, 1.0 / n) if weights is None else np.asarray(weights, np.float64)
  if w.shape != (n,):
    raise ValueError(f"weights must have shape ({n},), got {w.shape}.")
  keys_a, probs_a = _pmf(np.asarray(release(value, noise)), w)
  keys_b, probs_b = _pmf(np.asarray(release(value_prime, noise)), w)
  if keys_a.dtype != keys_b.dtype:
    raise ValueError("release returned outputs of different dtypes or shapes on the two inputs.")
  forward = (probs_a, _matched(keys_a, keys_b, probs_b))         # P(y), Q(y) over y ∈ supp P
  backward = (probs_b, _matched(keys_b, keys_a, probs_a))
  unmatched = max(math.fsum(p[q == 0.0]) for p, q in (forward, backward))
  eps = max(_smallest_epsilon(p, q, delta) for p, q in (forward, backward))
  at_claim = passed = None
  if epsilon_claimed is not None:
    at_claim = max(_hockey_stick(p, q, epsilon_claimed) for p, q in (forward, backward))
    passed = bool(at_claim <= delta * (1 + 1e-9))
  num_outputs = int(keys_a.size + keys_b.size - np.count_nonzero(forward[1]))
  return OutputAuditReport(eps, unmatched, at_claim, epsilon_claimed, float(delta), num_outputs,
                           passed)


def grid_output_audit(key: jax.Array, mechanism: Callable, X: Any, X_prime: Any, *,
                      grid_step: float, delta: float, epsilon_claimed: float | None = None,
                      trials: int = 10_000, featurize: Callable | None = None,
                      vectorized: bool = False, confidence: float = 0.95,
                      batch_size: int = 16_384) -> AuditReport:
  """Sampled float-leak detector for mechanisms that release values on a public grid.

  Runs the mechanism ``trials`` times on each input, checks that every (featurized) output is an
  exact multiple of ``grid_step`` — an off-grid value is a support leak and raises — and audits
  the exact output values as discrete events (:func:`epsilon_lower_bound` on the integer grid
  indices), so a value reachable from one input only shows up as an event the other never hits.

  Args:
    key: PRNG key.
    mechanism: ``mechanism(key, data) -> output``.
    X, X_prime: neighboring inputs.
    grid_step: the public grid the release promises (a power of two for dpjax's mechanisms).
    delta: the claim's δ.
    epsilon_claimed: the claim's ε.
    trials: runs per dataset.
    featurize: ``output -> scalar`` (default the output itself).
    vectorized: ``jax.vmap`` over the keys in batches (the mechanism must be traceable: dpjax's
      host releases are, through ``jax.pure_callback``) or, by default, a Python loop.
    confidence: joint confidence of the lower bound.
    batch_size: runs vectorised at a time when ``vectorized``.

  Returns:
    :class:`AuditReport` over the grid indices.

  Raises:
    AssertionError: an output is not on the grid (a float leak; the message shows it).
  """
  v.check_key(key)
  step = v.check_positive(grid_step, "grid_step")
  trials = v.check_int(trials, "trials", low=20)
  k1, k2 = jax.random.split(key)
  indices = []
  for k, data in ((k1, X), (k2, X_prime)):
    out = sample_outputs(k, mechanism, data, trials, featurize=featurize, vectorized=vectorized,
                         batch_size=batch_size).astype(np.float64)
    index = np.round(out / step)
    off = out != index * step
    if np.any(off):
      raise AssertionError(f"{int(off.sum())} of {trials} outputs are not multiples of the "
                           f"public grid step {step!r}, e.g. {out[off][:3]!r}: a float leak.")
    indices.append(index.astype(np.int64))
  eps, event, direction, counts = epsilon_lower_bound(indices[0], indices[1], delta=delta,
                                                      confidence=confidence)
  passed = None if epsilon_claimed is None else bool(eps <= epsilon_claimed)
  return AuditReport(eps, epsilon_claimed, float(delta), event, direction, counts, trials, passed)


def low_bits(value, bits: int = 4):
  """The sign and the lowest ``bits`` mantissa bits of a float array, as one integer event.

  A ``featurize`` for :func:`audit` (and :func:`sample_outputs`): each entry ``x`` is read as
  its IEEE bit pattern (a ``uint64`` view of float64, ``uint32`` of float32) and reduced to
  ``c = sign·2^bits + (pattern mod 2^bits)`` in ``[0, 2^(bits+1))``; the entries of an array
  are packed as base-``2^(bits+1)`` digits (entry 0 lowest). The result is an integer, so
  :func:`epsilon_lower_bound` audits it as a discrete output (each value, and thresholds on the
  code: with ``bits=1`` the event ``c == 1`` is "positive with an odd mantissa").

  Why: in real arithmetic the low bits of a continuous release carry nothing the value itself
  does not, and an ε-DP release keeps every event within e^ε. A float release ``fl(f + Z)`` does
  not: the rounding makes the law of its low bits depend on the bits of ``f`` (Mironov 2012), so
  on neighbours whose statistics have different bit patterns this event can exceed the claim —
  as it does for the raw release of output perturbation ERM
  (tests/audit/test_classic_erm_audits.py). A release on a public grid coarser than the last
  bits (every output a multiple of a power of two far above the ulp) has all low bits zero and
  leaves only the sign, which the real-arithmetic guarantee covers.

  Args:
    value: a float32 or float64 array (any shape with ``(bits + 1)·size`` at most 63 bits, 31
      when the array is a JAX float32 array and x64 is off), NumPy (computed in NumPy) or JAX
      (traceable: ``jit``, ``vmap``, as :func:`sample_outputs` calls it).
    bits: how many of the lowest mantissa bits to keep, 1 to 23 (float32) or 52 (float64).

  Returns:
    A scalar integer: NumPy ``int64`` for NumPy input; for JAX input ``int64`` with x64 on, else
    ``int32``.

  Raises:
    TypeError: ``value`` not float32 or float64.
    ValueError: ``bits`` out of range, or an array too large to pack.

  References:
    Mironov, "On significance of the least significant bits for differential privacy", CCS
    2012; docs/algorithms.md §1.10.
  """
  on_host = isinstance(value, (np.ndarray, np.generic, float))
  xp = np if on_host else jnp
  value = np.asarray(value) if on_host else jnp.asarray(value)
  if value.dtype not in (np.float32, np.float64):
    raise TypeError(f"value must be a float32 or float64 array, got dtype={value.dtype}.")
  mantissa = 52 if value.dtype == np.float64 else 23
  bits = v.check_int(bits, "bits", low=1, high=mantissa)
  width = 63 if (on_host or jax.dtypes.canonicalize_dtype(np.int64) == np.int64) else 31
  if (bits + 1) * value.size > width:
    raise ValueError(f"low_bits packs (bits + 1)·size = {(bits + 1) * value.size} bits into one "
                     f"integer of {width} bits: pass fewer entries (e.g. one coordinate) or "
                     f"fewer bits, got bits={bits}, size={value.size}.")
  unsigned = np.uint64 if value.dtype == np.float64 else np.uint32
  out = np.int64 if width == 63 else np.int32
  if on_host:
    pattern = value.reshape(-1).view(unsigned)
  else:
    pattern = jax.lax.bitcast_convert_type(value.reshape(-1), unsigned)
  top = 8 * np.dtype(unsigned).itemsize - 1
  sign = (pattern >> unsigned(top)).astype(out)
  low = (pattern & unsigned((1 << bits) - 1)).astype(out)
  digits = sign * (1 << bits) + low
  shifts = (bits + 1) * xp.arange(value.size, dtype=out)
  return xp.sum(digits << shifts).astype(out)


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


def _cp_interval(hits: int, n: int, alpha: float):
  """One-sided level-(1 − α) Clopper–Pearson bounds = the two-sided exact interval at
  confidence 1 − 2α (SciPy's ``binomtest(...).proportion_ci(method="exact")``)."""
  return stats.binomtest(int(hits), int(n)).proportion_ci(confidence_level=1.0 - 2.0 * alpha,
                                                          method="exact")


def _cp_lower(hits: int, n: int, alpha: float) -> float:
  return float(_cp_interval(hits, n, alpha).low)


def _cp_upper(hits: int, n: int, alpha: float) -> float:
  return float(_cp_interval(hits, n, alpha).high)
