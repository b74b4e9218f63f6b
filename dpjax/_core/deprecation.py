"""Deprecated spellings kept for one release (issue 36: ``neighbouring`` → ``neighboring``, as
``dp_accounting`` and ``jax_privacy`` spell the relation)."""

from __future__ import annotations

import warnings

__all__ = ["renamed_attribute", "renamed_argument"]

_REMOVAL = "it will be removed in the next release"


def renamed_attribute(new: str, old: str) -> property:
  """A read-only property ``old`` that warns (``DeprecationWarning``) and returns ``new``."""

  def get(self):
    warnings.warn(f"{old!r} is deprecated: use {new!r} ({_REMOVAL}).", DeprecationWarning,
                  stacklevel=2)
    return getattr(self, new)

  return property(get, doc=f"Deprecated alias of ``{new}``.")


def renamed_argument(new_value, old_value, *, new: str, old: str, default=None):
  """The value of a renamed keyword argument: ``old_value`` (with a ``DeprecationWarning``) when
  only the old name was given; ``TypeError`` when both were."""
  if old_value is None:
    return new_value
  if new_value is not default:
    raise TypeError(f"give {new!r} only ({old!r} is its deprecated spelling).")
  warnings.warn(f"the argument {old!r} is deprecated: use {new!r} ({_REMOVAL}).",
                DeprecationWarning, stacklevel=3)
  return old_value
