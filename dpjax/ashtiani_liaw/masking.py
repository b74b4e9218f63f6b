"""The covariance masking mechanism ``M_η(Σ) = S (I + ηG)(I + ηG)ᵀ Sᵀ`` ([AL22] Lemma 5.1/5.2).

A masking mechanism is not DP by itself: it makes two inputs within semimetric distance γ
(docs/algorithms.md §3.1) (ε, δ)-indistinguishable, and PPME (``populous_mean.py``) supplies the
stability that moves its input by at most γ when one row changes.

``S`` is any square root of Σ (``S Sᵀ = Σ``; Cholesky here): for orthogonal U,
``U(I + ηG)(I + ηG)ᵀUᵀ`` has the law of ``(I + ηG)(I + ηG)ᵀ`` (G is rotation invariant on both
sides), so the output distribution does not depend on the choice. The mechanism is the Gaussian
mechanism on the d² numbers ``S(I + ηG)`` whose noise covariance is shaped by Σ itself, followed by
the post-processing ``Y ↦ YYᵀ``.

Calibration [DERIVED, docs/algorithms.md §3.4; the paper's universal constant was not recovered]:
for ``dist(Σ, Σ') ≤ γ ≤ ½``, ``g = γ/(1 − γ)`` and ``x = ln(3/δ)``, ``M_η(Σ)`` and ``M_η(Σ')`` are
(ε, δ)-indistinguishable when

    F(γ, η) = d²g²/2 + √2 d g √x + g x + d g²/(2η²) + √(2dx) g/η  ≤  ε .

Proof (checked for this module). By affine invariance compare ``I + ηG`` with
``Λ^{1/2}(I + ηG)``, Λ diagonal with entries λ in ``[1/(1+γ), 1+γ] ⊂ [1 − γ, 1 + γ]`` (the same
interval in both directions, because dist is symmetric). Row i is ``N(e_i, η²I)`` against
``N(√λ e_i, λη²I)``; with ``y = e_i + ηz`` the log-density ratio is
``(d/2) ln λ + (1/λ − 1)‖z‖²/2 + (1 − √λ)²/(2λη²) + (1 − √λ) z_i/(λη)``. Writing u = 1/λ − 1
(|u| ≤ g), the mean of the first two terms is ``(d/2)(u − ln(1 + u)) ≤ d g²/4`` and the third is
``(1/√λ − 1)²/(2η²) ≤ g²/(8η²)``: summed over d rows, below the ``d²g²/2 + dg²/(2η²)`` of F.
The centred χ² part ``Σ_i (u_i/2)(‖z_i‖² − d)`` has d² terms with weights ``|u_i|/2 ≤ g/2``:
Laurent–Massart on its positive and negative parts bounds it by ``√2 d g √x + g x`` except with
probability 2e^{−x}; the Gaussian part ``Σ_i (1 − √λ_i) z_{ii}/(λ_i η)`` has variance
``≤ d g²/η²`` (``|1 − √λ|/λ ≤ g``), so it is ``≤ √(2dx) g/η`` except with probability e^{−x}.
So the privacy loss is ``≤ F`` except with probability ``3e^{−x} = δ``, in either direction, which
gives (ε, δ)-indistinguishability. The audit suite checks it empirically.

Rényi accounting (the default of :func:`calibrate_masking`; proof checked for this module, from
docs/algorithms.md §3.4 and the research note on the learner's sample size). With the reduction
above, the factor's rows are independent Gaussians, ``P_i = N(e_i, η²I_d)`` against
``Q_i = N(√λ_i e_i, λ_i η² I_d)``. For Gaussians the order-α Rényi divergence is closed form
(Gil, Alajaji & Linder 2013): with ``s = 1 − α + αλ > 0``,

    D_α(P_i ‖ Q_i) = α(1 − √λ)²/(2η²s) − d/(2(α − 1))·(ln s − α ln λ)      (+∞ if s ≤ 0).

It adds over the d rows and survives the post-processing ``Y ↦ YYᵀ`` and the affine map of the
reduction. The reverse direction is the same function at 1/λ (map both laws by ``y ↦ y/√λ``),
and the interval ``[1/(1+γ), 1+γ]`` is closed under λ ↦ 1/λ, so one supremum covers both
directions. Both terms grow as λ moves away from 1 on either side (with u = √λ the first term's
u-derivative has the sign of ``(u − 1)(1 + α(u − 1))`` and ``1 + α(u − 1) > 0`` when s > 0; the
second's λ-derivative is ``d·α(λ − 1)/(2(α − 1)λs)``), so the supremum over the whole interval
is ``d·max_{λ ∈ {1+γ, 1/(1+γ)}} D_α(λ)`` (:func:`masking_rdp`; the tests also search the
interval numerically). That RDP curve is converted to (ε, δ) by ``dp_accounting``'s
``compute_epsilon`` (Canonne, Kamath & Steinke 2020, Prop. 12) over a fixed grid of orders
(:func:`masking_epsilon`). Only the worst case over all admissible pairs is used: the exact
privacy-loss distribution of one extreme pair is a lower limit, not a proof for every pair.

Floating point (docs/algorithms.md §1.10): a threat this release does NOT cover. dpjax's additive
releases are made float-safe by rounding the statistic to a public grid and adding exact integer
noise (``dpjax.mechanisms.discretized_gaussian_mechanism``). That argument needs noise whose law
does not depend on the data; the mask's noise is multiplicative, ``S(I + ηG)``, with covariance
shaped by the private Σ, and a lattice-valued G would put the output on a lattice that depends on
Σ (a worse leak). The output is computed in float64 from float64 Gaussian draws, so an observer
who reads the exact bit pattern of the released matrix is outside the guarantee: the float64
matrices reachable from Σ and from a neighboring Σ' can differ in their low-order bits (Mironov
2012). What the release remains good for: its noise is of relative size η (≥ 1e-2 in practice)
while float64 rounding is ≈ 1e-16 relative, so every event that does not resolve the matrix below
about 1e-13 relative precision is governed by the proof above. Publish a rounded copy (for
example eigenvalues and eigenvector entries to 1e-8 relative) where bit-level inspection is a
concern; rounding is post-processing, though not a proof of float safety. The Ashtiani–Liaw
covariance and Gaussian learners (``al_covariance``, ``learn_covariance``, ``learn_gaussian``)
inherit this caveat through their masked release Σ̃.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon
from scipy import optimize

from dpjax import _validation as v
from dpjax import linalg

__all__ = ["MaskingCalibration", "calibrate_masking", "covariance_mask", "masking_concentration",
           "masking_epsilon", "masking_rdp", "simulated_masking_accuracy", "simulated_masking_eta"]


class MaskingCalibration(NamedTuple):
  """The public calibration of :func:`covariance_mask` for one ``(d, γ, ε, δ)``.

  Attributes:
    eta: the smallest private noise level ``η_min`` (any larger η is also private).
    distance: the sensitivity γ of the paper (the semimetric distance between the inputs on
      neighboring datasets).
    epsilon, delta: the masking budget.
    fixed_loss: the loss as η → ∞ (< ε): ``C_0 = d²g²/2 + √2 d g √x + g x`` for
      ``accounting="tail_bound"``; for ``"rdp"`` the ε of :func:`masking_epsilon` in that limit.
    accounting: ``"rdp"`` or ``"tail_bound"`` (:func:`calibrate_masking`).
  """
  eta: float
  distance: float
  epsilon: float
  delta: float
  fixed_loss: float
  accounting: str = "rdp"


def masking_privacy_loss(d: int, distance: float, eta: float, delta: float) -> float:
  """``F(γ, η)`` of the module docstring: the loss bound that holds except with probability δ.

  Args:
    d: dimension.
    distance: γ, the semimetric distance between the two inputs, ``0 < γ ≤ 1/2``.
    eta: the mechanism's noise level, > 0.
    delta: failure probability in (0, 1).

  Returns:
    F (nats); the mechanism is (F, δ)-indistinguishable on inputs at distance ≤ γ.
  """
  d, gamma, delta, eta = _check(d, distance, delta, eta=eta)
  g, x = gamma / (1.0 - gamma), math.log(3.0 / delta)
  return (_fixed_loss(d, g, x) + d * g * g / (2.0 * eta * eta)
          + math.sqrt(2.0 * d * x) * g / eta)


MASKING_ACCOUNTINGS = ("rdp", "tail_bound")

# Rényi orders for the conversion to (ε, δ): dense near 1, geometric up to 10⁵ (the optimum is
# about 1 + 2 ln(1/δ)/ε and the divergence is finite only below (1 + γ)/γ).
RDP_ORDERS = tuple((1.0 + np.geomspace(1e-2, 1e5, 481)).tolist())


def masking_rdp(d: int, distance: float, eta: float, orders=RDP_ORDERS) -> np.ndarray:
  """The mask's Rényi-DP curve on inputs at semimetric distance ≤ γ (module docstring).

  ``d · max_{λ ∈ {1+γ, 1/(1+γ)}} D_α(N(e, η²I_d) ‖ N(√λ e, λη²I_d))`` for each order α, the
  supremum over every admissible pair and both directions (+∞ where ``1 − α + αλ ≤ 0``).

  Args:
    d: dimension. distance: γ, ``0 < γ ≤ 1/2``. eta: noise level > 0.
    orders: Rényi orders α > 1.

  Returns:
    float64 array of the orders' shape (nats).
  """
  d, gamma, _, eta = _check(d, distance, eta=eta, allow_inf=True)
  alpha = np.asarray(orders, np.float64)
  if alpha.ndim != 1 or alpha.size == 0 or not np.all(alpha > 1.0):
    raise ValueError("orders must be a non-empty 1-D sequence of Rényi orders > 1.")
  return d * np.maximum(_row_rdp(alpha, gamma, d, eta),
                        _row_rdp(alpha, -gamma / (1.0 + gamma), d, eta))


def masking_epsilon(d: int, distance: float, eta: float, delta: float,
                    orders=RDP_ORDERS) -> float:
  """ε of the mask at δ on inputs at distance ≤ γ: :func:`masking_rdp` converted by
  ``dp_accounting.rdp.compute_epsilon`` (Canonne–Kamath–Steinke 2020, Prop. 12).

  Args:
    d: dimension. distance: γ, ``0 < γ ≤ 1/2``. eta: noise level > 0 (``math.inf``: the limit
      of the η-independent part). delta: in (0, 1).
    orders: Rényi orders α > 1.

  Returns:
    ε (nats); the mechanism is (ε, δ)-indistinguishable on inputs at distance ≤ γ.
  """
  delta = v.check_delta(delta)
  rdp = masking_rdp(d, distance, eta, orders)
  return float(compute_epsilon(list(orders), rdp.tolist(), delta)[0])


def calibrate_masking(d: int, distance: float, epsilon: float, delta: float, *,
                      accounting: str = "rdp") -> MaskingCalibration:
  """The smallest η at which the mask is (ε, δ)-indistinguishable on inputs within distance γ.

  ``accounting="rdp"`` (default): the exact Rényi divergence of the mask's Gaussian factor
  (module docstring), converted by ``dp_accounting``; ε decreases in η at every order, so the
  smallest η is found by Brent's method on ``log η`` (scipy) and rounded up until
  :func:`masking_epsilon` at it is ≤ ε. About 2.5× smaller η than the tail bound at the
  learners' calibrations, with the same guarantee.
  ``accounting="tail_bound"``: the tail bound F of the module docstring, in closed form in
  ``1/η``: ``F = C_0 + (d g²/2) y² + √(2dx) g y`` with ``y = 1/η`` is increasing in y, so
  ``η_min = d g / (√(2dx + 2d(ε − C_0)) − √(2dx))``, rounded up by one part in 10⁹.

  Args:
    d: dimension.
    distance: γ, the sensitivity in the semimetric, ``0 < γ ≤ 1/2``.
    epsilon, delta: the masking budget.
    accounting: ``"rdp"`` or ``"tail_bound"``.

  Returns:
    :class:`MaskingCalibration`.

  Raises:
    ValueError: γ ∉ (0, 1/2], an unknown ``accounting``, or the η-independent loss is ≥ ε (no
      η is private: γ is too large for this (d, ε, δ); PPME needs more groups).

  References:
    Ashtiani & Liaw, "Private and polynomial time algorithms for learning Gaussians and
    beyond", COLT 2022, Lemma 5.1 (its universal constant is replaced by the DERIVED
    calibration of docs/algorithms.md §3.4).
  """
  d, gamma, delta, _ = _check(d, distance, delta)
  epsilon = v.check_epsilon(epsilon)
  v.check_choice(accounting, "accounting", MASKING_ACCOUNTINGS)
  if accounting == "tail_bound":
    g, x = gamma / (1.0 - gamma), math.log(3.0 / delta)
    c0 = _fixed_loss(d, g, x)
    _check_fixed_loss(c0, epsilon, gamma, d, delta)
    root = math.sqrt(2.0 * d * x)
    eta = d * g / (math.sqrt(2.0 * d * x + 2.0 * d * (epsilon - c0)) - root) * (1.0 + 1e-9)
    return MaskingCalibration(eta, gamma, epsilon, delta, c0, accounting)
  c0 = masking_epsilon(d, gamma, math.inf, delta)
  _check_fixed_loss(c0, epsilon, gamma, d, delta)

  def excess(log_eta):
    return masking_epsilon(d, gamma, math.exp(log_eta), delta) - epsilon

  lo = math.log(gamma) - 10.0            # a bracket: ε(lo) > target (ε → ∞ as η → 0) ≥ ε(hi)
  while excess(lo) <= 0.0:
    lo -= 10.0
  hi = lo + 1.0
  while excess(hi) > 0.0:
    hi += 1.0
  eta = math.exp(optimize.brentq(excess, lo, hi, xtol=1e-12, rtol=1e-12))
  while masking_epsilon(d, gamma, eta, delta) > epsilon:
    eta *= 1.0 + 1e-9
  return MaskingCalibration(eta, gamma, epsilon, delta, c0, accounting)


def _row_rdp(alpha: np.ndarray, lam_minus_one: float, d: int, eta: float) -> np.ndarray:
  """D_α(N(e, η²I_d) ‖ N(√λ e, λη²I_d)) for an array of orders (+∞ where s ≤ 0); λ is passed
  as λ − 1 so that ``log1p`` keeps ``ln s − α ln λ`` (a difference of small numbers) accurate."""
  lam = 1.0 + lam_minus_one
  s = 1.0 + alpha * lam_minus_one
  with np.errstate(divide="ignore", invalid="ignore"):
    shift = 0.0 if math.isinf(eta) else alpha * (1.0 - math.sqrt(lam)) ** 2 / (2.0 * eta**2 * s)
    scale = -d / (2.0 * (alpha - 1.0)) * (np.log1p(alpha * lam_minus_one)
                                          - alpha * math.log1p(lam_minus_one))
    out = shift + scale
  return np.where(s > 0.0, out, np.inf)


def _check_fixed_loss(c0, epsilon, gamma, d, delta):
  if c0 >= epsilon:
    raise ValueError(f"no masking noise level is private: the η-independent loss C_0={c0:.4g} "
                     f"≥ epsilon={epsilon:g} at distance={gamma:.3g}, d={d}, delta={delta:g}; "
                     "the distance must shrink (more PPME groups).")


def masking_concentration(d: int, eta: float, beta: float) -> float:
  """α with ``P[dist(M_η(Σ), Σ) > α] ≤ β`` for every Σ ([AL22] Lemma 5.2, explicit form).

  ``dist(M_η(Σ), Σ) = dist(WWᵀ, I)`` with ``W = I + ηG``; ``‖G‖ ≤ Γ = 2√d + √(2 ln(1/β))``
  except with probability β (Davidson–Szarek), so the singular values of W lie in
  ``[1 − ηΓ, 1 + ηΓ]`` and ``α = max((1 + ηΓ)² − 1, (1 − ηΓ)^{−2} − 1)``; ``inf`` if ``ηΓ ≥ 1``.

  Args:
    d: dimension. eta: noise level > 0. beta: failure probability in (0, 1).

  Returns:
    α (a semimetric distance).
  """
  d = v.check_int(d, "d", low=1)
  eta = v.check_positive(eta, "eta")
  beta = v.check_probability(beta, "beta", open_high=True)
  t = eta * (2.0 * math.sqrt(d) + math.sqrt(2.0 * math.log(1.0 / beta)))
  if t >= 1.0:
    return math.inf
  return max((1.0 + t) ** 2 - 1.0, (1.0 - t) ** -2 - 1.0)


def simulated_masking_accuracy(d: int, eta: float, beta: float, *, draws: int = 20_000,
                               seed: int = 0) -> float:
  """α with ``P[dist(M_η(Σ), Σ) > α] ≤ β`` for every Σ, by Monte Carlo (utility only).

  ``dist(M_η(Σ), Σ)`` has the law of ``dist(WWᵀ, I) = max(s_max² − 1, s_min⁻² − 1)`` over the
  singular values of ``W = I + ηG`` whatever Σ (affine invariance; :func:`masking_concentration`),
  so ``draws`` public draws of G (NumPy, fixed ``seed``) estimate its (1 − β)-quantile without a
  bound's slack: about half of :func:`masking_concentration`'s α at the same η. The returned
  order statistic sits 3 binomial standard deviations above the (1 − β)·draws-th, so it is an
  upper confidence bound of the quantile (a one-sided 99.9% level), not a point estimate. Privacy
  does not depend on it: any η at or above the calibrated η_min is private.

  Args:
    d: dimension. eta: noise level > 0. beta: failure probability in (0, 1).
    draws: Monte Carlo draws (≥ 100). seed: public seed.

  Returns:
    α (a semimetric distance); ``inf`` if the quantile's draw has a singular W or η is so large
    that its singular values overflow when squared.
  """
  d = v.check_int(d, "d", low=1)
  eta = v.check_positive(eta, "eta")
  beta = v.check_probability(beta, "beta", open_high=True)
  return _simulated_accuracy(d, eta, beta, v.check_int(draws, "draws", low=100),
                             v.check_int(seed, "seed", low=0))


def simulated_masking_eta(d: int, accuracy: float, beta: float, *, draws: int = 20_000,
                          seed: int = 0) -> float:
  """The largest η (to 0.1%) whose :func:`simulated_masking_accuracy` is ≤ ``accuracy``.

  Bisection on ``log η`` with the same public draws at every η (so the quantile is a continuous
  function of η; it increases in η on every grid checked). About twice the η of the bound
  :func:`masking_concentration` for the same α at d = 3–10 (research note
  al-sample-complexity.md §2.5).

  Raises:
    ValueError: bad arguments.
  """
  d = v.check_int(d, "d", low=1)
  accuracy = v.check_positive(accuracy, "accuracy")
  beta = v.check_probability(beta, "beta", open_high=True)
  draws, seed = v.check_int(draws, "draws", low=100), v.check_int(seed, "seed", low=0)
  lo = hi = 1.0 / (2.0 * math.sqrt(d) + math.sqrt(2.0 * math.log(1.0 / beta)))
  while _simulated_accuracy(d, lo, beta, draws, seed) > accuracy:
    lo /= 2.0
  while _simulated_accuracy(d, hi, beta, draws, seed) <= accuracy:
    hi *= 2.0
  while hi / lo > 1.001:
    mid = math.sqrt(lo * hi)
    lo, hi = (mid, hi) if _simulated_accuracy(d, mid, beta, draws, seed) <= accuracy else (lo, mid)
  return lo


@functools.lru_cache(maxsize=2)     # 144 MB each at d = 30: keep only what a bisection reuses
def _mask_draws(d: int, draws: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal((draws, d, d))


@functools.lru_cache(maxsize=1024)
def _simulated_accuracy(d, eta, beta, draws, seed) -> float:
  s = np.linalg.svd(np.eye(d) + eta * _mask_draws(d, draws, seed), compute_uv=False)
  with np.errstate(divide="ignore", over="ignore"):    # a singular or huge W: dist = inf
    dist = np.maximum(s[:, 0] ** 2 - 1.0, s[:, -1] ** -2.0 - 1.0)
  index = math.ceil(draws * (1.0 - beta) + 3.0 * math.sqrt(draws * beta * (1.0 - beta)))
  return float(np.sort(dist)[min(index, draws) - 1])


def covariance_mask(key: jax.Array, Sigma, *, eta: float) -> jax.Array:
  """Samples ``M_η(Σ) = S (I + ηG)(I + ηG)ᵀ Sᵀ`` with ``S = cholesky(Σ)``, G i.i.d. N(0, 1).

  Guarantee: a (γ, F(γ, η), δ)-masking mechanism for the semimetric of §3.1 (see the module
  docstring; :func:`calibrate_masking` picks η for a target ε). Not DP on its own: the caller must
  bound the semimetric distance between the inputs on neighboring datasets (PPME does).
  Floating point: the output's low-order bits are not protected (module docstring).

  Args:
    key: PRNG key.
    Sigma: ``(d, d)`` symmetric positive definite, or a batch ``(b, d, d)`` (independent noise per
      matrix, one ``vmap``). Use float64 for ill-conditioned inputs. float16 / bfloat16 are
      upcast to float32 (there is no 16-bit Cholesky; the cast is exact and public).
    eta: noise level > 0 (public).

  Returns:
    Array of Sigma's shape, symmetric, in Sigma's dtype (float32 for 16-bit input). A batch
    member that is not positive definite (its Cholesky factor is not finite: NaN/inf entries
    included) is masked as if it were the identity — a fixed map of that matrix alone, so the
    masking guarantee for PD inputs is unchanged and no error depends on a private value.
    Traceable in ``key`` and ``Sigma``.

  Raises:
    TypeError: bad key or non-float ``Sigma``. ValueError: wrong shape, η ≤ 0.

  References:
    [AL22] Lemma 5.1/5.2 and App. D; docs/algorithms.md §3.4.
  """
  v.check_key(key)
  Sigma = jnp.asarray(v.check_float_array(Sigma, "Sigma"))
  if Sigma.ndim not in (2, 3) or Sigma.shape[-1] != Sigma.shape[-2] or Sigma.shape[-1] == 0:
    raise ValueError(f"Sigma must be a square (d, d) matrix or a (b, d, d) batch, got shape "
                     f"{tuple(Sigma.shape)}.")
  if jnp.finfo(Sigma.dtype).bits < 32:
    Sigma = Sigma.astype(jnp.float32)                # no 16-bit Cholesky; exact and public
  eta = v.check_positive(eta, "eta")
  batch = Sigma if Sigma.ndim == 3 else Sigma[None]
  L = jnp.linalg.cholesky(batch)
  pd = jnp.all(jnp.isfinite(L), axis=(1, 2), keepdims=True)
  L = jnp.where(pd, L, jnp.eye(L.shape[-1], dtype=L.dtype))
  out = linalg.symmetrize(jax.vmap(_mask_factor, in_axes=(0, 0, None))(
      jax.random.split(key, batch.shape[0]), L, eta))
  return out if Sigma.ndim == 3 else out[0]


def mask_covariance(key: jax.Array, Sigma: jax.Array, eta) -> jax.Array:
  """Traceable core of :func:`covariance_mask` for one matrix (no validation; Σ must be PD)."""
  return _mask_factor(key, jnp.linalg.cholesky((Sigma + Sigma.T) / 2), eta)


def _mask_factor(key, L, eta):
  d = L.shape[-1]
  W = jnp.eye(d, dtype=L.dtype) + eta * jax.random.normal(key, (d, d), L.dtype)
  Y = L @ W
  out = Y @ Y.T
  return 0.5 * (out + out.T)        # symmetric up to rounding; the public wrapper makes it exact


def _fixed_loss(d: int, g: float, x: float) -> float:
  return d * d * g * g / 2.0 + math.sqrt(2.0) * d * g * math.sqrt(x) + g * x


def _check(d, distance, delta=None, eta=None, allow_inf=False):
  d = v.check_int(d, "d", low=1)
  gamma = v.check_positive(distance, "distance")
  if gamma > 0.5:
    raise ValueError(f"distance must lie in (0, 1/2] for the masking calibration, got "
                     f"distance={gamma!r}.")
  if delta is not None:
    delta = v.check_delta(delta)
  if eta is not None:
    eta = v.check_positive(eta, "eta", allow_inf=allow_inf)
  return d, gamma, delta, eta
