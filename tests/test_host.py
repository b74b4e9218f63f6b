"""Host callbacks run plain NumPy (issue 33 §2): no JAX compiles or runs inside a
``jax.pure_callback`` of dpjax, and the float64 stages run without one.

How it is checked: each traced release is compiled ahead of time (``jit(f).lower(...).compile()``),
JAX's caches are cleared, and the compiled program runs while every XLA compilation is counted.
Any JAX operation inside the callback would have to compile again (its caches are empty), so the
count must be 0. A negative control (a callback that calls ``jnp``) is caught.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import _host
from dpjax import ashtiani_liaw as AL
from helpers import count_compilations
from dpjax import classic as CL
from dpjax import coinpress as CP
from dpjax import mechanisms as M
from dpjax import subspace as S

KEY = jax.random.key(0)
VEC = jnp.asarray(np.random.default_rng(0).normal(size=(5,)), jnp.float32)
X8 = jnp.asarray(np.random.default_rng(1).normal(size=(12, 2)) @ np.random.default_rng(2).normal(
    size=(2, 4)), jnp.float32)                   # 12 rows in a plane of R^4

_ROWS = jnp.asarray(np.random.default_rng(3).normal(size=(1600, 3)), jnp.float32)

# Every public release whose traced form is a host callback (one entry per host function).
CALLBACKS = {
    "discretized_gaussian_mechanism": (lambda k, x: M.discretized_gaussian_mechanism(
        k, x, sensitivity=1., noise_multiplier=1.), VEC),
    "truncated_laplace_mechanism": (lambda k, x: M.truncated_laplace_mechanism(
        k, x, sensitivity=1., epsilon=1., delta=1e-5), VEC),
    "snapping_mechanism": (lambda k, x: M.snapping_mechanism(k, x, sensitivity=1., epsilon=1.),
                           VEC),
    "discrete_gaussian": (lambda k, _: M.discrete_gaussian(k, (3,), sigma=2.), VEC),
    "truncated_discrete_laplace": (lambda k, _: M.truncated_discrete_laplace(k, (3,), scale=2,
                                                                             bound=10), VEC),
    "l2_laplace_mechanism": (lambda k, x: M.l2_laplace_mechanism(k, x, sensitivity=1.,
                                                                 epsilon=1.), VEC),
    "dpese": (lambda k, x: S.dpese(k, x, epsilon=4., delta=1e-5, k=2), X8),
    "coinpress_mean": (lambda k, x: CP.coinpress_mean(k, x, epsilon=2., delta=1e-5,
                                                      center=jnp.zeros(4), radius=10.), X8),
    "coinpress_covariance": (lambda k, x: CP.coinpress_covariance(
        k, x, epsilon=2., delta=1e-5, kappa=100., steps=2), X8),
    "analyze_gauss": (lambda k, x: S.analyze_gauss(k, x, epsilon=1., delta=1e-5, k=2,
                                                   clip_norm=1.), X8),
    "mod_sulq": (lambda k, x: CL.mod_sulq(k, x, epsilon=1., delta=1e-5, k=2, clip=True), X8),
    "ppme_mean": (lambda k, x: AL.ppme_mean(k, x, epsilon=4., delta=1e-5, num_groups=500,
                                            radius=10.), _ROWS[:1000, :3]),
    "learn_covariance": (lambda k, x: AL.learn_covariance(
        k, x, epsilon=20., delta=1e-6, min_group_size=10, num_groups=150, refine_accuracy=None),
                         _ROWS[:, :2]),
}
# Float64 learners (dpjax._host.float64) trace with x64 on only: compiled and run inside it.
X64 = {"ppme_mean", "learn_covariance", "coinpress_mean", "coinpress_covariance", "mod_sulq"}


def _compiled(f, x):
  return jax.jit(f).lower(KEY, x).compile()


def test_no_jax_runs_inside_a_host_callback(monkeypatch):
  """Every release in CALLBACKS, compiled ahead of time, runs with 0 compilations after JAX's
  caches are cleared; the negative control (a callback that calls jnp) compiles. One test, so
  that the suite's worker loses its caches once."""
  def bad(key, x):
    return _host.host_call(lambda rng, v: np.asarray(jnp.sin(v)),
                           jax.ShapeDtypeStruct(x.shape, np.float32), key, x)

  programs = {"negative control": (_compiled(bad, VEC), VEC)}
  for name, (f, x) in CALLBACKS.items():
    with jax.enable_x64(True) if name in X64 else contextlib.nullcontext():
      programs[name] = (_compiled(f, x), x)
  counts = {name: count_compilations(lambda: compiled(KEY, x), monkeypatch)
            for name, (compiled, x) in programs.items()}
  assert counts.pop("negative control") > 0
  assert counts == dict.fromkeys(CALLBACKS, 0), counts


def test_host_rng_is_deterministic_per_key_and_reads_every_word_of_the_key():
  a = _host.host_rng(jax.random.key(3)).integers(0, 2**63, 4)
  assert np.array_equal(a, _host.host_rng(jax.random.key(3)).integers(0, 2**63, 4))
  data = np.asarray(jax.random.key_data(jax.random.key(3)))
  assert np.array_equal(a, _host.host_rng(data).integers(0, 2**63, 4))       # the callback's view
  assert np.array_equal(a, _host.host_rng(jax.random.PRNGKey(3)).integers(0, 2**63, 4))
  for word in range(data.size):                   # a change in any word gives another stream
    other = data.copy()
    other.flat[word] ^= 1
    assert not np.array_equal(a, _host.host_rng(other).integers(0, 2**63, 4))


def test_host_call_gives_numpy_eagerly_and_the_canonical_dtype_traced():
  def release(rng, x):
    return x.astype(np.float64) + rng.standard_normal(x.shape), np.int64(2**40)
  shapes = (jax.ShapeDtypeStruct((5,), np.float64), jax.ShapeDtypeStruct((), np.int64))
  eager = _host.host_call(release, shapes, KEY, VEC)
  assert isinstance(eager[0], np.ndarray) and eager[0].dtype == np.float64
  traced = jax.jit(lambda k, x: _host.host_call(release, shapes, k, x))(KEY, VEC)
  assert traced[0].dtype == jnp.result_type(float)
  np.testing.assert_array_equal(np.asarray(traced[0]), eager[0].astype(traced[0].dtype))
  assert int(traced[1]) == min(2**40, int(jnp.iinfo(traced[1].dtype).max))   # saturated, not wrapped


def test_float64_runs_eagerly_stages_under_x64_and_refuses_a_float32_trace():
  def fn(key, x):
    return x.sum() * 1e-300 * 1e300 + jax.random.normal(key, (), x.dtype)     # 1e-300: float64 only
  eager = _host.float64("fn", fn, KEY, VEC)
  assert isinstance(eager, np.ndarray) and eager.dtype == np.float64 and np.isfinite(eager)
  with jax.enable_x64(True):
    traced = jax.jit(lambda k, x: _host.float64("fn", fn, k, x))(KEY, VEC)
  assert traced.dtype == jnp.float64
  np.testing.assert_allclose(np.asarray(traced), eager, rtol=1e-12)
  with pytest.raises(TypeError, match="fn computes in float64.*enable_x64"):
    jax.jit(lambda k, x: _host.float64("fn", fn, k, x))(KEY, VEC)


def test_eager_only_refuses_tracing_and_names_the_cores():
  _host.eager_only("learner", KEY, VEC)                       # concrete: nothing raised
  with pytest.raises(TypeError, match="learner is orchestrated on the host.*core_a"):
    jax.jit(lambda k: _host.eager_only("learner", k, VEC, cores="core_a"))(KEY)


def test_host_call_keeps_float64_under_an_x64_context_when_xla_runs_it_on_a_worker_thread():
  """``with jax.enable_x64(True):`` is thread-local, and XLA:CPU runs this program's callback on
  a worker thread (an expensive op before it), where JAX would cast float64 inputs to float32
  and refuse float64 outputs: host_call carries 64-bit values as uint32 words."""
  X = np.random.default_rng(0).normal(size=(3000, 400))

  def f(key, X):
    y = jnp.mean(jnp.tanh(X @ X.T), axis=0)[:4]
    return _host.host_call(lambda rng, v: (v, np.asarray(v.dtype == np.float64)),
                           (jax.ShapeDtypeStruct((4,), np.float64),
                            jax.ShapeDtypeStruct((), np.bool_)), key, y)

  with jax.enable_x64(True):
    out, saw_float64 = jax.jit(f)(KEY, X)
    expected = jnp.mean(jnp.tanh(jnp.asarray(X) @ jnp.asarray(X).T), axis=0)[:4]
  assert out.dtype == jnp.float64 and bool(saw_float64)
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-12)


def test_a_vmapped_host_call_gives_the_same_output_per_key_over_several_batch_axes():
  calls = []

  def release(rng, x):
    calls.append(1)
    return x.astype(np.float64) + rng.standard_normal(x.shape)

  shape = jax.ShapeDtypeStruct((5,), np.float64)
  f = lambda k: _host.host_call(release, shape, k, VEC)          # noqa: E731
  keys = jax.random.split(KEY, 6).reshape(2, 3)
  batched = jax.jit(jax.vmap(jax.vmap(f)))(keys)                   # two batch axes
  assert batched.shape == (2, 3, 5) and len(calls) == 6           # each example once
  for i in range(2):
    for j in range(3):
      np.testing.assert_array_equal(np.asarray(batched[i, j]),
                                    f(keys[i, j]).astype(batched.dtype))
  assert jax.vmap(f)(keys[:0, 0]).shape == (0, 5)                  # an empty batch
