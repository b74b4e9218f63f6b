"""Layering (issue 36 §2): no unit of dpjax uses another unit's private (``_``-prefixed) names.

A unit is a subpackage ``dpjax/<pkg>/`` or a top-level module ``dpjax/<mod>.py``. What several
units share lives in the internal layer — ``dpjax/_core/``, ``dpjax/_validation.py``,
``dpjax/_host.py``, ``dpjax/_data/`` — which anyone may import, names with or without a leading
underscore. The check parses every module with ``ast`` (no import runs) and builds its import
graph: ``from … import _x`` (absolute or relative, at any depth: function-level imports count),
``import dpjax.pkg._mod``, and attribute access ``alias._x`` / ``dpjax.pkg._x`` on imported
dpjax modules.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
from helpers import python_stdout

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dpjax"
SHARED = frozenset({"_core", "_validation", "_host", "_data"})


def _unit(name: str) -> str | None:
  """The unit of a dotted name (``dpjax.subspace.baselines._x`` → ``subspace``); ``"dpjax"``
  for the package's ``__init__`` and the names it defines (``dpjax._NAMES``); None outside
  dpjax."""
  parts = name.split(".")
  if parts[0] != "dpjax":
    return None
  if len(parts) > 1 and ((PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").is_file()):
    return parts[1]
  return "dpjax"


def _foreign_private(importer_unit: str, name: str) -> bool:
  """Whether the dotted ``name`` is a private name of a unit other than ``importer_unit`` (and
  not of the shared layer): some component after the unit starts with a single underscore."""
  unit = _unit(name)
  if unit is None or unit == importer_unit or unit in SHARED:
    return False
  tail = name.split(".")[1:] if unit == "dpjax" else name.split(".")[2:]
  return any(part.startswith("_") and not part.startswith("__") for part in tail)


def layering_violations(source: str, path: str) -> list[tuple[str, str]]:
  """``(path, dotted name)`` for each use in ``source`` (the module at ``path``, relative to the
  repository root, e.g. ``dpjax/classic/pca.py``) of another unit's private name."""
  parts = list(pathlib.PurePosixPath(path).with_suffix("").parts)
  is_package = parts[-1] == "__init__"
  if is_package:
    parts = parts[:-1]
  module = ".".join(parts)
  package = parts if is_package else parts[:-1]
  unit = _unit(module)
  tree = ast.parse(source, filename=path)
  aliases: dict[str, str] = {}          # local name → dotted dpjax name it is bound to
  found: list[tuple[str, str]] = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom):
      if node.level:
        base = package[:len(package) - (node.level - 1)]
        origin = ".".join(base + ([node.module] if node.module else []))
      else:
        origin = node.module or ""
      if _unit(origin) is None:
        continue
      for alias in node.names:
        full = f"{origin}.{alias.name}"
        aliases[alias.asname or alias.name] = full
        if _foreign_private(unit, full):
          found.append((path, full))
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if _unit(alias.name) is None:
          continue
        if _foreign_private(unit, alias.name):
          found.append((path, alias.name))
        if alias.asname:
          aliases[alias.asname] = alias.name
        else:
          aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute):
      continue
    chain, base = [node.attr], node.value
    while isinstance(base, ast.Attribute):
      chain.append(base.attr)
      base = base.value
    if isinstance(base, ast.Name) and base.id in aliases:
      full = ".".join([aliases[base.id], *reversed(chain)])
      # A chain is reported once, at its first private component (ast.walk visits each
      # prefix of ``a._x.y`` as its own Attribute node).
      if _foreign_private(unit, full) and not _foreign_private(unit, full.rsplit(".", 1)[0]):
        found.append((path, full))
  return found


def _modules():
  return sorted(PACKAGE.rglob("*.py"))


def _all_violations():
  found = []
  for file in _modules():
    found += layering_violations(file.read_text(encoding="utf-8"),
                                 file.relative_to(ROOT).as_posix())
  return found


def test_no_unit_uses_another_units_private_names():
  assert len(_modules()) > 50                            # the scan sees the package
  found = _all_violations()
  assert not found, (
      "move the shared helper into dpjax/_core/ (a name without a leading underscore) and "
      f"import it from there in both places: {found}")


@pytest.mark.parametrize("path, source, expected", [
    ("dpjax/classic/x.py", "from dpjax.subspace.baselines import _noisy_top_k\n",
     [("dpjax/classic/x.py", "dpjax.subspace.baselines._noisy_top_k")]),
    ("dpjax/classic/x.py", "def f():\n  from ..subspace import baselines as b\n  b._y(1)\n",
     [("dpjax/classic/x.py", "dpjax.subspace.baselines._y")]),
    ("dpjax/ledger.py", "from dpjax import accounting\naccounting._accountant('rdp')\n",
     [("dpjax/ledger.py", "dpjax.accounting._accountant")]),
    ("dpjax/ledger.py", "import dpjax.accounting\ndpjax.accounting._accountant('rdp')\n",
     [("dpjax/ledger.py", "dpjax.accounting._accountant")]),
    ("dpjax/sgd/x.py", "import dpjax.subspace._impl as impl\n",
     [("dpjax/sgd/x.py", "dpjax.subspace._impl")]),
    ("dpjax/sgd/x.py", "from dpjax import _NAMES\n", [("dpjax/sgd/x.py", "dpjax._NAMES")]),
    # Allowed: the same unit's privates, the shared layer, public names, dunders, non-dpjax.
    ("dpjax/subspace/streaming.py",
     "from dpjax.subspace import approximate\nfrom .baselines import _x\napproximate._plan()\n",
     []),
    ("dpjax/classic/x.py", "from dpjax import _validation as v\nfrom dpjax._host import _y\n"
     "from dpjax._core.second_moment import noisy_top_k\nv._real_scalar(1, 'x')\n", []),
    ("dpjax/classic/x.py", "from dpjax.subspace import baselines\nimport numpy as np\n"
     "baselines.analyze_gauss\nbaselines.__name__\nnp._private\n", []),
])
def test_the_checker_sees_each_kind_of_use(path, source, expected):
  assert layering_violations(source, path) == expected


def _imports_of(path: pathlib.Path) -> set[str]:
  """Every module ``path`` imports (any depth), ``from X import y`` as ``X`` and ``X.y``."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      names |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
  return names


def test_accounting_does_not_import_mechanisms():
  imported = _imports_of(PACKAGE / "accounting.py")
  assert not {m for m in imported if m.startswith("dpjax.mechanisms")}, imported
  code = ("import sys, dpjax.accounting; "
          "print(sorted(m for m in sys.modules if m.startswith('dpjax.mechanisms')))")
  assert python_stdout(code) == "[]"
  # Negative control: the same probe sees the mechanisms once a module that uses them loads.
  probe = code.replace("dpjax.accounting;", "dpjax.accounting, dpjax.mechanisms;")
  assert "dpjax.mechanisms" in python_stdout(probe)
