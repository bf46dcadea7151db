"""Splitting users' models into blocks: containers, lists, traced split points (``points`` and
``pipe_split``), builders and import paths, and HuggingFace GPT-2 / Llama / BERT, whose blocks
chained give exactly the model's own output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepcee.errors import SpecError
from deepcee.nets import pipe_split, split_model
from deepcee.nets.split import build_user_model
from deepcee.runtime.params import find_ties
from deepcee.userref import import_object, is_import_path

torch.set_num_threads(1)


def _chain(blocks, x):
    for b in blocks:
        x = b(x)
    return x


class Res(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.lin(x)) + x


class Net(nn.Module):
    """Embedding-like input layer, a ModuleList stack, a head that reuses the input weight and
    the input itself (a skip connection over every block), written in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.layers = nn.ModuleList([Res(), Res(), Res()])
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.flatten(1)) + F.linear(x, self.inp.weight)[:, :2] * x.size(0)


def test_containers_and_lists_are_their_children():
    seq = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    s = split_model(seq)
    assert s.how == "sequential" and s.names == ("0", "1", "2") and s.blocks[1] is seq[1]
    assert split_model(nn.ModuleList(list(seq))).how == "modulelist"
    assert split_model(list(seq)).names == ("layer0", "layer1", "layer2")
    whole = split_model(Net())
    assert whole.how == "whole" and len(whole.blocks) == 1


def test_traced_split_at_points_equals_the_model_and_keeps_ties():
    torch.manual_seed(0)
    net = Net()
    s = split_model(net, points=["layers", "head"])
    assert s.how == "traced" and s.names == ("start", "layers.0", "layers.1", "layers.2", "head")
    x = torch.randn(5, 4)
    torch.testing.assert_close(_chain(s.blocks, x), net(x), rtol=0, atol=0)
    # the head block reads inp.weight itself: one Parameter in two blocks, found as a tie
    (tie,) = find_ties(s.blocks)
    assert tie.blocks == (0, 4) and s.blocks[0].inp.weight is net.inp.weight
    mid = s.blocks[1](s.blocks[0](x))
    assert set(mid) == {"x", "add"}  # the input travels along the chain to where it is used


class Marked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        x = pipe_split(x)
        return self.b(x)


def test_pipe_split_marks_a_block_boundary():
    m = Marked()
    s = split_model(m)
    assert s.names == ("start", "pipe_split0")
    x = torch.randn(2, 3)
    torch.testing.assert_close(_chain(s.blocks, x), m(x), rtol=0, atol=0)
    torch.testing.assert_close(m(x), m.b(torch.tanh(m.a(x))))  # a no-op when the model runs


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x.sum() > 0 else x


def test_split_errors_name_the_problem():
    with pytest.raises(SpecError, match="split point 'nope' names no submodule"):
        split_model(Net(), points=["nope"])
    with pytest.raises(SpecError, match=r"not reached in forward order"):
        split_model(Net(), points=["head", "layers"])
    with pytest.raises(SpecError, match="cannot trace Branchy.forward"):
        split_model(Branchy(), points=["a"])
    with pytest.raises(SpecError, match="not a torch.nn.Module"):
        split_model([nn.Linear(2, 2), "relu"])


def _builder():
    return nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 1)), F.mse_loss


def test_builders_are_seeded_and_leave_the_callers_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = build_user_model(_builder, seed=7), build_user_model(_builder, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    assert a.loss_fn is F.mse_loss and a.how == "sequential"
    assert all(torch.equal(p, q) for x, y in zip(a.blocks, b.blocks, strict=True)
               for p, q in zip(x.parameters(), y.parameters(), strict=True))
    other = build_user_model(_builder, seed=8)
    assert not torch.equal(other.blocks[0].weight, a.blocks[0].weight)


def test_import_paths():
    assert is_import_path("tests_pkg.models:build") and is_import_path("m:a.b")
    assert not is_import_path("gpt2:seq_len=512") and not is_import_path("data.pt")
    assert import_object("torch.nn.functional:mse_loss", what="model") is F.mse_loss
    with pytest.raises(SpecError, match="model: cannot import 'no_such_module_here'"):
        import_object("no_such_module_here:x", what="model")
    with pytest.raises(SpecError, match="model: module 'torch' has no 'nope'"):
        import_object("torch:nope", what="model")


# -- HuggingFace --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip("transformers")


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[0, 5:] = 0
    mask[2, 7:] = 0
    return ids, mask


def _check_hf(model, out_of, expected_names, ties):
    model = model.double().eval()
    ids, mask = _inputs()
    s = split_model(model)
    assert s.names == expected_names
    assert [t.blocks for t in find_ties(s.blocks)] == ties
    for x in (ids, {"input_ids": ids, "attention_mask": mask}):
        kwargs = x if isinstance(x, dict) else {"input_ids": x}
        torch.testing.assert_close(_chain(s.blocks, x), out_of(model(**kwargs)), rtol=0, atol=0)
    return s


def test_hf_gpt2_blocks_equal_the_model(hf):
    cfg = hf.GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    s = _check_hf(hf.GPT2LMHeadModel(cfg), lambda o: o.logits, ("embed", "layer0", "layer1", "norm", "head"), [(0, 4)])
    assert s.how == "hf-gpt2" and s.loss_fn is not None
    boundary = s.blocks[0]({"input_ids": _inputs()[0], "attention_mask": _inputs()[1]})
    assert set(boundary) == {"hidden", "attention_mask"}  # the 2-D mask travels, not a T x T one


def test_hf_llama_blocks_equal_the_model(hf):
    cfg = hf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8,
                         bos_token_id=0, eos_token_id=0)
    s = _check_hf(hf.AutoModelForCausalLM.from_config(cfg), lambda o: o.logits,
                  ("embed", "layer0", "layer1", "norm", "head"), [])
    state = s.blocks[0](_inputs()[0])
    assert set(state) == {"hidden", "position_ids", "cos", "sin"}
    assert state["cos"].shape[0] == 3 and not state["cos"].requires_grad  # samples first, no gradient


def test_hf_bert_blocks_equal_the_model(hf):
    cfg = hf.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=8, pad_token_id=0)
    _check_hf(hf.BertForMaskedLM(cfg), lambda o: o.logits, ("embed", "layer0", "layer1", "head"), [(0, 3)])
    base = _check_hf(hf.BertModel(cfg, add_pooling_layer=False), lambda o: o.last_hidden_state,
                     ("embed", "layer0", "layer1"), [])
    assert base.loss_fn is None  # an encoder's output has no loss of its own
