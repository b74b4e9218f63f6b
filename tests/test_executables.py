"""The premise of the suite's guard against XLA:CPU's memory-mapping crash (issue 33 §2).

XLA:CPU holds every compiled executable in memory mappings of its own, and JAX's caches keep up
to ~16k executables alive; a process that reaches Linux's ``vm.max_map_count`` (65,530 by
default) crashes inside XLA's compiler. ``tests/conftest.py`` frees JAX's caches when a worker
passes half the limit; this checks, in a fresh interpreter (so that this worker keeps its
caches), that doing so frees the mappings. docs/development.md has the reduction that crashes.
"""

import os

import pytest

from helpers import run_on_devices

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")

_CODE = """
import gc, json
import jax, jax.numpy as jnp

def mappings():
  with open("/proc/self/maps", "rb") as f:
    return f.read().count(b"\\n")

x = jnp.ones((3,))
start = mappings()
functions = [jax.jit(lambda x, i=i: jnp.cos(x) * i) for i in range(20)]
for f in functions:                     # 20 distinct programs, kept alive by their caches
  f(x).block_until_ready()
grown = mappings() - start
jax.clear_caches()
gc.collect()
print(json.dumps({"grown": grown, "after": mappings() - start}))
"""


def test_live_executables_hold_mappings_and_clear_caches_frees_them():
  out = run_on_devices(_CODE, devices=1)
  assert out["grown"] >= 2 * 20, out          # 3 per executable with jaxlib 0.10 on x86-64
  assert out["after"] < out["grown"] / 4, out
