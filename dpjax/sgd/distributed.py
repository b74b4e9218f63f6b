"""Data-parallel DP-SGD over the devices of a ``jax.sharding.Mesh`` (docs/algorithms.md §6.6).

The privacy unit does not change when the data are sharded: it is still one example. A step
Poisson-samples every example with probability q from ONE key (the same mask whatever the device
count), each device sums the clipped gradients of the sampled examples it holds, the per-device
sums are added across devices (``lax.psum``), and the Gaussian noise is drawn ONCE, from the
step's noise key, on the reduced sum: every replica computes the same noise from the same key,
so the released update is exactly the single-device mechanism's (ℓ2-sensitivity C under
add/remove-one, noise std σC). Drawing noise per device would multiply the noise variance by
the device count and, worse, make a per-device key part of the mechanism; dpjax never does.

Everything is JAX's own machinery: ``jax.shard_map`` for the per-device sums and ``jit`` for the
rest; a multi-process run (``jax.distributed.initialize``) uses the same code on a global mesh.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dpjax import _validation as v
from dpjax.sgd import sampling

__all__ = ["DATA_AXIS", "data_mesh", "padded_size", "shard_examples", "sharded_chosen_sum",
           "sharded_poisson_clipped_sum"]

DATA_AXIS = "data"


def data_mesh(devices=None, axis_name: str = DATA_AXIS) -> jax.sharding.Mesh:
  """A one-axis mesh over ``devices`` (default: all of ``jax.devices()``) for data parallelism.

  Args:
    devices: a sequence of devices, or None for every device of every process.
    axis_name: the mesh axis the examples are sharded over.

  Returns:
    ``jax.sharding.Mesh`` with one axis ``axis_name``.
  """
  devices = list(jax.devices() if devices is None else devices)
  if not devices:
    raise ValueError("devices must not be empty.")
  return jax.sharding.Mesh(np.array(devices), (axis_name,))


def check_mesh(mesh, data_axis: str) -> int:
  """The number of devices along ``data_axis`` of a validated mesh."""
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
  if data_axis not in mesh.axis_names:
    raise ValueError(f"data_axis {data_axis!r} is not an axis of the mesh {mesh.axis_names}.")
  return mesh.shape[data_axis]


def padded_size(num_examples: int, mesh: jax.sharding.Mesh, data_axis: str = DATA_AXIS) -> int:
  """The smallest multiple of the mesh's ``data_axis`` size that holds N examples (public)."""
  devices = check_mesh(mesh, data_axis)
  return devices * math.ceil(v.check_int(num_examples, "num_examples", low=1) / devices)


def shard_examples(data, mesh: jax.sharding.Mesh, data_axis: str = DATA_AXIS):
  """Pads the example axis of ``data`` with zero rows to :func:`padded_size` and places it with
  the example axis sharded over ``data_axis`` (every other axis replicated).

  The padding rows are public constants that the sampling never selects
  (:func:`sharded_poisson_clipped_sum` draws the mask for the N real examples only).

  Args:
    data: pytree of arrays with a common leading example axis N (host or device arrays).
    mesh: the mesh.
    data_axis: the mesh axis to shard the examples over.

  Returns:
    ``(sharded_data, N)``.

  Raises:
    TypeError / ValueError: not a mesh, an unknown axis, leaves without a common leading axis.
  """
  leaves = jax.tree_util.tree_leaves(data)
  sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
  if not leaves or None in sizes or len(sizes) != 1:
    raise ValueError("data must be a non-empty pytree of arrays with one common leading "
                     f"example axis, got leading sizes {sorted(str(s) for s in sizes)}.")
  n = sizes.pop()
  total = padded_size(n, mesh, data_axis)
  sharding = NamedSharding(mesh, PartitionSpec(data_axis))

  def place(x):
    x = np.asarray(x)
    if total > n:
      x = np.concatenate([x, np.zeros((total - n,) + x.shape[1:], x.dtype)])
    return jax.device_put(x, sharding)

  return jax.tree_util.tree_map(place, data), n


def sharded_poisson_clipped_sum(grad_fn: Callable, params, data, key: jax.Array, *,
                                num_examples: int, sampling_prob, microbatch_size: int,
                                mesh: jax.sharding.Mesh, data_axis: str = DATA_AXIS,
                                extra_args=()):
  """:func:`dpjax.sgd.sampling.poisson_clipped_sum` with the examples sharded over a mesh: traceable.

  The mask is ``poisson_mask(key, N, q)`` — the single-device draw, for the N real examples;
  padding rows (``data`` may carry more rows than N, a multiple of the device count) are never
  sampled. Each device runs the micro-batch loop over the sampled examples it holds (every one
  of them: never truncated), then ``lax.psum`` adds the per-device sums, so the result is the
  single-device sum up to the order of floating-point additions, with the same ℓ2-sensitivity
  ``grad_fn.l2_norm_bound`` under add/remove-one. Add the noise to the result once (the
  optimiser transform does; module docstring).

  Args:
    grad_fn: as :func:`dpjax.sgd.sampling.poisson_clipped_sum` (dpjax's or jax_privacy's convention).
    params: the model parameters (replicated).
    data: pytree, leading example axis of size ``padded_size(N, mesh)`` (static), e.g. from
      :func:`shard_examples`.
    key: this step's sampling key.
    num_examples: N, the real examples (static, public).
    sampling_prob: q ∈ (0, 1] (may be traced).
    microbatch_size: rows per micro-batch on each device (static).
    mesh, data_axis: the mesh and the axis the examples are sharded over.
    extra_args: further (replicated) arguments of ``grad_fn``.

  Returns:
    A pytree like ``grad_fn``'s output (replicated): the sum over the sample.

  Raises:
    TypeError / ValueError: not a mesh, an unknown axis, a leading size that is not
      ``padded_size(N, mesh)``, ``microbatch_size < 1``.
  """
  chosen = jax.random.bernoulli(key, sampling_prob, (num_examples,))
  return sharded_chosen_sum(grad_fn, params, data, chosen, microbatch_size=microbatch_size,
                            mesh=mesh, data_axis=data_axis, extra_args=extra_args)


def sharded_chosen_sum(grad_fn: Callable, params, data, chosen: jax.Array, *,
                       microbatch_size: int, mesh: jax.sharding.Mesh,
                       data_axis: str = DATA_AXIS, extra_args=()):
  """The clipped-gradient sum over the examples marked in ``chosen`` (``(N,)`` bool, any batch
  selection's draw: Poisson, cyclic Poisson, fixed-size), the examples sharded over a mesh:
  each device sums the chosen examples it holds in micro-batches (never truncated), then
  ``lax.psum``. Traceable; the single-device sum up to the order of float additions.

  Raises:
    ValueError: ``data``'s leading axis is not ``padded_size(N, mesh)``; micro-batch < 1.
  """
  microbatch_size = v.check_int(microbatch_size, "microbatch_size", low=1)
  num_examples = chosen.shape[0]
  total = padded_size(num_examples, mesh, data_axis)
  sizes = {x.shape[0] for x in jax.tree_util.tree_leaves(data)}
  if sizes != {total}:
    raise ValueError(f"data's leading axis must be padded_size(N={num_examples}) = {total} "
                     f"(shard_examples pads it), got {sorted(sizes)}.")
  chosen = jnp.pad(chosen, (0, total - num_examples))
  call = sampling.masked_call(grad_fn)

  def local(params, data, chosen, extra):
    summed = sampling.sum_over_chosen(call, params, data, chosen, microbatch_size, extra)
    return jax.lax.psum(summed, data_axis)

  spec = PartitionSpec(data_axis)
  replicated = PartitionSpec()
  return jax.shard_map(local, mesh=mesh, in_specs=(replicated, spec, spec, replicated),
                       out_specs=replicated, check_vma=False)(params, data, chosen,
                                                              tuple(extra_args))
