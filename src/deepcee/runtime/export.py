"""``deepcee export``: a checkpoint as one plain ``state_dict`` file (and ``.safetensors``).

The checkpoint's ``model/<name>`` tensors ([Note: checkpoint layout] in
:mod:`deepcee.runtime.checkpoint`) are read in one process (DCP without a process group) and
written under every name each tensor has in the plain model, so the file loads into that model
with ``load_state_dict(..., strict=True)``: the user's own module, or for a built-in net
:func:`deepcee.runtime.state.builtin_model`. The file is ``torch.save`` of that dict (tied
names share one tensor, as in the model); with the ``safetensors`` package installed a
``.safetensors`` file beside it holds the same names (each its own copy: the format has no
shared tensors); an output named ``.safetensors`` gets that file alone. Files are written to a
temporary name and renamed.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from deepcee.errors import RuntimeSetupError, SpecError
from deepcee.runtime import checkpoint as ckpt
from deepcee.runtime.state import MODEL_PREFIX


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportResult:
    step: int
    folder: str
    """The checkpoint folder read."""
    tensors: int
    names: int
    """Keys written (a tied tensor once per name)."""
    files: tuple[str, ...]


def read_model_state(choice: ckpt.Choice) -> dict[str, torch.Tensor]:
    """Every name of the plain model -> its tensor, from a verified checkpoint."""
    reader = dcp.FileSystemReader(choice.folder)
    stored = reader.read_metadata().state_dict_metadata
    template = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
                for k, md in stored.items() if k.startswith(MODEL_PREFIX)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it loads without a process group: that is the point
        dcp.load(template, checkpoint_id=choice.folder, no_dist=True)
    primary = {k.removeprefix(MODEL_PREFIX): v for k, v in template.items()}
    names = choice.manifest.names or tuple((k, (k,)) for k in primary)
    out: dict[str, torch.Tensor] = {}
    for p, every in names:
        if p not in primary:
            raise RuntimeSetupError(f"{choice.folder}: the manifest names {p}, the checkpoint does not hold it")
        for n in every:
            out[n] = primary[p]
    return out


def _save_atomic(path: Path, write: Callable[[str], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def export_checkpoint(source: str | Path, output: str | Path) -> ExportResult:
    """Write the newest intact checkpoint under ``source`` (a run folder, a checkpoint folder or
    one ``step-N`` folder) to ``output`` (``torch.save``) and, with ``safetensors``, beside it."""
    out = Path(output)
    has_safetensors = importlib.util.find_spec("safetensors") is not None
    if out.suffix == ".safetensors" and not has_safetensors:  # never a torch pickle under that name
        raise SpecError(f"{str(out)!r}: writing .safetensors needs the safetensors package; give a .pt name",
                        field="--output")
    choice = ckpt.resolve(source)
    state = read_model_state(choice)
    files = []
    if out.suffix != ".safetensors":  # asked for .safetensors: that file alone
        _save_atomic(out, lambda p: torch.save(state, p))
        files.append(str(out))
    if has_safetensors:
        from safetensors.torch import save_file

        copies = {k: v.detach().clone().contiguous() for k, v in state.items()}
        st = out.with_suffix(".safetensors")
        _save_atomic(st, lambda p: save_file(copies, p, metadata={"format": "pt", "step": str(choice.step)}))
        files.append(str(st))
    return ExportResult(step=choice.step, folder=choice.folder, tensors=len({id(v) for v in state.values()}),
                        names=len(state), files=tuple(files))
