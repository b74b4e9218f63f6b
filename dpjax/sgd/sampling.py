"""Poisson sampling with fixed-size micro-batches (ALGORITHMS.md §6.1)."""

from __future__ import annotations

import math

import jax
import numpy as np

from dpjax import _validation as v


def poisson_mask(key: jax.Array, num_examples: int, sampling_prob: float) -> jax.Array:
  """``(N,)`` bool: each example is included independently with probability q.

  Data-independent (public randomness); the DP-SGD accountant's ``PoissonSampledDpEvent``
  assumes exactly this sampling.
  """
  v.check_key(key)
  num_examples = v.check_int(num_examples, "num_examples", low=1)
  sampling_prob = v.check_probability(sampling_prob, "sampling_prob")
  return jax.random.bernoulli(key, sampling_prob, (num_examples,))


def poisson_microbatches(key: jax.Array, num_examples: int, sampling_prob: float,
                         microbatch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """A Poisson sample laid out as ``M`` fixed-size micro-batches, padded, never truncated.

  Returns:
    ``(indices, mask)``, both ``(M, microbatch_size)`` NumPy arrays: ``indices`` int32 example
    indices (padding points to example 0), ``mask`` bool (False on padding), with
    ``M = max(1, ⌈|sample| / microbatch_size⌉)``. Every sampled example appears exactly once:
    truncating an overflowing batch would let one added example evict another and double the
    sensitivity (§6.1 CAUTION). ``M`` depends only on public randomness.
  """
  microbatch_size = v.check_int(microbatch_size, "microbatch_size", low=1)
  chosen = np.flatnonzero(np.asarray(poisson_mask(key, num_examples, sampling_prob)))
  m = max(1, math.ceil(chosen.size / microbatch_size))
  indices = np.zeros(m * microbatch_size, np.int32)
  mask = np.zeros(m * microbatch_size, bool)
  indices[:chosen.size] = chosen
  mask[:chosen.size] = True
  return indices.reshape(m, microbatch_size), mask.reshape(m, microbatch_size)
