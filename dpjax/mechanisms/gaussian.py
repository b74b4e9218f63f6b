"""The Gaussian mechanism: analytic, classic and Rényi calibrations; a float-safe release (§1.2).

The calibrations run on the host in float64: the analytic (Balle–Wang) one with
``dp_accounting``'s exact Gaussian solver (the condition in log space with SciPy's log-CDF, so it
stays accurate for tiny δ and large ε), the classic one with :mod:`math`, the Rényi one with
``dp_accounting``'s RDP accountant.

Floating point (docs/algorithms.md §1.10). Continuous Gaussian noise sampled in floating point has the
same weakness as Laplace noise (Mironov 2012): the float values ``f + Z`` can reach depend on
``f``. For float32 noise on a value moved by its sensitivity, most of the output mass is on values
the neighboring input can never produce (``dpjax.audit.exact_output_audit``). The default
``gaussian_mechanism(secure=True)`` therefore releases ``Λ·(round(f/Λ) + Y)`` with ``Y`` exact
discrete Gaussian noise on a public power-of-two grid Λ (:func:`discretized_gaussian_mechanism`):
the output is always a multiple of Λ, whatever ``f``, and its distribution is exactly that of
the discrete Gaussian mechanism on an integer statistic (Canonne, Kamath & Steinke 2020).
"""

from __future__ import annotations

import functools
import math
import jax
import numpy as np

from dpjax import _validation as v
# The calibrations live in dpjax.accounting (one home for calibration); re-exported here.
from dpjax.accounting import (analytic_gaussian_sigma, classic_gaussian_sigma,  # noqa: F401
                              rdp_gaussian_sigma)
from dpjax._host import host_call
from dpjax.mechanisms import discrete
from dpjax.mechanisms.grid import discretization

__all__ = ["discretized_gaussian_mechanism", "gaussian_mechanism", "gaussian_noise"]

CALIBRATIONS = ("analytic", "classic", "rdp")

def gaussian_noise(key: jax.Array, shape=(), *, sigma: float, dtype=None) -> jax.Array:
  """I.i.d. ``N(0, σ²)`` samples (a sampler; the guarantee comes from calibrating σ).

  Args:
    key: JAX PRNG key.
    shape: output shape, a tuple of non-negative ints.
    sigma: standard deviation ``σ ≥ 0``.
    dtype: float dtype (default: JAX's default float).

  Returns:
    Array of ``shape`` and ``dtype``.

  Raises:
    TypeError: non-key ``key``, bad ``shape`` or non-float ``dtype``.
    ValueError: σ negative, NaN or infinite.

  References:
    Balle & Wang, "Improving the Gaussian mechanism for differential privacy: analytical
    calibration and optimal denoising", ICML 2018, Thm 8; Dwork & Roth 2014, Thm A.1 (classic);
    docs/algorithms.md §1.2.
  """
  v.check_key(key)
  shape = v.check_shape(shape)
  sigma = v.check_positive(sigma, "sigma", allow_zero=True)
  dtype = v.check_float_dtype(dtype)
  return (sigma * jax.random.normal(key, shape, dtype)).astype(dtype)


def discretized_gaussian_mechanism(key: jax.Array, value, *, sensitivity: float,
                                   noise_multiplier: float,
                                   bound: float | None = None) -> np.ndarray:
  """Releases ``Λ·(round(clamp(f)/Λ) + Y)``, ``Y ~ N_ℤ(0, (z·Δ_Λ)²)``: a float-safe Gaussian.

  ``f = value`` is clamped to the public ``[−B, B]`` (1-Lipschitz per coordinate, so the
  sensitivity is unchanged), divided by the public power-of-two grid step Λ (exact) and rounded
  to the nearest integer, which moves the ℓ2-sensitivity in grid steps to at most
  ``Δ_Λ = Δ/Λ + √p`` (:func:`dpjax.mechanisms.discretization`). Exact discrete Gaussian noise
  with σ = z·Δ_Λ steps is added with integer arithmetic (:func:`dpjax.mechanisms.discrete.discrete_gaussian`),
  and the integer result is scaled back by Λ (exact in float64).

  Guarantee: for a statistic of ℓ2-sensitivity Δ under the caller's neighboring relation, the
  release is ``(α, α/(2z²))``-RDP for every α > 1 — the same curve as a continuous Gaussian
  mechanism with noise multiplier z, so it composes as ``dp_accounting.GaussianDpEvent(z)`` under
  RDP / zCDP accounting (CKS 2020 Thm 4: the discrete Gaussian's Rényi divergence for an integer
  shift v is at most ``α‖v‖²/(2σ²)``, and ‖v‖ ≤ Δ_Λ). Do not account it with the analytic or PLD
  Gaussian calibrations, which are exact for continuous noise only.

  Floating point: no float arithmetic touches the noise; every output is a multiple of Λ inside
  ``[−B − (noise), B + (noise)]``, so the set of possible outputs does not depend on ``f``
  (Mironov's attack does not apply). ``Δ`` must bound the change of ``value`` as computed; a
  NaN/inf entry is replaced by 0 first (a fixed map: raising would branch on private data).

  Traceable: under ``jit`` / ``vmap`` the host computation runs as a ``jax.pure_callback`` (the
  same output per key as the eager call) and the result comes back in JAX's default float
  dtype (float32 without x64: a rounding of the released grid value, i.e. post-processing).

  Args:
    key: JAX PRNG key.
    value: float array of any shape (the exact statistic; rounded on the host in float64).
    sensitivity: ℓ2-sensitivity ``Δ > 0``.
    noise_multiplier: ``z > 0``: the noise std in units of the (grid) sensitivity.
    bound: public clamp B (default ``2^50 Λ``).

  Returns:
    Eagerly: a float64 NumPy array shaped like ``value`` (float64 so that every multiple of Λ
    up to 2^53 steps is exact whatever JAX's x64 flag), every entry a multiple of Λ. Traced: a
    JAX array of the default float dtype.

  Raises:
    TypeError: non-float ``value``, non-key ``key``.
    ValueError: bad Δ, z or B; ``z·Δ_Λ > 2^40``.

  References:
    Canonne, Kamath & Steinke, "The discrete Gaussian for differential privacy", NeurIPS 2020;
    Mironov, "On significance of the least significant bits for differential privacy", CCS 2012.
  """
  v.check_key(key)
  value = v.check_float_array(value)
  z = v.check_positive(noise_multiplier, "noise_multiplier")
  grid = discretization(sensitivity, max(value.size, 1), bound)
  sigma = math.nextafter(z * grid.grid_sensitivity, math.inf)
  discrete.discrete_gaussian_sigma2(sigma)                 # validates σ ≤ 2^40 before tracing

  return host_call(functools.partial(discretized_gaussian_host, grid=grid, sigma=sigma),
                   jax.ShapeDtypeStruct(value.shape, np.float64), key, value)


def discretized_gaussian_host(rng: np.random.Generator, value, *, grid, sigma: float) -> np.ndarray:
  """The release of :func:`discretized_gaussian_mechanism` on the host (plain NumPy/Python,
  callable inside a host callback), unvalidated: ``grid`` from
  :func:`dpjax.mechanisms.discretization` and the discrete Gaussian's ``sigma`` in grid steps
  (validated by the caller); ``value`` a NumPy array, NaN/inf entries replaced by 0."""
  value = np.asarray(value)
  index = grid.round(v.sanitise_host_value(value))
  noise = discrete.discrete_gaussian_host(rng, (index.size,), sigma)
  return grid.release(index + noise, value.shape)


def gaussian_mechanism(key: jax.Array, value, *, sensitivity: float, epsilon: float,
                       delta: float, calibration: str | None = None, secure: bool = True,
                       bound: float | None = None):
  """Releases ``value + N(0, σ² I)`` with σ calibrated to (ε, δ); float-safe by default.

  Usage::

      mean = X.mean(axis=0)        # rows of norm ≤ 1: replace-one ℓ2-sensitivity 2/n
      noisy = dpjax.mechanisms.gaussian_mechanism(key, mean, sensitivity=2 / n,
                                                  epsilon=1.0, delta=1e-6)

  Guarantee: (ε, δ)-DP under the caller's neighboring relation when ``value`` has
  ℓ2-sensitivity ``sensitivity`` under it (docs/algorithms.md §1.2, §1.10).

  * ``secure=True`` (default, for released statistics): the float-safe
    :func:`discretized_gaussian_mechanism` — exact discrete Gaussian noise on a public
    power-of-two grid, output on that grid whatever the input, host-side float64. Proved through
    Rényi DP, so σ comes from :func:`rdp_gaussian_sigma` at the grid sensitivity
    ``Δ_Λ ≤ (1 + 2^-10)Δ`` (5–15% more noise than the analytic calibration of continuous noise);
    ``calibration`` must be None or ``"rdp"``.
  * ``secure=False``: continuous noise added in ``value``'s dtype (jittable), calibrated by
    ``calibration``: ``"analytic"`` (default; the exact Balle–Wang condition,
    :func:`analytic_gaussian_sigma`, valid for every ε > 0), ``"classic"``
    (``Δ sqrt(2 ln(1.25/δ))/ε``, refuses ε ≥ 1) or ``"rdp"``. (ε, δ)-DP in real arithmetic
    only: the float values it can output depend on ``value`` (Mironov 2012), so do not publish
    them where an observer could read their low-order bits.

  Args:
    key: JAX PRNG key.
    value: float array of any shape.
    sensitivity: ℓ2-sensitivity ``Δ > 0``.
    epsilon: ``ε > 0``.
    delta: ``δ ∈ (0, 1)``.
    calibration: None (``"rdp"`` if secure, else ``"analytic"``), ``"analytic"``, ``"classic"``
      or ``"rdp"``.
    secure: float-safe discrete release (default) or raw continuous noise.
    bound: public clamp for the secure release (default ``2^50 Λ``; see
      :func:`dpjax.mechanisms.discretization`); ignored when ``secure=False``.

  Returns:
    ``secure=True``: as :func:`discretized_gaussian_mechanism` (eagerly float64 NumPy, multiples
    of the public grid step ``discretization(Δ, value.size).grid``). ``secure=False``: a JAX
    array with ``value``'s shape and dtype. NaN/inf entries of ``value`` are replaced by 0
    before the noise (a fixed map, not a data-dependent error). Traceable either way.

  Raises:
    TypeError: non-float ``value``, non-key ``key``.
    ValueError: bad ε, δ, Δ; unknown ``calibration``; ``"analytic"`` or ``"classic"`` with
      ``secure=True``; ε ≥ 1 with ``"classic"``.

  References:
    [BW18] Thm 8; Dwork & Roth (2014), Thm A.1; Canonne, Kamath & Steinke (2020);
    docs/algorithms.md §1.2, §1.10.
  """
  v.check_key(key)
  if calibration is None:
    calibration = "rdp" if secure else "analytic"
  v.check_choice(calibration, "calibration", CALIBRATIONS)
  if secure:
    if calibration != "rdp":
      raise ValueError(
          f"calibration={calibration!r} is exact for continuous Gaussian noise only; "
          "secure=True adds discrete Gaussian noise, whose guarantee is proved through Rényi DP: "
          "use calibration='rdp' (the default) or secure=False.")
    z = rdp_gaussian_sigma(epsilon, delta)            # noise multiplier (sensitivity 1)
    return discretized_gaussian_mechanism(key, value, sensitivity=sensitivity,
                                          noise_multiplier=z, bound=bound)
  value = v.sanitise_value(value)
  calibrate = {"analytic": analytic_gaussian_sigma, "classic": classic_gaussian_sigma,
               "rdp": rdp_gaussian_sigma}[calibration]
  sigma = calibrate(epsilon, delta, sensitivity)
  return value + (sigma * jax.random.normal(key, value.shape, value.dtype)).astype(value.dtype)
