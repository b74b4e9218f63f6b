"""The result type of dpjax's private learners: one family of frozen dataclass pytrees.

Every learner returns a subclass of :class:`DPResult`. The arrays — the ⊥ flag ``ok``, the
estimate, and ``released`` (the other DP-released quantities, e.g. a winning noisy count) — are
pytree children, so a result passes through ``jax.jit`` and ``jax.vmap`` (e.g.
``jax.vmap(lambda k: dpjax.dpase(k, X, ...))(keys)`` stacks the arrays and keeps one ε). The
guarantee — ``epsilon``, ``delta``, ``neighboring`` (a ``dp_accounting.NeighboringRelation``) —
and ``info`` (public parameters only, an immutable :class:`PublicInfo`) are static metadata: they
depend on public inputs alone, never on data.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import DpEvent, NeighboringRelation, NonPrivateDpEvent, NoOpDpEvent

from dpjax import accounting
from dpjax._core.deprecation import renamed_attribute

__all__ = ["DPResult", "ERMResult", "EstimateResult", "GaussianResult", "PublicInfo",
           "SubspaceResult", "SyntheticDataResult", "UnderpoweredWarning", "warn_underpowered"]

_NAN = float("nan")       # one NaN object, so that equal infos compare equal (NaN != NaN)


def _freeze(value, name: str):
  """An immutable, hashable copy of a public info value (raises on arrays)."""
  if value is None or isinstance(value, (bool, str, enum.Enum)):
    return value
  if isinstance(value, (jax.Array, np.ndarray)) and getattr(value, "ndim", 1) == 0 \
      and not isinstance(value, jax.core.Tracer):
    value = value.item()
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    value = float(value)
    return _NAN if math.isnan(value) else value
  if isinstance(value, Mapping):
    return PublicInfo(value)
  if isinstance(value, tuple) and hasattr(value, "_fields"):      # NamedTuple
    return PublicInfo(value._asdict())
  if isinstance(value, (tuple, list)):
    return tuple(_freeze(x, name) for x in value)
  raise TypeError(f"info[{name!r}] must be a public scalar, string, tuple or mapping, got "
                  f"{type(value).__name__}; arrays (DP releases) belong in `released`.")


class UnderpoweredWarning(UserWarning):
  """A learner ran with fewer rows than it needs to be useful at its (ε, δ): the result is still
  private, but probably says little. Every such warning gives the rows needed and the helper
  that computes that number (``dpjax.coinpress.covariance_required_n``,
  ``dpjax.subspace.dpase_required_n``, ...); the same helper's number is the one a refusal quotes.
  Turn it into an error with ``warnings.simplefilter("error", dpjax.UnderpoweredWarning)``."""


def warn_underpowered(message: str, stacklevel: int | None = None) -> None:
  """Emits :class:`UnderpoweredWarning` at the user's call."""
  from dpjax import _validation as v
  warnings.warn(message, UnderpoweredWarning,
                stacklevel=v.user_stacklevel() if stacklevel is None else stacklevel)


class PublicInfo(Mapping):
  """An immutable, hashable mapping of public diagnostics (a result's static metadata).

  Values are frozen on construction: numbers become Python scalars, lists tuples, mappings and
  NamedTuples nested :class:`PublicInfo`. Arrays are refused: anything computed from data is a
  DP release and belongs in the result's ``released`` children.
  """
  __slots__ = ("_items",)

  def __init__(self, items: Mapping | None = None):
    items = {} if items is None else dict(items)
    object.__setattr__(self, "_items",
                       tuple((str(k), _freeze(val, str(k))) for k, val in items.items()))

  def __getitem__(self, key):
    for k, val in self._items:
      if k == key:
        return val
    raise KeyError(key)

  def __iter__(self):
    return (k for k, _ in self._items)

  def __len__(self):
    return len(self._items)

  def __hash__(self):
    return hash(frozenset(self._items))

  def __eq__(self, other):
    if not isinstance(other, Mapping):
      return NotImplemented
    other = other if isinstance(other, PublicInfo) else PublicInfo(other)
    return dict(self._items) == dict(other._items)

  def __setattr__(self, name, value):
    raise AttributeError("PublicInfo is immutable.")

  def __repr__(self):
    return "PublicInfo({" + ", ".join(f"{k!r}: {val!r}" for k, val in self._items) + "})"

  def __reduce__(self):                             # pickle (e.g. a fitted estimator)
    return PublicInfo, (dict(self._items),)

  def replace(self, **updates) -> "PublicInfo":
    """A copy with ``updates`` added or replaced."""
    return PublicInfo({**dict(self._items), **updates})


_BY_NUMBER = (accounting.EpsilonDeltaDpEvent, NoOpDpEvent, NonPrivateDpEvent)


def _static(**kwargs):
  return dataclasses.field(metadata=dict(static=True), **kwargs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPResult:
  """The common base of every learner's result (a pytree; see the module docstring).

  Attributes:
    ok: bool scalar array. ``False`` is the paper's ⊥: the mechanism declined to answer (a
      private test failed). The decision is itself part of the DP release, and every other
      array then holds a fixed placeholder (zeros), so ⊥ carries no further information.
    released: dict of further DP-released arrays (covered by ``epsilon``, ``delta``), e.g. a
      winning noisy count; a fixed placeholder (0) where nothing was released.
    epsilon: ε spent (nats), whatever the outcome; ``inf`` for a non-private computation.
    delta: δ spent, whatever the outcome.
    neighboring: the ``dp_accounting.NeighboringRelation`` under which ``(ε, δ)`` holds, or
      None for a computation that is not private (ε = inf) or sees only public data (ε = 0).
    info: :class:`PublicInfo`, the public parameters the learner used (never data).
    dp_event: the ``dp_accounting.DpEvent`` the release is, under ``neighboring``: a
      ``GaussianDpEvent`` / ``LaplaceDpEvent`` / ``ComposedDpEvent`` where the learner knows its
      mechanism exactly, else (the default, filled in from ``epsilon``, ``delta``)
      :class:`dpjax.accounting.EpsilonDeltaDpEvent` (``NoOpDpEvent`` for ε = δ = 0,
      ``NonPrivateDpEvent`` for ε = ∞). :meth:`dpjax.ledger.PrivacyLedger.record` takes it (or
      the result) and composes it with the rest.
  """
  ok: jax.Array
  released: dict = dataclasses.field(default_factory=dict)
  epsilon: float = _static()
  delta: float = _static()
  neighboring: NeighboringRelation | None = _static()
  info: PublicInfo = _static(default=PublicInfo())
  dp_event: DpEvent | None = _static(default=None)

  def __post_init__(self):
    for name in ("epsilon", "delta"):
      value = getattr(self, name)
      if isinstance(value, jax.core.Tracer):
        raise TypeError(f"a result's {name} is static metadata: pass a concrete number (the "
                        "public wrappers take ε and δ as Python floats; use the traceable "
                        "cores for traced ones).")
      object.__setattr__(self, name, float(value))
    if self.neighboring is not None and not isinstance(self.neighboring, NeighboringRelation):
      raise TypeError("neighboring must be a dp_accounting.NeighboringRelation or None, got "
                      f"{self.neighboring!r}.")
    if not isinstance(self.info, PublicInfo):
      object.__setattr__(self, "info", PublicInfo(self.info))
    # An event given by number follows (ε, δ) (so a ``replace`` of them cannot leave it stale);
    # a mechanism's own event (Gaussian, composed, ...) is kept as given.
    if self.dp_event is None or isinstance(self.dp_event, _BY_NUMBER):
      object.__setattr__(self, "dp_event", accounting.release_event(self.epsilon, self.delta))
    elif not isinstance(self.dp_event, DpEvent):
      raise TypeError(f"dp_event must be a dp_accounting.DpEvent, got {self.dp_event!r}.")

  neighbouring = renamed_attribute("neighboring", "neighbouring")

  def replace(self, **changes):
    """A copy with ``changes`` (``dataclasses.replace``)."""
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SubspaceResult(DPResult):
  """Outcome of a private subspace learner.

  Attributes:
    basis: ``(d, k)`` orthonormal basis of the learned subspace when ``ok``; zeros when not.
      Learners that also learn the dimension (the Ashtiani–Liaw exact subspace) return ``(d, d)``
      with the basis in the first ``released["rank"]`` columns and zeros after (static shapes).
  """
  basis: jax.Array

  @property
  def projection(self) -> jax.Array:
    """The ``(d, d)`` orthogonal projection ``V Vᵀ`` (zeros when ⊥)."""
    return self.basis @ self.basis.T


@dataclasses.dataclass(frozen=True, kw_only=True)
class EstimateResult(DPResult):
  """Outcome of a private mean or covariance estimator.

  Attributes:
    estimate: a mean ``(d,)`` or a covariance ``(d, d)`` when ``ok``; zeros when not. Each
      learner's docstring gives its dtype (the caller's precision, or float64 where the
      algorithm needs it, with the reason).
  """
  estimate: jax.Array


GAUSSIAN_STEPS = ("subspace", "covariance", "mean", "orthogonal_mean")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GaussianResult(DPResult):
  """Outcome of :func:`dpjax.ashtiani_liaw.learn_gaussian`.

  Attributes:
    mean: ``(d,)`` μ̃ (zeros on ⊥).
    covariance: ``(d, d)`` Σ̃ (zeros on ⊥).
    failed_step: int32 scalar array: 0 when ``ok``, else ``1 + i`` for the first step
      ``GAUSSIAN_STEPS[i]`` that returned ⊥ (a DP release, part of the outcome);
      :attr:`failed_step_name` spells it.
  """
  mean: jax.Array
  covariance: jax.Array
  failed_step: jax.Array = dataclasses.field(default_factory=lambda: jnp.int32(0))

  @property
  def failed_step_name(self) -> str | None:
    """The name of the failed step (None when ``ok``); needs a concrete result."""
    index = int(self.failed_step)
    return None if index == 0 else GAUSSIAN_STEPS[index - 1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticDataResult(DPResult):
  """Outcome of :func:`dpjax.synthetic.low_dimensional_synthetic_data` (pure ε-DP, no ⊥:
  ``ok`` is always True; a small εn gives a poor dataset, never a refusal).

  Attributes:
    synthetic: ``(m, d)`` synthetic rows in ``[0, 1]^d`` (``m = n``), the caller's dtype.
    basis: ``(d, d')`` the private orthonormal basis (top-d' eigenvectors of the private
      centred covariance).
    mean: ``(d,)`` the private mean, clipped into the cube.
  """
  synthetic: jax.Array
  basis: jax.Array
  mean: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class ERMResult(DPResult):
  """Outcome of a private ERM learner (:mod:`dpjax.classic.erm`): pure ε-DP (``delta = 0``).

  ERM has no ⊥: ``ok`` is always True for data in the learner's domain (a small εn gives a
  noisy model, never a refusal; a concrete dataset outside the domain raises). Only a traced
  dataset outside the domain (NaN, a label outside the allowed set, a row above the norm bound
  without clipping) gives ``ok=False`` and zeros, as :func:`dpjax._validation.domain_bottom`.

  Attributes:
    coefficients: the released linear model: ``(d,)`` for a binary learner (predict
      ``sign(x·f)``), ``(K, d)`` for one-vs-rest (predict the class of the largest ``x·f_k``).
      Covered by ``epsilon``.
    nonprivate_gradient_norm: the gradient norm ``‖∇J̃(f̂)‖`` the optimiser reached (scalar, or
      ``(K,)`` for one-vs-rest). NOT covered by the DP guarantee: it is a function of the data,
      a diagnostic for the analyst (did the solver reach its tolerance?), never to be published.
      It is deliberately not in ``released``, which holds DP releases only.
  """
  coefficients: jax.Array
  nonprivate_gradient_norm: jax.Array


def _short(value, width: int = 60) -> str:
  """An array as ``dtype[shape]`` (a concrete scalar as its value); a dict of them likewise;
  anything else as its repr, cut at ``width`` characters."""
  if isinstance(value, dict):
    return "{" + ", ".join(f"{k!r}: {_short(val, width)}" for k, val in value.items()) + "}"
  if hasattr(value, "shape") and hasattr(value, "dtype"):
    if value.shape == () and not isinstance(value, jax.core.Tracer):
      return repr(value.item())
    return f"{value.dtype}[{', '.join(str(n) for n in value.shape)}]"
  text = repr(value)
  return text if len(text) <= width else text[:width - 1] + "…"


def _summary_repr(self) -> str:
  """A result in one screen: arrays by dtype and shape, ε, δ and the relation by value, the
  public info by its keys, the event cut short."""
  fields = []
  for f in dataclasses.fields(self):
    value = getattr(self, f.name)
    if f.name == "info":
      fields.append("info={" + ", ".join(value) + "}")
    elif f.name == "neighboring":
      fields.append(f"neighboring={getattr(value, 'name', None)}")
    elif f.name == "released" and not value:
      continue
    else:
      fields.append(f"{f.name}={_short(value)}")
  return f"{type(self).__name__}(" + ", ".join(fields) + ")"


for _cls in (DPResult, SubspaceResult, EstimateResult, GaussianResult, SyntheticDataResult,
             ERMResult):
  jax.tree_util.register_dataclass(_cls)
  _cls.__repr__ = _summary_repr

