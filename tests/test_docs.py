"""The README examples and the notebooks run as written (so they cannot rot), and the README's
DP-SGD examples are private as written."""

import ast
import dataclasses
import functools
import inspect
import json
import math
import pathlib
import re
import warnings
from typing import Any

import jax
import numpy as np
import pytest

from dpjax import accounting
from dpjax.sgd.plan import DPSGDPlan

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _run(source: str, name: str) -> dict:
  namespace: dict = {"__name__": name}
  exec(compile(source, name, "exec"), namespace)  # noqa: S102 - our own documentation
  return namespace


# --- README code blocks, found by their section's heading ---------------------------------------

_HEADING = re.compile(r"^#{2,3} .*$", re.M)
_PYTHON = re.compile(r"```python\n(.*?)```", re.S)


def _section_block(text: str, match: re.Match) -> str | None:
  """The first python block after the heading ``match``, if it comes before the next heading."""
  code = _PYTHON.search(text, match.end())
  following = _HEADING.search(text, match.end())
  if code is None or (following is not None and following.start() < code.start()):
    return None
  return code.group(1)


def _block(text: str, heading: str) -> str:
  """The first python block of the README section whose ``## ``/``### `` heading starts with
  ``heading`` (never a block of a later section)."""
  assert heading.startswith(("## ", "### ")), heading
  matches = [m for m in _HEADING.finditer(text) if m.group(0).startswith(heading)]
  assert len(matches) == 1, f"README.md: {len(matches)} headings start with {heading!r}"
  code = _section_block(text, matches[0])
  assert code is not None, f"README.md: no python block under {heading!r}"
  return code


def _python_sections(text: str) -> dict[str, str]:
  """{heading: code} for every README section with its own python block."""
  sections = {}
  for m in _HEADING.finditer(text):
    code = _section_block(text, m)
    if code is not None:
      sections[m.group(0)] = code
  return sections


_LOOP_A = "### (a) Plain DP-SGD"
_LOOP_B = "### (b) Per-layer subspace noise"
_LOOP_C = "### (c) GEP with a trajectory basis"
_OWN_LOOP = (_LOOP_A, _LOOP_B, _LOOP_C)
_SGD_SECTIONS = [h for h, code in _python_sections(README.read_text()).items() if "sgd" in code]


def test_readme_blocks_are_found_by_heading():
  text = README.read_text()
  assert "def train_step" in _block(text, _LOOP_A)
  assert "public_input_basis" in _block(text, _LOOP_B)
  assert "embedding_residual_grad_sum" in _block(text, _LOOP_C)
  assert "## DP-SGD in your own loop" not in _python_sections(text)   # its blocks are under (a)-(c)
  assert all(any(h.startswith(p) for h in _SGD_SECTIONS) for p in _OWN_LOOP)
  with pytest.raises(AssertionError):
    _block("## A\ntext\n## B\n```python\nx = 1\n```\n", "## A")  # B's block is not A's


# --- Budgets recomputed independently -----------------------------------------------------------

def _independent_epsilon(budget) -> float:
  """ε of the DP-SGD steps by ``dp_accounting``'s own PLD accountant (the plans' default), from
  the budget's public numbers (σ, q, T) at its SGD δ, plus its subspace share (basic
  composition): an independent recomputation of what the budget claims."""
  import dp_accounting
  sub = budget.subspace_event                 # a Gaussian release is composed in by the PLD
  extra = () if isinstance(sub, (dp_accounting.NoOpDpEvent, accounting.EpsilonDeltaDpEvent)) \
      else (sub,)
  return _pld_epsilon(float(budget.noise_multiplier), float(budget.sampling_prob),
                      int(budget.steps), float(budget.sgd_delta), extra) + budget.subspace_epsilon


@functools.lru_cache(maxsize=None)         # the own-loop tests share one (σ, q, T, δ): ~2 s each
def _pld_epsilon(sigma: float, q: float, steps: int, delta: float, extra: tuple = ()) -> float:
  import dp_accounting
  event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      q, dp_accounting.GaussianDpEvent(sigma)), steps)
  accountant = dp_accounting.pld.PLDAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  return accountant.compose(dp_accounting.ComposedDpEvent([*extra, event])).get_epsilon(delta)


def _assert_budget(budget, *, epsilon, delta, sampling_prob, steps):
  """The guarantee the example claims, for the sampling and steps written in it."""
  assert budget.neighboring.name == "ADD_OR_REMOVE_ONE"
  assert budget.sampling_prob == pytest.approx(sampling_prob) and budget.steps == steps
  assert budget.delta <= delta * (1 + 1e-9)
  assert budget.sgd_delta + budget.subspace_delta <= delta * (1 + 1e-9)
  independent = _independent_epsilon(budget)        # PLD, the plans' default accountant
  assert independent <= epsilon * (1 + 1e-3), independent
  assert budget.epsilon == pytest.approx(independent, rel=0.02)


# --- Spies on the DP-SGD entry points the README examples call ----------------------------------

class _Stop(Exception):
  """Raised by a spy once it has recorded what the check needs (ends the example early)."""


def _row_bytes(data) -> set[bytes] | None:
  """The examples of a data pytree (rows of its first leaf, the inputs) as float64 bytes; None
  for a traced value (recorded where it is concrete instead)."""
  x = jax.tree_util.tree_leaves(data)[0]
  if isinstance(x, jax.core.Tracer):
    return None
  x = np.asarray(x, np.float64)
  return {row.tobytes() for row in x.reshape(len(x), -1)}


# σ calibrated by PLD for the own-loop examples' (ε, δ, q, T), rounded UP (a larger σ only
# lowers ε): the default run pins it to skip PLD's search (10-15 s here); the as-written (slow)
# tests calibrate for real and check the pin against it.
_PINNED_SIGMA = {(2.0, 1e-5, 250 / 7_500, 60): 0.98953}


class _Spy:
  """Wraps ``dpjax.sgd.dp_sgd_plan`` and the functions that take public or private rows.

  The plan a README example gets is the real one (:func:`dpjax.sgd.dp_sgd_plan` with the
  example's arguments) as a :class:`_SpyPlan`: its ``clipped_sum`` records the key and the sum of
  every call (host callbacks, also inside the example's own ``jit``), its noise transform records
  what goes in and what comes out, and its ``step``/``run``/``prepare`` record the private rows.

  Args:
    steps: the plan's ``steps`` as the example sees it (its loop length), at most the planned T
      (the budget still covers T); None: as written.
    pin: skip PLD's calibration for the README's targets (:data:`_PINNED_SIGMA`).
    train: False: ``step``/``run`` return their inputs and ``train_dp_sgd`` stops the example
      (only the data flow is checked).
  """

  def __init__(self, monkeypatch, *, steps: int | None = None, pin: bool = False,
               train: bool = True):
    import dpjax
    self.steps, self.train = steps, train
    self.plans: list = []                  # (real plan, the plan the example got)
    self.sums: list = []                   # (key bytes, leaves of the clipped sum)
    self.noised: list = []                 # (leaves in, leaves out)
    self.treedefs: dict = {}
    self.public: list[set] = []
    self.private: list[set] = []
    self.private_releases: list = []       # (rows, epsilon, delta) of private bases
    sgd = dpjax.sgd
    real_plan = sgd.dp_sgd_plan

    def spying_plan(grad_fn, **kwargs):
      plan = real_plan(grad_fn, **kwargs)
      fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
      fields["noise"] = self._noise(plan.noise)
      if steps is not None:
        fields["spy_steps"] = min(steps, plan.steps)
      proxy = _SpyPlan(**fields, spy=self)
      self.plans.append((plan, proxy))
      return proxy

    monkeypatch.setattr(sgd, "dp_sgd_plan", spying_plan)
    for module in (sgd, sgd.sources):
      for name, arg, kind in (("public_input_basis", "public_inputs", "public"),
                              ("public_gradient_subspace", "public_data", "public"),
                              ("private_input_basis", "X", "private"),
                              ("private_gradient_subspace", "data", "private")):
        monkeypatch.setattr(module, name, self._rows_spy(getattr(sgd.sources, name), arg, kind))
    real_train = sgd.train_dp_sgd
    signature = inspect.signature(real_train)

    def spying_train(*args, **kwargs):
      bound = signature.bind(*args, **kwargs)
      self.saw("private", bound.arguments["data"])
      if bound.arguments.get("public_data") is not None:
        self.saw("public", bound.arguments["public_data"])
      if not train:
        raise _Stop
      return real_train(*args, **kwargs)

    monkeypatch.setattr(sgd, "train_dp_sgd", spying_train)
    if pin:
      from dpjax import accounting
      real_calibrate = accounting.calibrate_noise_multiplier

      def pinned(target_epsilon, target_delta, sampling_prob, steps, *, accountant="rdp",
                 tuning=None, batch_selection=None):
        for (e, d, q, t), sigma in _PINNED_SIGMA.items():
          if (accountant == "pld" and tuning is None and steps == t
              and all(math.isclose(a, b, rel_tol=1e-9) for a, b in
                      ((target_epsilon, e), (target_delta, d), (sampling_prob, q)))):
            return sigma
        return real_calibrate(target_epsilon, target_delta, sampling_prob, steps,
                              accountant=accountant, tuning=tuning,
                              batch_selection=batch_selection)

      monkeypatch.setattr(accounting, "calibrate_noise_multiplier", pinned)

  def saw(self, kind: str, data) -> None:
    rows = _row_bytes(data)
    if rows is not None:
      (self.public if kind == "public" else self.private).append(rows)

  def _rows_spy(self, real, arg: str, kind: str):
    signature = inspect.signature(real)

    def spy(*args, **kwargs):
      bound = signature.bind(*args, **kwargs)
      self.saw(kind, bound.arguments[arg])
      out = real(*args, **kwargs)
      if kind == "private" and "epsilon" in bound.arguments:
        self.private_releases.append((_row_bytes(bound.arguments[arg]),
                                      bound.arguments["epsilon"], bound.arguments["delta"]))
      return out

    return spy

  def _noise(self, real):
    import optax

    def update(updates, state, params=None):
      out, state = real.update(updates, state, params)
      self.treedefs["in"] = jax.tree_util.tree_structure(updates)
      self.treedefs["out"] = jax.tree_util.tree_structure(out)
      jax.debug.callback(lambda i, o: self.noised.append((i, o)),
                         jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(out),
                         ordered=True)
      return out, state

    return optax.GradientTransformation(real.init, update)

  def overlap(self) -> set[bytes]:
    """Rows seen both as public and as private."""
    public = set().union(*self.public)
    private = set().union(*self.private)
    return public & private


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class _SpyPlan(DPSGDPlan):
  """The real plan with recording hooks (see :class:`_Spy`); hashed by identity."""
  spy: Any = None
  spy_steps: int | None = None
  __hash__ = object.__hash__
  __eq__ = object.__eq__

  @property
  def steps(self) -> int:
    """T as the example sees it (its loop length; the budget still covers the planned T)."""
    return self.config.steps if self.spy_steps is None else self.spy_steps

  def clipped_sum(self, params, data, opt_state):
    from dpjax.sgd import noise
    self.spy.saw("private", data)
    if not self.spy.train:                        # the data flow only: zeros of the sum's shape
      shapes = jax.eval_shape(super().clipped_sum, params, data, opt_state)
      return jax.tree_util.tree_map(lambda s: jax.numpy.zeros(s.shape, s.dtype), shapes)
    out = super().clipped_sum(params, data, opt_state)
    key = noise.step_keys(noise.noise_state(opt_state).key).sample      # the sample's key
    jax.debug.callback(lambda k, s: self.spy.sums.append((np.asarray(k).tobytes(), s)),
                       jax.random.key_data(key), jax.tree_util.tree_leaves(out), ordered=True)
    return out

  def prepare(self, data):
    self.spy.saw("private", data)
    return super().prepare(data)

  def step(self, params, opt_state, data, optimizer):
    self.spy.saw("private", data)
    if not self.spy.train:
      return params, opt_state
    return super().step(params, opt_state, data, optimizer)

  def run(self, params, opt_state, data, optimizer, **kwargs):
    self.spy.saw("private", data)
    if not self.spy.train:
      return params, opt_state
    return super().run(params, opt_state, data, optimizer, **kwargs)


# --- The README's "DP-SGD in your own loop" -----------------------------------------------------

_SIMPLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return, ast.Import,
           ast.ImportFrom)


def _dp_statements(code: str) -> int:
  """Statements marked ``# DP``; every line of a marked statement must be marked, and every
  marked line must belong to a marked simple statement."""
  lines = code.splitlines()
  marked = {i + 1 for i, line in enumerate(lines) if line.rstrip().endswith("# DP")}
  count, covered = 0, set()
  for node in ast.walk(ast.parse(code)):
    if isinstance(node, _SIMPLE):
      span = set(range(node.lineno, node.end_lineno + 1))
      if span & marked:
        assert span <= marked, f"a statement marked # DP only in part: {lines[node.lineno - 1]}"
        count += 1
        covered |= span
  assert marked <= covered, [lines[i - 1] for i in sorted(marked - covered)]
  return count


@pytest.mark.parametrize("heading", _OWN_LOOP)
def test_readme_own_loop_dp_line_counts(heading):
  """Each own-loop example has as many ``# DP`` statements as its heading says, and at most 5
  (issue 35 §2)."""
  text = README.read_text()
  title = next(m.group(0) for m in _HEADING.finditer(text) if m.group(0).startswith(heading))
  claimed = int(re.search(r"\((\d+) DP-specific lines\)", title).group(1))
  assert _dp_statements(_block(text, heading)) == claimed <= 5


def test_dp_statement_count_can_fail():
  assert _dp_statements("a = 1  # DP\nb = f(1,  # DP\n      2)  # DP\nc = 3\n") == 2
  with pytest.raises(AssertionError):
    _dp_statements("b = f(1,  # DP\n      2)\n")           # a multi-line statement half marked
  with pytest.raises(AssertionError):
    _dp_statements("for i in x:  # DP\n    pass\n")         # a marked line outside any statement


_PRINTED = re.compile(r"accuracy ([0-9.]+) at \(ε, δ\) = \(([0-9.]+), ([0-9.e+-]+)\), "
                      r"add/remove-one")


def _noise_draws(plan, state, spy) -> np.ndarray:
  """The noise the plan's transform added on the coordinates it noises without a basis
  (``out·L − in``, GEP: ``out·L/C_e − embedding``), over every recorded step."""
  L = plan.batch_selection.expected_batch_size
  out_def = spy.treedefs["out"]
  bases = ([None] * out_def.num_leaves if state.release == "full"
           else out_def.flatten_up_to(state.bases))
  draws = []
  for ins, outs in spy.noised:
    scale = 1.0
    if state.release == "embedding_residual":
      ins = jax.tree_util.tree_leaves(spy.treedefs["in"].unflatten(ins)["embedding"])
      scale = 1.0 / plan.grad_fn.embedding_clip
    for g, o, basis in zip(ins, outs, bases, strict=True):
      if basis is None:
        draws.append((np.asarray(o, np.float64) * L * scale - np.asarray(g, np.float64)).ravel())
  return np.concatenate(draws)


def _nu(state) -> float:
  """The release map's norm bound, recomputed from the bases (float64): 1 without bases and for
  GEP (its sensitivity comes from clipping the split), max(1, max ‖U‖₂ or ‖U‖₂‖V‖₂) per layer."""
  from dpjax.sgd import bases as bases_lib
  if state.release != "layers":
    return 1.0
  norm = lambda b: np.linalg.norm(np.asarray(b, np.float64), 2)  # noqa: E731
  norms = [norm(b.left) * norm(b.right) if isinstance(b, bases_lib.TwoSidedBasis) else norm(b)
           for b in jax.tree_util.tree_leaves(state.bases, is_leaf=bases_lib.is_basis)
           if b is not None]
  return max([1.0] + norms)


def _check_private_as_written(spy, ns, printed: str, *, steps_run: int):
  """The example drew ``steps_run`` fresh Poisson samples, every one went through the plan's
  noise with std σΔν, and its printed (ε, δ) covers the run by dp_accounting's own count."""
  from dpjax.sgd import noise
  (plan, proxy), = spy.plans
  assert proxy.steps == steps_run <= plan.steps == plan.budget.steps
  assert len(spy.sums) == len(spy.noised) == steps_run              # one sum per step, all noised
  assert len({key for key, _ in spy.sums}) == steps_run              # fresh keys
  for (_, summed), (noised_in, _) in zip(spy.sums, spy.noised):      # each sum, as it came out
    assert len(summed) == len(noised_in)
    assert all(np.array_equal(a, b) for a, b in zip(summed, noised_in))
  state = noise.noise_state(ns["opt_state"])
  delta_bound = plan.grad_fn.l2_norm_bound
  want = plan.noise_multiplier * delta_bound * _nu(state)            # σΔν
  assert float(state.noise_std) >= want and float(state.noise_std) == pytest.approx(want,
                                                                                     rel=1e-5)
  draws = _noise_draws(plan, state, spy)
  assert draws.size >= 150
  assert np.std(draws) == pytest.approx(float(state.noise_std), rel=5 / math.sqrt(2 * draws.size))
  assert abs(np.mean(draws)) < 5 * float(state.noise_std) / math.sqrt(draws.size)
  match, = _PRINTED.findall(printed)
  accuracy, epsilon, delta = map(float, match)
  assert epsilon == float(f"{plan.epsilon:.2f}") and delta == float(f"{plan.delta:g}")
  assert plan.neighboring.name == "ADD_OR_REMOVE_ONE"
  assert plan.budget.sampling_prob == pytest.approx(250 / 7_500)
  assert plan.budget.delta <= delta * (1 + 1e-9)
  assert _independent_epsilon(plan.budget) <= epsilon * (1 + 1e-9)   # ε ≤ the printed ε
  assert not spy.overlap()
  assert set().union(*spy.private) == _row_bytes(ns["X"]) and len(ns["X"]) == 7_500
  return accuracy, state


def _run_own_loop(heading, monkeypatch, capsys, *, steps=None, pin=False, replace=()):
  text = README.read_text()
  code = _block(text, heading)
  for old, new in replace:
    assert old in code, old
    code = code.replace(old, new)
  spy = _Spy(monkeypatch, steps=steps, pin=pin)
  ns = _run(code, f"README.md#{heading}")
  jax.effects_barrier()
  return spy, ns, capsys.readouterr().out


_FEW_STEPS = 4


@pytest.mark.parametrize("heading", [
    _LOOP_A, *(pytest.param(h, marks=pytest.mark.slow(
        reason="(b), (c) on 4 steps; the default run checks (a)'s loop, and (b)'s and (c)'s "
               "release maps in test_engine_grid")) for h in (_LOOP_B, _LOOP_C))])
def test_readme_own_loop_example_is_private(heading, monkeypatch, capsys):
  """Each "DP-SGD in your own loop" example as written (its loop cut to 4 of its T steps,
  σ pinned to its PLD calibration; the slow test below runs all T): every step draws a fresh
  Poisson sample, every clipped sum goes through the plan's noise with std σΔν, the plan's T covers
  the loop, and dp_accounting's own count of (σ, q, T) gives at most the printed ε."""
  spy, ns, printed = _run_own_loop(heading, monkeypatch, capsys, steps=_FEW_STEPS, pin=True)
  _, state = _check_private_as_written(spy, ns, printed, steps_run=_FEW_STEPS)
  assert state.release == {_LOOP_A: "full", _LOOP_B: "layers",
                           _LOOP_C: "embedding_residual"}[heading]


@pytest.mark.parametrize("replace", [
    pytest.param((("tx = plan.transform(opt)", "tx = optax.chain(optax.identity(), opt)"),),
                 id="no-noise"),
    pytest.param((("opt_state = plan.init(params, opt)", "opt_state = first = plan.init(params, opt)"),
                  ("plan.clipped_sum(params, (X, y), opt_state)",
                   "plan.clipped_sum(params, (X, y), first)")), id="one-state",
                 marks=pytest.mark.slow(reason="a second negative control of the spy; the "
                                               "default run keeps the no-noise one"))])
def test_own_loop_privacy_check_detects_a_broken_loop(replace, monkeypatch, capsys):
  """Negative controls: (a) with its sums not noised (the state's keys never move on), or every
  step's sample drawn from the first state (the one-key slip's form now that the plan owns the
  keys), fails the check above."""
  spy, ns, printed = _run_own_loop(_LOOP_A, monkeypatch, capsys, steps=_FEW_STEPS, pin=True,
                                   replace=replace)
  with pytest.raises((AssertionError, ValueError)):
    _check_private_as_written(spy, ns, printed, steps_run=_FEW_STEPS)


def test_readme_ghost_clipping_variant_is_private(monkeypatch, capsys):
  """(a) with its ``grad_fn`` line replaced as the prose says (ghost clipping of the Flax model
  as written, issue 38): private as above on 4 steps, and every parameter is ghost-clipped (no
  fallback warning)."""
  text = README.read_text()
  line = " ".join(re.search(r"replace the `grad_fn` line by\s+`(grad_fn = dpjax\.sgd\."
                            r"ghost_clipped_grad_sum\(.*?\))`", text, re.S).group(1).split())
  old = next(x for x in _block(text, _LOOP_A).splitlines() if x.startswith("grad_fn = "))
  with warnings.catch_warnings():
    warnings.filterwarnings("error", "ghost clipping", UserWarning)
    spy, ns, printed = _run_own_loop(_LOOP_A, monkeypatch, capsys, steps=_FEW_STEPS, pin=True,
                                     replace=((old, line + "  # DP"),))
  _check_private_as_written(spy, ns, printed, steps_run=_FEW_STEPS)
  assert spy.plans[0][0].grad_fn is ns["grad_fn"]
  assert ns["grad_fn"].fun.__qualname__.startswith("ghost_clipped_grad_sum")


def _prose_accuracies(text: str) -> list[float]:
  return [float(a) for a in re.search(r"\(about ([0-9.]+), ([0-9.]+) and ([0-9.]+) here\)",
                                      text).groups()]


@pytest.mark.slow(reason="the own-loop examples exactly as written: PLD calibration and all T = "
                         "60 steps (~40 s each); the default run checks them on 4 steps")
@pytest.mark.parametrize("heading", _OWN_LOOP)
def test_readme_own_loop_example_as_written(heading, monkeypatch, capsys):
  """As written: all T steps private (as above), the printed accuracy is the README's figure, and
  the default run's pinned σ is the calibrated one (rounded up)."""
  spy, ns, printed = _run_own_loop(heading, monkeypatch, capsys)
  plan = spy.plans[0][0]
  accuracy, _ = _check_private_as_written(spy, ns, printed, steps_run=60)
  claimed = _prose_accuracies(README.read_text())[_OWN_LOOP.index(heading)]
  assert accuracy == pytest.approx(claimed, abs=0.02)
  assert accuracy > 0.6                                         # it learns (chance: 0.1)
  pinned = _PINNED_SIGMA[(2.0, 1e-5, 250 / 7_500, 60)]
  assert plan.noise_multiplier <= pinned <= plan.noise_multiplier * (1 + 1e-4)


def _private_basis_variant(text: str) -> tuple[tuple[str, str], ...]:
  """(b)'s "without public rows" sentence, applied to (b)'s code as the sentence says."""
  release = " ".join(re.search(r"`(release = dpjax\.sgd\.private_input_basis\(.*?\))`,", text,
                               re.S).group(1).split())
  assert re.search(r"put `release` where\s+`U` goes", text)
  return (("U = dpjax.sgd.public_input_basis(mnist.X_train[7_500:], 16)",
           release + "; U = release  #"),)


@pytest.mark.slow(reason="(b) with a private basis as its prose says: Analyze Gauss's exact "
                         "discrete Gaussian noise on 784² entries (~20 s on the host), PLD "
                         "calibration and 60 steps")
def test_readme_private_input_basis_variant(monkeypatch, capsys):
  """(b) with the basis released from the private rows, as its prose says: Analyze Gauss on the
  7,500 private rows at a stand-alone (0.2, 1e-6), a Gaussian event composed with the steps by
  the plan's PLD accountant, whose (ε, δ) = (2, 1e-5) is the total; every step private as
  above; the σ and accuracy the prose gives."""
  text = README.read_text()
  spy, ns, printed = _run_own_loop(_LOOP_B, monkeypatch, capsys,
                                   replace=_private_basis_variant(text))
  accuracy, _ = _check_private_as_written(spy, ns, printed, steps_run=60)
  plan = spy.plans[0][0]
  (rows, release_epsilon, release_delta), = spy.private_releases
  assert rows == _row_bytes(ns["X"])                        # the release is on the private rows
  budget = plan.budget
  assert (release_epsilon, release_delta) == (0.2, 1e-6)
  assert budget.subspace_event == ns["release"].dp_event            # the release made is charged
  assert (budget.subspace_epsilon, budget.subspace_delta) == (0.0, 0.0)   # no ε split
  assert budget.sgd_delta == pytest.approx(1e-5) and plan.delta == pytest.approx(1e-5)
  assert plan.epsilon <= 2.0 * (1 + 1e-9)
  assert ns["release"].basis.shape == (784, 16)
  sigmas = re.search(r"σ is ([0-9.]+) instead of \(b\)'s ([0-9.]+) \(an ε split, 0\.2 off the\s+"
                     r"total, would have given ([0-9.]+)\)", text).groups()
  after, plain, split = map(float, sigmas)
  q = 250 / 7_500
  assert plan.noise_multiplier == pytest.approx(after, abs=0.006)
  assert accounting.calibrate_noise_multiplier(2.0, 1e-5, q, 60, accountant="pld") == \
      pytest.approx(plain, abs=0.006)
  assert accounting.plan_dpsgd_budget(2.0, 1e-5, sampling_prob=q, steps=60, subspace_epsilon=0.2,
                                      subspace_delta=1e-6, accountant="pld").noise_multiplier == \
      pytest.approx(split, abs=0.006)
  claimed = float(re.search(r"It costs accuracy here \(([0-9.]+) instead", text).group(1))
  assert accuracy == pytest.approx(claimed, abs=0.03)


# --- Public rows are never private rows ---------------------------------------------------------

def _overlap_of(code: str, name: str, monkeypatch) -> tuple[set, _Spy]:
  """Runs a README example with spies on everything that takes public or private rows (the
  plan's steps skipped, one step, σ pinned; ``train_dp_sgd`` stops the example once it has its
  rows) and returns the rows seen as both."""
  with monkeypatch.context() as patch:
    spy = _Spy(patch, steps=1, pin=True, train=False)
    try:
      _run(code, name)
    except _Stop:
      pass
    jax.effects_barrier()
  return spy.overlap(), spy


@pytest.mark.parametrize("heading", _SGD_SECTIONS)
def test_readme_public_rows_are_not_private_rows(heading, monkeypatch):
  """Every README example that trains with DP-SGD keeps the rows it calls public out of the rows
  it trains on privately (recorded where they enter dpjax, so a new example is covered too)."""
  code = _block(README.read_text(), heading)
  overlap, spy = _overlap_of(code, f"README.md#{heading}", monkeypatch)
  assert spy.private, "the example never handed private rows to dpjax"
  assert not overlap, f"{len(overlap)} public rows are also private rows"


@pytest.mark.parametrize("heading, old, new, shared", [
    (_LOOP_B, "X_train[7_500:]", "X_train[7_400:]", 100),
    ("## Example: learn a subspace privately", "(Xc[200:], yc[200:])", "(Xc[100:], yc[100:])",
     100)])
def test_public_rows_check_detects_overlap(heading, old, new, shared, monkeypatch):
  """Negative control: the same check flags a variant whose public rows overlap the private
  ones."""
  code = _block(README.read_text(), heading)
  assert old in code
  overlap, spy = _overlap_of(code.replace(old, new), "README.md#overlapping", monkeypatch)
  assert len(overlap) == shared


# --- The README's other examples -----------------------------------------------------------------

@pytest.mark.slow(reason="trains with a public subspace for 100 steps; its data flow is checked "
                         "by default")
def test_readme_example_runs(monkeypatch):
  """The first example as written: DPASE answers near the truth, and DP-SGD trains on rows
  disjoint from the ones it calls public, at the stated (ε, δ)."""
  text = README.read_text()
  code = _block(text, "## Example: learn a subspace privately")
  spy = _Spy(monkeypatch)
  ns = _run(code, "README.md")
  assert bool(ns["res"].ok) and float(ns["metrics"].projection_distance(
      ns["res"].basis, ns["model"].basis)) < 0.1
  assert spy.public and spy.private and not spy.overlap()          # private as written
  _assert_budget(ns["out"].budget, epsilon=2.0, delta=1e-5, sampling_prob=180 / 1_800, steps=100)


@pytest.mark.slow(reason="the README's covariance example")
def test_readme_covariance_example_runs():
  code = _block(README.read_text(), "## Example: a covariance with unknown scale")
  ns = _run(code, "README.md#covariance")
  assert bool(ns["cov"].ok) and ns["metrics"].covariance_error(ns["cov"].estimate,
                                                               ns["Sigma"]) < 0.1


@pytest.mark.slow(reason="the README's mesh example trains; the sharded step's audit runs by "
                         "default")
def test_readme_several_devices_example_runs():
  """The mesh example runs (on however many devices this process has) and learns."""
  code = _block(README.read_text(), "## Example: DP-SGD on several devices")
  assert "mesh=mesh" in code
  ns = _run(code, "README.md#devices")
  assert float(ns["out"].params[0]) > 0.5
  _assert_budget(ns["out"].budget, epsilon=2.0, delta=1e-5, sampling_prob=100 / 2_000, steps=50)


@pytest.mark.slow(reason="the quickstart notebook; no notebook runs by default")
def test_quickstart_notebook_runs():
  nb = json.loads((ROOT / "notebooks" / "quickstart.ipynb").read_text())
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  ns = _run(code, "quickstart.ipynb")
  assert ns["out"].subspace_ok is True and ns["out"].history[-1]["accuracy"] > 0.9


@pytest.mark.slow(reason="the private_subspaces notebook (reduced); no notebook runs by default")
def test_private_subspaces_notebook_runs_reduced(monkeypatch):
  monkeypatch.setenv("DPJAX_NOTEBOOK_QUICK", "1")
  nb = json.loads((ROOT / "notebooks" / "private_subspaces.ipynb").read_text())
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  ns = _run(code, "private_subspaces.ipynb")
  assert bool(ns["res"].ok)                                  # DPASEB answered
  assert all(r[1] < 0.1 for r in ns["rows"])                 # DPASE accurate at every d


@pytest.mark.slow(reason="the private_gaussians notebook (reduced); no notebook runs by default")
def test_private_gaussians_notebook_runs_reduced(monkeypatch):
  monkeypatch.setenv("DPJAX_NOTEBOOK_QUICK", "1")
  nb = json.loads((ROOT / "notebooks" / "private_gaussians.ipynb").read_text())
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  ns = _run(code, "private_gaussians.ipynb")
  assert ns["baseline_error"] > 1.0                          # the guessed clip bound fails
  # refine_accuracy (0.1) is the refinement's typical error at the minimum n (about half of the
  # keys land above 0.05 there, before and after issue 33's NumPy host RNG).
  assert bool(ns["refined"].ok) and ns["refined_error"] < min(0.1, ns["coarse_error"])
  assert ns["gauss"].ok and ns["gauss_cov_error"] < 0.1   # singular Σ; refine_accuracy at min n
  assert ns["bad"].failed_step_name == "covariance" and ns["lines"].failed_step_name == "subspace"


@pytest.mark.slow(reason="the private_structure_mnist notebook (reduced: 3,000 rows, k ≤ 60); "
                         "no notebook runs by default")
def test_private_structure_mnist_notebook_runs_reduced(monkeypatch):
  """The full-MNIST notebook at its reduced size: the spectra, and releases that never capture
  more energy than the exact basis of the same rank; the study's figure reads the committed
  report."""
  import matplotlib
  matplotlib.use("Agg")
  monkeypatch.setenv("DPJAX_NOTEBOOK_QUICK", "1")
  nb = json.loads((ROOT / "notebooks" / "private_structure_mnist.ipynb").read_text())
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  ns = _run(code, "private_structure_mnist.ipynb")
  assert ns["QUICK"] and ns["STUDY"].exists()
  assert ns["pixels"].shape == (3000, 784) and ns["scatter"].shape == (3000, 3969)
  for name, (lam, _, S, _) in ns["spectra"].items():
    for f in ns["SHARES"]:
      B = ns["released"][name, f]
      for k in ns["KS"]:
        kept = np.trace(B[:, :k].T @ S @ B[:, :k])
        assert kept <= lam[:k].sum() * (1 + 1e-6)
  ns["plt"].close("all")


@pytest.mark.slow(reason="the dp_sgd_flax notebook (reduced: 1,000 rows, 20 steps, ε = 1); no "
                         "notebook runs by default")
def test_dp_sgd_flax_notebook_runs_reduced(monkeypatch, capsys):
  """The Flax CNN notebook at its reduced size: every run prints the (ε, δ) its plan certifies
  (recomputed by dp_accounting), at the ε asked for, and the largest ε learns (chance 0.1)."""
  import matplotlib
  matplotlib.use("Agg")
  monkeypatch.setenv("DPJAX_NOTEBOOK_QUICK", "1")
  nb = json.loads((ROOT / "notebooks" / "dp_sgd_flax.ipynb").read_text())
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  ns = _run(code, "dp_sgd_flax.ipynb")
  printed = capsys.readouterr().out
  assert ns["QUICK"] and set(ns["budgets"]) == set(ns["EPSILONS"])
  for epsilon, budget in ns["budgets"].items():
    assert f"(ε, δ) = ({budget.epsilon:.2f}, {budget.delta:g}) add/remove-one" in printed
    assert f"{budget.epsilon:.2f}" == f"{epsilon:.2f}" and budget.delta <= ns["DELTA"]
    assert _independent_epsilon(budget) <= epsilon * (1 + 1e-9)
    assert budget.steps == ns["STEPS"]
    assert budget.sampling_prob == pytest.approx(ns["BATCH"] / ns["N_TRAIN"])
  assert ns["results"][max(ns["EPSILONS"])] > 0.2
  assert ns["nonprivate"] > 0.5
  ns["plt"].close("all")



def test_library_does_not_import_the_examples_model_libraries():
  """Flax and Equinox are test/example dependencies only (pyproject's extras): no module of
  dpjax imports them — except the main job (dpjax/demo.py, an example), whose CNN imports Flax
  inside the function that builds it, only when asked for, and dpjax.sgd.flax_layers (ghost
  clipping of Flax models), inside its one ``_flax()`` — and the extras name them."""
  for path in sorted((ROOT / "dpjax").rglob("*.py")):
    tree = ast.parse(path.read_text())
    lazy = set()
    allowed = {("dpjax", "demo.py"): "cnn_model", ("sgd", "flax_layers.py"): "_flax"}
    if (path.parent.name, path.name) in allowed:
      lazy = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
              and f.name == allowed[path.parent.name, path.name] for n in ast.walk(f)}
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      if id(node) not in lazy:
        assert not any(n.split(".")[0] in ("flax", "equinox") for n in names), path
  pyproject = (ROOT / "pyproject.toml").read_text()
  extras = {name: body for name, body in re.findall(r"^(\w+) = \[(.*?)^\]", pyproject, re.M | re.S)}
  assert '"flax>=' in extras["test"] and '"equinox>=' in extras["test"]
  assert '"flax>=' in extras["examples"]

# --- The specification ships with the project ----------------------------------------------------

_CITED_TREES = ("dpjax", "tests", "benchmarks", "notebooks", "README.md")
# "docs/algorithms.md §3.5", "docs/algorithms.md §3.5–3.6", "docs/algorithms.md §1.3, §1.4",
# "docs/algorithms.md\n  # §2.2": the section numbers that follow one citation.
_CITATION = re.compile(r"algorithms\.md[\s#\"]*((?:§\s*\d+(?:\.\d+)?(?:\s*[–/-]\s*\d+(?:\.\d+)?)?"
                       r"(?:\s*(?:,|and|or)\s*(?=§))?\s*)+)")


def _documentation_texts():
  for entry in _CITED_TREES:
    path = ROOT / entry
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
      if f.suffix == ".ipynb":
        nb = json.loads(f.read_text())
        yield f, "\n".join("".join(c["source"]) for c in nb["cells"])
      elif f.suffix in (".py", ".md"):
        yield f, f.read_text()


def _spec_sections() -> set[str]:
  text = (ROOT / "docs" / "algorithms.md").read_text()
  return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)[. ]", text, re.M))


def test_every_cited_section_exists():
  sections = _spec_sections()
  assert {"0", "1", "1.10", "2.2", "3.8", "6.2", "8"} <= sections
  cited, missing = 0, []
  for f, text in _documentation_texts():
    assert "ALGORITHMS" + ".md" not in text, f"{f}: cites the specification outside the repository"
    for run in _CITATION.finditer(text):
      for number in re.findall(r"\d+(?:\.\d+)?", run.group(1)):
        cited += 1
        if number not in sections:
          missing.append(f"{f.relative_to(ROOT)}: §{number}")
  assert cited > 100, cited                                   # the pattern still finds them
  assert not missing, missing


@pytest.mark.slow(reason="the synthetic_data notebook (reduced); no notebook runs by default")
def test_synthetic_data_notebook_runs_reduced(monkeypatch):
  import matplotlib
  import numpy as np
  matplotlib.use("Agg")                                      # plt.show() opens no window
  monkeypatch.setenv("DPJAX_NOTEBOOK_QUICK", "1")
  nb = json.loads((ROOT / "notebooks" / "synthetic_data.ipynb").read_text())
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  ns = _run(code, "synthetic_data.ipynb")
  for res in ns["results"].values():                         # n rows in the cube, a finite plane
    S = np.asarray(res.synthetic)
    assert S.shape == (ns["N"], ns["D"]) and S.min() >= 0.0 and S.max() <= 1.0
    assert res.basis.shape == (ns["D"], ns["DIM"])
    assert np.isfinite(float(ns["metrics"].projection_distance(res.basis, ns["U"])))
  assert all(1 <= k <= ns["D"] for k in ns["chosen"].values())
  for eps, curve in ns["curves"].items():                    # projecting beats d-dim PMM
    assert np.median(curve["pipeline"][-1]) < np.median(curve["pmm"][-1]), eps
  ns["plt"].close("all")


@pytest.mark.slow(reason="the classic_pca_erm notebook (reduced); no notebook runs by default")
def test_classic_pca_erm_notebook_runs_reduced(monkeypatch):
  """The notebook's lessons hold at its reduced size: PPCA and Analyze Gauss capture more
  variance at the larger ε than MOD-SuLQ, and objective perturbation at ε = 3 beats the
  majority class."""
  import matplotlib
  matplotlib.use("Agg")
  monkeypatch.setenv("DPJAX_NOTEBOOK_QUICK", "1")
  nb = json.loads((ROOT / "notebooks" / "classic_pca_erm.ipynb").read_text())
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  ns = _run(code, "classic_pca_erm.ipynb")
  pca = {name: vals.mean(0)[-1] for name, vals in ns["pca_results"].items()}
  sulq = next(v for k, v in pca.items() if k.startswith("MOD-SuLQ"))
  assert all(v > sulq for k, v in pca.items() if not k.startswith("MOD-SuLQ")), pca
  objective = ns["erm_results"]["objective perturbation"].mean(0)[-1]
  assert objective > 0.7, objective
  ns["plt"].close("all")
