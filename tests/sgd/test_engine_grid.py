"""Every feature of the DP-SGD engine composes with every other (issue 35 §1, §3).

The grid: clipped-gradient function {vmap, ghost} × release map {none, flat basis, per-layer,
two-sided, GEP} × {one device, a 4-device CPU mesh}. For each cell, one step of the plan
(``dp_sgd_plan`` → ``plan.step``) is compared with the path it must agree with, draw for draw
(the same sample key, the same noise key): the ghost cell with the vmap cell, the 4-device cell
with the one-device cell. And for every (clipping, release) the released noise std is σ·Δ·ν:
Δ read from the grad fn (C; GEP per part √2, joint 1), ν from the state's bases.

The default run checks a diagonal (every value of every axis at least once: 5 cells); the rest
run with --run-slow. The 4-device cells run in one subprocess (:func:`helpers.run_on_devices`).
"""

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax.sgd import bases as bases_lib
from dpjax.sgd import noise
from helpers import run_on_devices

CLIPS = ("vmap", "ghost")
RELEASES = ("none", "flat", "layers", "two_sided", "gep")
# The diagonal (default run): each clipping, release and device count at least once.
DIAGONAL = {("vmap", "none", 1), ("ghost", "flat", 1), ("vmap", "layers", 1),
            ("ghost", "two_sided", 1), ("ghost", "gep", 4)}

# Shared by this process and the 4-device subprocess: a two-layer dense model, 203 examples (not
# a multiple of 4: padding runs), sums from ghost or vmap clipping, plans with a given σ.
SETUP = """
import json, math
import jax, jax.numpy as jnp, numpy as np, optax
from dpjax.sgd import bases as bases_lib, gep, ghost, noise, per_example, plan as plan_lib
N, D, H, K = 203, 6, 5, 3
SIGMA, C, C_E, C_R = 1.3, 1.0, 1.0, 0.4
rng = np.random.default_rng(0)
X = (3.0 * rng.normal(size=(N, D))).astype(np.float32)
Y = rng.integers(0, K, N).astype(np.int32)
PARAMS = {"l1": {"w": jnp.asarray(rng.normal(size=(D, H)), jnp.float32), "b": jnp.zeros(H)},
          "l2": {"w": jnp.asarray(rng.normal(size=(H, K)), jnp.float32), "b": jnp.zeros(K)}}
P = sum(x.size for x in jax.tree_util.tree_leaves(PARAMS))
def apply_fn(p, x, *, dense):
  return dense(p["l2"], jnp.tanh(dense(p["l1"], x)))
def example_loss(out, y):
  return optax.softmax_cross_entropy_with_integer_labels(out, y)
def orth(rows, cols, seed):
  return np.linalg.qr(np.random.default_rng(seed).normal(size=(rows, cols)))[0].astype(np.float32)
def basis_kwargs(release):
  if release == "flat":
    return {"basis": orth(P, 4, 1)}
  if release == "none":
    return {}
  two = release == "two_sided"
  w2 = bases_lib.TwoSidedBasis(orth(H, 2, 2), orth(K, 2, 3)) if two else None
  return {"bases": {"l1": {"w": orth(D, 2, 4), "b": None}, "l2": {"w": w2, "b": None}}}
def grad_fn(clip, release):
  if release == "gep":
    if clip == "ghost":
      return ghost.ghost_clipped_grad_sum(apply_fn, example_loss, embedding_clip=C_E,
                                          residual_clip=C_R, joint=False)
    return gep.embedding_residual_grad_sum(ghost.model_loss(apply_fn, example_loss),
                                           embedding_clip=C_E, residual_clip=C_R, joint=False)
  if clip == "ghost":
    return ghost.ghost_clipped_grad_sum(apply_fn, example_loss, clip_norm=C)
  return per_example.clipped_grad_sum(ghost.model_loss(apply_fn, example_loss), clip_norm=C)
def make_plan(clip, release, mesh=None):
  kwargs = basis_kwargs("layers" if release == "gep" else release)
  return plan_lib.dp_sgd_plan(grad_fn(clip, release), num_examples=N, expected_batch_size=40.0,
                              steps=10, key=jax.random.key(7), noise_multiplier=SIGMA,
                              accountant="rdp", mesh=mesh, microbatch_size=16, **kwargs)
def one_step(clip, release, mesh=None):
  plan = make_plan(clip, release, mesh)
  opt = optax.sgd(1.0)
  state = plan.init(PARAMS, opt)
  new, _ = plan.step(PARAMS, state, plan.prepare((X, Y)), opt)
  return [np.asarray(b - a, np.float64).ravel().tolist()
          for a, b in zip(jax.tree_util.tree_leaves(PARAMS), jax.tree_util.tree_leaves(new))]
"""
_NS = {}
exec(SETUP, _NS)                       # noqa: S102  # the same definitions in this process


def _cells(devices):
  return [pytest.param(c, r, marks=() if (c, r, devices) in DIAGONAL else pytest.mark.slow(
      reason="an off-diagonal cell of the engine grid; the default run checks the diagonal"))
          for c in CLIPS for r in RELEASES]


@functools.lru_cache(maxsize=None)
def _step(clip, release):
  return [np.asarray(x) for x in _NS["one_step"](clip, release)]


@pytest.mark.parametrize("clip,release", _cells(1))
def test_one_device_cell_agrees_with_the_vmap_path(clip, release):
  """A ghost cell releases the vmap cell's update (same sample, same noise draws) to float32
  rounding; a vmap cell is finite and moved every leaf the release reaches."""
  got = _step(clip, release)
  assert all(np.all(np.isfinite(x)) for x in got)
  if clip == "ghost":
    for a, b in zip(got, _step("vmap", release)):
      np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
  else:
    assert sum(float(np.abs(x).sum()) > 0 for x in got) >= 3


@functools.lru_cache(maxsize=None)
def _four_device_steps(cells):
  code = SETUP + f"""
assert jax.device_count() == 4
from dpjax.sgd import distributed
mesh = distributed.data_mesh()
print(json.dumps({{f"{{c}}/{{r}}": one_step(c, r, mesh) for c, r in {list(cells)!r}}}))
"""
  return run_on_devices(code)


def _four_cells(slow: bool):
  return tuple(sorted((c, r) for c in CLIPS for r in RELEASES
                      if ((c, r, 4) in DIAGONAL) != slow))


@pytest.mark.parametrize("clip,release", _cells(4))
def test_four_device_cell_agrees_with_one_device(clip, release):
  """The same plan sharded over a 4-device CPU mesh releases the one-device update: the sample
  is drawn once for the N real examples, the per-device sums are added, the noise is drawn once
  from the same key (float32 rounding of the order of additions apart)."""
  slow = (clip, release, 4) not in DIAGONAL
  out = _four_device_steps(_four_cells(slow))[f"{clip}/{release}"]
  for a, b in zip(out, _step(clip, release)):
    np.testing.assert_allclose(np.asarray(a), b, rtol=2e-4, atol=2e-6)


def _release_noise(clip, release, draws=400):
  """``draws`` releases of a zero clipped sum (the noise alone, times L) and the state."""
  plan = _NS["make_plan"](clip, release)
  state = noise.noise_state(plan.init(_NS["PARAMS"], optax.identity()))
  data = plan.prepare((_NS["X"], _NS["Y"]))
  zero = jax.eval_shape(lambda: plan.clipped_sum(_NS["PARAMS"], data, state))
  zero = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), zero)
  batch = plan.batch_selection.expected_batch_size

  @jax.jit
  def one(key):
    out, _ = plan.noise.update(zero, dataclasses.replace(state, key=key), None)
    return jax.tree_util.tree_map(lambda x: x * batch, out)

  return jax.vmap(one)(jax.random.split(jax.random.key(3), draws)), state, plan


def _coefficients(out, state, release):
  """The released coordinates the noise is added to, recovered from the lifted updates:
  identity, ``Vᵀ ravel``, ``Uᵀ W [V]`` per basis leaf; for GEP the embedding of leaves without a
  basis (divided by C_e) and the residual's complement of the first kernel (divided by C_ρ)."""
  leaves = jax.tree_util.tree_leaves(out)
  if release == "none":
    return [np.concatenate([np.asarray(x).reshape(x.shape[0], -1) for x in leaves], axis=1)]
  if release == "flat":
    flat = np.concatenate([np.asarray(x).reshape(x.shape[0], -1) for x in leaves], axis=1)
    return [flat @ np.asarray(state.bases)]
  bases = jax.tree_util.tree_leaves(state.bases, is_leaf=bases_lib.is_basis)
  if release == "gep":
    free = [np.asarray(x).reshape(x.shape[0], -1) / _NS["C_E"]
            for x, U in zip(leaves, bases) if U is None]
    W, U = np.asarray(out["l1"]["w"]), np.asarray(state.bases["l1"]["w"])
    complement = np.eye(U.shape[0]) - U @ U.T          # (I − UUᵀ) W / C_ρ: residual noise only
    # An orthonormal basis of the complement keeps the coordinates' variance σ²Δ².
    Q = np.linalg.svd(complement)[0][:, :U.shape[0] - U.shape[1]]
    return free + [np.einsum("ar,nab->nrb", Q, W).reshape(W.shape[0], -1) / _NS["C_R"]]
  coeffs = []
  for x, U in zip(leaves, bases):
    x = np.asarray(x).reshape(x.shape[0], x.shape[1], -1)
    if U is None:
      coeffs.append(x.reshape(x.shape[0], -1))
    elif isinstance(U, bases_lib.TwoSidedBasis):
      coeffs.append(np.einsum("ar,nab,bs->nrs", np.asarray(U.left), x,
                              np.asarray(U.right)).reshape(x.shape[0], -1))
    else:
      coeffs.append(np.einsum("ar,nab->nrb", np.asarray(U), x).reshape(x.shape[0], -1))
  return coeffs


def _std_cells():
  return [pytest.param(c, r, marks=() if (c == "vmap") != (r == "gep") else pytest.mark.slow(
      reason="the noise std of the other clipping path (the same transform, Δ read from its "
             "grad fn); the default run checks each release once, GEP's √2 on the ghost path"))
          for c in CLIPS for r in RELEASES]


@pytest.mark.parametrize("clip,release", _std_cells())
def test_released_noise_std_is_sigma_delta_nu(clip, release):
  """The state's std is round_up(σ·Δ·ν) with Δ the grad fn's bound (C = 1; GEP per part √2)
  and ν the bases' bound (1 for none and GEP), and 400 releases of a zero sum have that std in
  every released coordinate (χ² bound on the pooled variance, and no coordinate's std off by
  more than 25%)."""
  out, state, plan = _release_noise(clip, release)
  delta = math.sqrt(2.0) if release == "gep" else _NS["C"]
  assert plan.grad_fn.l2_norm_bound == pytest.approx(delta)
  nu = {"flat": lambda: bases_lib.basis_norm_bound(state.bases),
        "layers": lambda: bases_lib.bases_norm_bound(state.bases),
        "two_sided": lambda: bases_lib.bases_norm_bound(state.bases)}.get(release, lambda: 1.0)()
  expected = _NS["SIGMA"] * delta * max(1.0, nu)
  assert float(state.noise_std) == pytest.approx(expected, rel=1e-6)
  assert float(state.noise_std) >= np.float32(expected)            # rounded up, never down
  coeffs = np.concatenate(_coefficients(out, state, release), axis=1)
  pooled = float(np.mean(coeffs ** 2))
  dof = coeffs.size
  assert abs(pooled / expected ** 2 - 1) < 6 / math.sqrt(dof / 2), (pooled, expected ** 2)
  per_coordinate = np.sqrt(np.mean(coeffs ** 2, axis=0)) / expected
  assert np.all(np.abs(per_coordinate - 1) < 0.25)


def test_the_grid_is_the_issues_grid():
  """The grid's axes and its default diagonal: every value of every axis at least once."""
  assert len(CLIPS) * len(RELEASES) * 2 == 20
  for axis, values in ((0, CLIPS), (1, RELEASES), (2, (1, 4))):
    assert {cell[axis] for cell in DIAGONAL} == set(values)
  assert json.loads(json.dumps(sorted(DIAGONAL)))                  # a plain, printable set
