"""Paced sends of large messages over slow links: chunks released at the link's rate.

[Note: paced messages over slow links]
A replica's averaging or parameter-server message crosses a WAN link in one burst: gloo hands
the whole buffer to TCP at once, and after the first such message CUBIC's congestion window
covers all of it (the namespaces run without slow start after idle, [Note: slow start after
idle in the namespaces] in :mod:`deepcee.runtime.realnet.netns`). A 1 MB burst into a router
buffer of 625 kB (50 ms at 100 Mbit/s) loses its tail, and TCP recovers by retransmission
timeouts: measured in mode ``realnet`` (gpt-tiny, model averaging every 16 steps over the
20-40 ms / 100 Mbit/s links of ``local-small``, D = 3.33), averages took 1.4 and 2.6-2.9
emulated seconds against the ~0.3 s of the link model, with 25-60 packets dropped per link
and retransmission timeouts backed off to 0.8 s. Linux paces TCP only under the ``fq``
queueing discipline or BBR; the first is not available everywhere (not on this project's
machines) and the second slows short bursts ([Note: congestion control in the namespaces]).

So the runtime paces such messages itself: a message to a peer on another node is cut into
chunks of :data:`CHUNK_S` of the link's rate (at least :data:`MIN_CHUNK_BYTES`), and one
thread per peer sends them in order, each ``isend`` waited for before the next, the next one
chunk time on the wire (:data:`WIRE_EFFICIENCY`: TCP/IP headers) after it. Waiting matters:
gloo transmits a message only once the receiver has posted its receive, so chunks issued on a
timer alone reach a receiver that posts late in one burst again (seen: the gather towards a
root still busy with its own step kept losing 16-60 packets). The bottleneck queue then holds
about one chunk, and the message takes ``latency + bytes / rate``: what :mod:`deepcee.simulator`
assumes. Measured on the run above after the change: no drops on any link, the largest
backlog 52-63 ms (one chunk plus acknowledgements) instead of the 166 ms buffer, the second
average 0.34 emulated s. The same holds at the receiving end: a root (or parameter server)
posts every receive of a gather before it waits for any (:func:`deepcee.runtime.replicas.star_mean`,
:mod:`deepcee.runtime.ps`), else the second replica's copy waits for the first one's to be
taken: averaging steps 0.29-0.34 s with it against 0.34-0.44 s without, at a load of 4-5. The receiver posts one receive per chunk, in order, into one buffer:
both ends derive the same cut from the message size and the link (:func:`chunk_bounds`). Every
send on a paced pair goes through its thread, small ones included, so messages with the same
source, destination and tag keep their order. Lanes are per peer, not per link resource:
two peers behind one shared pipe are paced each at the full rate (the runtime sends one copy
per replica across a WAN link, so this does not arise in averaging).

Where: mode ``realnet`` (real TCP through the shaping relay, rates known exactly). In mode
``emulated`` the link shaper sets delivery times instead; mode ``real`` does not pace (its
links' rates are whatever the network has, not the cluster file's).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from deepcee.cluster import Link

CHUNK_S = 0.01
"""A chunk is this many (emulated) seconds of the link's rate: 125 kB at 100 Mbit/s, a fifth
of a 50 ms router buffer."""
MIN_CHUNK_BYTES = 64 * 1024
"""Smaller chunks cost more per-message overhead than they save in burst size."""
WIRE_EFFICIENCY = 1448 / 1500
"""Payload bytes per wire byte of a full TCP segment (Ethernet MTU, timestamps on): the relay
serialises wire bytes at the link's rate, so payload is released at this fraction of it."""


def chunk_bounds(nbytes: int, link: Link | None) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` byte ranges a message of ``nbytes`` is sent in (one range: unpaced)."""
    if link is None:
        return [(0, nbytes)]
    chunk = max(MIN_CHUNK_BYTES, int(link.bandwidth_bytes_per_s * CHUNK_S))
    return [(lo, min(lo + chunk, nbytes)) for lo in range(0, max(nbytes, 1), chunk)]


class ChunkedWork:
    """A chunked receive: one ``irecv`` per chunk, waited for as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout: Any = None) -> bool:
        for w in self.works:
            w.wait(timeout) if timeout is not None else w.wait()
        return True


class PacedSend:
    """A message handed to a :class:`Pacer`: done when its last chunk's ``isend`` completed."""

    def __init__(self, chunks: int) -> None:
        self.left = chunks
        self.done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("paced send not completed in time (the receiver did not take it)")
        if self.error is not None:
            raise RuntimeError(str(self.error).splitlines()[0] if str(self.error) else repr(self.error))
        return True


@dataclass(slots=True)
class _Chunk:
    data: torch.Tensor
    tag: int
    wire_s: float
    message: PacedSend


class _Lane:
    """One peer's chunks, sent in order by one thread: each chunk's ``isend`` is waited for
    (gloo transmits only once the receiver posted its receive, so a receiver that posts late
    would otherwise get every chunk issued meanwhile in one burst), and the next goes one
    chunk time on the wire after that."""

    def __init__(self, dst: int, wall: Callable[[], float], timeout_s: float) -> None:
        self.dst, self.wall, self.timeout_s = dst, wall, timeout_s
        self.queue: deque[_Chunk] = deque()
        self.cv = threading.Condition()
        threading.Thread(target=self._run, name=f"deepcee-pacer-{dst}", daemon=True).start()

    def put(self, chunks: list[_Chunk]) -> None:
        with self.cv:
            self.queue.extend(chunks)
            self.cv.notify_all()

    def _run(self) -> None:
        next_at = 0.0
        while True:
            with self.cv:
                self.cv.wait_for(lambda: bool(self.queue))
                c = self.queue.popleft()
            delay = next_at - self.wall()
            if delay > 0:
                time.sleep(delay)
            try:
                if c.message.error is None:
                    dist.isend(c.data, dst=self.dst, tag=c.tag).wait(timedelta(seconds=self.timeout_s))
            except BaseException as exc:  # the message fails; its sender sees it in flush
                c.message.error = exc
            next_at = self.wall() + c.wire_s
            c.message.left -= 1  # a message's chunks are all in this lane: only this thread counts them
            if c.message.left == 0 or c.message.error is not None:
                c.message.done.set()


class Pacer:
    """Paced sends to several peers: one :class:`_Lane` (thread) per peer. :meth:`schedule`
    returns at once with a :class:`PacedSend` to wait on."""

    def __init__(self, *, wall: Callable[[], float], dilation: float, epoch: float | None,
                 timeout_s: float) -> None:
        self.wall, self.dilation, self.epoch, self.timeout_s = wall, dilation, epoch, timeout_s
        self._lanes: dict[int, _Lane] = {}

    def schedule(self, buf: torch.Tensor, dst: int, tag: int, link: Link) -> PacedSend:
        """Queue ``buf`` (1-D bytes) for ``dst`` in :func:`chunk_bounds` chunks, paced on ``link``."""
        at_s = 0.0 if self.epoch is None else (self.wall() - self.epoch) / self.dilation
        rate = link.bandwidth_at(at_s) * WIRE_EFFICIENCY / self.dilation  # wall bytes per second
        bounds = chunk_bounds(buf.numel(), link)
        message = PacedSend(len(bounds))
        if dst not in self._lanes:
            self._lanes[dst] = _Lane(dst, self.wall, self.timeout_s)
        self._lanes[dst].put([_Chunk(data=buf[lo:hi], tag=tag, wire_s=(hi - lo) / rate, message=message) for lo, hi in bounds])
        return message


__all__ = ["CHUNK_S", "MIN_CHUNK_BYTES", "WIRE_EFFICIENCY", "ChunkedWork", "PacedSend", "Pacer", "chunk_bounds"]
