"""Where DP-SGD's subspaces come from: functions a user calls between steps (docs/algorithms.md
§6.2, §6.4).

============================  ==============================  ================================
source                        basis                           privacy
============================  ==============================  ================================
:func:`public_input_basis`    ``(d, r)`` input-side, for a    free: public rows only (never
                              first layer's kernel            the training rows)
:func:`public_gradient_       flat ``(p, k)``                 free: public rows only
subspace`
:func:`private_input_basis`   ``(d, r)`` input-side           Analyze Gauss, (ε_s, δ_s): a DP
                                                              release composed in by the plan
                                                              (``subspace_epsilon/delta``)
:func:`private_gradient_      flat ``(p, k)``                 DPASE, (ε_s, δ_s) (add/remove-
subspace`                                                     one), composed in likewise
:func:`dpjax.sgd.             per-layer, from this run's      free: post-processing of
trajectory_bases`             released updates                releases already paid for
============================  ==============================  ================================

A flat basis goes to the plan as ``basis=``; an input-side basis into a per-layer bases pytree
(:func:`dpjax.sgd.bases_like`) as ``bases=``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import NeighboringRelation
from jax.flatten_util import ravel_pytree

from dpjax import _validation as v
from dpjax.results import SubspaceResult, UnderpoweredWarning
from dpjax.subspace import baselines
from dpjax.subspace.approximate import dpase
from dpjax.ledger import with_ledger

__all__ = ["flat_per_example_grads", "num_examples", "private_gradient_subspace",
           "private_input_basis", "public_gradient_subspace", "public_input_basis"]


def num_examples(data) -> int:
  """N, the shared leading (example) axis of a data pytree (validated, host side)."""
  leaves = jax.tree_util.tree_leaves(data)
  if not leaves:
    raise ValueError("data must be a non-empty pytree of arrays with a leading example axis.")
  if any(jnp.ndim(x) == 0 for x in leaves):
    raise ValueError("every leaf of data must have a leading example axis; got a scalar leaf.")
  sizes = {int(jnp.shape(x)[0]) for x in leaves}
  if len(sizes) != 1:
    raise ValueError(f"all leaves of data must share the leading (example) axis, got sizes "
                     f"{sorted(sizes)}.")
  n = sizes.pop()
  if n < 1:
    raise ValueError("data must hold at least one example.")
  return n


def _num_params(params) -> int:
  leaves = jax.tree_util.tree_leaves(params)
  if not leaves:
    raise ValueError("params must be a non-empty pytree of arrays.")
  return int(sum(np.size(x) for x in leaves))


@functools.partial(jax.jit, static_argnums=0)
def _chunk_grads(loss_fn, params, chunk):
  grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))(params, chunk)
  return jax.vmap(lambda g: ravel_pytree(g)[0])(grads)


def flat_per_example_grads(loss_fn: Callable, params, data, *,
                           chunk_size: int = 256) -> jax.Array:
  """``(N, p)`` matrix of flattened per-example gradients at ``params`` (one row per example).

  Computed in chunks of ``chunk_size`` examples, the last one padded to the same shape (one
  compilation per ``loss_fn``), so memory is ``O(chunk_size · p)`` besides the output. Not
  private by itself: feed it to a DP learner, or use it on public data only.

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar`` for one example (hashable: it is a static
      argument of the jitted chunk).
    params: pytree of parameters (p entries in all).
    data: pytree of arrays with a shared leading example axis N ≥ 1.
    chunk_size: examples per jitted chunk, ≥ 1.

  Returns:
    ``(N, p)`` array, rows in ``ravel_pytree`` order, in the gradients' dtype.

  Raises:
    ValueError: empty ``data`` / ``params``, leaves without a shared leading axis.
    TypeError: ``chunk_size`` not an integer, ``loss_fn`` not callable.
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  chunk_size = v.check_int(chunk_size, "chunk_size", low=1)
  n = num_examples(data)
  _num_params(params)
  data = jax.tree_util.tree_map(jnp.asarray, data)
  size = min(chunk_size, n)
  rows = []
  for start in range(0, n, size):
    idx = np.minimum(np.arange(start, start + size), n - 1)
    chunk = jax.tree_util.tree_map(lambda x: x[idx], data)
    rows.append(_chunk_grads(loss_fn, params, chunk)[: min(size, n - start)])
  return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=0)


@functools.partial(jax.jit, static_argnames=("clip",))
def _sanitise_rows(G, clip_norm, clip):
  # Row-wise, data-independent maps: they keep DPASE's guarantee (one row in, one row out).
  finite = jnp.all(jnp.isfinite(G), axis=1, keepdims=True)
  G = jnp.where(finite, G, jnp.zeros_like(G))
  if not clip:
    return G
  norms = jnp.linalg.norm(G, axis=1, keepdims=True)
  return G * (clip_norm / jnp.maximum(norms, clip_norm)).astype(G.dtype)


@with_ledger
def private_gradient_subspace(key: jax.Array, loss_fn: Callable, params, data, *, k: int,
                              epsilon: float, delta: float, gamma: float | None = None,
                              clip_norm: float | None = None,
                              **dpase_kwargs) -> SubspaceResult:
  """A rank-k gradient subspace learned privately with DPASE from per-example gradients.

  Usage::

      result = dpjax.sgd.private_gradient_subspace(key, loss_fn, params, (X, y), k=8,
                                                   epsilon=0.5, delta=1e-6, gamma=0.5)
      basis = result if result.ok else None    # ⊥ is common: then no subspace, or a public one

  One gradient per individual at ``params``, then :func:`dpjax.subspace.dpase` with
  ``partition="random_labels"`` on a gather function: the ``(N, p)`` gradient matrix never exists
  (docs/algorithms.md §6.2, memory). Each gradient row first goes through a fixed row-wise map:
  NaN/inf rows become zero (no data-dependent error), and, with ``clip_norm``, rows are clipped
  to ℓ2 norm ≤ ``clip_norm`` (utility only: DPASE needs no norm bound for privacy).

  Guarantee: (ε, δ)-DP under **add/remove-one** (and replace-one) for the rows of ``data``,
  provided each individual contributes exactly one row and ``params`` does not depend on
  ``data``: each gradient is a function of its row alone, and DPASE's independent uniform public
  labels put an added or removed row in exactly one subset, hence one item of its stability
  histogram (§6.2 route (c)). Privacy is worst case (gradients need not be Gaussian); N is
  treated as public (DPASE's parameters use it).

  [CAUTION, §6.2] DPASE's utility needs a strong multiplicative eigen-gap (``γ ≲ 1/d``-type,
  d = p) that real networks rarely meet: expect ⊥ (``result.ok == False``) and then train
  without a subspace or with a public one — never with a non-private subspace of these data.

  Args:
    key: PRNG key (consumed by DPASE).
    loss_fn: ``loss_fn(params, example) -> scalar`` for one example.
    params: the parameters at which gradients are taken (p entries in all).
    data: pytree of arrays with a leading example axis N, one example per individual.
    k: subspace dimension, ``1 ≤ k ≤ p``.
    epsilon, delta: the subspace's budget, ε_s > 0 and δ_s ∈ (0, 1).
    gamma: DPASE's public gap parameter (or pass ``cell_length=`` in ``dpase_kwargs``).
    clip_norm: optional ℓ2 bound > 0 applied to each gradient row before DPASE.
    **dpase_kwargs: forwarded to :func:`dpjax.subspace.dpase` (``num_subsets``,
      ``cell_length``, ...). ``partition`` is fixed to "random_labels".

  Returns:
    :class:`~dpjax.results.SubspaceResult` with a ``(p, k)`` basis over the flattened
    parameters (zeros on ⊥), ``epsilon``/``delta`` spent whatever the outcome,
    ``neighboring == NeighboringRelation.ADD_OR_REMOVE_ONE``. Traceable in ``key``, ``params``
    and ``data`` (as :func:`dpjax.subspace.dpase`).

  Raises:
    TypeError: ``key`` not a PRNG key, ``k`` not an integer.
    ValueError: ``k ∉ [1, p]``, a ``partition`` other than "random_labels", bad ``clip_norm``,
      and DPASE's own errors (ε, δ, γ, too few rows).

  References:
    Singhal & Steinke, NeurIPS 2021 (DPASE, Algorithm 2); docs/algorithms.md §2.2, §6.2.
  """
  key = v.check_key(key)
  k = v.check_int(k, "k", low=1, high=_num_params(params))
  partition = dpase_kwargs.pop("partition", "random_labels")
  if partition != "random_labels":
    raise ValueError("partition must be 'random_labels' (the add/remove-one guarantee needs "
                     f"it), got partition={partition!r}.")
  if clip_norm is not None:
    clip_norm = v.check_positive(clip_norm, "clip_norm")
  n, p = num_examples(data), _num_params(params)
  data = jax.tree_util.tree_map(jnp.asarray, data)
  flat_params, unravel = ravel_pytree(params)

  def gather(rows):
    # One individual's row: its flattened, sanitised gradient; padding (rows >= n) is zero.
    chunk = jax.tree_util.tree_map(lambda x: x.at[rows].get(mode="fill", fill_value=0), data)
    G = jax.vmap(lambda ex: ravel_pytree(jax.grad(loss_fn)(unravel(flat_params), ex))[0])(chunk)
    G = jnp.where((rows < n)[:, None], G, jnp.zeros_like(G))
    return _sanitise_rows(G, 1.0 if clip_norm is None else clip_norm, clip_norm is not None)

  result = dpase(key, gather, n=n, d=p, dtype=flat_params.dtype, epsilon=epsilon, delta=delta,
                 k=k, gamma=gamma, partition="random_labels", **dpase_kwargs)
  if result.neighboring != NeighboringRelation.ADD_OR_REMOVE_ONE:  # pragma: no cover
    raise RuntimeError(f"dpase returned a guarantee under {result.neighboring!r}, expected "
                       "add/remove-one.")
  return result


def public_gradient_subspace(loss_fn: Callable, params, public_data, *,
                             k: int) -> SubspaceResult:
  """The top-k right singular subspace of the per-example gradients of PUBLIC data.

  GEP / PDP-SGD style: the top-k eigenvectors of ``Σ_j ∇ℓ_j ∇ℓ_jᵀ`` over the public examples.
  It costs no privacy budget ONLY because ``public_data`` is public (drawn independently of the
  private training set, which must not overlap it); the returned ``epsilon = delta = 0`` states
  exactly that. Never pass private rows here.

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar`` for one example.
    params: the parameters at which gradients are taken (p entries in all).
    public_data: pytree of arrays with a leading example axis m ≥ k.
    k: subspace dimension, ``1 ≤ k ≤ p``.

  Returns:
    :class:`~dpjax.results.SubspaceResult` with ``ok=True``, a ``(p, k)`` orthonormal basis,
    ``epsilon=0``, ``delta=0``, ``neighboring=None`` (no private data seen) and
    ``info={"num_public": m}``. Traceable in ``params`` and ``public_data`` (under tracing a
    non-finite gradient or basis gives ``ok=False`` instead of an error).

  Numerics: the gradients may have any finite scale (the top-k subspace is computed after
  dividing them by a power of two of their largest entry, so their Gram matrix cannot overflow or
  underflow); 16-bit gradients are upcast to float32.

  Raises:
    TypeError: ``k`` not an integer.
    ValueError: ``k ∉ [1, p]``, fewer than k public examples, non-finite public gradients (or,
      defensively, a non-finite basis).

  References:
    Zhou, Wu & Banerjee, PDP-SGD, ICLR 2021; Yu et al., GEP, ICLR 2021.
  """
  k = v.check_int(k, "k", low=1, high=_num_params(params))
  m = num_examples(public_data)
  if m < k:
    raise ValueError(f"public_data needs at least k={k} examples, got {m}.")
  G = flat_per_example_grads(loss_fn, params, public_data)
  G = v.check_data(G, "public per-example gradients")
  # The public gradients' top-k right singular subspace: the non-private baseline's computation
  # (scale-safe; ⊥ under jit), released here at no cost to the private rows.
  try:
    result = baselines.pca_subspace(G, k=k)
  except ValueError as e:
    raise ValueError("public_gradient_subspace could not compute a finite basis from the "
                     f"public per-example gradients (dtype {G.dtype}); use float64 "
                     "parameters.") from e
  return dataclasses.replace(result, epsilon=0.0, delta=0.0, info={"num_public": int(m)})


def public_input_basis(public_inputs, rank: int) -> np.ndarray:
  """Top-``rank`` right singular vectors ``(d, rank)`` of PUBLIC rows ``(n_pub, d)``: an uncentred
  PCA of the inputs, float32, for a first layer's kernel ``(d, out)`` (input-side basis).

  Free ONLY because the rows are public (drawn independently of the private training set, which
  must not overlap them). Host side (NumPy, float64 SVD).

  Raises:
    ValueError: rows not 2-D, non-finite, or ``rank ∉ [1, min(n_pub, d)]``.
    TypeError: ``rank`` not an integer.
  """
  X = np.asarray(public_inputs, np.float64)
  if X.ndim != 2 or not np.all(np.isfinite(X)):
    raise ValueError(f"public_inputs must be a finite (n_pub, d) array, got shape {X.shape}.")
  rank = v.check_int(rank, "rank", low=1, high=min(X.shape))
  return np.linalg.svd(X, full_matrices=False)[2][:rank].T.astype(np.float32)


@with_ledger
def private_input_basis(key: jax.Array, X, rank: int, *, epsilon: float, delta: float,
                        clip_norm: float, secure: bool = True) -> SubspaceResult:
  """An input-side basis ``(d, rank)`` of the PRIVATE rows, released by Analyze Gauss.

  :func:`dpjax.subspace.analyze_gauss` on the rows' inputs (each clipped to the public
  ``clip_norm`` C_x for this release only: a fixed per-row map) under add/remove-one: Gaussian
  noise on the second moment (sensitivity C_x²), top-``rank`` eigenvectors.

  Guarantee: (ε, δ)-DP under add/remove-one (adding or removing a row moves the clipped second
  moment by ``x xᵀ``, Frobenius norm ≤ C_x²). Compose it into DP-SGD on the same rows by passing
  the result's ``dp_event`` as the plan's ``subspace_event``:

  * ``secure=False``: continuous Gaussian noise (analytic σ). The event is
    ``GaussianDpEvent(σ/C_x²)``, which the accountant composes with the sampled steps (PLD by
    default) — a release with a stand-alone ε of 0.1 then costs DP-SGD a fraction of that. Not
    float-safe (docs/algorithms.md §1.10), like the continuous Gaussian noise of the DP-SGD steps
    it is composed with.
  * ``secure=True`` (default): float-safe discretized Gaussian noise (Rényi calibration). The
    event is the (ε, δ) event, composed by basic composition (ε and δ come off the total).

  The key must be this release's own stream (one split of the run's key into purposes). It
  gives no :class:`dpjax.UnderpoweredWarning`: a projection for DP-SGD is judged by the model's
  accuracy, not by the captured energy of all r directions
  (:func:`dpjax.subspace.analyze_gauss_required_n` gives that figure).

  Args:
    key: PRNG key, owned by this release.
    X: ``(n, d)`` private inputs (rows are individuals).
    rank: r, ``1 ≤ r ≤ d``.
    epsilon, delta: the release's stand-alone (ε_s, δ_s).
    clip_norm: C_x > 0, the public row-norm bound.
    secure: float-safe discretized noise (default) or continuous noise with a Gaussian event.

  Returns:
    :class:`~dpjax.results.SubspaceResult` (``basis (d, r)``, ``epsilon``, ``delta``,
    ``neighboring == ADD_OR_REMOVE_ONE``, ``dp_event``).

  Raises:
    As :func:`dpjax.subspace.analyze_gauss`.

  References:
    Dwork, Talwar, Thakurta & Zhang, "Analyze Gauss", STOC 2014; Abadi et al., CCS 2016 (DP-PCA
    of the inputs before DP-SGD, composed in one accountant).
  """
  # No UnderpoweredWarning here: analyze_gauss's speaks of the captured energy of all r
  # directions, while this basis feeds a model judged by its accuracy (Abadi et al. take r = 60
  # at a small ε_s, where most directions are noise and the projection still helps).
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UnderpoweredWarning)
    return baselines.analyze_gauss(key, X, epsilon=epsilon, delta=delta, k=rank,
                                   clip_norm=clip_norm, secure=secure,
                                   neighboring=NeighboringRelation.ADD_OR_REMOVE_ONE)
