"""The private training loop (docs/algorithms.md §6): budgets, subspace sources, fallbacks.

All runs share one data shape, loss, clip norm and optimiser so that the jitted steps (and DPASE)
compile once for the whole module. They calibrate σ with RDP (``accountant="rdp"``): at these
small σ (q = 0.025, T ≤ 30) PLD's calibration takes 25–65 s per budget against RDP's 1–4 s.
The default accountant (PLD) is checked without calibrating
(test_the_default_accountant_is_pld); test_plan calibrates by PLD where it is cheap.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_accounting import NeighboringRelation

from dpjax import accounting, data, sgd
from dpjax.ledger import PrivacyLedger
from helpers import normal

N, D, K = 8_000, 20, 3
OPT = optax.sgd(0.5)
# The private subspace gets ε_s = 0.25·4 = 1 and δ_s = 0.1·1e-5, as in test_subspace_sources.
PRIVATE = dict(epsilon=4.0, delta=1e-5, subspace_epsilon_fraction=0.25, gamma=1e-6)


@functools.lru_cache(maxsize=None)
def _low_rank():
  """Logistic regression on x = B z: every per-example gradient lies in span(B).

  Returns ``(X, y)`` private rows, ``(X_pub, y_pub)`` disjoint public rows, and ``B``.
  """
  # Jitted: the same values as op by op, with less compilation.
  X, B = jax.jit(data.exact_subspace_data, static_argnums=(1, 2, 3))(
      jax.random.key(0), N + 200, D, K)
  y = (X @ B[:, 0] > 0).astype(jnp.float32)
  return (X[:N], y[:N]), (X[N:], y[N:]), B


@functools.lru_cache(maxsize=None)
def _isotropic():
  X = normal(3, (N, D))
  return X, (X[:, 0] > 0).astype(jnp.float32)


def _loss(w, example):
  x, y = example
  return optax.sigmoid_binary_cross_entropy(x @ w, y)


def _full_loss(w, X, y):
  return float(jnp.mean(jax.vmap(_loss, in_axes=(None, 0))(w, (X, y))))


def _train(key, train_data, **kwargs):
  args = dict(epsilon=4.0, delta=1e-5, steps=2, expected_batch_size=200, clip_norm=1.0,
              accountant="rdp") | kwargs
  return sgd.train_dp_sgd(jax.random.key(key), _loss, jnp.zeros(D), train_data, OPT, **args)


@pytest.mark.parametrize("subspace", [
    "none",
    pytest.param("public", marks=pytest.mark.slow(reason="training in a public subspace; the "
                                                         "default run trains without one"))])
def test_training_decreases_the_loss_within_budget(subspace):
  (X, y), public, B = _low_rank()
  # ε = 2: σ's RDP calibration takes ~0.9 s (~1.5 s at ε = 4); the loss still falls to ~0.34×.
  out = _train(1, (X, y), epsilon=2.0, steps=30, subspace=subspace, k=K, public_data=public,
               eval_fn=lambda w: {"loss": _full_loss(w, X, y)}, eval_every=15)
  assert out.budget.epsilon <= 2.0 + 1e-9 and out.budget.delta <= 1e-5 * (1 + 1e-12)
  assert out.budget.neighboring == NeighboringRelation.ADD_OR_REMOVE_ONE and out.budget.steps == 30
  assert out.budget.sampling_prob == pytest.approx(200 / N)
  assert _full_loss(out.params, X, y) < 0.8 * _full_loss(jnp.zeros(D), X, y)
  assert [h["step"] for h in out.history] == [15, 30]
  assert out.history[-1]["loss"] < out.history[0]["loss"] * 1.1
  assert out.subspace_ok == (None if subspace == "none" else True)
  if subspace == "public":       # noise and signal only in the public span(B) ∋ w
    residual = out.params - B @ (B.T @ out.params)
    assert float(jnp.linalg.norm(residual)) < 1e-3 * float(jnp.linalg.norm(out.params))


@pytest.mark.slow(reason="normalised clipping and weight averaging; the default run trains with "
                         "plain clipping")
def test_normalised_clipping_and_weight_averaging():
  """The strong-baseline options: automatic clipping trains; the EMA of the iterates is returned
  and evaluated, starts at the initial params and lags the last iterate."""
  (X, y), _, _ = _low_rank()
  seen = []
  out = _train(11, (X, y), steps=20, clipping="normalize", weight_ema=0.9,
               eval_fn=lambda w: seen.append(w) or {"loss": _full_loss(w, X, y)}, eval_every=20)
  assert out.averaged_params is not None and out.averaged_params.shape == (D,)
  assert _full_loss(out.averaged_params, X, y) < 0.8 * _full_loss(jnp.zeros(D), X, y)
  assert jnp.array_equal(seen[-1], out.averaged_params)
  assert not jnp.allclose(out.averaged_params, out.params)
  # The average is a convex combination of the iterates: a one-step run averages w0 and w1.
  one = _train(11, (X, y), steps=1, clipping="normalize", weight_ema=0.9)
  np.testing.assert_allclose(np.asarray(one.averaged_params), 0.9 * np.asarray(one.params),
                             rtol=1e-6)                             # β_0 = min(0.9, 1/10)
  assert _train(11, (X, y), steps=1).averaged_params is None


@pytest.mark.slow(reason="train_dp_sgd is deterministic per key; the default run trains once per "
                         "key")
def test_training_is_deterministic_for_a_fixed_key():
  train, _, _ = _low_rank()
  first = _train(2, train, steps=5).params
  assert jnp.array_equal(first, _train(2, train, steps=5).params)
  assert not jnp.array_equal(first, _train(3, train, steps=5).params)


@pytest.mark.slow(reason="micro-batches leave the step unchanged; poisson_clipped_sum's coverage "
                         "is tested by default")
def test_microbatching_does_not_change_the_step():
  """Same key → same Poisson samples; splitting them into micro-batches only re-associates sums."""
  train, _, _ = _low_rank()
  a = _train(7, train, steps=3, microbatch_size=64, progress=True).params
  b = _train(7, train, steps=3).params
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.slow(reason="training in the DPASE subspace when it answers; no private-subspace "
                         "training runs by default")
def test_private_subspace_is_used_when_dpase_answers():
  train, _, B = _low_rank()
  out = _train(8, train, subspace="private", k=K, **PRIVATE)
  assert out.subspace_ok is True
  b = out.budget
  assert b.subspace_epsilon == pytest.approx(1.0) and b.subspace_delta == pytest.approx(1e-6)
  assert b.epsilon == pytest.approx(b.subspace_epsilon + b.sgd_epsilon) and b.epsilon <= 4.0
  assert b.delta == pytest.approx(1e-5)
  # Every update lies in the learned span, which is close to span(B).
  residual = out.params - B @ (B.T @ out.params)
  assert float(jnp.linalg.norm(residual)) < 0.1 * float(jnp.linalg.norm(out.params))


@pytest.mark.slow(reason="DPASE ⊥ falls back to DP-SGD and pays; no private-subspace training "
                         "runs by default")
def test_private_subspace_bottom_falls_back_to_plain_dp_sgd_and_pays():
  """Isotropic gradients: DPASE says ⊥, training continues privately, the budget is spent."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = _train(4, _isotropic(), steps=3, subspace="private", k=K, **PRIVATE)
  assert out.subspace_ok is False
  assert any("⊥" in str(w.message) for w in caught)
  assert out.budget.subspace_epsilon == pytest.approx(1.0) and out.budget.epsilon <= 4.0 + 1e-9
  # The σ that runs is the one planned with the subspace's share taken out.
  assert out.budget == accounting.plan_dpsgd_budget(4.0, 1e-5, sampling_prob=200 / N, steps=3,
                                                    subspace_epsilon=4.0 * 0.25,
                                                    subspace_delta=1e-5 * 0.1)
  assert bool(jnp.all(jnp.isfinite(out.params))) and float(jnp.linalg.norm(out.params)) > 0


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
    (dict(subspace="private", k=D + 1, gamma=0.1), "k"),
    (dict(subspace="private", k=2, gamma=0.1, dpase_kwargs={"partition": "permutation"}),
     "random_labels"),
    (dict(steps=0), "steps"),
    (dict(microbatch_size=0), "microbatch_size"),
    (dict(optimizer=0.1), "optimizer"),
    (dict(key=5), "key"),
    (dict(clipping="flat"), "clipping"),
    (dict(clipping="normalize", stability=-1.0), "stability"),
    (dict(weight_ema=1.0), "weight_ema"),
    (dict(tuning=accounting.HyperparameterTuning(3.0), accountant="pld"), "accountant='rdp'"),
    (dict(tuning=accounting.HyperparameterTuning(3.0), accountant="rdp", subspace="private",
          k=2, gamma=0.1), "subspace release"),
    (dict(tuning=accounting.HyperparameterTuning(3.0), accountant="rdp",
          ledger=PrivacyLedger(1.0, 1e-5)), "tuning_event"),
])
def test_bad_arguments(kwargs, match):
  X, y = _low_rank()[0]
  # RDP: train_dp_sgd checks microbatch_size only after calibrating σ (PLD here: ~45 s).
  args = dict(epsilon=1.0, delta=1e-5, steps=2, expected_batch_size=30, clip_norm=1.0,
              accountant="rdp") | kwargs
  key, optimizer = args.pop("key", jax.random.key(0)), args.pop("optimizer", OPT)
  with pytest.raises((ValueError, TypeError), match=match):
    sgd.train_dp_sgd(key, _loss, jnp.zeros(D), (X, y), optimizer, **args)


def test_a_tuning_run_is_calibrated_for_the_whole_tuning():
  """With ``tuning``, σ is the one that makes the best of the drawn runs (ε, δ)-DP (RDP), and
  the budget says so: a single run at that σ costs less than ε."""
  tuning = accounting.HyperparameterTuning(3.0)
  res = _train(0, _low_rank()[0], tuning=tuning)
  q = 200 / N
  assert res.budget.tuning == tuning and res.budget.epsilon <= 4.0
  assert res.budget.noise_multiplier == accounting.calibrate_noise_multiplier(
      4.0, 1e-5, q, 2, tuning=tuning)
  assert accounting.dpsgd_epsilon(res.budget.noise_multiplier, q, 2, 1e-5) < 4.0


def test_the_default_accountant_is_pld(monkeypatch):
  """train_dp_sgd plans its budget with PLD unless told otherwise (the calibration itself is
  dpjax.accounting's, tested there; here it is intercepted before it runs)."""
  seen = []

  class Planned(Exception):
    pass

  def spy(*args, **kwargs):
    seen.append(kwargs.get("accountant"))
    raise Planned

  monkeypatch.setattr(accounting, "plan_dpsgd_budget", spy)
  X, y = _low_rank()[0]
  for kwargs in ({}, {"accountant": "rdp"}):
    with pytest.raises(Planned):
      sgd.train_dp_sgd(jax.random.key(0), _loss, jnp.zeros(D), (X, y), OPT, epsilon=1.0,
                       delta=1e-5, steps=2, expected_batch_size=30, clip_norm=1.0, **kwargs)
  assert seen == ["pld", "rdp"]


def test_non_finite_data_is_refused_before_anything_runs():
  X, y = _low_rank()[0]
  with pytest.raises(ValueError, match="data"):
    _train(0, (X.at[5, 0].set(jnp.nan), y))
