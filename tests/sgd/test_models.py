"""The plan works on the params pytrees users have: plain dicts, Flax NNX (``nnx.split``), Flax
Linen (``model.init``) and Equinox (``eqx.partition``) (issue 35 §1).

For each model family one plan step is checked against what it must be, independently of the
model: with the sampling rate 1 every example is in the batch, so the clipped sum is
``Σ_i clip_C(∇ loss_i)`` computed here by ``vmap(grad)`` and an explicit clip; the released noise
has std σΔν (Δ from the grad fn, ν from the bases) and lies in the bases' span. Flax and
Equinox are test dependencies only (``pip install dpjax[test]``); dpjax does not import them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpjax
from dpjax.sgd import noise

N, D, H, K = 24, 6, 5, 3
C, SIGMA = 0.5, 1.7


def _data():
  rng = np.random.default_rng(0)
  return (jnp.asarray(3.0 * rng.normal(size=(N, D)), jnp.float32),
          jnp.asarray(rng.integers(0, K, N), jnp.int32))


def _dict_model():
  rng = np.random.default_rng(1)
  params = {"l1": {"w": jnp.asarray(rng.normal(size=(D, H)), jnp.float32), "b": jnp.zeros(H)},
            "l2": {"w": jnp.asarray(rng.normal(size=(H, K)), jnp.float32), "b": jnp.zeros(K)}}

  def logits(p, x):
    return jnp.tanh(x @ p["l1"]["w"] + p["l1"]["b"]) @ p["l2"]["w"] + p["l2"]["b"]
  return params, logits, "kernel_in_out"


def _nnx_model():
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Sequential(nnx.Linear(D, H, rngs=nnx.Rngs(0)), nnx.tanh,
                         nnx.Linear(H, K, rngs=nnx.Rngs(1)))
  graphdef, params = nnx.split(model, nnx.Param)
  return params, lambda p, x: nnx.merge(graphdef, p)(x), "kernel_in_out"


def _linen_model():
  nn = pytest.importorskip("flax.linen")

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(K)(jnp.tanh(nn.Dense(H)(x)))
  model = MLP()
  params = model.init(jax.random.key(0), jnp.zeros(D))["params"]
  return params, lambda p, x: model.apply({"params": p}, x), "kernel_in_out"


def _equinox_model():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(D, K, H, depth=1, activation=jnp.tanh, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_array)
  return params, lambda p, x: eqx.combine(p, static)(x), "weight_out_in"


MODELS = {"dict": _dict_model, "flax_nnx": _nnx_model, "flax_linen": _linen_model,
          "equinox": _equinox_model}


def _families(default):
  """Every family; those not in ``default`` run with --run-slow (each compiles its own step)."""
  return [f if f in default else pytest.param(f, marks=pytest.mark.slow(
      reason=f"the {f} params pytree; the default run covers {', '.join(default)}"))
          for f in MODELS]


def _loss(logits):
  def loss(params, example):
    x, y = example
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y)
  return loss


def _first_layer_basis(layout, rank=2):
  """An input-side basis of the first weight: ``U (D, r)`` for a kernel ``(in, out)`` (Flax,
  dicts); for Equinox's ``(out, in)`` weight the input side is the right factor."""
  U = jnp.asarray(np.linalg.qr(np.random.default_rng(5).normal(size=(D, rank)))[0], jnp.float32)
  if layout == "kernel_in_out":
    return lambda path, w: U if w.ndim == 2 and w.shape[0] == D else None
  return lambda path, w: (dpjax.sgd.TwoSidedBasis(jnp.eye(H), U)
                          if w.ndim == 2 and w.shape == (H, D) else None)


def _plan(grad_fn, **kwargs):
  return dpjax.sgd.dp_sgd_plan(grad_fn, num_examples=N, expected_batch_size=N, steps=3,
                               noise_multiplier=SIGMA, key=jax.random.key(3), **kwargs)


def _expected_sum(loss, params, data):
  grads = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, data)
  leaves = jax.tree_util.tree_leaves(grads)
  norms = jnp.sqrt(sum(jnp.sum(g.reshape(N, -1) ** 2, axis=1) for g in leaves))
  factor = jnp.minimum(1.0, C / norms)
  return jax.tree_util.tree_map(lambda g: jnp.einsum("n,n...->...", factor, g), grads)


@pytest.mark.parametrize("family", _families(("flax_nnx",)))
def test_a_plan_step_is_the_clipped_sum_plus_noise_of_std_sigma_delta(family):
  params, logits, _ = MODELS[family]()
  loss, data = _loss(logits), _data()
  plan = _plan(dpjax.sgd.clipped_grad_sum(loss, clip_norm=C))
  opt = optax.sgd(1.0)
  opt_state = plan.init(params, opt)
  got = plan.clipped_sum(params, data, opt_state)
  want = _expected_sum(loss, params, data)
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(params)
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)

  assert float(noise.noise_state(opt_state).noise_std) == pytest.approx(SIGMA * C, rel=1e-6)
  new, _ = plan.step(params, opt_state, data, opt)
  released = jax.tree_util.tree_map(lambda a, b: (a - b) * N, params, new)   # sum + noise
  residual = np.concatenate([np.ravel(r - w) for r, w in zip(jax.tree_util.tree_leaves(released),
                                                              jax.tree_util.tree_leaves(want))])
  # Every coordinate of the noise is N(0, (σC)²): its sample std over the p coordinates.
  assert np.std(residual) == pytest.approx(SIGMA * C, rel=0.5)
  assert np.all(np.isfinite(residual))


@pytest.mark.parametrize("family", _families(("equinox",)))
def test_per_layer_bases_confine_the_first_layers_release_to_the_input_span(family):
  """A first-layer input basis selected by the leaf's shape (``bases_like``): that leaf's
  release (sum + noise) lies in the span, every other leaf gets full noise."""
  params, logits, layout = MODELS[family]()
  loss, data = _loss(logits), _data()
  bases = dpjax.sgd.bases_like(params, _first_layer_basis(layout))
  flat_bases = jax.tree_util.tree_leaves(
      bases, is_leaf=lambda x: x is None or isinstance(x, dpjax.sgd.TwoSidedBasis))
  chosen = [b for b in flat_bases if b is not None]
  assert len(chosen) == 1                                   # exactly the first weight
  plan = _plan(dpjax.sgd.clipped_grad_sum(loss, clip_norm=C), bases=bases)
  opt = optax.sgd(1.0)
  new, _ = plan.step(params, plan.init(params, opt), data, opt)
  U = np.asarray(chosen[0] if layout == "kernel_in_out" else chosen[0].right)
  flat_new = jax.tree_util.tree_leaves(new)
  flat_old = jax.tree_util.tree_leaves(params)
  projected = 0
  for old, upd, basis in zip(flat_old, flat_new, flat_bases):
    step = np.asarray(old - upd)
    if basis is None:
      continue
    projected += 1
    M = step if layout == "kernel_in_out" else step.T       # input axis first
    np.testing.assert_allclose(U @ (U.T @ M), M, atol=1e-5)  # in span(U) on the input side
    assert np.linalg.norm(M) > 1e-3
  assert projected == 1


@pytest.mark.slow(reason="GEP on Flax NNX and Equinox params; the default run checks GEP on "
                         "dicts (test_engine_grid) and these pytrees with the other releases")
@pytest.mark.parametrize("family", ["flax_nnx", "equinox"])
def test_gep_with_trajectory_bases_runs_on_the_models_params(family):
  """GEP's embedding/residual split over per-layer trajectory bases of the params pytree:
  the released update has the params' structure, finite, noise std σ·√2 per part."""
  params, logits, _ = MODELS[family]()
  loss, data = _loss(logits), _data()
  grad_fn = dpjax.sgd.embedding_residual_grad_sum(loss, embedding_clip=C, residual_clip=C / 2,
                                                  joint=False)
  plan = _plan(grad_fn, bases=dpjax.sgd.trajectory_bases(params, 2))
  opt = optax.sgd(1.0)
  opt_state = plan.init(params, opt)
  assert float(noise.noise_state(opt_state).noise_std) == pytest.approx(
      SIGMA * np.sqrt(2), rel=1e-6)
  new, opt_state = plan.step(params, opt_state, data, opt)
  assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(params)
  assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(new))
  moved = jax.tree_util.tree_map(lambda a, b: a - b, params, new)
  opt_state = plan.update_bases(opt_state, bases=dpjax.sgd.trajectory_bases(moved, 2))
  new2, _ = plan.step(new, opt_state, data, opt)
  assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(new2))
