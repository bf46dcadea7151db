"""Every limit on an input value, in one table: the field, its type, its range and why.

Torch-free. A :class:`Limit` checks one value (type, finiteness, range) and says what is wrong
in one line; the readers (:class:`~deepcee.inputs.fields.Fields`), the model-spec parser and
the CLI's argument types (:mod:`deepcee.cliargs`) all check through these objects, so a
range is written once. :data:`LIMITS` lists them for ``docs/file-formats.md`` (the table there
is :func:`markdown_table`; a test keeps the two equal).

Two kinds of bound:

- *physical*: the widest values a real cluster, model or run could have, several orders of
  magnitude beyond today's hardware; wider values only overflow sums and products (``1e308``
  bytes/s makes a transfer time 0, ``1e308`` FLOP/s x a count is ``inf``).
- *work*: sizes above which one command would take more than a minute or more memory than the
  project machine (2 cores, 24 GiB) has. Measured by ``benchmarks/input_limits.py``; the
  numbers and the sizes they were measured at are in ``docs/file-formats.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

GIB = 1024**3


def show(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error message stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True, kw_only=True)
class Limit:
    """The range of one kind of input number. ``check`` returns the value as ``int`` or ``float``
    or raises ``ValueError`` with a one-line reason (callers add file and field)."""

    name: str
    """What the number is (the docs table's first column)."""
    lo: float
    hi: float
    integer: bool = False
    lo_open: bool = False
    """``True``: ``lo`` itself is not allowed (``> lo``)."""
    hi_open: bool = False
    unit: str = ""
    why: str = ""
    fields: str = ""
    """Where it applies (file keys, flags), for the docs table."""

    def describe(self) -> str:
        left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        unit = f" {self.unit}" if self.unit else ""
        return f"{left}{_num(self.lo)}, {_num(self.hi)}{right}{unit}"

    def check(self, value: Any, *, shown: str | None = None) -> int | float:
        """``value`` if it is a number of the right type inside the range, else ``ValueError``
        (messages quote ``shown``, the value as the user wrote it, when given)."""
        kind = "an integer" if self.integer else "a number"
        text = show(value) if shown is None else shown
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected {kind}, got {text} ({type(value).__name__})")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"must be a finite number in {self.describe()}, got {text}")
        if self.integer and isinstance(value, float) and value != int(value):
            raise ValueError(f"expected {kind}, got {text}")
        if not self.contains(value):
            raise ValueError(f"must be in {self.describe()}, got {text}")
        return int(value) if self.integer else float(value)

    def scaled(self, factor: float, unit: str) -> Limit:
        """This limit for a value given in another unit: ``value x factor`` is in this limit's unit
        (``LATENCY.scaled(1e-3, "ms")`` for a ``latency_ms`` key)."""
        return Limit(name=self.name, lo=self.lo / factor, hi=self.hi / factor, integer=self.integer,
                     lo_open=self.lo_open, hi_open=self.hi_open, unit=unit, why=self.why, fields=self.fields)

    def contains(self, value: float) -> bool:
        try:
            v = float(value)
        except OverflowError:  # an int beyond float range
            return False
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below


def _num(x: float) -> str:
    if x == int(x) and abs(x) < 1e10:
        return f"{int(x):,}"
    return f"{x:g}"


# -- work limits (measured: benchmarks/input_limits.py, docs/file-formats.md) ---------------

MAX_DEVICES = 2048
"""Devices in one cluster. Planning ``gpt2`` took 28 CPU s with 2,048 devices in one island;
with 4,096 it took 12 s in 16 islands but 56 s in 4 and 101 s (2.6 GiB) in one. The planner
must handle 1,024 in 16 islands (issue 10): 10 s."""
MAX_DEVICES_PER_NODE = 1024
"""Devices of one ``[[nodes]]`` entry (real servers hold at most 16): a node of 1,024 devices
took 7 CPU s to plan, of 2,048 22 s."""
MAX_GLOBAL_BATCH = 2**20
"""Samples per step: planning ``gpt2`` at 2**20 took 3 CPU s on ``cee-testbed`` and 9 s on 1,024
devices; at 2**24, 49 s (1.3 GiB) on ``cee-testbed``."""
MAX_LAYERS = 1024
"""Layers of a model (blocks, as the planner sees them); see also :data:`PLANNER_MEMORY_BYTES`."""
PLANNER_BYTES_PER_CELL = 1200
"""Planner memory per (cluster device x layer-range cell): its range tables hold
``(layers + 1)**2`` cells for each candidate stage; 1.1 KB measured on ``cee-testbed`` at 130 to
514 layers and on 1,024 devices at 34 to 66 layers (an upper estimate)."""
PLANNER_MEMORY_BYTES = 8 * GIB
"""Most memory a planning run may need: a third of the project machine's 24 GiB."""
MAX_SIMULATION_WORK = 1_000_000
"""Simulator work of one ``deepcee simulate`` (iterations x devices x compute actions of each
device's stage): about 17 CPU us and 800 bytes each, so 17 s and 0.8 GiB."""
MAX_SCHEDULE_CELLS = 50_000
"""Stages x microbatches of one ``deepcee schedule show``: 0.1 CPU ms each, so 5 s."""
MAX_TOML_BYTES = 4 * 2**20
"""Size of a hand-written TOML file: tomllib reads about 1 MB/s (a 16,384-device cluster is 0.26 MB)."""
MAX_JSON_BYTES = 32 * 2**20
"""Size of a JSON file: 32 MiB parse in about 1 s (a 10**6-point trace is 28 MiB)."""
MAX_DEPTH = 32
"""Nesting of JSON/TOML values; deepcee's own files nest at most 7 deep."""
MAX_TEXT_CHARS = 100_000
"""Characters of one string value (descriptions, names, explanations)."""
MAX_NAME_CHARS = 200
"""Characters of a name (device, node, island, kind, model, system)."""


# -- the table ------------------------------------------------------------------------------

_PHYSICAL = "far beyond real hardware; wider values only overflow sums and products"

PEAK_FLOPS = Limit(name="peak compute", lo=0, lo_open=True, hi=1e18, unit="FLOP/s",
                   fields="kinds.*.peak_tflops (x 1e12), peak_flops_per_s", why=_PHYSICAL)
MEMORY = Limit(name="device memory", lo=0, lo_open=True, hi=2.0**50, unit="bytes",
               fields="kinds.*.memory_gib (x 2**30), memory_bytes", why=_PHYSICAL + " (1 PiB)")
FRACTION = Limit(name="achievable fraction", lo=0, lo_open=True, hi=1,
                 fields="kinds.*.achievable_fraction", why="a fraction of peak")
OVERHEAD = Limit(name="per-layer overhead", lo=0, hi=1, unit="s",
                 fields="kinds.*.per_layer_overhead_us (x 1e-6), per_layer_overhead_s",
                 why="a kernel launch costs microseconds; one second per layer is no device")
SLOWDOWN = Limit(name="slowdown", lo=1e-6, hi=1e6, fields="nodes[].slowdown, devices[].slowdown",
                 why="compute time multiplier; keeps device speeds finite and non-zero")
LATENCY = Limit(name="link latency", lo=0, hi=60, unit="s",
                fields="latency_s / _ms / _us (islands, nodes, links)",
                why="a geostationary hop is 0.6 s; a minute per message trains nothing")
BANDWIDTH = Limit(name="link bandwidth", lo=125, hi=1.25e14, unit="bytes/s",
                  fields="bandwidth_*_per_s, trace bandwidths",
                  why="1 kbit/s to 1 Pbit/s; outside, transfer times are 0 or years")
DEVICES_PER_NODE = Limit(name="devices of a node", lo=1, hi=MAX_DEVICES_PER_NODE, integer=True,
                         fields="nodes[].devices", why="work: planning time (measured, below); real nodes hold 16")
NODE_RANK = Limit(name="node rank", lo=0, hi=MAX_DEVICES - 1, integer=True, fields="nodes[].node_rank",
                  why="torchrun's node rank; a cluster has fewer nodes than devices")
DEVICES = Limit(name="devices of a cluster", lo=1, hi=MAX_DEVICES, integer=True,
                fields="sum of nodes[].devices, devices[]", why="work: planning time (measured, below)")
DATA_BYTES = Limit(name="data held", lo=0, hi=1e21, unit="bytes", fields="islands.*.data_* (data_bytes)",
                   why="a zettabyte; wider values only overflow sums")
DEVICE_PRICE = Limit(name="device price", lo=0, hi=1e3, unit="USD/s",
                     fields="islands.*.price_usd_per_device_hour (x 1/3600), device_usd_per_s",
                     why="3.6 M USD per device-hour; a price is never negative")
EGRESS_PRICE = Limit(name="egress price", lo=0, hi=1e-3, unit="USD/byte",
                     fields="islands.*.egress_usd_per_gb (x 1e-9), egress_usd_per_byte",
                     why="a million USD per GB; a price is never negative")
TRACE_TIME = Limit(name="trace time", lo=0, hi=1e7, unit="s", fields="times_s[]",
                   why="seconds since training start; 1e7 s is 116 days")
TRACE_POINTS = Limit(name="trace points", lo=1, hi=1_000_000, integer=True, fields="times_s",
                     why="a point per second for 11 days; bounded by the JSON size limit too")
GLOBAL_BATCH = Limit(name="global batch", lo=1, hi=MAX_GLOBAL_BATCH, integer=True,
                     fields="global_batch, --global-batch, shares, microbatch sizes and counts",
                     why="work: planning time (measured)")
LAYERS = Limit(name="layers", lo=1, hi=MAX_LAYERS, integer=True,
               fields="layers (profile), num_layers (+2: embedding, head), layer_start/stop",
               why="work: planner tables grow as layers**2 (measured)")
LAYER_INDEX = Limit(name="layer index", lo=0, hi=MAX_LAYERS, integer=True,
                    fields="stages[].layer_start, layer_stop", why="see layers")
FLOPS = Limit(name="FLOPs per sample", lo=0, hi=1e24, unit="FLOP",
              fields="layers[].forward_flops, input_grad_flops, weight_grad_flops", why=_PHYSICAL)
PARAMETERS = Limit(name="parameters of a layer", lo=0, hi=1e15, integer=True,
                   fields="layers[].parameter_count", why=_PHYSICAL)
BYTES = Limit(name="bytes per sample", lo=0, hi=2.0**50, unit="bytes",
              fields="input_bytes, layers[].activation_bytes, output_bytes, peak memory", why=_PHYSICAL)
BYTES_PER_PARAMETER = Limit(name="bytes per parameter", lo=0, hi=1024, unit="bytes",
                            fields="gradient_bytes_per_parameter, state_bytes_per_parameter",
                            why="fp64 Adam needs 32; 1 KiB is no optimizer")
MEASURED_TIME = Limit(name="measured time", lo=0, hi=3600, unit="s",
                      fields="measured (fixed_s, per_sample_s), probe timings",
                      why="a time is never negative; an hour per layer and sample is no measurement")
DURATION = Limit(name="duration", lo=0, hi=1e7, unit="s",
                 fields="estimate.iteration_s, wall_s, strategy.window_s",
                 why="116 days; a longer figure is a corrupt file")
RATE = Limit(name="throughput", lo=0, hi=1e12, unit="samples/s", fields="estimate.samples_per_s",
             why=_PHYSICAL)
COUNT = Limit(name="count", lo=0, hi=MAX_GLOBAL_BATCH, integer=True,
              fields="strategy steps, periods and group sizes, probe rounds",
              why="as large as the global batch")
SEQ_LEN = Limit(name="sequence length", lo=1, hi=2**20, integer=True, fields="seq_len, --seq-len",
                why="a million tokens per sample")
IMAGE_SIZE = Limit(name="image side", lo=1, hi=2**14, integer=True, fields="image_size, --image-size",
                   why="16,384 pixels a side")
WIDTH = Limit(name="model width", lo=1, hi=2**20, integer=True,
              fields="hidden_size, ffn_size, num_heads, num_kv_heads",
              why="a million units; wider overflows per-layer sizes")
VOCAB = Limit(name="vocabulary", lo=1, hi=2**24, integer=True, fields="vocab_size", why="16 M tokens")
OUTER_LR = Limit(name="outer learning rate", lo=0, hi=1e3, fields="strategy.outer_lr", why="a finite step size")
OUTER_MOMENTUM = Limit(name="outer momentum", lo=0, hi=1, hi_open=True, fields="strategy.outer_momentum",
                       why="a momentum is below 1")
MEASURED_RATIO = Limit(name="measured ratio", lo=0, hi=1e9,
                       fields="probe pacing_ratio, max_residual_fraction, dilation", why="a ratio of two measured times")

LIMITS: tuple[Limit, ...] = (
    PEAK_FLOPS, MEMORY, FRACTION, OVERHEAD, SLOWDOWN, LATENCY, BANDWIDTH, DEVICES_PER_NODE, DEVICES, NODE_RANK,
    DATA_BYTES, DEVICE_PRICE, EGRESS_PRICE,
    TRACE_TIME, TRACE_POINTS, GLOBAL_BATCH, LAYERS, LAYER_INDEX, FLOPS, PARAMETERS, BYTES,
    BYTES_PER_PARAMETER, MEASURED_TIME, DURATION, RATE, COUNT, SEQ_LEN, IMAGE_SIZE, WIDTH, VOCAB, OUTER_LR,
    OUTER_MOMENTUM, MEASURED_RATIO,
)


def markdown_table(limits: tuple[Limit, ...] = LIMITS) -> str:
    """``limits`` as a Markdown table (``docs/file-formats.md`` holds :data:`LIMITS` and the
    command line's :data:`deepcee.cliargs.CLI_LIMITS`; a test keeps them equal)."""
    rows = ["| value | type | range | where | why |", "|---|---|---|---|---|"]
    for lim in limits:
        typ = "integer" if lim.integer else "number"
        rows.append(f"| {lim.name} | {typ} | {lim.describe()} | {lim.fields} | {lim.why} |")
    return "\n".join(rows)


if __name__ == "__main__":
    from deepcee.cliargs import CLI_LIMITS

    print(markdown_table(), end="\n\n")
    print(markdown_table(CLI_LIMITS))
