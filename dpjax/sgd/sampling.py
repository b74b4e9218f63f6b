"""Poisson sampling with fixed-size micro-batches (docs/algorithms.md §6.1).

DP-SGD's accountant (``PoissonSampledDpEvent``, add/remove-one) assumes that every example is
included in a step independently with probability q, so the batch size is random. To keep the
jitted work static-shaped, the sample is laid out in ``M`` micro-batches of a fixed size, padded
with a mask; ``M`` varies from step to step.

What is private here: the sample depends on the sampling key and N only, never on the rows'
values — but which examples were drawn, and hence the realised size ``|sample|`` and ``M``, is
part of the secret that privacy amplification by subsampling relies on (under add/remove-one the
realised size counts the added row when it is drawn). So ``mask.sum()`` and ``M`` may set padding
and loop counts but must never enter a released value: DP-SGD divides by the public expected
batch size ``L = qN`` instead. Timing side channels are out of scope.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from dpjax import _validation as v


def poisson_mask(key: jax.Array, num_examples: int, sampling_prob: float) -> jax.Array:
  """``(N,)`` bool: each example is included independently with probability q.

  Data-independent (public randomness): the mask depends on ``key``, N and q only, which is
  exactly the sampling ``dp_accounting``'s ``PoissonSampledDpEvent`` assumes (add/remove-one).

  Args:
    key: PRNG key (use a fresh one per step).
    num_examples: N ≥ 1.
    sampling_prob: q ∈ (0, 1].

  Returns:
    ``(N,)`` bool JAX array.

  Raises:
    TypeError: ``key`` not a PRNG key, ``num_examples`` not an integer.
    ValueError: N < 1, q ∉ (0, 1].

  References:
    Mironov, Talwar & Zhang, "Rényi Differential Privacy of the Sampled Gaussian Mechanism", 2019.
  """
  key = v.check_key(key)
  num_examples = v.check_int(num_examples, "num_examples", low=1)
  sampling_prob = v.check_probability(sampling_prob, "sampling_prob")
  return jax.random.bernoulli(key, sampling_prob, (num_examples,))


def poisson_microbatches(key: jax.Array, num_examples: int, sampling_prob: float,
                         microbatch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """A Poisson sample laid out as ``M`` fixed-size micro-batches, padded, never truncated.

  Host-side helper (NumPy). The sample is :func:`poisson_mask` with the same key; every sampled
  example appears exactly once, in increasing index order. Truncating an overflowing batch to a
  fixed size would let one added example evict another and double the sensitivity (§6.1
  CAUTION), so the number of micro-batches grows with the sample instead. ``M`` is a function of
  the sampling randomness (the key, N, q), not of the rows' values; like the sample itself it is
  kept out of every release (see the module docstring).

  Args:
    key: PRNG key (use a fresh one per step).
    num_examples: N ≥ 1.
    sampling_prob: q ∈ (0, 1].
    microbatch_size: B ≥ 1, rows per micro-batch (a static shape for the jitted step).

  Returns:
    ``(indices, mask)``, both ``(M, B)`` NumPy arrays with ``M = max(1, ⌈|sample| / B⌉)``:
    ``indices`` int32 example indices (padding points to example 0) and ``mask`` bool (False on
    padding). ``mask.sum()`` is the realised sample size: use it for padding only, never in a
    released quantity.

  Raises:
    TypeError: ``key`` not a PRNG key, a non-integer size.
    ValueError: N < 1, q ∉ (0, 1], B < 1.
  """
  microbatch_size = v.check_int(microbatch_size, "microbatch_size", low=1)
  chosen = np.flatnonzero(np.asarray(poisson_mask(key, num_examples, sampling_prob)))
  m = max(1, math.ceil(chosen.size / microbatch_size))
  indices = np.zeros(m * microbatch_size, np.int32)
  mask = np.zeros(m * microbatch_size, bool)
  indices[:chosen.size] = chosen
  mask[:chosen.size] = True
  return indices.reshape(m, microbatch_size), mask.reshape(m, microbatch_size)
