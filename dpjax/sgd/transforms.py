"""optax transformations that privatise gradients (docs/algorithms.md §6.1, §6.2).

Like ``jax_privacy``'s ``clipped_grad``, the noise transformations take the SUM of clipped
per-example gradients (:func:`dpjax.sgd.clipped_grad_sum`) and return a noisy average divided by
the public expected batch size L, so they chain with any optax optimiser::

    tx = optax.chain(dp_gaussian_noise(clip_norm=1.0, noise_multiplier=σ,
                                       expected_batch_size=256, key=key), optax.adam(1e-3))

Privacy: one step is the sampled Gaussian mechanism — the clipped sum has ℓ2-sensitivity C under
add/remove-one and gets ``N(0, σ²C²)`` noise — accounted by :mod:`dpjax.accounting`. The noise is
sampled in the gradients' dtype (float32 in most training); the floating-point caveat of §1.10 is
not addressed inside DP-SGD, as in every DP-SGD library.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from dpjax import _validation as v
from dpjax import linalg
from dpjax.sgd import per_example


class DPNoiseState(NamedTuple):
  """The transformation's PRNG key, split at every step (never reused)."""
  key: jax.Array


class SubspaceNoiseState(NamedTuple):
  """State of :func:`subspace_dp_gaussian_noise`: the basis lives here, not in the program.

  Attributes:
    key: PRNG key, split at every update (never reused; :func:`update_basis` keeps it).
    basis: ``(p, k)`` public or DP-released basis V.
    base_std: float32 scalar ``σ·C`` (rounded up).
    noise_std: float32 scalar ``σ·C·max(1, ν̂)`` for this basis (:func:`basis_norm_bound`,
      rounded up): the std of the k-dimensional noise.
  """
  key: jax.Array
  basis: jax.Array
  base_std: jax.Array
  noise_std: jax.Array


def _check(clip_norm, noise_multiplier, expected_batch_size, key):
  v.check_key(key)
  return (v.check_positive(clip_norm, "clip_norm"),
          v.check_positive(noise_multiplier, "noise_multiplier", allow_zero=True),
          v.check_positive(expected_batch_size, "expected_batch_size"))


def dp_gaussian_noise(*, clip_norm: float, noise_multiplier: float, expected_batch_size: float,
                      key: jax.Array) -> optax.GradientTransformation:
  """``update(S) = (S + N(0, σ²C² I_p)) / L`` on every leaf: the DP-SGD privatiser.

  ``S`` is the sum of per-example gradients clipped to ℓ2 norm C
  (:func:`dpjax.sgd.clipped_grad_sum`). Privacy: under add/remove-one, S has ℓ2-sensitivity C,
  so each update is the Gaussian mechanism with noise multiplier σ; with Poisson sampling it is
  the sampled Gaussian mechanism that :func:`dpjax.accounting.dpsgd_epsilon` accounts. Dividing
  by the public L (not the realised batch size, which is private under Poisson sampling) and the
  optimiser that follows are post-processing.

  Example::

      tx = optax.chain(dp_gaussian_noise(clip_norm=1.0, noise_multiplier=1.1,
                                         expected_batch_size=256, key=key), optax.adam(1e-3))

  Args:
    clip_norm: C > 0, the bound the summed per-example gradients were clipped to.
    noise_multiplier: σ ≥ 0 (σ = 0 gives no privacy; useful for tests).
    expected_batch_size: L > 0, the public expected batch size ``q N``.
    key: PRNG key, kept in the state (:class:`DPNoiseState`) and split at every update, never
      reused.

  Returns:
    An ``optax.GradientTransformation``; updates have the structure and dtypes of ``S``, the
    noise is drawn in each leaf's dtype.

  Raises:
    ValueError: C ≤ 0, σ < 0, L ≤ 0 (or any of them not finite).
    TypeError: ``key`` not a PRNG key, non-numeric arguments.

  References:
    Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
  """
  clip_norm, sigma, batch = _check(clip_norm, noise_multiplier, expected_batch_size, key)
  return _gaussian_noise(sigma * clip_norm, batch, key)


def _gaussian_noise(std, batch, key) -> optax.GradientTransformation:
  """Unvalidated builder of :func:`dp_gaussian_noise` (traceable)."""

  def init_fn(params):
    del params
    return DPNoiseState(key)

  def update_fn(updates, state, params=None):
    del params
    next_key, noise_key = jax.random.split(state.key)
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    keys = jax.random.split(noise_key, len(leaves))
    # std and L may be traced scalars; cast them so that every leaf keeps its dtype.
    noisy = [(g + jnp.asarray(std, g.dtype) * jax.random.normal(k, g.shape, g.dtype))
             / jnp.asarray(batch, g.dtype) for g, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(treedef, noisy), DPNoiseState(next_key)

  return optax.GradientTransformation(init_fn, update_fn)


def subspace_dp_gaussian_noise(basis: jax.Array, *, clip_norm: float, noise_multiplier: float,
                               expected_batch_size: float, key: jax.Array,
                               tol: float = 1e-3) -> optax.GradientTransformation:
  """Noise in a k-dim subspace only: ``update(S) = unravel(V (Vᵀ s + N(0, σ²C²ν² I_k)) / L)``.

  ``s = ravel_pytree(S)`` flattens the summed clipped gradients (p parameters) and ``V (p, k)``
  has orthonormal columns. Privacy per step is that of DP-SGD, under add/remove-one: ``Vᵀ`` is
  linear and commutes with the sum, so the released k-vector ``Vᵀ s`` has ℓ2-sensitivity
  ``≤ C·‖V‖₂`` and gets ``N(0, σ²C²ν²)`` noise with ``ν = max(1, ν̂) ≥ ‖V‖₂`` (ν̂ from
  :func:`basis_norm_bound`, an upper bound on the spectral norm computed in float64). The
  released vector is therefore the Gaussian mechanism with noise multiplier ≥ σ relative to its
  sensitivity, whatever V: a basis that is only nearly orthonormal (floating point; an
  orthonormal basis cast to float32) cannot stretch a clipped gradient past its noise. Mapping
  back by V and dividing by L are post-processing (docs/algorithms.md §6.2). Account it with the same
  :func:`dpjax.accounting.dpsgd_event`. The noise energy is ``σ²C²ν²k/L²`` instead of
  ``σ²C²p/L²``; the price is the discarded residual ``(I − VVᵀ)s``. (An entrywise check
  ``max |VᵀV − I| ≤ tol``, used before, accepted bases with ``‖V‖₂ ≈ 1.41`` at k = 1000: the
  privacy argument needs the spectral norm.)

  ``V`` must be public or a DP release (e.g. DPASE's basis from
  :func:`dpjax.sgd.private_gradient_subspace`) whose cost is composed in; a basis computed
  non-privately from the training data voids the guarantee.

  Args:
    basis: ``(p, k)`` float array with orthonormal columns, ``1 ≤ k ≤ p``; p must equal the
      number of parameters (checked at ``init``).
    clip_norm: C > 0.
    noise_multiplier: σ ≥ 0.
    expected_batch_size: L > 0, the public expected batch size.
    key: PRNG key, kept in the state and split at every update.
    tol: accepted ``‖VᵀV − I‖₂`` (spectral), default 1e-3. A usability check only: privacy
      holds for any accepted V because the noise is scaled by ν ≥ ‖V‖₂.

  Returns:
    An ``optax.GradientTransformation`` whose updates lie in ``span(V)`` (as pytrees like S).
    V and the noise std live in its state (:class:`SubspaceNoiseState`), not in the compiled
    update (at p = 2·10⁵, k = 16 the update's HLO is 19 KB, against 25.6 MB with V baked in);
    :func:`update_basis` swaps in a refreshed basis and keeps the key stream.

  Raises:
    ValueError: ``basis`` not 2-D with ``1 ≤ k ≤ p``, not finite, or its columns not
      orthonormal (``‖VᵀV − I‖₂ > tol``); at ``init``, p ≠ the parameter count; and as
      :func:`dp_gaussian_noise`.
    TypeError: as :func:`dp_gaussian_noise`; ``basis`` not a float array.

  References:
    Zhou, Wu & Banerjee, "Bypassing the Ambient Dimension: Private SGD with Gradient Subspace
    Identification" (PDP-SGD), ICLR 2021; Yu et al., "Do Not Let Privacy Overbill Utility:
    Gradient Embedding Perturbation" (GEP), ICLR 2021.
  """
  clip_norm, sigma, batch = _check(clip_norm, noise_multiplier, expected_batch_size, key)
  basis = check_basis(basis, tol=tol)
  base_std = round_up_float32(sigma * clip_norm)
  return _subspace_noise(batch, key, basis, base_std, subspace_noise_std(base_std, basis))


def _subspace_noise(batch, key, basis=None, base_std=None,
                    noise_std=None) -> optax.GradientTransformation:
  """Unvalidated builder of :func:`subspace_dp_gaussian_noise`: ``update`` reads V and the noise
  std from the state, so neither is a constant of the compiled program (``basis`` and the stds
  are needed by ``init`` only)."""

  def init_fn(params):
    p = ravel_pytree(params)[0].shape[0]
    if p != basis.shape[0]:
      raise ValueError(f"basis must have one row per parameter: p={p}, got basis of shape "
                       f"{tuple(basis.shape)}.")
    return SubspaceNoiseState(key, jnp.asarray(basis), jnp.asarray(base_std, jnp.float32),
                              jnp.asarray(noise_std, jnp.float32))

  def update_fn(updates, state, params=None):
    del params
    next_key, noise_key = jax.random.split(state.key)
    flat, unravel = ravel_pytree(updates)
    # The released k-vector is computed with V as stored (at least float32), never with V cast
    # down to 16-bit gradients: basis_norm_bound covers V's own values (and a float32 cast),
    # not a 16-bit rounding of them. Casting the noisy result back is post-processing.
    dtype = jnp.promote_types(jnp.promote_types(flat.dtype, state.basis.dtype), jnp.float32)
    V = state.basis.astype(dtype)
    noise = jax.random.normal(noise_key, (V.shape[1],), dtype)
    coefficients = linalg.matmul(V.T, flat.astype(dtype)) + state.noise_std.astype(dtype) * noise
    out = (linalg.matmul(V, coefficients) / jnp.asarray(batch, dtype)).astype(flat.dtype)
    return unravel(out), state._replace(key=next_key)

  return optax.GradientTransformation(init_fn, update_fn)


def update_basis(opt_state, basis, *, tol: float = 1e-3):
  """Swaps a new basis into every :class:`SubspaceNoiseState` of ``opt_state``; keys are kept.

  For a refreshed subspace (a new public basis, or a new DP release whose cost is composed in):
  the transformation, its compiled update and its key stream stay; only V and the noise std
  ``σ·C·max(1, ν̂(V))`` (:func:`basis_norm_bound`) change. Host-side (validates V in float64),
  call it between jitted steps. Works on a whole ``optax.chain`` state.

  Args:
    opt_state: an optimiser state containing one or more :class:`SubspaceNoiseState`.
    basis: ``(p, k)`` float array with orthonormal columns, of the same shape and dtype as the
      current one (so the compiled update is reused).
    tol: accepted ``‖VᵀV − I‖₂``, as in :func:`subspace_dp_gaussian_noise`.

  Returns:
    ``opt_state`` with the new basis and noise std.

  Raises:
    ValueError: no :class:`SubspaceNoiseState` in ``opt_state``; a basis of another shape; as
      :func:`check_basis`.
  """
  basis = check_basis(basis, tol=tol)

  def swap(state):
    if state.basis.shape != basis.shape:
      raise ValueError(f"the new basis must have the current shape {tuple(state.basis.shape)}, "
                       f"got {tuple(basis.shape)}.")
    std = subspace_noise_std(float(state.base_std), basis)
    return state._replace(basis=basis.astype(state.basis.dtype),
                          noise_std=jnp.asarray(std, jnp.float32))

  return map_states(opt_state, SubspaceNoiseState, swap, "subspace_dp_gaussian_noise")


def map_states(opt_state, state_type, fn, origin: str):
  """Applies ``fn`` to every ``state_type`` node of an optimiser state (e.g. a whole
  ``optax.chain`` state), leaving the rest as is.

  Raises:
    ValueError: ``opt_state`` holds no ``state_type`` (from the transform ``origin``).
  """
  is_state = lambda x: isinstance(x, state_type)  # noqa: E731
  if not any(is_state(x) for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_state)):
    raise ValueError(f"opt_state has no {state_type.__name__} (from {origin}).")
  return jax.tree_util.tree_map(lambda x: fn(x) if is_state(x) else x, opt_state,
                                is_leaf=is_state)


def round_up_float32(value: float) -> np.float32:
  """``value`` as float32, rounded UP (a noise std is never below the accounted one)."""
  out = np.float32(value)
  if float(out) < value:
    out = np.nextafter(out, np.float32(np.inf))
  return out


def subspace_noise_std(base_std: float, basis) -> np.float32:
  """``σC·max(1, ν̂)`` in float32 rounded up: the sensitivity of ``Vᵀs`` is ``C‖V‖₂`` and
  ``ν̂ ≥ ‖V‖₂`` (:func:`basis_norm_bound`)."""
  return round_up_float32(float(base_std) * max(1.0, basis_norm_bound(basis)))


def dp_aggregate(*, clip_norm: float, noise_multiplier: float, expected_batch_size: float,
                 key: jax.Array,
                 basis: jax.Array | None = None) -> optax.GradientTransformationExtraArgs:
  """Per-example gradients in, privatised average out (an optax.contrib-style aggregator).

  ``update(per_example_grads, state, params=None, *, mask=None)``: clip each example's gradient
  (leaves with a leading batch axis B) to global ℓ2 norm C, sum the rows weighted by ``mask``
  (``(B,)``, 0/False for padding; default all ones), then apply :func:`dp_gaussian_noise`, or
  :func:`subspace_dp_gaussian_noise` when ``basis`` is given. Unlike
  ``optax.contrib.differentially_private_aggregate`` it divides by the public expected batch
  size L, not by the realised one. Privacy: as the noise transform it wraps (add/remove-one,
  sensitivity C). Prefer :func:`dpjax.sgd.clipped_grad_sum` + the noise transform when you can:
  it never materialises the ``(B, p)`` per-example gradients.

  Args:
    clip_norm: C > 0.
    noise_multiplier: σ ≥ 0.
    expected_batch_size: L > 0.
    key: PRNG key, kept in the state.
    basis: optional ``(p, k)`` orthonormal basis (see :func:`subspace_dp_gaussian_noise`).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its updates have the params' structure.

  Raises:
    As :func:`dp_gaussian_noise` / :func:`subspace_dp_gaussian_noise`; at ``update``,
    ``ValueError`` if ``mask`` is not ``(B,)``.
  """
  if basis is None:
    inner = dp_gaussian_noise(clip_norm=clip_norm, noise_multiplier=noise_multiplier,
                              expected_batch_size=expected_batch_size, key=key)
  else:
    inner = subspace_dp_gaussian_noise(basis, clip_norm=clip_norm,
                                       noise_multiplier=noise_multiplier,
                                       expected_batch_size=expected_batch_size, key=key)
  clip_norm = float(clip_norm)

  def update_fn(updates, state, params=None, *, mask=None, **extra_args):
    del extra_args
    clipped = per_example.clip_per_example(updates, clip_norm)
    size = jax.tree_util.tree_leaves(clipped)[0].shape[0]
    weights = jnp.ones(size) if mask is None else jnp.asarray(mask)
    if weights.shape != (size,):
      raise ValueError(f"mask must have shape ({size},) (one entry per example), got "
                       f"{tuple(weights.shape)}.")
    summed = jax.tree_util.tree_map(
        lambda g: jnp.tensordot(weights.astype(g.dtype), g, axes=1, precision=linalg.HIGHEST),
        clipped)
    return inner.update(summed, state, params)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def check_basis(basis, name: str = "basis", *, tol: float = 1e-3,
                partial: bool = False) -> jax.Array:
  """Validates a ``(p, k)`` basis with orthonormal columns on the host; returns it as an array.

  The orthonormality check is spectral, ``‖VᵀV − I‖₂ ≤ tol`` (float64), and serves usability
  only; the transforms keep privacy for any accepted V by scaling their noise with
  :func:`basis_norm_bound`. With ``partial=True`` a partial isometry is accepted too (columns
  orthonormal or zero, as :func:`dpjax.sgd.trajectory_bases` returns under its rank rule): every
  eigenvalue of ``VᵀV`` within ``tol`` of 0 or 1, so ``VVᵀ`` is (up to ``tol``) an orthogonal
  projector and ``‖V‖₂ ≤ 1 + tol``.

  Raises:
    ValueError: not 2-D, ``k ∉ [1, p]``, non-finite entries, or ``‖VᵀV − I‖₂ > tol`` (with
      ``partial``: an eigenvalue of ``VᵀV`` farther than ``tol`` from both 0 and 1).
    TypeError: not a float array.
  """
  try:
    basis = jnp.asarray(basis)
  except TypeError as exc:
    raise TypeError(f"{name} must be a (p, k) float array, got {type(basis).__name__}.") from exc
  if basis.ndim != 2 or basis.shape[1] == 0 or basis.shape[1] > basis.shape[0]:
    raise ValueError(f"{name} must have shape (p, k) with 1 <= k <= p, got "
                     f"{tuple(basis.shape)}.")
  if not jnp.issubdtype(basis.dtype, jnp.floating):
    raise TypeError(f"{name} must be a float array, got dtype={basis.dtype}.")
  tol = v.check_positive(tol, "tol")
  b = np.asarray(basis, np.float64)
  if not np.all(np.isfinite(b)):
    raise ValueError(f"{name} contains NaN or infinite entries.")
  eigenvalues = np.linalg.eigvalsh(_gram(b))
  if partial:
    err = float(np.max(np.minimum(np.abs(eigenvalues), np.abs(eigenvalues - 1.0))))
    if err > tol:
      raise ValueError(f"{name} must have orthonormal or zero columns (every eigenvalue of VᵀV "
                       f"within {tol} of 0 or 1), got one {err:.3g} away.")
    return basis
  err = float(np.max(np.abs(eigenvalues - 1.0)))
  if err > tol:
    raise ValueError(f"{name} must have orthonormal columns (‖VᵀV − I‖₂ <= {tol}), got "
                     f"‖VᵀV − I‖₂ = {err:.3g}.")
  return basis


def _gram(b: np.ndarray) -> np.ndarray:
  gram = b.T @ b
  return 0.5 * (gram + gram.T)


def basis_norm_bound(basis) -> float:
  """An upper bound on the spectral norm ``‖V‖₂`` of a ``(p, k)`` basis (host, float64).

  ``λ_max(VᵀV)`` in float64, plus margins for the rounding of the Gram product
  (``(p + 10k)·2^-53·tr(VᵀV)``, which bounds ``‖ΔG‖₂ ≤ ‖ΔG‖_F`` and the eigensolver's error), then
  a factor ``1 + 2^-24·√k`` that covers casting V to float32 (each entry moves by ≤ 2^-24
  relative, so ``‖ΔV‖₂ ≤ 2^-24‖V‖_F ≤ 2^-24√k‖V‖₂``). The noise transforms scale their noise by
  ``max(1, bound)``, so ``‖Vᵀx‖ ≤ bound·‖x‖`` is what their privacy rests on.

  Args:
    basis: ``(p, k)`` real array.

  Returns:
    The bound as a Python float (about 1 for an orthonormal basis).
  """
  b = np.asarray(basis, np.float64)
  p, k = b.shape
  gram = _gram(b)
  top = float(np.linalg.eigvalsh(gram)[-1])
  top += (p + 10 * k) * 2.0**-53 * float(np.trace(gram))
  return math.sqrt(max(top, 0.0)) * (1.0 + 2.0**-24 * math.sqrt(k))
