"""DP-SGD's batch selection: Poisson sampling with fixed-size micro-batches (docs/algorithms.md
§6.1).

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

import dataclasses
import functools
import math
from typing import Callable

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np

from dpjax import _validation as v
from dpjax.sgd import per_example

__all__ = ["CyclicPoissonSampling", "FixedSizeSampling", "PoissonSampling",
           "TruncatedPoissonSampling", "accumulate_microbatches", "cyclic_poisson_chosen",
           "cyclic_poisson_sampling", "fixed_size_chosen", "fixed_size_sampling",
           "poisson_clipped_sum", "poisson_mask", "poisson_microbatches", "poisson_sampling",
           "truncated_poisson_clipped_sum", "truncated_poisson_sampling"]


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


@dataclasses.dataclass(frozen=True)
class PoissonSampling:
  """Batch selection by Poisson sampling: each of the N examples enters a step independently with
  probability ``q = L/N``; the sample is summed in micro-batches of B rows, never truncated.

  Its part of the privacy argument is :meth:`dp_event`: a step event (the Gaussian release of
  the clipped sum) becomes ``PoissonSampledDpEvent(q, step)``, meaningful under add/remove-one
  (the relation under which ``dp_accounting`` amplifies by Poisson subsampling). Other schemes
  (shuffling, fixed-size sampling) would be other classes with the same two methods.

  Attributes:
    num_examples: N, the private training set's size (public).
    expected_batch_size: L ∈ (0, N].
    microbatch_size: B, rows per jitted micro-batch (static).
  """
  num_examples: int
  expected_batch_size: float
  microbatch_size: int

  @property
  def sampling_prob(self) -> float:
    """q = L/N."""
    return self.expected_batch_size / self.num_examples

  def dp_event(self, step_event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
    """``PoissonSampledDpEvent(q, step_event)``: one sampled step (add/remove-one)."""
    return dp_accounting.PoissonSampledDpEvent(self.sampling_prob, step_event)

  def compositions(self, steps: int) -> int:
    """How many times :meth:`dp_event` composes over T steps: T."""
    return steps

  def chosen(self, key: jax.Array, **_) -> jax.Array:
    """``(N,)`` bool: this step's sample (:func:`poisson_mask`; the mask a mesh's devices sum
    their rows of)."""
    return poisson_mask(key, self.num_examples, self.sampling_prob)

  def clipped_sum(self, grad_fn: Callable, params, data, key: jax.Array, *extra_args):
    """One step's clipped-gradient sum over a fresh Poisson sample drawn with ``key``
    (traceable; :func:`poisson_clipped_sum`). Use a fresh key per step."""
    return poisson_clipped_sum(grad_fn, params, data, key, sampling_prob=self.sampling_prob,
                               microbatch_size=self.microbatch_size, extra_args=extra_args)


def poisson_sampling(num_examples: int, expected_batch_size: float, *,
                     microbatch_size: int | None = None, devices: int = 1) -> PoissonSampling:
  """Validated :class:`PoissonSampling`.

  Args:
    num_examples: N ≥ 1.
    expected_batch_size: L ∈ (0, N].
    microbatch_size: B ≥ 1 (default ``min(⌈N/D⌉, ⌈L' + 4√L'⌉)`` with ``L' = L/D`` the expected
      sample per device, D = ``devices``: one micro-batch covers the sample with high
      probability).
    devices: D ≥ 1, the devices the examples are sharded over (sets the default B).

  Raises:
    ValueError: N < 1, L ∉ (0, N], B < 1, D < 1.
    TypeError: non-integer N, B or D.
  """
  n = v.check_int(num_examples, "num_examples", low=1)
  batch = v.check_positive(expected_batch_size, "expected_batch_size")
  if batch > n:
    raise ValueError(f"expected_batch_size must be <= num_examples={n}, got {batch}.")
  devices = v.check_int(devices, "devices", low=1)
  if microbatch_size is None:
    local = batch / devices
    microbatch_size = min(math.ceil(n / devices), math.ceil(local + 4 * math.sqrt(local)))
  microbatch_size = v.check_int(microbatch_size, "microbatch_size", low=1)
  return PoissonSampling(n, float(batch), microbatch_size)


@dataclasses.dataclass(frozen=True)
class TruncatedPoissonSampling:
  """Poisson sampling truncated to at most B examples a step: static shapes, no micro-batch loop.

  Each example enters the Poisson sample independently with probability q = L/N; when the
  sample holds more than B = ``max_batch_size`` examples, a uniformly random subset of B of them
  is kept. The step is then ONE clipped sum over a fixed batch of B rows (masked where the
  sample is smaller), so its shapes are static and no loop over micro-batches is needed.

  Its part of the privacy argument is :meth:`dp_event`: truncation lets an added example evict
  another, so a step is no longer the Poisson-sampled Gaussian mechanism; ``dp_accounting``'s
  ``TruncatedSubsampledGaussianDpEvent`` (Google, arXiv 2508.15089) accounts for it as a mixture
  of the sampled Gaussian mechanism and, with the probability that the sample overflows, one of
  twice the sensitivity. Only the PLD accountant composes it. Under add/remove-one the event is
  stated with ``dataset_size = N + 1``, the larger of the two neighbours (the overflow
  probability grows with the number of other examples).

  Attributes:
    num_examples: N, the private training set's size (public).
    expected_batch_size: L ∈ (0, N].
    max_batch_size: B ≥ 1, the rows of the step's one static batch.
  """
  num_examples: int
  expected_batch_size: float
  max_batch_size: int

  @property
  def sampling_prob(self) -> float:
    """q = L/N."""
    return self.expected_batch_size / self.num_examples

  @property
  def microbatch_size(self) -> int:
    """The one batch's rows, B (the micro-batch of a step that needs only one)."""
    return self.max_batch_size

  def dp_event(self, step_event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
    """``TruncatedSubsampledGaussianDpEvent(N + 1, q, B, σ)`` for a Gaussian step event.

    Raises:
      ValueError: a step event that is not a ``GaussianDpEvent`` (the truncated analysis is
        for the Gaussian mechanism only).
    """
    if not isinstance(step_event, dp_accounting.GaussianDpEvent):
      raise ValueError("truncated Poisson sampling is accounted for the Gaussian mechanism only "
                       f"(dp_accounting's TruncatedSubsampledGaussianDpEvent), got {step_event}.")
    return dp_accounting.TruncatedSubsampledGaussianDpEvent(
        dataset_size=self.num_examples + 1, sampling_probability=self.sampling_prob,
        truncated_batch_size=self.max_batch_size, noise_multiplier=step_event.noise_multiplier)

  def compositions(self, steps: int) -> int:
    """How many times :meth:`dp_event` composes over T steps: T."""
    return steps

  def clipped_sum(self, grad_fn: Callable, params, data, key: jax.Array, *extra_args):
    """One step's clipped-gradient sum over a fresh truncated Poisson sample drawn with ``key``
    (traceable; :func:`truncated_poisson_clipped_sum`). Use a fresh key per step."""
    return truncated_poisson_clipped_sum(grad_fn, params, data, key,
                                         sampling_prob=self.sampling_prob,
                                         max_batch_size=self.max_batch_size,
                                         extra_args=extra_args)


def truncated_poisson_sampling(num_examples: int, expected_batch_size: float,
                               max_batch_size: int) -> TruncatedPoissonSampling:
  """Validated :class:`TruncatedPoissonSampling`.

  Raises:
    ValueError: N < 1, L ∉ (0, N], B < 1.
    TypeError: non-integer N or B.
  """
  selection = poisson_sampling(num_examples, expected_batch_size, microbatch_size=1)
  return TruncatedPoissonSampling(selection.num_examples, selection.expected_batch_size,
                                  v.check_int(max_batch_size, "max_batch_size", low=1))


def truncated_poisson_chosen(key: jax.Array, num_examples: int, sampling_prob,
                             max_batch_size: int) -> tuple[jax.Array, jax.Array]:
  """``(indices, mask)``, both ``(B,)``: a Poisson sample at q truncated to a uniformly random
  subset of at most B of its examples (the first B of the sample in a random permutation's
  order; traceable). ``key`` is split once into the sample's and
  the subset's streams. The mask marks the kept examples; like the sample, it never enters a
  released value (:mod:`dpjax.sgd.sampling`)."""
  sample_key, subset_key = jax.random.split(key)
  sampled = jax.random.bernoulli(sample_key, sampling_prob, (num_examples,))
  # A uniform subset of the sample: the sampled examples in a uniformly random order (a
  # permutation, not float priorities, which tie for N in the tens of thousands and would be
  # broken by index), the first B kept.
  order = jax.random.permutation(subset_key, num_examples)
  first = jnp.argsort(~sampled[order], stable=True)
  indices = order[first][:min(max_batch_size, num_examples)].astype(jnp.int32)
  mask = sampled[indices]
  pad = max_batch_size - indices.shape[0]
  if pad:                                        # B > N: a batch of B rows all the same
    indices = jnp.concatenate([indices, jnp.zeros((pad,), jnp.int32)])
    mask = jnp.concatenate([mask, jnp.zeros((pad,), bool)])
  return indices, mask


@dataclasses.dataclass(frozen=True)
class CyclicPoissonSampling:
  """Cyclic Poisson sampling: the examples are split once into b groups; step t samples only
  group ``t mod b``, each of its examples independently with probability ``q_g = L·b/N``.

  The batch selection of banded matrix-factorization noise (BandMF; :mod:`dpjax.sgd.correlation`):
  an example can take part only in steps b apart, so with a b-banded strategy its
  contributions never share a band. The groups are an INDEPENDENT partition (each example's
  group uniform on {0, …, b−1}, drawn once per run from the plan's key, never from the data),
  which is what the amplified analysis needs under add/remove-one (jax_privacy's
  ``PartitionType.INDEPENDENT``). The expected batch is ``q_g·N/b = L`` at every step.

  Its part of the privacy argument: :meth:`dp_event` is ``PoissonSampledDpEvent(q_g, step)``
  and it composes ``⌈T/b⌉`` times (:meth:`compositions`) — the amplified BandMF theorem
  (Choquette-Choo et al. 2023, Thm 4; jax_privacy's ``amplified_bandmf_event``) for noise whose
  strategy C is at most b-banded with columns of norm ≤ 1; with independent noise (C = I) it is
  plain: each example takes part in at most ``⌈T/b⌉`` steps, each a sampled Gaussian step.
  docs/algorithms.md §6.1.

  Unamplified (``amplified=False``, for a BLT strategy normalised to min-sep sensitivity 1,
  :class:`dpjax.sgd.correlation.BufferedToeplitz`): :meth:`dp_event` is the step's Gaussian
  itself and it composes once — the whole run is one Gaussian mechanism. Given the partition
  and every sampling coin (independent of the data), the added example takes part in steps at
  least b apart, at most ⌈T/b⌉ of them, so the normalised strategy's output moves by at most Δ;
  mixing over the coins keeps the Gaussian's (ε, δ) curve (docs/algorithms.md §6.7).

  Attributes:
    num_examples: N, the private training set's size (public).
    expected_batch_size: L, with ``L·b ≤ N``.
    cycle_length: b ≥ 1 (1: Poisson sampling).
    microbatch_size: rows per jitted micro-batch (static).
    amplified: True (the amplified event) or False (one Gaussian for the run).
  """
  num_examples: int
  expected_batch_size: float
  cycle_length: int
  microbatch_size: int
  amplified: bool = True

  @property
  def sampling_prob(self) -> float:
    """q_g = L·b/N, an example's inclusion probability in a step of its group."""
    return min(1.0, self.expected_batch_size * self.cycle_length / self.num_examples)

  def dp_event(self, step_event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
    """``PoissonSampledDpEvent(q_g, step_event)``: one of an example's rounds (add/remove-one);
    unamplified, ``step_event`` itself (the run's one Gaussian)."""
    if not self.amplified:
      return step_event
    return dp_accounting.PoissonSampledDpEvent(self.sampling_prob, step_event)

  def compositions(self, steps: int) -> int:
    """⌈T/b⌉: the most steps one example can take part in (unamplified: 1, the run)."""
    if not self.amplified:
      return 1
    return -(-steps // self.cycle_length)

  def chosen(self, key: jax.Array, *, step, partition_key: jax.Array, **_) -> jax.Array:
    """``(N,)`` bool: step ``step``'s sample (:func:`cyclic_poisson_chosen`)."""
    return cyclic_poisson_chosen(key, partition_key, self.num_examples, self.sampling_prob,
                                 self.cycle_length, step)

  def clipped_sum(self, grad_fn: Callable, params, data, key: jax.Array, *extra_args, step,
                  partition_key: jax.Array):
    """Step ``step``'s clipped-gradient sum over the Poisson sample of group ``step mod b``
    (traceable): ``key`` this step's fresh sample key, ``partition_key`` the run's one
    partition key (the same at every step)."""
    chosen = cyclic_poisson_chosen(key, partition_key, _num_rows(data), self.sampling_prob,
                                   self.cycle_length, step)
    data = jax.tree_util.tree_map(jnp.asarray, data)
    return sum_over_chosen(masked_call(grad_fn), params, data, chosen, self.microbatch_size,
                           extra_args)


def cyclic_poisson_sampling(num_examples: int, expected_batch_size: float, cycle_length: int, *,
                            microbatch_size: int | None = None,
                            amplified: bool = True) -> CyclicPoissonSampling:
  """Validated :class:`CyclicPoissonSampling` (default micro-batch size as
  :func:`poisson_sampling`'s).

  Raises:
    ValueError: N < 1, L ∉ (0, N], b < 1, ``L·b > N`` (q_g would exceed 1), B < 1.
    TypeError: non-integer N, b or B.
  """
  selection = poisson_sampling(num_examples, expected_batch_size, microbatch_size=microbatch_size)
  b = v.check_int(cycle_length, "cycle_length", low=1)
  if selection.expected_batch_size * b > selection.num_examples:
    raise ValueError(f"cyclic Poisson sampling needs expected_batch_size·cycle_length <= "
                     f"num_examples (each group of about N/b examples must hold the expected "
                     f"batch L): {selection.expected_batch_size:g}·{b} > "
                     f"{selection.num_examples}.")
  return CyclicPoissonSampling(selection.num_examples, selection.expected_batch_size, b,
                               selection.microbatch_size, bool(amplified))


def cyclic_poisson_chosen(key: jax.Array, partition_key: jax.Array, num_examples: int,
                          sampling_prob, cycle_length: int, step) -> jax.Array:
  """``(N,)`` bool, traceable: the examples of group ``step mod b`` (the independent partition
  drawn from ``partition_key``: each example's group uniform on {0, …, b−1}), each kept with
  probability ``sampling_prob`` (a Bernoulli mask drawn with ``key``, as :func:`poisson_mask`)."""
  group = jax.random.randint(partition_key, (num_examples,), 0, cycle_length)
  eligible = group == jnp.asarray(step, jnp.int32) % cycle_length
  return eligible & jax.random.bernoulli(key, sampling_prob, (num_examples,))


@dataclasses.dataclass(frozen=True)
class FixedSizeSampling:
  """Fixed-size sampling: each step a uniformly random batch of exactly B distinct examples
  (sampling without replacement), the same B at every step.

  Its part of the privacy argument is :meth:`dp_event`, stated under REPLACE-ONE (the datasets
  have the same public size N and differ in one example's value): ``dp_accounting`` composes
  ``SampledWithoutReplacementDpEvent`` (Wang, Balle & Kasiviswanathan 2019, Thm 27) under
  ``NeighboringRelation.REPLACE_ONE`` and by RDP only. Replacing one example moves the clipped
  sum by up to 2Δ (its old term out, its new one in), so the step's Gaussian with std σΔ has
  noise multiplier σ/2 relative to that sensitivity: the event is
  ``SampledWithoutReplacementDpEvent(N, B, GaussianDpEvent(σ/2))``. A plan with this selection
  states every figure under replace-one (``plan.budget.neighboring``); compare with an
  add/remove-one plan only after :func:`dpjax.accounting.replace_one_from_add_remove`.
  docs/algorithms.md §6.1.

  Attributes:
    num_examples: N (public; the same in both neighbours).
    batch_size: B ∈ [1, N], an integer.
    microbatch_size: rows per jitted micro-batch (static).
  """
  num_examples: int
  batch_size: int
  microbatch_size: int

  neighboring = dp_accounting.NeighboringRelation.REPLACE_ONE

  @property
  def expected_batch_size(self) -> float:
    """B (the batch is always B)."""
    return float(self.batch_size)

  @property
  def sampling_prob(self) -> float:
    """B/N, each example's inclusion probability in a step."""
    return self.batch_size / self.num_examples

  def dp_event(self, step_event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
    """``SampledWithoutReplacementDpEvent(N, B, GaussianDpEvent(σ/2))`` for the step's
    ``GaussianDpEvent(σ)`` (replace-one: sensitivity 2Δ).

    Raises:
      ValueError: a step event that is not a ``GaussianDpEvent``.
    """
    if not isinstance(step_event, dp_accounting.GaussianDpEvent):
      raise ValueError("fixed-size sampling is accounted for the Gaussian mechanism only, got "
                       f"{step_event}.")
    return dp_accounting.SampledWithoutReplacementDpEvent(
        self.num_examples, self.batch_size,
        dp_accounting.GaussianDpEvent(step_event.noise_multiplier / 2))

  def compositions(self, steps: int) -> int:
    """How many times :meth:`dp_event` composes over T steps: T."""
    return steps

  def chosen(self, key: jax.Array, **_) -> jax.Array:
    """``(N,)`` bool: this step's batch (:func:`fixed_size_chosen`)."""
    return fixed_size_chosen(key, self.num_examples, self.batch_size)

  def clipped_sum(self, grad_fn: Callable, params, data, key: jax.Array, *extra_args):
    """One step's clipped-gradient sum over a fresh batch of B examples drawn with ``key``
    (traceable). Use a fresh key per step."""
    chosen = fixed_size_chosen(key, _num_rows(data), self.batch_size)
    data = jax.tree_util.tree_map(jnp.asarray, data)
    return sum_over_chosen(masked_call(grad_fn), params, data, chosen, self.microbatch_size,
                           extra_args)


def fixed_size_sampling(num_examples: int, batch_size: int, *,
                        microbatch_size: int | None = None) -> FixedSizeSampling:
  """Validated :class:`FixedSizeSampling` (default micro-batch: the whole batch B).

  Raises:
    ValueError: N < 1, B ∉ [1, N], micro-batch < 1.
    TypeError: non-integer N, B or micro-batch size.
  """
  n = v.check_int(num_examples, "num_examples", low=1)
  b = v.check_int(batch_size, "batch_size", low=1, high=n)
  microbatch_size = v.check_int(b if microbatch_size is None else microbatch_size,
                                "microbatch_size", low=1)
  return FixedSizeSampling(n, b, microbatch_size)


def fixed_size_chosen(key: jax.Array, num_examples: int, batch_size: int) -> jax.Array:
  """``(N,)`` bool with exactly B True: a uniformly random subset of B of the N examples (the
  first B of ``jax.random.permutation``, whose sort rounds make ties of its random keys
  negligible — float priorities would tie for N in the tens of thousands), traceable."""
  indices = jax.random.permutation(key, num_examples)[:batch_size]
  return jnp.zeros((num_examples,), bool).at[indices].set(True)


def _num_rows(data) -> int:
  """N, the leading example axis every leaf of ``data`` shares (static)."""
  sizes = {x.shape[0] for x in jax.tree_util.tree_leaves(data)}
  if len(sizes) != 1:
    raise ValueError(f"data leaves must share one leading example axis, got sizes {sizes}.")
  return sizes.pop()


def truncated_poisson_clipped_sum(grad_fn: Callable, params, data, key: jax.Array, *,
                                  sampling_prob, max_batch_size: int, extra_args=()):
  """The clipped-gradient sum over a truncated Poisson sample (:class:`TruncatedPoissonSampling`):
  traceable core; one call of ``grad_fn`` on a static batch of ``max_batch_size`` rows.

  Args:
    grad_fn, params, data, extra_args: as :func:`poisson_clipped_sum`.
    key: PRNG key of this step's sample (a fresh one per step).
    sampling_prob: q ∈ (0, 1].
    max_batch_size: B ≥ 1 (static).

  Raises:
    ValueError: ``max_batch_size < 1``; data without a common leading axis.
  """
  max_batch_size = v.check_int(max_batch_size, "max_batch_size", low=1)
  indices, mask = truncated_poisson_chosen(key, _num_rows(data), sampling_prob, max_batch_size)
  batch = jax.tree_util.tree_map(lambda x: jnp.asarray(x)[indices], data)
  return masked_call(grad_fn)(params, batch, mask, *extra_args)


@functools.partial(jax.jit, static_argnames=("grad_fn",))
def accumulate_microbatches(grad_fn: Callable, params, data, indices: jax.Array,
                            mask: jax.Array):
  """``Σ_m grad_fn(params, data[indices[m]], mask[m])`` over ALL micro-batches, in one call.

  Traceable core of a DP-SGD step's clipped sum: a ``lax.scan`` over the ``(M, B)`` layout of
  :func:`dpjax.sgd.sampling.poisson_microbatches`, so no micro-batch of the sample can be skipped (a
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

  The traceable core of :meth:`PoissonSampling.clipped_sum` (and of the plan's step), for
  training loops written as one ``lax.scan`` (and ``vmap``-ped over seeds or hyperparameters): the sample is
  :func:`dpjax.sgd.sampling.poisson_mask` with ``key`` (the same draw as the host-side
  :func:`dpjax.sgd.sampling.poisson_microbatches`), its indices are laid out in fixed-size micro-batches
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
  n = _num_rows(data)
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
