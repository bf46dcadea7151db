"""The torch dependency is a range in pyproject.toml; CI and the README pin it through
constraints.txt (the CPU build here), so both install the same build."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_torch_is_a_range_pinned_by_the_constraints_file():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if re.match(r"torch\b", d)]
    assert ">=" in torch_dep and "==" not in torch_dep
    pins = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if line and not line.startswith("#")]
    assert pins == ["torch==2.13.0"]


def test_ci_and_readme_install_with_the_constraints():
    install = "pip install -c constraints.txt -e '.[dev]'"
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pip install" in line]
    assert len(ci) == 1 and "-c constraints.txt" in ci[0] and ci[0].endswith("-e '.[dev]'")
    readme = (ROOT / "README.md").read_text()
    assert f"{install} && deepcee demo" in readme
    setup = readme.split("## Set up and run the main job", 1)[1].split("## What you can do", 1)[0]
    assert re.findall(r"```bash\n(.*?)\n```", setup, re.S) == [f"{install} && deepcee demo", "python -m pytest"]
