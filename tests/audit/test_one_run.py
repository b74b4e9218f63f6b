"""Auditing in one run (Steinke, Nasr & Jagielski 2023): a correct release passes, a broken one is
flagged, and the API refuses what would void the bound.

The model run is the white-box one of the paper's Gaussian experiments: m Dirac canaries (the
coordinate vectors e_i, exactly orthogonal), the release y = Σ_{i in} e_i + σ z with σ the
Gaussian mechanism's for (ε, δ) at sensitivity 1 (add/remove one canary moves y by e_i, norm 1),
and each canary scored by its coordinate y_i. One run, many canaries: the bound uses m
independent inclusions, not m runs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize, stats

from dpjax import audit

pytest.importorskip("jax_privacy.auditing")
pytestmark = pytest.mark.audit

DELTA = 1e-5


def _gaussian_sigma(epsilon, delta=DELTA):
  """σ of the Gaussian mechanism at sensitivity 1 that is exactly (ε, δ)-DP (Balle & Wang 2018)."""
  def excess(s):
    return (stats.norm.cdf(-epsilon * s + 1 / (2 * s))
            - np.exp(epsilon) * stats.norm.cdf(-epsilon * s - 1 / (2 * s)) - delta)
  return optimize.brentq(excess, 0.05, 100.0)


def _one_run(key, canaries, sigma):
  inclusion_key, noise_key = jax.random.split(key)          # one split into named purposes
  included = audit.canary_inclusions(inclusion_key, canaries)
  noise = np.asarray(jax.random.normal(noise_key, (canaries,)), np.float64)
  return included + sigma * noise, included                  # y_i = 1[i in] + σ z_i


@pytest.mark.parametrize("method", audit.ONE_RUN_METHODS)
@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_a_correct_gaussian_release_passes_and_a_broken_one_is_flagged(epsilon, method):
  sigma = _gaussian_sigma(epsilon)
  for seed in range(3):
    scores, included = _one_run(jax.random.key(seed), 2_000, sigma)
    correct = audit.one_run_audit(scores, included, delta=DELTA, epsilon_claimed=epsilon,
                                  method=method)
    assert correct.passed and correct.epsilon_lower_bound <= epsilon, correct
    assert correct.canaries == 2_000 and correct.included == int(included.sum())
  # The negative control: the same claim with a twentieth of the noise (true ε far above it).
  scores, included = _one_run(jax.random.key(7), 2_000, sigma / 20)
  broken = audit.one_run_audit(scores, included, delta=DELTA, epsilon_claimed=epsilon,
                               method=method)
  assert not broken.passed and broken.epsilon_lower_bound > epsilon, broken


def test_the_bound_sees_part_of_the_true_epsilon_and_the_fdp_analysis_more():
  """At ε = 4 with 10,000 canaries the one-run bound is well above 0 (measured 0.96) and the
  f-DP analysis is tighter (1.99): the audit has power, it is not a constant pass."""
  scores, included = _one_run(jax.random.key(3), 10_000, _gaussian_sigma(4.0))
  plain = audit.one_run_audit(scores, included, delta=DELTA, epsilon_claimed=4.0)
  fdp = audit.one_run_audit(scores, included, delta=DELTA, epsilon_claimed=4.0,
                            method="one_run_fdp")
  assert 0.5 < plain.epsilon_lower_bound < fdp.epsilon_lower_bound <= 4.0, (plain, fdp)


def test_random_scores_give_no_evidence():
  scores = np.asarray(jax.random.normal(jax.random.key(5), (2_000,)))
  included = audit.canary_inclusions(jax.random.key(6), 2_000)
  report = audit.one_run_audit(scores, included, delta=DELTA)
  assert report.epsilon_lower_bound < 0.5 and report.passed is None


def test_inclusions_are_fair_coins_determined_by_the_key():
  a = audit.canary_inclusions(jax.random.key(0), 20_000)
  assert a.dtype == np.bool_ and a.shape == (20_000,)
  assert abs(a.mean() - 0.5) < 0.02
  np.testing.assert_array_equal(a, audit.canary_inclusions(jax.random.key(0), 20_000))
  assert (a != audit.canary_inclusions(jax.random.key(1), 20_000)).any()


def test_bad_inputs_are_refused_with_the_reason():
  scores, included = _one_run(jax.random.key(0), 100, 1.0)
  with pytest.raises(ValueError, match="both in and out"):
    audit.one_run_audit(scores, np.ones(100, bool), delta=DELTA)
  with pytest.raises(ValueError, match="boolean"):
    audit.one_run_audit(scores, included.astype(int), delta=DELTA)
  with pytest.raises(ValueError, match="shape"):
    audit.one_run_audit(scores[:-1], included, delta=DELTA)
  with pytest.raises(ValueError, match="finite"):
    audit.one_run_audit(np.where(included, np.nan, scores), included, delta=DELTA)
  with pytest.raises(ValueError, match="method"):
    audit.one_run_audit(scores, included, delta=DELTA, method="many_runs")
  with pytest.raises(ValueError, match="significance"):
    audit.one_run_audit(scores, included, delta=DELTA, significance=1.0)
  with pytest.raises(ValueError, match="epsilon_claimed"):
    audit.one_run_audit(scores, included, delta=DELTA, epsilon_claimed=0.0)
  with pytest.raises(ValueError, match="canaries"):
    audit.canary_inclusions(jax.random.key(0), 1)


# ---- A DP-SGD run on the plan, audited in one run with Dirac canaries. ----------------------

class _DeclaresLess:
  """A broken gradient sum: it clips at 30·C but declares C (the noise is then 30× too small
  for the canaries' true sensitivity)."""

  def __init__(self, grad_fn, bound):
    self._grad_fn, self.l2_norm_bound = grad_fn, bound

  def __call__(self, params, batch, mask):
    return self._grad_fn(params, batch, mask)


def _dp_sgd_with_canaries(key, *, control=None, canaries=1_000, epsilon=2.0):
  """A linear softmax on 1,000 rows (10 features, 3 classes) + m canaries, plan at (ε, 1e-5),
  L = 200, T = 100, SGD; returns the one-run report against the claimed ε."""
  import optax
  import dpjax

  data_key, inclusion_key, run_key = jax.random.split(key, 3)
  X = jax.random.normal(data_key, (1_000, 10))
  y = (X[:, 0] > 0).astype(jnp.int32) + (X[:, 1] > 1).astype(jnp.int32)

  def loss(params, example):
    x, label = example
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["w"] + params["b"], label)

  clip = 1.0
  cans = audit.DiracCanaries.draw(inclusion_key, canaries,
                                  scale=30 * clip if control == "unclipped" else clip)
  loss_c = cans.loss(loss)
  grad_fn = (_DeclaresLess(dpjax.sgd.clipped_grad_sum(loss_c, clip_norm=30 * clip), clip)
             if control == "unclipped" else dpjax.sgd.clipped_grad_sum(loss_c, clip_norm=clip))
  budget = ({"noise_multiplier": 0.05, "accountant": "rdp"} if control == "no_noise"
            else {"epsilon": epsilon})
  plan = dpjax.sgd.dp_sgd_plan(grad_fn, num_examples=cans.num_examples(len(X)),
                               expected_batch_size=200, steps=100, delta=DELTA, key=run_key,
                               **budget)
  params = cans.params({"w": jnp.zeros((10, 3)), "b": jnp.zeros(3)})
  opt = optax.sgd(0.5)
  trained, _ = plan.run(params, plan.init(params, opt), plan.prepare(cans.data((X, y))), opt)
  accuracy = float(((X @ trained["model"]["w"] + trained["model"]["b"]).argmax(-1) == y).mean())
  report = audit.one_run_audit(cans.scores(params, trained), cans.included, delta=DELTA,
                               epsilon_claimed=epsilon)
  return report, accuracy, plan


def test_a_dp_sgd_run_with_dirac_canaries_passes_and_its_broken_variants_are_flagged():
  """One plan run per case (≈ 1 s each). The correct run passes with a bound above 0 (the
  canaries are seen), trains its model, and its plan is at the claimed ε; removing the noise, or
  a gradient sum that declares less than it clips at, is refuted by the same audit."""
  report, accuracy, plan = _dp_sgd_with_canaries(jax.random.key(0))
  assert report.passed, report
  assert 0.0 < report.epsilon_lower_bound <= 2.0        # measured 0.64 (0.03 with key 1)
  assert plan.epsilon == pytest.approx(2.0, rel=1e-2) and accuracy > 0.7   # measured 0.82
  for control in ("no_noise", "unclipped"):
    broken, _, _ = _dp_sgd_with_canaries(jax.random.key(0), control=control)
    assert not broken.passed and broken.epsilon_lower_bound > 2.0, (control, broken)


def test_dirac_canaries_are_orthogonal_examples_of_norm_scale():
  cans = audit.DiracCanaries.draw(jax.random.key(0), 6, scale=0.7)
  loss_c = cans.loss(lambda p, ex: jnp.sum(p["w"] * ex) ** 2)
  params = cans.params({"w": jnp.ones(3)})
  examples, index = cans.data(jnp.arange(12.0).reshape(4, 3))
  assert examples.shape == (4 + cans.included.sum(), 3)
  assert list(np.asarray(index)) == [-1] * 4 + list(np.flatnonzero(cans.included))
  for i in range(examples.shape[0]):
    g = jax.grad(loss_c)(params, (examples[i], index[i]))
    if i < 4:
      assert not np.any(np.asarray(g["canaries"])) and np.any(np.asarray(g["model"]["w"]))
    else:
      expected = np.zeros(6)
      expected[int(index[i])] = 0.7
      np.testing.assert_allclose(np.asarray(g["canaries"]), expected, rtol=1e-6)
      assert not np.any(np.asarray(g["model"]["w"]))
