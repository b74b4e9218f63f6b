"""Two processes on localhost (``jax.distributed.initialize``, CPU collectives over gloo), each
holding half the rows: one data-parallel DP-SGD step and one sharded DPASE call give the
single-process answers (docs/algorithms.md §6.6, README "DP-SGD on several devices")."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax import sgd, subspace
from dpjax.sgd import sampling
from helpers import normal

ROOT = pathlib.Path(__file__).resolve().parents[2]
N, D, SIGMA, C, L = 1_000, 6, 1.5, 1.0, 100.0

_WORKER = """
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[2], num_processes=2,
                           process_id=int(sys.argv[1]))
import jax.numpy as jnp, numpy as np, optax
from jax.sharding import NamedSharding, PartitionSpec
from dpjax import sgd
from helpers import normal
N, D, SIGMA, C, L = {N}, {D}, {SIGMA}, {C}, {L}
pid = jax.process_index()
X = np.asarray(normal(0, (N, D))); Y = (X[:, 0] > 0).astype(np.float32)
half = slice(pid * N // 2, (pid + 1) * N // 2)            # this process's rows only
mesh = sgd.data_mesh()
rows = NamedSharding(mesh, PartitionSpec("data"))
data = (jax.make_array_from_process_local_data(rows, X[half]),
        jax.make_array_from_process_local_data(rows, Y[half]))
loss = lambda w, ex: optax.sigmoid_binary_cross_entropy(ex[0] @ w, ex[1])
# The plan over the global mesh: its sharded clipped sum (each process's rows) and its noise.
plan = sgd.dp_sgd_plan(sgd.clipped_grad_sum(loss, clip_norm=C), num_examples=N,
                       expected_batch_size=L, steps=1, key=jax.random.key(7),
                       noise_multiplier=SIGMA, accountant="rdp", microbatch_size=64, mesh=mesh)
state = plan.noise.init(jnp.full(D, 0.1))
@jax.jit
def step(params, data, state):
  summed = plan.clipped_sum(params, data, state)
  update, _ = plan.noise.update(summed, state)
  return update
out = step(jnp.full(D, 0.1), data, state)
# DPASE: each process's rows are all-gathered (the sharded DPASE keeps X on every device), then
# the subsets' top-k solves are sharded over the devices of both processes.
from jax.experimental import multihost_utils
from dpjax import subspace
Z = np.asarray(normal(1, (2_000, 8))) * np.r_[np.ones(2), np.full(6, 1e-4)]
rows_z = jax.make_array_from_process_local_data(rows, Z[pid * 1000:(pid + 1) * 1000])
full = np.asarray(multihost_utils.process_allgather(rows_z, tiled=True))
res = subspace.dpase(jax.random.key(5), full, epsilon=1.0, delta=1e-6, k=2, gamma=1e-3,
                     partition="random_labels", mesh=sgd.data_mesh())
print(json.dumps({{"process": pid, "devices": jax.device_count(),
                  "update": np.asarray(jax.device_get(out)).tolist(),
                  "dpase_ok": bool(res.ok),
                  "dpase_count": int(res.released["winning_count"]),
                  "dpase_basis": np.asarray(res.basis).tolist()}}))
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow(reason="two JAX processes (gloo); the default run audits the sharded step on "
                         "4 devices in one")
def test_two_processes_give_the_single_process_step():
  code = _WORKER.format(N=N, D=D, SIGMA=SIGMA, C=C, L=L)
  address = f"127.0.0.1:{_free_port()}"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
             PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
  procs = [subprocess.Popen([sys.executable, "-c", code, str(i), address], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = []
  for p in procs:
    try:
      stdout, stderr = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise AssertionError("the two processes gave no answer in 240 s (a hang; "
                           "docs/algorithms.md §2.2 has the one found so far)")
    assert p.returncode == 0, stderr[-3000:]
    outs.append(json.loads(stdout.strip().splitlines()[-1]))
  assert [o["devices"] for o in outs] == [2, 2]
  # The single-process step: the same sample (one key), the same sum, the same noise (one key).
  X = normal(0, (N, D))
  data = (X, (X[:, 0] > 0).astype(jnp.float32))
  loss = lambda w, ex: optax.sigmoid_binary_cross_entropy(ex[0] @ w, ex[1])
  grad_fn = sgd.clipped_grad_sum(loss, clip_norm=C)
  summed = sampling.poisson_clipped_sum(grad_fn, jnp.full(D, 0.1), data, jax.random.key(3),
                                        sampling_prob=L / N, microbatch_size=64)
  tx = sgd.dp_noise(grad_fn, noise_multiplier=SIGMA, expected_batch_size=L,
                    key=jax.random.key(7))
  single, _ = tx.update(summed, tx.init(jnp.zeros(D)))
  for o in outs:                                     # both processes hold the same update
    np.testing.assert_allclose(o["update"], np.asarray(single), rtol=1e-5, atol=1e-6)
  # One DPASE call across the two processes gives the single-process answer.
  Z = np.asarray(normal(1, (2_000, 8))) * np.r_[np.ones(2), np.full(6, 1e-4)]
  res = subspace.dpase(jax.random.key(5), Z, epsilon=1.0, delta=1e-6, k=2, gamma=1e-3,
                       partition="random_labels")
  assert bool(res.ok)
  for o in outs:
    assert o["dpase_ok"] and o["dpase_count"] == int(res.released["winning_count"])
    np.testing.assert_allclose(o["dpase_basis"], np.asarray(res.basis), atol=1e-5)
