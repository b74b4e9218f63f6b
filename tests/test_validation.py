"""Every public entry point validates its arguments before tracing, naming the argument.

One table of (entry point, bad argument, expected error) over the whole public API, plus key
hygiene: same key ⇒ bit-identical output, different keys ⇒ different output, for every sampler
and learner.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpjax
from dpjax import data, mechanisms as M, sgd

KEY = jax.random.key(0)
X_GOOD = np.asarray(data.approximate_subspace_data(KEY, 2_000, 10, 2, gamma=1e-5)[0])


def _dpase(**kw):
  args = dict(key=KEY, X=X_GOOD, epsilon=1.0, delta=1e-6, k=2, gamma=1e-5) | kw
  key, X = args.pop("key"), args.pop("X")
  return dpjax.dpase(key, X, **args)


def _loss(w, ex):
  return optax.sigmoid_binary_cross_entropy(ex[0] @ w, ex[1])


def _train(**kw):
  X = kw.pop("X", X_GOOD)
  key = kw.pop("key", KEY)
  args = dict(epsilon=1.0, delta=1e-5, steps=2, expected_batch_size=50, clip_norm=1.0) | kw
  y = jnp.zeros(X.shape[0])
  return sgd.train_dp_sgd(key, _loss, jnp.zeros(10), (jnp.asarray(X), y),
                          optax.sgd(0.1), **args)


def _with_nan(X):
  X = np.array(X, np.float32)
  X[3, 1] = np.nan
  return X


def _with_inf(X):
  X = np.array(X, np.float32)
  X[0, 0] = np.inf
  return X


CASES = [
    # DPASE
    ("dpase NaN", lambda: _dpase(X=_with_nan(X_GOOD)), ValueError, "NaN"),
    ("dpase inf", lambda: _dpase(X=_with_inf(X_GOOD)), ValueError, "infinite"),
    ("dpase rank", lambda: _dpase(X=X_GOOD[None]), ValueError, "dimensions"),
    ("dpase dtype", lambda: _dpase(X=X_GOOD > 0), TypeError, "dtype"),
    ("dpase eps", lambda: _dpase(epsilon=0.0), ValueError, "epsilon"),
    ("dpase eps type", lambda: _dpase(epsilon="1"), TypeError, "epsilon"),
    ("dpase delta", lambda: _dpase(delta=1.0), ValueError, "delta"),
    ("dpase k low", lambda: _dpase(k=0), ValueError, "k"),
    ("dpase k high", lambda: _dpase(k=11), ValueError, "k"),
    ("dpase k type", lambda: _dpase(k=2.5), TypeError, "k"),
    ("dpase n small", lambda: _dpase(X=X_GOOD[:50]), ValueError, "n is too small"),
    ("dpase key", lambda: _dpase(key=np.zeros(3, np.uint32)), TypeError, "key"),
    # training
    ("train NaN", lambda: _train(X=_with_nan(X_GOOD)), ValueError, "NaN"),
    ("train eps", lambda: _train(epsilon=-1.0), ValueError, "epsilon"),
    ("train delta", lambda: _train(delta=0.0), ValueError, "delta"),
    ("train steps", lambda: _train(steps=0), ValueError, "steps"),
    ("train k", lambda: _train(subspace="public", k=11, public_data=(jnp.zeros((5, 10)),
                                                                     jnp.zeros(5))),
     ValueError, "k"),
    ("train key", lambda: _train(key=1), TypeError, "key"),
    # subspace sources
    ("public k", lambda: sgd.public_gradient_subspace(_loss, jnp.zeros(10),
                                                      (jnp.zeros((3, 10)), jnp.zeros(3)), k=5),
     ValueError, "k"),
    # mechanisms
    ("laplace NaN", lambda: M.laplace_mechanism(KEY, np.array([np.nan]), sensitivity=1.0,
                                                epsilon=1.0), ValueError, "NaN"),
    ("laplace int", lambda: M.laplace_mechanism(KEY, np.array([1]), sensitivity=1.0,
                                                epsilon=1.0), TypeError, "float"),
    ("gaussian eps", lambda: M.gaussian_mechanism(KEY, jnp.ones(2), sensitivity=1.0,
                                                  epsilon=0.0, delta=1e-5), ValueError, "epsilon"),
    ("gaussian delta", lambda: M.gaussian_mechanism(KEY, jnp.ones(2), sensitivity=1.0,
                                                    epsilon=1.0, delta=-1.0), ValueError, "delta"),
    ("tlap inf", lambda: M.truncated_laplace_mechanism(KEY, jnp.array([jnp.inf]),
                                                       sensitivity=1.0, epsilon=1.0, delta=1e-5),
     ValueError, "NaN or infinite"),
    ("histogram key", lambda: M.stable_histogram(0, jnp.ones((3, 1), jnp.int32), epsilon=1.0,
                                                 delta=1e-5), TypeError, "key"),
    ("gap_max delta", lambda: M.gap_max(KEY, jnp.ones(3), epsilon=1.0, delta=1.0),
     ValueError, "delta"),
    ("exponential eps", lambda: M.exponential_mechanism(KEY, jnp.ones(3), sensitivity=1.0,
                                                        epsilon=-2.0), ValueError, "epsilon"),
    ("snapping key", lambda: M.snapping_mechanism("key", np.ones(2), sensitivity=1.0,
                                                  epsilon=1.0), TypeError, "key"),
    # accounting
    ("calibrate delta", lambda: dpjax.accounting.calibrate_noise_multiplier(1.0, 2.0, 0.1, 10),
     ValueError, "target_delta"),
    ("ledger eps", lambda: dpjax.accounting.PrivacyLedger(0.0, 1e-5), ValueError, "epsilon"),
    # data
    ("data gamma", lambda: data.approximate_subspace_data(KEY, 10, 5, 2, gamma=-0.1),
     ValueError, "gamma"),
]


@pytest.mark.parametrize("name,call,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(name, call, exc, match):
  with pytest.raises(exc, match=match):
    call()


SAMPLERS = {
    "laplace_mechanism": lambda k: M.laplace_mechanism(k, np.zeros(8), sensitivity=1.0,
                                                       epsilon=1.0),
    "laplace_mechanism_raw": lambda k: M.laplace_mechanism(k, jnp.zeros(8), sensitivity=1.0,
                                                           epsilon=1.0, secure=False),
    "gaussian_mechanism": lambda k: M.gaussian_mechanism(k, jnp.zeros(8), sensitivity=1.0,
                                                         epsilon=1.0, delta=1e-5),
    "truncated_laplace": lambda k: M.truncated_laplace(k, (8,), sensitivity=1.0, epsilon=1.0,
                                                       delta=1e-5),
    "discrete_laplace": lambda k: M.discrete_laplace(k, (32,), scale=3.0),
    "stable_histogram": lambda k: M.stable_histogram(
        k, jnp.array([[0]] * 20 + [[1]] * 20, jnp.int32), epsilon=1.0, delta=1e-3).noisy_counts,
    "gap_max": lambda k: jax.vmap(lambda kk: M.gap_max(kk, jnp.array([10.0, 2.0]), epsilon=1.0,
                                                       delta=0.1).ok)(jax.random.split(k, 64)),
    "exponential_mechanism": lambda k: jax.vmap(lambda kk: M.exponential_mechanism(
        kk, jnp.arange(4.0), sensitivity=1.0, epsilon=1.0))(jax.random.split(k, 32)),
    "dpase": lambda k: _dpase(key=k).basis,
    "approximate_subspace_data": lambda k: data.approximate_subspace_data(k, 5, 4, 2,
                                                                          gamma=0.1)[0],
    "poisson_mask": lambda k: sgd.poisson_mask(k, 64, 0.5),
    "train_dp_sgd": lambda k: _train(key=k).params,
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_same_key_bit_identical_different_key_different(name):
  draw = SAMPLERS[name]
  a, b, c = (np.asarray(draw(jax.random.key(s))) for s in (7, 7, 8))
  assert np.array_equal(a, b), "same key must give bit-identical output"
  assert not np.array_equal(a, c), "different keys must give different output"


def test_noise_transforms_never_reuse_their_key():
  tx = sgd.dp_gaussian_noise(clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=1.0,
                             key=KEY)
  state = tx.init(jnp.zeros(4))
  first, state1 = tx.update(jnp.zeros(4), state)
  second, state2 = tx.update(jnp.zeros(4), state1)
  assert not np.array_equal(first, second)
  assert not np.array_equal(jax.random.key_data(state1.key), jax.random.key_data(KEY))
  # The returned key is not the one the noise came from: redrawing from it differs.
  assert not np.array_equal(first, jax.random.normal(state1.key, (4,)))
