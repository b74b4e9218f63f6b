"""Every public key/data function runs under ``jax.jit`` and under ``jax.vmap`` over keys (the
vmap compiled as one program, ``jit(vmap(f))``: batched tracers throughout, one compilation).

Issue 11 §1/§2: host-side validation never touches traced values, results are pytrees whose
static metadata (ε, δ, the neighboring relation, public info) is not a leaf, and the host-side
float-safe releases (``dpjax._host.host_call``) give the same answer eagerly, under ``jit`` and
per row of a ``vmap``. ``poisson_microbatches`` is host-only by design (its output size is the
sampled batch size) and is absent here.
"""

import contextlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpjax
from dpjax import ashtiani_liaw as AL
from dpjax import classic as CL
from dpjax import coinpress as CP
from dpjax import linalg as L
from dpjax import mechanisms as M
from dpjax import sgd as G
from dpjax.sgd import per_example, sampling, sources
from dpjax import subspace as S
from dpjax import synthetic as SY
from dpjax.ashtiani_liaw import populous_mean

_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.normal(size=(200, 6)) * np.array([3, 2, 1, .01, .01, .01]), jnp.float32)
X8 = jnp.asarray(_rng.normal(size=(2000, 2)) @ _rng.normal(size=(2, 5)), jnp.float32)
XL = jnp.asarray(_rng.normal(size=(30000, 3)) * np.array([1., 2., 3.]), jnp.float32)
VEC = jnp.asarray(_rng.normal(size=(5,)), jnp.float32)
IVEC = jnp.arange(5, dtype=jnp.int32)
SCORES = jnp.asarray([10., 3., 1., 0.], jnp.float32)
ITEMS = jnp.asarray(_rng.integers(0, 3, size=(200, 2)), jnp.int32)
UNIT = jnp.asarray(_rng.uniform(size=(64, 1)), jnp.float32)
UNIT2 = jnp.asarray(_rng.uniform(size=(20, 3)), jnp.float32)
PARAMS = {"w": jnp.zeros((3,))}
DATA = (jnp.asarray(_rng.normal(size=(64, 3)), jnp.float32),
        jnp.asarray(_rng.normal(size=(64,)), jnp.float32))


def _loss(p, ex):
  x, y = ex
  return (x @ p["w"] - y) ** 2


# Releases computed on the host (host_call): eager, jit and vmap must agree bit for bit.
HOST = {
    "gaussian_mechanism": (lambda k, x: M.gaussian_mechanism(k, x, sensitivity=1., epsilon=1.,
                                                             delta=1e-5), VEC),
    "discretized_gaussian_mechanism": (lambda k, x: M.discretized_gaussian_mechanism(
        k, x, sensitivity=1., noise_multiplier=1.), VEC),
    "laplace_mechanism": (lambda k, x: M.laplace_mechanism(k, x, sensitivity=1., epsilon=1.), VEC),
    "truncated_laplace_mechanism": (lambda k, x: M.truncated_laplace_mechanism(
        k, x, sensitivity=1., epsilon=1., delta=1e-5), VEC),
    "snapping_mechanism": (lambda k, x: M.snapping_mechanism(k, x, sensitivity=1., epsilon=1.),
                           VEC),
    "discrete_gaussian": (lambda k, _: M.discrete_gaussian(k, (3,), sigma=2.), VEC),
    "truncated_discrete_laplace": (lambda k, _: M.truncated_discrete_laplace(k, (3,), scale=2,
                                                                             bound=10), VEC),
    "snapping_l1_mechanism": (lambda k, x: M.snapping_l1_mechanism(
        k, x, l1_sensitivity=1., epsilon=1., bound=100.), VEC),
    "l2_laplace_mechanism": (lambda k, x: M.l2_laplace_mechanism(k, x, sensitivity=1.,
                                                                 epsilon=1.), VEC),
    "private_centered_covariance": (lambda k, _: SY.private_centered_covariance(
        k, np.asarray(UNIT2), epsilon=1.), VEC),
}

# Everything else: runs under jit and vmap, is deterministic per key.
TRACED = {
    "gaussian_mechanism(secure=False)": (lambda k, x: M.gaussian_mechanism(
        k, x, sensitivity=1., epsilon=1., delta=1e-5, secure=False), VEC),
    "laplace_mechanism(secure=False)": (lambda k, x: M.laplace_mechanism(
        k, x, sensitivity=1., epsilon=1., secure=False), VEC),
    "truncated_laplace_mechanism(secure=False)": (lambda k, x: M.truncated_laplace_mechanism(
        k, x, sensitivity=1., epsilon=1., delta=1e-5, secure=False), VEC),
    "discrete_laplace_mechanism": (lambda k, x: M.discrete_laplace_mechanism(
        k, x, sensitivity=1, epsilon=1.), IVEC),
    "exponential_mechanism": (lambda k, s: M.exponential_mechanism(k, s, sensitivity=1.,
                                                                   epsilon=1.), SCORES),
    "gap_max": (lambda k, s: M.gap_max(k, s, epsilon=1., delta=1e-5), SCORES),
    "gap_max_core": (lambda k, s: M.gap_max_core(k, s, M.gap_max_parameters(1., 1e-5)), SCORES),
    "stable_histogram": (lambda k, it: M.stable_histogram(k, it, epsilon=1., delta=1e-5), ITEMS),
    "gaussian_noise": (lambda k, _: M.gaussian_noise(k, (3,), sigma=1.), VEC),
    "laplace_noise": (lambda k, _: M.laplace_noise(k, (3,), scale=1.), VEC),
    "truncated_laplace": (lambda k, _: M.truncated_laplace(k, (3,), sensitivity=1., epsilon=1.,
                                                           delta=1e-5), VEC),
    "discrete_laplace": (lambda k, _: M.discrete_laplace(k, (3,), scale=2.), VEC),
    "dpase": (lambda k, x: S.dpase(k, x, epsilon=4., delta=1e-5, k=2, gamma=0.01), X8),
    "dpaseb": (lambda k, x: S.dpaseb(k, x, epsilon=4., delta=1e-5, k=2, alpha=0.5, num_blocks=3,
                                     gamma=0.01), X8),
    "dpese": (lambda k, x: S.dpese(k, x, epsilon=4., delta=1e-5, k=2), X8[:60]),
    "analyze_gauss": (lambda k, x: S.analyze_gauss(k, x, epsilon=1., delta=1e-5, k=2,
                                                   clip_norm=1.), X),
    "pca_subspace": (lambda k, x: S.pca_subspace(x, k=2), X),
    "al_subspace": (lambda k, x: AL.al_subspace(k, x, epsilon=4., delta=1e-5), X8),
    "al_covariance": (lambda k, x: AL.al_covariance(k, x, epsilon=20., delta=1e-6,
                                                    min_group_size=50, num_groups=300), XL),
    "learn_covariance": (lambda k, x: AL.learn_covariance(k, x, epsilon=20., delta=1e-6,
                                                          min_group_size=50, num_groups=150), XL),
    "ppme_mean": (lambda k, x: AL.ppme_mean(k, x, epsilon=4., delta=1e-5, num_groups=100,
                                            radius=10.), X8),
    "robust_mean": (lambda k, x: AL.robust_mean(k, x, epsilon=4., delta=1e-5, corruption=0.01,
                                                num_groups=100, radius=10.), X8),
    "robust_covariance": (lambda k, x: AL.robust_covariance(
        k, x, epsilon=20., delta=1e-6, corruption=0.01, min_group_size=50, num_groups=300), XL),
    "covariance_mask": (lambda k, s: AL.covariance_mask(k, s, eta=0.1), jnp.eye(4)),
    "closeness_matrix": (lambda k, x: AL.closeness_matrix(x[:4, :3, None] * x[:4, None, :3]
                                                          + jnp.eye(3), 0.5), X),
    "neighbour_counts": (lambda k, x: AL.neighbour_counts(x[:4, :3, None] * x[:4, None, :3]
                                                          + jnp.eye(3), 0.5), X),
    "euclidean_neighbour_counts": (lambda k, x: AL.euclidean_neighbour_counts(x, 1.0), X),
    "coinpress_mean": (lambda k, x: CP.coinpress_mean(k, x, epsilon=2., delta=1e-5,
                                                      center=jnp.zeros(5), radius=10.), X8),
    "coinpress_covariance": (lambda k, x: CP.coinpress_covariance(k, x, epsilon=2., delta=1e-5,
                                                                  kappa=100.), X8),
    "private_gradient_subspace": (lambda k, d: G.private_gradient_subspace(
        k, _loss, PARAMS, d, k=1, epsilon=4., delta=1e-5, clip_norm=1., gamma=0.01), DATA),
    "public_gradient_subspace": (lambda k, d: G.public_gradient_subspace(_loss, PARAMS, d, k=1),
                                 DATA),
    "poisson_mask": (lambda k, _: sampling.poisson_mask(k, 10, 0.5), VEC),
    "clip_per_example": (lambda k, d: per_example.clip_per_example({"g": d[0]}, 1.0), DATA),
    "clipped_grad_sum": (lambda k, d: G.clipped_grad_sum(_loss, clip_norm=1.)(
        PARAMS, d, jnp.ones(64)), DATA),
    "flat_per_example_grads": (lambda k, d: sources.flat_per_example_grads(_loss, PARAMS, d), DATA),
    "orthonormal_basis": (lambda k, _: L.orthonormal_basis(k, 5, 2), VEC),
    "approximate_subspace_data": (lambda k, _: dpjax.data.approximate_subspace_data(
        k, 50, 5, 2, gamma=0.1)[0], VEC),
    "exact_subspace_data": (lambda k, _: dpjax.data.exact_subspace_data(k, 50, 5, 2)[0], VEC),
    "low_dimensional_cube_data": (lambda k, _: dpjax.data.low_dimensional_cube_data(
        k, 50, 5, 2)[0], VEC),
    "pmm_core": (lambda k, y: SY.pmm_core(k, y, SY.pmm_parameters(64, 1, epsilon=1., depth=4)),
                 UNIT),
    "l2_laplace_noise": (lambda k, _: M.l2_laplace_noise(k, 3, 2.), VEC),
    "mod_sulq": (lambda k, x: CL.mod_sulq(k, x, epsilon=1., delta=1e-5, k=2, clip=True), X),
    "ppca": (lambda k, x: CL.ppca(k, x, epsilon=1., k=1, clip=True), X),
    "ppca(k=2)": (lambda k, x: CL.ppca(k, x, epsilon=1., k=2, num_sweeps=2, clip=True), X),
    "output_perturbation": (lambda k, d: CL.output_perturbation(
        k, d[0], jnp.sign(d[1]), epsilon=1., clip=True), DATA),
    "objective_perturbation": (lambda k, d: CL.objective_perturbation(
        k, d[0], jnp.sign(d[1]), epsilon=1., clip=True), DATA),
    "one_vs_rest": (lambda k, d: CL.one_vs_rest(
        k, d[0], (d[1] > 0).astype(jnp.int32), classes=[0, 1], epsilon=1., clip=True), DATA),
    "psmm_noisy_counts": (lambda k, a: SY.psmm.psmm_noisy_counts(
        k, a, SY.psmm.psmm_lattice(1., 1, 1., side=0.5), 1., 1.), UNIT),
}
# Full suite only (issue 11 §8: the default run under 5 minutes). Each of these functions' modules
# keeps its own default tests; the default audits run most of them (or their wrappers) under
# jit(vmap) over trials (tests/audit). Issue 33: mod_sulq runs under jit(vmap) over keys in
# tests/classic/test_pca.py, gap_max under vmap in the audits and tests/mechanisms/test_gap_max.py,
# l2_laplace_noise under vmap over keys and β in tests/classic/test_erm.py.
SLOW = {"al_covariance", "learn_covariance", "robust_covariance", "dpaseb",
        "private_gradient_subspace", "dpase", "approximate_subspace_data",
        "low_dimensional_cube_data", "ppca(k=2)", "output_perturbation", "one_vs_rest",
        "robust_mean", "coinpress_covariance", "dpese", "ppca", "pmm_core", "al_subspace",
        "objective_perturbation", "ppme_mean", "stable_histogram",
        "discrete_laplace_mechanism", "gap_max_core", "coinpress_mean", "psmm_noisy_counts",
        "mod_sulq", "gap_max", "l2_laplace_noise"}

# Float64 learners (dpjax._host.float64): traceable with JAX's x64 mode on only (a float32 trace
# raises TypeError, tested in their modules), so traced here inside `jax.enable_x64(True)`.
X64 = {"coinpress_mean", "coinpress_covariance", "mod_sulq", "ppca", "ppca(k=2)",
       "output_perturbation", "objective_perturbation", "one_vs_rest"}
X64 |= {"al_subspace", "al_covariance", "learn_covariance", "ppme_mean", "robust_mean",
        "robust_covariance"}

# Orchestrated on the host (dpjax._host.eager_only: steps whose shapes depend on released
# values): tracing raises TypeError naming the traceable pieces.
EAGER_ONLY = {
    "learn_gaussian": (lambda k, x: AL.learn_gaussian(
        k, x, epsilon=20., delta=1e-6, covariance_kwargs=dict(min_group_size=50)), XL),
}

KEYS = jax.random.split(jax.random.key(7), 2)


@pytest.fixture(autouse=True)
def _quiet_accounting():
  logging.disable(logging.WARNING)       # dp_accounting's RDP order warnings
  yield
  logging.disable(logging.NOTSET)


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _assert_same(a, b, exact):
  la, lb = _leaves(a), _leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert x.shape == y.shape and x.dtype == y.dtype
    if exact:
      np.testing.assert_array_equal(x, y)
    else:
      np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(HOST))
def test_host_releases_agree_eagerly_under_jit_and_vmap(name):
  f, x = HOST[name]
  batched = jax.vmap(lambda k: f(k, x))(KEYS)
  jitted = jax.jit(f)
  for i, key in enumerate(KEYS):
    traced = jitted(key, x)
    # Eagerly the release is NumPy in full precision; traced, the same value in JAX's canonical
    # dtype (host_call's contract): equal after that cast.
    eager = np.asarray(f(key, x)).astype(traced.dtype)
    _assert_same(eager, traced, exact=True)
    _assert_same(traced, batched[i], exact=True)


_COSTLY = pytest.mark.slow(reason="jit(vmap) of a costly function (issue 11 §8); the audits vmap "
                                   "most of these by default")


@pytest.mark.parametrize("name", [pytest.param(n, marks=_COSTLY) if n in SLOW else n
                                  for n in sorted(TRACED)])
def test_public_functions_run_under_jit_and_vmap(name):
  f, x = TRACED[name]
  with jax.enable_x64(True) if name in X64 else contextlib.nullcontext():
    # jax.jit(f)(key, x) traces f with the data as a traced argument: eval_shape is that trace
    # without compiling a program that jit(vmap(f)) below compiles and runs anyway.
    abstract = jax.eval_shape(f, KEYS[0], x)
    # The data closed over (concrete inside the trace): host checks must not stage jnp operations.
    jax.make_jaxpr(lambda k: f(k, x))(KEYS[0])
    run = jax.jit(jax.vmap(lambda k: f(k, x)))
    batched = run(KEYS)
    _assert_same(batched, run(KEYS), exact=True)                       # deterministic per key
    # Static metadata stays static: the batched result has the traced tree structure.
    assert jax.tree_util.tree_structure(batched) == jax.tree_util.tree_structure(abstract)
    for a, b in zip(jax.tree_util.tree_leaves(abstract), _leaves(batched)):
      assert b.shape == (len(KEYS),) + a.shape and b.dtype == a.dtype
    if isinstance(abstract, dpjax.DPResult):
      assert abstract.ok.dtype == jnp.bool_ and abstract.ok.shape == ()
      eager = f(KEYS[0], x)
      assert type(eager) is type(abstract)
      _assert_same(eager, f(KEYS[0], x), exact=True)
      assert (eager.epsilon, eager.delta, eager.neighboring, eager.info) == (
          abstract.epsilon, abstract.delta, abstract.neighboring, abstract.info)


@pytest.mark.parametrize("name", sorted(EAGER_ONLY))
def test_eager_only_learners_refuse_tracing(name):
  f, x = EAGER_ONLY[name]
  with pytest.raises(TypeError, match=f"{name} is orchestrated on the host.*call it eagerly"):
    jax.eval_shape(f, KEYS[0], x)
  with pytest.raises(TypeError, match="orchestrated on the host"):
    jax.vmap(lambda k: f(k, x))(KEYS)


@pytest.mark.slow(reason="vmap(dpase) returning its result; the default TRACED cases vmap other "
                         "learners' results")
def test_results_vmap_over_keys_with_the_relation_as_metadata():
  """The issue's example: ``vmap(lambda k: dpase(k, X, ...))(keys)`` (str leaves broke it)."""
  out = jax.vmap(lambda k: S.dpase(k, X8, epsilon=4., delta=1e-5, k=2, gamma=0.01))(KEYS)
  assert out.basis.shape == (2, 5, 2) and out.ok.shape == (2,)
  assert out.neighboring is not None and out.epsilon == 4.0


@pytest.mark.filterwarnings("ignore:ppme_mean")
def test_an_epsilon_sweep_does_not_recompile():
  """Public scalars are traced arguments of the jitted cores: ε changes, the program does not."""
  run = populous_mean._ppme_mean_run
  AL.ppme_mean(KEYS[0], X8, epsilon=4., delta=1e-5, num_groups=100, radius=10.)
  before = run._cache_size()
  for eps in (1.0, 2.0, 8.0):
    AL.ppme_mean(KEYS[0], X8, epsilon=eps, delta=1e-5, num_groups=100, radius=10.)
  assert run._cache_size() == before


@pytest.mark.slow(reason="a DPASEB ε/δ sweep at fixed t does not recompile; the ppme_mean sweep "
                         "runs by default")
def test_a_dpaseb_epsilon_sweep_at_fixed_shapes_does_not_recompile():
  """With t fixed (num_subsets), ε and δ only move traced scalars of DPASEB's jitted core."""
  from dpjax.subspace import boosted
  kw = dict(k=2, alpha=0.5, num_blocks=3, gamma=0.01, num_subsets=8)
  S.dpaseb(KEYS[0], X8, epsilon=4., delta=1e-5, **kw)
  before = boosted._dpaseb._cache_size()
  for eps, delta in ((3.0, 1e-5), (6.0, 1e-6)):
    S.dpaseb(KEYS[0], X8, epsilon=eps, delta=delta, **kw)
  assert boosted._dpaseb._cache_size() == before
