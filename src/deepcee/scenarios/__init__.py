"""Built-in clusters, selectable by name (``deepcee scenarios`` lists them)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from deepcee.cluster import Cluster, load_cluster
from deepcee.errors import ClusterSpecError

DEFAULT_SCENARIO = "local-small"


def scenario_names() -> list[str]:
    files = resources.files(__package__).iterdir()
    return sorted(Path(f.name).stem for f in files if f.name.endswith(".toml"))


def scenario_path(name: str) -> Path:
    path = Path(str(resources.files(__package__).joinpath(f"{name}.toml")))
    if not path.exists():
        raise ClusterSpecError(f"unknown scenario {name!r} (known: {', '.join(scenario_names())})",
                               field="--scenario")
    return path


def load_scenario(name: str) -> Cluster:
    return load_cluster(scenario_path(name))
