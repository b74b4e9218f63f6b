"""The examples in the docstrings of the functions a user meets first run as written (issue 53,
optax's style): every ``>>>`` line in these modules is executed and its output compared."""

import doctest
import importlib

import pytest

MODULES = ["dpjax.sgd.per_example", "dpjax.sgd.plan", "dpjax.accounting",
           "dpjax.coinpress.covariance", "dpjax.coinpress.mean", "dpjax.subspace.approximate",
           "dpjax.subspace.baselines",
           "dpjax.estimators"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                           verbose=False)
  assert result.attempted > 0, f"{name}: no docstring example"
  assert result.failed == 0, f"{name}: {result.failed} docstring example(s) failed"


def test_every_listed_module_has_an_example_and_a_broken_one_fails():
  """The check can fail: an example with a wrong output is counted as a failure."""
  def wrong():
    """>>> 1 + 1
    3
    """
  finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(verbose=False)
  for test in finder.find(wrong, "wrong", globs={}):
    runner.run(test, out=lambda _: None)
  assert runner.failures == 1
