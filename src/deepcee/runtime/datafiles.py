"""Data named on a command line: an import path or a file, as a :class:`~deepcee.runtime.sources.Data`.

:func:`load_data` takes

- ``package.module:name``: a ``Dataset``, ``IterableDataset``, ``DataLoader``, a
  :class:`~deepcee.runtime.sources.Data`, or a callable returning one of them (a callable that
  returns a ``DataLoader`` is called again on every rank and every epoch);
- a ``.pt`` file (``torch.load`` with ``weights_only``: tensors, tuples, lists and dicts only),
  a ``.npy`` or a ``.npz`` file, holding
  - two tensors ``(inputs, targets)`` (a tuple or list, or a dict with keys ``inputs`` and
    ``targets``, or ``x`` and ``y``): one sample per row (a ``TensorDataset``);
  - a dict of tensors with a ``labels`` key: one sample per row, inputs as a dict;
  - one integer tensor: token ids for a causal LM: 2-D, one window per row (``inputs`` the
    first ``T - 1`` tokens, ``targets`` the next ones); 1-D, a token stream cut into windows
    of ``seq_len + 1``;
- a text file (any other suffix): its bytes as a token stream (vocabulary 256), cut into
  windows of ``seq_len + 1`` (:class:`TokenWindows`).

Files are read once, where the data is named (the parent of a local launch, or every rank
under torchrun); the samples then travel with the job.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from deepcee.errors import SpecError
from deepcee.runtime.data import Batch
from deepcee.runtime.sources import Data
from deepcee.userref import import_object, is_import_path

DEFAULT_SEQ_LEN = 64


class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` tokens of a 1-D token stream, back to back: sample ``i`` is
    ``(tokens[i s : i s + s], tokens[i s + 1 : i s + s + 1])`` with ``s = seq_len``."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.dim() != 1 or tokens.is_floating_point():
            raise SpecError(f"a token stream must be a 1-D integer tensor, got {tokens.dtype} of shape "
                            f"{list(tokens.shape)}", field="data")
        if seq_len < 1 or tokens.numel() < seq_len + 1:
            raise SpecError(f"{tokens.numel()} tokens make no window of seq_len + 1 = {seq_len + 1}", field="seq_len")
        self.tokens, self.seq_len = tokens.long(), seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        w = self.tokens[i * self.seq_len:i * self.seq_len + self.seq_len + 1]
        return w[:-1], w[1:]


class RowWindows(Dataset):
    """Rows of a 2-D integer tensor as causal-LM samples: ``(row[:-1], row[1:])``."""

    def __init__(self, rows: torch.Tensor) -> None:
        if rows.dim() != 2 or rows.shape[1] < 2 or rows.is_floating_point():
            raise SpecError(f"token rows must be a 2-D integer tensor with >= 2 columns, got {rows.dtype} of shape "
                            f"{list(rows.shape)}", field="data")
        self.rows = rows.long()

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows[i, :-1], self.rows[i, 1:]


class DictRows(Dataset):
    """Rows of equally long tensors in a dict with ``labels``: sample ``i`` is ``{k: v[i]}``."""

    def __init__(self, columns: dict[str, torch.Tensor]) -> None:
        sizes = {k: v.shape[0] for k, v in columns.items()}
        if len(set(sizes.values())) != 1:
            raise SpecError(f"every column needs the same number of rows, got {sizes}", field="data")
        self.columns = columns

    def __len__(self) -> int:
        return next(iter(self.columns.values())).shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.columns.items()}


def _tensor(x: Any) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


def dataset_from_value(value: Any, *, seq_len: int | None = None, where: str = "data") -> Any:
    """A dataset from what a data file holds (see the module docstring)."""
    if isinstance(value, np.lib.npyio.NpzFile):
        value = {k: value[k] for k in value.files}
    if isinstance(value, (torch.Tensor, np.ndarray)):
        t = _tensor(value)
        if t.dim() == 2:
            return RowWindows(t)
        return TokenWindows(t, seq_len or DEFAULT_SEQ_LEN)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return TensorDataset(_tensor(value[0]), _tensor(value[1]))
    if isinstance(value, dict):
        cols = {k: _tensor(v) for k, v in value.items()}
        for a, b in (("inputs", "targets"), ("x", "y")):
            if set(cols) == {a, b}:
                return TensorDataset(cols[a], cols[b])
        if "labels" in cols:
            return DictRows(cols)
        raise SpecError(f"a dict of data needs keys inputs/targets, x/y, or a 'labels' column; got {sorted(cols)}",
                        field=where)
    raise SpecError(f"cannot make samples from a {type(value).__name__}", field=where)


def read_file(path: Path, *, seq_len: int | None = None) -> Any:
    """The dataset a data file holds."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".pt":
            value = torch.load(path, map_location="cpu", weights_only=True)
        elif suffix in (".npy", ".npz"):
            value = np.load(path, allow_pickle=False)
        else:
            value = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise SpecError(f"cannot read data: {str(exc).splitlines()[0][:200]}", file=str(path), field="data") from None
    try:
        return dataset_from_value(value, seq_len=seq_len)
    except SpecError as exc:
        raise SpecError(str(exc), file=str(path)) from None


def resolve_data(ref: Any, *, seq_len: int | None = None) -> Any:
    """A file or an import path as the object it names; anything else as it is."""
    if not isinstance(ref, (str, Path)):
        return ref
    path = Path(ref)
    if path.exists():
        return read_file(path, seq_len=seq_len)
    if isinstance(ref, str) and is_import_path(ref):
        return import_object(ref, what="data")
    raise SpecError(f"no such file, and not an import path (package.module:name): {str(ref)!r}", field="data")


def load_data(ref: Any, *, seq_len: int | None = None, seed: int = 0, shuffle: bool = True,
              eval: Any = None) -> Data:
    """``ref`` (an import path, a file, or a data object) as :class:`Data`, with ``eval`` (a
    fraction or count to hold out, or evaluation data named the same ways). See the module docstring."""
    obj = resolve_data(ref, seq_len=seq_len)
    if isinstance(obj, Data):
        return obj
    if isinstance(obj, Batch):
        raise SpecError("a single Batch is not a dataset; give a Dataset or an object with batch(step, n)",
                        field="data")
    if isinstance(eval, (str, Path)):
        eval = resolve_data(eval, seq_len=seq_len)
    return Data(obj, seed=seed, shuffle=shuffle, eval=eval)
