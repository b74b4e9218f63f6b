"""Classic private PCA (Chaudhuri, Sarwate & Sinha 2013, JMLR 14; docs/algorithms.md §5.3).

Both algorithms see rows in the unit ball (public bound ``data_norm``; rows above it are refused,
or clipped to it with ``clip=True``) through the second moment ``A = (1/n) Σ x_i x_iᵀ`` — NOT the
covariance: centring would need the mean, which is itself private (spend budget on a private
mean first, e.g. :func:`dpjax.coinpress.coinpress_mean`, and pass the centred rows).

* :func:`mod_sulq` — input perturbation: top-k eigenvectors of ``A + N``, N a symmetric Gaussian
  matrix with the paper's std β; (ε, δ)-DP.
* :func:`ppca` — the exponential mechanism with score ``n tr(VᵀAV)``: V from the matrix Bingham
  density ``∝ exp((nε/2) tr(VᵀAV))`` on the Stiefel manifold; ε-DP for an exact draw. The score
  sees only the subspace, so the released basis is the sampler's times a fresh Haar-random
  ``(k, k)`` orthogonal matrix: a Haar basis of the sampled subspace, as under the exact law.
  For k = 1 an exact rejection sampler (Kent, Ganeiber & Mardia 2018; ``info["guarantee"]``
  ``"exact"``); for k > 1 the Gibbs sampler of Hoff (2009), whose subspace is only
  approximately from the target: the (ε, 0) claim holds in the sampler's limit, which the
  result states in ``info["guarantee"] == "exact sampler limit"``.

Keys: each sampler call splits its key once into three named streams (the Gibbs chain's start,
its sweeps — only ever folded in, per column update and per rejection round — and the Haar
rotation); no key is both split and folded in (under ``jax_threefry_partitionable``,
``fold_in(key, i)`` equals ``split(key, n)[i]``).

The cores work on ``S = Σ u_i u_iᵀ = n A`` with ``u_i = x_i / data_norm`` (rows in the unit ball):
``tr(VᵀSV) = Σ ‖Vᵀu_i‖²`` is the exponential mechanism's score, of sensitivity 1, and ``S``'s
upper triangle has ℓ2-sensitivity √2 (:data:`SECOND_MOMENT_SENSITIVITY`). Both wrappers compute
S, and PPCA's sampler and MOD-SuLQ's continuous release, in float64 in JAX whatever JAX's x64 flag
(:func:`dpjax._host.float64`): eagerly under ``jax.enable_x64(True)``; under ``jit`` / ``vmap``
staged inline, which needs the trace to run with x64 on (a float32 trace raises ``TypeError``).
MOD-SuLQ's float-safe release (the discretized Gaussian on S's upper triangle and the
eigendecomposition) is plain NumPy on the host, a pure callback under tracing.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax import accounting, linalg
from dpjax._core import pca_power
from dpjax._core.second_moment import noisy_top_k, secure_top_k, unit_second_moment
from dpjax._host import float64
from dpjax.mechanisms.gaussian import analytic_gaussian_sigma, rdp_gaussian_sigma
from dpjax.mechanisms.grid import discretization
from dpjax.results import SubspaceResult
from dpjax.ledger import with_ledger

__all__ = ["bingham_sample", "matrix_bingham_sample", "mod_sulq", "mod_sulq_beta", "mod_sulq_core",
           "mod_sulq_required_n", "ppca", "ppca_core", "ppca_required_n", "scatter_matrix"]

# Replace-one ℓ2-sensitivity of the upper triangle (diagonal included) of S = Σ u uᵀ, ‖u‖ ≤ 1:
# ‖triu(uuᵀ − u'u'ᵀ)‖ ≤ ‖uuᵀ − u'u'ᵀ‖_F = sqrt(‖u‖⁴ + ‖u'‖⁴ − 2(u·u')²) ≤ √2, attained by
# orthogonal unit rows (e1, e2: the difference is diag(1, −1), all on the diagonal).
SECOND_MOMENT_SENSITIVITY = math.sqrt(2.0)
DEFAULT_BATCH_SIZE = 16          # proposals per rejection round (PROPOSED; see bingham_sample)
DEFAULT_NUM_SWEEPS = 100         # Gibbs sweeps for k > 1 (PROPOSED)
# ``info["guarantee"]`` of a PPCA result: what its (ε, δ = 0) is a statement about.
GUARANTEE_EXACT = "exact"                        # the released output (k = 1: exact sampler)
GUARANTEE_SAMPLER_LIMIT = "exact sampler limit"  # the exact Bingham law, the limit of the Gibbs
                                                 # sampler (num_sweeps → ∞); not proved for the
                                                 # finite-sweep output (k > 1)
MAX_CONCENTRATION = 2.0**500     # ε n / 2 above this is refused (float64 eigh/sampler range)
_BISECTION_STEPS = 64            # b ∈ [1, p] to ~(p − 1)·2^-64: any b ∈ (0, p] is exact anyway


# --------------------------------------------------------------------------------------------
# Rows, second moment.
# --------------------------------------------------------------------------------------------

def _check_rows(X, data_norm, clip):
  """Validates ``X`` and the public bound; returns ``(X float64 numpy or tracer, C's mantissa
  and exponent, the basis dtype)``. A concrete row above the bound raises unless ``clip``."""
  X64 = v.check_data64(X, "X")
  in_dtype = X.dtype if hasattr(X, "dtype") else np.asarray(X).dtype
  floating = jnp.issubdtype(in_dtype, jnp.floating)
  # The norm check's slack is the input's own rounding (rows normalised in its precision); the
  # basis comes back in X's dtype as check_data gives it (16-bit floats as float32).
  slack_eps = float(jnp.finfo(in_dtype).eps) if floating else float(np.finfo(np.float32).eps)
  if floating and jnp.finfo(in_dtype).bits >= 32:
    out_dtype = jax.dtypes.canonicalize_dtype(in_dtype)
  else:
    out_dtype = jnp.float32 if floating else jnp.result_type(float)
  data_norm = v.check_positive(data_norm, "data_norm")
  if not isinstance(clip, (bool, np.bool_)):
    raise TypeError(f"clip must be a bool, got clip={clip!r}.")
  if not clip and not v.is_traced(X64):
    norms = _row_norms(X64)
    slack = 16.0 * slack_eps * math.sqrt(X64.shape[1])     # such rows are then clipped exactly
    worst = int(np.argmax(norms))
    if norms[worst] > data_norm * (1.0 + slack):
      raise ValueError(
          f"row {worst} of X has norm {norms[worst]:.6g} > data_norm={data_norm:g}: the privacy "
          "guarantee assumes every row in the ball of radius data_norm. Pass clip=True to scale "
          "such rows down to the bound (DP-safe: a public, per-row map), or a larger public "
          "data_norm. Never rescale by the data's own maximum norm (that is not private).")
  mantissa, exponent = math.frexp(data_norm)
  return X64, mantissa, exponent, out_dtype


def _row_norms(X: np.ndarray) -> np.ndarray:
  """Row norms in float64 without over- or underflow (each row scaled by its largest entry)."""
  top = np.max(np.abs(X), axis=1)
  safe = np.where(top > 0, top, 1.0)
  return top * np.linalg.norm(X / safe[:, None], axis=1)


def scatter_matrix(X, *, data_norm: float = 1.0, clip: bool = False) -> np.ndarray:
  """``S = Σ_i u_i u_iᵀ`` (float64), ``u_i = x_i / data_norm`` (clipped to the unit ball): the
  input of :func:`mod_sulq_core` and :func:`ppca_core` (``S = n A`` in the paper's notation).

  Scale-safe (rows are normalised by a power of two of their largest entry first, as in
  :func:`dpjax.subspace.analyze_gauss`). Not a release: S is private.

  Eager only (S is returned as NumPy float64; under tracing the wrappers compute it).

  Raises:
    ValueError: as :func:`ppca` (a row above ``data_norm`` without ``clip``, NaN, bad shape).
    TypeError: under tracing (use the wrappers there).
  """
  if v.is_traced(X):
    raise TypeError("scatter_matrix needs a concrete X; under jit call mod_sulq / ppca.")
  X64, mantissa, exponent, _ = _check_rows(X, data_norm, clip)
  # S = Σ u uᵀ, u = x / max(C, ‖x‖) with C = mantissa·2^exponent: the rows' scale-safe
  # normalisation of dpjax.subspace.analyze_gauss, in float64.
  return float64("scatter_matrix", unit_second_moment, X64, mantissa, exponent)


# --------------------------------------------------------------------------------------------
# MOD-SuLQ.
# --------------------------------------------------------------------------------------------

def mod_sulq_beta(n: int, d: int, epsilon: float, delta: float) -> float:
  """MOD-SuLQ's noise std β on ``A = (1/n) XᵀX`` ([CSS13] Algorithm 1; docs/algorithms.md §5.3)::

      β = (d + 1)/(n ε) · sqrt(2 ln((d² + d)/(2 δ sqrt(2π)))) + 1/(n sqrt(ε))

  Raises:
    ValueError: bad n, d, ε, δ, or ``(d² + d)/(2δ sqrt(2π)) ≤ 1`` (the logarithm is not
      positive: for d = 1 that is δ ≥ 0.399; the formula is undefined there).
  """
  n = v.check_int(n, "n", low=1)
  d = v.check_int(d, "d", low=1)
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  ratio = (d * d + d) / (2.0 * delta * math.sqrt(2.0 * math.pi))
  if not ratio > 1.0:
    largest = (d * d + d) / (2 * math.sqrt(2 * math.pi))
    raise ValueError(f"MOD-SuLQ's β needs (d² + d)/(2δ√(2π)) > 1, got {ratio:.4g} for d={d}, "
                     f"delta={delta!r}: choose δ < {largest:.4g}.")
  return ((d + 1) / (n * epsilon) * math.sqrt(2.0 * math.log(ratio))
          + 1.0 / (n * math.sqrt(epsilon)))


@with_ledger
def mod_sulq(key: jax.Array, X, *, epsilon: float, delta: float, k: int,
             data_norm: float = 1.0, clip: bool = False, secure: bool = True) -> SubspaceResult:
  """MOD-SuLQ ([CSS13] Algorithm 1): the top-k eigenvectors of ``A + N``.

  Usage::

      res = dpjax.classic.mod_sulq(jax.random.key(0), X, epsilon=1.0, delta=1e-6, k=2)
      res.basis                  # (d, k) orthonormal; X (n, d), rows ‖x_i‖ ≤ data_norm = 1

  ``A = (1/n) Σ u_i u_iᵀ`` (``u_i = x_i/data_norm``; not centred), ``N`` symmetric with upper
  triangle and diagonal i.i.d. ``N(0, β²)``, β the paper's :func:`mod_sulq_beta` (from a
  per-entry union bound), kept so that benchmarks compare the published algorithm. With the
  tight sensitivity and the analytic calibration this mechanism IS
  :func:`dpjax.subspace.analyze_gauss` (``clip_norm = data_norm``), with less noise by a factor
  that grows like d.

  Guarantee: (ε, δ)-DP under replace-one (n public), never resting on the paper's proof: one
  replaced row moves A's upper triangle (d(d+1)/2 entries) by ≤ √2/n in ℓ2
  (:data:`SECOND_MOMENT_SENSITIVITY`), a Gaussian mechanism, and the wrapper raises the noise
  wherever β falls short of (ε, δ) at that sensitivity (``info["sigma"]``, the std used, against
  ``info["beta"]``); the eigenvectors are post-processing. ``secure=True`` (default): ``nA``'s
  upper triangle released on the host by :func:`dpjax.mechanisms.discretized_gaussian_mechanism`
  (float-safe, §1.10), checked with the looser RDP accountant: at small ε or δ near its limit
  much more noise (:func:`dpjax.mechanisms.rdp_gaussian_sigma`'s), or a ValueError (use
  ``secure=False`` there). ``secure=False``: continuous float64 noise (:func:`mod_sulq_core`),
  DP in real arithmetic (§1.10's caveat). No ⊥: ``ok`` is True (a NaN in a traced X gives the
  typed ⊥). Proof and measurements: docs/algorithms.md §5.3.

  Args:
    key: PRNG key.
    X: ``(n, d)`` float data, rows are individuals with ``‖x_i‖ ≤ data_norm``.
    epsilon, delta: the budget (δ must make β defined, see :func:`mod_sulq_beta`).
    k: subspace dimension, ``1 <= k <= d``.
    data_norm: public row-norm bound (default 1, the paper's).
    clip: scale rows above ``data_norm`` down to it (a public per-row map, so the guarantee is
      unchanged); False (default) refuses such rows. Under tracing the check cannot run and
      rows are always clipped.
    secure: float-safe discretized release (default) or raw continuous noise.

  Returns:
    :class:`~dpjax.results.SubspaceResult` (``ok`` True, neighboring ``REPLACE_ONE``, δ as
    given), basis ``(d, k)`` orthonormal in X's dtype (16-bit floats: float32); ``info``:
    ``beta`` (units of ``data_norm²``), ``sigma`` (the std used on A), ``data_norm``, ``clip``,
    ``secure`` and (secure) ``noise_multiplier`` and ``grid`` (the grid step of ``n A``).
    Computed in float64 in JAX: traceable in ``key`` and ``X`` with JAX's x64 mode on (the
    secure release then a NumPy pure callback); under a float32 trace (x64 off) it raises
    ``TypeError``; eagerly it runs under ``jax.enable_x64(True)`` whatever the flag.

  Raises:
    TypeError: bad key, X not a real array, clip not a bool; traced with JAX's x64 mode off.
    ValueError: NaN/inf in a concrete X, a row above ``data_norm`` (without ``clip``), bad ε,
      δ, k or ``data_norm``; (secure) no noise multiplier up to 1e7 passes the RDP check.

  Warns:
    dpjax.UnderpoweredWarning: n below :func:`mod_sulq_required_n` (at accuracy 1/10); the
      message gives that number. The result is still private.
  """
  key = v.check_key(key)
  X64, mantissa, exponent, out_dtype = _check_rows(X, data_norm, clip)
  n, d = X64.shape
  k = v.check_int(k, "k", low=1, high=d)
  epsilon = v.check_epsilon(epsilon)
  delta = v.check_delta(delta)
  beta = mod_sulq_beta(n, d, epsilon, delta)
  _warn_mod_sulq(n, d, k, epsilon, delta, secure)
  info = {"beta": beta, "data_norm": float(data_norm), "clip": bool(clip),
          "secure": bool(secure)}
  z, grid, unit_sigma = _mod_sulq_noise(n * beta, d, epsilon, delta, secure)
  if secure:
    info.update(noise_multiplier=z, grid=grid)
  info["sigma"] = unit_sigma / n

  # A NaN in a traced X makes S NaN: the secure release counts such entries as 0 and the
  # continuous one returns NaN; either way the typed ⊥ below replaces the basis. The key is an
  # argument of the float64 stage in both paths, so that a traced key (X closed over) stages it.
  if secure:
    S = float64("mod_sulq", lambda _, X: unit_second_moment(X, mantissa, exponent), key, X64)
    basis = secure_top_k(key, S, z, k, sensitivity=SECOND_MOMENT_SENSITIVITY)
  else:
    basis = float64("mod_sulq", lambda key, X: mod_sulq_core(
        key, unit_second_moment(X, mantissa, exponent), unit_sigma, k=k), key, X64)
  basis = jnp.asarray(basis, out_dtype)
  ok = jnp.asarray(True)
  if v.is_traced(X64):
    ok, basis = v.domain_bottom(X64, ok, basis)
  return SubspaceResult(ok=ok, basis=basis, epsilon=epsilon, delta=delta,
                        neighboring=NeighboringRelation.REPLACE_ONE, info=info)


def _mod_sulq_noise(n_beta, d, epsilon, delta, secure):
  """``(noise multiplier, grid step, std on S = nA)``: the secure release's (z, grid) or
  ``(None, None, ·)`` for the continuous one. ``n_beta`` is nβ, the paper's std on S."""
  if not secure:
    return None, None, max(n_beta, analytic_gaussian_sigma(epsilon, delta,
                                                           SECOND_MOMENT_SENSITIVITY))
  grid = discretization(SECOND_MOMENT_SENSITIVITY, d * (d + 1) // 2)
  step = grid.grid_sensitivity * grid.grid             # the release's std per unit of z
  z = n_beta / step
  # The release is RDP with multiplier z (sensitivity √2): accept the paper's z if that gives
  # (ε, δ), else (never seen) take the RDP calibration's.
  if accounting.gaussian_composition_epsilon([z], delta, accountant="rdp") > epsilon:
    z = max(z, rdp_gaussian_sigma(epsilon, delta))
  return z, grid.grid, z * step


def mod_sulq_required_n(d: int, k: int, *, epsilon: float, delta: float, accuracy: float = 0.1,
                        secure: bool = True) -> int:
  """Rows :func:`mod_sulq` needs so that its noise typically costs the basis at most
  ``accuracy·n`` of captured energy (units of ``data_norm²``; n is the most n rows in the ball
  can have); the number its :class:`dpjax.UnderpoweredWarning` quotes (at the default
  ``accuracy = 1/10``), which it gives exactly when n is below it.

  >>> import dpjax
  >>> dpjax.classic.mod_sulq_required_n(30, 2, epsilon=1.0, delta=1e-6)
  84258

  As :func:`dpjax.subspace.analyze_gauss_required_n` (``⌈4kσ√d / accuracy⌉``, σ the std on
  ``S = nA``, here nβ or the secure release's, which does not depend on n;
  docs/algorithms.md §5.6): the paper's β is larger by a factor that grows like d, and so is
  the number. Public numbers only.

  Raises:
    ValueError: bad d, k, ε, δ or accuracy (δ must make β defined, :func:`mod_sulq_beta`).
  """
  d = v.check_int(d, "d", low=1)
  k = v.check_int(k, "k", low=1, high=d)
  epsilon, delta = v.check_epsilon(epsilon), v.check_delta(delta)
  return pca_power.required_rows(_mod_sulq_loss(d, k, epsilon, delta, secure), accuracy)


def _mod_sulq_loss(d, k, epsilon, delta, secure):
  unit_sigma = _mod_sulq_noise(mod_sulq_beta(1, d, epsilon, delta), d, epsilon, delta, secure)[2]
  return pca_power.gaussian_energy_loss(unit_sigma, d, k)


def _warn_mod_sulq(n, d, k, epsilon, delta, secure):
  pca_power.warn_if_underpowered(
      "mod_sulq", n, _mod_sulq_loss(d, k, epsilon, delta, secure),
      f"dpjax.classic.mod_sulq_required_n({d}, {k}, epsilon={epsilon:g}, delta={delta:g}, "
      f"accuracy={{}}{'' if secure else ', secure=False'})",
      f"d={d}, k={k}, ε={epsilon:g}, δ={delta:g}")


@functools.partial(jax.jit, static_argnames=("k",))
def mod_sulq_core(key: jax.Array, S: jax.Array, noise_std, *, k: int) -> jax.Array:
  """Traceable MOD-SuLQ with raw continuous noise: the top-k eigenvectors of ``S + E``.

  ``E`` symmetric, upper triangle and diagonal i.i.d. ``N(0, noise_std²)``, in S's dtype (run
  under ``jax.enable_x64(True)`` with float64 S for the wrapper's precision, as :func:`mod_sulq`
  does). With ``S = scatter_matrix(X)`` (= nA) and ``noise_std = n·mod_sulq_beta(n, d, ε, δ)``
  this is ``mod_sulq(..., secure=False)``: (ε, δ)-DP in real arithmetic under replace-one. No
  validation: ``jax.jit`` / ``jax.vmap`` it over keys.

  Returns:
    ``(d, k)`` orthonormal basis, eigenvalues of ``S + E`` descending.
  """
  return noisy_top_k(key, S, noise_std, k)


# --------------------------------------------------------------------------------------------
# The Bingham samplers.
# --------------------------------------------------------------------------------------------

def _solve_b(lam):
  """The root ``b ∈ [1, p]`` of ``Σ_i 1/(b + 2λ_i) = 1`` (λ ≥ 0 with min 0), by bisection.

  The left side decreases in b, is ≥ 1 at b = 1 (the λ = 0 term alone is 1/b) and ≤ 1 at b = p,
  so the root lies in [1, p]. Kent et al. choose it to make the envelope efficient; the sampler
  is exact for every ``b ∈ (0, p]`` (see :func:`_log_acceptance`), so the bisection's accuracy
  and the data-dependence of b affect running time only, never the output's law.
  """
  p = lam.shape[-1]
  one = jnp.ones((), lam.dtype)

  def body(_, interval):
    lo, hi = interval
    mid = 0.5 * (lo + hi)
    above = jnp.sum(1.0 / (mid + 2.0 * lam)) > 1.0       # root above mid
    return jnp.where(above, mid, lo), jnp.where(above, hi, mid)

  lo, hi = jax.lax.fori_loop(0, _BISECTION_STEPS, body, (one, one * p))
  return 0.5 * (lo + hi)


def _log_envelope_bound(b, p):
  """``log M = −(p − b)/2 + (p/2) log(p/b)``: the maximum over ``z ≥ 0`` of
  ``−z + (p/2) log(1 + 2z/b)``, attained at ``z = (p − b)/2`` (needs ``0 < b ≤ p``)."""
  return -0.5 * (p - b) + 0.5 * p * jnp.log(p / b)


def _log_acceptance(z, b, p):
  """``log[exp(−z) (1 + 2z/b)^{p/2} / M]`` with ``z = xᵀBx ≥ 0``: the log acceptance probability
  of a proposal ``x`` (Bingham ``exp(−xᵀBx)`` over the ACG envelope ``(xᵀΩx)^{−p/2}``,
  ``Ω = I + 2B/b``, so ``xᵀΩx = 1 + 2z/b`` on the sphere). ≤ 0 for every z ≥ 0 when
  ``b ∈ (0, p]``: d/dz = −1 + p/(b + 2z) vanishes only at z = (p − b)/2, a maximum."""
  return -z + 0.5 * p * jnp.log1p(2.0 * z / b) - _log_envelope_bound(b, p)


def _bingham_draw(key, C, batch_size):
  """One exact draw from ``∝ exp(xᵀCx)`` on the unit sphere of ``R^p``; returns
  ``(x (p,), number of proposals used)`` (see :func:`bingham_sample`)."""
  p = C.shape[-1]
  # A non-finite C (only from a traced NaN dataset, whose output the caller replaces by ⊥)
  # becomes 0, so that the loop below always ends.
  C = jnp.where(jnp.all(jnp.isfinite(C)), C, jnp.zeros_like(C))
  c, Q = jnp.linalg.eigh(C)                                   # ascending
  lam = jnp.maximum(c[-1] - c, 0.0)        # B = c_max I − C ≥ 0: the target is exp(−xᵀBx)
  b = _solve_b(lam)
  inv_omega = b / (b + 2.0 * lam)          # 1/ω_i ∈ (0, 1], the top direction's is 1
  w = lam * inv_omega                      # λ_i/ω_i ≤ b/2: z below never over/underflows
  dtype = C.dtype

  def cond(state):
    return ~state[2]

  def body(state):
    i, x, _, count = state
    # One normal draw per round (one random-bits program to compile): p coordinates of the
    # proposal and two more for the uniform of the test, as E = (g1² + g2²)/2 ~ Exp(1).
    draws = jax.random.normal(jax.random.fold_in(key, i), (batch_size, p + 2), dtype)
    g = draws[:, :p]
    exponential = 0.5 * jnp.sum(draws[:, p:] ** 2, axis=1)
    y2 = jnp.sum(g * g * inv_omega, axis=1)     # ‖y‖², y = g/√ω ~ N(0, Ω⁻¹); ≥ g_top² > 0
    z = jnp.sum(g * g * w, axis=1) / y2         # xᵀBx for x = y/‖y‖
    accept = -exponential <= _log_acceptance(z, b, p)     # probability exp(log acceptance)
    first = jnp.argmax(accept)                  # the first accepted proposal of the batch
    found = jnp.any(accept)
    x_new = g[first] * jnp.sqrt(inv_omega) / jnp.sqrt(y2[first])
    used = (i * batch_size + first + 1).astype(jnp.int32)
    return i + 1, jnp.where(found, x_new, x), found, jnp.where(found, used, count)

  init = (jnp.int32(0), jnp.zeros((p,), dtype), jnp.asarray(False), jnp.int32(0))
  _, x, _, count = jax.lax.while_loop(cond, body, init)
  return jnp.matmul(Q, x, precision=linalg.HIGHEST), count


def bingham_sample(key: jax.Array, C: jax.Array, *,
                   batch_size: int = DEFAULT_BATCH_SIZE) -> jax.Array:
  """One exact draw from the Bingham density ``∝ exp(xᵀCx)`` on the unit sphere ``S^{p−1}``.

  Rejection sampling with the angular central Gaussian envelope (Kent, Ganeiber & Mardia 2018,
  "A new unified approach for the simulation of a wide class of directional distributions",
  JCGS 27(2)): with ``C = Q diag(c) Qᵀ`` and ``B = c_max I − C`` (eigenvalues ``λ_i ≥ 0``,
  smallest 0), the target is ``∝ exp(−xᵀBx)``; proposals ``x = y/‖y‖``, ``y ~ N(0, Ω⁻¹)``,
  ``Ω = I + 2B/b`` with b the root of ``Σ 1/(b + 2λ_i) = 1``, are accepted with probability
  ``exp(−xᵀBx)(xᵀΩx)^{p/2}/M``, ``M = exp(−(p − b)/2)(p/b)^{p/2}``. The ratio never exceeds 1
  (its maximum over ``z = xᵀBx ≥ 0`` is M, at ``z = (p − b)/2``), so the first accepted
  proposal is an exact draw, for any b in (0, p]. The test runs in log space (``log1p``), and
  the quadratic forms use ``λ_i/ω_i ≤ b/2``, so a huge concentration (``‖C‖`` up to ~1e150 in
  float64) neither overflows nor underflows.

  Proposals come in batches of ``batch_size`` (vectorised); a ``jax.lax.while_loop`` runs until
  a batch holds an acceptance and returns its first. The loop has no cap (a cap with a
  fallback would change the law): its running time is random and depends on C — timing is not
  protected. Measured acceptance rates (float64): ≈ 1 at low concentration, falling to a floor
  of about ``0.87/√p`` at high concentration (0.65 at p = 2, 0.53 at p = 3, 0.27 at p = 10,
  0.12 at p = 50, 0.087 at p = 100, 0.051 at p = 300; the same from ``‖C‖`` = 1e4 to 1e100).
  C is used through its eigendecomposition in C's dtype (use float64 for large
  concentrations); a non-finite C is treated as 0 (uniform), so the loop always ends.

  Traceable (``jax.jit`` / ``jax.vmap`` over keys and C; the same draw per key either way).

  Args:
    key: PRNG key.
    C: ``(p, p)`` symmetric float matrix (adding a multiple of I does not change the law).
    batch_size: proposals per round (static; efficiency only).

  Returns:
    ``(p,)`` unit vector in C's dtype. Its sign is uniformly random, as the law is symmetric:
    the draw is multiplied by an independent uniform sign (the k = 1 case of the Haar rotation
    of :func:`matrix_bingham_sample`; the law is unchanged).
  """
  return _scaled_matrix_bingham(key, C, 1.0, 1, 0, batch_size)[:, 0]


def _gibbs(start_key, sweeps_key, C, k, num_sweeps, batch_size):
  """Hoff's (2009) Gibbs sampler for ``∝ exp(tr(VᵀCV))`` on the Stiefel manifold ``V (d, k)``.

  Column j given the others lies on the unit sphere of their orthogonal complement (dimension
  ``d − k + 1``, orthonormal basis N from a complete QR); there its density is
  ``∝ exp(wᵀ NᵀCN w)``, a vector Bingham drawn exactly by :func:`_bingham_draw`. Any basis N
  gives the same conditional law. Systematic scan, ``num_sweeps · k`` column updates, from a
  Haar-random frame drawn from ``start_key`` alone (never from the data); update t draws with
  ``fold_in(sweeps_key, t)`` (``sweeps_key`` is only ever folded, never split).
  """
  d = C.shape[0]
  V0 = linalg.orthonormal_basis(start_key, d, k, C.dtype)

  def update(t, V):
    j = t % k
    others = jnp.roll(V, -(j + 1), axis=1)[:, :k - 1]           # every column but j
    N = jnp.linalg.qr(others, mode="complete")[0][:, k - 1:]     # (d, d − k + 1)
    w, _ = _bingham_draw(jax.random.fold_in(sweeps_key, t),
                         linalg.matmul(N.T, linalg.matmul(C, N)), batch_size)
    return V.at[:, j].set(jnp.matmul(N, w, precision=linalg.HIGHEST))

  return jax.lax.fori_loop(0, num_sweeps * k, update, V0)


def _haar_orthogonal(key, k, dtype):
  """A Haar-random ``(k, k)`` orthogonal matrix: the QR factor Q of a standard Gaussian matrix
  with its column signs fixed by ``diag(sign(R))`` (Mezzadri 2007; without the fix Q is not
  Haar). Both determinants ±1 occur, each with probability 1/2; for k = 1 a uniform sign."""
  return linalg.orthonormal_basis(key, k, k, dtype)


def _matrix_bingham_parts(key, C, k, num_sweeps, batch_size):
  """``(frame (d, k), rotation (k, k))``: the sampler's frame and the Haar rotation that
  :func:`_scaled_matrix_bingham` releases it with (``frame @ rotation``).

  The key is split once, into three named streams: ``start`` (the Gibbs chain's Haar-random
  initial frame; unused for k = 1), ``sweeps`` (the rejection rounds for k = 1, the column
  updates for k > 1; only folded in, never split) and ``rotation`` (one Gaussian draw for the
  Haar rotation). No key is both split and folded, or both consumed and split.
  """
  start, sweeps, rotation = jax.random.split(key, 3)
  if k == 1:
    frame = _bingham_draw(sweeps, C, batch_size)[0][:, None]
  else:
    frame = _gibbs(start, sweeps, C, k, num_sweeps, batch_size)
  return frame, _haar_orthogonal(rotation, k, C.dtype)


def matrix_bingham_sample(key: jax.Array, C: jax.Array, k: int, *,
                          num_sweeps: int = DEFAULT_NUM_SWEEPS,
                          batch_size: int = DEFAULT_BATCH_SIZE) -> jax.Array:
  """A draw from the matrix Bingham density ``∝ exp(tr(VᵀCV))`` on ``{V (d, k): VᵀV = I}``.

  k = 1: exact (:func:`bingham_sample`; ``num_sweeps`` unused). k > 1: ``num_sweeps`` sweeps of
  Hoff's Gibbs sampler (Hoff 2009, "Simulation of the matrix Bingham–von Mises–Fisher
  distribution, with applications to multivariate and relational data", JCGS 18(2)) from a
  Haar-random frame: APPROXIMATE, exact only in the limit of many sweeps. Each column update is
  an exact vector Bingham draw in the orthogonal complement of the other columns (dimension
  ``d − k + 1``). Traceable; running time is data-dependent (see :func:`bingham_sample`).

  The density depends on V only through its span (``tr((VR)ᵀC(VR)) = tr(VᵀCV)`` for every
  orthogonal R), so under the exact law the basis is Haar-distributed within the subspace. The
  chain's in-plane rotation does not mix at high concentration (it stays tied to the start), so
  the draw returned is the chain's frame times a fresh Haar-random ``(k, k)`` orthogonal matrix
  R (QR of a Gaussian, signs fixed; its own key): a Haar basis of the chain's subspace. This
  Markov step leaves the target invariant, so the output is no farther from the target in total
  variation than the chain, and differs from it only through the law of the subspace.

  Returns:
    ``(d, k)`` with orthonormal columns, in C's dtype.
  """
  return _scaled_matrix_bingham(key, C, 1.0, k, num_sweeps if k > 1 else 0, batch_size)


# The one compiled program behind bingham_sample, matrix_bingham_sample, ppca_core and ppca:
# positional static arguments (num_sweeps 0 for k = 1), so every spelling of a call hits the
# same cache entry. ``scale·C`` with scale = 1 is exact.
@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _scaled_matrix_bingham(key, C, scale, k, num_sweeps, batch_size):
  frame, rotation = _matrix_bingham_parts(key, scale * C, k, num_sweeps, batch_size)
  return linalg.matmul(frame, rotation)


# --------------------------------------------------------------------------------------------
# PPCA.
# --------------------------------------------------------------------------------------------

@with_ledger
def ppca(key: jax.Array, X, *, epsilon: float, k: int, num_sweeps: int = DEFAULT_NUM_SWEEPS,
         data_norm: float = 1.0, clip: bool = False,
         batch_size: int = DEFAULT_BATCH_SIZE) -> SubspaceResult:
  """PPCA ([CSS13] Algorithm 2): V from the matrix Bingham ``∝ exp((nε/2) tr(VᵀAV))``.

  Usage::

      res = dpjax.classic.ppca(jax.random.key(0), X, epsilon=1.0, k=2)
      res.basis, res.info["guarantee"]   # (d, k); "exact" (k = 1), "exact sampler limit" (k > 1)

  The exponential mechanism on the Stiefel manifold, score ``u(V) = n tr(VᵀAV) = Σ_i ‖Vᵀu_i‖²``
  (``u_i = x_i/data_norm``; A the second moment, not centred). Guarantee: ε-DP (δ = 0) under
  replace-one for an EXACT sample (also under add/remove-one: n is not used): one row changes one
  term ``‖Vᵀu_i‖² ∈ [0, 1]``, sensitivity 1. The score sees only span(V); the released basis is
  the sampler's frame times a fresh Haar-random ``(k, k)`` rotation (post-processing, no
  budget). ``info["guarantee"]`` says what the result's ``(ε, 0)`` is a statement about:

  * k = 1: :data:`GUARANTEE_EXACT` (``"exact"``): the released output; the rejection sampler
    (:func:`bingham_sample`, Kent, Ganeiber & Mardia 2018) is exact.
  * k > 1: :data:`GUARANTEE_SAMPLER_LIMIT` (``"exact sampler limit"``): the exact Bingham law,
    the limit ``num_sweeps → ∞`` of Hoff's Gibbs sampler (:func:`matrix_bingham_sample`). For the
    finite-sweep output NO guarantee is proved (MCMC; no useful bound on the chain's distance
    from the target is known); were the released subspace within total variation η of the
    target's on every dataset, the output would be ``(ε, (1 + e^ε) η)``-DP. The chain mixes
    slowly when C's top eigenvalue dominates (a measured total-variation gap ≥ 3.5% after the
    default 100 sweeps). Account for k > 1 results accordingly (``delta`` is that of the limit
    law, not a bound for the finite chain), and prefer more sweeps at large nε.

  Running time depends on the data (the rejection loop is never capped: a fallback would break
  the law): timing is not protected. The sampler runs in float64 whatever JAX's x64 flag and is
  DP in real arithmetic (§1.10). Samplers, proofs, audits: docs/algorithms.md §5.3.

  Args:
    key: PRNG key.
    X: ``(n, d)`` float data, rows are individuals with ``‖x_i‖ ≤ data_norm``.
    epsilon: ε > 0 (``εn/2 ≤`` :data:`MAX_CONCENTRATION`).
    k: subspace dimension, ``1 <= k <= d``.
    num_sweeps: Gibbs sweeps for k > 1 (PROPOSED default :data:`DEFAULT_NUM_SWEEPS`; ignored
      for k = 1).
    data_norm: public row-norm bound (default 1).
    clip: scale rows above ``data_norm`` down to it (a public per-row map); False refuses them.
      Under tracing the check cannot run and rows are always clipped.
    batch_size: rejection proposals per round (efficiency only).

  Returns:
    :class:`~dpjax.results.SubspaceResult` (``ok`` True; ``epsilon`` ε, ``delta`` 0, neighboring
    ``REPLACE_ONE``), basis ``(d, k)`` orthonormal in X's dtype (16-bit floats: float32), a
    Haar-random basis of the sampled subspace (columns in no order: use ``projection`` or
    captured variance, not column 0); ``info``: ``guarantee`` (above), ``exact`` (k = 1),
    ``num_sweeps`` (0 for k = 1), ``batch_size``, ``data_norm``, ``clip``. Traceable in ``key``
    and ``X`` with JAX's x64 mode on (a NaN in a traced X gives ⊥); under a float32 trace (x64
    off) it raises ``TypeError``; eagerly it runs under ``jax.enable_x64(True)`` whatever the flag.

  Raises:
    TypeError: bad key, X not a real array, non-integer k / num_sweeps / batch_size, clip not a
      bool; traced with JAX's x64 mode off.
    ValueError: NaN/inf in a concrete X, a row above ``data_norm`` (without ``clip``), bad ε, k,
      ``num_sweeps``, ``batch_size`` or ``data_norm``; ``εn/2 > MAX_CONCENTRATION``.

  Warns:
    dpjax.UnderpoweredWarning: n below :func:`ppca_required_n` (at accuracy 1/10); the message
      gives that number. The result is still private.
  """
  key = v.check_key(key)
  X64, mantissa, exponent, out_dtype = _check_rows(X, data_norm, clip)
  n, d = X64.shape
  k = v.check_int(k, "k", low=1, high=d)
  epsilon = v.check_epsilon(epsilon)
  num_sweeps = v.check_int(num_sweeps, "num_sweeps", low=1)
  batch_size = v.check_int(batch_size, "batch_size", low=1)
  if epsilon * n / 2 > MAX_CONCENTRATION:
    raise ValueError(f"epsilon·n/2 = {epsilon * n / 2:.3g} exceeds {MAX_CONCENTRATION:.3g}, "
                     "beyond the sampler's float64 range; ε that large gives no privacy.")
  sweeps = 0 if k == 1 else num_sweeps
  pca_power.warn_if_underpowered(
      "ppca", n, pca_power.bingham_energy_loss(epsilon, d, k),
      f"dpjax.classic.ppca_required_n({d}, {k}, epsilon={epsilon:g}, accuracy={{}})",
      f"d={d}, k={k}, ε={epsilon:g}")

  def run(key, X):
    # A NaN in a traced X makes S NaN: the sampler then draws from C = 0 (so it ends) and the
    # typed ⊥ below replaces the basis.
    S = unit_second_moment(X, mantissa, exponent)
    return ppca_core(key, S, epsilon, k=k, num_sweeps=num_sweeps, batch_size=batch_size)

  basis = jnp.asarray(float64("ppca", run, key, X64), out_dtype)
  ok = jnp.asarray(True)
  if v.is_traced(X64):
    ok, basis = v.domain_bottom(X64, ok, basis)
  info = {"guarantee": GUARANTEE_EXACT if k == 1 else GUARANTEE_SAMPLER_LIMIT, "exact": k == 1,
          "num_sweeps": sweeps, "batch_size": batch_size, "data_norm": float(data_norm),
          "clip": bool(clip)}
  return SubspaceResult(ok=ok, basis=basis, epsilon=epsilon, delta=0.0,
                        neighboring=NeighboringRelation.REPLACE_ONE, info=info)


def ppca_required_n(d: int, k: int, *, epsilon: float, accuracy: float = 0.1) -> int:
  """Rows :func:`ppca` needs so that its draw typically costs the basis at most ``accuracy·n``
  of captured energy (units of ``data_norm²``); the number its
  :class:`dpjax.UnderpoweredWarning` quotes (at the default ``accuracy = 1/10``), which it gives
  exactly when n is below it.

  >>> import dpjax
  >>> dpjax.classic.ppca_required_n(30, 2, epsilon=1.0)
  560

  The typical loss of the matrix Bingham draw ``∝ exp((ε/2) tr(VᵀSV))`` is taken as
  ``k(d − k)/ε``: ``1/ε`` for each of the k(d − k) directions of the Grassmannian, its Laplace
  approximation (a Gaussian of variance ``1/(ε·gap)`` per direction, costing ``gap`` times that;
  smaller where the gap is below ``1/ε``); the answer is ``⌈k(d − k)/(ε·accuracy)⌉``
  (docs/algorithms.md §5.6). An approximation, not a bound. Public numbers only.

  Raises:
    ValueError: bad d, k, ε or accuracy.
  """
  d = v.check_int(d, "d", low=1)
  k = v.check_int(k, "k", low=1, high=d)
  epsilon = v.check_epsilon(epsilon)
  return pca_power.required_rows(pca_power.bingham_energy_loss(epsilon, d, k), accuracy)


def ppca_core(key: jax.Array, S: jax.Array, epsilon, *, k: int,
              num_sweeps: int = DEFAULT_NUM_SWEEPS,
              batch_size: int = DEFAULT_BATCH_SIZE) -> jax.Array:
  """Traceable PPCA: :func:`matrix_bingham_sample` with ``C = (ε/2)·S``.

  ``S = scatter_matrix(X)`` (= nA, rows in the unit ball; ``tr(VᵀSV)`` is the score of
  sensitivity 1). ε-DP under replace-one for k = 1; for k > 1 only in the sampler's limit
  (``num_sweeps → ∞``; see :func:`ppca`). The basis is Haar-random within the sampled
  subspace. Runs in S's dtype: call it under ``jax.enable_x64(True)`` with float64 S, as
  :func:`ppca` does. No validation: ``jax.jit`` / ``jax.vmap`` it over keys (and ε).

  Returns:
    ``(d, k)`` orthonormal basis in S's dtype.
  """
  return _scaled_matrix_bingham(key, S, 0.5 * epsilon, k, num_sweeps if k > 1 else 0,
                                batch_size)
