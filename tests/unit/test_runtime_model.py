"""Runtime behaviours the simulator reads: closed forms on a two-stage chain for blocking sends,
the receive handshake, the step barrier, gradient clipping, measured link curves; the declared
runtimes, and that deepcee's runtime does what its declaration says."""

from __future__ import annotations

import pytest
from test_simulator import events_of, make_plan, unit_cluster, unit_model

from deepcee.comm import allreduce_s
from deepcee.errors import SpecError
from deepcee.profile import LinkCurve
from deepcee.simulator.engine import simulate, wire_bytes
from deepcee.simulator.runtime_model import (
    CUDA_RUNTIME,
    DEEPSPEED,
    DEFAULT_RUNTIME,
    RuntimeModel,
    deepcee_runtime,
    runtime_for,
    runtime_model,
)

L = 2.0
"""One-way latency of every link; F = 1, I = W = 1, B = 2 per layer and microbatch."""
PLAIN = RuntimeModel(name="plain", receive_handshake=False, allreduce_handshake_latencies=0.0)


def _run(runtime: RuntimeModel, num_microbatches: int, *, iterations: int = 1, **plan):
    cluster = unit_cluster([1, 1], latency_s=L)
    p = make_plan([["n0:0"], ["n1:0"]], num_microbatches, schedule="gpipe", **plan)
    return simulate(p, cluster, unit_model(2), runtime=runtime, iterations=iterations)


def test_async_sends_overlap_compute_and_blocking_sends_hold_the_device() -> None:
    # async: F0 0-1, F1 1-2 on stage 0; stage 1 F0 3-4, F1 4-5, B0 5-7, B1 7-9; back at 9, 11
    assert _run(PLAIN, 2).iteration_s == pytest.approx(13.0)
    # blocking: every send holds its device until delivered (L after it started)
    blocking = RuntimeModel(name="b", sends="blocking", receives="in-order", receive_handshake=False,
                            allreduce_handshake_latencies=0.0)
    r = _run(blocking, 2)
    assert r.iteration_s == pytest.approx(17.0)
    assert r.comm_wait_s["n0:0"] >= 2 * L  # stage 0 sat in both of its sends


def test_receive_handshake_delays_a_piece_until_the_receivers_ready_notice() -> None:
    # the receiver posted at 0; its notice reaches the sender at L = 2 > the end of F0 (1)
    assert _run(PLAIN, 1).iteration_s == pytest.approx(6 + 2 * L)
    assert _run(DEFAULT_RUNTIME, 1).iteration_s == pytest.approx(L + L + 3 + L + 2)


def test_step_barrier_costs_its_latencies_and_lines_devices_up() -> None:
    base = _run(PLAIN, 2, iterations=3)
    barrier = RuntimeModel(name="b", receive_handshake=False, allreduce_handshake_latencies=0.0, step_barrier=True,
                           barrier_latencies=4.0)
    r = _run(barrier, 2, iterations=3)
    assert r.iteration_times_s == pytest.approx([13.0 + 4 * L] * 3)
    assert all(t <= 13.0 + 1e-9 for t in base.iteration_times_s)
    assert [e.where for e in events_of(r, "allreduce")[:2]] == ["n0:0", "n1:0"]  # the barrier, on every device


def test_without_a_barrier_each_device_starts_its_next_step_when_done() -> None:
    # the last stage finishes its step before the first: without a barrier it starts the next
    # one at once (and posts its receives), so the handshake costs nothing after the first step
    r = _run(DEFAULT_RUNTIME, 1, iterations=4)
    first = L + L + 3 + L + 2
    assert r.iteration_times_s[0] == pytest.approx(first)
    assert all(t < first - 1e-9 for t in r.iteration_times_s[1:])


def test_gradient_clipping_adds_one_scalar_all_reduce_over_the_stages() -> None:
    clip = RuntimeModel(name="c", receive_handshake=False, allreduce_handshake_latencies=0.0, gradient_clipping=True)
    cluster = unit_cluster([1, 1], latency_s=L)
    extra = allreduce_s(cluster, ["n0:0", "n1:0"], 4.0, "allreduce-ring")
    assert extra == pytest.approx(2 * L)
    assert _run(clip, 2).iteration_s == pytest.approx(13.0 + extra)


def test_a_measured_link_curve_prices_each_piece_by_its_size() -> None:
    model = unit_model(2, output_bytes=500.0)
    curve = LinkCurve(sizes_bytes=(16, 1000), serialisation_s=(0.0, 0.5), bandwidth_bytes_per_s=1000.0)
    with_curve = model.__class__(**{**{f: getattr(model, f) for f in model.__dataclass_fields__},
                                    "links": {"n0:0->n1:0": curve}})
    assert wire_bytes(model, "n0:0", "n1:0", 500.0) == 500.0
    want = 1000.0 * 0.5 * (500 - 16) / (1000 - 16)
    assert wire_bytes(with_curve, "n0:0", "n1:0", 500.0) == pytest.approx(want)
    assert wire_bytes(with_curve, "n0:0", "n1:0", 3000.0) == pytest.approx(1000.0 * (0.5 + 2000 / 1000))
    cluster = unit_cluster([1, 1], latency_s=L, bandwidth_bytes_per_s=1000.0)
    p = make_plan([["n0:0"], ["n1:0"]], 1, schedule="gpipe")
    a = simulate(p, cluster, model, runtime=PLAIN)
    b = simulate(p, cluster, with_curve, runtime=PLAIN)
    # forward piece priced by the curve, the backward one (no curve that way) by bytes / bandwidth
    assert b.iteration_s - a.iteration_s == pytest.approx(want / 1000.0 - 0.5)


def test_declared_runtimes() -> None:
    emulated, realnet, real = (deepcee_runtime(m) for m in ("emulated", "realnet", "real"))
    assert DEFAULT_RUNTIME == realnet and runtime_model("deepcee") == realnet
    assert emulated.allreduce == "modelled" and not emulated.receive_handshake and emulated.step_barrier
    assert realnet.receive_handshake and realnet.allreduce_handshake_latencies == 1 and not realnet.step_barrier
    assert real.step_barrier and real.barrier_latencies == 4
    assert all(r.sends == "async" and r.receives == "at-step-start" and r.holds_whole_model
               for r in (emulated, realnet, real))
    assert runtime_model("deepspeed", step_overhead_s=0.1) == DEEPSPEED.with_overhead(0.1)
    assert DEEPSPEED.sends == "blocking" and DEEPSPEED.gradient_clipping
    with pytest.raises(SpecError, match="unknown runtime 'megatron'"):
        runtime_model("megatron")
    with pytest.raises(SpecError, match="step_overhead_s"):
        RuntimeModel(name="x", step_overhead_s=-1.0)
    with pytest.raises(SpecError, match="handshake"):
        RuntimeModel(name="x", receives="in-order")
    # deepcee on CUDA: in order, no receive handshake, NCCL's ring; the rest as on CPU per mode
    for mode, cpu in (("emulated", emulated), ("realnet", realnet), ("real", real)):
        cuda = runtime_model("deepcee-cuda", mode=mode)
        assert cuda == deepcee_runtime(mode, device="cuda") and "CUDA" in cuda.name
        assert cuda.receives == "in-order" and not cuda.receive_handshake and cuda.allreduce_handshake_latencies == 0
        assert (cuda.sends, cuda.step_barrier, cuda.barrier_latencies, cuda.first_waits_for_all,
                cuda.holds_whole_model) == (cpu.sends, cpu.step_barrier, cpu.barrier_latencies,
                                            cpu.first_waits_for_all, cpu.holds_whole_model)
    assert CUDA_RUNTIME == runtime_model("deepcee-cuda")
    with pytest.raises(SpecError, match="device"):
        deepcee_runtime("realnet", device="tpu")


def test_runtime_for_a_cluster_of_gpus_is_the_cuda_runtime() -> None:
    import dataclasses

    from conftest import measured_model

    from deepcee.profile import DeviceMemory
    from deepcee.scenarios import load_scenario

    testbed, local = load_scenario("cee-testbed"), load_scenario("local-small")
    assert runtime_for(testbed) == CUDA_RUNTIME  # RTX 3090s
    assert runtime_for(local) == DEFAULT_RUNTIME  # says it is emulated by CPU worker processes
    assert runtime_for(unit_cluster([1, 1])) == DEFAULT_RUNTIME  # these tests' clusters say so too
    # a profile that measured a device kind in host memory: CPU devices, whatever the cluster says
    plain = dataclasses.replace(unit_cluster([1, 1]), emulation="")
    model = measured_model("unit", layers=2)
    assert runtime_for(plain) == runtime_for(plain, unit_model(2)) == CUDA_RUNTIME
    on_host = dataclasses.replace(model, measured_memory={"unit": DeviceMemory(
        fixed_bytes=1.0, fragmentation_fraction=0.0, method="resident set", host_memory=True)})
    assert runtime_for(plain, on_host) == DEFAULT_RUNTIME


def test_cuda_runtime_holds_buffers_for_the_microbatches_in_flight_and_has_no_receive_handshake() -> None:
    import dataclasses

    from test_simulator import chain

    cluster, devs = chain(4)
    gpus = dataclasses.replace(cluster, emulation="")
    act, out, m = 100.0, 1.0, 6
    model = unit_model(4, activation_bytes=act, output_bytes=out)
    p = make_plan(devs, m, schedule="1f1b")
    on_gpus = simulate(p, gpus, model)  # the cluster's runtime: deepcee on CUDA
    assert on_gpus.peak_memory_bytes == simulate(p, cluster, model, runtime=CUDA_RUNTIME).peak_memory_bytes
    on_cpu = simulate(p, cluster, model)
    for s in range(4):
        k, moved = min(4 - s, m), out * ((s > 0) + (s < 3))
        # stashed activations + one input/output pair + the other in-flight microbatches' buffers
        assert on_gpus.peak_memory_bytes[devs[s][0]] == pytest.approx(k * act + 2 * out + (k - 1) * moved)
        assert on_cpu.peak_memory_bytes[devs[s][0]] == pytest.approx(k * act + 2 * out + (2 * m - 1) * moved)
    # one microbatch over two stages: no ready notice to wait for (the handshake costs CPU 2 L)
    assert _run(CUDA_RUNTIME, 1).iteration_s == pytest.approx(_run(PLAIN, 1).iteration_s)
    assert _run(DEFAULT_RUNTIME, 1).iteration_s > _run(CUDA_RUNTIME, 1).iteration_s


def test_deepcee_runtime_does_what_it_declares() -> None:
    """The runtime code behind each declared property (read, not run: the dist tests run it)."""
    import inspect

    import torch

    from deepcee.runtime import outputs, p2p, pacing, trainer

    realnet = deepcee_runtime("realnet")
    # receives posted when the step starts, on gloo (CPU), unless the launch asks for in order
    assert realnet.receives == "at-step-start"
    assert "prepost=prepost_receives(self.cfg.receives, self.w.device)" in inspect.getsource(trainer.Trainer.make_p2p)
    assert p2p.prepost_receives("auto", torch.device("cpu"))
    assert not p2p.prepost_receives("in-order", torch.device("cpu"))
    assert "self._post(a.kind, a.microbatch)" in inspect.getsource(p2p.P2P.begin_step)
    # on CUDA in order, and every send's buffer dropped once it completed
    cuda = deepcee_runtime("realnet", device="cuda")
    assert cuda.receives == "in-order" and not cuda.receive_handshake
    assert not p2p.prepost_receives("auto", torch.device("cuda"))
    assert "self._reap()" in inspect.getsource(p2p.P2P._send)
    assert "self._reap()" in inspect.getsource(p2p.P2P._receive)
    assert "is_completed()" in inspect.getsource(p2p.P2P._reap)
    # sends are isend, waited for at the end of the step
    assert realnet.sends == "async" and "dist.isend" in inspect.getsource(p2p.P2P._send)
    # mode emulated waits for the comm model's all-reduce; realnet gathers records through the store
    assert "allreduce_s(" in inspect.getsource(pacing.pace_allreduce)
    assert "realnet" in inspect.getsource(outputs.gather)
    # the optimizer step is paced like compute, which the simulator counts from the profile
    assert "pace=self.pacer.run" in inspect.getsource(trainer.Trainer._train_step)


def test_simulate_cli_labels_its_figures_and_takes_a_runtime(tmp_path, capsys) -> None:
    from conftest import measured_model

    from deepcee.cli import main
    from deepcee.models import get_model
    from deepcee.plan import save_json_atomic
    from deepcee.profiler.fidelity import default_plans
    from deepcee.scenarios import load_scenario

    plan = default_plans(load_scenario("local-small"), get_model("gpt-tiny"))[1]  # 3 stages over the slow links
    save_json_atomic(tmp_path / "plan.json", plan.to_dict())
    assert main(["simulate", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "simulated on datasheet figures" in out and "runtime: deepcee (mode realnet)" in out
    measured = measured_model("cpu-worker", layers=6)
    save_json_atomic(tmp_path / "profile.json", measured.to_dict())
    assert main(["simulate", str(tmp_path / "plan.json"), "--profile", str(tmp_path / "profile.json")]) == 0
    ours = capsys.readouterr().out
    assert "simulated on a measured profile" in ours and "datasheet" not in ours
    assert main(["simulate", str(tmp_path / "plan.json"), "--profile", str(tmp_path / "profile.json"),
                 "--runtime", "deepspeed"]) == 0
    theirs = capsys.readouterr().out
    assert "runtime: deepspeed-style" in theirs

    def ms(text: str) -> float:
        return float(text.split("simulated: ")[1].split(" ms")[0])

    assert ms(theirs) > ms(ours)  # blocking sends through 20-40 ms links cost the stages their overlap


def test_simulate_cli_takes_the_clusters_runtime_by_default(tmp_path, capsys) -> None:
    from deepcee.cli import main
    from deepcee.models import get_model
    from deepcee.plan import save_json_atomic
    from deepcee.profiler.fidelity import default_plans
    from deepcee.scenarios import load_scenario

    # local-small's device names exist on the testbed (RTX 3090s)
    plan = default_plans(load_scenario("cee-testbed"), get_model("gpt-tiny"))[0].replace(cluster="cee-testbed")
    save_json_atomic(tmp_path / "plan.json", plan.to_dict())
    assert main(["simulate", str(tmp_path / "plan.json")]) == 0
    assert "runtime: deepcee on CUDA (mode realnet)" in capsys.readouterr().out  # RTX 3090s
    assert main(["simulate", str(tmp_path / "plan.json"), "--runtime", "deepcee"]) == 0
    assert "runtime: deepcee (mode realnet)" in capsys.readouterr().out
