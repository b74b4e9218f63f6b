"""Test data helpers (``tests/`` is on ``sys.path``: ``pythonpath`` in pyproject.toml)."""

import jax
import jax.numpy as jnp
import numpy as np


def normal(seed, shape, dtype=jnp.float32):
  """Standard normal test data drawn by NumPy from ``seed`` (an int, or a concrete PRNG key).

  ``jax.random.normal`` compiles a random-number program for every new shape (~0.3 s on a CPU),
  which the suite paid about 150 times; test data need no JAX randomness.
  """
  if not isinstance(seed, int):
    seed = [int(w) for w in np.asarray(jax.random.key_data(seed)).ravel()]
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def count_compilations(run, monkeypatch, *, clear: bool = True) -> int:
  """How many XLA compilations happen during ``run()``.

  ``clear`` (default) empties JAX's caches first, so that any JAX operation inside ``run`` must
  compile again and is counted (a program compiled ahead of time keeps its executable).
  """
  from jax._src import compiler
  count = [0]
  real = compiler.backend_compile_and_load

  def counted(*args, **kwargs):
    count[0] += 1
    return real(*args, **kwargs)

  if clear:
    jax.clear_caches()
  monkeypatch.setattr(compiler, "backend_compile_and_load", counted)
  jax.block_until_ready(run())
  return count[0]


def print_audit_table(rows):
  """Prints ``(name, (claimed ε, empirical ε lower bound, trials))`` rows (visible with -s)."""
  if rows:
    print(f"\n{'mechanism':<40}{'claimed ε':>10}{'empirical ε ≥':>15}{'trials':>9}")
    for name, (claimed, lb, trials) in rows:
      print(f"{name:<40}{claimed:>10.3f}{lb:>15.3f}{trials:>9}")


def run_on_devices(code: str, devices: int = 4, timeout: float = 240.0) -> dict:
  """Runs ``code`` in a fresh Python with ``devices`` simulated CPU devices and returns the JSON
  object it prints last (so the calling test process keeps its single device).

  ``XLA_FLAGS=--xla_force_host_platform_device_count`` takes effect only before JAX starts, hence
  the subprocess; the code must ``print(json.dumps(...))`` as its last line of output.
  """
  import json
  import os
  import pathlib
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""),     # the suite's own flags
                                 f"--xla_force_host_platform_device_count={devices}"]).strip(),
             PYTHONPATH=os.pathsep.join([str(root), str(root / "tests"),
                                         os.environ.get("PYTHONPATH", "")]))
  try:
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=root)
  except subprocess.TimeoutExpired as exc:
    raise AssertionError(f"{devices} simulated CPU devices gave no answer in {timeout:.0f} s "
                         "(a hang; docs/algorithms.md §2.2 has the one found so far)") from exc
  if done.returncode != 0:
    raise AssertionError(f"the {devices}-device subprocess failed ({done.returncode}):\n"
                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def python_stdout(code: str) -> str:
  """The stripped stdout of ``python -c code`` in a fresh interpreter (what an import loads)."""
  import subprocess
  import sys
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        check=True, timeout=120).stdout.strip()
