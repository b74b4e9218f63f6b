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


def print_audit_table(rows):
  """Prints ``(name, (claimed ε, empirical ε lower bound, trials))`` rows (visible with -s)."""
  if rows:
    print(f"\n{'mechanism':<40}{'claimed ε':>10}{'empirical ε ≥':>15}{'trials':>9}")
    for name, (claimed, lb, trials) in rows:
      print(f"{name:<40}{claimed:>10.3f}{lb:>15.3f}{trials:>9}")
