"""DP-SGD in a few lines of an existing optax loop: clipping, noise and accounting bound together.

A :class:`DPSGDPrivatizer` is built from a sensitivity-bearing clipped-gradient function
(:func:`dpjax.sgd.clipped_grad_sum`, or ``jax_privacy.clipping.clipped_grad``: anything with an
``l2_norm_bound``), so the clip norm C that bounds the per-example terms, the noise std σC of the
transform and the C the accountant's noise multiplier σ is relative to are one number::

    grad_fn = dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=1.0)
    dp = dpjax.sgd.dp_sgd_privatizer(grad_fn, epsilon=2.0, delta=1e-5, num_examples=N,
                                     expected_batch_size=256, steps=T, key=key, basis=V)
    tx = optax.chain(dp.transform, optax.adam(1e-3))
    for t, step_key in enumerate(jax.random.split(sample_key, T)):
      grads = dp.clipped_sum(params, data, step_key)       # the whole Poisson sample
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)

Privacy (add/remove-one): each step Poisson-samples the examples with q = L/N on the device
(:func:`dpjax.sgd.poisson_mask`'s draw), sums their clipped gradients over EVERY micro-batch of
the sample in one jitted call (:func:`poisson_clipped_sum`: a dropped micro-batch would make
the realised sensitivity differ from the accounted one), and the transform adds N(0, σ²C²) noise
(or noise in span(V), :func:`dpjax.sgd.subspace_dp_gaussian_noise`) and divides by the public L.
The T steps are ``dpjax.accounting.dpsgd_event(σ, q, T)``; ``spend`` is what the accountant
certifies. A basis V must be public or a DP release whose cost is composed in (pass its ε, δ as
``subspace_epsilon`` / ``subspace_delta`` so the total stays ``(epsilon, delta)``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import accounting
from dpjax.sgd import per_example, transforms


def l2_norm_bound(grad_fn) -> float:
  """The ℓ2 bound C carried by a sensitivity-bearing clipped-gradient function.

  Reads ``grad_fn.l2_norm_bound`` (dpjax's :class:`~dpjax.sgd.per_example.ClippedGradSum` and
  ``jax_privacy``'s ``BoundedSensitivityCallable`` both carry it).

  Raises:
    TypeError: ``grad_fn`` carries no finite positive ``l2_norm_bound``.
  """
  bound = getattr(grad_fn, "l2_norm_bound", None)
  if bound is None or not callable(grad_fn):
    raise TypeError("grad_fn must be a sensitivity-bearing clipped-gradient function (with an "
                    "l2_norm_bound), e.g. dpjax.sgd.clipped_grad_sum(loss_fn, clip_norm=C); got "
                    f"{type(grad_fn).__name__}.")
  return v.check_positive(bound, "grad_fn.l2_norm_bound")


@functools.partial(jax.jit, static_argnames=("grad_fn",))
def accumulate_microbatches(grad_fn: Callable, params, data, indices: jax.Array,
                            mask: jax.Array):
  """``Σ_m grad_fn(params, data[indices[m]], mask[m])`` over ALL micro-batches, in one call.

  Traceable core of a DP-SGD step's clipped sum: a ``lax.scan`` over the ``(M, B)`` layout of
  :func:`dpjax.sgd.poisson_microbatches`, so no micro-batch of the sample can be skipped (a
  skipped one would change the realised sensitivity). Rows with ``mask = False`` (padding,
  including whole padded micro-batches) contribute nothing.

  Args:
    grad_fn: ``grad_fn(params, batch, mask)`` (static; hashable), e.g.
      :func:`dpjax.sgd.clipped_grad_sum`; or ``jax_privacy.clipping.clipped_grad(...)`` (called
      with ``is_padding_example = ~mask``, its convention).
    params: the model parameters (pytree).
    data: pytree of arrays with a leading example axis N.
    indices: ``(M, B)`` int32 example indices.
    mask: ``(M, B)`` bool.

  Returns:
    A pytree like ``grad_fn``'s output: the sum over the sample (ℓ2-sensitivity
    ``grad_fn.l2_norm_bound`` under add/remove-one).
  """
  call = masked_call(grad_fn)

  def body(total, batch):
    idx, msk = batch
    chunk = jax.tree_util.tree_map(lambda x: x[idx], data)
    return jax.tree_util.tree_map(jnp.add, total, call(params, chunk, msk)), None

  first = jax.tree_util.tree_map(lambda x: x[indices[0]], data)
  zeros = jax.tree_util.tree_map(jnp.zeros_like, jax.eval_shape(call, params, first, mask[0]))
  total, _ = jax.lax.scan(body, zeros, (indices, mask))
  return total


def poisson_clipped_sum(grad_fn: Callable, params, data, key: jax.Array, *,
                        sampling_prob, microbatch_size: int, extra_args=()):
  """The clipped-gradient sum over a Poisson sample drawn inside the trace: traceable core.

  The jittable counterpart of :meth:`DPSGDPrivatizer.clipped_sum` for training loops written as
  one ``lax.scan`` (and ``vmap``-ped over seeds or hyperparameters): the sample is
  :func:`dpjax.sgd.poisson_mask` with ``key`` (the same draw as the host-side
  :func:`dpjax.sgd.poisson_microbatches`), its indices are laid out in fixed-size micro-batches
  of ``microbatch_size`` rows, and a ``lax.while_loop`` sums EVERY micro-batch the sample needs
  (``⌈|sample| / B⌉``, at least one): never truncated, so the sensitivity is
  ``grad_fn.l2_norm_bound`` under add/remove-one, as the accountant assumes. The loop count is a
  function of the sampling randomness only and never enters the released sum (timing side
  channels are out of scope, as in :mod:`dpjax.sgd.sampling`).

  Known XLA:CPU issue (jaxlib 0.10.2, measured): ``vmap`` of a loop whose body holds this sum
  AND a matrix decomposition (e.g. :func:`dpjax.sgd.low_rank_denoise`'s SVD) can deadlock (all
  threads parked); ``lax.map`` over the seeds runs it, as fast here
  (``benchmarks/gradient_subspace.py``).

  Args:
    grad_fn: ``grad_fn(params, batch, mask, *extra_args)``, e.g.
      :func:`dpjax.sgd.clipped_grad_sum` or :func:`dpjax.sgd.embedding_residual_grad_sum`
      (whose bases go in ``extra_args``); or jax_privacy's ``clipped_grad`` (no extra args).
    params: the model parameters (pytree).
    data: pytree of arrays with a leading example axis N (static N).
    key: PRNG key of this step's sample (a fresh one per step).
    sampling_prob: q ∈ (0, 1] (may be traced).
    microbatch_size: B ≥ 1 (static).
    extra_args: further arguments of ``grad_fn`` (e.g. the bases).

  Returns:
    A pytree like ``grad_fn``'s output: the sum over the sample.

  Raises:
    ValueError: ``microbatch_size < 1``; data without a common leading axis.
  """
  microbatch_size = v.check_int(microbatch_size, "microbatch_size", low=1)
  sizes = {x.shape[0] for x in jax.tree_util.tree_leaves(data)}
  if len(sizes) != 1:
    raise ValueError(f"data leaves must share one leading example axis, got sizes {sizes}.")
  n = sizes.pop()
  chosen = jax.random.bernoulli(key, sampling_prob, (n,))
  return sum_over_chosen(masked_call(grad_fn), params, data, chosen, microbatch_size,
                         extra_args)


def sum_over_chosen(call: Callable, params, data, chosen: jax.Array, microbatch_size: int,
                    extra_args=()):
  """``Σ_{i: chosen_i} call(params, data[i])`` in fixed-size micro-batches: traceable core.

  ``call(params, batch, mask, *extra_args)`` in dpjax's convention (:func:`masked_call`).
  The chosen indices are laid out first, in increasing order, padded and masked; a
  ``lax.while_loop`` sums EVERY micro-batch the sample needs (``⌈|sample| / B⌉``, at least one):
  never truncated. The loop count depends on ``chosen`` only (sampling randomness) and never
  enters the sum.
  """
  n = chosen.shape[0]
  count = jnp.sum(chosen, dtype=jnp.int32)
  # The chosen indices first, in increasing order, padded with zeros (then masked out).
  order = jnp.nonzero(chosen, size=n + microbatch_size, fill_value=0)[0].astype(jnp.int32)
  positions = jnp.arange(microbatch_size, dtype=jnp.int32)

  def microbatch_sum(start):
    idx = jax.lax.dynamic_slice(order, (start,), (microbatch_size,))
    chunk = jax.tree_util.tree_map(lambda x: x[idx], data)
    return call(params, chunk, start + positions < count, *extra_args)

  def body(carry):
    start, total = carry
    return start + microbatch_size, jax.tree_util.tree_map(jnp.add, total,
                                                            microbatch_sum(start))

  first = microbatch_sum(jnp.int32(0))
  _, total = jax.lax.while_loop(lambda c: c[0] < count, body,
                                (jnp.int32(microbatch_size), first))
  return total


def masked_call(grad_fn: Callable) -> Callable:
  """``(params, batch, mask) -> sum``: dpjax's convention, or jax_privacy's ``clipped_grad``
  (``fun(params, batch, is_padding_example=~mask)``)."""
  if isinstance(grad_fn, per_example.ClippedGradSum):
    return grad_fn
  if type(grad_fn).__module__.startswith("jax_privacy"):
    if getattr(grad_fn, "has_aux", False):
      raise ValueError("a jax_privacy clipped_grad with has_aux=True returns per-example "
                       "outputs; use has_aux=False.")
    return lambda params, batch, mask: grad_fn(params, batch,
                                               is_padding_example=jnp.logical_not(mask))
  return grad_fn


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPSGDPrivatizer:
  """What :func:`dp_sgd_privatizer` returns: one DP-SGD configuration, used consistently.

  Attributes:
    grad_fn: the clipped-gradient sum (carries C as ``l2_norm_bound``).
    transform: the optax privatiser (full or subspace noise, std σC, divides by L).
    noise_multiplier: σ (calibrated to the budget, or given).
    sampling_prob: q = L/N.
    expected_batch_size: L.
    num_examples: N.
    steps: T.
    microbatch_size: B, rows per jitted micro-batch.
    budget: the :class:`dpjax.accounting.DPSGDBudget` (ε, δ under add/remove-one).
    dp_event: the ``dp_accounting`` event of the T steps (for a ledger or another accountant).
  """
  grad_fn: Callable
  transform: optax.GradientTransformation
  noise_multiplier: float
  sampling_prob: float
  expected_batch_size: float
  num_examples: int
  steps: int
  microbatch_size: int
  budget: accounting.DPSGDBudget
  dp_event: Any

  def clipped_sum(self, params, data, key: jax.Array):
    """One step's clipped-gradient sum over a fresh Poisson sample drawn with ``key``.

    One jitted call of :func:`poisson_clipped_sum`: the sample (the draw of
    :func:`dpjax.sgd.poisson_mask`) is made on the device and every micro-batch of it is summed
    in a ``lax.while_loop``, so the host does no per-example work and the program compiles once
    per data shape, whatever the sample size. Feed the result to ``transform`` (it adds the
    noise). Use a fresh key per step.
    """
    return self._sum_fn(params, data, key, self.sampling_prob,
                        microbatch_size=self.microbatch_size)

  @functools.cached_property
  def _sum_fn(self):
    try:
      hash(self.grad_fn)
    except TypeError:        # an unhashable grad_fn cannot be static: one jit per privatizer
      return jax.jit(functools.partial(_clipped_sum_impl, self.grad_fn),
                     static_argnames=("microbatch_size",))
    return functools.partial(_clipped_sum_static, self.grad_fn)


def _clipped_sum_impl(grad_fn, params, data, key, sampling_prob, microbatch_size):
  return poisson_clipped_sum(grad_fn, params, data, key, sampling_prob=sampling_prob,
                             microbatch_size=microbatch_size)


_clipped_sum_static = jax.jit(_clipped_sum_impl, static_argnames=("grad_fn", "microbatch_size"))


def dp_sgd_privatizer(grad_fn, *, num_examples: int, expected_batch_size: float, steps: int,
                      key: jax.Array, epsilon: float | None = None, delta: float = 1e-5,
                      noise_multiplier: float | None = None, basis=None,
                      subspace_epsilon: float = 0.0, subspace_delta: float = 0.0,
                      microbatch_size: int | None = None,
                      accountant: str = "rdp") -> DPSGDPrivatizer:
  """DP-SGD (optionally with noise in a k-dim subspace) for an existing optax loop.

  Either ``epsilon`` (σ is calibrated so that the T steps, plus a private subspace's
  ``(subspace_epsilon, subspace_delta)``, are ``(epsilon, delta)``-DP) or ``noise_multiplier``
  (σ given; the budget is what the accountant certifies at ``delta``).

  Privacy: ``(budget.epsilon, budget.delta)``-DP under add/remove-one, for the T released noisy
  updates (and whatever is computed from them) — provided each step uses
  :meth:`DPSGDPrivatizer.clipped_sum` with a fresh key, then ``transform``, exactly T times, and
  ``basis`` is public or a DP release accounted in ``subspace_epsilon/delta``. Reason: the
  sampled Gaussian mechanism with ℓ2-sensitivity C = ``grad_fn.l2_norm_bound`` (Abadi et al.
  2016), accounted by ``dp_accounting`` (:func:`dpjax.accounting.dpsgd_event`).

  Args:
    grad_fn: sensitivity-bearing clipped-gradient sum with an ``l2_norm_bound``:
      :func:`dpjax.sgd.clipped_grad_sum`, or ``jax_privacy.clipping.clipped_grad(loss,
      l2_clip_norm=C)`` (its default ``normalize_by=1``: the sum, which the transform divides
      by L).
    num_examples: N ≥ 1, the private training set's size.
    expected_batch_size: L ∈ (0, N]; q = L/N.
    steps: T ≥ 1.
    key: PRNG key of the noise stream (kept in the transform's state).
    epsilon: total ε > 0, or None when ``noise_multiplier`` is given.
    delta: total δ ∈ (0, 1).
    noise_multiplier: σ ≥ 0 instead of ``epsilon`` (σ = 0: no privacy, ε = ∞).
    basis: optional ``(p, k)`` orthonormal basis (noise in its span;
      :func:`dpjax.sgd.update_basis` refreshes it in the optimiser state).
    subspace_epsilon, subspace_delta: the private basis's cost, composed into the total.
    microbatch_size: B (default ``⌈L + 4√L⌉``, capped at N).
    accountant: ``"rdp"`` or ``"pld"``.

  Returns:
    A :class:`DPSGDPrivatizer`.

  Raises:
    TypeError: ``grad_fn`` without an ``l2_norm_bound``; a bad key.
    ValueError: neither or both of ``epsilon`` and ``noise_multiplier``; L > N; bad sizes,
      budgets or basis (as :func:`dpjax.sgd.subspace_dp_gaussian_noise`).
  """
  clip_norm = l2_norm_bound(grad_fn)
  v.check_key(key)
  n = v.check_int(num_examples, "num_examples", low=1)
  batch = v.check_positive(expected_batch_size, "expected_batch_size")
  if batch > n:
    raise ValueError(f"expected_batch_size must be <= num_examples={n}, got {batch}.")
  steps = v.check_int(steps, "steps", low=1)
  delta = v.check_delta(delta)
  q = batch / n
  if (epsilon is None) == (noise_multiplier is None):
    raise ValueError("give exactly one of epsilon (σ is calibrated) and noise_multiplier.")
  if epsilon is not None:
    budget = accounting.plan_dpsgd_budget(
        v.check_positive(epsilon, "epsilon"), delta, sampling_prob=q, steps=steps,
        subspace_epsilon=subspace_epsilon, subspace_delta=subspace_delta, accountant=accountant)
  else:
    sigma = v.check_positive(noise_multiplier, "noise_multiplier", allow_zero=True)
    sgd_eps = (accounting.dpsgd_epsilon(sigma, q, steps, delta, accountant=accountant)
               if sigma > 0 else float("inf"))
    budget = accounting.DPSGDBudget(
        noise_multiplier=sigma, sampling_prob=q, steps=steps,
        subspace_epsilon=float(subspace_epsilon), subspace_delta=float(subspace_delta),
        sgd_epsilon=sgd_eps, sgd_delta=delta, epsilon=sgd_eps + float(subspace_epsilon),
        delta=delta + float(subspace_delta), neighbouring=NeighboringRelation.ADD_OR_REMOVE_ONE)
  sigma = budget.noise_multiplier
  if basis is None:
    transform = transforms.dp_gaussian_noise(clip_norm=clip_norm, noise_multiplier=sigma,
                                             expected_batch_size=batch, key=key)
  else:
    transform = transforms.subspace_dp_gaussian_noise(basis, clip_norm=clip_norm,
                                                      noise_multiplier=sigma,
                                                      expected_batch_size=batch, key=key)
  if microbatch_size is None:
    microbatch_size = min(n, int(np.ceil(batch + 4 * np.sqrt(batch))))
  microbatch_size = v.check_int(microbatch_size, "microbatch_size", low=1)
  return DPSGDPrivatizer(grad_fn=grad_fn, transform=transform, noise_multiplier=sigma,
                         sampling_prob=q, expected_batch_size=batch, num_examples=n,
                         steps=steps, microbatch_size=microbatch_size, budget=budget,
                         dp_event=accounting.dpsgd_event(sigma, q, steps) if sigma > 0 else None)
