"""dpjax.sgd.dp_aggregate, the drop-in for optax.contrib.differentially_private_aggregate (issue
50 §6): optax's own tests run against it, and it agrees with optax's transform."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpjax import sgd
from dpjax.sgd import per_example

_privacy_test = pytest.importorskip("optax.contrib._privacy_test")


class TestOptaxsOwnTests(_privacy_test.DifferentiallyPrivateAggregateTest):
  """optax's DifferentiallyPrivateAggregateTest with its transform replaced by dp_aggregate.

  One difference is by design: dpjax clips at C(1 − ρ) with the factor rounded down (ρ ≈ 1.5e-6
  here, ``per_example.clip_margin``) so that no term's norm exceeds C in floating point; optax's
  clipping test asserts its exact ``g / max(1, ‖g‖/C)`` at rtol 2e-7, so it is rerun below at
  rtol = 2ρ."""

  def setUp(self):
    super().setUp()
    self._saved = _privacy_test._privacy
    _privacy_test._privacy = types.SimpleNamespace(
        differentially_private_aggregate=sgd.dp_aggregate)

  def tearDown(self):
    _privacy_test._privacy = self._saved
    super().tearDown()



# optax's parameterised clipping test (test_clipping_norm0, 1, ...): rerun below at rtol 2ρ.
for _name in [n for n in dir(TestOptaxsOwnTests) if n.startswith("test_clipping_norm")]:
  setattr(TestOptaxsOwnTests, _name,
          lambda self: self.skipTest("rerun at the clip margin: test_optax_clipping_test_at_..."))


@pytest.mark.parametrize("clip", [0.5, 10.0, 20.0, 40.0, 80.0])
def test_optax_clipping_test_at_the_clip_margin(clip):
  """optax's test_clipping_norm (example i's gradients full of i), at rtol 2ρ."""
  size = 8
  params = {"key_a": (jnp.zeros((2, 3, 4)), jnp.zeros([])), "key_b": jnp.zeros((6, 7))}
  grads = jax.tree.map(lambda p: jnp.moveaxis(jnp.arange(size) * jnp.ones(p.shape + (size,)),
                                              -1, 0), params)
  norms = jnp.sqrt(sum(jnp.sum(g.reshape(size, -1) ** 2, axis=1)
                       for g in jax.tree.leaves(grads)))
  expected = jnp.mean(jnp.arange(size) / jnp.maximum(norms / clip, 1.0))
  tx = sgd.dp_aggregate(l2_norm_clip=clip, noise_multiplier=0.0, key=42)
  state = tx.init(params)
  rho = per_example.clip_margin(jnp.float32, 67)
  for _ in range(3):
    updates, state = jax.jit(tx.update)(grads, state, params)
    for leaf in jax.tree.leaves(updates):
      np.testing.assert_allclose(leaf, jnp.broadcast_to(expected, leaf.shape), rtol=2 * rho)


def test_same_release_as_optax_and_every_term_within_the_clip_norm():
  """Without noise both transforms give the same mean of clipped gradients (to the clip margin);
  with noise the std is σC/B; a NaN example contributes 0 (optax's would poison the sum)."""
  rng = np.random.default_rng(0)
  grads = {"w": jnp.asarray(rng.standard_normal((16, 5, 3)) * 3, jnp.float32),
           "b": jnp.asarray(rng.standard_normal((16, 3)), jnp.float32)}
  params = jax.tree.map(lambda g: g[0], grads)
  ours = sgd.dp_aggregate(1.0, 0.0, key=jax.random.key(1))
  theirs = optax.contrib.differentially_private_aggregate(1.0, 0.0, key=jax.random.key(1))
  a, _ = ours.update(grads, ours.init(params), params)
  b, _ = theirs.update(grads, theirs.init(params), params)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads)
  c, _ = ours.update(bad, ours.init(params), params)
  clean = jax.tree.map(lambda g: g[1:], grads)
  d, _ = ours.update(clean, ours.init(params), params)
  for x, y in zip(jax.tree.leaves(c), jax.tree.leaves(d)):
    np.testing.assert_allclose(x * 16, y * 15, rtol=1e-6, atol=1e-6)
  noisy = sgd.dp_aggregate(2.0, 3.0, key=jax.random.key(2))
  big = {"w": jnp.zeros((4, 200, 100))}
  out, state = noisy.update(big, noisy.init({"w": big["w"][0]}))
  assert abs(float(jnp.std(out["w"])) - 6.0 / 4) < 0.05 * 6.0 / 4
  out2, _ = noisy.update(big, state)
  assert not np.allclose(out["w"], out2["w"])               # the key moves on every update


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="l2_norm_clip"):
    sgd.dp_aggregate(0.0, 1.0, key=0)
  with pytest.raises(ValueError, match="noise_multiplier"):
    sgd.dp_aggregate(1.0, -1.0, key=0)
  with pytest.raises(ValueError, match="not both"):
    sgd.dp_aggregate(1.0, 1.0, key=0, seed=1)
  with pytest.warns(UserWarning, match="key"):
    sgd.dp_aggregate(1.0, 1.0)
  tx = sgd.dp_aggregate(1.0, 1.0, seed=3)
  with pytest.raises(ValueError, match="leading batch axis"):
    tx.update({"w": jnp.zeros((3,)), "b": jnp.zeros(())}, tx.init({"w": 0.0, "b": 0.0}))
