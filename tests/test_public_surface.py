"""A public surface a user can hold (issue 36 §2).

Every public module and package declares ``__all__`` (names that exist, none private); the
README's "API map" lists, row by row, exactly those names; ``docs/algorithms.md``, which the
docstrings cite, ships inside the package as ``dpjax/algorithms.md`` (an identical copy).
"""

from __future__ import annotations

import ast
import importlib
import importlib.resources
import importlib.util
import pathlib
import pkgutil
import re

import pytest

import dpjax

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PACKAGE_DIR = pathlib.Path(dpjax.__file__).resolve().parent


def _public_modules(name: str = "dpjax", path: pathlib.Path = PACKAGE_DIR) -> list[str]:
  """``dpjax`` and every module or package below it whose own name does not start with ``_``
  (found on disk, nothing imported; ``_``-prefixed packages are skipped with all they hold)."""
  found = [name]
  for info in pkgutil.iter_modules([str(path)], f"{name}."):
    leaf = info.name.rsplit(".", 1)[1]
    if leaf.startswith("_"):
      continue
    if info.ispkg:
      found += _public_modules(info.name, path / leaf)
    else:
      found.append(info.name)
  return found


PUBLIC_MODULES = sorted(_public_modules())


def _has_sklearn() -> bool:
  return importlib.util.find_spec("sklearn") is not None


def _import(name: str):
  if name == "dpjax.estimators":
    pytest.importorskip("sklearn")
  return importlib.import_module(name)


def _literal_all(name: str) -> list[str]:
  """``__all__`` read from a module's source (for ``dpjax.estimators`` without scikit-learn)."""
  spec = importlib.util.find_spec(name)
  tree = ast.parse(pathlib.Path(spec.origin).read_text())
  for node in tree.body:
    targets = node.targets if isinstance(node, ast.Assign) else (
        [node.target] if isinstance(node, ast.AnnAssign) else [])
    if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
      return list(ast.literal_eval(node.value))
  raise AssertionError(f"{name}: no literal __all__")


def _declared(name: str) -> list[str]:
  if name == "dpjax.estimators" and not _has_sklearn():
    return _literal_all(name)
  return list(importlib.import_module(name).__all__)


# --- (a) every public module declares its public names ------------------------------------------

def test_public_modules_are_found():
  assert {"dpjax", "dpjax.sgd", "dpjax.sgd.per_example", "dpjax.accounting"} <= set(PUBLIC_MODULES)
  assert not [m for m in PUBLIC_MODULES if any(p.startswith("_") for p in m.split("."))]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_module_declares_all(name):
  module = _import(name)
  assert "__all__" in vars(module), f"{name} declares no __all__"
  names = list(module.__all__)
  assert all(isinstance(n, str) for n in names), f"{name}.__all__: {names!r}"
  duplicates = sorted({n for n in names if names.count(n) > 1})
  assert not duplicates, f"{name}.__all__ repeats {duplicates}"
  private = [n for n in names if n.startswith("_")]
  assert not private, f"{name}.__all__ lists private names {private}"
  missing = [n for n in names if not hasattr(module, n)]
  assert not missing, f"{name}.__all__ lists names it does not have: {missing}"


# --- (b) the README's API map lists exactly each module's __all__ -------------------------------

_MODULE_CELL = re.compile(r"^`(dpjax(?:\.\w+)*)`$")
_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")


def _cells(row: str) -> list[str]:
  """The cells of one markdown table row (``\\|`` is a literal bar, not a separator)."""
  return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def _listed_names(cell: str) -> tuple[list[str], list[str]]:
  """``(names, malformed)``: the backticked identifiers of a "public names" cell, outside any
  parentheses (parenthesised text describes a name; backticks inside it are not names), and the
  backticked tokens outside parentheses that are not identifiers."""
  names, malformed, depth, i = [], [], 0, 0
  while i < len(cell):
    ch = cell[i]
    if ch == "`":
      end = cell.find("`", i + 1)
      if end < 0:
        malformed.append(cell[i:])
        break
      token = cell[i + 1:end]
      if depth == 0:
        (names if _IDENTIFIER.match(token) else malformed).append(token)
      i = end + 1
      continue
    if ch == "(":
      depth += 1
    elif ch == ")":
      depth = max(depth - 1, 0)
    i += 1
  return names, malformed


def parse_api_map(text: str) -> dict[str, list[str]]:
  """{module: names listed} from the tables of the ``## API map`` section (up to the next
  ``## `` heading): every row whose first cell is a backticked ``dpjax…`` module name. Raises
  AssertionError for a missing section, a repeated row or a malformed names cell."""
  match = re.search(r"^## API map[^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
  assert match is not None, "README.md has no '## API map' section"
  rows: dict[str, list[str]] = {}
  for line in match.group(1).splitlines():
    if not line.lstrip().startswith("|"):
      continue
    cells = _cells(line)
    module = _MODULE_CELL.match(cells[0])
    if module is None:
      continue                                   # the header and separator rows
    name = module.group(1)
    assert name not in rows, f"API map: two rows for {name}"
    assert len(cells) == 3, f"API map row {name}: {len(cells)} cells, not 3"
    names, malformed = _listed_names(cells[2])
    assert not malformed, f"API map row {name}: not a name outside parentheses: {malformed}"
    rows[name] = names
  return rows


def api_map_mismatches(rows: dict[str, list[str]], declared: dict[str, list[str]]) -> list[str]:
  """What differs between the map's rows and the modules' ``__all__`` (empty when they agree)."""
  problems = []
  for name in sorted(set(declared) - set(rows)):
    problems.append(f"{name}: no row in the API map")
  for name in sorted(set(rows) - set(declared)):
    problems.append(f"{name}: a row in the API map, but not a public module")
  for name in sorted(set(rows) & set(declared)):
    listed, public = rows[name], set(declared[name])
    repeated = sorted({n for n in listed if listed.count(n) > 1})
    missing, extra = sorted(public - set(listed)), sorted(set(listed) - public)
    if missing:
      problems.append(f"{name}: in __all__ but not in the API map: {missing}")
    if extra:
      problems.append(f"{name}: in the API map but not in __all__: {extra}")
    if repeated:
      problems.append(f"{name}: listed twice in the API map: {repeated}")
  return problems


def test_readme_api_map_lists_exactly_each_modules_all():
  rows = parse_api_map(README.read_text())
  declared = {name: _declared(name) for name in PUBLIC_MODULES}
  problems = api_map_mismatches(rows, declared)
  assert not problems, "README.md API map:\n" + "\n".join(problems)


_FAKE_MAP = """# x

## API map

| module | what | public names |
| --- | --- | --- |
| `dpjax.fake` | a fake (with `helper` in prose) | `alpha` (first, see `beta`), `beta`{extra} |
| `dpjax.fake.sub` | empty | — |

## Next

| `dpjax.after` | not in the map's section | `gamma` |
"""


def test_api_map_check_detects_an_extra_or_missing_name():
  """Negative control: the same parser and comparison report a map that lists one name too many
  or one too few, and ignore parenthesised names and rows outside the section."""
  declared = {"dpjax.fake": ["alpha", "beta"], "dpjax.fake.sub": []}
  rows = parse_api_map(_FAKE_MAP.format(extra=""))
  assert rows == {"dpjax.fake": ["alpha", "beta"], "dpjax.fake.sub": []}
  assert api_map_mismatches(rows, declared) == []
  extra = api_map_mismatches(parse_api_map(_FAKE_MAP.format(extra=", `gamma`")), declared)
  assert extra == ["dpjax.fake: in the API map but not in __all__: ['gamma']"]
  fewer = api_map_mismatches(rows, {**declared, "dpjax.fake": ["alpha", "beta", "delta"]})
  assert fewer == ["dpjax.fake: in __all__ but not in the API map: ['delta']"]
  assert api_map_mismatches({}, declared) == ["dpjax.fake: no row in the API map",
                                              "dpjax.fake.sub: no row in the API map"]
  with pytest.raises(AssertionError, match="not a name"):
    parse_api_map(_FAKE_MAP.format(extra=", `dpjax.other.name`"))


# --- docs/algorithms.md ships with the package --------------------------------------------------

def test_algorithms_md_ships_as_package_data():
  """The package copy is byte-identical to docs/algorithms.md (so they cannot drift), and an
  installed package reads it with importlib.resources."""
  source = (ROOT / "docs" / "algorithms.md").read_bytes()
  assert (ROOT / "dpjax" / "algorithms.md").read_bytes() == source, (
      "dpjax/algorithms.md differs from docs/algorithms.md: cp docs/algorithms.md dpjax/")
  shipped = importlib.resources.files("dpjax").joinpath("algorithms.md")
  assert shipped.is_file() and shipped.read_bytes() == source
