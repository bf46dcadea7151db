"""A user's model on the ranks without processes: tie detection, packing for the ranks (no
shared memory, ties kept, the user's object untouched), private copies, and the tie groups a
plan needs (which stages, ranks and devices; created in one order)."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from torch import nn

from deepcee.errors import RuntimeSetupError, SpecError
from deepcee.plan import Plan, StagePlan
from deepcee.runtime.job import Job, TrainConfig
from deepcee.runtime.params import (
    PackedModel,
    Tie,
    find_ties,
    model_ties,
    private_blocks,
    tie_groups,
)
from deepcee.runtime.partition import Topology
from deepcee.scenarios import load_scenario


class Head(nn.Module):
    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.weight = emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class Masked(nn.Module):
    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.mask


def tied_model() -> list[nn.Module]:
    """[embedding, masked, masked, head]: the head is the embedding's weight; both middle blocks share a buffer."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    mask = torch.ones(4)
    return [emb, Masked(mask), Masked(mask), Head(emb)]


def _storages(blocks) -> set[int]:
    return {t.untyped_storage().data_ptr() for b in blocks for t in [*b.parameters(), *b.buffers()]}


def test_finds_parameter_and_buffer_ties_by_identity():
    ties = find_ties(tied_model())
    assert ties == (Tie(kind="parameter", uses=((0, "weight"), (3, "weight"))),
                    Tie(kind="buffer", uses=((1, "mask"), (2, "mask"))))
    assert ties[0].blocks == (0, 3) and ties[0].describe() == "0.weight = 3.weight"


def test_equal_values_are_not_a_tie_and_a_reuse_inside_one_block_is_not_either():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.load_state_dict(a.state_dict())
    inner = nn.Sequential(a, nn.Tanh())
    inner.register_parameter("again", a.weight)  # twice in one block
    assert find_ties([inner, b]) == ()
    assert find_ties(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) == ()


def test_a_parameter_in_three_blocks_lists_every_use():
    shared = nn.Linear(2, 2)
    box = nn.Module()
    box.a, box.b = shared, shared  # twice inside block 2
    (tie,) = [t for t in find_ties([shared, nn.Sequential(shared), box]) if t.uses[0][1] == "weight"]
    assert tie.uses == ((0, "weight"), (1, "0.weight"), (2, "a.weight"), (2, "b.weight"))


def test_a_tie_needs_two_blocks():
    with pytest.raises(SpecError, match="at least 2 blocks"):
        Tie(kind="parameter", uses=((0, "a"), (0, "b")))


def test_torch_forking_pickler_moves_a_model_to_shared_memory():
    """Why user models are packed: spawn pickles with ForkingPickler, which shares storages in place."""
    model = nn.Linear(3, 3)
    ForkingPickler.dumps([model])
    assert model.weight.is_shared()


def test_a_job_reaches_a_spawned_rank_packed_without_shared_memory():
    blocks = tied_model()
    before = {k: v.clone() for k, v in nn.ModuleList(blocks).state_dict().items()}
    plan = Plan(system="t", cluster="local-small", model="user", global_batch=2, microbatch_size=2, num_microbatches=1,
                schedule="gpipe", stages=(StagePlan(layer_start=0, layer_stop=4, devices=("cloud0:0",), shares=(2,)),))
    job = Job(name="j", plan=plan, cluster=load_scenario("local-small"), model=blocks, config=TrainConfig(steps=1),
              run_dir="/nonexistent")
    on_rank = pickle.loads(bytes(ForkingPickler.dumps(job)))
    assert not any(t.is_shared() for b in blocks for t in [*b.parameters(), *b.buffers()])
    assert isinstance(on_rank.model, PackedModel) and on_rank.model.num_blocks == 4
    assert on_rank.model.ties == find_ties(blocks)  # found on the user's blocks, before packing
    assert on_rank.name == "j" and on_rank.config == job.config and job.model is blocks
    copy_a, copy_b = private_blocks(on_rank.model), private_blocks(on_rank.model)
    for mine in (copy_a, copy_b):
        assert find_ties(mine) == find_ties(blocks) and mine[3].weight is mine[0].weight
        assert not any(t.is_shared() for b in mine for t in b.parameters())
    assert len({*_storages(blocks)} & {*_storages(copy_a)}) == 0 and not _storages(copy_a) & _storages(copy_b)
    with torch.no_grad():
        copy_a[0].weight.add_(1.0)
    assert all(torch.equal(v, before[k]) for k, v in nn.ModuleList(blocks).state_dict().items())
    assert pickle.loads(pickle.dumps(on_rank)).model == on_rank.model  # packed once, not again


def test_a_live_model_is_deep_copied_whole_on_the_rank():
    seq = nn.Sequential(*tied_model())
    mine = private_blocks(seq)
    assert mine[3].weight is mine[0].weight and mine[1].mask is mine[2].mask
    assert not _storages(mine) & _storages(seq)
    assert model_ties(seq) == find_ties(mine) and model_ties("gpt-tiny") == ()


def _plan(stages: list[tuple[int, int, tuple[str, ...]]]) -> Plan:
    return Plan(system="t", cluster="c", model="user", global_batch=4, microbatch_size=2, num_microbatches=2,
                schedule="gpipe", stages=tuple(StagePlan(layer_start=a, layer_stop=b, devices=d,
                                                         shares=(2,) if len(d) == 1 else (1, 1))
                                               for a, b, d in stages))


def test_tie_groups_follow_the_plan_in_one_order():
    ties = (Tie(kind="parameter", uses=((3, "w"), (5, "w"))),    # stages 1 and 2
            Tie(kind="parameter", uses=((0, "w"), (5, "x"))),    # stages 0 and 2
            Tie(kind="parameter", uses=((1, "v"), (2, "v"))),    # inside stage 0: no group
            Tie(kind="parameter", uses=((0, "u"), (4, "u"))),    # stages 0 and 2 again
            Tie(kind="buffer", uses=((0, "m"), (5, "m"))))      # buffers are not summed
    plan = _plan([(0, 3, ("a", "b")), (3, 4, ("c",)), (4, 6, ("d", "e"))])
    made = []
    groups = tie_groups(ties, plan, Topology(plan), lambda ranks: made.append(tuple(ranks)) or len(made))
    assert [(g.stages, g.ranks, g.devices, g.group) for g in groups] == [
        ((0, 2), (0, 1, 3, 4), ("a", "b", "d", "e"), 1), ((1, 2), (2, 3, 4), ("c", "d", "e"), 2)]
    assert groups[0].ties == (ties[1], ties[3]) and made == [(0, 1, 3, 4), (2, 3, 4)]
    one_stage = _plan([(0, 6, ("a", "b"))])
    assert tie_groups(ties, one_stage, Topology(one_stage), lambda r: pytest.fail("no group needed")) == ()


def test_a_tie_beyond_the_plan_is_named():
    plan = _plan([(0, 2, ("a",)), (2, 4, ("b",))])
    with pytest.raises(RuntimeSetupError, match=r"0.w = 7.w .*0..3"):
        tie_groups((Tie(kind="parameter", uses=((0, "w"), (7, "w"))),), plan, Topology(plan), lambda r: None)
