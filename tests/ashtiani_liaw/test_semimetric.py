"""The affine-invariant semimetric and its batched closeness predicates (docs/algorithms.md §3.1).

Every check compares against an independent NumPy/SciPy reference (generalised eigenvalues of the
pencil (B, A)) or against a property the spec states; nothing is a hard-coded result. float64
throughout (``jax.enable_x64``) except where a test says otherwise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from dpjax.ashtiani_liaw import semimetric as sm


# ------------------------------------------------------------------------------------- helpers


def _ref_dist(A, B):
  """``max_λ max(λ − 1, 1/λ − 1)`` over the eigenvalues λ of ``A^{-1}B`` (SciPy, float64)."""
  lam = scipy.linalg.eigh(np.asarray(B, np.float64), np.asarray(A, np.float64),
                          eigvals_only=True)
  return max(lam.max() - 1.0, 1.0 / lam.min() - 1.0)


def _rand_pd(rng, d, cond=10.0):
  q, _ = np.linalg.qr(rng.normal(size=(d, d)))
  return (q * np.geomspace(1.0, cond, d)) @ q.T


def _rand_T(rng, d, cond):
  """A random invertible matrix with condition number ``cond`` (random singular vectors)."""
  u, _ = np.linalg.qr(rng.normal(size=(d, d)))
  w, _ = np.linalg.qr(rng.normal(size=(d, d)))
  return (u * np.geomspace(1.0, cond, d)) @ w.T


def _near(rng, base, spread, k):
  """k candidates ``base^{1/2} exp(spread·H) base^{1/2}`` with H symmetric Gaussian."""
  d = base.shape[0]
  root = np.linalg.cholesky(base)
  out = []
  for _ in range(k):
    H = rng.normal(size=(d, d))
    w, V = np.linalg.eigh(spread * (H + H.T) / 2)
    out.append(root @ ((V * np.exp(w)) @ V.T) @ root.T)
  return np.stack(out)


def _singular(rng, d, kind):
  if kind == "zero":
    return np.zeros((d, d))
  if kind == "zero row":                  # exactly singular: a zero row and column
    S = _rand_pd(rng, d)
    i = rng.integers(d)
    S[i, :] = 0.0
    S[:, i] = 0.0
    return S
  v = rng.normal(size=(d, d - 1))         # rank d − 1
  return v @ v.T


def _dist(A, B):
  with jax.enable_x64(True):
    return float(jax.jit(sm.psd_distance)(jnp.asarray(A, jnp.float64),
                                          jnp.asarray(B, jnp.float64)))


def _min_eig(M):
  return np.linalg.eigvalsh((M + M.T) / 2).min()


# ------------------------------------------------------------------------------- psd_distance


@pytest.mark.parametrize("seed,d,cond", [(0, 1, 1.0), (1, 2, 10.0), (2, 3, 1e3), (3, 5, 10.0),
                                         (4, 8, 100.0)])
def test_psd_distance_matches_the_generalised_eigenvalue_reference(seed, d, cond):
  rng = np.random.default_rng(seed)
  for _ in range(5):
    A, B = _rand_pd(rng, d, cond), _rand_pd(rng, d, cond) * rng.uniform(0.2, 5.0)
    ref = _ref_dist(A, B)
    assert _dist(A, B) == pytest.approx(ref, rel=1e-8)
    # The definition's other form: max of the two whitened operator norms.
    w, V = np.linalg.eigh(A)
    a_inv_half = (V / np.sqrt(w)) @ V.T
    w, V = np.linalg.eigh(B)
    b_inv_half = (V / np.sqrt(w)) @ V.T
    other = max(np.linalg.norm(a_inv_half @ B @ a_inv_half - np.eye(d), 2),
                np.linalg.norm(b_inv_half @ A @ b_inv_half - np.eye(d), 2))
    assert ref == pytest.approx(other, rel=1e-7)


def test_psd_distance_basic_semimetric_properties():
  rng = np.random.default_rng(10)
  for d in (1, 3, 8):              # dimensions of the reference test: _dist compiles per d
    for _ in range(5):
      A = _rand_pd(rng, d, 50.0) * rng.uniform(0.5, 2.0)
      B = _rand_pd(rng, d, 50.0) * rng.uniform(0.5, 2.0)
      assert _dist(A, B) == pytest.approx(_dist(B, A), rel=1e-9)          # symmetric
      assert _dist(A, B) > 0
      assert abs(_dist(A, A)) <= 1e-9                                       # dist(Y, Y) = 0
      c = rng.uniform(0.1, 10.0)                                            # scalar multiples
      assert _dist(A, c * A) == pytest.approx(max(c, 1 / c) - 1, rel=1e-9)


def test_psd_distance_float32_is_close_to_float64():
  rng = np.random.default_rng(11)
  A, B = _rand_pd(rng, 4), _rand_pd(rng, 4)
  d32 = jax.jit(sm.psd_distance)(jnp.asarray(A, jnp.float32), jnp.asarray(B, jnp.float32))
  assert d32.dtype == jnp.float32
  assert float(d32) == pytest.approx(_ref_dist(A, B), rel=1e-4)


@pytest.mark.parametrize("cond_T,rel", [(1.0, 1e-9), (30.0, 1e-8), (1e6, 1e-3)])
def test_affine_invariance(cond_T, rel):
  """dist(TATᵀ, TBTᵀ) = dist(A, B); with cond(T) = 1e6 the inputs have condition ~1e13."""
  rng = np.random.default_rng(int(np.log10(cond_T)) + 20)
  for d in (2, 3, 5):
    for _ in range(3):
      A, B = _rand_pd(rng, d), _rand_pd(rng, d)
      T = _rand_T(rng, d, cond_T)
      assert _dist(T @ A @ T.T, T @ B @ T.T) == pytest.approx(_dist(A, B), rel=rel)


def test_equivalence_with_the_loewner_sandwich():
  """dist(A,B) ≤ r ⟺ B/(1+r) ⪯ A ⪯ (1+r)B, tested just above and just below r = dist."""
  rng = np.random.default_rng(30)
  for d in (1, 2, 5, 8):
    for _ in range(5):
      A = _rand_pd(rng, d, 10.0)
      B = _near(rng, A, rng.uniform(0.05, 0.5), 1)[0]
      dist = _dist(A, B)
      scale = np.linalg.norm(A, 2) + np.linalg.norm(B, 2)
      for r, holds in ((dist * (1 + 1e-3), True), (dist * (1 - 1e-3), False)):
        lower, upper = _min_eig(A - B / (1 + r)), _min_eig((1 + r) * B - A)
        sandwich = min(lower, upper) >= -1e-12 * scale
        assert sandwich == holds, (d, dist, r, lower, upper)
      # The one-way implication dist ≤ r ⇒ (1 − r)A ⪯ B ⪯ (1 + r)A, at r = dist.
      assert _min_eig(B - (1 - dist) * A) >= -1e-10 * scale
      assert _min_eig((1 + dist) * A - B) >= -1e-10 * scale


def test_restricted_triangle_inequality():
  """1 + dist(A,C) ≤ (1 + dist(A,B))(1 + dist(B,C)), and the ≤ (3/2)(sum) form when both ≤ 1."""
  rng = np.random.default_rng(40)
  for d in (1, 2, 3, 5):
    for _ in range(20):
      A = _rand_pd(rng, d, 10.0)
      B = _near(rng, A, rng.uniform(0.02, 0.6), 1)[0]
      C = _near(rng, B, rng.uniform(0.02, 0.6), 1)[0]
      ab, bc, ac = _dist(A, B), _dist(B, C), _dist(A, C)
      assert ac <= (ab + bc + ab * bc) * (1 + 1e-9)
      if ab <= 1 and bc <= 1:
        assert ac <= 1.5 * (ab + bc) * (1 + 1e-9)
  # Attained by commuting scalings (so the reconstructed constant cannot be improved).
  s, t = 0.3, 0.7
  A = _rand_pd(rng, 3)
  assert _dist(A, (1 + s) * (1 + t) * A) == pytest.approx(s + t + s * t, rel=1e-9)


@pytest.mark.parametrize("kind", ["zero", "zero row", "rank deficient"])
def test_singular_argument_is_infinitely_far_in_both_orders(kind):
  """Exactly singular → +inf. A rank-deficient v vᵀ is singular only up to rounding: its Cholesky
  may succeed with a pivot of a few ulps, so the distance is then 'numerically infinite'."""
  rng = np.random.default_rng(50)
  floor = np.inf if kind != "rank deficient" else 1e12
  for d in (2, 5):
    for _ in range(5):
      A, S = _rand_pd(rng, d), _singular(rng, d, kind)
      assert _dist(A, S) >= floor
      assert _dist(S, A) >= floor
      if kind != "rank deficient":
        assert _dist(S, S) == np.inf                     # not even close to itself
  with jax.enable_x64(True):
    nan = jnp.full((2, 2), jnp.nan)
    assert _dist(nan, np.eye(2)) == np.inf
    assert _dist(np.eye(2), nan) == np.inf


# --------------------------------------------------------------------- closeness_matrix (pairs)


def _ref_close(Ys, r, ref_Ys=None):
  """Brute force ``dist < r`` with a mask of pairs too close to the boundary to be decided."""
  ref_Ys = Ys if ref_Ys is None else ref_Ys
  k = len(Ys)
  dist = np.full((k, k), np.inf)
  for i in range(k):
    for j in range(k):
      try:
        np.linalg.cholesky(ref_Ys[i])
        np.linalg.cholesky(ref_Ys[j])
      except np.linalg.LinAlgError:
        continue
      if np.linalg.matrix_rank(ref_Ys[i]) < len(ref_Ys[i]):
        continue
      dist[i, j] = _ref_dist(ref_Ys[i], ref_Ys[j])
  return dist < r, dist


def _candidates(seed, k, d, *, num_singular=0, T=None):
  rng = np.random.default_rng(seed)
  base = _rand_pd(rng, d, 5.0)
  Ys = _near(rng, base, 0.12, k)                  # about half of the pairs within r = 0.25
  singular = rng.choice(k, num_singular, replace=False) if num_singular else []
  for n, i in enumerate(singular):
    Ys[i] = _singular(rng, d, ("zero", "zero row")[n % 2])
  ref = Ys.copy()
  if T is not None:
    Ys = np.einsum("ab,kbc,dc->kad", T, Ys, T)
    Ys = (Ys + np.swapaxes(Ys, 1, 2)) / 2
  return Ys, ref, list(singular)


@pytest.mark.parametrize("k,chunk_size,d", [
    (1, None, 3), (7, 3, 3),
    pytest.param(13, 4, 3, marks=pytest.mark.slow(reason="k = 13 in chunks of 4; the default run "
                                                         "checks k = 7 in chunks of 3")),
    pytest.param(20, 8, 3, marks=pytest.mark.slow(reason="k = 20 in chunks of 8; the default run "
                                                         "checks k = 20 unchunked, k = 7 in 3s")),
    (20, None, 3), (6, 64, 3),
    # d > 12: LAPACK kernel and the short-circuit; chunk 3 makes two scan steps of 64 chunks,
    # several chunks of survivors and a padded last step.
    (9, None, 16), (20, 3, 16)])
def test_closeness_matrix_matches_brute_force(k, chunk_size, d):
  Ys, _, singular = _candidates(k * 7 + (chunk_size or 0), k, d, num_singular=min(2, k - 1))
  _, dist = _ref_close(Ys, 0.0)
  finite = np.unique(dist[np.isfinite(dist) & ~np.eye(k, dtype=bool)])
  # About half of the pairs close (the d = 3 candidates are built for r = 0.25).
  r = 0.25 if d <= 12 else float(finite[len(finite) // 2 - 1] + finite[len(finite) // 2]) / 2
  close = dist < r
  with jax.enable_x64(True):
    got = np.asarray(sm.closeness_matrix(jnp.asarray(Ys), r, chunk_size=chunk_size))
  assert got.shape == (k, k) and got.dtype == bool
  decided = np.abs(dist - r) > 1e-9 * r
  np.testing.assert_array_equal(got[decided], close[decided])
  np.testing.assert_array_equal(got, got.T)
  for i in singular:                              # close to nothing, not even itself
    assert not got[i].any() and not got[:, i].any()
  pd_idx = [i for i in range(k) if i not in singular]
  assert got[pd_idx, pd_idx].all()                # the diagonal of PD candidates
  if k >= 7:                                      # the test set is informative
    off = ~np.eye(k, dtype=bool)
    assert 0 < close[off].sum() < off.sum()


def test_closeness_matrix_ill_conditioned_candidates():
  """Candidates T Y_i Tᵀ with cond(T Y_i Tᵀ) ~ 1e10: same answer as for the Y_i (invariance)."""
  rng = np.random.default_rng(60)
  d, k, r = 3, 17, 0.25
  T = _rand_T(rng, d, 1e5)
  Ys, ref, singular = _candidates(61, k, d, num_singular=1, T=T)
  assert np.linalg.cond(Ys[[i for i in range(k) if i not in singular][0]]) > 1e9
  close, dist = _ref_close(Ys, r, ref_Ys=ref)
  with jax.enable_x64(True):
    got = np.asarray(sm.closeness_matrix(jnp.asarray(Ys), r, chunk_size=4))
    counts = np.asarray(sm.neighbour_counts(jnp.asarray(Ys), r, chunk_size=4))
  decided = np.abs(dist - r) > 1e-4 * r
  np.testing.assert_array_equal(got[decided], close[decided])
  assert not got[singular[0]].any()
  np.testing.assert_array_equal(counts, got.sum(axis=1))


def test_closeness_matrix_float32():
  d, k, r = 3, 11, 0.25
  Ys, _, _ = _candidates(62, k, d)
  close, dist = _ref_close(Ys, r)
  got = np.asarray(sm.closeness_matrix(jnp.asarray(Ys, jnp.float32), r, chunk_size=4))
  decided = np.abs(dist - r) > 1e-3 * r
  np.testing.assert_array_equal(got[decided], close[decided])


@pytest.mark.parametrize("chunk_size", [
    1, 13, None,
    pytest.param(4, marks=pytest.mark.slow(reason="chunks of 4 (a partial last one); the default "
                                                  "run checks 1, 13 and none")),
    pytest.param(7, marks=pytest.mark.slow(reason="chunks of 7 (two, one partial); the default run "
                                                  "checks 1, 13 and none"))])
def test_neighbour_counts_are_row_sums_of_the_closeness_matrix(chunk_size):
  d, k, r = 2, 13, 0.3
  Ys, _, _ = _candidates(70, k, d, num_singular=2)
  with jax.enable_x64(True):
    Y = jnp.asarray(Ys)
    full = np.asarray(sm.closeness_matrix(Y, r, chunk_size=chunk_size))
    counts = sm.neighbour_counts(Y, r, chunk_size=chunk_size)
  assert counts.shape == (k,) and counts.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(counts), full.sum(axis=1))
  assert 0 in np.asarray(counts)                  # the singular candidates


def test_neighbour_counts_radius_monotone():
  Ys, _, _ = _candidates(71, 15, 3)
  with jax.enable_x64(True):
    at = jax.jit(sm.neighbour_counts)           # the radius traced: one compile for the four
    counts = [np.asarray(at(jnp.asarray(Ys), r)) for r in (0.05, 0.2, 0.5, 5.0)]
  for small, large in zip(counts, counts[1:]):
    assert (small <= large).all()
  assert (counts[0] >= 1).all() and (counts[-1] == 15).all()


# ------------------------------------------------------------------------ Euclidean counts


@pytest.mark.parametrize("k,p,block_size,offset,dtype", [
    (1, 3, 1024, 0.0, jnp.float64), (37, 4, 8, 0.0, jnp.float64), (50, 2, 1024, 0.0, jnp.float32),
    (23, 5, 5, 1e6, jnp.float64),
    (40, 3, 16, 1e6, jnp.float32),     # unbounded means: no Gram-expansion cancellation
])
def test_euclidean_neighbour_counts_match_brute_force(k, p, block_size, offset, dtype):
  rng = np.random.default_rng(k + p)
  r = 1.0
  direction = rng.normal(size=p)
  Y = offset * direction / np.linalg.norm(direction) + rng.normal(size=(k, p)) * 1.2
  with jax.enable_x64(dtype == jnp.float64):
    Yj = jnp.asarray(Y, dtype)
    counts = np.asarray(sm.euclidean_neighbour_counts(Yj, r, block_size=block_size))
  Yq = np.asarray(Yj, np.float64)                 # the values the function actually saw
  dist = np.linalg.norm(Yq[:, None, :] - Yq[None, :, :], axis=-1)
  tol = 1e-9 if dtype == jnp.float64 else 1e-4
  undecided = np.abs(dist - r) <= tol * r
  ref_lo = ((dist <= r) & ~undecided).sum(axis=1)
  ref_hi = ((dist <= r) | undecided).sum(axis=1)
  assert counts.shape == (k,)
  assert (ref_lo <= counts).all() and (counts <= ref_hi).all(), (counts, ref_lo)
  assert (counts >= 1).all()
  if k > 20:
    assert (counts > 1).any() and (counts < k).any()    # informative


# ------------------------------------------------------------------------- _cholesky_succeeds


_UNROLLED = "the unrolled path at d = {}; the default run checks it at d = 1, 3 and 12"


@pytest.mark.parametrize("d", [
    1, 3, 12,                                                     # unrolled
    *(pytest.param(d, marks=pytest.mark.slow(reason=_UNROLLED.format(d))) for d in (2, 5, 8)),
    24,                                                           # LAPACK
    pytest.param(16, marks=pytest.mark.slow(reason="the LAPACK path at d = 16; the default run "
                                                   "checks it at d = 24"))])
def test_cholesky_succeeds_agrees_with_eigenvalues(d):
  rng = np.random.default_rng(80 + d)
  batch = 400
  H = rng.normal(size=(batch, d, d))
  H = (H + np.swapaxes(H, 1, 2)) / 2
  # Shift the spectrum so that λ_min(A) ~ U(−1, 1): about half are positive definite.
  shift = np.linalg.eigvalsh(H)[:, 0] - rng.uniform(-1.0, 1.0, size=batch)
  A = H - shift[:, None, None] * np.eye(d)
  ev = np.linalg.eigvalsh(A)
  lam_min, scale = ev[:, 0], np.abs(ev).max(axis=1)
  decided = np.abs(lam_min) > 1e-8 * scale
  with jax.enable_x64(True):
    succeeds = jax.jit(sm._cholesky_succeeds)
    got = np.asarray(succeeds(jnp.asarray(A)))
  assert got.shape == (batch,)
  np.testing.assert_array_equal(got[decided], (lam_min > 0)[decided])
  assert 0.2 < got.mean() < 0.8
  # Extra batch axes, with NaN / inf matrices (fail) among them: one more shape (each shape
  # compiles the unrolled factorisation anew).
  A2, want = A[:12].copy(), got[:12].copy()
  A2[9:11] = np.nan
  A2[11] = np.inf
  want[9:] = False
  with jax.enable_x64(True):
    got2 = np.asarray(succeeds(jnp.asarray(A2.reshape(3, 4, d, d))))
  np.testing.assert_array_equal(got2, want.reshape(3, 4))

