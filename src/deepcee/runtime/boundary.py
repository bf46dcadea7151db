"""What crosses a stage boundary: a tensor, or a small fixed structure of tensors.

A block takes one value and returns one value; for most nets that is a tensor, but a
HuggingFace decoder layer also needs the attention mask, the position ids and the rotary
embeddings, so a boundary may be a *structure*: a tensor, ``None``, or a tuple, list or
``dict`` (string keys) of structures. Every tensor in it holds the samples first (dimension 0
is the sample), so a device's share of a microbatch is the same slice of every tensor.

:func:`flatten` gives a structure's *spec* (its shape as nested tuples, JSON-able) and its
leaves in a fixed order; :func:`unflatten` puts leaves back. :class:`BoundaryMeta` is the
per-sample description of a boundary agreed at start-up (:func:`deepcee.runtime.p2p.exchange_metadata`):
the spec and one :class:`TensorMeta` per tensor leaf, which also says whether the tensor gets a
gradient. A single tensor is described by a plain :class:`TensorMeta` (as before structures
existed), so the start-up messages of single-tensor nets are unchanged.

[Note: boundary gradients]
Only a tensor that is floating *and* depends on the sending stage's parameters gets a
gradient back (``TensorMeta.grad``, read off the sender's dry run with autograd on): the hidden
state does; the position ids (integers), a mask, or rotary ``cos``/``sin`` computed from
buffers do not, so no bytes and no autograd work are spent on them. The gradient of a boundary
is a structure of the same spec with a tensor at each such leaf and ``None`` elsewhere, as
autograd would give it; :class:`~deepcee.runtime.stage.StageRunner` takes and returns gradients
in that form, and :class:`~deepcee.runtime.p2p.P2P` sends only their tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepcee.errors import SpecError

Spec = Any
"""``"T"`` (a tensor), ``"N"`` (``None``), ``("tuple", (specs...))``, ``("list", (specs...))`` or
``("dict", ((key, spec), ...))``."""
TENSOR, NONE = "T", "N"


def flatten(x: Any, *, path: str = "") -> tuple[Spec, list[torch.Tensor | None]]:
    """``(spec, leaves)`` of a structure; a value that is neither a tensor, ``None``, a tuple, a
    list nor a dict with string keys is a :class:`SpecError` naming where it is."""
    if isinstance(x, torch.Tensor):
        return TENSOR, [x]
    if x is None:
        return NONE, [None]
    if isinstance(x, (tuple, list)):
        specs, leaves = [], []
        for i, v in enumerate(x):
            s, lv = flatten(v, path=f"{path}[{i}]")
            specs.append(s)
            leaves += lv
        return ("tuple" if isinstance(x, tuple) else "list", tuple(specs)), leaves
    if isinstance(x, dict):
        items, leaves = [], []
        for k, v in x.items():
            if not isinstance(k, str):
                raise SpecError(f"dict keys must be strings, got {k!r}", field=f"boundary{path}")
            s, lv = flatten(v, path=f"{path}[{k!r}]")
            items.append((k, s))
            leaves += lv
        return ("dict", tuple(items)), leaves
    raise SpecError(f"a value crossing a stage boundary must be a tensor (or a tuple, list or dict of them), got "
                    f"{type(x).__name__}", field=f"boundary{path}")


def unflatten(spec: Spec, leaves: Sequence[torch.Tensor | None]) -> Any:
    """The structure of ``spec`` with ``leaves`` in :func:`flatten`'s order."""
    it = iter(leaves)
    out = _build(spec, it)
    if next(it, _END) is not _END:
        raise ValueError(f"more leaves than spec {spec!r} holds")
    return out


_END = object()


def _build(spec: Spec, it: Iterator[torch.Tensor | None]) -> Any:
    if spec in (TENSOR, NONE):
        return next(it)
    kind, children = spec
    if kind == "dict":
        return {k: _build(s, it) for k, s in children}
    values = [_build(s, it) for s in children]
    return tuple(values) if kind == "tuple" else values


def tensors(x: Any) -> list[torch.Tensor]:
    """The tensors of a structure, in :func:`flatten`'s order."""
    return [t for t in flatten(x)[1] if t is not None]


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor | None], x: Any) -> Any:
    """The structure with ``fn`` applied to every tensor."""
    spec, leaves = flatten(x)
    return unflatten(spec, [None if t is None else fn(t) for t in leaves])


def grads_for(x: Any, mask: Sequence[bool], make: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A gradient structure for ``x``: ``make(t)`` for each tensor whose ``mask`` entry is true,
    ``None`` elsewhere ([Note: boundary gradients])."""
    spec, leaves = flatten(x)
    it = iter(mask)
    return unflatten(spec, [None if t is None else (make(t) if next(it) else None) for t in leaves])


def num_samples(x: Any) -> int:
    """The common first dimension of a structure's tensors."""
    sizes = {t.shape[0] if t.dim() else None for t in tensors(x)}
    if len(sizes) != 1 or None in sizes:
        raise SpecError(f"every tensor crossing a stage boundary holds the samples first; got first dimensions "
                        f"{sorted(sizes, key=str)}", field="boundary")
    return sizes.pop()


def take(x: Any, lo: int, hi: int) -> Any:
    """Samples ``[lo, hi)`` of every tensor."""
    return map_tensors(lambda t: t[lo:hi], x)


def cat(parts: Sequence[Any]) -> Any:
    """The structures of ``parts`` (one spec) joined along the samples."""
    spec, _ = flatten(parts[0])
    columns = [flatten(p)[1] for p in parts]
    return unflatten(spec, [None if col[0] is None else torch.cat(list(col)) for col in zip(*columns, strict=True)])


def to_device(x: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> Any:
    """Every tensor on ``device``; floating ones also in ``dtype`` when given."""
    def move(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return map_tensors(move, x)


# -- metadata agreed at start-up --------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMeta:
    """Per-sample shape and dtype of a tensor crossing a stage boundary."""

    shape: tuple[int, ...]
    dtype: str
    grad: bool = True
    """Whether the receiver sends its gradient back ([Note: boundary gradients]); only floating
    tensors ever do."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def gets_grad(self) -> bool:
        return self.grad and self.torch_dtype.is_floating_point

    @property
    def bytes_per_sample(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.torch_dtype).element_size()

    @staticmethod
    def of(t: torch.Tensor, *, grad: bool = True) -> TensorMeta:
        return TensorMeta(shape=tuple(t.shape[1:]), dtype=str(t.dtype).removeprefix("torch."), grad=grad)

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "grad": self.grad}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @staticmethod
    def from_dict(d: dict[str, Any]) -> TensorMeta:
        return TensorMeta(shape=tuple(d["shape"]), dtype=d["dtype"], grad=bool(d.get("grad", True)))

    @staticmethod
    def from_json(text: str) -> TensorMeta | BoundaryMeta | None:
        """A tensor's or a structure's meta (``None`` for the last stage, which sends nothing)."""
        d = json.loads(text)
        if d is None:
            return None
        return BoundaryMeta.from_dict(d) if "spec" in d else TensorMeta.from_dict(d)


def _spec_from_json(s: Any) -> Spec:
    if isinstance(s, str):
        return s
    kind, children = s
    if kind == "dict":
        return kind, tuple((k, _spec_from_json(c)) for k, c in children)
    return kind, tuple(_spec_from_json(c) for c in children)


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryMeta:
    """Per-sample description of a structure crossing a stage boundary: its spec and one
    :class:`TensorMeta` per tensor leaf (in :func:`flatten` order)."""

    spec: Spec
    tensors: tuple[TensorMeta, ...]

    def __post_init__(self) -> None:
        n = sum(1 for leaf in _leaf_kinds(self.spec) if leaf == TENSOR)
        if n != len(self.tensors):
            raise SpecError(f"spec {self.spec!r} holds {n} tensors, got {len(self.tensors)} metas", field="boundary")

    @staticmethod
    def of(x: Any) -> TensorMeta | BoundaryMeta:
        """The meta of what a stage outputs (computed with autograd on: a tensor gets a gradient
        when autograd tracks it, [Note: boundary gradients]); a plain :class:`TensorMeta` for a tensor."""
        if isinstance(x, torch.Tensor):
            return TensorMeta.of(x, grad=x.requires_grad)
        spec, leaves = flatten(x)
        return BoundaryMeta(spec=spec, tensors=tuple(TensorMeta.of(t, grad=t.requires_grad)
                                                     for t in leaves if t is not None))

    @staticmethod
    def coerce(meta: TensorMeta | BoundaryMeta) -> BoundaryMeta:
        return meta if isinstance(meta, BoundaryMeta) else BoundaryMeta(spec=TENSOR, tensors=(meta,))

    @property
    def bytes_per_sample(self) -> int:
        return sum(t.bytes_per_sample for t in self.tensors)

    @property
    def grad_mask(self) -> tuple[bool, ...]:
        return tuple(t.gets_grad for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        return {"spec": json.loads(json.dumps(self.spec)), "tensors": [t.to_dict() for t in self.tensors]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @staticmethod
    def from_dict(d: dict[str, Any]) -> BoundaryMeta:
        return BoundaryMeta(spec=_spec_from_json(d["spec"]), tensors=tuple(TensorMeta.from_dict(t) for t in d["tensors"]))

    def describe(self) -> str:
        names = _leaf_names(self.spec)
        return ", ".join(f"{n}: {t.dtype}{list(t.shape)}{'' if t.gets_grad else ' (no grad)'}"
                         for n, t in zip(names, self.tensors, strict=True))

    def pick(self, value: Any) -> list[torch.Tensor | None]:
        """Per tensor of the boundary, ``value``'s tensor there (``value`` has this spec, with
        ``None`` allowed anywhere, or is ``None``: a gradient that is ``None`` throughout)."""
        if value is None:
            return [None] * len(self.tensors)
        kinds = _leaf_kinds(self.spec)
        leaves = flatten(value)[1]
        if len(leaves) != len(kinds):
            raise SpecError(f"{len(leaves)} values where the boundary has {len(kinds)} ({self.describe()})",
                            field="boundary")
        return [v for v, k in zip(leaves, kinds, strict=True) if k == TENSOR]

    def build(self, tensors: Sequence[torch.Tensor | None]) -> Any:
        """The boundary's structure with ``tensors`` (one per tensor of the boundary) in place."""
        it = iter(tensors)
        return unflatten(self.spec, [next(it) if k == TENSOR else None for k in _leaf_kinds(self.spec)])

    def zeros(self, samples: int, device: torch.device | str = "cpu") -> Any:
        """A structure of zeros with ``samples`` samples (a stage's dry-run input)."""
        return self.build([torch.zeros((samples, *m.shape), dtype=m.torch_dtype, device=device)
                           for m in self.tensors])


def _leaf_kinds(spec: Spec) -> list[str]:
    if spec in (TENSOR, NONE):
        return [spec]
    kind, children = spec
    return [leaf for c in children for leaf in _leaf_kinds(c[1] if kind == "dict" else c)]


def _leaf_names(spec: Spec, path: str = "") -> list[str]:
    """A readable name for each tensor leaf (``['hidden']``, ``[1]``)."""
    if spec == TENSOR:
        return [path or "tensor"]
    if spec == NONE:
        return []
    kind, children = spec
    if kind == "dict":
        return [n for k, c in children for n in _leaf_names(c, f"{path}[{k!r}]")]
    return [n for i, c in enumerate(children) for n in _leaf_names(c, f"{path}[{i}]")]
