"""CoinPress private covariance (Biswas, Dong, Kamath & Ullman 2020, Algorithms 3–4; MVCRec).

See :mod:`dpjax.coinpress.schedule` for the privacy accounting, the floating-point treatment and
the references shared by the mean and the covariance.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import accounting, linalg
from dpjax._host import float64
from dpjax.coinpress.schedule import (_check_common, _standard_normal, default_fractions,
                                      gaussian_norm_radius, steps_event)
from dpjax.mechanisms.gaussian import analytic_gaussian_sigma, discretized_gaussian_mechanism
from dpjax.mechanisms.grid import discretization
from dpjax.results import EstimateResult, warn_underpowered
from dpjax.ledger import with_ledger

__all__ = ["choose_covariance_steps", "coinpress_covariance", "covariance_required_n"]

_AUTO_MAX_STEPS = 8          # choose_covariance_steps searches T in 1..8


@with_ledger
def coinpress_covariance(key: jax.Array, X, *, epsilon: float, delta: float, kappa: float,
                         steps: int | None = None, beta: float = 0.01,
                         fractions: Sequence[float] | None = None,
                         accountant: str | None = None, secure: bool = True) -> EstimateResult:
  """CoinPress private covariance (the paper's MVCRec, Algorithms 3–4), (ε, δ)-DP, replace-one.

  Usage::

      res = dpjax.coinpress.coinpress_covariance(jax.random.key(0), X, epsilon=1.0,
                                                 delta=1e-6, kappa=2.0)
      res.estimate            # (d, d) float64, symmetric PSD

  Model (for utility only): rows ``x_i ~ N(0, Σ)`` i.i.d. with ``I ⪯ Σ ⪯ κ I`` for a public κ
  (unknown mean: use ``(x_{2i} − x_{2i−1})/√2``, n/2 rows). After a preconditioner Σ̃ within a
  factor K of Σ, feed ``sqrt(K) · X Σ̃^{-1/2}`` with ``kappa = K²`` and map back.

  Privacy: (ε, δ)-DP under replace-one (n public). Each of the T steps is a Gaussian mechanism on
  the second moment of the rows, whitened by earlier releases and clipped to a public radius γ,
  of replace-one Frobenius sensitivity ``Δ = √2 γ²/n``; ``dp_accounting`` composes the steps.
  Utility: under the model, w.p. ≥ 1 − β, ``‖Σ^{-1/2} Σ̂ Σ^{-1/2} − I‖_2 ≤ info["error_bound"]``
  (worst-case; typical errors are much smaller). Algorithm and proofs: docs/algorithms.md §3.5.1.

  Args:
    key: a JAX PRNG key, used once (split into the T steps' keys, or one draw of all noise).
    X: ``(n, d)`` real array, rows are individuals, ``n ≥ 2``.
    epsilon, delta: ε > 0 (nats), δ ∈ (0, 1).
    kappa: public κ ≥ 1 with ``I ⪯ Σ ⪯ κ I``.
    steps: number of steps T. Default (``steps`` and ``fractions`` both None) [PROPOSED]:
      :func:`choose_covariance_steps`, a public function of ``(n, d, κ, ε, δ, β)`` (too many
      steps hurt at small n). Otherwise ``len(fractions)``, or 4 when only ``fractions`` is None.
    beta: failure probability of the utility guarantee, in (0, 1) (default 0.01); sets γ and the
      public η_t; privacy does not depend on it.
    fractions: per-step budget fractions ``f_t > 0`` summing to 1 (:func:`default_fractions`).
    accountant: None (``"rdp"`` if ``secure``, else ``"analytic"``), ``"analytic"`` (exact for
      continuous noise, :func:`calibrate_noise_scale`), ``"pld"`` or ``"rdp"``; only ``"rdp"``
      is valid with ``secure=True``.
    secure: float-safe discretized releases (default) or raw continuous noise.

  Returns:
    :class:`~dpjax.results.EstimateResult` (``ok`` True eagerly; neighboring ``REPLACE_ONE``;
    ``epsilon`` the composed ε): ``estimate`` a symmetric PSD ``(d, d)`` float64 NumPy array
    eagerly (the recursion runs in float64 whatever JAX's x64 flag); ``info`` with ``steps``,
    ``fractions``, ``noise_scale``, ``noise_multipliers``, ``sigmas``, ``sensitivities`` (Δ per
    step), ``clip_radii`` (γ per step), ``etas``, ``lower_bounds`` (λ_0..λ_{T−1}),
    ``error_bound``, ``beta``, ``steps_rule`` ("choose_covariance_steps" or "given"),
    ``zcdp_rho``, ``accountant``, ``secure`` and (secure) ``grids`` (Λ_t); with ``secure=True``
    ``released["releases"]``, the ``(T, d, d)`` released Z_t (covered by ε, on their grids).
    Traceable in ``key`` and ``X`` inside ``with jax.enable_x64(True):`` (float64 JAX outputs,
    symmetric up to rounding; secure releases by host callback, the same draw per key as
    eagerly; a non-finite traced ``X`` gives ``ok=False`` and zeros).

  Raises:
    TypeError: ``key`` not a PRNG key; non-numeric ``X``; non-integer ``steps``; traced
      (``jit`` / ``vmap``) with JAX's x64 mode off.
    ValueError: ``X`` not 2-D, ``n < 2``, NaN/inf in a concrete ``X``; ``kappa`` not finite or
      ``kappa < 1``; ε ≤ 0; δ ∉ (0, 1); β ∉ (0, 1); bad ``fractions`` or ``steps``; unknown
      ``accountant``, or ``"analytic"``/``"pld"`` with ``secure=True``.

  Warns:
    dpjax.UnderpoweredWarning: the typical error ``‖Σ^-1/2 Σ̂ Σ^-1/2 − I‖₂`` exceeds 1; the
      message gives :func:`covariance_required_n`'s rows for errors 1 and 0.1. The result is
      still private.

  References:
    Biswas, Dong, Kamath & Ullman, NeurIPS 2020, Algorithms 3–4 (MVC, MVCRec);
    Ashtiani & Liaw, COLT 2022, Thm 5.5 (refinement after a preconditioner).
  """
  key = v.check_key(key)
  X64 = v.check_data64(X, "X", min_rows=2)
  n, d = X64.shape
  kappa = v.check_positive(kappa, "kappa")
  if kappa < 1.0:
    raise ValueError(f"kappa must be >= 1 (the bound I ⪯ Σ ⪯ kappa·I), got kappa={kappa!r}.")
  auto_steps = steps is None and fractions is None
  epsilon, delta, beta, fractions, accountant = _check_common(
      epsilon, delta, beta, steps, fractions, accountant, secure)
  if auto_steps:
    fractions = default_fractions(choose_covariance_steps(n, d, kappa=kappa, epsilon=epsilon,
                                                          delta=delta, beta=beta))
  T = len(fractions)

  s, spent = accounting.calibrate_gaussian_composition(epsilon, delta, fractions,
                                                     accountant=accountant)
  zs = tuple(s / math.sqrt(f) for f in fractions)
  plan = _covariance_plan(n, d, kappa, beta, fractions, s, secure=secure)
  if plan.typical_error > 1.0:
    _warn_underpowered(n, d, kappa, epsilon, delta, beta, plan.typical_error)
  norm_radius, sens, sigmas, etas = plan.norm_radius, plan.sensitivity, plan.sigmas, plan.etas
  ok, estimate, releases = float64(
      "coinpress_covariance", _covariance_release, key, X64, m0=1.0 / math.sqrt(kappa),
      norm_radius=norm_radius, sigmas=sigmas, etas=etas, sensitivity=sens, noise_multipliers=zs,
      secure=bool(secure))
  info = dict(steps=T, fractions=fractions, noise_scale=s, noise_multipliers=zs,
              sigmas=sigmas, sensitivities=(sens,) * T, clip_radii=(norm_radius,) * T, etas=etas,
              lower_bounds=plan.lower_bounds, error_bound=plan.error_bound, beta=beta,
              steps_rule="choose_covariance_steps" if auto_steps else "given",
              zcdp_rho=1.0 / (2.0 * s * s), accountant=accountant, secure=bool(secure))
  if secure:
    info.update(grids=(plan.grid,) * T)
  return EstimateResult(ok=jnp.asarray(ok), estimate=estimate,
                        released={"releases": releases} if secure else {}, epsilon=spent,
                        delta=delta, neighboring=NeighboringRelation.REPLACE_ONE, info=info,
                        dp_event=steps_event(zs, secure))


def _warn_underpowered(n, d, kappa, epsilon, delta, beta, typical):
  """The :class:`dpjax.UnderpoweredWarning` of a run whose typical error exceeds 1, with the
  rows :func:`covariance_required_n` gives for errors 1 and 0.1."""
  args = f"{d}, kappa={kappa:g}, epsilon={epsilon:g}, delta={delta:g}"
  need_1 = covariance_required_n(d, kappa=kappa, epsilon=epsilon, delta=delta, accuracy=1.0,
                                 beta=beta)
  need_01 = covariance_required_n(d, kappa=kappa, epsilon=epsilon, delta=delta, accuracy=0.1,
                                  beta=beta)
  warn_underpowered(
      f"coinpress_covariance: at n={n} rows its typical error ‖Σ^-1/2 Σ̂ Σ^-1/2 − I‖₂ is about "
      f"{typical:.3g} (d={d}, κ={kappa:g}, ε={epsilon:g}, δ={delta:g}): the estimate says "
      f"little. An error of 1 needs n ≥ {need_1:,} rows and of 0.1 n ≥ {need_01:,} "
      f"(dpjax.coinpress.covariance_required_n({args}, accuracy=...)); or raise epsilon, or "
      "lower kappa with a tighter public bound. The result is still private.")


def choose_covariance_steps(n: int, d: int, *, kappa: float, epsilon: float, delta: float,
                            beta: float = 0.01) -> int:
  """[PROPOSED] The default T of :func:`coinpress_covariance`, a public function of its arguments.

  The paper leaves T to the user (its theory takes T = O(log κ); its experiments use 1–5). Too
  many steps hurt when n is small — each step whose η_t exceeds the whitened covariance shrinks
  it further below the fixed clipping radius — and too few leave the preconditioning unfinished.
  Rule: among T = 1..8 with the paper's split, take the smallest T whose *typical-case* error
  proxy is within 10% of the best. The proxy is the ``error_bound`` recursion with the tail terms
  dropped: ``2 sqrt(d/n)`` for the sampling error, ``σ_t sqrt(2d)`` for ``‖E_t‖``,
  ``λ_{t+1} = λ_t/(λ_t + 2η_t)``, and ``2 sqrt(d/n) + 2 σ_{T−1} sqrt(2d)/λ_{T−1}`` at the end.
  (The rigorous bound itself is too pessimistic to choose with: it prefers T = 1 where T = 3
  halves the measured error.) The analytic Gaussian σ of (ε, δ) stands in for the accountant's
  common scale s (they agree up to the PLD discretisation), so no accountant runs here.

  Measured ``‖Σ^{-1/2}Σ̂Σ^{-1/2} − I‖_2`` (ε = 1, δ = 1e-6, κ = 10, mean over 5–8 seeds; chosen
  T in brackets): d = 10, n = 1e4, Σ eigenvalues 1..10 [1]: 0.72 (T = 4: 3.3); d = 10, n = 2e4,
  Σ = I [2]: 0.56 (T = 3: 0.51, T = 1: 0.90); d = 5 and 10, n = 5e4 [3, 4]: within 10% of the
  best T (0.03 and 0.06).

  Args:
    n: number of rows ≥ 2.
    d: dimension ≥ 1.
    kappa: κ ≥ 1 with ``I ⪯ Σ ⪯ κ I``.
    epsilon: ε > 0.
    delta: δ ∈ (0, 1).
    beta: β ∈ (0, 1).

  Returns:
    T as an int in ``[1, 8]``.
  """
  n = v.check_int(n, "n", low=2)
  d = v.check_int(d, "d", low=1)
  kappa = v.check_positive(kappa, "kappa")
  if kappa < 1.0:
    raise ValueError(f"kappa must be >= 1 (the bound I ⪯ Σ ⪯ kappa·I), got kappa={kappa!r}.")
  beta = v.check_probability(beta, "beta", open_high=True)
  s0 = analytic_gaussian_sigma(epsilon, delta, 1.0)
  proxies = [_covariance_plan(n, d, kappa, beta, default_fractions(t), s0).typical_error
             for t in range(1, _AUTO_MAX_STEPS + 1)]
  best = min(proxies)
  return 1 + next(i for i, p in enumerate(proxies) if p <= 1.1 * best)


def covariance_required_n(d: int, *, kappa: float, epsilon: float, delta: float,
                          accuracy: float = 0.1, beta: float = 0.01) -> int:
  """[PROPOSED] Rows :func:`coinpress_covariance` needs for a typical error ``accuracy``.

  >>> import dpjax
  >>> dpjax.coinpress.covariance_required_n(10, kappa=100.0, epsilon=1.0, delta=1e-6)
  85952

  The smallest n at which the best T in 1..8 has the typical-case error proxy of
  :func:`choose_covariance_steps` (the ``error_bound`` recursion without its tail terms, an
  estimate of ``‖Σ^{-1/2}Σ̂Σ^{-1/2} − I‖_2`` at the worst spread ``I ⪯ Σ ⪯ κI``) at most
  ``accuracy/1.1``. That minimum over T falls with n, and the chosen T's proxy is within 1.1× of
  it, so every n at or above the answer has proxy ≤ ``accuracy`` at its default T. A public
  planning figure (utility only): privacy never depends on n. The proxy is conservative:
  measured median errors (ε = 1, δ = 1e-6, κ ∈ {16, 52}, 4 seeds, eigenvalues geometric on
  [1, κ]) are 0.15–0.6× it once it is below 0.5 (d = 3, 5, 10, 30; ``docs/algorithms.md`` §3.5).

  Args:
    d: dimension ≥ 1.
    kappa: κ ≥ 1 with ``I ⪯ Σ ⪯ κ I``.
    epsilon, delta: the budget of the CoinPress run.
    accuracy: the target, > 0 (default 0.1).
    beta: β ∈ (0, 1) as in :func:`coinpress_covariance`.

  Returns:
    n as an int ≥ 2.

  Raises:
    ValueError: bad arguments, or no n up to 10¹² reaches the target.
  """
  d = v.check_int(d, "d", low=1)
  kappa = v.check_positive(kappa, "kappa")
  if kappa < 1.0:
    raise ValueError(f"kappa must be >= 1 (the bound I ⪯ Σ ⪯ kappa·I), got kappa={kappa!r}.")
  epsilon, delta = v.check_epsilon(epsilon), v.check_delta(delta)
  accuracy = v.check_positive(accuracy, "accuracy")
  beta = v.check_probability(beta, "beta", open_high=True)
  s0 = analytic_gaussian_sigma(epsilon, delta, 1.0)

  def reaches(n):
    return min(_covariance_plan(n, d, kappa, beta, default_fractions(t), s0).typical_error
               for t in range(1, _AUTO_MAX_STEPS + 1)) <= accuracy / 1.1

  return v.smallest_n(reaches, f"coinpress_covariance reaches no typical error {accuracy:g} with "
                      f"up to 1e12 rows at d={d}, kappa={kappa:g}, epsilon={epsilon:g}, "
                      f"delta={delta:g}")


class _CovariancePlan(NamedTuple):
  norm_radius: float
  sensitivity: float
  grid: float | None
  sigmas: tuple[float, ...]
  etas: tuple[float, ...]
  lower_bounds: tuple[float, ...]
  error_bound: float
  typical_error: float


def _covariance_plan(n: int, d: int, kappa: float, beta: float, fractions: tuple[float, ...],
                     scale: float, secure: bool = False) -> _CovariancePlan:
  """The public constants of :func:`coinpress_covariance` (host, float64). With ``secure`` the
  noise std is the discretized release's (z times the grid sensitivity, in matrix units)."""
  T = len(fractions)
  norm_radius = gaussian_norm_radius(d, beta / (3.0 * n))
  sens = math.sqrt(2.0) * norm_radius * norm_radius / n
  grid, noise_unit = None, sens
  if secure:
    discrete_grid = discretization(sens, d * (d + 1) // 2)
    grid, noise_unit = discrete_grid.grid, discrete_grid.grid_sensitivity * discrete_grid.grid
  sigmas = tuple(scale / math.sqrt(f) * noise_unit for f in fractions)
  a = math.sqrt(d / n) + math.sqrt(2.0 * math.log(6.0 / beta) / n)
  sampling = 2.0 * a + a * a
  tail = math.sqrt(2.0 * d) + math.sqrt(2.0 * math.log(6.0 * T / beta))
  noise_norms = tuple(sg * tail for sg in sigmas)
  etas = tuple(sampling + e for e in noise_norms)
  lower = [1.0 / kappa]
  for eta in etas[:-1]:
    lower.append(lower[-1] / (lower[-1] + 3.0 * eta))
  error_bound = sampling + 2.0 * noise_norms[-1] / lower[-1]
  # Typical-case proxy (choose_covariance_steps): the same recursion without the tail terms.
  sampling_typ = 2.0 * math.sqrt(d / n)
  lam = 1.0 / kappa
  for sg in sigmas[:-1]:
    lam = lam / (lam + 2.0 * (sampling_typ + sg * math.sqrt(2.0 * d)))
  typical = sampling_typ + 2.0 * sigmas[-1] * math.sqrt(2.0 * d) / lam
  return _CovariancePlan(norm_radius, sens, grid, sigmas, etas, tuple(lower), error_bound, typical)


def _covariance_release(key, X, *, m0, norm_radius, sigmas, etas, sensitivity,
                        noise_multipliers, secure):
  """The T steps of :func:`coinpress_covariance` in traceable JAX (float64 under
  :func:`float64`): ``(ok, estimate, releases (T, d, d) or None)``, ``ok`` False and the outputs
  zero when ``X`` holds NaN/inf (reachable traced only; a concrete one is rejected by the
  validation). ``secure``: the float-safe discretized release of each step; else raw continuous
  noise (no releases returned)."""
  d = X.shape[1]
  if not secure:
    estimate = _covariance_core(key, X, m0, norm_radius, jnp.asarray(sigmas, X.dtype),
                                jnp.asarray(etas, X.dtype))
    ok, estimate = v.domain_bottom(X, True, linalg.symmetrize(estimate))
    return ok, estimate, None
  M, M_inv = jnp.eye(d, dtype=X.dtype) * m0, jnp.eye(d, dtype=X.dtype) / m0
  releases = []
  for k_step, z, eta in zip(jax.random.split(key, len(etas)), noise_multipliers, etas):
    coords = _svec(_whitened_second_moment(X, M, norm_radius))
    Z = _unsvec(jnp.asarray(discretized_gaussian_mechanism(
        k_step, coords, sensitivity=sensitivity, noise_multiplier=z)), d)   # post-processing
    releases.append(Z)
    M_inv_used = M_inv                                  # the whitening Z was released in
    M, M_inv = _whitening_update(Z, M, M_inv, eta)
  estimate = linalg.symmetrize(_covariance_estimate(Z, M_inv_used))
  return v.domain_bottom(X, True, estimate, jnp.stack(releases))


def _psd_part(Z):
  """``(P_+(Z), eigenvalues, eigenvectors)`` of a symmetric matrix."""
  lam, V = jnp.linalg.eigh(Z)
  return (V * jnp.maximum(lam, 0.0)) @ V.T, lam, V


def _svec(S):
  """Isometric coordinates of a symmetric matrix: ``S_ii`` and ``√2 S_ij`` (i < j), row-major
  upper triangle; ``‖svec(S)‖₂ = ‖S‖_F``."""
  d = S.shape[0]
  rows, cols = np.triu_indices(d)
  return S[rows, cols] * jnp.where(rows == cols, 1.0, math.sqrt(2.0)).astype(S.dtype)


def _unsvec(v, d: int):
  """Inverse of :func:`_svec` (exactly symmetric)."""
  rows, cols = np.triu_indices(d)
  upper = jnp.zeros((d, d), v.dtype).at[rows, cols].set(
      v / jnp.where(rows == cols, 1.0, math.sqrt(2.0)).astype(v.dtype))
  return upper + jnp.triu(upper, 1).T


@jax.jit
def _whitened_second_moment(X, M, norm_radius):
  """``(1/n) Σ w̃_i w̃_iᵀ`` for ``w_i = M x_i`` clipped to norm γ: the statistic of one step."""
  W = X @ M.T
  norms = jnp.sqrt(jnp.sum(W * W, axis=1))
  W = W * jnp.minimum(1.0, norm_radius / jnp.maximum(norms, jnp.finfo(X.dtype).tiny))[:, None]
  S = (W.T @ W) / X.shape[0]
  return 0.5 * (S + S.T)


@jax.jit
def _whitening_update(Z, M, M_inv, eta):
  """``U = P_+(Z) + η I``, ``M ← U^{-1/2} M`` (post-processing of the release Z)."""
  _, lam, V = _psd_part(Z)
  u = jnp.maximum(lam, 0.0) + eta
  return (V * (1.0 / jnp.sqrt(u))) @ V.T @ M, M_inv @ (V * jnp.sqrt(u)) @ V.T


@jax.jit
def _covariance_estimate(Z, M_inv):
  """``Σ̂ = M^{-1} P_+(Z) M^{-ᵀ}`` from the last release (post-processing), exactly symmetric."""
  Zp, _, _ = _psd_part(Z)
  return M_inv @ Zp @ M_inv.T          # symmetric up to rounding; the wrapper makes it exact


def _covariance_core(key, X, m0, norm_radius, sigmas, etas):
  """Traceable CoinPress covariance with raw continuous noise (float64 under x64): the
  symmetric PSD ``(d, d)`` estimate."""
  d = X.shape[1]
  noise = _standard_normal(key, (sigmas.shape[0], d, d))
  return _covariance_steps(X, m0, norm_radius, sigmas, etas, noise)


@jax.jit
def _covariance_steps(X, m0, norm_radius, sigmas, etas, noise):
  """T whiten–clip–noise steps given standard normal ``(T, d, d)`` matrices G_t."""
  d = X.shape[1]
  eye = jnp.eye(d, dtype=X.dtype)

  def step(carry, inputs):
    M, M_inv, _, _ = carry
    sigma, eta, G = inputs
    Z = _whitened_second_moment(X, M, norm_radius) + sigma * 0.5 * (G + G.T)   # this step's release
    return _whitening_update(Z, M, M_inv, eta) + (Z, M_inv), None

  init = (m0 * eye, eye / m0, jnp.zeros_like(eye), eye / m0)
  (_, _, Z, M_inv), _ = jax.lax.scan(step, init, (sigmas, etas, noise))
  return _covariance_estimate(Z, M_inv)      # through the whitening that Z was released in
