"""The README example and the notebooks run as written (so they cannot rot)."""

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(source: str, name: str) -> dict:
  namespace: dict = {"__name__": name}
  exec(compile(source, name, "exec"), namespace)  # noqa: S102 - our own documentation
  return namespace


def test_readme_example_runs():
  text = (ROOT / "README.md").read_text()
  code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
  ns = _run(code, "README.md")
  assert bool(ns["res"].ok) and float(ns["metrics"].projection_distance(
      ns["res"].basis, ns["model"].basis)) < 0.1
  assert ns["out"].budget.epsilon <= 2.0 + 1e-9


def test_readme_covariance_example_runs():
  text = (ROOT / "README.md").read_text()
  code = re.findall(r"```python\n(.*?)```", text, re.S)[1]
  ns = _run(code, "README.md#covariance")
  assert bool(ns["cov"].ok) and ns["metrics"].covariance_error(ns["cov"].estimate,
                                                               ns["Sigma"]) < 0.1


@pytest.mark.slow
def test_quickstart_notebook_runs():
  nb = json.loads((ROOT / "notebooks" / "quickstart.ipynb").read_text())
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  ns = _run(code, "quickstart.ipynb")
  assert ns["out"].subspace_ok is True and ns["out"].history[-1]["accuracy"] > 0.9


@pytest.mark.slow
def test_private_subspaces_notebook_runs_reduced(monkeypatch):
  monkeypatch.setenv("DPJAX_NOTEBOOK_QUICK", "1")
  nb = json.loads((ROOT / "notebooks" / "private_subspaces.ipynb").read_text())
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  ns = _run(code, "private_subspaces.ipynb")
  assert bool(ns["res"].ok)                                  # DPASEB answered
  assert all(r[1] < 0.1 for r in ns["rows"])                 # DPASE accurate at every d


@pytest.mark.slow
def test_private_gaussians_notebook_runs_reduced(monkeypatch):
  monkeypatch.setenv("DPJAX_NOTEBOOK_QUICK", "1")
  nb = json.loads((ROOT / "notebooks" / "private_gaussians.ipynb").read_text())
  code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  ns = _run(code, "private_gaussians.ipynb")
  assert ns["baseline_error"] > 1.0                          # the guessed clip bound fails
  assert bool(ns["refined"].ok) and ns["refined_error"] < min(0.05, ns["coarse_error"])
  assert ns["gauss"].ok and ns["gauss_cov_error"] < 0.05     # full pipeline, singular Σ
  assert ns["bad"].failed_step_name == "covariance" and ns["lines"].failed_step_name == "subspace"
