"""Moving layers between ranks at an iteration boundary, and rebuilding a stage around them.

Used by the adapter's re-plans (:mod:`deepcee.adapter.hooks`) and by an elastic run's
recovery (:mod:`deepcee.adapter.elastic`); its own module so that neither imports the other.
Parameters, buffers and optimizer state of a moved layer travel as one object per device pair
(in the decision message's order), paced by the emulated link when there is one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from deepcee.adapter.messages import Move, transfers_of
from deepcee.errors import RuntimeSetupError

if TYPE_CHECKING:
    from deepcee.runtime.trainer import Trainer


def rebuild(t: Trainer, key: str, received: Mapping[int, dict[str, Any]], kept_state: Mapping[Any, Any]) -> None:
    """New stage from the blocks (moved layers loaded first), optimizer state carried over."""
    with torch.no_grad():
        for layer, payload in received.items():
            for name, p in t.blocks[layer].named_parameters():
                p.copy_(payload["params"][name])
            for name, b in t.blocks[layer].named_buffers():
                b.copy_(payload["buffers"][name])
    t.build_stage(key)
    start = t.pipeline.stages[t.placement.stage].layer_start  # its replica's stage
    for name, p in t.stage.module.named_parameters():
        idx, rest = name.split(".", 1)
        layer = start + int(idx)
        if layer in received:
            state = received[layer]["state"].get(rest)
            if state:
                t.optimizer.state[p] = {k: _to_device(v, p) for k, v in state.items()}
        elif p in kept_state:
            t.optimizer.state[p] = kept_state[p]
    t.p2p = t.make_p2p()


def _layer_payload(t: Trainer, layer: int) -> dict[str, Any]:
    """Parameters, buffers and optimizer state of ``layer`` as this rank holds them (CPU copies)."""
    params, state = {}, {}
    opt_state = t.optimizer.state
    for name, p in t.blocks[layer].named_parameters():
        params[name] = p.detach().cpu().clone()
        if p in opt_state:
            state[name] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                           for k, v in opt_state[p].items()}
    buffers = {name: b.detach().cpu().clone() for name, b in t.blocks[layer].named_buffers()}
    return {"params": params, "buffers": buffers, "state": state}


def move_state(t: Trainer, devices: Sequence[str], moves: Sequence[Move]) -> dict[int, dict[str, Any]]:
    """Run this rank's part of ``moves`` (pairwise, in the message's order); returns what it received."""
    me = devices[t.w.rank]
    received: dict[int, dict[str, Any]] = {}
    for src, dst, layers in transfers_of(moves):
        if me == src:
            payload = {layer: _layer_payload(t, layer) for layer in layers}
            nbytes = sum(_nbytes(v) for v in payload.values())
            deliver = t.clock.wall()
            if t.shaper is not None:
                deliver = t.shaper.deliver_at(t.cluster.link(src, dst), nbytes, deliver)
            _send_object(t, {"deliver": deliver, "layers": payload}, dst)
        elif me == dst:
            box = _recv_object(t, src)
            if t.shaper is not None:
                t.clock.sleep_until(box["deliver"])
            received.update(box["layers"])
    return received


def _send_object(t: Trainer, obj: Any, dst: str) -> None:
    rank = t.topo.rank_of_device(dst)
    try:
        t.w.waiter.call(lambda: dist.send_object_list([obj], dst=rank), what=f"sending layer state to {dst}", peer=dst)
    except RuntimeError as exc:
        raise RuntimeSetupError(f"rank {t.w.rank}: sending layer state to rank {rank} ({dst}) failed: "
                                f"{str(exc)[:160]}") from None


def _recv_object(t: Trainer, src: str) -> Any:
    rank = t.topo.rank_of_device(src)
    box: list[Any] = [None]
    try:
        t.w.waiter.call(lambda: dist.recv_object_list(box, src=rank), what=f"receiving layer state from {src}",
                        peer=src)
    except RuntimeError as exc:
        raise RuntimeSetupError(f"rank {t.w.rank}: receiving layer state from rank {rank} ({src}) failed: "
                                f"{str(exc)[:160]}") from None
    return box[0]


def _to_device(v: Any, p: torch.Tensor) -> Any:
    # moments live with the parameter; AdamW keeps its step counter on the CPU
    return v.to(p.device) if torch.is_tensor(v) and v.shape == p.shape else v


def _nbytes(payload: Mapping[str, Any]) -> int:
    n = sum(t.numel() * t.element_size() for part in ("params", "buffers") for t in payload[part].values())
    for st in payload["state"].values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return n


__all__ = ["move_state", "rebuild"]
