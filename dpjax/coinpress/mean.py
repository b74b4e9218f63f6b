"""CoinPress private mean (Biswas, Dong, Kamath & Ullman 2020, Algorithms 1–2; MVMRec).

See :mod:`dpjax.coinpress.schedule` for the privacy accounting, the floating-point treatment and
the references shared by the mean and the covariance.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import accounting
from dpjax._host import float64
from dpjax.coinpress.schedule import (_check_common, _standard_normal, gaussian_norm_radius,
                                      steps_event)
from dpjax.mechanisms.gaussian import discretized_gaussian_mechanism
from dpjax.mechanisms.grid import discretization
from dpjax.results import EstimateResult, warn_underpowered
from dpjax.ledger import with_ledger

__all__ = ["coinpress_mean", "mean_required_n"]


@with_ledger
def coinpress_mean(key: jax.Array, X, *, epsilon: float, delta: float, center, radius: float,
                   steps: int | None = None, beta: float = 0.01,
                   fractions: Sequence[float] | None = None, accountant: str | None = None,
                   secure: bool = True) -> EstimateResult:
  """CoinPress private mean (the paper's MVMRec, Algorithms 1–2), (ε, δ)-DP under replace-one.

  Usage::

      res = dpjax.coinpress.coinpress_mean(jax.random.key(0), X, epsilon=1.0, delta=1e-6,
                                           center=np.zeros(d), radius=100.0)
      res.estimate            # (d,) float64, within res.info["error_bound"] of μ w.p. ≥ 0.99

  Model (for utility only): rows ``x_i ~ N(μ, Σ)`` i.i.d. with ``Σ ⪯ I`` and a public prior
  ``‖μ − center‖ ≤ radius``. For data whitened by a preconditioner with ``(1/K) I ⪯ Σ_w ⪯ K I``
  divide the whitened rows, the centre and the radius by ``sqrt(K)``; multiply the estimate back.

  Privacy: (ε, δ)-DP under replace-one (n public). Step t is a Gaussian mechanism on the mean of
  the rows clipped to ``B(c_t, R_t)`` (``c_t`` an earlier release, ``R_t`` public), of
  replace-one ℓ2-sensitivity ``2R_t/n``; ``dp_accounting`` composes the steps. Every radius and
  noise scale is a public function of ``(n, d, radius, ε, δ, β, fractions)``. Utility: under the
  model, w.p. ≥ 1 − β, ``‖μ̂ − μ‖ ≤ info["error_bound"]``; a wrong prior or model costs accuracy,
  never privacy. Algorithm and proofs: docs/algorithms.md §3.5.1.

  Args:
    key: a JAX PRNG key, used once (split into the T steps' keys, or one draw of all noise).
    X: ``(n, d)`` real array, rows are individuals, ``n ≥ 2``; integer input is converted.
    epsilon, delta: ε > 0 (nats), δ ∈ (0, 1).
    center: ``(d,)`` public prior centre.
    radius: public prior radius > 0 with ``‖μ − center‖ ≤ radius``.
    steps: number of steps T (default 4, or ``len(fractions)``).
    beta: failure probability of the utility guarantee, in (0, 1) (default 0.01, as in the
      paper's code); it sets public radii only, privacy does not depend on it.
    fractions: per-step budget fractions ``f_t > 0`` summing to 1 (default
      :func:`default_fractions`: 3/4 to the last step, 1/4 shared by the others).
    accountant: None (``"rdp"`` if ``secure``, else ``"analytic"``), ``"analytic"`` (exact for
      continuous noise, :func:`calibrate_noise_scale`), ``"pld"`` or ``"rdp"``; only ``"rdp"``
      is valid with ``secure=True``.
    secure: float-safe discretized releases (default) or raw continuous noise.

  Returns:
    :class:`~dpjax.results.EstimateResult` (``ok`` True eagerly; ``epsilon`` the composed ε ≤ the
    requested one; neighboring ``REPLACE_ONE``): ``estimate`` a ``(d,)`` float64 NumPy array
    eagerly (float64 whatever JAX's x64 flag: means of 1e6 keep their digits; with
    ``secure=True`` a multiple of ``info["grids"][-1]``); ``released["centers"]`` ``(T, d)``, the
    released c_1..c_T (covered by the guarantee); ``info`` with ``steps``, ``fractions``,
    ``noise_scale`` (s), ``noise_multipliers`` (z_t), ``sigmas`` (σ_t), ``sensitivities`` (Δ_t),
    ``clip_radii`` (R_t), ``radii`` (r_0..r_T), ``error_bound`` (r_T), ``norm_radius``, ``beta``,
    ``zcdp_rho`` (= 1/(2s²)), ``accountant``, ``secure`` and (secure) ``grids`` (Λ_t). Traceable
    in ``key``, ``X`` and ``center`` inside ``with jax.enable_x64(True):`` (float64 JAX outputs;
    secure releases by host callback, the same draw per key as eagerly; a non-finite traced
    ``X`` or ``center`` gives ``ok=False`` and zeros).

  Raises:
    TypeError: ``key`` not a PRNG key; non-numeric ``X``/``center``; non-integer ``steps``;
      traced (``jit`` / ``vmap``) with JAX's x64 mode off.
    ValueError: ``X`` not 2-D, ``n < 2``, NaN/inf in a concrete ``X`` or ``center``; ``center``
      not of shape ``(d,)``; ``radius ≤ 0``; ε ≤ 0; δ ∉ (0, 1); β ∉ (0, 1); bad ``fractions`` or
      ``steps``; unknown ``accountant``, or ``"analytic"``/``"pld"`` with ``secure=True``.

  Warns:
    dpjax.UnderpoweredWarning: n below :func:`mean_required_n` at half the radius (the typical
      error exceeds radius/2); the message gives that number. The result is still private.

  References:
    Biswas, Dong, Kamath & Ullman, NeurIPS 2020, Algorithms 1–2 (MVM, MVMRec).
  """
  key = v.check_key(key)
  X64 = v.check_data64(X, "X", min_rows=2)
  n, d = X64.shape
  center64 = _check_center(center, d)
  radius = v.check_positive(radius, "radius")
  epsilon, delta, beta, fractions, accountant = _check_common(
      epsilon, delta, beta, steps, fractions, accountant, secure)
  T = len(fractions)

  s, spent = accounting.calibrate_gaussian_composition(epsilon, delta, fractions,
                                                     accountant=accountant)
  zs = tuple(s / math.sqrt(f) for f in fractions)
  norm_radius, radii, clip_radii, sens, sigmas, grids = _mean_schedule(n, d, radius, zs, beta,
                                                                       secure)
  typical = _typical_error(d, n, sigmas)
  if typical > radius / 2:                        # exactly when n < mean_required_n(radius/2)
    need = mean_required_n(d, radius=radius, epsilon=epsilon, delta=delta, accuracy=radius / 2,
                           fractions=fractions, beta=beta, accountant=accountant,
                           secure=secure)
    _warn_underpowered(n, d, radius, epsilon, delta, typical, need)

  ok, estimate, centers = float64(
      "coinpress_mean", _mean_release, key, X64, center64, clip_radii=tuple(clip_radii),
      sigmas=tuple(sigmas), sensitivities=tuple(sens), noise_multipliers=zs,
      grids=tuple(grids) if secure else None)
  info = dict(steps=T, fractions=fractions, noise_scale=s, noise_multipliers=zs,
              sigmas=tuple(sigmas), sensitivities=tuple(sens), clip_radii=tuple(clip_radii),
              radii=tuple(radii), error_bound=radii[-1], norm_radius=norm_radius,
              beta=beta, zcdp_rho=1.0 / (2.0 * s * s), accountant=accountant,
              secure=bool(secure))
  if secure:
    info["grids"] = tuple(grids)
  return EstimateResult(ok=jnp.asarray(ok), estimate=estimate, released={"centers": centers},
                        epsilon=spent, delta=delta, neighboring=NeighboringRelation.REPLACE_ONE,
                        info=info, dp_event=steps_event(zs, secure))


def _mean_schedule(n, d, radius, zs, beta, secure):
  """The public schedule ``(γ, r_0..r_T, R_t, Δ_t, σ_t, Λ_t)`` of :func:`coinpress_mean` for n
  rows (docstring's algorithm)."""
  T = len(zs)
  norm_radius = gaussian_norm_radius(d, beta / (2.0 * n))
  step_radius = gaussian_norm_radius(d, beta / (2.0 * T))
  radii, clip_radii, sens, sigmas, grids = [radius], [], [], [], []
  for z in zs:
    big_r = radii[-1] + norm_radius
    if secure:
      # The centre is rounded to the step's grid Λ (≤ 2× the grid of the unshifted radius), which
      # moves it by ≤ √d·Λ/2: the ball grows by that much so that nothing else is clipped.
      big_r += math.sqrt(d) * discretization(2.0 * big_r / n, d).grid
    clip_radii.append(big_r)
    sens.append(2.0 * big_r / n)
    if secure:                                  # the discretized release's effective std
      grid = discretization(sens[-1], d)
      grids.append(grid.grid)
      sigmas.append(z * grid.grid_sensitivity * grid.grid)
    else:
      sigmas.append(z * sens[-1])
    radii.append(step_radius * math.sqrt(1.0 / n + sigmas[-1] ** 2))
  return norm_radius, radii, clip_radii, sens, sigmas, grids


def _typical_error(d, n, sigmas) -> float:
  """The typical ‖μ̂ − μ‖ (Σ = I): that of ``N(0, (1/n + σ_{T−1}²) I_d)``, ≈ sqrt(d(1/n + σ²))."""
  return math.sqrt(d * (1.0 / n + sigmas[-1] ** 2))


def mean_required_n(d: int, *, radius: float, epsilon: float, delta: float,
                    accuracy: float, steps: int | None = None,
                    fractions: Sequence[float] | None = None, beta: float = 0.01,
                    accountant: str | None = None, secure: bool = True) -> int:
  """Rows :func:`coinpress_mean` needs for a typical error ``‖μ̂ − μ‖ ≤ accuracy`` (in the
  units where ``Σ ⪯ I``), with the same schedule arguments (``steps``, ``fractions``,
  ``beta``, ``accountant``, ``secure``); the number its :class:`dpjax.UnderpoweredWarning`
  quotes, which it gives exactly when n is below it.

  >>> import dpjax
  >>> dpjax.coinpress.mean_required_n(10, radius=100.0, epsilon=1.0, delta=1e-6, accuracy=0.5)
  786

  The typical error is that of ``N(0, (1/n + σ_{T−1}²) I_d)`` (the docstring's utility
  argument): ``sqrt(d(1/n + σ_{T−1}²))``, with σ_{T−1} from the public schedule at n rows; the
  answer is the smallest n reaching ``accuracy`` (bisection; it falls with n). At least
  ``d/accuracy²`` (the non-private sampling error). Public numbers only.

  Raises:
    ValueError: bad arguments, or no n up to 10¹² reaches ``accuracy``.
  """
  d = v.check_int(d, "d", low=1)
  radius = v.check_positive(radius, "radius")
  accuracy = v.check_positive(accuracy, "accuracy")
  epsilon, delta, beta, fractions, accountant = _check_common(
      epsilon, delta, beta, steps, fractions, accountant, secure)
  s, _ = accounting.calibrate_gaussian_composition(epsilon, delta, fractions,
                                                   accountant=accountant)
  zs = tuple(s / math.sqrt(f) for f in fractions)

  def enough(n):
    return _typical_error(d, n, _mean_schedule(n, d, radius, zs, beta, secure)[4]) <= accuracy

  return max(v.smallest_n(enough, f"no n up to 1e12 reaches accuracy={accuracy:g} for d={d}"), 2)


def _warn_underpowered(n, d, radius, epsilon, delta, typical, need):
  warn_underpowered(
      f"coinpress_mean: at n={n} rows its typical error ‖μ̂ − μ‖ is about {typical:.3g}, over "
      f"half the prior radius {radius:g} (d={d}, ε={epsilon:g}, δ={delta:g}): the estimate says "
      f"little beyond the prior centre. Half the radius needs n ≥ {need:,} rows "
      f"(dpjax.coinpress.mean_required_n({d}, radius={radius:g}, epsilon={epsilon:g}, "
      f"delta={delta:g}, accuracy={radius / 2:g}) with this call's schedule); or raise "
      "epsilon. The result is still private.")


def _mean_release(key, X, center, *, clip_radii, sigmas, sensitivities, noise_multipliers,
                  grids):
  """The T steps of :func:`coinpress_mean` in traceable JAX (float64 under :func:`float64`):
  ``(ok, c_T, centres (T, d))``, ``ok`` False and the outputs zero when ``X`` or ``center`` holds
  NaN/inf (reachable traced only; a concrete one is rejected by the validation). ``grids`` None:
  raw continuous noise; else the float-safe discretized release of each step."""
  if grids is None:
    estimate, centers = _mean_core(key, X, center, jnp.asarray(clip_radii, X.dtype),
                                   jnp.asarray(sigmas, X.dtype))
  else:
    c, centers = center, []
    for k_step, big_r, sensitivity, z, grid in zip(jax.random.split(key, len(grids)), clip_radii,
                                                   sensitivities, noise_multipliers, grids):
      # Released relative to the (public) centre, rounded to the grid: the clipped rows' mean
      # deviation is at most R in norm, so the mechanism's clamp B = 2^50 Λ never binds however
      # far the data sit from 0 (released about c it clamped at |c| ≳ 2^50 Λ, e.g. 1e8 at
      # n = 3·10⁵: a silent, large error). The sum c + Λ·k is exact (both multiples of Λ,
      # |c|/Λ < 2^53) or rounds to a multiple of a larger power of two: post-processing.
      c = jnp.round(c / grid) * grid
      c = c + discretized_gaussian_mechanism(k_step, _clipped_deviation(X, c, big_r),
                                             sensitivity=sensitivity, noise_multiplier=z)
      centers.append(c)
    estimate, centers = c, jnp.stack(centers)
  return v.domain_bottom(X, v.all_finite(center), estimate, centers)


def _mean_core(key, X, center, clip_radii, sigmas):
  """Traceable CoinPress mean with raw continuous noise (float64 under x64): returns
  ``(c_T, centres (T, d))``."""
  noise = _standard_normal(key, (clip_radii.shape[0], X.shape[1]))
  return _mean_steps(X, center, clip_radii, sigmas, noise)


def _clipped_deviation_impl(X, c, big_r):
  """Mean of ``x − c`` over the rows clipped to the ball ``B(c, R)`` (norm ≤ R)."""
  diff = X - c
  norms = jnp.sqrt(jnp.sum(diff * diff, axis=1))
  scale = jnp.minimum(1.0, big_r / jnp.maximum(norms, jnp.finfo(X.dtype).tiny))
  return jnp.mean(diff * scale[:, None], axis=0)


def _clipped_mean_impl(X, c, big_r):
  """Mean of the rows clipped to the ball ``B(c, R)`` (the statistic each step releases)."""
  return c + _clipped_deviation_impl(X, c, big_r)


_clipped_deviation = jax.jit(_clipped_deviation_impl)


@jax.jit
def _mean_steps(X, center, clip_radii, sigmas, noise):
  """T clip-and-noise steps given the standard normal noise ``(T, d)``."""

  def step(c, inputs):
    big_r, sigma, g = inputs
    c_next = _clipped_mean_impl(X, c, big_r) + sigma * g      # the release of this step
    return c_next, c_next

  return jax.lax.scan(step, center, (clip_radii, sigmas, noise))


def _check_center(center, d: int):
  arr = v.check_data64(center, "center", ndim=1)
  if arr.shape != (d,):
    raise ValueError(f"center must have shape (d,) = ({d},) to match X, got shape {arr.shape}.")
  return arr
