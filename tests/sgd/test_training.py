"""The private training loop (ALGORITHMS.md §6): budgets, subspace sources, fallbacks."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax import accounting, data, sgd


def _logistic_problem(n=2_000, d=20, k=3):
  X, B = data.exact_subspace_data(jax.random.key(0), n, d, k)   # gradients lie in span(B)
  y = (X @ B[:, 0] > 0).astype(jnp.float32)
  return X, y, B


def _loss(w, example):
  x, y = example
  return optax.sigmoid_binary_cross_entropy(x @ w, y)


def _full_loss(w, X, y):
  return float(jnp.mean(jax.vmap(_loss, in_axes=(None, 0))(w, (X, y))))


@pytest.mark.parametrize("subspace", ["none", "public"])
def test_training_decreases_the_loss_within_budget(subspace):
  X, y, B = _logistic_problem()
  w0 = jnp.zeros(20)
  out = sgd.train_dp_sgd(jax.random.key(1), _loss, w0, (X[200:], y[200:]), optax.sgd(0.5),
                         epsilon=4.0, delta=1e-5, steps=40, expected_batch_size=200,
                         clip_norm=1.0, subspace=subspace, k=3, public_data=(X[:200], y[:200]),
                         eval_fn=lambda w: {"loss": _full_loss(w, X, y)}, eval_every=20)
  assert out.budget.epsilon <= 4.0 + 1e-9 and out.budget.delta <= 1e-5
  assert out.budget.neighbouring == "add_remove"
  assert _full_loss(out.params, X, y) < 0.8 * _full_loss(w0, X, y)
  assert [h["step"] for h in out.history] == [20, 40]
  assert out.subspace_ok == (None if subspace == "none" else True)
  if subspace == "public":       # noise and signal only in the public span(B) ∋ w
    residual = out.params - B @ (B.T @ out.params)
    assert float(jnp.linalg.norm(residual)) < 1e-3 * float(jnp.linalg.norm(out.params))


def test_training_is_deterministic_for_a_fixed_key():
  X, y, _ = _logistic_problem(n=500)
  run = lambda seed: sgd.train_dp_sgd(jax.random.key(seed), _loss, jnp.zeros(20), (X, y),
                                      optax.sgd(0.1), epsilon=1.0, delta=1e-5, steps=5,
                                      expected_batch_size=50, clip_norm=1.0).params
  first = run(2)
  assert jnp.array_equal(first, run(2)) and not jnp.array_equal(first, run(3))


def test_private_subspace_bottom_falls_back_to_plain_dp_sgd_and_pays():
  """Isotropic gradients: DPASE says ⊥, training continues privately, the budget is spent."""
  X = jax.random.normal(jax.random.key(3), (3_000, 30))
  y = (X[:, 0] > 0).astype(jnp.float32)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = sgd.train_dp_sgd(jax.random.key(4), _loss, jnp.zeros(30), (X, y), optax.sgd(0.5),
                           epsilon=2.0, delta=1e-5, steps=10, expected_batch_size=100,
                           clip_norm=1.0, subspace="private", k=2, gamma=1e-3,
                           subspace_epsilon_fraction=0.25)
  assert out.subspace_ok is False
  assert any("⊥" in str(w.message) for w in caught)
  assert out.budget.subspace_epsilon == pytest.approx(0.5) and out.budget.epsilon <= 2.0 + 1e-9
  # The σ that runs is the one planned with the subspace's share taken out.
  assert out.budget == accounting.plan_dpsgd_budget(2.0, 1e-5, sampling_prob=100 / 3_000,
                                                    steps=10, subspace_epsilon=0.5,
                                                    subspace_delta=1e-5 * 0.1)


def test_microbatching_does_not_change_the_step():
  """Same key → same Poisson samples; splitting them into micro-batches only re-associates sums."""
  X, y, _ = _logistic_problem(n=400)
  run = lambda mb: sgd.train_dp_sgd(jax.random.key(7), _loss, jnp.zeros(20), (X, y),
                                    optax.sgd(0.5), epsilon=3.0, delta=1e-5, steps=3,
                                    expected_batch_size=40, clip_norm=1.0, microbatch_size=mb,
                                    progress=True)
  np.testing.assert_allclose(np.asarray(run(7).params), np.asarray(run(None).params), atol=1e-5)


def test_private_subspace_is_used_when_dpase_answers():
  X, y, B = _logistic_problem(n=8_000)
  out = sgd.train_dp_sgd(jax.random.key(8), _loss, jnp.zeros(20), (X, y), optax.sgd(0.5),
                         epsilon=4.0, delta=1e-5, steps=2, expected_batch_size=400,
                         clip_norm=1.0, subspace="private", k=3, gamma=1e-6)
  assert out.subspace_ok is True
  b = out.budget
  assert b.subspace_epsilon == pytest.approx(0.4) and b.subspace_delta == pytest.approx(1e-6)
  assert b.epsilon == pytest.approx(b.subspace_epsilon + b.sgd_epsilon) and b.epsilon <= 4.0
  # Every update lies in the learned span; the learned span is span(B), so w stays near it.
  residual = out.params - B @ (B.T @ out.params)
  assert float(jnp.linalg.norm(residual)) < 0.1 * float(jnp.linalg.norm(out.params))


@pytest.mark.parametrize("kwargs,match", [
    (dict(expected_batch_size=10_000), "expected_batch_size"),
    (dict(subspace="public", k=2), "public_data"),
    (dict(subspace="public", k=None, public_data=0), "k"),
    (dict(subspace="magic"), "subspace"),
    (dict(epsilon=0.0), "epsilon"),
    (dict(delta=1.0), "delta"),
    (dict(clip_norm=0.0), "clip_norm"),
    (dict(refresh_every=5), "refresh_every"),
    (dict(subspace="private", k=2, subspace_epsilon_fraction=1.0), "subspace_epsilon_fraction"),
    (dict(subspace="private", k=2, subspace_delta_fraction=0.0), "subspace_delta_fraction"),
    (dict(subspace="private", k=2), "gamma"),
    (dict(subspace="private", k=21, gamma=0.1), "k"),
    (dict(subspace="private", k=2, gamma=0.1, dpase_kwargs={"partition": "permutation"}),
     "random_labels"),
    (dict(steps=0), "steps"),
    (dict(microbatch_size=0), "microbatch_size"),
    (dict(optimizer=0.1), "optimizer"),
    (dict(key=5), "key"),
])
def test_bad_arguments(kwargs, match):
  X, y, _ = _logistic_problem(n=300)
  args = dict(epsilon=1.0, delta=1e-5, steps=2, expected_batch_size=30, clip_norm=1.0) | kwargs
  key, optimizer = args.pop("key", jax.random.key(0)), args.pop("optimizer", optax.sgd(0.1))
  with pytest.raises((ValueError, TypeError), match=match):
    sgd.train_dp_sgd(key, _loss, jnp.zeros(20), (X, y), optimizer, **args)
