"""A run's data: any ``Dataset``, ``IterableDataset`` or ``DataLoader`` as global batches by step.

:class:`Data` wraps what a user has and answers the runtime's one question: *rows* ``[lo, hi)``
of the global batch of step ``s`` (:meth:`Data.rows`); every rank asks only for its own rows
(its sample range of each microbatch, :meth:`deepcee.runtime.partition.Topology.global_samples`),
so each replica and device gets its share of every global batch and no two get the same sample.
:func:`as_source` turns anything a job may hold into a :class:`Data` (the shipped datasets
and objects with ``batch(step, batch_size)`` included).

[Note: data by step]
What a step trains on depends only on ``(data, seed, step, global batch)``, on every rank:

- map-style ``Dataset`` (``TensorDataset`` included): epoch ``e`` is a permutation of the
  training indices drawn from ``(seed, e)`` (or the identity without shuffling); step ``s`` is
  slice ``k`` of epoch ``e``, ``(e, k) = divmod(s, len // global_batch)``; the last partial
  batch of an epoch is left out. A rank fetches only its rows (``__getitems__`` when the
  dataset has it, a tensor index for a ``TensorDataset``).
- ``IterableDataset``, ``DataLoader`` (or a callable returning one): a stream; global batch
  ``s`` is samples ``[s B, (s+1) B)`` of the stream, epochs back to back (the stream is started
  again when it ends). A stream cannot be indexed, so every rank reads the whole global batch
  and keeps its rows; the stream must give the same samples on every rank (seed its
  shuffling), which start-up checks ([`data digest` in :func:`deepcee.runtime.p2p.exchange_metadata`]).
  A resumed run skips the samples of the steps done.
- an object with ``batch(step, batch_size) -> Batch`` (the shipped datasets): as it says.

A sample is ``(inputs, targets)`` (a tuple or list of two), or a dict with a ``labels`` key
(the targets; the other keys are the inputs, as a dict); inputs and targets may be tensors or
structures of tensors (:mod:`deepcee.runtime.boundary`). Samples are collated with
``torch.utils.data.default_collate``.

Evaluation ([Note: evaluation data]): ``eval`` is a held-out part of a map-style dataset (a
fraction or a count, drawn once from ``seed``, never trained on) or a separate dataset of any
kind above. :meth:`Data.num_eval_batches` / :meth:`Data.eval_rows` give evaluation batch ``k``
of a given size by rows (like :meth:`Data.rows`; partial last batches are left out), and
:meth:`Data.eval_batches` iterates whole batches.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, default_collate

from deepcee.errors import SpecError
from deepcee.runtime import boundary
from deepcee.runtime.data import Batch

log = logging.getLogger(__name__)

DEFAULT_EVAL_BATCHES = 4
"""Evaluation batches drawn from an endless evaluation source (an object with ``batch``)."""


def as_batch(collated: Any, *, where: str = "data") -> Batch:
    """A collated sample structure as :class:`Batch`: ``(inputs, targets)`` or a dict with ``labels``."""
    if isinstance(collated, Batch):
        return collated
    if isinstance(collated, (tuple, list)) and len(collated) == 2:
        return Batch(inputs=collated[0], targets=collated[1])
    if isinstance(collated, dict) and "labels" in collated:
        return Batch(inputs={k: v for k, v in collated.items() if k != "labels"}, targets=collated["labels"])
    raise SpecError(f"a sample must be (inputs, targets) or a dict with a 'labels' key, got {_describe(collated)}",
                    field=where)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)}"
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a {type(x).__name__}"


def _slice(b: Batch, lo: int, hi: int) -> Batch:
    return Batch(inputs=boundary.take(b.inputs, lo, hi), targets=boundary.take(b.targets, lo, hi))


def _is_map(obj: Any) -> bool:
    return (hasattr(obj, "__getitem__") and hasattr(obj, "__len__") and not isinstance(obj, IterableDataset)
            and not isinstance(obj, (DataLoader, torch.Tensor, tuple, dict, str)))


# -- the three kinds of part ------------------------------------------------------------------


class _MapPart:
    """Indices ``indices`` of a map-style dataset, by step. See [Note: data by step]."""

    def __init__(self, dataset: Any, indices: np.ndarray, *, shuffle: bool, seed: int) -> None:
        self.dataset, self.indices, self.shuffle, self.seed = dataset, indices, shuffle, seed
        self._perm: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.indices)

    def _epoch(self, e: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != e:
            order = np.random.default_rng([self.seed, e]).permutation(len(self.indices)) if self.shuffle else None
            self._perm = (e, self.indices if order is None else self.indices[order])
        return self._perm[1]

    def indices_of(self, step: int, batch_size: int) -> np.ndarray:
        per_epoch = len(self.indices) // batch_size
        if per_epoch == 0:
            raise SpecError(f"the data has {len(self.indices)} training samples, fewer than the global batch "
                            f"{batch_size}", field="data")
        e, k = divmod(step, per_epoch)
        return self._epoch(e)[k * batch_size:(k + 1) * batch_size]

    def fetch(self, idx: np.ndarray) -> Batch:
        if isinstance(self.dataset, TensorDataset):
            return as_batch(self.dataset[torch.as_tensor(idx, dtype=torch.long)])
        if hasattr(self.dataset, "__getitems__"):
            samples = self.dataset.__getitems__([int(i) for i in idx])
        else:
            samples = [self.dataset[int(i)] for i in idx]
        return as_batch(default_collate(samples))

    def rows(self, step: int, batch_size: int, lo: int, hi: int) -> Batch:
        return self.fetch(self.indices_of(step, batch_size)[lo:hi])


class _StreamPart:
    """An ``IterableDataset`` or ``DataLoader`` read in order, epochs back to back. See [Note: data by step]."""

    def __init__(self, make: Callable[[], Iterable[Any]], *, batched: bool) -> None:
        self.make, self.batched = make, batched
        self._it: Iterator[Any] | None = None
        self._left: Batch | None = None
        self._pos = 0
        """Samples consumed since the start of the stream."""
        self._cache: tuple[int, int, Batch] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"make": self.make, "batched": self.batched}  # a copy starts from the beginning

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["make"], batched=state["batched"])

    def _next(self) -> Any:
        for _ in range(2):
            if self._it is None:
                self._it = iter(self.make())
            try:
                return next(self._it)
            except StopIteration:
                self._it = None  # the next epoch
        raise SpecError("the data stream yields nothing", field="data")

    def _read(self, n: int) -> Batch:
        """The next ``n`` samples of the stream."""
        if not self.batched:
            out = as_batch(default_collate([self._next() for _ in range(n)]))
        else:
            parts, have = [], 0
            while have < n:
                chunk = self._left if self._left is not None else as_batch(self._next())
                self._left = None
                size = boundary.num_samples(chunk.targets)
                if have + size > n:
                    chunk, self._left = _slice(chunk, 0, n - have), _slice(chunk, n - have, size)
                    size = n - have
                parts.append(chunk)
                have += size
            out = Batch(inputs=boundary.cat([p.inputs for p in parts]), targets=boundary.cat([p.targets for p in parts]))
        self._pos += n
        return out

    def global_batch(self, step: int, batch_size: int) -> Batch:
        if self._cache is not None and self._cache[:2] == (step, batch_size):
            return self._cache[2]
        start = step * batch_size
        if start < self._pos:  # back to the beginning (a re-run of an earlier step)
            self._it, self._left, self._pos = None, None, 0
        while self._pos < start:  # a resumed run: skip the samples already trained on
            self._read(min(batch_size, start - self._pos))
        batch = self._read(batch_size)
        self._cache = (step, batch_size, batch)
        return batch

    def rows(self, step: int, batch_size: int, lo: int, hi: int) -> Batch:
        return _slice(self.global_batch(step, batch_size), lo, hi)


class _StepPart:
    """An object with ``batch(step, batch_size)``; the last global batch is kept for its slices."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self._cache: tuple[int, int, Batch] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"obj": self.obj}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["obj"])

    def global_batch(self, step: int, batch_size: int) -> Batch:
        if self._cache is None or self._cache[:2] != (step, batch_size):
            self._cache = (step, batch_size, as_batch(self.obj.batch(step, batch_size)))
        return self._cache[2]

    def rows(self, step: int, batch_size: int, lo: int, hi: int) -> Batch:
        return _slice(self.global_batch(step, batch_size), lo, hi)


def _part(obj: Any, *, shuffle: bool, seed: int, where: str) -> _MapPart | _StreamPart | _StepPart:
    if hasattr(obj, "batch") and callable(obj.batch) and not _is_map(obj):
        return _StepPart(obj)
    if isinstance(obj, DataLoader):
        return _StreamPart(_Same(obj), batched=obj.batch_size is not None or obj.batch_sampler is not None)
    if isinstance(obj, IterableDataset):
        return _StreamPart(_Same(obj), batched=False)
    if _is_map(obj):
        return _MapPart(obj, np.arange(len(obj)), shuffle=shuffle, seed=seed)
    if callable(obj):
        made = obj()
        if isinstance(made, DataLoader):
            return _StreamPart(obj, batched=made.batch_size is not None or made.batch_sampler is not None)
        return _part(made, shuffle=shuffle, seed=seed, where=where)
    hint = " (for tensors of inputs and targets: torch.utils.data.TensorDataset(inputs, targets))" if isinstance(
        obj, tuple) else ""
    raise SpecError(f"expected a Dataset, an IterableDataset, a DataLoader (or a callable returning one) or an "
                    f"object with batch(step, batch_size), got {type(obj).__name__}{hint}", field=where)


class _Same:
    """A factory that hands out the same iterable (a DataLoader or an IterableDataset) each epoch."""

    def __init__(self, obj: Iterable[Any]) -> None:
        self.obj = obj

    def __call__(self) -> Iterable[Any]:
        return self.obj


# -- the user's view ------------------------------------------------------------------------


class Data:
    """Training data (and optionally evaluation data) of a run. See the module docstring.

    ``train``: a map-style ``Dataset``, an ``IterableDataset``, a ``DataLoader``, a callable
    returning one of them, or an object with ``batch(step, batch_size)``. ``eval``: a fraction
    (``0 < eval < 1``) or a number of samples held out of a map-style ``train``, or a separate
    dataset of any of those kinds. ``shuffle`` and ``seed`` order a map-style dataset's epochs.
    ``eval_batches``: how many evaluation batches an endless evaluation source (``batch(step,
    n)``) gives (default :data:`DEFAULT_EVAL_BATCHES`)."""

    def __init__(self, train: Any, *, eval: Any = None, shuffle: bool = True, seed: int = 0,
                 eval_batches: int | None = None) -> None:
        self.shuffle, self.seed = shuffle, seed
        self.train = _part(train, shuffle=shuffle, seed=seed, where="data")
        self.eval: _MapPart | _StreamPart | _StepPart | None = None
        self._eval_count = eval_batches
        if isinstance(eval, (int, float)) and not isinstance(eval, bool):
            self._hold_out(eval)
        elif eval is not None:
            self.eval = _part(eval, shuffle=False, seed=seed, where="eval")
        self._eval_stream: list[Batch] = []

    def _hold_out(self, amount: float) -> None:
        if not isinstance(self.train, _MapPart):
            raise SpecError(f"holding out {amount!r} needs a map-style dataset (with len and indexing); give a "
                            "separate evaluation dataset instead", field="eval")
        n = len(self.train)
        if not math.isfinite(amount) or (amount > 1 and amount != int(amount)):  # int() would take 2.5 as 2
            raise SpecError(f"must be a fraction in (0, 1) or a whole count of samples, got {amount!r}", field="eval")
        k = int(amount) if isinstance(amount, int) or amount >= 1 else round(amount * n)
        if not 0 < k < n:
            raise SpecError(f"must hold out between 1 and {n - 1} of the {n} samples, got {amount!r}", field="eval")
        # one draw from the seed, fixed for the whole run (never the training permutation)
        order = np.random.default_rng([self.seed, 0xE7A1]).permutation(n)
        ds = self.train.dataset
        self.eval = _MapPart(ds, np.sort(order[:k]), shuffle=False, seed=self.seed)
        self.train = _MapPart(ds, np.sort(order[k:]), shuffle=self.shuffle, seed=self.seed)

    def describe(self) -> str:
        kinds = {_MapPart: "map-style dataset", _StreamPart: "stream", _StepPart: "batch(step, n) source"}
        what = kinds[type(self.train)] + (f" of {len(self.train)} training samples" if isinstance(self.train, _MapPart) else "")
        if isinstance(self.eval, _MapPart):
            what += f", {len(self.eval)} evaluation samples"
        elif self.eval is not None:
            what += f", evaluation {kinds[type(self.eval)]}"
        return what

    # -- training ---------------------------------------------------------------------------
    def rows(self, step: int, batch_size: int, lo: int, hi: int) -> Batch:
        """Rows ``[lo, hi)`` of the global batch of ``step`` (``batch_size`` samples)."""
        if not 0 <= lo < hi <= batch_size:
            raise SpecError(f"rows [{lo}, {hi}) are not inside a global batch of {batch_size}", field="rows")
        return self.train.rows(step, batch_size, lo, hi)

    def batch(self, step: int, batch_size: int) -> Batch:
        """The whole global batch of ``step`` (a single-process reference reads this)."""
        return self.rows(step, batch_size, 0, batch_size)

    def epoch_of(self, step: int, batch_size: int) -> int | None:
        """The epoch ``step`` belongs to (``None`` for streams and step sources, whose epochs the data decides)."""
        if not isinstance(self.train, _MapPart):
            return None
        return step // max(1, len(self.train) // batch_size)

    def digest(self, batch_size: int) -> str | None:
        """A digest of step 0's global batch for a stream (ranks compare it at start-up: a stream
        must give every rank the same samples); ``None`` for indexed data, which every rank draws alike."""
        if not isinstance(self.train, _StreamPart):
            return None
        h = hashlib.sha256()
        b = self.train.global_batch(0, batch_size)
        for t in (*boundary.tensors(b.inputs), *boundary.tensors(b.targets)):
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    # -- evaluation: [Note: evaluation data] ----------------------------------------------------
    def _own_eval(self) -> Callable[[int], Iterable[Batch]] | None:
        """The ``eval_batches`` of a ``batch(step, n)`` source that has one (the shipped datasets),
        used when no other evaluation data is given."""
        if self.eval is not None or not isinstance(self.train, _StepPart):
            return None
        fn = getattr(self.train.obj, "eval_batches", None)
        return fn if callable(fn) else None

    @property
    def has_eval(self) -> bool:
        """Whether there is evaluation data (held out, separate, or the source's own)."""
        return self.eval is not None or self._own_eval() is not None

    def num_eval_batches(self, batch_size: int) -> int:
        """Whole evaluation batches of ``batch_size`` samples (0 without evaluation data)."""
        if self.eval is None:
            own = self._own_eval()
            return 0 if own is None else sum(1 for _ in own(batch_size))
        if isinstance(self.eval, _MapPart):
            return len(self.eval) // batch_size
        if isinstance(self.eval, _StepPart):
            return self._eval_count or DEFAULT_EVAL_BATCHES
        return len(self._stream_eval(batch_size))

    def _stream_eval(self, batch_size: int) -> list[Batch]:
        """A finite evaluation stream read once and cut into whole batches (kept: evaluation repeats)."""
        if self._eval_stream and boundary.num_samples(self._eval_stream[0].targets) == batch_size:
            return self._eval_stream
        it = iter(self.eval.make())
        chunks = [as_batch(x) for x in it] if self.eval.batched else [
            as_batch(default_collate(c)) for c in _chunks(it, batch_size)]
        if not chunks:
            raise SpecError("the evaluation stream yields nothing", field="eval")
        joined = Batch(inputs=boundary.cat([c.inputs for c in chunks]), targets=boundary.cat([c.targets for c in chunks]))
        whole = boundary.num_samples(joined.targets) // batch_size
        batches = [_slice(joined, k * batch_size, (k + 1) * batch_size) for k in range(whole)]
        self._eval_stream = batches[:self._eval_count or len(batches)]
        return self._eval_stream

    def eval_rows(self, k: int, batch_size: int, lo: int, hi: int) -> Batch:
        """Rows ``[lo, hi)`` of evaluation batch ``k`` (``0 <= k < num_eval_batches(batch_size)``)."""
        count = self.num_eval_batches(batch_size)
        if not 0 <= k < count:
            raise SpecError(f"evaluation batch {k} of {count} (batch size {batch_size})", field="eval")
        if isinstance(self.eval, _MapPart):
            return self.eval.fetch(self.eval.indices[k * batch_size:(k + 1) * batch_size][lo:hi])
        if isinstance(self.eval, _StepPart):
            return self.eval.rows(k, batch_size, lo, hi)
        if self.eval is None:  # the source's own evaluation batches
            return _slice(next(itertools.islice(self._own_eval()(batch_size), k, None)), lo, hi)
        return _slice(self._stream_eval(batch_size)[k], lo, hi)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        """Every whole evaluation batch of ``batch_size`` samples, in order."""
        own = self._own_eval()
        if own is not None:
            yield from own(batch_size)
            return
        for k in range(self.num_eval_batches(batch_size)):
            yield self.eval_rows(k, batch_size, 0, batch_size)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_eval_stream"] = []
        return state


def _chunks(it: Iterator[Any], n: int) -> Iterator[list[Any]]:
    while True:
        chunk = [x for _, x in zip(range(n), it, strict=False)]
        if not chunk:
            return
        yield chunk


def as_source(obj: Any, *, seed: int = 0) -> Data:
    """A job's data as :class:`Data` (a :class:`Data` is returned as it is; others shuffled with ``seed``)."""
    return obj if isinstance(obj, Data) else Data(obj, seed=seed)
