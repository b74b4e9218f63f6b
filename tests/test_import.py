"""``import dpjax`` is lazy (issue 36 §2): it loads neither JAX nor dp_accounting, and every
top-level name resolves on first use to the object its subpackage defines."""


import pytest
from helpers import python_stdout

import dpjax


def test_import_dpjax_loads_no_subpackage_jax_or_dp_accounting():
  code = ("import sys, dpjax; print(sorted(m for m in sys.modules if m.split('.')[0] in "
          "('jax', 'jaxlib', 'dp_accounting', 'numpy', 'scipy', 'optax') or "
          "m.startswith('dpjax.')))")
  assert python_stdout(code) == "[]"
  # Negative control: the same probe sees a subpackage once it is used.
  code = code.replace("import sys, dpjax;", "import sys, dpjax; dpjax.ledger;")
  assert "dpjax.ledger" in python_stdout(code)


def test_every_top_level_name_resolves_to_its_subpackages_object():
  import importlib
  for name in dpjax.__all__:
    value = getattr(dpjax, name)
    if name in dpjax._SUBPACKAGES:
      assert value is importlib.import_module(f"dpjax.{name}")
    else:
      assert value is getattr(importlib.import_module(f"dpjax.{dpjax._NAMES[name]}"), name)
  assert set(dpjax.__all__) <= set(dir(dpjax))
  from dpjax import dpase, sgd                                        # noqa: F401
  with pytest.raises(AttributeError, match="no attribute 'experiments_typo'"):
    dpjax.experiments_typo                                            # noqa: B018
