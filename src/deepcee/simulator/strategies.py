"""What joins replicas, strategy by strategy, as message graphs on the shared network (torch-free).

Each ``run_*`` function schedules a strategy's processes on a :class:`~.replicas.Run`'s event
loop; :func:`~.replicas.simulate_replicas` runs the loop. The message patterns are the
runtime's, so the simulator times what the runtime does:

[Note: ps sync (simulator)]
``ps`` (exact): per layer segment, every holder pushes its gradient to its server (its
island's, else the nearest: :meth:`~.replicas.Run.server_of`); a server sums what it got
(server work), sends its partial sum to every other server, sums all partials (server work)
and sends the total back to its holders. A server serves segments in layer order.

[Note: relaxed rules (simulator)]
- ``model-averaging``: every replica runs local steps (pipeline, its stage all-reduces, its
  optimizer); after every ``period``-th local step it waits until all replicas got there, then
  per segment the first holder of the segment in each replica sends its parameters to the
  *root* (the segment's first holder in replica 0), which averages them (server work; with
  the Nesterov outer optimizer also the outer step) and sends the result back to each
  replica's first holder (its own replica's holders directly), which hands it on to the
  other holders of its replica: one copy per replica crosses the WAN; the runtime's gather
  and scatter ([Note: deterministic averaging] there). With ``overlap`` nobody waits at the
  sync point: [Note: overlapped averaging (simulator)] in :mod:`.overlap`.
- ``partial``: after each local step a replica waits for its group. Rounds are formed in
  arrival order: a round closes when ``max_group`` replicas wait (0: no bound), or all do, or
  ``window_s`` has passed since it opened and at least ``min_group`` wait; every
  ``full_sync_every``-th round and the last close only when every replica waits. The group
  averages as above (root: the first holder in its lowest replica); a group of one averages
  nothing. ``steps`` rounds are run; a replica runs one local step per round it joins.
- ``asgd-ga``: a replica runs ``accumulation_steps`` passes without optimizer, its stage
  all-reduces, then pushes ``1/S`` of every segment's gradient to each of the ``S`` servers
  (from the segment's first holder), all at once when its last device finished; a server
  applies pushes one at a time in delivery order (server work: the optimizer step of its
  ``1/S`` of the model), except that it holds a push back while applying it would leave a
  replica that is still computing more than ``staleness_bound`` updates behind; after an
  update it sends its ``1/S`` of every segment to every holder of the pushing replica, which
  resumes when all servers' parts arrived.

Server work counts :data:`SUM_FLOPS_PER_PARAMETER` per parameter and input summed (and
:data:`OUTER_FLOPS_PER_PARAMETER` for an outer Nesterov step) at the device's effective
FLOP/s: operation counts, not measurements, and a lower bound where the work is bound by
memory bandwidth, as the optimizer step's model is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepcee.simulator.network import Graph, Node
from deepcee.simulator.pipelines import StepTimes, segment_sync

if TYPE_CHECKING:  # replicas.py calls the run_* functions with its Run; only the type is needed here
    from deepcee.simulator.replicas import Run

SUM_FLOPS_PER_PARAMETER = 1.0
"""One addition per parameter for every input a server or root sums."""
OUTER_FLOPS_PER_PARAMETER = 6.0
"""DiLoCo's outer Nesterov step: the change, the momentum update and the step (about six
multiply-adds per parameter)."""



@dataclass(frozen=True, slots=True, kw_only=True)
class GroupRecord:
    """One round of ``partial``: who averaged, and when the round opened and closed."""

    round: int
    members: tuple[int, ...]
    full: bool
    open_s: float
    close_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class PushRecord:
    """One ``asgd-ga`` push a server applied."""

    server: str
    replica: int
    version: int
    """The server's version before the push."""
    staleness: int
    """Server updates since the replica pulled the model its gradient was computed on."""
    applied_s: float


def _chains(g: Graph, ready: Mapping[str, float]) -> dict[str, int]:
    """Per device, the node after which it is free: at first its arrival."""
    return {d: g.add(Node(device=d, ready_s=t, what="arrive")) for d, t in ready.items()}


def _resumes(run: Run, g: Graph, chains: Mapping[str, int], group: Sequence[int]) -> dict[int, float]:
    """Per replica of ``group``, when its last device left the graph."""
    return {r: max(g.nodes[chains[d]].fired_s for d in run.pipes[r].devices) for r in group}


# -- exact -----------------------------------------------------------------------------------


def _exact_graph(run: Run, g: Graph, ready: Mapping[str, float], step: int, t0: float) -> dict[str, int]:
    """Every segment's gradient combination over all its holders, in layer order per device."""
    chains = _chains(g, ready)
    server_prev: dict[str, int] = {}
    for seg in run.segments:
        kind = segment_sync(run.plan, seg)
        holders = seg.devices
        if len(holders) <= 1 or kind == "none":
            continue
        nbytes = run.model.gradient_bytes(seg.start, seg.stop)
        what = f"step {step} layers [{seg.start}, {seg.stop})"
        if kind == "ps":
            _ps(run, g, chains, server_prev, holders, nbytes, run.model.parameters(seg.start, seg.stop), what, t0)
            continue
        c = g.add(Node(device=holders[0], collective=(holders, nbytes, kind), what=f"{what} {kind}"))
        for h in holders:
            g.link(chains[h], c)
        for h in holders:
            chains[h] = g.add(Node(device=h))
            g.link(c, chains[h])
    return chains


def _ps(run: Run, g: Graph, chains: dict[str, int], server_prev: dict[str, int], holders: Sequence[str],
        nbytes: float, params: int, what: str, t0: float) -> None:
    """[Note: ps sync (simulator)] for one segment."""
    servers = run.plan.servers
    mine = {s: [h for h in holders if run.server_of(h) == s] for s in servers}
    gather, total = {}, {}
    for s in servers:
        flops = run.server_flops(s, t0)
        gather[s] = g.add(Node(device=s, queued=True, ready_s=t0, what=f"{what} server sum",
                               work_s=len(mine[s]) * params * SUM_FLOPS_PER_PARAMETER / flops))
        total[s] = g.add(Node(device=s, queued=True, what=f"{what} server total",
                              work_s=len(servers) * params * SUM_FLOPS_PER_PARAMETER / flops))
        if s in server_prev:
            g.link(server_prev[s], gather[s])
        for h in mine[s]:
            g.link(chains[h], gather[s], nbytes)
        run.server_memory[s] = max(run.server_memory[s], 2 * nbytes)
    for s in servers:
        for s2 in servers:
            g.link(gather[s], total[s2], nbytes)
    for s in servers:
        server_prev[s] = total[s]
        for h in mine[s]:
            chains[h] = g.add(Node(device=h))
            g.link(total[s], chains[h], nbytes)


def _exact_optimizer(run: Run, r: int, d: int, at_s: float, step: int) -> float:
    """Device ``d`` of replica ``r`` steps every segment it holds; the end."""
    pipe, name, t = run.pipes[r], run.pipes[r].devices[d], at_s
    for seg in run.segments:
        if name in seg.holders[r]:
            shards = len(seg.devices) if segment_sync(run.plan, seg) == "zero2" else 1
            t += pipe.optimizer_s(d, t, step, start=seg.start, stop=seg.stop, shards=shards)
    return t


def run_exact(run: Run, steps: int) -> None:
    """Every step: all pipelines from one start, the segments' combination, the optimizer steps."""
    loop = run.loop

    def step(k: int, t0: float) -> None:
        ready: dict[str, float] = {}
        arrive = []
        for pipe in run.pipes:
            list_end = pipe.run_pass(t0, k)
            ready.update(zip(pipe.devices, list_end, strict=True))
            arrive.append(max(list_end))
        g = Graph(loop, run.net)
        chains = _exact_graph(run, g, ready, k, t0)
        ends: dict[str, float] = {}
        for r, pipe in enumerate(run.pipes):
            for d, name in enumerate(pipe.devices):
                g.on_fire[chains[name]] = lambda t, r=r, d=d, name=name: ends.__setitem__(
                    name, _exact_optimizer(run, r, d, t, k))

        def done(g: Graph) -> None:
            resume = _resumes(run, g, chains, range(len(run.pipes)))
            end = max(ends.values())
            for r in range(len(run.pipes)):
                run.crossed(r, arrive[r], max(arrive), resume[r])
                run.step_done(r, end)
            if k + 1 < steps:
                loop.at(end, lambda t: step(k + 1, t))

        g.on_done = done
        g.start()

    loop.at(run.start_s, lambda t: step(0, t))


# -- averaging (model averaging, partial) -------------------------------------------------------


def _average(run: Run, group: Sequence[int], ready: Mapping[str, float], what: str,
             then: Callable[[dict[int, float]], None]) -> None:
    """Average every segment over the replicas of ``group`` (sorted), gather to a root and
    scatter; ``then`` gets each replica's resume time."""
    g = Graph(run.loop, run.net)
    chains = _chains(g, ready)
    outer = run.plan.strategy.kind == "model-averaging" and run.plan.strategy.outer_optimizer == "nesterov"
    for seg in run.segments:
        holders = [seg.holders[r] for r in group]
        root = holders[0][0]
        nbytes, params = run.model.gradient_bytes(seg.start, seg.stop), run.model.parameters(seg.start, seg.stop)
        flops = len(group) * SUM_FLOPS_PER_PARAMETER + (OUTER_FLOPS_PER_PARAMETER if outer else 0.0)
        mean = g.add(Node(device=root, queued=True, work_s=params * flops / run.server_flops(root, run.loop.now),
                          what=f"{what} layers [{seg.start}, {seg.stop}) average"))
        if outer:
            run.server_memory[root] = max(run.server_memory[root], 2 * nbytes)
        for hs in holders:
            g.link(chains[hs[0]], mean, nbytes)
        for hs in holders:  # to each replica's delegate, which hands it on inside its replica
            first = None
            for h in hs:
                node = g.add(Node(device=h))
                g.link(mean if first is None or hs[0] == root else first, node, nbytes)
                if h != hs[0]:
                    g.link(chains[h], node)
                chains[h] = node
                first = node if first is None else first
    g.on_done = lambda g: then(_resumes(run, g, chains, group))
    g.start()


def _ready(run: Run, r: int, times: Sequence[float]) -> dict[str, float]:
    return dict(zip(run.pipes[r].devices, times, strict=True))


def run_model_averaging(run: Run, steps: int) -> None:
    loop, period, n = run.loop, run.plan.strategy.period, len(run.pipes)
    count = [0] * n
    arrived: dict[int, StepTimes] = {}

    def start(r: int, t: float) -> None:
        st = run.pipes[r].local_step(t, count[r])
        count[r] += 1
        loop.at(max(st.end), lambda t2: after(r, st, t2))

    def finish(r: int, t: float) -> None:
        run.step_done(r, t)
        if count[r] < steps:
            start(r, t)

    def after(r: int, st: StepTimes, t: float) -> None:
        if count[r] % period:
            finish(r, t)
            return
        arrived[r] = st
        if len(arrived) < n:
            return
        came = {q: max(s.end) for q, s in arrived.items()}
        ready = {d: x for q, s in arrived.items() for d, x in _ready(run, q, s.end).items()}
        arrived.clear()

        def resumed(resume: dict[int, float]) -> None:
            for q, x in resume.items():
                run.crossed(q, came[q], t, x)
                loop.at(x, lambda t2, q=q: finish(q, t2))

        _average(run, range(n), ready, f"average after local step {count[r]}", resumed)

    for r in range(n):
        loop.at(run.start_s, lambda t, r=r: start(r, t))


def run_partial(run: Run, steps: int) -> None:
    """SDPipe's partial averaging; see [Note: relaxed rules (simulator)]."""
    Partial(run, steps).begin()


class Partial:
    """The coordinator and the replicas of a ``partial`` run."""

    def __init__(self, run: Run, rounds: int) -> None:
        self.run, self.rounds, self.s = run, rounds, run.plan.strategy
        self.n = len(run.pipes)
        self.count = [0] * self.n
        self.waiting: list[tuple[float, int]] = []
        self.opened: float | None = None
        self.timer_for: float | None = None
        self.round = 0

    def begin(self) -> None:
        for r in range(self.n):
            self.run.loop.at(self.run.start_s, lambda t, r=r: self.start(r, t))

    def start(self, r: int, t: float) -> None:
        st = self.run.pipes[r].local_step(t, self.count[r])
        self.count[r] += 1
        self.run.loop.at(max(st.end), lambda t2: self.arrive(r, t2))

    def arrive(self, r: int, t: float) -> None:
        self.waiting.append((t, r))
        self.waiting.sort()
        if self.opened is None:
            self.opened = t
        self.check(t)

    def full(self, j: int) -> bool:
        return (j + 1) % self.s.full_sync_every == 0 or j == self.rounds - 1

    def closes(self, t: float) -> int:
        n = len(self.waiting)
        if n == 0:
            return 0
        if n == self.n:
            return n
        if self.full(self.round):
            return 0
        cap = self.s.max_group or self.n
        if n >= cap:
            return cap
        expired = self.opened is not None and t >= self.opened + self.s.window_s
        return n if expired and n >= min(self.s.min_group, self.n) else 0

    def check(self, t: float) -> None:
        while self.round < self.rounds:
            take = self.closes(t)
            if not take:
                break
            members, self.waiting = self.waiting[:take], self.waiting[take:]
            self.form(members, t)
            self.round += 1
            self.opened = t if self.waiting else None
        if self.opened is not None and self.round < self.rounds and self.timer_for != self.opened:
            self.timer_for = self.opened
            self.run.loop.at(self.opened + self.s.window_s, self.check)

    def form(self, members: list[tuple[float, int]], t: float) -> None:
        group = sorted(r for _, r in members)
        came = {r: x for x, r in members}
        j, run = self.round, self.run
        run.groups.append(GroupRecord(round=j, members=tuple(group), full=self.full(j),
                                      open_s=self.opened if self.opened is not None else t, close_s=t))
        final = j == self.rounds - 1

        def resumed(resume: dict[int, float]) -> None:
            for r, x in resume.items():
                run.crossed(r, came[r], t, x)
                run.loop.at(x, lambda t2, r=r: self.finish(r, t2, final))

        if len(group) == 1:
            resumed({group[0]: t})
            return
        ready = {d: t for r in group for d in run.pipes[r].devices}
        _average(run, group, ready, f"round {j}", resumed)

    def finish(self, r: int, t: float, final: bool) -> None:
        self.run.step_done(r, t)
        if not final:
            self.start(r, t)


# -- asgd-ga ------------------------------------------------------------------------------------


def run_asgd_ga(run: Run, steps: int) -> None:
    """Cloudless-Training's ASGD-GA; see [Note: relaxed rules (simulator)]."""
    AsgdGa(run, steps).begin()


class AsgdGa:
    """The replicas and the parameter servers of an ``asgd-ga`` run."""

    def __init__(self, run: Run, steps: int) -> None:
        self.run, self.steps = run, steps
        s = run.plan.strategy
        self.k, self.bound = s.accumulation_steps, s.staleness_bound
        self.servers = run.plan.servers
        n = len(run.pipes)
        self.rounds = math.ceil(steps / self.k)
        self.count = [0] * n
        self.version = dict.fromkeys(self.servers, 0)
        self.pulled = {s: [0] * n for s in self.servers}
        self.pushed = {s: [0] * n for s in self.servers}
        self.issued: dict[str, dict[int, float]] = {s: {} for s in self.servers}
        """Server -> replica -> delivery of its pending push."""
        self.computing = [True] * n
        """Whether a replica computes: from the pull of its last server until its next push. The
        runtime's servers judge this from the pushes each received; with several servers that
        can make each server wait for a replica that waits for another server, so the
        simulator uses the replicas' own state (a server learns it through the store)."""
        self.held: dict[str, dict[int, float]] = {s: {} for s in self.servers}
        self.busy = dict.fromkeys(self.servers, False)
        self.came = [0.0] * n
        self.hold = [0.0] * n
        self.pulls: list[list[float]] = [[] for _ in range(n)]
        model = run.model
        for srv in self.servers:
            run.server_memory[srv] = model.state_bytes(0, model.num_layers) / len(self.servers)

    def begin(self) -> None:
        for r in range(len(self.run.pipes)):
            self.run.loop.at(self.run.start_s, lambda t, r=r: self.start(r, t))

    def start(self, r: int, t: float) -> None:
        c = self.count[r]
        round_end = (c + 1) % self.k == 0 or c + 1 == self.steps
        st = self.run.pipes[r].local_step(t, c, sync=round_end, optimizer=False)
        self.count[r] += 1
        if round_end:
            self.run.loop.at(max(st.end), lambda t2: self.push(r, t2))
        else:
            self.run.loop.at(max(st.end), lambda t2: self.local_done(r, t2))

    def local_done(self, r: int, t: float) -> None:
        self.run.step_done(r, t)
        self.start(r, t)

    def push(self, r: int, t: float) -> None:
        run, share = self.run, len(self.servers)
        self.came[r], self.hold[r], self.pulls[r] = t, 0.0, []
        self.computing[r] = False
        for srv in self.servers:
            arrive = t
            for seg in run.segments:
                nbytes = run.model.gradient_bytes(seg.start, seg.stop) / share
                arrive = max(arrive, run.net.send(seg.holders[r][0], srv, nbytes, t, f"replica {r} push"))
            self.issued[srv][r] = arrive
            run.loop.at(arrive, lambda t2, srv=srv: self.try_apply(srv, t2))
        for srv in self.servers:  # r stopped computing: a held push may now be allowed
            self.try_apply(srv, t)

    def allowed(self, srv: str, r: int) -> bool:
        for q in range(len(self.run.pipes)):
            if q != r and self.computing[q] and self.version[srv] + 1 - self.pulled[srv][q] > self.bound:
                return False
        return True

    def try_apply(self, srv: str, t: float) -> None:
        if self.busy[srv]:
            return
        for _, r in sorted((d, q) for q, d in self.issued[srv].items() if d <= t):
            if self.allowed(srv, r):
                self.apply(srv, r, t)
                return
            self.held[srv].setdefault(r, t)

    def apply(self, srv: str, r: int, t: float) -> None:
        run = self.run
        held = self.held[srv].pop(r, t)
        self.hold[r] = max(self.hold[r], t - held)
        del self.issued[srv][r]
        dev = run.cluster.device(srv)
        from deepcee.simulator.engine import optimizer_step_s

        work = optimizer_step_s(run.model, 0, run.model.num_layers, run.cluster.kinds[dev.kind], dev.slowdown)
        end = run.net.work(srv, t, work / len(self.servers), f"server {srv} applies replica {r}")
        self.busy[srv] = True
        run.loop.at(end, lambda t2: self.applied(srv, r, t2))

    def applied(self, srv: str, r: int, t: float) -> None:
        run = self.run
        run.pushes.append(PushRecord(server=srv, replica=r, version=self.version[srv],
                                     staleness=self.version[srv] - self.pulled[srv][r], applied_s=t))
        self.version[srv] += 1
        self.pulled[srv][r] = self.version[srv]
        self.pushed[srv][r] += 1
        self.busy[srv] = False
        last = t
        for seg in run.segments:
            nbytes = run.model.gradient_bytes(seg.start, seg.stop) / len(self.servers)
            for h in seg.holders[r]:
                last = max(last, run.net.send(srv, h, nbytes, t, f"server {srv} to replica {r}"))
        self.pulls[r].append(last)
        if len(self.pulls[r]) == len(self.servers):
            resume = max(self.pulls[r])
            run.crossed(r, self.came[r], self.came[r] + self.hold[r], resume)
            run.loop.at(resume, lambda t2: self.resumed(r, t2))
        self.try_apply(srv, t)

    def resumed(self, r: int, t: float) -> None:
        self.run.step_done(r, t)
        if self.count[r] < self.steps:
            self.computing[r] = True
            self.start(r, t)


__all__ = ["OUTER_FLOPS_PER_PARAMETER", "SUM_FLOPS_PER_PARAMETER", "run_asgd_ga", "run_exact",
           "run_model_averaging", "run_partial"]
