"""How a training runtime behaves, as stated properties the simulator reads (torch-free).

Two runtimes that run the same plan on the same hardware can take different times: one
overlaps its sends with compute, the other waits for each send in the stage's own instruction
stream; one all-reduces with a handshake per ring step, another without; one ends every step
with a collective that lines all devices up, another lets each stage run on. A
:class:`RuntimeModel` states these properties; :func:`deepcee.simulator.engine.simulate` takes
one (``runtime=``) and times the plan as that runtime would run it.

Declared runtimes (:func:`runtime_model`):

- ``deepcee``: deepcee's own runtime (:mod:`deepcee.runtime`), per launch mode
  (:func:`deepcee_runtime`; its [Note: deepcee's runtime behaviour] says which runtime code
  each property describes). The default of the simulator is mode ``realnet``: deepcee over
  real TCP with step records out of band, the behaviour a WAN deployment sees.
- ``deepcee-cuda``: deepcee's runtime on CUDA devices (NCCL), per launch mode
  (:func:`deepcee_runtime` with ``device="cuda"``): receives posted in order, send buffers
  freed as their sends complete, NCCL's ring all-reduce. The planner and the simulator take it
  for clusters whose devices are GPUs (:func:`runtime_for`, [Note: which runtime plans a cluster]).
- ``deepspeed``: a DeepSpeed-style pipeline runtime (blocking, in-stream sends and receives;
  NCCL-style ring all-reduce without a per-step handshake; global-norm gradient clipping over
  the whole pipeline; a collective at the end of every step), so a plan can be compared as
  if run by it (``deepcee simulate --runtime deepspeed``).

[Note: deepcee's runtime behaviour]
What :mod:`deepcee.runtime` does, property by property (the runtime reads this declaration
where it acts on it, and ``tests/unit/test_runtime_model.py`` holds the two together):

- sends: ``isend`` per piece, waited for only at the end of the step
  (:meth:`deepcee.runtime.p2p.P2P.end_step`): ``async``;
- receives: every receive of a step posted when the step starts on gloo
  (:meth:`~deepcee.runtime.p2p.P2P.begin_step`): ``at-step-start``. gloo's TCP transport
  sends a piece only after the receiver's "ready" notice arrived, so over a real network a
  piece starts no earlier than the receiver's step start plus one link latency
  (``receive_handshake``). In mode ``emulated`` the notice crosses loopback (no modelled
  latency) and the link shaper alone sets delivery;
- gradient all-reduce: gloo's ring over the stage's devices; each ring step waits for the
  receiver's "ready", one one-way latency more per step than the alpha-beta ring
  (``allreduce_handshake_latencies = 1``; measured in mode ``realnet``: about two one-way
  latencies more than the ring model with two ranks). In mode ``emulated`` the runtime waits
  for :func:`deepcee.comm.allreduce_s` itself (``allreduce = "modelled"``: agreement there
  holds by construction);
- the end of a step (:func:`deepcee.runtime.outputs.gather`): mode ``emulated``
  gathers every rank's record with a gloo collective over loopback (``step_barrier``: the
  next step starts on every device together); mode ``realnet`` publishes the records in the
  launch's file store, out of band, and only rank 0 (the plan's first device) waits for all of
  them (``first_waits_for_all``; every other device starts its next step when its own ends);
  mode ``real`` gathers them with gloo over the network (a barrier of about four one-way
  latencies, [Note: metrics out of band] in :mod:`deepcee.runtime.outputs`);
- per-step costs: the optimizer step, paced like compute on an emulated device (the profile's
  measured per-layer times, else the FLOP estimate), no gradient clipping, and the step's
  bookkeeping (``step_overhead_s``: the records' gather or publication, measured by the
  profiler, :func:`deepcee.profiler.run.step_overhead_wall_s`);
- memory: every rank builds every layer of the net, then trains its stage's
  (``holds_whole_model``), and holds every receive buffer of a step from its start.

On CUDA (NCCL), and on CPU/gloo with :attr:`deepcee.runtime.job.TrainConfig.receives` set to
``in-order``, the runtime posts each receive when the schedule reaches it and frees each send
buffer once its send completed ([Note: in-order receives] in :mod:`deepcee.runtime.p2p`):

- receives: ``in-order``, with no receive handshake to model (a piece's transfer starts
  when both the sender's ``isend`` and the receiver's ``irecv`` are posted; the receiver
  posts when it needs the piece, so the handshake's latency is not hidden as with receives
  posted at the step start, and the simulator's in-order receive already makes the receiver wait);
- memory: communication buffers only for the microbatches in flight (``in_flight``, not
  ``2 x num_microbatches``: :func:`deepcee.simulator.memory.runtime_buffer_bytes`); the other
  layers' parameters stay on the host (``holds_whole_model`` counts only where a device's
  memory is the host's, never on a GPU);
- gradient all-reduce: NCCL's ring (:func:`deepcee.comm.allreduce_s`, no per-step handshake);
- sends, the end of a step and the per-step costs: as on CPU in the same launch mode.

The CUDA declaration states what the code does; no CUDA run was timed against it on this
project's machines (they have no GPU): the CPU/gloo in-order path is tested for exactness
(``tests/dist/test_runtime_inorder.py``), not for time.

[Note: which runtime plans a cluster]
:func:`runtime_for` decides, for the planner (:func:`deepcee.planner.search.plan_training`,
:class:`deepcee.planner.cost_model.AnalyticCostModel`) and for the simulator when no runtime
is given (:func:`deepcee.simulator.engine.simulate`): a cluster whose devices are GPUs is run by
``deepcee-cuda``, any other by :data:`DEFAULT_RUNTIME`. A cluster's devices are GPUs unless the
cluster says it is emulated (:attr:`deepcee.cluster.Cluster.emulation`: CPU worker processes)
or the model profile measured one of its device kinds in host memory
(:attr:`deepcee.profile.DeviceMemory.host_memory`: a CPU device). Fidelity checks against
emulated runs name their runtime explicitly (:mod:`deepcee.profiler.fidelity`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, get_args

from deepcee.errors import SpecError

if TYPE_CHECKING:
    from deepcee.cluster import Cluster
    from deepcee.profile import ModelProfile

SendMode = Literal["async", "blocking"]
"""``async``: a send takes no device time (the transfer runs beside compute); ``blocking``:
the sending device waits until its last piece was delivered (sends in the instruction stream)."""
RecvPosting = Literal["at-step-start", "in-order"]
"""When a device posts its receives: all at the start of the step, or as the schedule reaches them."""
AllreduceMode = Literal["ring", "modelled"]
"""``ring``: the transport's own ring all-reduce (:func:`deepcee.comm.allreduce_s` plus the
handshakes); ``modelled``: the runtime waits for :func:`deepcee.comm.allreduce_s` itself."""
RuntimeName = Literal["deepcee", "deepcee-cuda", "deepspeed"]
RUNTIME_NAMES: tuple[RuntimeName, ...] = get_args(RuntimeName)
LaunchMode = Literal["emulated", "realnet", "real"]
LAUNCH_MODES: tuple[LaunchMode, ...] = get_args(LaunchMode)
DeviceType = Literal["cpu", "cuda"]
DEVICE_TYPES: tuple[DeviceType, ...] = get_args(DeviceType)


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeModel:
    """The behaviour of one training runtime, as the simulator times it."""

    name: str
    """Who: ``deepcee (mode realnet)``, ``deepspeed-style``, ..."""
    sends: SendMode = "async"
    receives: RecvPosting = "at-step-start"
    receive_handshake: bool = True
    """A piece starts serialising no earlier than the receiver posted its receive plus the
    link's latency (the receiver's "ready" notice; gloo over TCP). With receives posted at the
    step start this costs only the first pieces of a step."""
    allreduce: AllreduceMode = "ring"
    allreduce_handshake_latencies: float = 1.0
    """Extra one-way latencies (of the ring's slowest edge) per ring step of the all-reduce."""
    step_barrier: bool = False
    """Every device starts the next step together (a collective at the end of each step);
    ``False``: each device starts its next step when its own step is done."""
    barrier_latencies: float = 0.0
    """What that collective costs, in one-way latencies of the slowest link between a device
    and the first device of the plan."""
    first_waits_for_all: bool = False
    """Without a step barrier: the plan's first device (rank 0, which gathers the step records)
    starts its next step only when every device has ended the step."""
    gradient_clipping: bool = False
    """Global-norm clipping: one scalar all-reduce over one device per stage after the
    gradient synchronisation, before any optimizer step."""
    step_overhead_s: float = 0.0
    """Bookkeeping per device per step beyond the optimizer (emulated seconds)."""
    holds_whole_model: bool = False
    """Every rank builds every layer on the host (then trains its stage's, moved to its device):
    the other layers' parameters count in a device whose memory is the host's (a CPU device,
    :attr:`deepcee.profile.DeviceMemory.host_memory`)."""
    description: str = ""

    def __post_init__(self) -> None:
        for name, value, known in (("sends", self.sends, get_args(SendMode)),
                                   ("receives", self.receives, get_args(RecvPosting)),
                                   ("allreduce", self.allreduce, get_args(AllreduceMode))):
            if value not in known:
                raise SpecError(f"runtime {self.name!r}: {name} must be one of {', '.join(known)}, got {value!r}",
                                field=name)
        for name in ("allreduce_handshake_latencies", "barrier_latencies", "step_overhead_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise SpecError(f"runtime {self.name!r}: must be a number >= 0, got {v!r}", field=name)
        if self.receive_handshake and self.receives != "at-step-start":
            raise SpecError(f"runtime {self.name!r}: a receive handshake is modelled for receives posted at the "
                            "step start only (a rendezvous with in-order receives is not)", field="receive_handshake")

    def with_overhead(self, step_overhead_s: float) -> RuntimeModel:
        """The same runtime with another per-step bookkeeping cost."""
        return replace(self, step_overhead_s=step_overhead_s)


def deepcee_runtime(mode: LaunchMode = "realnet", *, step_overhead_s: float = 0.0,
                    device: DeviceType = "cpu") -> RuntimeModel:
    """deepcee's own runtime in launch ``mode`` (see [Note: deepcee's runtime behaviour]).

    - ``emulated``: no transport handshake (loopback), the all-reduce waits for the model,
      a collective over loopback ends every step;
    - ``realnet``: gloo over real TCP (handshakes), step records through the launch's file
      store, so no collective lines the devices up between steps;
    - ``real``: as ``realnet``, but the records are gathered with gloo over the network (an
      all-gather of sizes then a gather: about four one-way latencies, all devices in step).

    ``step_overhead_s``: the records' bookkeeping per step (emulated seconds). ``device``:
    ``cuda`` gives the CUDA runtime of that mode (see [Note: deepcee's runtime behaviour]).
    """
    if mode not in LAUNCH_MODES:
        raise SpecError(f"must be one of {', '.join(LAUNCH_MODES)}, got {mode!r}", field="mode")
    if device not in DEVICE_TYPES:
        raise SpecError(f"must be one of {', '.join(DEVICE_TYPES)}, got {device!r}", field="device")
    on_cpu = _deepcee_cpu(mode, step_overhead_s)
    if device == "cpu":
        return on_cpu
    return replace(on_cpu, name=f"deepcee on CUDA (mode {mode})", receives="in-order", receive_handshake=False,
                   allreduce="modelled" if mode == "emulated" else "ring", allreduce_handshake_latencies=0.0,
                   description="async sends freed as they complete, receives posted in order, NCCL ring "
                               "all-reduce, buffers for the microbatches in flight only")


def _deepcee_cpu(mode: LaunchMode, step_overhead_s: float) -> RuntimeModel:
    if mode == "emulated":
        return RuntimeModel(name="deepcee (mode emulated)", receive_handshake=False, allreduce="modelled",
                            allreduce_handshake_latencies=0.0, step_barrier=True, step_overhead_s=step_overhead_s,
                            holds_whole_model=True,
                            description="async sends, receives posted at the step start, links and all-reduce "
                                        "emulated by the runtime's own models, records gathered over loopback")
    if mode == "realnet":
        return RuntimeModel(name="deepcee (mode realnet)", step_overhead_s=step_overhead_s, holds_whole_model=True,
                            first_waits_for_all=True,
                            description="async sends, receives posted at the step start (gloo's ready notice), "
                                        "gloo ring all-reduce, records out of band")
    return RuntimeModel(name="deepcee (mode real)", step_barrier=True, barrier_latencies=4.0,
                        step_overhead_s=step_overhead_s, holds_whole_model=True,
                        description="async sends, receives posted at the step start (gloo's ready notice), "
                                    "gloo ring all-reduce, records gathered with gloo")


DEEPSPEED = RuntimeModel(
    name="deepspeed-style", sends="blocking", receives="in-order", receive_handshake=False, allreduce="ring",
    allreduce_handshake_latencies=0.0, step_barrier=True, barrier_latencies=2.0, gradient_clipping=True,
    description="blocking in-stream sends and receives, ring all-reduce, global-norm gradient clipping over the "
                "pipeline, loss broadcast from the last stage at the end of every step")
"""A DeepSpeed-style pipeline runtime: ``PipelineEngine`` runs ``SendActivation`` /
``RecvActivation`` / ``SendGrad`` / ``RecvGrad`` as instructions of the stage's own stream,
clips the global gradient norm (an all-reduce across the pipeline) and broadcasts the loss
from the last stage after every batch (one collective: two one-way latencies)."""


def runtime_model(name: str, *, mode: LaunchMode = "realnet", step_overhead_s: float = 0.0) -> RuntimeModel:
    """A declared runtime by name (``deepcee`` and ``deepcee-cuda``, in ``mode``; ``deepspeed``)."""
    if name == "deepcee":
        return deepcee_runtime(mode, step_overhead_s=step_overhead_s)
    if name == "deepcee-cuda":
        return deepcee_runtime(mode, step_overhead_s=step_overhead_s, device="cuda")
    if name == "deepspeed":
        return DEEPSPEED.with_overhead(step_overhead_s)
    raise SpecError(f"unknown runtime {name!r} (known: {', '.join(RUNTIME_NAMES)})", field="--runtime")


DEFAULT_RUNTIME = deepcee_runtime("realnet")
"""What :func:`deepcee.simulator.engine.simulate` assumes unless told otherwise."""

CUDA_RUNTIME = deepcee_runtime("realnet", device="cuda")
"""deepcee's runtime on GPUs, as :func:`runtime_for` gives it for a cluster of GPUs."""


def on_gpus(cluster: Cluster, model: ModelProfile | None = None) -> bool:
    """Whether ``cluster``'s devices are GPUs ([Note: which runtime plans a cluster])."""
    if cluster.emulation:
        return False
    if model is None:
        return True
    for kind in cluster.kinds:
        over = model.memory_overhead(kind)
        if over is not None and over.host_memory:
            return False
    return True


def runtime_for(cluster: Cluster, model: ModelProfile | None = None) -> RuntimeModel:
    """The runtime that runs plans on ``cluster`` ([Note: which runtime plans a cluster])."""
    return CUDA_RUNTIME if on_gpus(cluster, model) else DEFAULT_RUNTIME
