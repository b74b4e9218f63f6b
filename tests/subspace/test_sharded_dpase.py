"""DPASE with its per-subset solves sharded over the devices of a mesh (``mesh=``;
docs/algorithms.md §2.2): the same output as on one device for a fixed key.

The multi-device case runs in a subprocess with four simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4`` takes effect only before JAX starts),
so this process keeps one device.
"""

import jax
import numpy as np
import pytest

from dpjax import data
from dpjax.subspace import approximate
from helpers import run_on_devices

N, D, K, GAMMA = 2_000, 10, 2, 1e-5
KW = dict(epsilon=1.0, delta=1e-6, k=K, gamma=GAMMA)


def _one_device_mesh(*axes):
  devices = np.array(jax.devices()[:1]).reshape((1,) * len(axes))
  return jax.sharding.Mesh(devices, axes)


@pytest.mark.slow(reason="DPASE on 1-device meshes (one and two axes) equals plain; by default "
                         "only mesh checks run")
def test_a_one_device_mesh_changes_nothing():
  X, _ = data.approximate_subspace_data(jax.random.key(0), N, D, K, gamma=GAMMA)
  key = jax.random.key(3)
  plain = approximate.dpase(key, X, **KW)
  sharded = approximate.dpase(key, X, mesh=_one_device_mesh("subsets"), **KW)
  assert bool(plain.ok) and bool(sharded.ok) == bool(plain.ok)
  assert int(sharded.released["winning_count"]) == int(plain.released["winning_count"])
  np.testing.assert_array_equal(np.asarray(sharded.basis), np.asarray(plain.basis))
  # The other axis of a two-axis mesh replicates.
  two = approximate.dpase(key, X, mesh=_one_device_mesh("data", "subsets"), mesh_axis="subsets",
                          **KW)
  np.testing.assert_array_equal(np.asarray(two.basis), np.asarray(plain.basis))


@pytest.mark.parametrize("mesh,axis,exc,match", [
    ("devices", None, TypeError, "jax.sharding.Mesh"),
    (_one_device_mesh("subsets"), "rows", ValueError, "not an axis"),
    (_one_device_mesh("data", "subsets"), None, ValueError, "mesh_axis"),
])
def test_bad_meshes_raise_before_tracing(mesh, axis, exc, match):
  X = np.zeros((N, D), np.float32)
  with pytest.raises(exc, match=match):
    approximate.dpase(jax.random.key(0), X, mesh=mesh, mesh_axis=axis, **KW)
  with pytest.raises(exc, match=match):
    approximate.dpase(jax.random.key(0), lambda rows: None, n=N, d=D, dtype=np.float32,
                      mesh=mesh, mesh_axis=axis, **KW)


_FOUR_DEVICES = """
import json
import jax, jax.numpy as jnp, numpy as np
from dpjax import linalg
from dpjax.subspace import approximate as A
from dpjax.subspace import partition as P
assert len(jax.devices()) == 4
N, D, K, GAMMA = {N}, {D}, {K}, {GAMMA}
KW = dict(epsilon=1.0, delta=1e-6, k=K, gamma=GAMMA)
rng = np.random.default_rng(0)                # NumPy data: no generator to compile
basis = np.linalg.qr(rng.standard_normal((D, K)))[0]
X = jnp.asarray(rng.standard_normal((N, K)) @ basis.T + GAMMA * rng.standard_normal((N, D)),
                jnp.float32)
key = jax.random.key(3)
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("subsets",))
out = {{}}
for partition in {PARTITIONS}:
  one = A.dpase(key, X, partition=partition, **KW)
  four = A.dpase(key, X, partition=partition, mesh=mesh, **KW)
  out[partition] = dict(ok=[bool(one.ok), bool(four.ok)],
                        count=[int(one.released["winning_count"]),
                               int(four.released["winning_count"])],
                        basis=float(jnp.max(jnp.abs(one.basis - four.basis))),
                        devices=len(four.basis.sharding.device_set))
if {FULL}:
  gather = lambda rows: X.at[rows].get(mode="fill", fill_value=0)
  one = A.dpase(key, gather, n=N, d=D, dtype=jnp.float32, **KW)
  four = A.dpase(key, gather, n=N, d=D, dtype=jnp.float32, mesh=mesh, **KW)
  out["gathered"] = dict(ok=[bool(one.ok), bool(four.ok)],
                         count=[int(one.released["winning_count"]),
                                int(four.released["winning_count"])],
                         basis=float(jnp.max(jnp.abs(one.basis - four.basis))),
                         devices=len(four.basis.sharding.device_set))
  grid = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "subsets"))
  two = A.dpase(key, X, mesh=grid, mesh_axis="subsets", **KW)       # "data" replicates
  out["two_axes"] = dict(ok=[bool(one.ok), bool(two.ok)],
                         count=[int(one.released["winning_count"]),
                                int(two.released["winning_count"])],
                         basis=float(jnp.max(jnp.abs(one.basis - two.basis))),
                         devices=len(two.basis.sharding.device_set))
  # dpase on an array under an outer jax.jit: the sharded solves and the rest in one program.
  run = lambda key, X, mesh: A.dpase(key, X, partition="random_labels", mesh=mesh,
                                     top_k_method="subspace_iteration", **KW)
  ref = run(key, X, None)
  jitted = jax.jit(lambda key, X: run(key, X, mesh))(key, X)
  out["jit"] = dict(ok=[bool(ref.ok), bool(jitted.ok)],
                    count=[int(ref.released["winning_count"]),
                           int(jitted.released["winning_count"])],
                    basis=float(jnp.max(jnp.abs(ref.basis - jitted.basis))), devices=4)
# The (t, d, k) bases themselves: t = 38 subsets padded to 40 over 4 devices, 2 dropped.
params = A.dpase_parameters(N, D, K, epsilon=1.0, delta=1e-6, gamma=GAMMA)
index = P.random_label_index(jax.random.split(key, 5)[0], N, params.num_subsets,
                             P.subset_capacity(params.subset_size))
solve = lambda X, block: linalg.gathered_top_k_subspaces(X, block, K)
plain = A._sharded(solve, X, index, N, None, None)
sharded = A._sharded(solve, X, index, N, mesh, "subsets")
# The subspace iteration too (its while_loop carry becomes device-varying under shard_map).
iterate = lambda X, block: linalg.gathered_top_k_subspaces(X, block, K,
                                                           method="subspace_iteration")
iter_diff = jnp.max(jnp.abs(A._sharded(iterate, X, index, N, None, None)
                            - A._sharded(iterate, X, index, N, mesh, "subsets")))
out["bases"] = dict(t=params.num_subsets, shape=list(sharded.shape),
                    diff=float(jnp.max(jnp.abs(plain - sharded))), iter_diff=float(iter_diff))
print(json.dumps(out))
"""


def _on_four_devices(partitions, full):
  code = _FOUR_DEVICES.format(N=N, D=D, K=K, GAMMA=GAMMA, PARTITIONS=partitions, FULL=full)
  out = run_on_devices(code, devices=4)        # a run that answers takes 10–25 s here
  for name, res in out.items():
    if name != "bases":
      assert res["ok"] == [True, True], (name, res)
      assert res["count"][0] == res["count"][1], (name, res)
      assert res["basis"] <= 1e-5, (name, res)
      assert res["devices"] == 4, (name, res)                # replicated over the mesh
  assert out["bases"]["t"] % 4 != 0                          # the padding is exercised
  assert out["bases"]["shape"] == [out["bases"]["t"], D, K]
  # A CPU mesh solves one subset per call (no batched LAPACK: approximate._sharded), the plain
  # path vmaps: equal to float32 rounding (2e-6 measured).
  assert out["bases"]["diff"] <= 1e-5 and out["bases"]["iter_diff"] <= 1e-5
  return out


@pytest.mark.slow(reason="DPASE on 4 devices equals 1 device (a subprocess); by default only mesh "
                         "checks run")
def test_four_devices_give_the_one_device_output():
  _on_four_devices(("random_labels",), False)


@pytest.mark.slow(reason="all partitions, a gather function, two axes and jit on 4 devices; by "
                         "default only mesh checks")
def test_four_devices_give_the_one_device_output_for_every_variant():
  out = _on_four_devices(approximate.PARTITIONS, True)
  assert set(out) == {*approximate.PARTITIONS, "gathered", "two_axes", "jit", "bases"}
