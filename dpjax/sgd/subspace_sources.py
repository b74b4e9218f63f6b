"""Where a gradient subspace comes from: private (DPASE), public data, or none (ALGORITHMS.md §6.2)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from dpjax import _validation as v
from dpjax import linalg
from dpjax.subspace.approximate import dpase
from dpjax.subspace.result import SubspaceResult


def _num_examples(data) -> int:
  leaves = jax.tree_util.tree_leaves(data)
  if not leaves:
    raise ValueError("data must be a non-empty pytree of arrays with a leading example axis.")
  sizes = {int(jnp.shape(x)[0]) for x in leaves}
  if len(sizes) != 1:
    raise ValueError(f"all leaves of data must share the leading (example) axis, got sizes "
                     f"{sorted(sizes)}.")
  return sizes.pop()


def flat_per_example_grads(loss_fn: Callable, params, data, *,
                           chunk_size: int = 256) -> jax.Array:
  """``(N, p)`` matrix of flattened per-example gradients at ``params`` (one row per example).

  Computed in chunks of ``chunk_size`` examples (padded to a fixed shape, one compilation) to
  bound memory.
  """
  chunk_size = v.check_int(chunk_size, "chunk_size", low=1)
  n = _num_examples(data)

  @jax.jit
  def chunk_grads(chunk):
    grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))(params, chunk)
    return jax.vmap(lambda g: ravel_pytree(g)[0])(grads)

  rows = []
  for start in range(0, n, chunk_size):
    idx = jnp.minimum(jnp.arange(start, start + chunk_size), n - 1)
    rows.append(chunk_grads(jax.tree_util.tree_map(lambda x: x[idx], data))
                [: min(chunk_size, n - start)])
  return jnp.concatenate(rows, axis=0)


def private_gradient_subspace(key: jax.Array, loss_fn: Callable, params, data, *, k: int,
                              epsilon: float, delta: float, gamma: float | None = None,
                              **dpase_kwargs) -> SubspaceResult:
  """A rank-k gradient subspace learned privately with DPASE from per-example gradients.

  One gradient per individual, at ``params`` (e.g. the initial parameters, which must not depend
  on the private data), then :func:`dpjax.subspace.dpase` with ``partition="random_labels"``.

  Guarantee: (ε, δ)-DP under add/remove-one (and replace-one): each individual's gradient lands
  in one DPASE subset, and DPASE's random-label partition makes adding or removing a row change
  exactly one subset. Privacy is worst case: gradients need not be Gaussian. [CAUTION, §6.2]
  DPASE's utility needs a strong eigen-gap that real networks rarely have: expect ⊥
  (``result.ok == False``) and then train without a subspace, never with a non-private one.

  Args:
    key: PRNG key.
    loss_fn: ``loss_fn(params, example) -> scalar`` for one example.
    params: the parameters at which gradients are taken.
    data: pytree of arrays with a leading example axis N.
    k: subspace dimension, ``1 <= k <= p``.
    epsilon, delta: the subspace's budget (ε_s, δ_s).
    gamma: DPASE's public gap parameter (or pass ``cell_length=``).
    **dpase_kwargs: forwarded to :func:`dpjax.subspace.dpase`.

  Returns:
    :class:`SubspaceResult` with a ``(p, k)`` basis over the flattened parameters.
  """
  v.check_key(key)
  dpase_kwargs.setdefault("partition", "random_labels")
  G = flat_per_example_grads(loss_fn, params, data)
  return dpase(key, G, epsilon=epsilon, delta=delta, k=k, gamma=gamma, **dpase_kwargs)


def public_gradient_subspace(loss_fn: Callable, params, public_data, *,
                             k: int) -> SubspaceResult:
  """The top-k right singular subspace of the per-example gradients of PUBLIC data.

  GEP / PDP-SGD style. It costs no privacy budget only because ``public_data`` is public: never
  pass private rows here.

  Returns:
    :class:`SubspaceResult` with ``ok=True``, ``epsilon=delta=0`` and
    ``neighbouring="public_data"``.
  """
  G = flat_per_example_grads(loss_fn, params, public_data)
  k = v.check_int(k, "k", low=1, high=G.shape[1])
  if G.shape[0] < k:
    raise ValueError(f"public_data needs at least k={k} examples, got {G.shape[0]}.")
  G = v.check_data(G, "public per-example gradients")
  basis = linalg.top_k_right_singular_vectors(G, k)
  return SubspaceResult(ok=jnp.asarray(True), basis=basis, epsilon=0.0, delta=0.0,
                        neighbouring="public_data", info={"num_public": int(G.shape[0])})
