"""The Python API: ``deepcee.profile``, ``deepcee.plan``, ``deepcee.train`` (see ``docs/api.md``).

The same objects the command line uses: a :class:`~deepcee.profile.ModelProfile` (or, measured
on a cluster, a :class:`~deepcee.profiler.run.ProfileResult`), a
:class:`~deepcee.planner.search.PlanResult` holding the :class:`~deepcee.plan.Plan`, and a
:class:`~deepcee.runtime.records.TrainResult`. ::

    import deepcee
    prof = deepcee.profile(model, data)                       # counted from the model's blocks
    result = deepcee.plan(prof, "cluster.toml", global_batch=32)
    run = deepcee.train(model, data, result.plan, cluster="cluster.toml", steps=100)

``model`` is anything :func:`deepcee.nets.split.build_user_model` takes (a module, a list of
blocks, a HuggingFace model, ``"package.module:build"``, a builder, a built-in net's name), cut
into blocks by :func:`deepcee.nets.split_model` (``points=`` for split points); ``data`` is
anything :func:`deepcee.runtime.datafiles.load_data` takes (a ``Dataset``, ``IterableDataset``,
``DataLoader``, a :class:`~deepcee.runtime.sources.Data`, a file, an import path).

The three names are also the torch-free modules ``deepcee.profile``, ``deepcee.plan`` and
``deepcee.train``, made callable ([Note: callable modules] in :mod:`deepcee._callable`).
Torch is imported only by the calls that need it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepcee.cluster import Cluster
from deepcee.errors import SpecError
from deepcee.plan import Plan
from deepcee.planfile import load_plan
from deepcee.profile import ModelProfile

if TYPE_CHECKING:
    from deepcee.nets.split import SplitModel
    from deepcee.planner.search import PlanResult
    from deepcee.profiler.run import ProfileResult
    from deepcee.runtime.records import TrainResult
    from deepcee.runtime.sources import Data

log = logging.getLogger(__name__)


def load_cluster_ref(cluster: Cluster | str | Path) -> Cluster:
    """A cluster object, a built-in scenario's name, or a cluster file."""
    if isinstance(cluster, Cluster):
        return cluster
    from deepcee.cluster import load_cluster
    from deepcee.scenarios import load_scenario, scenario_names

    ref = str(cluster)
    if ref in scenario_names() and not Path(ref).exists():
        return load_scenario(ref)
    return load_cluster(ref)


def user_model(model: Any, *, loss_fn: Any = None, points: tuple[str, ...] | list[str] = (),
               seed: int = 0) -> SplitModel:
    """``model`` as blocks with a loss (``loss_fn`` overrides the split's default)."""
    from deepcee import nets
    from deepcee.nets.split import SplitModel, build_user_model

    if isinstance(model, str) and model in nets.NET_NAMES:
        blocks, default_loss = nets.build(model, seed)
        split = SplitModel(blocks=tuple(blocks), names=nets.block_names(model), how="built-in", loss_fn=default_loss)
    else:
        split = build_user_model(model, seed=seed, points=tuple(points))
    if loss_fn is not None:
        split = SplitModel(blocks=split.blocks, names=split.names, how=split.how, loss_fn=loss_fn)
    if split.loss_fn is None:
        raise SpecError(f"the model ({split.how}, last block {split.names[-1]!r}) has no default loss; pass loss_fn",
                        field="loss_fn")
    return split


def _model_name(model: Any, name: str | None) -> str:
    if name:
        return name
    if isinstance(model, str):
        return model.rpartition(":")[2] or model
    return type(model).__name__ if not isinstance(model, (list, tuple)) else "blocks"


def profile(model: Any, data: Any = None, cluster: Cluster | str | Path | None = None, *, loss_fn: Any = None,
            points: tuple[str, ...] | list[str] = (), name: str | None = None, seed: int = 0,
            out_dir: str | Path | None = None, emulated: bool = True, deadline_s: float = 900.0,
            **probe: Any) -> ModelProfile | ProfileResult:
    """The model's per-layer costs for planning.

    Without ``cluster``: a :class:`ModelProfile` counted from the blocks (parameters, FLOPs of
    the runtime's own F/I/W actions, saved activations and boundary bytes per sample, on two
    samples of ``data``); a built-in analytic model's name (``"gpt2"``) needs no data. With
    ``cluster``: every device and link of it probed (one process per device, emulated unless
    ``emulated=False``), as ``deepcee profile`` does; returns the
    :class:`~deepcee.profiler.run.ProfileResult` (``.profile``, the measured ``.cluster``) and
    writes its files into ``out_dir`` (default: a new temporary folder). ``probe`` goes to
    :func:`deepcee.profiler.run.profile_cluster`."""
    if isinstance(model, str) and data is None and cluster is None:
        from deepcee.models import get_model, model_names

        if model in model_names():
            return get_model(model)
    if data is None:
        raise SpecError("profiling a model needs data (a few samples to run it on)", field="data")
    from deepcee.profiler.device import net_source
    from deepcee.runtime.datafiles import load_data

    split = user_model(model, loss_fn=loss_fn, points=points, seed=seed)
    source = load_data(data, seed=seed)
    label = _model_name(model, name)
    if cluster is None:
        from deepcee.profiler.model import profile_from_blocks

        return profile_from_blocks(net_source(split, dataset=source, name=label))
    import tempfile

    from deepcee.profiler.run import profile_cluster

    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="deepcee-profile-"))
    return profile_cluster(load_cluster_ref(cluster), split, out, emulated=emulated, deadline_s=deadline_s,
                           loss_fn=split.loss_fn, dataset=source, name=label, **probe)


def plan(model: Any, cluster: Cluster | str | Path | None = None, *, global_batch: int, data: Any = None,
         loss_fn: Any = None, points: tuple[str, ...] | list[str] = (), schedules: tuple[str, ...] | None = None,
         **options: Any) -> PlanResult:
    """The fastest plan that fits, as ``deepcee plan`` finds it: a
    :class:`~deepcee.planner.search.PlanResult` (``.plan``, ``.explanation``).

    ``model``: a :class:`ModelProfile`, a :class:`~deepcee.profiler.run.ProfileResult` (its
    measured cluster is used when ``cluster`` is not given), a built-in model's name, or a
    model (then ``data`` to count its profile, :func:`profile`). ``options``: fields of
    :class:`~deepcee.planner.search.PlannerOptions`."""
    from deepcee.planner.search import PlannerOptions, plan_training

    prof = model
    if not isinstance(prof, ModelProfile) and hasattr(prof, "profile") and hasattr(prof, "cluster"):
        cluster = cluster if cluster is not None else prof.cluster
        prof = prof.profile
    if not isinstance(prof, ModelProfile):
        prof = profile(model, data, loss_fn=loss_fn, points=points)
    if cluster is None:
        raise SpecError("planning needs a cluster (an object, a scenario name or a cluster file)", field="cluster")
    c = load_cluster_ref(cluster)
    if schedules is not None:
        options["schedules"] = tuple(schedules)
    result = plan_training(c, prof, global_batch, options=PlannerOptions(**options))
    ref = c.name if not isinstance(cluster, (str, Path)) else str(cluster)
    from dataclasses import replace

    return replace(result, plan=result.plan.replace(cluster=ref, model=prof.name))


def train(model: Any, data: Any, plan: Plan | PlanResult | str | Path, *, steps: int,
          cluster: Cluster | str | Path | None = None, loss_fn: Any = None, points: tuple[str, ...] | list[str] = (),
          run_dir: str | Path | None = None, deadline_s: float = 3600.0, checkpoint_dir: str | Path | None = None,
          seed: int = 0, **config: Any) -> TrainResult:
    """Train ``model`` on ``data`` following ``plan`` on local processes (one per device; devices
    and links emulated unless ``mode`` says otherwise) and return the
    :class:`~deepcee.runtime.records.TrainResult` (losses, samples/s, per-step metrics).

    ``plan``: a :class:`Plan`, a :class:`~deepcee.planner.search.PlanResult` or a plan file;
    ``cluster``: the plan's cluster (default: the scenario or file the plan names). ``config``:
    other :class:`~deepcee.runtime.job.TrainConfig` fields (``mode``, ``dtype``, ``optimizer``,
    ``checkpoint_every``, ...). Every rank trains its own copy of the model; the object passed is
    never modified ([Note: private copies] in :mod:`deepcee.runtime.params`)."""
    from deepcee.runtime.datafiles import load_data
    from deepcee.runtime.launch import run_training

    p = _as_plan(plan)
    c = load_cluster_ref(cluster if cluster is not None else p.cluster)
    split = user_model(model, loss_fn=loss_fn, points=points, seed=seed)
    if p.num_layers != len(split.blocks):
        raise SpecError(f"the plan covers {p.num_layers} layers, the model splits into {len(split.blocks)} blocks "
                        f"({', '.join(split.names)}); plan this model (deepcee.plan) or give the same split points",
                        field="plan")
    source: Data = load_data(data, seed=seed)
    return run_training(p, c, model=list(split.blocks), loss_fn=split.loss_fn, dataset=source, steps=steps,
                        run_dir=run_dir, deadline_s=deadline_s, checkpoint_dir=checkpoint_dir, seed=seed, **config)


def _as_plan(plan: Any) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return load_plan(plan)
    if isinstance(getattr(plan, "plan", None), Plan):
        return plan.plan
    raise SpecError(f"expected a Plan, a PlanResult or a plan file, got {type(plan).__name__}", field="plan")
