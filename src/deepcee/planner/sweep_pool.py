"""The crossover sweeps' planner: the full search's candidates re-scored at every sweep point (torch-free).

[Note: sweep pool]
A crossover study (:mod:`deepcee.planner.crossover`) needs the best plan with and without the
left-out devices at ~20 sweep points (global batch, bandwidth of the slow links). Running the
search again at every point cost 469 CPU s at 512 devices. The sweeps change no device and no
island, only the links' bandwidth or the global batch, so the island chains, stage layouts
and layer splits the full search found stay the candidates: :class:`PoolPlanner` takes the
distinct (stage devices, layer split, sync, schedule) of the plan, its counterfactuals, the
baselines' plans, and of the best plans the full search's cost model scored (at most
``per_device_set`` per set of devices, ``pool`` entries in all), rebuilds each at the point (its own
microbatch size where it divides the batch, else the nearest sizes that do, within 4x; a
schedule as it is (a compact one where the microbatch count is its own), a compact one
also as ZB-H2 and a GPipe one also as 1F1B), scores them with the cost model, drops those that do not fit memory, and
simulates the best ``confirm`` of them. So every figure of the sweeps is a plan of the full
search's (or a baseline's) layouts, scored by the simulator; what the sweeps do not do is look
for new chains or layouts at the point, or build the baselines again there (a batch far from
the planned one could favour a layout neither kept), so a curve can sit below what a new
search would find there. A plan's figures (the cost model's and the simulator's) are shared by
every call whose cluster has the same view of the plan's devices ([Note: cluster views] in
:mod:`deepcee.cluster`): the kept devices' sub-cluster, and the bandwidth points whose changed links
the plan does not use. At 512 devices in 8 islands that took the sweeps' cost-model timings from
469 to 264 and their simulations from 41 to 26, with every figure the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from deepcee.cluster import Cluster
from deepcee.cluster.model import ClusterView
from deepcee.plan import Plan
from deepcee.planner.cost_model import AnalyticCostModel
from deepcee.planner.space import StageLayout, build_plan
from deepcee.profile import ModelProfile
from deepcee.simulator.engine import simulate, to_estimate

STANDINS = {"compact": "zb-h2", "gpipe": "1f1b"}
"""The fixed schedule an entry is rebuilt with besides (or, for a compact schedule at another
microbatch count, instead of) its own: a compact schedule is built for one microbatch count
(ZB-H2 is the fixed schedule nearest it), and GPipe's in-flight count grows with the batch
(1F1B holds at most the stage count)."""


def _schedules(schedule: str, same_count: bool) -> tuple[str, ...]:
    own = (schedule,) if schedule != "compact" or same_count else ()
    return own + ((STANDINS[schedule],) if schedule in STANDINS else ())


def _entry(plan: Plan) -> tuple:
    return (tuple(st.devices for st in plan.stages), tuple(st.layer_start for st in plan.stages)
            + (plan.stages[-1].layer_stop,), plan.sync, tuple(st.recompute for st in plan.stages),
            plan.microbatch_size, plan.schedule, plan.actions, plan.num_microbatches)


def _sizes(global_batch: int, n: int) -> list[int]:
    """``n`` where it divides the batch, else the nearest divisors within 4x of it."""
    if global_batch % n == 0:
        return [n]
    divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0 and n / 4 <= d <= 4 * n]
    below = [d for d in divisors if d < n]
    above = [d for d in divisors if d > n]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


class PoolPlanner:
    """A :class:`~deepcee.planner.crossover.SweepPlanner` over a fixed pool of layouts. See
    [Note: sweep pool]."""

    def __init__(self, plans: Iterable[Plan], scored: Iterable[Plan] = (), *, per_device_set: int = 3,
                 pool: int = 24, confirm: int = 1) -> None:
        entries = dict.fromkeys(_entry(p) for p in plans)
        per_set: dict[frozenset[str], int] = {}
        for p in scored:  # best first: at most ``per_device_set`` of each set of devices used
            used = frozenset(p.devices)
            if len(entries) >= pool or per_set.get(used, 0) >= per_device_set or _entry(p) in entries:
                continue
            per_set[used] = per_set.get(used, 0) + 1
            entries.setdefault(_entry(p))
        self.entries = list(entries)
        self.confirm = confirm
        self.cost_model = AnalyticCostModel()
        self.views: dict[ClusterView, int] = {}
        """Each distinct :meth:`~deepcee.cluster.Cluster.view_key` seen, numbered ([Note: cluster views])."""
        self.scored: dict[tuple, tuple[float, Plan, tuple] | None] = {}
        """Per (entry, microbatch size, schedule, batch, model, view of its devices), its figure and plan."""
        self.simulated: dict[tuple, Plan] = {}

    def add(self, plans: Iterable[Plan]) -> bool:
        """Add the entries of ``plans`` not already held (the crossover's new searches, [Note:
        crossover] in :mod:`deepcee.planner.crossover`); returns whether any was new."""
        held = set(self.entries)
        new = [e for e in dict.fromkeys(_entry(p) for p in plans) if e not in held]
        self.entries += new
        return bool(new)

    def __call__(self, cluster: Cluster, model: ModelProfile, global_batch: int, *,
                 use_all_devices: bool = False) -> Plan | None:
        names = set(cluster.device_names)
        return self._best(cluster, model, global_batch, lambda used: not use_all_devices or used == names)

    def best_using(self, cluster: Cluster, model: ModelProfile, global_batch: int, devices: Iterable[str]
                   ) -> Plan | None:
        """The best entry that uses at least one of ``devices`` (the crossover's "with": [Note:
        crossover] in :mod:`deepcee.planner.crossover`), as :meth:`__call__` scores it."""
        wanted = frozenset(devices)
        return self._best(cluster, model, global_batch, lambda used: not wanted.isdisjoint(used))

    def _best(self, cluster: Cluster, model: ModelProfile, global_batch: int,
              accept: Callable[[set[str]], bool]) -> Plan | None:
        names = set(cluster.device_names)
        scored, found = self.scored, []
        for slots, split, sync, recompute, n, schedule, actions, m in self.entries:
            used = {d for devs in slots for d in devs}
            if not used <= names or not accept(used):
                continue
            view = self._view(cluster, used)
            layout = StageLayout(slots=slots, islands=(), label="sweep pool")
            for size in _sizes(global_batch, n):
                # a compact action list is kept where the microbatch count is its own
                same = actions and size * m == global_batch
                for sched in _schedules(schedule, bool(same)):
                    key = (slots, split, sync, recompute, size, sched, global_batch, model.name, view)
                    if key in scored:
                        found += [scored[key]] if scored[key] is not None else []
                        continue
                    scored[key] = None
                    try:
                        plan = build_plan(layout, split, cluster=cluster, model=model, global_batch=global_batch,
                                          microbatch_size=size, schedule=sched, sync=sync, recompute=recompute,
                                          actions=actions if sched == "compact" else ())
                    except ValueError:  # fewer samples per microbatch than devices on a stage
                        continue
                    est = self.cost_model.estimate(plan, cluster, model)
                    if all(need <= cluster.memory_bytes(d) for d, need in est.peak_memory_bytes.items()):
                        scored[key] = (est.iteration_s, plan, key)
                        found.append(scored[key])
        best = _best_simulated(sorted(found, key=lambda x: x[0])[: self.confirm], cluster, model, self.simulated)
        if best is not None:  # built on another cluster of the same view: this one's name and left-out devices
            used = set(best.devices)
            excluded = tuple(d for d in cluster.device_names if d not in used)
            if (best.cluster, best.excluded_devices) != (cluster.name, excluded):
                best = best.replace(cluster=cluster.name, excluded_devices=excluded)
        return best

    def _view(self, cluster: Cluster, devices: Iterable[str]) -> int:
        """The number of ``cluster``'s view of ``devices`` (a plan's figures depend on nothing else)."""
        return self.views.setdefault(cluster.view_key(devices), len(self.views))


def _best_simulated(cands: Sequence[tuple[float, Plan, tuple]], cluster: Cluster, model: ModelProfile,
                    cache: dict[tuple, Plan]) -> Plan | None:
    """The simulator's best of ``cands`` (figure, plan, its key in :attr:`PoolPlanner.scored`, which
    holds its devices' view: the plan's left-out devices may differ, its figures may not)."""
    best = None
    for _, plan, key in cands:
        got = cache.get(key)
        if got is None:
            got = cache[key] = plan.replace(estimate=to_estimate(simulate(plan, cluster, model, record=False), plan,
                                                                 cluster))
        if best is None or got.estimate.iteration_s < best.estimate.iteration_s:
            best = got
    return best
