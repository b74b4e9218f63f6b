"""Privacy audit of one DP-SGD step on 4 (simulated) devices (docs/algorithms.md §6.6).

The step is the library's building blocks as a data-parallel user composes them:
:func:`dpjax.sgd.shard_examples` places the rows on a 4-device mesh,
:func:`dpjax.sgd.sharded_poisson_clipped_sum` sums the clipped gradients per device and adds the
sums across devices, and :func:`dpjax.sgd.dp_gaussian_noise` adds the noise once. The canary
design is ``_canary_step`` of test_mechanism_audits.py: a linear model whose canary row has
gradient norm ≥ C along e_0, full batch (q = 1), add/remove-one. It runs in a subprocess
(``helpers.run_on_devices``) so the suite keeps one device; the negative control (σ/3 under the
claim for σ) shows the audit has power on the same path.
"""

import pytest

from dpjax import accounting
from helpers import print_audit_table, run_on_devices

pytestmark = pytest.mark.audit
RESULTS = {}

_AUDIT = """
import json
import jax, jax.numpy as jnp, numpy as np
from dpjax import audit, sgd
assert jax.device_count() == 4
d, C = 8, 1.0
mesh = sgd.data_mesh()
X = jnp.concatenate([jnp.eye(d)[None, 0] * 5.0, 0.1 * jnp.ones((5, d))])
loss = lambda w, ex: ex[1] * jnp.dot(w, ex[0])       # ex[1] = 0 removes the row
grad_sum = sgd.clipped_grad_sum(loss, clip_norm=C)
def step_for(sigma):
  def step(key, member):
    k_sample, k_noise = jax.random.split(key)
    data, n = sgd.shard_examples((np.asarray(X), np.ones(6, np.float32)), mesh)
    data = (data[0], jnp.pad(member, (0, data[1].shape[0] - n)))
    summed = sgd.sharded_poisson_clipped_sum(grad_sum, jnp.zeros(d), data, k_sample,
                                             num_examples=n, sampling_prob=1.0,
                                             microbatch_size=2, mesh=mesh)
    tx = sgd.dp_gaussian_noise(clip_norm=C, noise_multiplier=sigma, expected_batch_size=1.0,
                               key=k_noise)
    out, _ = tx.update(summed, tx.init(jnp.zeros(d)))
    return out[0]
  return jax.jit(step)      # one compiled program: the audit's eager vmap of 4-device ops is slow
with_canary = jnp.ones(6)
without = with_canary.at[0].set(0.0)
out = {}
for name, sigma in (("claim", 1.0), ("control", 1.0 / 3.0)):
  rep = audit.audit(jax.random.key(29), step_for(sigma), without, with_canary, delta=1e-5,
                    trials=TRIALS)
  out[name] = float(rep.epsilon_lower_bound)
print(json.dumps(out))
"""


def _check(name, claimed, lb, trials):
  RESULTS[name] = (claimed, lb, trials)
  assert lb <= claimed, f"{name}: empirical ε ≥ {lb:.3f} > claimed {claimed}"


def test_dp_sgd_step_on_four_devices(audit_trials):
  n = audit_trials(5_000, 100_000)
  bounds = run_on_devices(f"TRIALS = {n}\n" + _AUDIT, devices=4)
  claimed = accounting.dpsgd_epsilon(1.0, 1.0, 1, 1e-5)
  _check("DP-SGD step on 4 devices", claimed, bounds["claim"], n)
  # Negative control (not in EXPECTED): σ/3 under the claim for σ must be flagged.
  assert bounds["control"] > claimed, (
      f"the audit missed σ/3 on 4 devices: empirical ε ≥ {bounds['control']:.3f}")


@pytest.fixture(scope="module", autouse=True)
def _print_table():
  yield
  print_audit_table(sorted(RESULTS.items()))
