"""Poisson sampling laid out in padded micro-batches, never truncated; the traceable clipped sum
over the sample (docs/algorithms.md §6.1)."""

import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpjax.sgd import per_example, sampling

N, D = 400, 5
_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.normal(size=(N, D)), jnp.float32)
DATA = (X, X @ jnp.arange(1.0, D + 1.0))


def loss_fn(w, example):
  x, y = example
  return (x @ w - y) ** 2


# The reference masked sum at C = 1, jitted once for the module (op by op it compiles ~30 ops).
_masked_sum = jax.jit(per_example.clipped_grad_sum(loss_fn, clip_norm=1.0))


def test_poisson_mask_shape_dtype_and_determinism():
  mask = sampling.poisson_mask(jax.random.key(0), 500, 0.3)
  assert mask.shape == (500,) and mask.dtype == bool
  assert np.array_equal(mask, sampling.poisson_mask(jax.random.key(0), 500, 0.3))
  assert not np.array_equal(mask, sampling.poisson_mask(jax.random.key(1), 500, 0.3))
  assert bool(sampling.poisson_mask(jax.random.key(2), 50, 1.0).all())   # q = 1: everyone


def test_inclusion_rate_is_q_for_every_example():
  n, q, trials = 200, 0.1, 400
  keys = jax.random.split(jax.random.key(3), trials)
  # The same draws as one call per key, in one program (400 calls cost ~2 s of dispatch).
  draws = np.asarray(jax.jit(jax.vmap(lambda k: sampling.poisson_mask(k, n, q)))(keys))
  total = int(draws.sum())
  ci = stats.binomtest(total, n * trials).proportion_ci(0.999)
  assert ci.low <= q <= ci.high
  # Independent across examples and steps: per-example counts are Binomial(trials, q).
  per_example = draws.sum(0)
  chi2 = np.sum((per_example - trials * q) ** 2 / (trials * q * (1 - q)))
  assert stats.chi2.sf(chi2, n) > 1e-3


@pytest.mark.parametrize("n,q,b", [(1_000, 0.05, 16), (300, 0.5, 64), (50, 0.02, 8),
                                   (40, 1.0, 7)])
def test_microbatches_are_never_truncated(n, q, b):
  for i in range(40):
    key = jax.random.key(i)
    idx, mask = sampling.poisson_microbatches(key, n, q, b)
    chosen = np.flatnonzero(np.asarray(sampling.poisson_mask(key, n, q)))
    assert idx.dtype == np.int32 and mask.dtype == bool
    assert idx.shape == mask.shape == (max(1, math.ceil(chosen.size / b)), b)
    assert int(mask.sum()) == chosen.size                     # nobody dropped
    np.testing.assert_array_equal(idx[mask], chosen)           # each sampled example once
    assert np.all(idx[~mask] == 0)                             # padding points to example 0


def test_an_overflowing_sample_gets_more_microbatches():
  sizes = {sampling.poisson_microbatches(jax.random.key(i), 2_000, 0.05, 100)[0].shape[0]
           for i in range(30)}
  assert {1, 2} <= sizes                  # E|sample| = 100: some steps need a second batch


def test_empty_sample_gives_one_fully_padded_microbatch():
  # q tiny: with this key nobody is drawn; M is still 1 (a static shape), all padding.
  for i in range(20):
    idx, mask = sampling.poisson_microbatches(jax.random.key(i), 5, 1e-6, 4)
    if not mask.any():
      assert idx.shape == (1, 4) and np.all(idx == 0)
      return
  pytest.fail("expected an empty sample")


@pytest.mark.parametrize("call,exc,match", [
    (lambda: sampling.poisson_mask(jax.random.key(0), 10, 0.0), ValueError, "sampling_prob"),
    (lambda: sampling.poisson_mask(jax.random.key(0), 10, 1.5), ValueError, "sampling_prob"),
    (lambda: sampling.poisson_mask(jax.random.key(0), 0, 0.5), ValueError, "num_examples"),
    (lambda: sampling.poisson_mask(jax.random.key(0), 10.0, 0.5), TypeError, "num_examples"),
    (lambda: sampling.poisson_mask(7, 10, 0.5), TypeError, "key"),
    (lambda: sampling.poisson_microbatches(jax.random.key(0), 10, 0.5, 0), ValueError,
     "microbatch_size"),
])
def test_bad_inputs(call, exc, match):
  with pytest.raises(exc, match=match):
    call()


# -------------------------------------------------------------------------- PoissonSampling

def test_poisson_sampling_defaults_cover_the_sample_in_one_microbatch():
  """B = min(⌈N/D⌉, ⌈L' + 4√L'⌉), L' = L/D the expected sample per device."""
  selection = sampling.poisson_sampling(1_000, 100)
  assert selection == sampling.PoissonSampling(1_000, 100.0, 140)
  assert selection.sampling_prob == pytest.approx(0.1)
  assert sampling.poisson_sampling(1_000, 100, devices=4).microbatch_size == math.ceil(25 + 20)
  assert sampling.poisson_sampling(10, 9).microbatch_size == 10              # ⌈N/D⌉ caps it
  assert sampling.poisson_sampling(10, 9, devices=4).microbatch_size == 3
  assert sampling.poisson_sampling(1_000, 100, microbatch_size=7).microbatch_size == 7
  assert isinstance(sampling.poisson_sampling(1_000, 100).expected_batch_size, float)


def test_poisson_sampling_dp_event_is_the_poisson_sampled_step():
  selection = sampling.poisson_sampling(400, 40)
  step = dp_accounting.GaussianDpEvent(1.3)
  assert selection.dp_event(step) == dp_accounting.PoissonSampledDpEvent(0.1, step)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(num_examples=0, expected_batch_size=1), ValueError, "num_examples"),
    (dict(num_examples=10.0, expected_batch_size=1), TypeError, "num_examples"),
    (dict(num_examples=10, expected_batch_size=0), ValueError, "expected_batch_size"),
    (dict(num_examples=10, expected_batch_size=11), ValueError, "num_examples=10"),
    (dict(num_examples=10, expected_batch_size=5, microbatch_size=0), ValueError,
     "microbatch_size"),
    (dict(num_examples=10, expected_batch_size=5, devices=0), ValueError, "devices"),
])
def test_poisson_sampling_validates_its_arguments(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    sampling.poisson_sampling(**kwargs)


@pytest.mark.parametrize("q,microbatch", [
    pytest.param(50 / N, 7, marks=pytest.mark.slow(reason="many micro-batches (B = 7); the default "
                                                          "run checks q = 0.9, B = 16")),
    pytest.param(0.9, 400, marks=pytest.mark.slow(reason="one micro-batch (B = N); the default run "
                                                         "checks q = 0.9, B = 16")),
    (0.9, 16)])
def test_poisson_clipped_sum_in_the_trace_covers_the_whole_sample(q, microbatch):
  """The traceable core draws the host helper's sample and sums every micro-batch of it (many
  micro-batches, one, and a sample far above B: never truncated), under jit and vmap."""
  grad_fn = per_example.clipped_grad_sum(loss_fn, clip_norm=1.0)
  params = jnp.ones(D)
  keys = jax.random.split(jax.random.key(6), 3)

  selection = sampling.PoissonSampling(N, q * N, microbatch)

  @jax.jit
  def sums(keys):       # with extra_args, which reach grad_fn, and the PoissonSampling object
    return (jax.vmap(lambda k: sampling.poisson_clipped_sum(
        grad_fn, params, DATA, k, sampling_prob=q, microbatch_size=microbatch))(keys),
            sampling.poisson_clipped_sum(
                lambda p, b, m, c: grad_fn(p, b, m) * c, params, DATA, keys[0],
                sampling_prob=q, microbatch_size=microbatch, extra_args=(2.0,)),
            selection.clipped_sum(grad_fn, params, DATA, keys[1]))

  got, scaled, selected = sums(keys)
  for key, row in zip(keys, np.asarray(got)):
    mask = np.asarray(sampling.poisson_mask(key, N, q))
    expected = _masked_sum(params, DATA, jnp.asarray(mask))
    np.testing.assert_allclose(row, np.asarray(expected), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(scaled), 2 * np.asarray(got[0]), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(selected), np.asarray(got[1]), rtol=1e-5, atol=1e-4)
  # Data leaves must share the example axis.
  with pytest.raises(ValueError, match="leading example axis"):
    sampling.poisson_clipped_sum(grad_fn, params, (X, X[:3]), keys[0], sampling_prob=q,
                                 microbatch_size=microbatch)


def test_masked_call_speaks_both_conventions():
  """dpjax's ``(params, batch, mask)`` passes through; jax_privacy's clipped_grad is called
  with ``is_padding_example = ~mask``; its has_aux form (per-example outputs) is refused."""
  ours = per_example.clipped_grad_sum(loss_fn, clip_norm=1.0)
  assert sampling.masked_call(ours) is ours
  plain = lambda p, b, m: None                                    # noqa: E731
  assert sampling.masked_call(plain) is plain
  clipping = pytest.importorskip("jax_privacy.clipping")
  batch_loss = lambda w, batch: jnp.sum(jax.vmap(loss_fn, (None, 0))(w, batch))   # noqa: E731
  theirs = clipping.clipped_grad(batch_loss, l2_clip_norm=1.0, batch_argnums=1)
  mask = jnp.arange(N) % 3 == 0
  params = jnp.ones(D)
  np.testing.assert_allclose(np.asarray(sampling.masked_call(theirs)(params, DATA, mask)),
                             np.asarray(_masked_sum(params, DATA, mask)), rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match="has_aux"):
    sampling.masked_call(clipping.clipped_grad(
        lambda w, batch: (batch_loss(w, batch), 0.0), l2_clip_norm=1.0, batch_argnums=1,
        has_aux=True))


# ---- Truncated Poisson sampling (issue 52 §3). ---------------------------------------------

_chosen = jax.jit(sampling.truncated_poisson_chosen, static_argnums=(1, 3))


def test_truncation_keeps_at_most_b_and_every_sampled_example_when_the_sample_fits():
  for seed in range(20):
    key = jax.random.key(seed)
    idx, mask = _chosen(key, 50, 0.2, 8)
    assert idx.shape == mask.shape == (8,) and int(mask.sum()) <= 8
    sample_key, _ = jax.random.split(key)
    sampled = np.flatnonzero(np.asarray(jax.random.bernoulli(sample_key, 0.2, (50,))))
    kept = np.asarray(idx)[np.asarray(mask)]
    assert set(kept) <= set(sampled) and len(set(kept)) == len(kept)
    assert len(kept) == min(len(sampled), 8)        # a sample that fits is kept whole
  np.testing.assert_array_equal(_chosen(jax.random.key(3), 50, 0.2, 8)[0],
                                _chosen(jax.random.key(3), 50, 0.2, 8)[0])


def test_an_overflowing_sample_is_truncated_to_a_uniform_subset():
  """q = 1, N = 6, B = 3: every example is kept with probability 1/2, each pair equally often."""
  keys = jax.random.split(jax.random.key(0), 4_000)
  masks = np.zeros((4_000, 6), bool)
  idx, mask = jax.vmap(lambda k: sampling.truncated_poisson_chosen(k, 6, 1.0, 3))(keys)
  np.put_along_axis(masks, np.asarray(idx), np.asarray(mask), axis=1)
  assert np.all(masks.sum(1) == 3)
  np.testing.assert_allclose(masks.mean(0), 0.5, atol=0.03)
  pairs = (masks[:, :, None] & masks[:, None, :]).mean(0)[np.triu_indices(6, 1)]
  np.testing.assert_allclose(pairs, 3 / 6 * 2 / 5, atol=0.03)


def test_b_above_n_pads_a_static_batch():
  idx, mask = _chosen(jax.random.key(1), 3, 1.0, 5)
  assert idx.shape == (5,) and list(np.asarray(mask)) == [True] * 3 + [False] * 2


def test_truncated_event_and_its_cost():
  """The step event is dp_accounting's truncated one at N + 1 (the larger neighbour); at a B that
  never overflows it costs what Poisson does, at B = L far more (measured ε at σ = 1.2,
  q = 0.05, T = 50, δ = 1e-5: Poisson 1.82, B = 2,000 1.82, B = 130 2.82, B = 100 (= L) 7.50;
  ε grows with the event's dataset size, 7.48 at 1,999 to 7.50 at 2,002)."""
  sel = sampling.truncated_poisson_sampling(2_000, 100, 100)
  event = sel.dp_event(dp_accounting.GaussianDpEvent(1.2))
  assert event == dp_accounting.TruncatedSubsampledGaussianDpEvent(2_001, 0.05, 100, 1.2)
  with pytest.raises(ValueError, match="Gaussian"):
    sel.dp_event(dp_accounting.LaplaceDpEvent(1.0))

  def eps(selection):
    step = (dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.2))
            if selection is None else selection.dp_event(dp_accounting.GaussianDpEvent(1.2)))
    acc = dp_accounting.pld.PLDAccountant()
    return acc.compose(dp_accounting.SelfComposedDpEvent(step, 50)).get_epsilon(1e-5)
  poisson = eps(None)
  assert eps(sampling.truncated_poisson_sampling(2_000, 100, 2_000)) == pytest.approx(
      poisson, rel=1e-3)
  assert eps(sel) > 1.5 * poisson


def test_a_truncated_plan_trains_in_one_static_batch_and_books_its_event():
  import optax
  import dpjax
  rows = (X, (X[:, 0] > 0).astype(jnp.int32))

  def xent(w, example):
    x, label = example
    return optax.softmax_cross_entropy_with_integer_labels(x @ w, label)
  ledger = dpjax.ledger.PrivacyLedger(50.0, 1e-5)
  plan = dpjax.sgd.dp_sgd_plan(dpjax.sgd.clipped_grad_sum(xent, clip_norm=1.0), num_examples=N,
                               expected_batch_size=40, steps=30, noise_multiplier=1.0,
                               key=jax.random.key(0), max_batch_size=40, ledger=ledger)
  assert isinstance(plan.batch_selection, sampling.TruncatedPoissonSampling)
  assert "TruncatedSubsampledGaussianDpEvent" in repr(plan.dp_event)
  assert ledger.spent.epsilon == pytest.approx(plan.epsilon, rel=1e-6)
  w = jnp.zeros((D, 2))
  opt = optax.sgd(0.5)
  trained, _ = plan.run(w, plan.init(w, opt), plan.prepare(rows), opt)
  assert float(((X @ trained).argmax(-1) == rows[1]).mean()) > 0.8


@pytest.mark.parametrize("kwargs, match", [
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"max_batch_size": 10, "accountant": "rdp"}, "PLD"),
])
def test_truncated_config_refuses_what_it_cannot_account(kwargs, match):
  import dpjax
  with pytest.raises(ValueError, match=match):
    dpjax.sgd.DPSGDConfig(num_examples=N, expected_batch_size=40, steps=3, noise_multiplier=1.0,
                          **kwargs)


def test_truncated_plan_takes_no_mesh_or_microbatch_size():
  import dpjax
  config = dpjax.sgd.DPSGDConfig(num_examples=N, expected_batch_size=40, steps=3,
                                 noise_multiplier=1.0, max_batch_size=40)
  with pytest.raises(ValueError, match="one static batch"):
    config.make(_masked_sum, key=jax.random.key(0), microbatch_size=8)


# ------------------------------------------------------------------- fixed-size sampling


def test_fixed_size_batches_hold_exactly_b_distinct_examples_uniformly():
  """Every draw holds exactly B examples; over 4,000 draws each example's inclusion rate is
  B/N (chi-square) and pairs are included at the without-replacement rate B(B−1)/(N(N−1))."""
  n, b = 12, 5
  draw = jax.jit(jax.vmap(lambda k: sampling.fixed_size_chosen(k, n, b)))
  chosen = np.asarray(draw(jax.random.split(jax.random.key(0), 4_000)))
  assert chosen.shape == (4_000, n) and np.all(chosen.sum(1) == b)
  counts = chosen.sum(0)
  assert stats.chisquare(counts).pvalue > 1e-3
  pair = np.mean(chosen[:, 0] & chosen[:, 1])
  assert pair == pytest.approx(b * (b - 1) / (n * (n - 1)), abs=0.02)
  np.testing.assert_array_equal(draw(jax.random.split(jax.random.key(0), 3)), chosen[:3])


def test_fixed_size_sum_is_the_clipped_sum_of_its_batch_in_any_microbatching():
  sel = sampling.fixed_size_sampling(N, 37, microbatch_size=8)
  w = jnp.ones(D)
  key = jax.random.key(3)
  chosen = sampling.fixed_size_chosen(key, N, 37)
  want = _masked_sum(w, DATA, chosen)
  got = jax.jit(lambda k: sel.clipped_sum(_masked_sum, w, DATA, k))(key)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  whole = sampling.fixed_size_sampling(N, 37)
  assert whole.microbatch_size == 37
  np.testing.assert_allclose(whole.clipped_sum(_masked_sum, w, DATA, key), want, rtol=1e-5,
                             atol=1e-5)


def test_fixed_size_event_is_replace_one_sampling_without_replacement_at_half_sigma():
  """σ is std/Δ; replacing one example moves the sum by 2Δ, so dp_accounting's multiplier (std
  over the sensitivity of the relation) is σ/2; ε is RDP's under REPLACE_ONE."""
  import dpjax
  sel = sampling.fixed_size_sampling(1_000, 50)
  event = sel.dp_event(dp_accounting.GaussianDpEvent(1.2))
  assert event == dp_accounting.SampledWithoutReplacementDpEvent(
      1_000, 50, dp_accounting.GaussianDpEvent(0.6))
  assert dpjax.accounting.event_neighboring(event) == dp_accounting.NeighboringRelation.REPLACE_ONE
  want = dp_accounting.rdp.RdpAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE).compose(
          event, 100).get_epsilon(1e-5)
  got = dpjax.accounting.dpsgd_epsilon(1.2, 0.05, 100, 1e-5, batch_selection=sel)
  assert got == pytest.approx(want, rel=1e-9)
  with pytest.raises(ValueError, match="Gaussian"):
    sel.dp_event(dp_accounting.LaplaceDpEvent(1.0))


def test_a_fixed_size_plan_calibrates_under_replace_one_trains_and_books_its_relation():
  import optax
  import dpjax
  rows = (X, (X[:, 0] > 0).astype(jnp.int32))

  def xent(w, example):
    x, label = example
    return optax.softmax_cross_entropy_with_integer_labels(x @ w, label)
  grad_fn = dpjax.sgd.clipped_grad_sum(xent, clip_norm=1.0)
  replace_one = dp_accounting.NeighboringRelation.REPLACE_ONE
  ledger = dpjax.ledger.PrivacyLedger(4.0, 1e-5, neighboring=replace_one, accountant="rdp")
  plan = dpjax.sgd.dp_sgd_plan(grad_fn, num_examples=N, expected_batch_size=40, steps=30,
                               epsilon=2.0, delta=1e-5, accountant="rdp", fixed_size=True,
                               key=jax.random.key(0), ledger=ledger)
  assert isinstance(plan.batch_selection, sampling.FixedSizeSampling)
  assert plan.neighboring == plan.budget.neighboring == replace_one
  assert plan.epsilon == pytest.approx(2.0, rel=1e-3)
  assert ledger.spent.epsilon == pytest.approx(plan.epsilon, rel=1e-6)
  poisson = dpjax.sgd.DPSGDConfig(num_examples=N, expected_batch_size=40, steps=30, epsilon=2.0,
                                  accountant="rdp").calibrate().noise_multiplier
  assert plan.noise_multiplier > 1.3 * poisson                # sensitivity 2Δ under replace-one
  w = jnp.zeros((D, 2))
  opt = optax.sgd(0.5)
  trained, _ = plan.run(w, plan.init(w, opt), plan.prepare(rows), opt)
  assert float(((X @ trained).argmax(-1) == rows[1]).mean()) > 0.8
  with pytest.raises(ValueError, match="REPLACE_ONE"):     # an add/remove ledger refuses it
    dpjax.sgd.dp_sgd_plan(grad_fn, num_examples=N, expected_batch_size=40, steps=30,
                          epsilon=2.0, accountant="rdp", fixed_size=True, key=jax.random.key(1),
                          ledger=dpjax.ledger.PrivacyLedger(4.0, 1e-5, accountant="rdp"))


@pytest.mark.parametrize("kwargs, match", [
    ({}, "RDP only"),
    ({"accountant": "rdp", "expected_batch_size": 40.5}, "integer"),
    ({"accountant": "rdp", "subspace_epsilon": 0.1}, "subspace release"),
    ({"accountant": "rdp", "cycle_length": 2}, "cycle_length"),
    ({"accountant": "rdp", "tuning": "tuning"}, "tuning"),
])
def test_fixed_size_config_refuses_what_it_cannot_account(kwargs, match):
  import dpjax
  if kwargs.get("tuning") == "tuning":
    kwargs = dict(kwargs, tuning=dpjax.accounting.HyperparameterTuning(3.0))
  kwargs = {"expected_batch_size": 40, **kwargs}
  with pytest.raises(ValueError, match=match):
    dpjax.sgd.DPSGDConfig(num_examples=N, steps=3, epsilon=1.0, fixed_size=True, **kwargs)
