"""The Ashtiani–Liaw learners' tracing contracts (issue 33 §2: host callbacks run plain NumPy).

* ``al_subspace``, ``al_covariance``, ``learn_covariance``, ``ppme_mean`` (and the robust
  wrappers) compute in float64 with JAX (``dpjax._host.float64``): traceable with x64 on, with the
  eager call's output per key (discrete parts exactly, floats up to rounding); a float32 trace
  raises ``TypeError``; a non-finite traced ``X`` gives ⊥.
* ``learn_gaussian`` is orchestrated on the host (``eager_only``): tracing raises ``TypeError``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import ashtiani_liaw as AL
from dpjax.ashtiani_liaw.exact_subspace import nearest_projection_basis

# The eager references compile per shape and static argument (seconds each); these are the
# shapes and arguments of eager calls in test_exact_subspace (al_subspace), test_gaussian_learner
# (learn_covariance's AL step at d = 3) and test_populous_mean (ppme_mean), whose programs a
# process running those tests too reuses.
KEYS = jax.random.split(jax.random.key(3), 2)
_rng = np.random.default_rng(0)
LOW_RANK = _rng.normal(size=(2000, 2)) @ _rng.normal(size=(2, 10))        # rank 2 in R^10
ROWS = _rng.normal(size=(20364, 3)) * np.array([1.0, 3.0, 10.0])
COV = dict(epsilon=20., delta=1e-6, num_groups=111, min_group_size=183)  # learn_covariance's AL
COV_ROWS = ROWS[:111 * 183]                                              # step calibration
MEAN_ROWS = 1e3 + _rng.normal(size=(230 * 50, 5))

LEARNERS = {
    "al_subspace": (lambda k, x: AL.al_subspace(k, x, epsilon=1., delta=1e-6), LOW_RANK),
    "al_covariance": (lambda k, x: AL.al_covariance(k, x, **COV), COV_ROWS),
    "learn_covariance": (lambda k, x: AL.learn_covariance(k, x, refine_accuracy=None, **COV),
                         ROWS),
    "ppme_mean": (lambda k, x: AL.ppme_mean(k, x, epsilon=10., delta=1e-5, num_groups=230,
                                            radius=10.), MEAN_ROWS),
}
SLOW = {"learn_covariance"}


def _params(names):
  slow = pytest.mark.slow(reason="learn_covariance (AL step + CoinPress) traced; the default run "
                                 "traces al_covariance")
  return [pytest.param(n, marks=slow) if n in SLOW else n for n in sorted(names)]


@pytest.mark.parametrize("name", sorted(LEARNERS))
def test_a_float32_trace_raises_type_error(name):
  f, x = LEARNERS[name]
  with pytest.raises(TypeError, match=f"{name} computes in float64.*enable_x64"):
    jax.jit(f)(KEYS[0], jnp.asarray(x, jnp.float32))
  with pytest.raises(TypeError, match=f"{name} computes in float64"):
    jax.vmap(lambda k: f(k, x))(KEYS)                       # traced key, concrete data


@functools.cache
def _traced(name):
  """``jit(vmap(learner))`` over keys, the data traced too: one program per learner (seconds to
  compile), shared by the two tests below."""
  return jax.jit(jax.vmap(LEARNERS[name][0], in_axes=(0, None)))


@pytest.mark.parametrize("name", _params(LEARNERS))
def test_traced_with_x64_matches_the_eager_call_per_key(name):
  f, x = LEARNERS[name]
  with jax.enable_x64(True):
    batched = jax.tree.map(np.asarray, _traced(name)(KEYS, jnp.asarray(x)))
  for i, key in enumerate(KEYS):
    traced = jax.tree.map(lambda a: a[i], batched)
    eager = f(key, x)                                       # x64 off: float64 NumPy outputs
    assert bool(eager.ok) and bool(traced.ok)
    if name == "al_subspace":
      assert int(traced.released["rank"]) == int(eager.released["rank"]) == 2
      np.testing.assert_allclose(traced.basis, np.asarray(eager.basis, traced.basis.dtype),
                                 atol=1e-10)
      continue
    assert traced.estimate.dtype == np.float64
    # The unmasked statistic may differ by rounding (XLA fuses the traced program differently);
    # the released noise is the same per key. PPME's release is on its grid: at most one step.
    atol = eager.info["grid"] if name == "ppme_mean" else 0.0
    np.testing.assert_allclose(traced.estimate, eager.estimate, rtol=1e-8, atol=atol)


@pytest.mark.parametrize("name", _params(LEARNERS))
def test_a_non_finite_traced_dataset_gives_bottom(name):
  _, x = LEARNERS[name]
  bad = np.array(x)
  bad[3, 1] = np.nan
  with jax.enable_x64(True):
    res = _traced(name)(KEYS, jnp.asarray(bad))
  assert not np.any(np.asarray(res.ok))
  outputs = (res.basis, res.released["rank"]) if name == "al_subspace" else (res.estimate,)
  for out in outputs:
    assert not np.any(np.asarray(out))


def test_learn_gaussian_is_eager_only_and_names_its_traceable_steps():
  X = _rng.normal(size=(2616, 2))
  pattern = ("learn_gaussian is orchestrated on the host.*call it eagerly.*al_subspace, "
             "learn_covariance, ppme_mean and coinpress_mean")
  with pytest.raises(TypeError, match=pattern):
    jax.jit(lambda k: AL.learn_gaussian(k, X, epsilon=20., delta=1e-6,
                                        batch_sizes=(100, 100, 1208, 1208)))(KEYS[0])


def test_nearest_projection_basis_keeps_eigenvalues_above_one_half_in_decreasing_order():
  rng = np.random.default_rng(1)
  Q, _ = np.linalg.qr(rng.normal(size=(5, 5)))
  w = np.array([0.9, 0.2, 1.1, 0.51, 0.49])
  P = (Q * w) @ Q.T + 1e-12 * rng.normal(size=(5, 5))      # not exactly symmetric
  with jax.enable_x64(True):
    basis, rank = jax.jit(nearest_projection_basis)(jnp.asarray(P))
  basis = np.asarray(basis)
  assert int(rank) == 3
  np.testing.assert_array_equal(basis[:, 3:], 0.0)         # zero-padded to (d, d)
  for j, i in enumerate((2, 0, 3)):                          # eigenvalues 1.1, 0.9, 0.51
    assert abs(abs(basis[:, j] @ Q[:, i]) - 1.0) < 1e-9
  with jax.enable_x64(True):
    assert int(nearest_projection_basis(jnp.zeros((3, 3)))[1]) == 0   # ⊥: rank 0
