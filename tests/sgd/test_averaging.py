"""iterate_average: an EMA of the iterates as an optax piece (post-processing; dpjax/sgd/
averaging.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax import sgd
from dpjax.sgd import averaging
from helpers import normal


def _params():
  return {"w": normal(0, (3, 2)), "b": jnp.zeros(2)}


def _gradients(steps):
  return [{"w": normal(10 + t, (3, 2)), "b": normal(50 + t, (2,))} for t in range(steps)]


def test_the_average_follows_the_warmed_up_ema_of_the_iterates_from_the_initial_params():
  """The rule train_dp_sgd's ``weight_ema`` used before it became an optax piece:
  ``w̄ ← optax.incremental_update(w_t, w̄, 1 − β_t)`` with ``β_t = min(β, (1 + t)/(10 + t))``,
  t = 0, 1, …, from ``w̄ = params₀``; the updates pass through unchanged."""
  decay, steps = 0.8, 12                        # β_t = (1 + t)/(10 + t) until t = 26: warm-up
  params = _params()
  plain = optax.sgd(0.1)
  tx = optax.chain(plain, sgd.iterate_average(decay))
  state, plain_state = tx.init(params), plain.init(params)
  update = jax.jit(tx.update)
  reference = params
  for t, g in enumerate(_gradients(steps)):
    updates, state = update(g, state, params)
    expected_updates, plain_state = plain.update(g, plain_state, params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, updates, expected_updates)
    params = optax.apply_updates(params, updates)
    reference = optax.incremental_update(params, reference, 1.0 - min(decay, (1 + t) / (10 + t)))
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                           sgd.averaged_params(state), reference)
  averaged = sgd.averaged_params(state)
  assert int(state[1].count) == steps
  assert not np.allclose(averaged["w"], params["w"])          # it lags the last iterate
  # One step: β_0 = min(β, 1/10), so w̄_1 = 0.1·w_0 + 0.9·w_1.
  one = tx.update(_gradients(1)[0], tx.init(_params()), _params())[1]
  w1 = optax.apply_updates(_params(), plain.update(_gradients(1)[0], plain.init(_params()))[0])
  np.testing.assert_allclose(sgd.averaged_params(one)["w"],
                             0.1 * _params()["w"] + 0.9 * w1["w"], rtol=1e-6)


def test_the_average_keeps_the_params_dtypes_and_its_decay_caps_the_warm_up():
  params = {"w": jnp.ones((2, 2), jnp.bfloat16), "b": jnp.zeros(2)}
  tx = averaging.iterate_average(0.05)                          # β_t = 0.05 from t = 0
  state = tx.init(params)
  updates = {"w": jnp.ones((2, 2), jnp.bfloat16), "b": jnp.ones(2)}
  _, state = tx.update(updates, state, params)
  assert state.average["w"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(state.average["b"]), 0.95, rtol=1e-6)   # 0.05·0 + 0.95·1


def test_params_are_required_and_averaged_params_finds_exactly_one_average():
  tx = sgd.iterate_average(0.9)
  state = tx.init(_params())
  with pytest.raises(ValueError, match="needs params"):
    tx.update(_params(), state)
  with pytest.raises(ValueError, match="found 0"):
    sgd.averaged_params(optax.sgd(0.1).init(_params()))
  with pytest.raises(ValueError, match="found 2"):
    sgd.averaged_params((state, state))


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5, float("nan")])
def test_the_decay_must_lie_strictly_between_zero_and_one(decay):
  with pytest.raises(ValueError, match="decay"):
    sgd.iterate_average(decay)
