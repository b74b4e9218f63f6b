"""The private training loop and the subspace sources."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax import data, metrics, sgd


def _logistic_problem(n=2_000, d=20, k=3):
  X, B = data.exact_subspace_data(jax.random.key(0), n, d, k)   # gradients lie in span(B)
  y = (X @ B[:, 0] > 0).astype(jnp.float32)
  return X, y, B


def _loss(w, example):
  x, y = example
  return optax.sigmoid_binary_cross_entropy(x @ w, y)


def _full_loss(w, X, y):
  return float(jnp.mean(jax.vmap(_loss, in_axes=(None, 0))(w, (X, y))))


def test_public_subspace_captures_an_exactly_low_rank_gradient_space():
  X, y, B = _logistic_problem()
  res = sgd.public_gradient_subspace(_loss, jnp.zeros(20), (X[:100], y[:100]), k=3)
  assert bool(res.ok) and res.epsilon == 0.0 and res.basis.shape == (20, 3)
  assert float(metrics.projection_distance(res.basis, B)) < 1e-3


@pytest.mark.parametrize("subspace", ["none", "public"])
def test_training_decreases_the_loss_within_budget(subspace):
  X, y, _ = _logistic_problem()
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


def test_training_is_deterministic_for_a_fixed_key():
  X, y, _ = _logistic_problem(n=500)
  run = lambda: sgd.train_dp_sgd(jax.random.key(2), _loss, jnp.zeros(20), (X, y), optax.sgd(0.1),
                                 epsilon=1.0, delta=1e-5, steps=5, expected_batch_size=50,
                                 clip_norm=1.0)
  assert jnp.array_equal(run().params, run().params)


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


def test_private_subspace_succeeds_on_exactly_low_rank_gradients():
  """Gradients of a linear model on x = Bz lie in span(B): DPASE finds it under add/remove."""
  X, y, B = _logistic_problem(n=8_000)
  res = sgd.private_gradient_subspace(jax.random.key(5), _loss, jnp.zeros(20), (X, y), k=3,
                                      epsilon=1.0, delta=1e-6, gamma=1e-6)
  assert res.neighbouring == "add_remove"
  assert bool(res.ok) and float(metrics.projection_distance(res.basis, B)) < 0.1


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
])
def test_bad_arguments(kwargs, match):
  X, y, _ = _logistic_problem(n=300)
  args = dict(epsilon=1.0, delta=1e-5, steps=2, expected_batch_size=30, clip_norm=1.0) | kwargs
  with pytest.raises((ValueError, TypeError), match=match):
    sgd.train_dp_sgd(jax.random.key(0), _loss, jnp.zeros(20), (X, y), optax.sgd(0.1), **args)
