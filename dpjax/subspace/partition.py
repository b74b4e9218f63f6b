"""DPASE's public partition of the rows into ``t`` subsets ([SS21] Algorithm 2, step 1).

Both partitions are drawn from the key alone (never from the data), so they are public:

* the permutation: a random permutation of ``n`` rows cut into ``t`` blocks of ``m`` rows;
* random labels: each row gets an independent uniform label in ``{0..t−1}``; subset j holds the
  rows labelled j, in row order, up to the public capacity :func:`subset_capacity` (rows past it
  are dropped, which only ever changes their own subset).

The in-memory, gathered and streamed row sources of :func:`dpjax.subspace.dpase` use these same
functions, so one key gives one partition whatever the source.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

__all__ = ["permutation_index", "random_label_index", "random_labels", "subset_capacity"]


@functools.partial(jax.jit, static_argnames=("n", "t", "m"))
def permutation_index(key, n, t, m):
  """``(t, m)`` row indices: a public permutation cut into t blocks (the rest unused)."""
  return jax.random.permutation(key, n)[: t * m].reshape(t, m)


def subset_capacity(m: int) -> int:
  """A random-labels subset's public capacity ``m + ⌈4√m⌉ + 4`` (overflow is dropped)."""
  return m + math.ceil(4 * math.sqrt(m)) + 4


def random_labels(key, n: int, t: int) -> jax.Array:
  """``(n,)`` int32: row i's public subset label, uniform in ``{0..t−1}``, independent."""
  return jax.random.randint(key, (n,), 0, t)


@functools.partial(jax.jit, static_argnames=("n", "t", "capacity"))
def random_label_index(key, n, t, capacity):
  """``(t, capacity)`` row indices of :func:`random_labels`' subsets in row order; ``n`` pads a
  subset."""
  labels = random_labels(key, n, t)
  order = jnp.argsort(labels, stable=True)          # public: depends on the labels only
  sorted_labels = labels[order]
  first = jnp.searchsorted(sorted_labels, jnp.arange(t))
  rank = jnp.arange(n) - first[sorted_labels]
  index = jnp.full((t, capacity), n, order.dtype)
  # Rows past a subset's capacity are dropped: that only ever changes the subset they belong to.
  return index.at[sorted_labels, rank].set(order, mode="drop")
