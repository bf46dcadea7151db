"""A run's data by rows of each step's global batch: map-style datasets (epochs, seeded
shuffling, held-out evaluation samples), streams (IterableDataset, DataLoader, a DataLoader
factory; resume), files and import paths. Each device of each microbatch gets its own rows,
and together they are the global batch, without overlap."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from deepcee.errors import SpecError
from deepcee.plan import Plan, StagePlan
from deepcee.runtime.datafiles import load_data
from deepcee.runtime.partition import Topology
from deepcee.runtime.sources import Data

N, B = 20, 8


def _ds(n: int = N) -> TensorDataset:
    x = torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 3)
    return TensorDataset(x, torch.arange(n))


def _ids(batch) -> list[int]:
    return batch.targets.tolist()


def test_ranks_rows_partition_every_global_batch():
    plan = Plan(system="t", cluster="c", model="m", global_batch=B, microbatch_size=4, num_microbatches=2,
                schedule="gpipe", stages=(StagePlan(layer_start=0, layer_stop=1, devices=("a", "b"), shares=(3, 1)),
                                          StagePlan(layer_start=1, layer_stop=2, devices=("c",), shares=(4,))))
    topo = Topology(plan)
    data = Data(_ds(), seed=1)
    for step in range(5):
        got = [i for r in topo.stage_ranks(0) for m in range(2) for i in _ids(data.rows(step, B, *topo.global_samples(r, m)))]
        assert sorted(got) == sorted(_ids(data.batch(step, B))) and len(set(got)) == B


def test_epochs_visit_every_sample_once_in_a_seeded_order():
    data = Data(_ds(), seed=1)
    per_epoch = N // B  # 2 steps; the 4 samples left over sit out that epoch
    epoch0 = [i for s in range(per_epoch) for i in _ids(data.batch(s, B))]
    epoch1 = [i for s in range(per_epoch, 2 * per_epoch) for i in _ids(data.batch(s, B))]
    assert len(set(epoch0)) == len(epoch0) == per_epoch * B
    assert epoch0 != epoch1 and data.epoch_of(per_epoch, B) == 1
    assert _ids(Data(_ds(), seed=1).batch(3, B)) == _ids(data.batch(3, B))
    assert _ids(Data(_ds(), seed=2).batch(0, B)) != _ids(data.batch(0, B))
    assert _ids(Data(_ds(), shuffle=False).batch(1, B)) == list(range(B, 2 * B))


def test_held_out_evaluation_samples_are_never_trained_on():
    data = Data(_ds(40), eval=0.25, seed=0)
    train = {i for s in range(4) for i in _ids(data.batch(s, B))}
    held = [i for b in data.eval_batches(4) for i in _ids(b)]
    assert data.num_eval_batches(4) == 2 and len(held) == 8 and set(held).isdisjoint(train)
    assert _ids(data.eval_rows(1, 4, 1, 3)) == held[5:7]
    assert "30 training samples, 10 evaluation samples" in data.describe()
    separate = Data(_ds(), eval=_ds(6))
    assert separate.num_eval_batches(4) == 1 and Data(_ds()).num_eval_batches(4) == 0
    with pytest.raises(SpecError, match="between 1 and 19"):
        Data(_ds(), eval=20)


class Samples(Dataset):
    """Dict samples with labels (as HuggingFace datasets give them)."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.full((4,), i), "attention_mask": torch.ones(4), "labels": torch.tensor(i)}


def test_dict_samples_split_into_inputs_and_labels():
    b = Data(Samples(), shuffle=False).rows(0, 4, 1, 3)
    assert set(b.inputs) == {"input_ids", "attention_mask"} and b.targets.tolist() == [1, 2]
    assert b.inputs["input_ids"].shape == (2, 4)


class Stream(IterableDataset):
    def __init__(self, n: int = 13, start: int = 0) -> None:
        self.n, self.start = n, start

    def __iter__(self):
        return iter([(torch.tensor([float(i)]), torch.tensor(i)) for i in range(self.start, self.start + self.n)])


def test_streams_read_in_order_epochs_back_to_back_and_resume():
    data = Data(Stream())
    assert _ids(data.batch(0, B)) == list(range(8)) and _ids(data.batch(1, B)) == [8, 9, 10, 11, 12, 0, 1, 2]
    resumed = Data(Stream())
    assert _ids(resumed.rows(2, B, 2, 5)) == _ids(data.batch(2, B))[2:5]
    loader = Data(DataLoader(TensorDataset(torch.arange(13.0)[:, None], torch.arange(13)), batch_size=5))
    assert _ids(loader.batch(1, B)) == _ids(data.batch(1, B))  # batches re-cut into global batches

    def factory():
        return DataLoader(TensorDataset(torch.arange(13.0)[:, None], torch.arange(13)), batch_size=3)

    assert _ids(Data(factory).batch(2, B)) == _ids(data.batch(2, B))
    assert data.digest(B) == Data(Stream()).digest(B) != Data(Stream(start=1)).digest(B) is not None
    assert Data(_ds()).digest(B) is None  # indexed data: every rank draws alike by construction
    with pytest.raises(SpecError, match="needs a map-style dataset"):
        Data(Stream(), eval=0.1)
    evaluated = Data(_ds(), eval=Stream(9, start=100))
    assert evaluated.num_eval_batches(4) == 2 and _ids(evaluated.eval_rows(1, 4, 0, 2)) == [104, 105]


def test_errors_name_the_data():
    with pytest.raises(SpecError, match="data: the data has 5 training samples, fewer than the global batch 8"):
        Data(_ds(5)).batch(0, B)
    with pytest.raises(SpecError, match=r"a sample must be \(inputs, targets\)"):
        Data([torch.zeros(2)] * 10).batch(0, 4)
    with pytest.raises(SpecError, match="TensorDataset"):
        Data((torch.zeros(4, 2), torch.zeros(4)))
    with pytest.raises(SpecError, match="expected a Dataset"):
        Data(42)


def test_files_and_import_paths(tmp_path, monkeypatch):
    x, y = torch.randn(12, 3), torch.randint(0, 2, (12,))
    torch.save((x, y), tmp_path / "pair.pt")
    torch.save({"x": x, "y": y}, tmp_path / "xy.pt")
    np.save(tmp_path / "rows.npy", np.arange(40).reshape(8, 5))
    np.savez(tmp_path / "cols.npz", input_ids=np.ones((9, 4), dtype=np.int64), labels=np.zeros((9, 4), dtype=np.int64))
    (tmp_path / "text.txt").write_bytes(b"abcdefghijklmnopqrstuvwxyz")
    for name in ("pair.pt", "xy.pt"):
        b = load_data(tmp_path / name, shuffle=False).batch(0, 4)
        assert torch.equal(b.inputs, x[:4]) and torch.equal(b.targets, y[:4])
    rows = load_data(tmp_path / "rows.npy", shuffle=False).batch(0, 2)
    assert rows.inputs.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]] and rows.targets[0].tolist() == [1, 2, 3, 4]
    cols = load_data(str(tmp_path / "cols.npz")).batch(0, 3)
    assert set(cols.inputs) == {"input_ids"} and cols.targets.shape == (3, 4)
    text = load_data(tmp_path / "text.txt", seq_len=5, shuffle=False).batch(1, 2)
    assert bytes(text.inputs[0].tolist()) == b"klmno" and bytes(text.targets[0].tolist()) == b"lmnop"
    (tmp_path / "mydata.py").write_text("import torch\nfrom torch.utils.data import TensorDataset\n"
                                        "def build():\n    return TensorDataset(torch.zeros(6, 2), torch.arange(6))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _ids(load_data("mydata:build", shuffle=False).batch(1, 3)) == [3, 4, 5]
    with pytest.raises(SpecError, match="no such file, and not an import path"):
        load_data(str(tmp_path / "missing.pt"))
    (tmp_path / "bad.pt").write_bytes(b"not a pickle")
    with pytest.raises(SpecError, match=r"bad.pt: data: cannot read data"):
        load_data(tmp_path / "bad.pt")
