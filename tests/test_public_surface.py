"""A public surface a user can hold (issue 36 §2).

Every public module and package declares ``__all__`` (names that exist, none private); the API
reference's "API map" page (``docs/reference/map.rst``) lists, row by row, exactly those names;
``docs/algorithms.md``, which the docstrings cite, ships inside the package as
``dpjax/algorithms.md`` (an identical copy).
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
API_MAP = ROOT / "docs" / "reference" / "map.rst"
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


# --- (b) the reference's API map lists exactly each module's __all__ ----------------------------

_MODULE_CELL = re.compile(r"^``(dpjax(?:\.\w+)*)``$")
_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")


def _list_table_rows(text: str) -> list[list[str]]:
  """The rows of every ``.. list-table::`` in an reStructuredText page, each a list of cells (a
  cell's continuation lines joined by single spaces). A row starts with ``* - `` and each further
  cell with ``- `` two columns to its right; a line indented past that continues the cell. A
  table ends at the first non-blank line back at the left margin."""
  rows: list[list[str]] = []
  in_table, indent = False, None
  for line in text.splitlines():
    if line.startswith(".. list-table::"):
      in_table, indent = True, None
      continue
    if not in_table or not line.strip():
      continue
    if not line[0].isspace():
      in_table = False
      continue
    here = len(line) - len(line.lstrip())
    body = line.strip()
    if body.startswith("* - ") or body == "* -":
      if indent is None:
        indent = here
      assert here == indent, f"list-table row at indent {here}, not {indent}: {line!r}"
      rows.append([body[4:].strip()])
    elif indent is None:
      assert body.startswith(":"), f"list-table: neither an option nor a row: {line!r}"
    elif here == indent + 2 and (body.startswith("- ") or body == "-"):
      rows[-1].append(body[2:].strip())
    else:
      assert here >= indent + 4, f"list-table: a line outside any cell: {line!r}"
      rows[-1][-1] = f"{rows[-1][-1]} {body}".strip()
  return rows


def _listed_names(cell: str) -> tuple[list[str], list[str]]:
  """``(names, malformed)``: the inline literals (double backticks) of a "public names" cell
  outside any parentheses (parenthesised text describes a name; literals inside it are not
  names), and what outside parentheses looks like a name but is not: a literal that is not an
  identifier, a single-backticked one, an unclosed one."""
  names, malformed, depth, i = [], [], 0, 0
  while i < len(cell):
    if cell.startswith("``", i):
      end = cell.find("``", i + 2)
      if end < 0:
        malformed.append(cell[i:])
        break
      token = cell[i + 2:end]
      if depth == 0:
        (names if _IDENTIFIER.match(token) else malformed).append(token)
      i = end + 2
      continue
    ch = cell[i]
    if ch == "`":                                 # default role: `name` renders, but write ``name``
      end = cell.find("`", i + 1)
      if end < 0:
        malformed.append(cell[i:])
        break
      if depth == 0:
        malformed.append(cell[i:end + 1])
      i = end + 1
      continue
    if ch == "(":
      depth += 1
    elif ch == ")":
      depth = max(depth - 1, 0)
    i += 1
  return names, malformed


def parse_api_map(text: str) -> dict[str, list[str]]:
  """{module: names listed} from the list-tables of the API map page: every row but the headers
  (first cell ``module``) has a ``dpjax…`` module as an inline literal in its first cell and its
  public names in its third. Raises AssertionError for a page without a table, a row that names
  no module, a repeated row, a row without three cells or a malformed names cell."""
  table_rows = _list_table_rows(text)
  assert table_rows, "API map: no '.. list-table::' rows"
  rows: dict[str, list[str]] = {}
  for cells in table_rows:
    if cells[0] == "module":
      continue                                   # a header row
    module = _MODULE_CELL.match(cells[0])
    assert module is not None, f"API map: a row that names no ``dpjax…`` module: {cells[0]!r}"
    name = module.group(1)
    assert name not in rows, f"API map: two rows for {name}"
    assert len(cells) == 3, f"API map row {name}: {len(cells)} cells, not 3"
    names, malformed = _listed_names(cells[2])
    assert not malformed, (f"API map row {name}: not a name outside parentheses (a name is "
                           f"``name``): {malformed}")
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


def test_api_map_lists_exactly_each_modules_all():
  rows = parse_api_map(API_MAP.read_text())
  declared = {name: _declared(name) for name in PUBLIC_MODULES}
  problems = api_map_mismatches(rows, declared)
  assert not problems, f"{API_MAP.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_api_map_is_a_page_of_the_reference():
  toctree = (API_MAP.parent / "index.rst").read_text().split(".. toctree::", 1)[1]
  assert re.search(r"^\s+map\s*$", toctree, re.M), "docs/reference/index.rst: no 'map' entry"


def _fake_map(names: str = "``alpha`` (first, see ``beta``; ``f(x)`` is prose),\n       ``beta``",
              sub_row: bool = True) -> str:
  """A small API map page: ``dpjax.fake`` lists ``names`` (a cell over two lines by default),
  ``dpjax.fake.sub`` nothing, and a literal after the table that is prose, not a row."""
  sub = "   * - ``dpjax.fake.sub``\n     - empty\n     - —\n" if sub_row else ""
  return f"""API map
=======

.. list-table::
   :header-rows: 1
   :widths: 20 30 50

   * - module
     - what
     - public names
   * - ``dpjax.fake``
     - a fake (with ``helper`` in prose)
     - {names}
{sub}
Next
----

``dpjax.after`` is not in a table: ``gamma``
"""


def test_api_map_check_detects_an_extra_or_missing_name_or_row():
  """Negative control: the same parser and comparison report a map that lists one name too many
  or one too few or lacks a module's row, and ignore parenthesised names and text outside the
  tables."""
  declared = {"dpjax.fake": ["alpha", "beta"], "dpjax.fake.sub": []}
  rows = parse_api_map(_fake_map())
  assert rows == {"dpjax.fake": ["alpha", "beta"], "dpjax.fake.sub": []}
  assert api_map_mismatches(rows, declared) == []
  extra = api_map_mismatches(parse_api_map(_fake_map("``alpha``, ``beta``, ``gamma``")), declared)
  assert extra == ["dpjax.fake: in the API map but not in __all__: ['gamma']"]
  missing = api_map_mismatches(parse_api_map(_fake_map("``alpha`` (see ``beta``)")), declared)
  assert missing == ["dpjax.fake: in __all__ but not in the API map: ['beta']"]
  fewer = api_map_mismatches(rows, {**declared, "dpjax.fake": ["alpha", "beta", "delta"]})
  assert fewer == ["dpjax.fake: in __all__ but not in the API map: ['delta']"]
  no_row = api_map_mismatches(parse_api_map(_fake_map(sub_row=False)), declared)
  assert no_row == ["dpjax.fake.sub: no row in the API map"]
  assert api_map_mismatches({}, declared) == ["dpjax.fake: no row in the API map",
                                              "dpjax.fake.sub: no row in the API map"]
  twice = api_map_mismatches(parse_api_map(_fake_map("``alpha``, ``beta``, ``alpha``")), declared)
  assert twice == ["dpjax.fake: listed twice in the API map: ['alpha']"]


@pytest.mark.parametrize("names, message", [
    ("``alpha``, ``dpjax.other.name``", "not a name"),
    ("``alpha``, `beta`", "not a name"),
    ("``alpha``, ``beta", "not a name"),
])
def test_api_map_parser_refuses_a_malformed_names_cell(names, message):
  with pytest.raises(AssertionError, match=message):
    parse_api_map(_fake_map(names))


def test_api_map_parser_refuses_a_malformed_row():
  page = _fake_map()
  with pytest.raises(AssertionError, match="two rows for dpjax.fake"):
    parse_api_map(page.replace("``dpjax.fake.sub``", "``dpjax.fake``"))
  with pytest.raises(AssertionError, match="2 cells, not 3"):
    parse_api_map(page.replace("     - empty\n", ""))
  with pytest.raises(AssertionError, match="names no ``dpjax…`` module"):
    parse_api_map(page.replace("``dpjax.fake.sub``", "`dpjax.fake.sub`"))
  with pytest.raises(AssertionError, match="no '.. list-table::'"):
    parse_api_map("API map\n=======\n\nNo table.\n")


# --- docs/algorithms.md ships with the package --------------------------------------------------

def test_algorithms_md_ships_as_package_data():
  """The package copy is byte-identical to docs/algorithms.md (so they cannot drift), and an
  installed package reads it with importlib.resources."""
  source = (ROOT / "docs" / "algorithms.md").read_bytes()
  assert (ROOT / "dpjax" / "algorithms.md").read_bytes() == source, (
      "dpjax/algorithms.md differs from docs/algorithms.md: cp docs/algorithms.md dpjax/")
  shipped = importlib.resources.files("dpjax").joinpath("algorithms.md")
  assert shipped.is_file() and shipped.read_bytes() == source
