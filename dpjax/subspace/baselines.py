"""Baselines for private subspace learning: Analyze Gauss and non-private PCA (same result type)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import dp_accounting
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import linalg
from dpjax._core import pca_power
from dpjax._core.second_moment import (moment_discretization, noisy_top_k, secure_top_k,
                                       unit_clip, unit_second_moment)
from dpjax.mechanisms.gaussian import analytic_gaussian_sigma, rdp_gaussian_sigma
from dpjax.results import SubspaceResult
from dpjax.ledger import with_ledger

__all__ = ["analyze_gauss", "analyze_gauss_required_n", "pca_subspace"]


@with_ledger
def analyze_gauss(key: jax.Array, X, *, epsilon: float, delta: float, k: int,
                  clip_norm: float, secure: bool = True,
                  neighboring: NeighboringRelation = NeighboringRelation.REPLACE_ONE
                  ) -> SubspaceResult:
  """Analyze Gauss (Dwork, Talwar, Thakurta & Zhang 2014): noisy second moment, top-k eigenvectors.

  >>> import jax, numpy as np, dpjax
  >>> X = np.random.default_rng(0).normal(size=(5000, 20)) / 10    # rows are individuals
  >>> r = dpjax.subspace.analyze_gauss(jax.random.key(0), X, epsilon=1.0, delta=1e-6, k=3,
  ...                                  clip_norm=1.0)
  >>> bool(r.ok), r.basis.shape, r.neighboring.name, r.epsilon
  (True, (20, 3), 'REPLACE_ONE', 1.0)

  Rows are clipped to the public norm C (``x ↦ x·min(1, C/‖x‖)``), ``A = XᵀX`` gets a symmetric
  Gaussian matrix ``E`` (upper triangle and diagonal i.i.d. ``N(0, σ²)``, mirrored), and the answer
  is the top-k eigenvectors of ``A + E``, computed in units of C² (huge or tiny C and rows
  neither overflow nor underflow). Noise grows with d (error ``≈ σ√d/(nλ_k)``), which the
  dimension-free DPASE avoids.

  Guarantee: (ε, δ)-DP under ``neighboring``: replace-one (default; one row changes the upper
  triangle of ``A`` by ≤ 2C² in ℓ2) or add/remove-one (≤ C², half the std); σ is calibrated for
  that sensitivity and the eigenvectors are post-processing. ``dp_event`` is
  ``GaussianDpEvent(σ/Δ)`` for ``secure=False`` (composed exactly by the PLD and RDP accountants),
  the (ε, δ) event for ``secure=True`` (the discrete Gaussian's guarantee is its Rényi curve).
  ``secure=True`` (default) releases the noisy upper triangle with
  :func:`dpjax.mechanisms.discretized_gaussian_mechanism` (a public power-of-two grid, σ from
  :func:`dpjax.mechanisms.rdp_gaussian_sigma`; host-side); ``secure=False`` adds continuous noise
  with the analytic σ in one jitted program (5–15% less noise; the floating-point caveat of §1.10
  applies). Proof, numerics and edge cases: docs/algorithms.md §2.5.

  Args:
    key: PRNG key.
    X: ``(n, d)`` float data; runs in X's dtype (16-bit floats are upcast to float32).
    epsilon, delta: the budget.
    k: subspace dimension, ``1 <= k <= d``.
    clip_norm: public row-norm bound C > 0 (rows above it are scaled down).
    secure: float-safe discretized noise (default) or raw continuous noise.
    neighboring: ``NeighboringRelation.REPLACE_ONE`` (default; Δ = 2C²) or
      ``ADD_OR_REMOVE_ONE`` (Δ = C²).

  Returns:
    :class:`~dpjax.results.SubspaceResult` (``ok`` except ⊥ for a non-finite traced ``X``; under
    ``neighboring``), basis ``(d, k)`` in X's dtype; ``info["sigma"]`` is the noise std in X's units
    (``σ = info["unit_sigma"]·C²``, computed on the host in float64: ``inf`` if C² overflows
    float64, which the computation never forms), ``info["unit_sigma"]`` the std in units of C²,
    ``info["secure"]``, and with ``secure=True`` ``info["grid"]`` (in units of C²). Traceable in
    ``key`` and ``X`` in every x64 mode (the second moment in X's dtype in JAX; the secure
    release and its eigendecomposition in NumPy on the host, as a ``jax.pure_callback`` under
    tracing).

  Raises:
    TypeError: bad key, or X not a real array.
    ValueError: NaN/inf in a concrete X, wrong rank, bad ε, δ, k, or ``clip_norm`` not finite
      and > 0.

  Warns:
    dpjax.UnderpoweredWarning: n below :func:`analyze_gauss_required_n` (at accuracy 1/10); the
      message gives that number. The result is still private.
  """
  key = v.check_key(key)
  X = v.check_data(X, "X")
  n, d = X.shape
  k = v.check_int(k, "k", low=1, high=d)
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  clip_norm = v.check_positive(clip_norm, "clip_norm")
  neighboring = v.check_neighboring(neighboring)
  # σ scales linearly with the sensitivity (2C² or C²), so in units of C² the std is σ(ε, δ, Δ).
  sensitivity = 2.0 if neighboring == NeighboringRelation.REPLACE_ONE else 1.0
  _warn_if_underpowered(n, d, k, epsilon, delta, secure, neighboring)
  info = {"clip_norm": clip_norm, "secure": bool(secure)}
  mantissa, exponent = math.frexp(float(clip_norm))
  event = None                                  # the (ε, δ) event, filled in by the result
  if secure:
    basis, grid, unit_sigma = _secure_basis(key, X, k, mantissa, exponent, epsilon, delta,
                                            sensitivity)
    info["grid"] = grid
  else:
    unit_sigma = analytic_gaussian_sigma(epsilon, delta, sensitivity=sensitivity)
    basis = _analyze_gauss_core(key, X, k, mantissa, exponent, unit_sigma)
    event = dp_accounting.GaussianDpEvent(unit_sigma / sensitivity)
  sigma = unit_sigma * clip_norm * clip_norm            # report only; inf beyond float64's range
  info.update(sigma=sigma, unit_sigma=unit_sigma)
  ok = jnp.asarray(True)
  if v.is_traced(X):                       # a NaN dataset is outside the domain: ⊥
    ok, basis = v.domain_bottom(X, ok, basis)
  return SubspaceResult(ok=ok, basis=basis, epsilon=epsilon, delta=delta,
                        neighboring=neighboring, info=info, dp_event=event)


def _secure_basis(key, X, k, clip_mantissa, clip_exponent, epsilon, delta, sensitivity=2.0):
  """The top-k eigenvectors of ``Σ u uᵀ`` (units of C², computed in X's dtype) with its upper
  triangle released by the float-safe discretized Gaussian (ℓ2-sensitivity 2), the
  eigendecomposition on the host in float64 (post-processing); returns ``(basis (d, k) in X's
  dtype, grid step, noise std)``."""
  A = unit_second_moment(X, clip_mantissa, clip_exponent)
  z, grid, unit_sigma = _secure_noise(A.shape[0], epsilon, delta, sensitivity)
  basis = secure_top_k(key, A, z, k, sensitivity=sensitivity)
  return jnp.asarray(basis, X.dtype), grid, unit_sigma


def _secure_noise(d, epsilon, delta, sensitivity):
  """``(noise multiplier, grid step, noise std in units of C²)`` of the secure release."""
  z = rdp_gaussian_sigma(epsilon, delta)
  grid, _ = moment_discretization(d, z, sensitivity)
  return z, grid.grid, z * grid.grid_sensitivity * grid.grid


def analyze_gauss_required_n(d: int, k: int, *, epsilon: float, delta: float,
                             accuracy: float = 0.1, secure: bool = True,
                             neighboring: NeighboringRelation = NeighboringRelation.REPLACE_ONE
                             ) -> int:
  """Rows :func:`analyze_gauss` needs so that its noise typically costs the basis at most
  ``accuracy·n`` of captured energy (units of C²; n is the most n clipped rows can have); the
  number its :class:`dpjax.UnderpoweredWarning` quotes (at the default ``accuracy = 1/10``),
  which it gives exactly when n is below it.

  >>> import dpjax
  >>> dpjax.subspace.analyze_gauss_required_n(30, 2, epsilon=1.0, delta=1e-6, accuracy=0.1)
  3974

  The typical loss is ``2k·‖E‖₂`` (``tr(P̂A) ≥ tr(PA) − 2k‖E‖₂`` for every noise matrix E, by
  Weyl) with ``‖E‖₂ ≈ 2σ√d``, σ the call's noise std in units of C² (same ``secure`` and
  ``neighboring``); the answer is ``⌈4kσ√d / accuracy⌉`` (docs/algorithms.md §5.6). It bounds
  the loss against the largest energy, n·C²: rows far inside the ball lose a larger fraction of
  their own energy. Public numbers only.

  Raises:
    ValueError: bad d, k, ε, δ or accuracy.
  """
  d = v.check_int(d, "d", low=1)
  k = v.check_int(k, "k", low=1, high=d)
  epsilon, delta = v.check_epsilon(epsilon), v.check_delta(delta)
  neighboring = v.check_neighboring(neighboring)
  return pca_power.required_rows(_energy_loss(d, k, epsilon, delta, secure, neighboring),
                                 accuracy)


def _energy_loss(d, k, epsilon, delta, secure, neighboring):
  """The typical captured-energy loss (units of C²) of the call's noise."""
  sensitivity = 2.0 if neighboring == NeighboringRelation.REPLACE_ONE else 1.0
  unit_sigma = (_secure_noise(d, epsilon, delta, sensitivity)[2] if secure
                else analytic_gaussian_sigma(epsilon, delta, sensitivity=sensitivity))
  return pca_power.gaussian_energy_loss(unit_sigma, d, k)


def _warn_if_underpowered(n, d, k, epsilon, delta, secure, neighboring):
  add_remove = neighboring != NeighboringRelation.REPLACE_ONE
  options = (("" if secure else ", secure=False")
             + (", neighboring=ADD_OR_REMOVE_ONE" if add_remove else ""))
  pca_power.warn_if_underpowered(
      "analyze_gauss", n, _energy_loss(d, k, epsilon, delta, secure, neighboring),
      f"dpjax.subspace.analyze_gauss_required_n({d}, {k}, epsilon={epsilon:g}, "
      f"delta={delta:g}, accuracy={{}}{options})",
      f"d={d}, k={k}, ε={epsilon:g}, δ={delta:g}{', add/remove-one' if add_remove else ''}")


@functools.partial(jax.jit, static_argnames=("k",))
def _analyze_gauss_core(key, X, k, clip_mantissa, clip_exponent, unit_sigma):
  """Top-k eigenvectors of ``Σ u uᵀ + E'``, ``u = x/max(C, ‖x‖)``, ``E'`` symmetric with
  ``N(0, unit_sigma²)`` entries: Analyze Gauss in units of C² with raw continuous noise. C enters
  as its exact host-side mantissa and exponent (``C = f·2^c``), so a C outside X's dtype range
  (e.g. 1e50 with float32 rows) still clips correctly."""
  U = unit_clip(X, clip_mantissa, clip_exponent)
  return noisy_top_k(key, linalg.matmul(U.T, U), unit_sigma, k)


def pca_subspace(X, *, k: int) -> SubspaceResult:
  """Non-private PCA: the top-k right singular vectors of ``X``. NOT private — a reference floor.

  Scale-safe (:func:`dpjax.linalg.top_k_right_singular_vectors` normalises the block by a power
  of two first); runs in X's dtype, 16-bit floats upcast to float32.

  Returns:
    :class:`~dpjax.results.SubspaceResult` with ``ok=True``, ``epsilon=inf``, ``delta=1`` and
    ``neighboring=None`` (not private). Traceable; under tracing a non-finite X or basis gives
    ``ok=False`` instead of an error.

  Raises:
    TypeError: X not a real array. ValueError: NaN/inf in a concrete X, wrong rank,
      ``k ∉ [1, min(n, d)]``, or (defensive, not expected after the normalisation) a non-finite
      basis.
  """
  X = v.check_data(X, "X")
  k = v.check_int(k, "k", low=1, high=min(X.shape))
  basis = linalg.top_k_right_singular_vectors(X, k)
  ok = v.all_finite(basis)
  if v.is_traced(X, ok):              # ok is staged under jit even for a closed-over X
    ok, basis = v.domain_bottom(X, ok, basis)
  # Non-private baseline: checking its own output is fine (nothing private is released here).
  elif not bool(ok):
    raise ValueError("pca_subspace could not compute a finite basis for X in its dtype "
                     f"{X.dtype}; pass float64 data.")
  return SubspaceResult(ok=ok, basis=basis, epsilon=math.inf, delta=1.0, neighboring=None)
