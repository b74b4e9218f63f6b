"""He–Vershynin–Zhu synthetic data (dpjax.synthetic): the pipeline, PMM, PSMM, the private
projection and the choice of d', and their public helpers (data, metrics, snapping)."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import NeighboringRelation
from scipy import optimize

import dpjax
from dpjax import data, metrics
from dpjax import mechanisms as M
from dpjax.synthetic import pmm as P
from dpjax.synthetic import projection, psmm
from dpjax.synthetic import low_dimensional_synthetic_data as synthesize


N, DEPTH = 2000, 8               # shared by most tests: PMM compiles once per (n, d', depth)
# One program per data shape (eagerly, each of the generator's operations compiled apart).
_cube_jit = jax.jit(data.low_dimensional_cube_data, static_argnums=(1, 2, 3))


def _cube_data(n, d, dim, seed=0):
  X, U = _cube_jit(jax.random.key(seed), n, d, dim)
  return X, U


# ------------------------------------------------------------------------------ the pipeline


def test_shapes_cube_size_metadata_and_determinism_per_key():
  X, _ = _cube_data(N, 5, 2)
  a = synthesize(jax.random.key(1), X, epsilon=2.0, dim=2, depth=DEPTH)
  b = synthesize(jax.random.key(1), X, epsilon=2.0, dim=2, depth=DEPTH)
  c = synthesize(jax.random.key(2), X, epsilon=2.0, dim=2, depth=DEPTH)
  assert isinstance(a, dpjax.SyntheticDataResult)
  assert a.synthetic.shape == (N, 5) and a.synthetic.dtype == X.dtype
  assert a.basis.shape == (5, 2) and a.mean.shape == (5,)
  assert bool(jnp.all((a.synthetic >= 0) & (a.synthetic <= 1)))
  np.testing.assert_allclose(np.asarray(a.basis.T @ a.basis), np.eye(2), atol=1e-5)
  assert bool(a.ok) and a.epsilon == 2.0 and a.delta == 0.0
  assert a.neighboring == NeighboringRelation.REPLACE_ONE
  assert int(a.released["dim"]) == 2 and a.info["method"] == "pmm"
  assert int(jnp.sum(a.released["leaf_counts"])) == N
  assert jnp.array_equal(a.synthetic, b.synthetic) and jnp.array_equal(a.basis, b.basis)
  assert not jnp.array_equal(a.synthetic, c.synthetic)


@pytest.mark.slow(reason="psmm, auto, the tight scale, a chosen d' and a split; the default run "
                         "uses pmm at d' = 2")
def test_every_documented_option_runs():
  X, _ = _cube_data(400, 4, 3)
  for kwargs in (dict(dim=3, method="psmm", lattice_side=0.8), dict(dim=3, method="auto"),
                 dict(dim=1, method="pmm", covariance_scale="tight"),
                 dict(dim=None, max_dim=3, c_syn=2.0, budget_split=(0.2, 0.2, 0.6), depth=5)):
    res = synthesize(jax.random.key(3), X, epsilon=4.0, **kwargs)
    assert res.synthetic.shape == (400, 4)
    assert bool(jnp.all((res.synthetic >= 0) & (res.synthetic <= 1)))
    assert res.info["method"] in ("pmm", "psmm")
  assert synthesize(jax.random.key(3), X, epsilon=4.0, dim=3, method="psmm",
                    lattice_side=0.8).info["method"] == "psmm"


@pytest.mark.slow(reason="W1 within 2× of the sampling floor (ε = 200, n = 8000); the default run "
                         "checks shapes")
def test_utility_approaches_the_sampling_floor_at_large_epsilon_n():
  """At ε = 200, n = 8000 the pipeline's W1 is within 2× of two independent samples' W1."""
  XX, U = _cube_data(16_000, 8, 2)
  X, fresh = XX[:8000], XX[8000:]
  res = synthesize(jax.random.key(4), X, epsilon=200.0, dim=2, depth=10)
  w1, label = metrics.wasserstein_1(X[:1500], res.synthetic[:1500])
  floor, _ = metrics.wasserstein_1(X[:1500], fresh[:1500])
  assert label == "exact"
  assert float(metrics.projection_distance(res.basis, U)) < 0.1
  assert w1 < 2.0 * floor, (w1, floor)


@pytest.mark.slow(reason="the projection beats full-dimensional PMM in W1; the shape tests run by "
                         "default")
def test_the_private_projection_beats_full_dimensional_pmm():
  """The curse removed: on data near a line in d = 8, PMM in all 8 coordinates is far worse."""
  X, _ = _cube_data(N, 8, 1, seed=5)
  res = synthesize(jax.random.key(6), X, epsilon=50.0, dim=1, depth=DEPTH)
  direct = P.pmm(jax.random.key(6), X, epsilon=50.0 / 3, depth=DEPTH)
  ours, _ = metrics.wasserstein_1(X[:1000], res.synthetic[:1000])
  theirs, _ = metrics.wasserstein_1(X[:1000], direct[:1000])
  assert ours < 0.5 * theirs, (ours, theirs)


@pytest.mark.parametrize("dim", [
    *(pytest.param(d, marks=pytest.mark.slow(reason=f"true dimension {d}; the default run finds 3"))
      for d in (1, 2)),
    3])
def test_the_private_choice_finds_the_true_dimension_at_large_epsilon_n(dim):
  X, _ = _cube_data(20_000, 10, dim)
  eps_c, n, d = 100.0, 20_000, 10
  M_hat = projection.private_centered_covariance(jax.random.key(7), X, epsilon=eps_c)
  noise = projection.laplace_matrix_norm_quantile(
      d, projection.covariance_sensitivity(n, d) / eps_c)
  mean = projection.private_mean(jax.random.key(8), X, epsilon=eps_c)
  chosen = projection.choose_dim(np.linalg.eigvalsh(M_hat), d=d, noise_norm=noise,
                                 radius=projection.cube_radius(mean), epsilon_n=eps_c * n)
  assert chosen == dim


@pytest.mark.slow(reason="the private choice of d' inside the pipeline; choose_dim runs by "
                         "default above")
def test_the_private_choice_runs_inside_the_pipeline():
  X, _ = _cube_data(N, 6, 2)
  res = synthesize(jax.random.key(9), X, epsilon=400.0, depth=DEPTH)
  assert int(res.released["dim"]) == 2 and res.info["dim_requested"] is None


@pytest.mark.parametrize("bad, match", [
    (dict(X=np.full((10, 3), 1.5)), "scale_to_unit_cube"),
    (dict(X=-np.ones((10, 3)) * 0.1), "unit cube"),
    (dict(X=np.where(np.eye(10, 3) > 0, np.nan, 0.5)), "NaN"),
    (dict(X=np.full((1, 3), 0.5)), "at least 2 rows"),
    (dict(dim=4), "dim"),
    (dict(dim=0), "dim"),
    (dict(epsilon=0.0), "epsilon"),
    (dict(epsilon=-1.0), "epsilon"),
    (dict(epsilon=math.inf), "epsilon"),
    (dict(method="mwem"), "method"),
    (dict(covariance_scale="loose"), "covariance_scale"),
    (dict(budget_split=(0.5, 0.5, 0.5)), "budget_split"),
    (dict(budget_split=(1.0, 0.0, 0.0)), "budget_split"),
    (dict(dim=3, method="psmm", max_cells=5), "max_cells"),
])
def test_bad_input_raises_a_clear_error(bad, match):
  kwargs = dict(X=np.full((10, 3), 0.5), epsilon=1.0, dim=2)
  kwargs.update(bad)
  X = kwargs.pop("X")
  with pytest.raises(ValueError, match=match):
    synthesize(jax.random.key(0), X, **kwargs)


def test_bad_key_and_dtype():
  with pytest.raises(TypeError):
    synthesize(0, np.full((10, 3), 0.5), epsilon=1.0, dim=1)
  with pytest.raises(TypeError):
    synthesize(jax.random.key(0), np.full((10, 3), True), epsilon=1.0, dim=1)


@pytest.mark.parametrize("dtype", [
    pytest.param(jnp.float16, marks=pytest.mark.slow(reason="float16 rows; the default run checks "
                                                            "float32")),
    pytest.param(jnp.bfloat16, marks=pytest.mark.slow(reason="bfloat16 rows; the default run "
                                                             "checks float32")),
    jnp.float32])
def test_low_precision_rows_are_accepted_and_extreme_rows_stay_in_the_cube(dtype):
  X = np.zeros((N, 5))                  # the shapes of the pipeline test above: its programs
  X[::2] = 1.0                                        # all mass on two opposite corners
  res = synthesize(jax.random.key(10), jnp.asarray(X, dtype), epsilon=1.0, dim=2, depth=DEPTH)
  assert res.synthetic.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(res.synthetic)))
  assert bool(jnp.all((res.synthetic >= 0) & (res.synthetic <= 1)))


# ----------------------------------------------------------------------------------------- PMM


def test_pmm_scales_spend_exactly_the_budget():
  for dim, depth, eps in ((1, 5, 1.0), (2, 12, 0.3), (3, 9, 7.0)):
    scales = P.pmm_noise_scales(eps, depth, dim)
    assert math.isclose(sum(2 / s for s in scales), eps, rel_tol=1e-12)
    params = P.pmm_parameters(1000, dim, epsilon=eps, depth=depth)
    assert all(num / params.den >= s for num, s in zip(params.nums, params.scales))


def test_leaf_index_and_leaf_cells_agree():
  Y = jnp.asarray(np.random.default_rng(1).uniform(size=(2000, 3)), jnp.float32)

  @jax.jit                      # one program (eagerly, each small operation compiled apart)
  def check(Y):
    out = {}
    for depth in (1, 4, 7):
      leaf = P.leaf_index(Y, depth)
      lower, side = P.leaf_cells(depth, 3)
      out[depth] = (jnp.all((Y >= lower[leaf]) & (Y < lower[leaf] + side)), leaf.max())
    return out

  for depth, (inside, top) in check(Y).items():
    assert bool(inside), depth
    assert int(top) < 2**depth, depth


def test_consistency_gives_non_negative_children_that_sum_to_their_parents():
  rng = np.random.default_rng(2)
  levels = [jnp.asarray(rng.integers(-20, 40, size=2**j), jnp.int32) for j in range(1, 7)]
  consistent = jax.jit(P.consistent_counts)       # eagerly, each small operation compiles apart
  final = np.asarray(consistent(levels, 123))
  assert final.sum() == 123 and final.min() >= 0
  zero = [jnp.full(2**j, -5, jnp.int32) for j in range(1, 4)]   # all noisy counts negative
  assert np.asarray(consistent(zero, 9)).sum() == 9


@pytest.mark.slow(reason="pmm alone and its depth check; the pipeline test covers PMM's size, "
                         "range, determinism")
def test_pmm_output_size_range_and_key_determinism():
  Y = jnp.asarray(np.random.default_rng(3).beta(2, 5, size=(N, 2)), jnp.float32)
  a = P.pmm(jax.random.key(0), Y, epsilon=1.0, depth=DEPTH)
  assert a.shape == (N, 2) and bool(jnp.all((a >= 0) & (a <= 1)))
  assert jnp.array_equal(a, P.pmm(jax.random.key(0), Y, epsilon=1.0, depth=DEPTH))
  with pytest.raises(ValueError, match="depth"):
    P.pmm(jax.random.key(0), Y, epsilon=1.0, depth=P.MAX_DEPTH + 1)


@pytest.mark.slow(reason="pmm_core vmapped over keys; the default run jits it for one key in the "
                         "pipeline")
def test_pmm_core_is_jittable_and_vmappable_over_keys():
  Y = jnp.asarray(np.random.default_rng(4).uniform(size=(64, 1)), jnp.float32)
  params = P.pmm_parameters(64, 1, epsilon=1.0, depth=4)
  keys = jax.random.split(jax.random.key(0), 3)
  out, released = jax.jit(jax.vmap(lambda k: P.pmm_core(k, Y, params)))(keys)
  assert out.shape == (3, 64, 1) and released["leaf_counts"].shape == (3, 16)
  np.testing.assert_array_equal(np.asarray(released["leaf_counts"]).sum(axis=1), 64)


# ---------------------------------------------------------------------------------------- PSMM


def _bl_dual_grid(centres, points=41):
  """The dual's feasible set on a grid: f with |f| ≤ 1 and |f_k − f_l| ≤ d_kl."""
  grid = np.linspace(-1, 1, points)
  F = np.array(list(itertools.product(grid, repeat=len(centres))))
  D = np.linalg.norm(centres[:, None] - centres[None], axis=-1)
  return F[np.all(np.abs(F[:, :, None] - F[:, None, :]) <= D[None] + 1e-12, axis=(1, 2))]


def test_the_bounded_lipschitz_lp_against_a_brute_force_search():
  """Three cells on a line: the LP's μ is a probability vector whose BL distance to ν (brute
  force over the dual's feasible f) is the smallest over a grid of probability vectors."""
  centres = np.array([[0.0], [0.3], [1.0]])
  F = _bl_dual_grid(centres)
  steps = np.linspace(0, 1, 21)
  simplex = np.array([(a, b, 1 - a - b) for a in steps for b in steps if a + b <= 1 + 1e-12])
  rng = np.random.default_rng(5)
  for _ in range(3):
    nu = rng.normal(0.33, 0.3, size=3)
    mu = psmm.bounded_lipschitz_projection(nu, centres)
    assert mu.min() >= 0 and math.isclose(mu.sum(), 1.0, rel_tol=1e-9)
    ours = float((F @ (mu - nu)).max())
    best = float((F @ (simplex - nu).T).max(axis=0).min())
    assert ours <= best + 0.06, (ours, best)         # grid steps of 0.05 in f and μ


def _bl_norm_dual_lp(sigma, centres):
  """‖σ‖_BL by its dual LP, solved independently: max f·σ, |f| ≤ 1, f_k − f_l ≤ d_kl."""
  m = len(sigma)
  D = np.linalg.norm(centres[:, None] - centres[None], axis=-1)
  pairs = [(k, l) for k in range(m) for l in range(m) if k != l]
  rows = np.array([np.eye(m)[k] - np.eye(m)[l] for k, l in pairs])
  res = optimize.linprog(-sigma, A_ub=rows, b_ub=[D[k, l] for k, l in pairs], bounds=(-1, 1),
                         method="highs")
  return -res.fun


def test_the_lp_beats_every_random_probability_vector_in_the_dual():
  """Six cells in the plane: no Dirichlet-random probability vector is closer to ν in BL norm
  (computed by the dual LP, independent code) than the projection's μ."""
  rng = np.random.default_rng(6)
  centres = rng.uniform(size=(6, 2))
  nu = rng.normal(0.2, 0.2, size=6)
  mu = psmm.bounded_lipschitz_projection(nu, centres)
  ours = _bl_norm_dual_lp(mu - nu, centres)
  others = [_bl_norm_dual_lp(p - nu, centres) for p in rng.dirichlet(np.ones(6) * 0.5, 300)]
  assert ours <= min(others) + 1e-7


def test_psmm_lattice_refuses_a_lattice_too_large_and_rounds_counts_to_n():
  with pytest.raises(ValueError, match="max_cells"):
    psmm.psmm_lattice(1.0, 3, 1e6, max_cells=400)
  lattice = psmm.psmm_lattice(1.0, 2, 100.0)
  assert np.all(np.linalg.norm(np.clip(0, lattice.centres - lattice.side / 2,
                                       lattice.centres + lattice.side / 2), axis=1) <= 1.0)
  counts = psmm.round_to_counts(np.array([0.3333, 0.3333, 0.3334]), 10)
  assert counts.sum() == 10 and counts.min() >= 3


@pytest.mark.slow(reason="psmm's output on the lattice with n rows; PSMM's counts run by default "
                         "in the audits")
def test_psmm_output_lies_on_the_lattice_and_has_n_rows():
  A = jnp.asarray(np.random.default_rng(8).normal(size=(500, 3)) * 0.2, jnp.float32)
  points, released = psmm.psmm(jax.random.key(0), A, epsilon=2.0, radius=1.0, side=0.5)
  assert points.shape == (500, 3)
  centres = released["centres"]
  assert np.all(np.min(np.linalg.norm(points[:, None] - centres[None], axis=-1), axis=1) < 1e-9)


# ------------------------------------------------------------ covariance, mean, helpers


def test_covariance_sensitivity_bound_holds_under_an_adversarial_search():
  """The DERIVED 3/n per entry: random and corner-to-corner replacements never exceed it."""
  rng = np.random.default_rng(9)
  n, d = 5, 3
  worst = 0.0
  for _ in range(4000):
    X = rng.integers(0, 2, size=(n, d)).astype(float) if rng.random() < 0.5 else rng.uniform(
        size=(n, d))
    Xp = X.copy()
    Xp[rng.integers(n)] = rng.integers(0, 2, size=d) if rng.random() < 0.5 else rng.uniform(
        size=d)
    cov = lambda Z: Z.T @ Z / n - np.outer(Z.mean(0), Z.mean(0))    # noqa: E731
    worst = max(worst, np.abs(cov(X) - cov(Xp)).max())
  assert worst <= 3 / n
  assert projection.covariance_sensitivity(n, d, "tight") <= projection.covariance_sensitivity(
      n, d, "paper")


@pytest.mark.slow(reason="the private covariance and mean's accuracy; the choice-of-d' test uses "
                         "them by default")
def test_private_covariance_is_symmetric_and_accurate_at_large_epsilon_n():
  X, _ = _cube_data(5000, 4, 2)
  M_hat = projection.private_centered_covariance(jax.random.key(1), X, epsilon=500.0)
  Xn = np.asarray(X, np.float64)
  exact = np.cov(Xn.T, bias=True)
  assert np.array_equal(M_hat, M_hat.T)
  assert np.abs(M_hat - exact).max() < 0.01
  mean = projection.private_mean(jax.random.key(2), X, epsilon=500.0)
  assert np.abs(mean - Xn.mean(0)).max() < 0.01


def test_snapping_l1_mechanism_counts_the_slack_of_every_coordinate():
  lam_one = M.snapping_parameters(2.0, 1.0, bound=100.0)[0]
  out = M.snapping_l1_mechanism(jax.random.key(0), np.zeros(50), l1_sensitivity=2.0, epsilon=1.0,
                                bound=100.0)
  slack = 2.0**-49 * 100.0 / 2.0
  expected_lambda = 2.0 * (1 + 50 * slack) / 1.0
  assert out.shape == (50,) and np.all(np.abs(out) <= 100.0)
  assert expected_lambda > lam_one                      # more noise than one coordinate's
  with pytest.raises(ValueError):
    M.snapping_l1_mechanism(jax.random.key(0), np.zeros(3), l1_sensitivity=0.0, epsilon=1.0,
                            bound=1.0)


def test_scale_to_unit_cube_and_the_model_generator():
  X = np.array([[0.0, 16.0], [8.0, 4.0], [20.0, -1.0]])
  Y = np.asarray(data.scale_to_unit_cube(X, 0.0, 16.0))
  np.testing.assert_allclose(Y, [[0, 1], [0.5, 0.25], [1, 0]])
  with pytest.raises(ValueError, match="upper > lower"):
    data.scale_to_unit_cube(X, 1.0, 1.0)
  Z, U = data.low_dimensional_cube_data(jax.random.key(0), 500, 6, 2, noise=0.0)
  assert Z.shape == (500, 6) and U.shape == (6, 2)
  centred = np.asarray(Z, np.float64) - 0.5
  residual = centred - centred @ np.asarray(U) @ np.asarray(U).T
  assert np.abs(residual).max() < 1e-5 and np.linalg.norm(centred, axis=1).max() <= 0.3 + 1e-5


def test_wasserstein_1_exact_and_sliced():
  X = np.zeros((3, 2))
  Y = np.ones((5, 2))
  assert metrics.wasserstein_1(X, Y) == pytest.approx((math.sqrt(2), "exact"))
  rng = np.random.default_rng(0)
  A, B = rng.normal(size=(300, 3)), rng.normal(size=(200, 3)) + 0.5
  exact, _ = metrics.wasserstein_1(A, B, method="exact")
  sliced, label = metrics.wasserstein_1(A, B, method="sliced")
  assert label == "sliced" and 0 < sliced <= exact * 1.05
  with pytest.raises(ValueError):
    metrics.wasserstein_1(A, B[:, :2])
  with pytest.raises(ValueError):
    metrics.wasserstein_1(A, B, method="sinkhorn")
