"""The full Ashtiani–Liaw Gaussian learner ([AL22] §5.1, Thm 5.7; docs/algorithms.md §3.6).

Learns ``N(μ, Σ)`` with Σ possibly singular and μ, Σ unbounded, in four steps on disjoint
batches of rows (fixed by position, public):

1. **Subspace.** Pair differences ``(x_{2i} − x_{2i+1})/√2 ~ N(0, Σ)``;
   :func:`dpjax.subspace.al_subspace` releases ``range(Σ)`` (basis V, rank r).
2. **Covariance in the subspace.** ``(x_{2i} − x_{2i+1})ᵀV/√2 ~ N(0, VᵀΣV)`` (full rank r);
   :func:`~dpjax.ashtiani_liaw.learn_covariance` (AL preconditioner + CoinPress) → Σ̂_r.
3. **Mean in the subspace.** ``w_i = Σ̂_r^{-1/2} Vᵀ x_i`` has covariance within a constant factor
   of I: Euclidean PPME (:func:`~dpjax.ashtiani_liaw.ppme_mean`) on one half gives a
   centre with a public error radius, CoinPress (:func:`~dpjax.coinpress.
   coinpress_mean`) on the other refines it (the spec's "or CoinPress" route). PPME's
   float-safe grid is sized by the public bound ``4√d·S·‖Σ̂_r^{-1/2}‖₂`` on the whitened mean
   (S below), so that a whitened mean of any size stays inside its clamp.
4. **Mean outside the subspace.** ``U_⊥ᵀ x_i`` equals ``U_⊥ᵀμ`` up to the released subspace's
   snapping error and rounding. A stability histogram of ``⌊log2‖x_i‖_∞ / 8 + ω⌋`` on the first
   half of step 4's batch releases the scale S of the rows (before step 2, and also when
   r = d: step 3 uses it too); Euclidean PPME on the other half, with a public radius that
   covers the snapping error of the group means (``2·d·s·‖x̄ − μ‖``, bounded through the released
   Σ̂_r) and the rounding (``2^{-40}S``), releases ``U_⊥ᵀμ``.

Output: ``μ̃ = V Σ̂_r^{1/2} μ̂_w + U_⊥ û_⊥``, ``Σ̃ = V Σ̂_r Vᵀ``.

Privacy guarantee: (ε, δ)-DP under replace-one. Every step is (ε, δ)-DP on its own batch (the
sub-steps of 3 and 4 use disjoint halves), later steps see earlier batches only through DP
releases, and one replaced row lies in exactly one batch: adaptive parallel composition. ⊥ in any
step stops the pipeline and ``failed_step`` names it (a ⊥ of the scale histogram is reported at
step 3, its first user, or at step 4 when r = 0).

The paper's Thm 5.7 promises TV error α with ``n = Õ(d²/α² + d²√ln(1/δ)/(αε) + …)``. In floating
point the released subspace is exact only up to its public snapping grid (``info["subspace"]
["snap_scale"]``), so the mean outside the subspace carries an error of that order: TV between
singular Gaussians with different affine supports is 1, so measure the in-subspace TV and the
orthogonal error separately (:func:`dpjax.metrics.gaussian_tv` does the former).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import NeighboringRelation

from dpjax import _validation as v
from dpjax._host import eager_only
from dpjax.ashtiani_liaw.covariance import (_sqrt_and_inverse_sqrt, learn_covariance,
                                            learn_covariance_required_n, pair_differences)
from dpjax.ashtiani_liaw.exact_subspace import (al_subspace, al_subspace_info,
                                                al_subspace_parameters, released_basis)
from dpjax.ashtiani_liaw.populous_mean import min_groups_for_test, ppme_mean
from dpjax.coinpress import coinpress_mean
from dpjax.mechanisms.histogram import histogram_threshold, stable_histogram, top_bin
from dpjax.results import GAUSSIAN_STEPS as STEPS
from dpjax.results import GaussianResult, warn_underpowered
from dpjax.ledger import with_ledger

__all__ = ["gaussian_batch_sizes", "learn_gaussian", "learn_gaussian_required_n"]

# Public floor on step 4's PPME radius (2^-400 ≈ 3.9e-121). On all-zero (or ≲ 1e-140) rows the
# released scale S is ≈ 2^-1016 and the radius 2^-40·S·√d subnormal; the analytic Gaussian
# calibration behind PPME's mask cannot handle sensitivities below ≈ 1e-150 (its bisection
# underflows and divides by zero). Any positive public radius is private; a larger one only
# makes the answer's absolute error ≈ this floor, which is below anything float64 rows of
# ordinary scale can resolve.
_MIN_ORTHOGONAL_RADIUS = 2.0 ** -400


def gaussian_batch_sizes(n: int, d: int, *, epsilon: float, delta: float,
                         covariance_share: float = 2.0 / 3.0) -> tuple[int, int, int, int]:
  """Default rows per step: the minimum the subspace and orthogonal steps need (with a factor 2
  margin), the rest split ``covariance_share : 1 − covariance_share`` between steps 2 and 3.

  Raises:
    ValueError: n too small for steps 1 and 4.
  """
  n1, n4 = _fixed_rows(d, epsilon, delta)
  rest = n - n1 - n4
  if rest < 4:
    raise ValueError(f"learn_gaussian needs more than {n1 + n4 + 4} rows for d={d}, "
                     f"epsilon={epsilon}, delta={delta}, got n={n}.")
  n2, n3 = _split_rest(rest, covariance_share)
  return n1, n2, n3, n4


def _fixed_rows(d, epsilon, delta):
  """Steps 1 and 4's rows: the minimum they need, with a factor 2 margin."""
  k_sub = al_subspace_parameters(10**12, d, epsilon=epsilon, delta=delta).min_groups
  n1 = 2 * 2 * k_sub * d                                  # pairs, and a factor 2 margin
  k4 = min_groups_for_test(epsilon / 4, delta / 2)
  tau = histogram_threshold(epsilon, delta)
  n4 = 2 * max(8 * k4, int(4 * tau))                      # halves: PPME groups of ≥ 8, histogram
  return n1, n4


def learn_gaussian_required_n(d: int, *, epsilon: float, delta: float, rank: int | None = None,
                              covariance_kwargs: dict | None = None) -> int:
  """Rows :func:`learn_gaussian` needs at its default :func:`gaussian_batch_sizes` for every
  step's public requirement to hold when step 1 releases rank ``rank`` (default d, the most
  rows); the number its refusal (``rank=0``: steps 1, 3 and 4 alone) and its step-2 ⊥ warning
  (the released rank) quote.

  Step 2 runs :func:`~dpjax.ashtiani_liaw.learn_covariance` on the pair differences of its
  rows projected to the released rank r, so it needs ``n2 // 2 ≥``
  :func:`~dpjax.ashtiani_liaw.learn_covariance_required_n` ``(r, ε, δ, **covariance_kwargs)``
  (its calibration's time: seconds at r = 13); steps 3 and 4 need two rows per PPME group. The
  answer is the smallest n meeting all of them (bisection). Public numbers only.

  Raises:
    ValueError: bad arguments.
  """
  d = v.check_int(d, "d", low=1)
  epsilon, delta = v.check_epsilon(epsilon), v.check_delta(delta, upper=0.5)
  rank = d if rank is None else v.check_int(rank, "rank", low=0, high=d)
  n1, n4 = _fixed_rows(d, epsilon, delta)
  k_mean = _mean_groups(epsilon, delta)
  pairs = (learn_covariance_required_n(rank, epsilon, delta, **(covariance_kwargs or {}))
           if rank > 0 else 0)

  def enough(n):
    n2, n3 = _split_rest(n - n1 - n4)
    return (_mean_steps_fit(n3, n4, k_mean) is None) and n2 // 2 >= pairs

  return v.smallest_n(enough, f"learn_gaussian meets no requirement up to 1e12 rows at d={d}",
                      start=n1 + n4 + 4)


def _split_rest(rest, covariance_share=2.0 / 3.0):
  n2 = int(rest * covariance_share)
  return n2, rest - n2


def _mean_steps_fit(n3, n4, k_mean):
  """None when steps 3 and 4 have two rows per PPME group, else ``(step, rows it needs, got)``."""
  for step, rows in (("mean", n3 // 2), ("orthogonal-mean", n4 - n4 // 2)):
    if rows // k_mean < 2:
      return step, 4 * k_mean, 2 * rows
  return None


@with_ledger
def learn_gaussian(key: jax.Array, X, *, epsilon: float, delta: float,
                   batch_sizes: tuple[int, int, int, int] | None = None,
                   covariance_kwargs: dict | None = None, beta: float = 0.05,
                   subspace_kwargs: dict | None = None) -> GaussianResult:
  """Learns ``N(μ, Σ)`` (Σ possibly singular, μ and Σ unbounded) privately ([AL22] Thm 5.7).

  Args:
    key: PRNG key.
    X: ``(n, d)`` rows ~ N(μ, Σ) (individuals).
    epsilon, delta: the budget (δ < 1/2).
    batch_sizes: rows for steps 1–4 (default :func:`gaussian_batch_sizes`); their sum ≤ n.
    covariance_kwargs: extra :func:`~dpjax.ashtiani_liaw.learn_covariance` arguments
      for step 2 (e.g. ``num_groups``, ``min_group_size``).
    beta: failure probability used for the public radii of steps 3 and 4.
    subspace_kwargs: extra :func:`~dpjax.subspace.al_subspace` arguments (e.g. ``snap_scale``).

  Returns:
    :class:`~dpjax.results.GaussianResult` (neighboring ``REPLACE_ONE``): ``mean (d,)`` and
    ``covariance (d, d)`` — float64 NumPy eagerly (unbounded μ and Σ with condition numbers up
    to 1e12 need float64 whatever JAX's x64 flag) —, ``failed_step`` (0, or 1 + the index in
    ``STEPS`` of the first step that answered ⊥; ``failed_step_name`` spells it),
    ``released["rank"]`` (the released rank r of Σ, 0 on ⊥ at step 1) and ``info`` with the
    public ``batch_sizes`` and the subspace step's parameters. A step whose public row
    requirement depends on the released rank (step 2 at rank r) and is not met answers ⊥ with a
    :class:`dpjax.UnderpoweredWarning` naming the requirement and
    :func:`learn_gaussian_required_n`'s rows for that rank, never an exception after a release.

  Eager only: the steps' shapes (r columns) and whether later steps run depend on released
  values, so the pipeline is orchestrated on the host and neither a ``jit`` program nor a host
  callback (which runs no JAX) can hold it. Its steps :func:`~dpjax.ashtiani_liaw.al_subspace`,
  :func:`~dpjax.ashtiani_liaw.learn_covariance`, :func:`~dpjax.ashtiani_liaw.ppme_mean` and
  :func:`~dpjax.coinpress.coinpress_mean` are traceable on their own (with JAX's x64 mode on).

  Raises:
    TypeError: called under ``jit`` / ``vmap`` (a traced ``key`` or ``X``): call it eagerly.
    ValueError: bad input (NaN/inf in X included), n too small for a step (the message says
      which and how many rows).

  References:
    [AL22] §5.1, Thm 5.7; docs/algorithms.md §3.6.
  """
  key = v.check_key(key)
  X = v.check_data64(X, "X")
  epsilon, delta = v.check_epsilon(epsilon), v.check_delta(delta, upper=0.5)
  beta = v.check_probability(beta, "beta", open_high=True)
  n, d = X.shape
  if batch_sizes is None:
    need = learn_gaussian_required_n(d, epsilon=epsilon, delta=delta, rank=0)
    if n < need:
      raise ValueError(
          f"learn_gaussian needs n ≥ {need:,} rows for d={d}, epsilon={epsilon:g}, "
          f"delta={delta:g} even if the released rank is 0, got n={n:,} "
          f"(dpjax.ashtiani_liaw.learn_gaussian_required_n({d}, epsilon={epsilon:g}, "
          f"delta={delta:g}, rank=...): rank d needs the most).")
    sizes = gaussian_batch_sizes(n, d, epsilon=epsilon, delta=delta)
  else:
    sizes = tuple(v.check_int(s, "batch_sizes[i]", low=2) for s in batch_sizes)
  if len(sizes) != 4 or sum(sizes) > n:
    raise ValueError(f"batch_sizes must be 4 sizes summing to <= n={n}, got {sizes}.")
  misfit = _mean_steps_fit(sizes[2], sizes[3], _mean_groups(epsilon, delta))
  if misfit is not None:
    raise ValueError(f"learn_gaussian's {misfit[0]} step needs at least {misfit[1]} rows "
                     f"(batch_sizes), got {misfit[2]}.")
  sub_params = al_subspace_parameters(sizes[0] // 2, d, epsilon=epsilon, delta=delta,
                                      **(subspace_kwargs or {}))
  info = {"batch_sizes": sizes, "subspace": al_subspace_info(sub_params)}
  eager_only("learn_gaussian", key, X,
             cores="al_subspace, learn_covariance, ppme_mean and coinpress_mean (trace them "
                   "inside `with jax.enable_x64(True):`)")
  ok, mean, covariance, failed, rank = _learn_gaussian(
      key, X, sizes=sizes, epsilon=epsilon, delta=delta, beta=beta,
      covariance_kwargs=covariance_kwargs or {}, subspace_kwargs=subspace_kwargs or {},
      snap_scale=sub_params.snap_scale)
  return GaussianResult(ok=jnp.asarray(ok), mean=mean, covariance=covariance,
                        failed_step=jnp.asarray(failed, jnp.int32),
                        released={"rank": jnp.asarray(rank, jnp.int32)}, epsilon=epsilon,
                        delta=delta, neighboring=NeighboringRelation.REPLACE_ONE, info=info)


def _learn_gaussian(key, X, *, sizes, epsilon, delta, beta, covariance_kwargs, subspace_kwargs,
                    snap_scale):
  """The four steps, eagerly, on float64 NumPy rows ``X`` (the steps' releases are float64
  NumPy eagerly): ``(ok, mean, covariance, failed_step, rank)``."""
  d = X.shape[1]
  fail = lambda step, rank=0: (False, np.zeros(d), np.zeros((d, d)),        # noqa: E731
                               1 + STEPS.index(step), rank)
  ends = np.cumsum(sizes)
  B1, B2, B3, B4 = (X[e - s:e] for s, e in zip(sizes, ends))
  # One split of the parent key into disjoint purposes.
  (k_subspace, k_covariance, k_mean_coarse, k_mean_fine, k_scale_offset, k_scale_histogram,
   k_orthogonal) = jax.random.split(key, 7)

  # 1. Subspace (float64 basis: the released projection is applied to rows of any scale; x64 on
  # so that al_subspace returns its basis in the rows' float64).
  with jax.enable_x64(True):
    sub = al_subspace(k_subspace, pair_differences(B1), epsilon=epsilon, delta=delta,
                      **subspace_kwargs)
  if not bool(sub.ok):
    return fail("subspace")
  V = released_basis(sub).astype(np.float64)
  r = V.shape[1]
  U_perp = _orthogonal_complement(V)

  # The rows' scale S (a stability histogram on step 4's first half): a public bound on the
  # means that steps 3 and 4 release, so that their float-safe grids cover them.
  scale = _row_scale(k_scale_offset, k_scale_histogram, B4[:B4.shape[0] // 2], epsilon,
                     delta)
  if scale is None:
    return fail("mean" if r > 0 else "orthogonal_mean", r)

  # 2–3. Covariance and mean in the subspace.
  mean_in, Sigma_r = np.zeros(d), np.zeros((r, r))
  if r > 0:
    try:
      cov = learn_covariance(k_covariance, pair_differences(B2) @ V, epsilon=epsilon, delta=delta,
                             **covariance_kwargs)
    except ValueError as err:          # the rows step 2 needs depend on the released rank r
      warn_underpowered(f"learn_gaussian: step 2 answers ⊥ at the released rank r={r}: {err}"
                        + _rank_rows_hint(X.shape[0], d, r, epsilon, delta, covariance_kwargs,
                                          sizes))
      return fail("covariance", r)
    if not bool(cov.ok):
      return fail("covariance", r)
    Sigma_r = np.asarray(cov.estimate)
    root, inv_root = _sqrt_and_inverse_sqrt(Sigma_r)
    W = B3 @ V @ inv_root
    # |entries of E w| ≤ ‖Σ̂_r^{-1/2}‖₂·√d·‖μ‖_∞ ≲ ‖Σ̂_r^{-1/2}‖₂·√d·S (public; 4× room).
    magnitude = 4.0 * math.sqrt(d) * scale * float(np.linalg.norm(inv_root, 2))
    mu_w = _whitened_mean(k_mean_coarse, k_mean_fine, W, epsilon, delta, beta, magnitude)
    if mu_w is None:
      return fail("mean", r)
    mean_in = V @ (root @ mu_w)

  # 4. Mean outside the subspace.
  mean_out = np.zeros(d)
  if r < d:
    trace = float(np.trace(Sigma_r)) * 2.0                 # ≥ tr Σ up to the refinement error
    tilt = 2.0 * d * snap_scale                            # ≥ ‖U_⊥ᵀ Π‖ for the snapped release
    u = _constant_mean(k_orthogonal, B4[B4.shape[0] // 2:], U_perp, scale, tilt, trace, epsilon,
                       delta, beta)
    if u is None:
      return fail("orthogonal_mean", r)
    mean_out = U_perp @ u
  return True, mean_in + mean_out, V @ Sigma_r @ V.T, 0, r


def _whitened_mean(k_coarse, k_fine, W, epsilon, delta, beta, magnitude):
  """Step 3: PPME centre on one half, CoinPress on the other; rows with covariance ≈ I.

  ``magnitude`` (public) bounds the whitened mean's entries: PPME's float-safe grid is coarsened
  to cover it (a whitened mean of 10¹² otherwise saturates at PPME's clamp ``2^40 γ/√r``).
  """
  n, r = W.shape
  half = n // 2
  k = _mean_groups(epsilon, delta)
  m = half // k
  K = 2.0                                                  # covariance of W within a factor 2
  group_error = math.sqrt(K / m) * (math.sqrt(r) + math.sqrt(2.0 * math.log(2.0 * k / beta)))
  coarse = ppme_mean(k_coarse, W[:half], epsilon=epsilon, delta=delta, num_groups=k,
                     radius=2.0 * group_error, magnitude=magnitude)
  if not bool(coarse.ok):
    return None
  sigma = coarse.info["sigma"]
  radius = group_error + sigma * (math.sqrt(r) + math.sqrt(2.0 * math.log(1.0 / beta)))
  scale = math.sqrt(K)
  fine = coinpress_mean(k_fine, W[half:] / scale, epsilon=epsilon, delta=delta,
                        center=np.asarray(coarse.estimate) / scale, radius=radius / scale)
  return np.asarray(fine.estimate) * scale


def _row_scale(k_offset, k_histogram, B, epsilon, delta):
  """The rows' scale S: the upper edge of the most common octave of ``‖x_i‖_∞`` (randomly offset
  bins of 8 binary orders, a stability histogram; (ε, δ)-DP on ``B``), or None on ⊥."""
  offset = float(jax.random.uniform(k_offset, ()))                 # public
  magnitude = np.maximum(np.max(np.abs(B), axis=1), np.finfo(np.float64).tiny)
  octave = np.floor(np.log2(magnitude) / 8.0 + offset).astype(np.int32)[:, None]
  hist = stable_histogram(k_histogram, octave, epsilon=epsilon, delta=delta)
  ok, bin_, _ = top_bin(hist)
  if not bool(ok):
    return None
  return 2.0 ** (8.0 * (int(bin_[0]) + 1 - offset))


def _constant_mean(k_ppme, B, U_perp, scale, tilt, trace, epsilon, delta, beta):
  """Step 4: the (nearly) constant ``U_⊥ᵀ x_i`` by Euclidean PPME on ``B`` (step 4's second half).

  A group mean of ``U_⊥ᵀ x`` differs from ``U_⊥ᵀ μ`` by ``U_⊥ᵀ Π (x̄ − μ)``, at most
  ``tilt · √(tr Σ/m)(1 + √(2 ln(2k/β)))`` for all k groups of m rows w.p. ≥ 1 − β (Gaussian
  norm concentration), plus rounding ≈ ``2^{-40}·S`` (S the released scale of the rows); twice
  that is PPME's public radius.
  """
  k = _mean_groups(epsilon, delta)
  U = B @ U_perp
  m = U.shape[0] // k
  spread = tilt * math.sqrt(trace / m) * (1.0 + math.sqrt(2.0 * math.log(2.0 * k / beta)))
  radius = 2.0 * spread + 2.0 ** -40 * scale * math.sqrt(U.shape[1])
  radius = max(radius, _MIN_ORTHOGONAL_RADIUS)      # public: all-zero rows give S ≈ 2^-1016
  # |U entries| ≤ ‖x‖ ≲ √d·S for rows in the released octave; 4√d·S leaves room (public). Without
  # it the float-safe release would clamp at ≈ 2^40·γ, far below ‖μ‖ at this tiny radius.
  res = ppme_mean(k_ppme, U, epsilon=epsilon, delta=delta, num_groups=k, radius=radius,
                  magnitude=4.0 * math.sqrt(B.shape[1]) * scale)
  return np.asarray(res.estimate) if bool(res.ok) else None


def _rank_rows_hint(n, d, r, epsilon, delta, covariance_kwargs, sizes):
  """The default split's rows for rank r (learn_gaussian_required_n), when it was used."""
  if sizes != gaussian_batch_sizes(n, d, epsilon=epsilon, delta=delta):
    return ""
  need = learn_gaussian_required_n(d, epsilon=epsilon, delta=delta, rank=r,
                                   covariance_kwargs=covariance_kwargs)
  return (f" At the default batch sizes learn_gaussian needs n ≥ {need:,} rows for rank {r} "
          f"(dpjax.ashtiani_liaw.learn_gaussian_required_n({d}, epsilon={epsilon:g}, "
          f"delta={delta:g}, rank={r})).")


def _mean_groups(epsilon: float, delta: float) -> int:
  """The PPME groups of steps 3 and 4 (public)."""
  return max(min_groups_for_test(epsilon / 4, delta / 2), 40)


def _orthogonal_complement(V: np.ndarray) -> np.ndarray:
  d, r = V.shape
  if r == 0:
    return np.eye(d)
  q, _ = np.linalg.qr(np.concatenate([V, np.eye(d)], axis=1))
  basis = q[:, r:d]
  basis -= V @ (V.T @ basis)                               # re-orthogonalise against V
  q, _ = np.linalg.qr(basis)
  return q

