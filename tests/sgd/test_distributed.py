"""Data-parallel DP-SGD (dpjax.sgd.distributed; docs/algorithms.md §6.6).

The multi-device checks run in a subprocess with 4 simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``, :func:`helpers.run_on_devices`), so the
rest of the suite keeps one device. The audit of one sharded step is in
tests/audit/test_distributed_audits.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import sgd
from dpjax.sgd import distributed
from helpers import run_on_devices

# Shared by this process and the 4-device subprocess. N is not a multiple of 4: padding runs.
_SETUP = """
import json
import jax, jax.numpy as jnp, numpy as np, optax
from dpjax import sgd
from helpers import normal
N, D = 1001, 6
X = normal(0, (N, D)); Y = (X[:, 0] > 0).astype(jnp.float32)
def loss(w, ex):
  x, t = ex
  return optax.sigmoid_binary_cross_entropy(x @ w, t)
def train(**kw):
  # RDP: PLD's calibration at these budgets takes tens of seconds (the accountant is not the
  # subject here).
  args = dict(epsilon=2.0, delta=1e-5, steps=3, expected_batch_size=100, clip_norm=1.0,
              microbatch_size=32, accountant="rdp") | kw
  return sgd.train_dp_sgd(jax.random.key(1), loss, jnp.zeros(D), (X, Y), optax.sgd(0.5), **args)
def zero_loss(w, ex):
  return 0.0 * jnp.sum(w)
def noise_per_step(**kw):
  # Zero gradients and SGD with lr 1: each step's update is minus the noise divided by L.
  hist = sgd.train_dp_sgd(jax.random.key(2), zero_loss, jnp.zeros(64), (X, Y), optax.sgd(1.0),
                          epsilon=1.0, delta=1e-5, steps=100, expected_batch_size=50.0,
                          clip_norm=2.0, eval_fn=lambda w: {"w": np.asarray(w)}, eval_every=1,
                          accountant="rdp", **kw)
  w = np.stack([np.zeros(64)] + [h["w"] for h in hist.history])
  steps = np.diff(w, axis=0)
  return {"std": float(steps.std()), "expected": float(hist.budget.noise_multiplier * 2.0 / 50.0)}
"""

_FOUR = _SETUP + """
assert jax.device_count() == 4
mesh = sgd.data_mesh()
public = (normal(9, (200, D)), jnp.zeros(200))
sub = dict(subspace="public", k=2, public_data=public)
out = {"one": np.asarray(train().params).tolist(),
       "four": np.asarray(train(mesh=mesh).params).tolist(),
       "sub_one": np.asarray(train(**sub).params).tolist(),
       "sub_four": np.asarray(train(mesh=mesh, **sub).params).tolist(),
       "noise": noise_per_step(mesh=mesh)}
# The plan's clipped sum with the examples sharded over the mesh (prepare pads N = 1001 to
# 1004) and without: the same Poisson sample, summed per device then psum-ed.
def plan(**kw):
  return sgd.dp_sgd_plan(sgd.clipped_grad_sum(loss, clip_norm=1.0), num_examples=N,
                         expected_batch_size=0.3 * N, steps=1, key=jax.random.key(0),
                         noise_multiplier=0.0, microbatch_size=16, **kw)
sharded, single = plan(mesh=mesh), plan()
prepared = sharded.prepare((X, Y))
assert prepared[0].shape[0] == 1004 and len(prepared[0].sharding.device_set) == 4
# Both plans hold the same key: the same sample (drawn from the state's key).
summed = sharded.clipped_sum(jnp.zeros(D), prepared, sharded.init(jnp.zeros(D), optax.sgd(1.0)))
out["sum_sharded"] = np.asarray(summed).tolist()
out["sum_single"] = np.asarray(single.clipped_sum(
    jnp.zeros(D), (X, Y), single.init(jnp.zeros(D), optax.sgd(1.0)))).tolist()
# Cyclic Poisson (BandMF) and fixed-size sampling: the same sample, sharded.
for name, kw in (("cyclic", dict(noise_strategy=sgd.banded_toeplitz([1.0, 0.5]))),
                 ("fixed", dict(fixed_size=True, accountant="rdp"))):
  def scheme(**more):
    return sgd.dp_sgd_plan(sgd.clipped_grad_sum(loss, clip_norm=1.0), num_examples=N,
                           expected_batch_size=100, steps=2, key=jax.random.key(3),
                           noise_multiplier=1.0, microbatch_size=16, **kw, **more)
  a, b = scheme(mesh=mesh), scheme()
  out[name] = [np.asarray(a.clipped_sum(jnp.zeros(D), a.prepare((X, Y)),
                                        a.init(jnp.zeros(D), optax.sgd(1.0)))).tolist(),
               np.asarray(b.clipped_sum(jnp.zeros(D), (X, Y),
                                        b.init(jnp.zeros(D), optax.sgd(1.0)))).tolist()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def four_devices():
  return run_on_devices(_FOUR, devices=4)


@pytest.mark.slow(reason="4-device training equals 1-device (a subprocess); the default run "
                         "audits a 4-device step")
def test_one_and_four_devices_agree_for_a_fixed_key(four_devices):
  """Same key, same Poisson samples, same noise: the sharded run is the single-device run up to
  the order of float additions."""
  np.testing.assert_allclose(four_devices["four"], four_devices["one"], rtol=1e-5, atol=1e-6)
  # Subspace projection works the same way (the noise in span(V), added once after the psum).
  np.testing.assert_allclose(four_devices["sub_four"], four_devices["sub_one"], rtol=1e-5,
                             atol=1e-6)
  assert not np.allclose(four_devices["sub_one"], four_devices["one"])
  np.testing.assert_allclose(four_devices["sum_sharded"], four_devices["sum_single"],
                             rtol=1e-5, atol=1e-5)
  for scheme in ("cyclic", "fixed"):                 # cyclic Poisson and fixed-size samples
    sharded, single = four_devices[scheme]
    np.testing.assert_allclose(sharded, single, rtol=1e-5, atol=1e-5)
    assert np.linalg.norm(single) > 0
  assert np.linalg.norm(four_devices["one"]) > 0


@pytest.mark.slow(reason="the noise of 4-device training is added once; the default run audits "
                         "a 4-device step")
def test_the_noise_is_added_once_on_four_devices(four_devices):
  """One step's noise std is σC/L: noise drawn per device and summed would be 2× (√4)."""
  noise = four_devices["noise"]
  assert noise["std"] == pytest.approx(noise["expected"], rel=0.03)


@pytest.mark.slow(reason="training on a 1-device mesh equals the unsharded run; the default run "
                         "audits the sharded sum")
def test_a_one_device_mesh_gives_the_unsharded_run():
  ns = {}
  exec(_SETUP, ns)                                   # the same setup as the subprocess
  plain = ns["train"]().params
  meshed = ns["train"](mesh=sgd.data_mesh()).params
  np.testing.assert_allclose(np.asarray(meshed), np.asarray(plain), rtol=1e-6, atol=1e-7)
  noise = ns["noise_per_step"]()
  assert noise["std"] == pytest.approx(noise["expected"], rel=0.03)


def test_padding_and_placement():
  mesh = sgd.data_mesh()
  assert distributed.padded_size(10, mesh) == 10
  X = np.arange(12.0).reshape(6, 2)
  placed, n = distributed.shard_examples({"x": X}, mesh)
  assert n == 6 and placed["x"].shape == (6, 2)
  np.testing.assert_array_equal(np.asarray(placed["x"]), X)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(mesh="cpu"), TypeError, "jax.sharding.Mesh"),
    (dict(data_axis="batch"), ValueError, "not an axis"),
])
def test_bad_mesh_arguments_raise_clear_errors(kwargs, exc, match):
  ns = {}
  exec(_SETUP, ns)
  if "mesh" not in kwargs:
    kwargs = dict(kwargs, mesh=sgd.data_mesh())
  with pytest.raises(exc, match=match):
    ns["train"](steps=1, **kwargs)


def test_sharded_sum_rejects_unpadded_data():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  fn = sgd.clipped_grad_sum(lambda w, x: jnp.dot(w, x), clip_norm=1.0)
  with pytest.raises(ValueError, match="padded_size"):
    distributed.sharded_poisson_clipped_sum(fn, jnp.zeros(2), jnp.ones((5, 2)),
                                            jax.random.key(0), num_examples=4, sampling_prob=0.5,
                                            microbatch_size=2, mesh=mesh)
