"""Inputs a new user writes that the other tests never showed: clusters of one device, links
given twice, node names with colons, a model of one's own without a loss."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deepcee.cli import main
from deepcee.cluster import cluster_from_toml_dict, load_cluster
from deepcee.cluster.outages import LinkOutage
from deepcee.errors import ClusterSpecError, SpecError
from deepcee.jsonio import save_json_atomic
from deepcee.models import get_model
from deepcee.planner.compare import compare


def one_device() -> dict:
    return {
        "name": "one",
        "kinds": {"g": {"peak_tflops": 10.0, "memory_gib": 16.0}},
        "islands": {"a": {"latency_us": 50, "bandwidth_gbit_per_s": 10}},
        "nodes": [{"name": "n0", "island": "a", "kind": "g", "devices": 1}],
    }


def test_compare_on_a_cluster_of_one_device_has_no_leave_out_line() -> None:
    """The best single node then uses every device: nothing is left out, so there is no
    crossover to sweep (it used to fail: 'crossover needs left-out devices')."""
    report = compare(cluster_from_toml_dict(one_device()), get_model("gpt2"), 8)
    assert report.leave_out == "" and report.crossover is None
    assert report.rows[0].system == "deepcee" and report.rows[0].samples_per_s > 0


TWO_ISLANDS = """
name = "t"
[kinds.g]
peak_tflops = 10
memory_gib = 16
[islands.a]
latency_us = 50
bandwidth_gbit_per_s = 10
[islands.b]
latency_us = 50
bandwidth_gbit_per_s = 10
[[nodes]]
name = "a0"
island = "a"
kind = "g"
devices = 2
[[nodes]]
name = "b0"
island = "b"
kind = "g"
devices = 2
[[links]]
between = ["a", "b"]
latency_ms = 10
bandwidth_mbit_per_s = 100
"""


@pytest.mark.parametrize("second", ['between = ["b", "a"]', 'between = ["a", "b"]',
                                    'between = ["b", "a"]\ndirected = true'])
def test_a_link_given_twice_is_an_error_naming_both_entries(tmp_path: Path, second: str) -> None:
    """It used to load silently: the later entry replaced the earlier one in one direction only
    (a -> b at 100 Mbit/s, b -> a at 10)."""
    p = tmp_path / "c.toml"
    p.write_text(TWO_ISLANDS + f"[[links]]\n{second}\nlatency_ms = 20\nbandwidth_mbit_per_s = 10\n")
    with pytest.raises(ClusterSpecError, match=r"c\.toml: links\[1\]\.between: '[ab]' -> '[ab]' is already given "
                                               r"by links\[0\]"):
        load_cluster(p)


def test_an_asymmetric_link_is_two_directed_entries(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text(TWO_ISLANDS.replace("bandwidth_mbit_per_s = 100\n", "bandwidth_mbit_per_s = 100\ndirected = true\n")
                 + '[[links]]\nbetween = ["b", "a"]\ndirected = true\nlatency_ms = 20\nbandwidth_mbit_per_s = 10\n')
    c = load_cluster(p)
    assert c.link("a0:0", "b0:0").bandwidth_bytes_per_s == pytest.approx(12.5e6)
    assert c.link("b0:0", "a0:0").bandwidth_bytes_per_s == pytest.approx(1.25e6)


@pytest.mark.parametrize(("text", "pair"), [("dc:1:edge@5", ("dc:1", "edge")), ("edge:dc:1@5:9", ("edge", "dc:1")),
                                           ("a@b:edge@5", ("a@b", "edge"))])
def test_link_down_names_nodes_whose_names_hold_colons(text: str, pair: tuple[str, str]) -> None:
    """A node may be named ``dc:1`` (its devices are ``dc:1:0``, ...); ``--link-down`` used to
    split at every colon and refuse it. Straggler texts already cut where the device is."""
    outage = LinkOutage.parse(text, ["dc:1", "edge", "a@b"])
    assert (outage.a, outage.b, outage.start_s) == (*pair, 5.0)


def test_link_down_refuses_an_ambiguous_or_unknown_pair() -> None:
    with pytest.raises(ClusterSpecError, match="NODE_A:NODE_B@START"):
        LinkOutage.parse("a:b:c@1", ["a", "b", "c", "a:b", "b:c"])
    with pytest.raises(ClusterSpecError, match="NODE_A:NODE_B@START"):
        LinkOutage.parse("a:zz@1", ["a", "b"])


@pytest.mark.parametrize(("argv", "needle"), [
    (["plan", "--scenario", "local-small", "--model", "gpt2", "--global-batch", "8", "-o", "{d}"],
     "argument -o/--output: '{d}' is a folder, not a file"),
    (["plan", "--scenario", "local-small", "--model", "gpt2", "--global-batch", "8", "-o", "{f}/p.json"],
     "argument -o/--output: '{f}/p.json' cannot be created: '{f}' is a file"),
    (["simulate", "plan.json", "--plot", "{d}"], "argument --plot: '{d}' is a folder, not a file"),
    (["compare", "--scenario", "local-small", "--model", "gpt2", "--global-batch", "8", "--json", "{d}"],
     "argument --json: '{d}' is a folder"),
    (["profile", "--scenario", "local-small", "-o", "{f}"], "argument -o/--output: '{f}' is a file, not a folder"),
    (["train", "--plan", "plan.json", "--steps", "1", "--run-dir", "{f}"], "argument --run-dir: '{f}' is a file"),
])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    """These used to end in a traceback (IsADirectoryError, FileExistsError) after the work,
    leaving a '.<name>.tmp' file behind."""
    d, f = tmp_path / "adir", tmp_path / "afile"
    d.mkdir()
    f.write_text("")
    assert main([a.format(d=d, f=f) for a in argv]) == 2
    err = capsys.readouterr().err
    assert needle.format(d=d, f=f) in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]


def test_a_json_write_that_fails_leaves_no_temporary_file(tmp_path: Path) -> None:
    (tmp_path / "out.json").mkdir()
    with pytest.raises(OSError):
        save_json_atomic(tmp_path / "out.json", {"a": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


USER_MODELS = '''
import torch
from torch import nn

def one_linear():
    return nn.Sequential(nn.Linear(4, 3))

def wrong_width():
    return nn.Sequential(nn.Linear(5, 3))

class ArgMax(nn.Module):
    def forward(self, x):
        return x.argmax(dim=-1)

def integer_output():
    return nn.Sequential(nn.Linear(4, 3), ArgMax())

def cross_entropy(out, y):
    return nn.functional.cross_entropy(out, y)
'''


@pytest.fixture
def user_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module of the user's own models (``audit_models``) and a classification data file."""
    import torch

    (tmp_path / "audit_models.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.save((torch.randn(16, 4), torch.randint(0, 3, (16,))), tmp_path / "cls.pt")
    return tmp_path


def _plan_own(user_models: Path, model: str, *more: str) -> list[str]:
    return ["plan", "--scenario", "local-small", "--model", f"audit_models:{model}", "--data",
            str(user_models / "cls.pt"), "--global-batch", "8", "-o", str(user_models / "p.json"), *more]


def test_a_model_without_a_loss_names_the_flag_on_the_command_line(
        user_models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It said 'loss_fn: ... pass loss_fn', the Python argument, not the flag."""
    assert main(_plan_own(user_models, "one_linear")) == 2
    err = capsys.readouterr().err
    assert "error: --loss: audit_models:one_linear: the model (sequential, last block '0') has no default loss; " \
           "give --loss" in err


@pytest.mark.parametrize(("model", "needle"), [
    ("wrong_width", "block 0 ('0') and the loss cannot run on 2 samples of the data (RuntimeError: mat1 and mat2"),
    ("integer_output", "block 1 ('1') and the loss cannot run on 2 samples of the data (RuntimeError: "),
])
def test_a_model_that_cannot_run_on_the_data_is_one_line_naming_the_block(
        user_models: Path, capsys: pytest.CaptureFixture[str], model: str, needle: str) -> None:
    """Counting the profile ran the blocks on the data and ended in a traceback."""
    assert main(_plan_own(user_models, model, "--loss", "audit_models:cross_entropy")) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_a_first_stage_that_cannot_run_on_the_data_says_so(tmp_path: Path) -> None:
    """Stage 0 has no sender: the message read 'cannot run on the output of  (per-sample None)',
    and the launcher prefixed it with its rank a second time ('rank 0: rank 0 (...)')."""
    import json
    from datetime import timedelta

    import torch.distributed as dist

    from deepcee.errors import RuntimeSetupError
    from deepcee.plan import Plan, StagePlan
    from deepcee.runtime.p2p import exchange_metadata
    from deepcee.runtime.partition import Topology
    from deepcee.runtime.supervise import first_error, write_error

    plan = Plan(system="t", cluster="c", model="m", global_batch=4, microbatch_size=4, num_microbatches=1,
                schedule="gpipe", stages=(StagePlan(layer_start=0, layer_stop=1, devices=("a",), shares=(4,)),))
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    store.set("j/hello/0", json.dumps({"plan": "d1", "device": "a"}))

    def boom(meta: object) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeSetupError) as info:
        exchange_metadata(store, Topology(plan), 0, job="j", plan_digest="d1", timeout_s=1, output_meta=boom)
    assert str(info.value) == ("rank 0 (device a, stage 0) cannot run on a sample of the data: RuntimeError: mat1 and "
                               "mat2 shapes cannot be multiplied")
    write_error(tmp_path, 0, info.value)
    assert str(first_error(tmp_path)) == str(info.value)


def test_a_plan_finds_its_cluster_file_beside_it_from_another_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The plan records the cluster path as typed (relative to where `deepcee plan` ran);
    `deepcee simulate runs/plan.json` from another folder said 'unknown scenario or cluster file'."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "one.toml").write_text(
        'name = "one"\n[kinds.g]\npeak_tflops = 10\nmemory_gib = 16\n[islands.a]\nlatency_us = 50\n'
        'bandwidth_gbit_per_s = 10\n[[nodes]]\nname = "n0"\nisland = "a"\nkind = "g"\ndevices = 1\n')
    monkeypatch.chdir(tmp_path / "runs")
    assert main(["plan", "--cluster", "one.toml", "--model", "gpt2", "--global-batch", "8", "-o", "plan.json"]) == 0
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["simulate", "runs/plan.json"]) == 0
    assert "simulated:" in capsys.readouterr().out


def test_simulate_counts_the_profile_of_a_plan_for_a_model_of_ones_own(
        user_models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The error asked for --data, which `deepcee simulate` did not take."""
    assert main(_plan_own(user_models, "one_linear", "--loss", "audit_models:cross_entropy")) == 0
    plan = str(user_models / "p.json")
    assert main(["simulate", plan]) == 2
    assert "needs --data" in capsys.readouterr().err
    assert main(["simulate", plan, "--data", str(user_models / "cls.pt"), "--loss", "audit_models:cross_entropy"]) == 0
    assert "simulated:" in capsys.readouterr().out


def test_rates_below_a_megabit_are_not_shown_as_zero() -> None:
    """A 1 kbit/s link (the files' lower limit) was reported as '0 Mbit/s'."""
    from deepcee.units import fmt_rate

    assert [fmt_rate(b / 8) for b in (1e3, 512e3, 0.9994e6, 0.9996e6, 100e6, 2.5e9)] == [
        "1 kbit/s", "512 kbit/s", "999 kbit/s", "1 Mbit/s", "100 Mbit/s", "2.5 Gbit/s"]


@pytest.mark.parametrize(("section", "key", "flag", "entry"), [
    ("faults", "link_down", "--link-down", "cloud0:edge0@1"),
    ("training", "stragglers", "--straggler", "edge0:0:3"),
])
def test_repeatable_flags_are_lists_in_a_job_config(tmp_path: Path, section: str, key: str, flag: str,
                                                    entry: str) -> None:
    """The documented list was refused ('must be a string'), and a string was taken and later
    read character by character."""
    import argparse

    from deepcee import jobconfig, train

    parser = argparse.ArgumentParser()
    train.add_train_arguments(parser)
    dest = "link_down" if key == "link_down" else "straggler"
    config = tmp_path / "job.toml"
    config.write_text(f'[{section}]\n{key} = ["{entry}"]\n')
    assert getattr(jobconfig.parse_with_config(parser, ["--config", str(config)]), dest) == [entry]
    config.write_text(f'[{section}]\n{key} = "{entry}"\n')
    with pytest.raises(SpecError, match=rf"job\.toml: {section}\.{key}: must be a list of strings, one per {flag}, "
                                        rf"got '{entry}' \(flag {flag}\)"):
        jobconfig.parse_with_config(parser, ["--config", str(config)])


@pytest.mark.parametrize("amount", [float("nan"), float("inf"), 2.5])
def test_an_evaluation_hold_out_that_is_no_fraction_or_count_is_refused(amount: float) -> None:
    """nan and inf ended in ValueError / OverflowError tracebacks (also from `--eval-data nan`),
    2.5 held out 2 samples."""
    import torch
    from torch.utils.data import TensorDataset

    import deepcee

    with pytest.raises(SpecError, match=r"eval: must be a fraction in \(0, 1\) or a whole count of samples, got "):
        deepcee.Data(TensorDataset(torch.randn(10, 4), torch.arange(10)), eval=amount)


@pytest.mark.parametrize(("old", "new", "field"), [('name = "a0"', 'name = "a->0"', "nodes[0].name"),
                                                   ("[islands.b]", '[islands."b->c"]', 'islands.b->c')])
def test_names_holding_the_link_arrow_are_refused(tmp_path: Path, old: str, new: str, field: str) -> None:
    """A pipe is named 'src->dst' (simulator, adapter, profile link keys): nodes 'a->b' and 'c'
    shared a pipe name with nodes 'a' and 'b->c', and the adapter could not split it."""
    text = TWO_ISLANDS.replace(old, new)
    if "b->c" in new:
        text = text.replace('island = "b"', 'island = "b->c"').replace('["a", "b"]', '["a", "b->c"]')
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ClusterSpecError, match=rf"c\.toml: {re.escape(field)}: names may not hold '->'"):
        load_cluster(p)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_to_a_safetensors_name_writes_safetensors(tmp_path: Path) -> None:
    """`deepcee export run -o model.safetensors` wrote a torch pickle under that name."""
    pytest.importorskip("safetensors")
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from deepcee.runtime import checkpoint as ckpt
    from deepcee.runtime.export import export_checkpoint

    folder = ckpt.step_dir(tmp_path / "checkpoints", 3)
    weight = torch.arange(6.0).reshape(2, 3)
    dcp.save({"model/fc.weight": weight}, checkpoint_id=str(folder), no_dist=True)
    ckpt.commit(folder, ckpt.Manifest(step=3, plan_digest="d", model="m", dtype="float32", optimizer="sgd",
                                      files=ckpt.checksum_folder(folder), names=(("fc.weight", ("fc.weight",)),)))
    out = export_checkpoint(tmp_path, tmp_path / "model.safetensors")
    assert out.files == (str(tmp_path / "model.safetensors"),)
    assert torch.equal(load_file(str(tmp_path / "model.safetensors"))["fc.weight"], weight)


def test_resume_without_a_checkpoint_says_it_starts_at_step_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """`--resume` on a folder without checkpoints (a mistyped --run-dir) trained from scratch silently."""
    import logging
    from types import SimpleNamespace

    from deepcee.runtime import persist

    monkeypatch.setattr(persist, "_agree", lambda t, choose: choose())  # one rank: no store needed
    trainer = SimpleNamespace(ckpt_root=lambda: tmp_path / "checkpoints", w=SimpleNamespace(rank=0))
    with caplog.at_level(logging.WARNING, logger=persist.log.name):
        assert persist.resume(trainer) is None
    assert f"--resume: no intact checkpoint under {tmp_path / 'checkpoints'}: training starts at step 0" in caplog.text


def test_compare_relaxed_on_one_island_says_no_relaxed_row_has_a_plan() -> None:
    """With one island no relaxed row has a plan; the note said 'multiplier from: -'."""
    report = compare(cluster_from_toml_dict(one_device()), get_model("gpt2"), 8, crossover=False, sync="relaxed")
    note = next(n for n in report.notes if "multiplier from" in n)
    assert note.endswith("multiplier from: none (no relaxed row has a plan here; each row says why)")
    assert all(r.samples_per_s is None or r.samples_per_s == 0 or r.semantics != "relaxed" for r in report.rows)


@pytest.mark.parametrize("blank", [" ", "a0 ", " a0"])
def test_blank_or_padded_node_names_are_refused(tmp_path: Path, blank: str) -> None:
    """A node named ' ' loaded, and showed in reports and device names ('  :0') as nothing."""
    p = tmp_path / "c.toml"
    p.write_text(TWO_ISLANDS.replace('name = "a0"', f'name = "{blank}"'))
    with pytest.raises(ClusterSpecError, match=r"c\.toml: nodes\[0\]\.name: names may not be blank"):
        load_cluster(p)


@pytest.mark.parametrize(("text", "pair"), [("eu,west,us", ("eu,west", "us")), ("us,eu,west", ("us", "eu,west")),
                                           ("us,asia", ("us", "asia"))])
def test_trace_links_split_where_both_sides_are_names(text: str, pair: tuple[str, str]) -> None:
    """An island may be named ``eu,west``; ``--trace-links`` split at the first comma and refused it."""
    from deepcee.cliargs import split_name_pair

    assert split_name_pair(text, {"eu,west", "us", "asia"}) == pair


def test_trace_links_refuse_an_ambiguous_pair_or_one_name_twice() -> None:
    from deepcee.cliargs import split_name_pair

    with pytest.raises(ValueError, match="in 2 ways"):
        split_name_pair("a,b,c", {"a", "b", "c", "a,b", "b,c"})
    with pytest.raises(ValueError, match="two different names"):
        split_name_pair("a,a", {"a"})
