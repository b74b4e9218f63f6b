"""Scaling: data-parallel DP-SGD and DPASE over devices, and streaming DPASE beyond memory.

Every device count runs in its own Python process (``XLA_FLAGS=
--xla_force_host_platform_device_count=D`` takes effect only at start-up), so on a CPU the
"devices" are simulated: they share the machine's cores, and the ratios say what the sharded
programs cost, not what more hardware would buy. On a GPU host (``--gpu``) the processes see the
real devices instead.

* DP-SGD: examples per second of one jitted data-parallel step (``dp_sgd_plan(..., mesh=
  data_mesh())``'s ``plan.step``: the Poisson sample's clipped sum of a one-hidden-layer MLP,
  ghost-clipped, ``--clipped-sum vmap`` for per-example gradients, summed per device and across
  devices; the noise once; SGD), plain and subspace-projected (``basis=``: noise in a public
  k-dimensional basis), on 1, 2 and 4 devices. Examples per second = the expected batch L over
  the median step time (the first call, compilation included, is reported apart).
* DPASE: the wall time of ``dpase`` (in memory) with its subsets' top-k SVDs sharded over 1 and
  4 devices (``mesh=``; on the CPU at n = 10^5, d = 1,000 by default). Each device count runs
  under ``--worker-timeout``; a run that gives no answer is recorded as failed (``null`` in the
  summary) rather than stopping the benchmark.
* Streaming: ``dpase`` on chunks of a float32 ``np.memmap`` on disk, with its
  process's peak resident memory (``VmHWM``) next to the ``n·d·4`` bytes the rows take; the
  in-memory DPASE on the file's first ``--n-in-memory`` rows (default min(n, 10^6): its peak
  was 15 GiB of this machine's 23 at 10^6) is timed in the same way.

    python benchmarks/scaling.py --json out.json              # streaming at n = 10^7, d = 1,000
    python benchmarks/scaling.py --quick --json out.json      # n = 10^6
    python benchmarks/scaling.py --gpu --json out.json        # on a GPU host: real devices

``--json PATH`` writes ``{"summary": {"dpsgd_examples_per_s": {"1": .., "2": .., "4": ..},
"dpase_seconds": {"1": .., "4": ..}, "streaming": {"n", "d", "seconds", "peak_rss_bytes"}},
...}`` with the per-run details (subspace-projected throughput, compile times, the in-memory
comparison) beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- workers: each runs in a fresh process and prints one JSON line ---------------------------

def _dpsgd_worker(args) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from dpjax import sgd
  from dpjax.sgd import ghost

  devices = jax.device_count()
  n, width, batch = args.n_train, args.width, args.batch
  rng = np.random.default_rng(0)
  X = rng.standard_normal((n, args.features)).astype(np.float32)
  y = rng.integers(0, 10, n).astype(np.int32)

  def init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (args.features, width)) / np.sqrt(args.features),
            "b1": jnp.zeros(width),
            "w2": jax.random.normal(k2, (width, 10)) / np.sqrt(width), "b2": jnp.zeros(10)}

  def apply_fn(p, x, *, dense):
    h = jax.nn.relu(dense({"w": p["w1"], "b": p["b1"]}, x))
    return dense({"w": p["w2"], "b": p["b2"]}, h)

  def example_loss(logits, t):
    return optax.softmax_cross_entropy_with_integer_labels(logits, t)

  params = init(jax.random.key(0))
  p = sum(x.size for x in jax.tree_util.tree_leaves(params))
  mesh = sgd.data_mesh()
  if args.clipped_sum == "ghost":
    grad_fn = sgd.ghost_clipped_grad_sum(apply_fn, example_loss, clip_norm=1.0)
  else:
    grad_fn = sgd.clipped_grad_sum(ghost.model_loss(apply_fn, example_loss), clip_norm=1.0)
  micro = int(np.ceil(batch / devices + 4 * np.sqrt(batch / devices)))
  out = {"devices": devices, "parameters": p, "batch": batch, "n": n,
         "clipped_sum": args.clipped_sum}
  optimizer = optax.sgd(0.1)
  for name in ("plain", "subspace"):
    basis = None
    if name == "subspace":
      basis, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(2), (p, args.rank)))
    # σ = 1 given (RDP: no PLD accounting to wait for; the budget is not what is measured).
    plan = sgd.dp_sgd_plan(grad_fn, num_examples=n, expected_batch_size=batch,
                           steps=args.steps + 2, noise_multiplier=1.0, accountant="rdp",
                           key=jax.random.key(1), basis=basis, mesh=mesh, microbatch_size=micro)
    data = plan.prepare((X, y))                     # padded, sharded over the mesh

    def step(params, opt_state, data, plan=plan):     # the plan draws each step's keys
      return plan.step(params, opt_state, data, optimizer)

    state = (params, plan.init(params, optimizer))
    start = time.perf_counter()
    state = jax.block_until_ready(step(*state, data))
    first = time.perf_counter() - start
    # One more untimed call: the state returned by the first call can differ from the initial
    # one in weak types or placement, which retraces once.
    state = jax.block_until_ready(step(*state, data))
    times = []
    for _ in range(args.steps):
      start = time.perf_counter()
      state = jax.block_until_ready(step(*state, data))
      times.append(time.perf_counter() - start)
    med = float(np.median(times))
    out[name] = {"examples_per_s": batch / med, "step_median_s": med, "first_call_s": first}
  return out


def _dpase_worker(args) -> dict:
  import jax
  import numpy as np
  from dpjax import data as dpdata
  from dpjax import subspace

  n, d, k = args.n_dpase, args.d_dpase, args.k
  X, _ = dpdata.approximate_subspace_data(jax.random.key(0), n, d, k, gamma=args.gap)
  X = np.asarray(X)
  kwargs = dict(epsilon=1.0, delta=1e-6, k=k, gamma=args.gap, partition="random_labels")
  mesh = None if jax.device_count() == 1 else jax.sharding.Mesh(np.array(jax.devices()),
                                                                ("subsets",))
  start = time.perf_counter()
  res = subspace.dpase(jax.random.key(1), X, mesh=mesh, **kwargs)
  jax.block_until_ready(res.basis)
  first = time.perf_counter() - start
  times = []
  for r in range(args.repeats):
    start = time.perf_counter()
    res = subspace.dpase(jax.random.key(2 + r), X, mesh=mesh, **kwargs)
    jax.block_until_ready(res.basis)
    times.append(time.perf_counter() - start)
  return {"devices": jax.device_count(), "n": n, "d": d, "k": k,
          "seconds": float(np.median(times)), "first_call_s": first, "ok": bool(res.ok)}


def _streaming_worker(args) -> dict:
  import jax
  import numpy as np
  from dpjax import subspace

  n, d, k = args.n_stream, args.d, args.k
  chunk = args.chunk
  kwargs = dict(epsilon=1.0, delta=1e-6, k=k, gamma=args.gap)
  rows = np.memmap(args.memmap, dtype=np.float32, mode="r", shape=(n, d))
  if args.in_memory:
    start = time.perf_counter()
    X = np.array(rows)                              # the rows read into memory
    res = subspace.dpase(jax.random.key(1), X, partition="random_labels", **kwargs)
    jax.block_until_ready(res.basis)
  else:
    start = time.perf_counter()
    res = subspace.dpase(jax.random.key(1), _memmap_chunks(args.memmap, n, d, chunk), n=n, d=d,
                         dtype=np.float32, **kwargs)
    jax.block_until_ready(res.basis)
  seconds = time.perf_counter() - start
  peak = _peak_rss_bytes()
  return {"n": n, "d": d, "k": k, "seconds": seconds, "peak_rss_bytes": int(peak),
          "rows_bytes": n * d * 4, "ok": bool(res.ok), "in_memory": bool(args.in_memory)}


def _peak_rss_bytes() -> int:
  """This process's peak resident memory: ``VmHWM`` of ``/proc/self/status`` on Linux, else
  ``ru_maxrss``. (Linux keeps ``ru_maxrss`` across ``fork`` + ``exec``, so a worker started by a
  driver that has just written a large memmap would report the driver's peak.)"""
  import resource
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024                                 # kB
  except OSError:
    pass
  scale = 1 if sys.platform == "darwin" else 1024                          # bytes / KiB
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _memmap_chunks(path: str, n: int, d: int, chunk: int):
  """The rows of a float32 file, ``chunk`` at a time: each chunk is mapped, copied and unmapped,
  so the file's pages do not stay resident (a memmap sliced in place keeps every page it has
  read counted in the peak resident memory, up to the whole file)."""
  import numpy as np
  for i in range(0, n, chunk):
    m = min(chunk, n - i)
    part = np.memmap(path, dtype=np.float32, mode="r", offset=4 * i * d, shape=(m, d))
    out = np.array(part)
    del part
    yield out


def _write_memmap(path: str, n: int, d: int, k: int, gap: float, chunk: int) -> None:
  """Rows ``x = z B + γ·w`` near a k-dim subspace, written chunk by chunk (never all in RAM)."""
  import numpy as np
  rng = np.random.default_rng(0)
  B = np.linalg.qr(rng.standard_normal((d, k)))[0].T                     # (k, d)
  out = np.memmap(path, dtype=np.float32, mode="w+", shape=(n, d))
  for i in range(0, n, chunk):
    m = min(chunk, n - i)
    out[i:i + m] = (rng.standard_normal((m, k)) @ B
                    + gap * rng.standard_normal((m, d)) / np.sqrt(d)).astype(np.float32)
  out.flush()
  del out


# --- the driver --------------------------------------------------------------------------------

def _run_worker(kind: str, devices: int, argv: list[str], gpu: bool,
                timeout: float | None = None) -> dict:
  env = dict(os.environ)
  if not gpu:
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={devices}").strip()
  else:
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(devices))
  env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
  try:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", kind, *argv],
                          env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"failed": f"no answer within {timeout:.0f} s (killed)"}
  if done.returncode != 0:
    raise RuntimeError(f"{kind} worker on {devices} devices failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="streaming at n = 10^6 (default 10^7)")
  ap.add_argument("--gpu", action="store_true",
                  help="run on the host's real devices (a GPU host); the model grows to ~10M "
                       "parameters and the in-memory DPASE to n = 10^7")
  ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
  ap.add_argument("--devices", default="1,2,4", help="DP-SGD device counts (default 1,2,4)")
  ap.add_argument("--n-train", type=int, default=60_000, help="DP-SGD training rows")
  ap.add_argument("--features", type=int, default=784, help="DP-SGD input width")
  ap.add_argument("--width", type=int, default=None,
                  help="DP-SGD hidden width (default 256; --gpu 12,288)")
  ap.add_argument("--batch", type=int, default=256, help="DP-SGD expected batch L")
  ap.add_argument("--rank", type=int, default=16, help="the projected step's subspace rank")
  ap.add_argument("--steps", type=int, default=10, help="timed DP-SGD steps")
  ap.add_argument("--clipped-sum", choices=("ghost", "vmap"), default="ghost",
                  help="DP-SGD's clipped sum: ghost clipping (default) or vmap(grad)")
  ap.add_argument("--n-dpase", type=int, default=None,
                  help="in-memory DPASE rows, 1 and 4 devices (default 10^5; --gpu 10^7)")
  ap.add_argument("--d-dpase", type=int, default=None,
                  help="in-memory DPASE dimension (default 1,000)")
  ap.add_argument("--worker-timeout", type=float, default=120.0,
                  help="seconds before a DPASE device-count run is recorded as failed")
  ap.add_argument("--n-stream", type=int, default=None,
                  help="streaming DPASE rows (default 10^7, --quick 10^6)")
  ap.add_argument("--d", type=int, default=1_000, help="streaming DPASE dimension")
  ap.add_argument("--k", type=int, default=5, help="DPASE subspace dimension")
  ap.add_argument("--gap", type=float, default=1e-6,
                  help="DPASE data's noise level and public gap γ (default 1e-6)")
  ap.add_argument("--chunk", type=int, default=10_000, help="streaming chunk rows (10,000)")
  ap.add_argument("--repeats", type=int, default=3, help="timed DPASE calls")
  ap.add_argument("--skip-in-memory", action="store_true",
                  help="skip the in-memory DPASE comparison")
  ap.add_argument("--n-in-memory", type=int, default=None,
                  help="rows of the in-memory comparison (default min(n-stream, 10^6))")
  ap.add_argument("--worker", choices=("dpsgd", "dpase", "streaming"), help=argparse.SUPPRESS)
  ap.add_argument("--memmap", help=argparse.SUPPRESS)
  ap.add_argument("--in-memory", action="store_true", help=argparse.SUPPRESS)
  return ap


def _forward(args, names) -> list[str]:
  out = []
  for name in names:
    value = getattr(args, name)
    if value is not None:
      out += [f"--{name.replace('_', '-')}", str(value)]
  return out


def main(argv=None) -> dict | None:
  args = _parser().parse_args(argv)
  if args.worker:
    worker = {"dpsgd": _dpsgd_worker, "dpase": _dpase_worker,
              "streaming": _streaming_worker}[args.worker]
    print(json.dumps(worker(args)))
    return None
  # Unset sizes: the CPU defaults, or the GPU ones (784·12288 + 12288·10 ≈ 9.8M parameters).
  if args.width is None:
    args.width = 12_288 if args.gpu else 256
  if args.n_dpase is None:
    args.n_dpase = 10**7 if args.gpu else 10**5
  if args.d_dpase is None:
    args.d_dpase = 1_000
  if args.n_stream is None:
    args.n_stream = 10**6 if args.quick else 10**7
  if args.n_in_memory is None:
    args.n_in_memory = min(args.n_stream, 10**6)
  counts = [int(c) for c in args.devices.split(",")]
  sgd_args = _forward(args, ["n_train", "features", "width", "batch", "rank", "steps",
                             "clipped_sum"])
  dpsgd = {c: _run_worker("dpsgd", c, sgd_args, args.gpu) for c in counts}
  for c, r in dpsgd.items():
    print(f"DP-SGD ({r['clipped_sum']}), {c} device(s), {r['parameters']:,} parameters, "
          f"L = {r['batch']}: "
          f"plain {r['plain']['examples_per_s']:,.0f} ex/s, subspace "
          f"{r['subspace']['examples_per_s']:,.0f} ex/s (first call "
          f"{r['plain']['first_call_s']:.1f} s)")
  dpase_args = _forward(args, ["n_dpase", "d_dpase", "k", "gap", "repeats"])
  dpase = {c: _run_worker("dpase", c, dpase_args, args.gpu, timeout=args.worker_timeout)
           for c in (1, 4)}
  for c, r in dpase.items():
    if "failed" in r:
      print(f"DPASE in memory, {c} device(s): {r['failed']}")
      continue
    print(f"DPASE in memory, n = {r['n']:,}, d = {r['d']}, {c} device(s): {r['seconds']:.2f} s "
          f"(ok = {r['ok']}, first call {r['first_call_s']:.1f} s)")
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "rows.f32")
    _write_memmap(path, args.n_stream, args.d, args.k, args.gap, args.chunk)
    stream_args = _forward(args, ["n_stream", "d", "k", "gap", "chunk"]) + ["--memmap", path]
    streaming = _run_worker("streaming", 1, stream_args, args.gpu)
    in_memory = None
    if not args.skip_in_memory:
      try:
        in_memory_args = (_forward(args, ["d", "k", "gap", "chunk"])
                          + ["--n-stream", str(min(args.n_in_memory, args.n_stream)),
                             "--memmap", path, "--in-memory"])          # the file's first rows
        in_memory = _run_worker("streaming", 1, in_memory_args, args.gpu)
      except RuntimeError as err:            # the rows do not fit: say so
        in_memory = {"failed": str(err).splitlines()[0]}
  print(f"DPASE streaming from a memmap, n = {streaming['n']:,}, d = {streaming['d']}: "
        f"{streaming['seconds']:.1f} s, peak RSS {streaming['peak_rss_bytes'] / 2**30:.2f} GiB "
        f"(rows {streaming['rows_bytes'] / 2**30:.1f} GiB; ok = {streaming['ok']})")
  if in_memory and "seconds" in in_memory:
    print(f"DPASE in memory, n = {in_memory['n']:,}: {in_memory['seconds']:.1f} s, peak RSS "
          f"{in_memory['peak_rss_bytes'] / 2**30:.2f} GiB")
  result = {
      "summary": {
          "dpsgd_examples_per_s": {str(c): r["plain"]["examples_per_s"]
                                   for c, r in dpsgd.items()},
          "dpase_seconds": {str(c): r.get("seconds") for c, r in dpase.items()},
          "streaming": {k: streaming[k] for k in ("n", "d", "seconds", "peak_rss_bytes")}},
      "more": {"dpsgd": dpsgd, "dpase": dpase, "streaming": streaming,
               "in_memory": in_memory},
      "config": vars(args) | {"platform": platform.platform(), "gpu": args.gpu}}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  main()
