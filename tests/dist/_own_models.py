"""Users' own models and data for the multi-process tests (importable by spawned ranks and by
``--model _own_models:build_mlp`` on a command line): an MLP on a ``TensorDataset``, tiny
HuggingFace GPT-2 / Llama / BERT models built from configs with random weights (padded text
with attention masks; token windows; masked-LM labels), and a hand-written small ResNet cut at
split points. Everything is seeded, so every process builds the same models and data."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from deepcee.runtime.datafiles import DictRows, RowWindows

VOCAB, SEQ = 64, 12


def build_mlp() -> tuple[nn.Module, object]:
    """An MLP whose second block is a lone activation (a stage of its own has no parameters)."""
    torch.manual_seed(5)  # also seeded by deepcee; repeated so the reference builds the same
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)), F.mse_loss


def mlp_data(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, torch.sin(x[:, :3]) + 0.1 * x[:, 3:6])


def _tokens(n: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def padded_text(n: int = 48) -> DictRows:
    """Right-padded token rows with an attention mask; labels are the next tokens, -100 at pads."""
    ids = _tokens(n, SEQ + 1, 2)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (n,), generator=torch.Generator().manual_seed(3))
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    labels = torch.where(mask.bool(), ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    return DictRows({"input_ids": ids[:, :-1] * mask, "attention_mask": mask, "labels": labels})


def token_rows(n: int = 48) -> RowWindows:
    return RowWindows(_tokens(n, SEQ + 1, 4))


def masked_lm(n: int = 48) -> DictRows:
    """BERT inputs with padding; labels at ~30% of the real tokens, -100 elsewhere."""
    d = padded_text(n).columns
    pick = (torch.rand(n, SEQ, generator=torch.Generator().manual_seed(6)) < 0.3) & d["attention_mask"].bool()
    pick[:, 0] = True  # every sample counts at least one token
    labels = torch.where(pick, d["input_ids"], torch.full_like(d["input_ids"], -100))
    return DictRows({"input_ids": d["input_ids"], "attention_mask": d["attention_mask"], "labels": labels})


def build_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(11)
    return GPT2LMHeadModel(cfg)


def build_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                      bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(12)
    return AutoModelForCausalLM.from_config(cfg)


def build_bert():
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(13)
    return BertForMaskedLM(cfg)


# -- a hand-written ResNet (GroupNorm: a sample's result does not depend on its microbatch) ----


class Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(2, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(2, cout)
        self.down = None if stride == 1 and cin == cout else nn.Conv2d(cin, cout, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gn2(self.conv2(F.relu(self.gn1(self.conv1(x)))))
        return F.relu(y + (x if self.down is None else self.down(x)))


class SmallResNet(nn.Module):
    """stem, layer1, layer2, then pooling and fc written in forward (not modules)."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.GroupNorm(2, 8), nn.ReLU())
        self.layer1 = Basic(8, 8, 1)
        self.layer2 = Basic(8, 16, 2)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def build_resnet() -> tuple[SmallResNet, object]:
    torch.manual_seed(14)
    return SmallResNet(), F.cross_entropy


def images(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g))
