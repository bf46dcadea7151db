"""The elastic session's waits and its fault flag, on an in-memory store (no other process).

Orderings that a loaded machine produces only now and then are forced here: a store whose
``check`` of one key, from the heartbeat thread, waits until the test lets it go. Every wait of
these tests is bounded (a few seconds at most), so a regression fails instead of hanging.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from deepcee.errors import RuntimeSetupError
from deepcee.runtime.elastic import ElasticConfig, JoinRecord, PeerLost, Session, Transition

CFG = ElasticConfig(heartbeat_s=0.05, lost_after_s=0.2)
BOUND_S = 10.0
"""Longest any step of these tests may take: far above what each needs, far below a hang."""


class GatedStore(dist.Store):
    """An in-memory store; the heartbeat thread's ``check`` of ``gated_key`` waits for :attr:`go`."""

    def __init__(self, gated_key: str = "") -> None:
        super().__init__()
        self.inner = dist.HashStore()
        self.gated_key = gated_key
        self.arrived, self.go = threading.Event(), threading.Event()

    def check(self, keys):
        if self.gated_key in keys and threading.current_thread().name == "deepcee-heartbeat" and not self.go.is_set():
            self.arrived.set()
            assert self.go.wait(BOUND_S)
        return self.inner.check(keys)

    def set(self, key, value):
        self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def add(self, key, n):
        return self.inner.add(key, n)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def wait(self, keys, timeout=None):
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)


def _session(store, device: str, devices: tuple[str, ...], **kw) -> Session:
    return Session(store, kw.pop("config", CFG), device=device, launch_devices=devices, timeout_s=kw.pop("timeout_s", 5.0),
                   torch_device=torch.device("cpu"))


def _beats(store, device: str) -> int:
    return int(store.get(f"hb/{device}").decode().split()[0])


def _bounded(fn):
    """``fn()`` in a thread of its own, its exception raised here; fails past :data:`BOUND_S`
    (a wait that never ends fails the test instead of hanging it)."""
    box: list = [None, None]

    def run() -> None:
        try:
            box[0] = fn()
        except BaseException as exc:  # noqa: BLE001  (raised again in the test's thread)
            box[1] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(BOUND_S)
    assert not th.is_alive(), f"still waiting after {BOUND_S:g} s"
    if box[1] is not None:
        raise box[1]
    return box[0]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_heartbeat_that_looked_at_the_old_generation_does_not_flag_the_new_one():
    # the heartbeat thread reads generation 0 (which has a fault), the rank enters generation 1,
    # then the thread finds generation 0's fault: the new generation must not inherit it (it did:
    # the rank's next wait raised "generation 1: fault (reported by ?)" and, since the flag was
    # already set, its recovery never wrote the fault where the other members would see it)
    store = GatedStore(gated_key="g0/fault")
    s = _session(store, "a", ("a",))
    s.enter(Transition(gen=0, devices=("a",), resume_step=0))
    try:
        s.start()
        s.report("a: a peer is gone", suspect=None)
        assert store.arrived.wait(BOUND_S)  # the thread holds generation 0, before its look at the fault
        s.leave()
        s.enter(Transition(gen=1, devices=("a",), resume_step=0))
        store.go.set()
        n, t_end = _beats(store, "a"), time.monotonic() + BOUND_S
        while _beats(store, "a") < n + 2 and time.monotonic() < t_end:  # the thread went on past its look
            time.sleep(CFG.heartbeat_s / 5)
        assert _beats(store, "a") >= n + 2
        assert not s.fault.is_set()
        s.check()  # no PeerLost
        s.report("a: a real fault of generation 1", suspect=None)
        with pytest.raises(PeerLost, match="generation 1: a: a real fault"):
            s.check()
    finally:
        s.close()
        s.leave()
        s.release()


def test_a_recovery_whose_flag_is_set_still_publishes_the_fault():
    # however the flag came to be set, the other members learn of the fault from the store, not
    # by waiting out their own timeouts
    store = dist.HashStore()
    s = _session(store, "a", ("a", "b"))
    s.fault.set()
    store.compare_set("g0/leader", "", "b")  # b leads: a waits for its decision
    store.set("hb/b", f"1 {os.getpid()} {s._host}")
    join = JoinRecord(device="a", rank=0, applied=3, version=0, layers=(), detected_s=time.time())
    tr = Transition(gen=1, devices=("a", "b"), resume_step=3)
    store.set("g0/decision", pickle.dumps(tr))
    assert _bounded(lambda: s.recover(join, lambda *a: tr)) == tr
    assert s.first_fault() is not None and s.first_fault().by == "a"


def test_waiting_to_rejoin_ends_with_an_error_when_no_device_can_admit_it():
    # the only other device is gone: nobody is left to take b back in
    store = dist.HashStore()
    s = _session(store, "b", ("a", "b"))
    store.set("hb/a", f"7 {_dead_pid()} {s._host}")
    t0 = time.monotonic()
    with pytest.raises(RuntimeSetupError, match=r"b: waited to rejoin, but for .* s no device of the run could "
                                                r"admit it \(a: its process \(pid \d+\) is gone\)"):
        _bounded(s.await_admission)
    assert time.monotonic() - t0 < BOUND_S


def test_waiting_to_rejoin_ends_with_an_error_when_every_other_device_waits_too():
    # every device was restarted and asks to come back: none of them is training to admit the others
    store = dist.HashStore()
    s = _session(store, "b", ("a", "b"))
    stop = threading.Event()

    def a_waits_too() -> None:  # alive, beating, and asking to rejoin itself
        n = 0
        store.set("rejoin/a", "1")
        while not stop.wait(CFG.heartbeat_s):
            n += 1
            store.set("hb/a", f"{n} {os.getpid()} {s._host}")

    th = threading.Thread(target=a_waits_too, daemon=True)
    th.start()
    try:
        with pytest.raises(RuntimeSetupError, match=r"b: waited to rejoin, but for .* s no device of the run "
                                                    r"could admit it \(a: waits to rejoin too\)"):
            _bounded(s.await_admission)
    finally:
        stop.set()
        th.join(BOUND_S)


def test_waiting_to_rejoin_returns_the_transition_that_admits_it():
    store = dist.HashStore()
    s = _session(store, "b", ("a", "b"))
    tr = Transition(gen=2, devices=("a", "b"), resume_step=5, joined=("b",))
    stop = threading.Event()

    def a_admits() -> None:  # a trains (beats) and admits b once it asks
        n = 0
        while not stop.wait(CFG.heartbeat_s):
            n += 1
            store.set("hb/a", f"{n} {os.getpid()} {s._host}")
            if store.check(["rejoin/b"]):
                store.set(f"admit/b/{store.get('rejoin/b').decode()}", pickle.dumps(tr))
                store.delete_key("rejoin/b")

    th = threading.Thread(target=a_admits, daemon=True)
    th.start()
    try:
        assert _bounded(s.await_admission) == tr
    finally:
        stop.set()
        th.join(BOUND_S)


def test_waiting_for_a_live_leader_that_never_decides_ends_with_an_error():
    store = dist.HashStore()
    s = _session(store, "b", ("a", "b"), timeout_s=0.5)
    store.compare_set("g0/leader", "", "a")
    stop = threading.Event()

    def a_beats() -> None:
        n = 0
        while not stop.wait(CFG.heartbeat_s):
            n += 1
            store.set("hb/a", f"{n} {os.getpid()} {s._host}")

    th = threading.Thread(target=a_beats, daemon=True)
    th.start()
    join = JoinRecord(device="b", rank=1, applied=3, version=0, layers=(), detected_s=time.time())
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeSetupError, match="b: no decision from a, the leader of the recovery of generation 0, "
                                                    r"within \d"):
            _bounded(lambda: s.recover(join, lambda *a: None))
    finally:
        stop.set()
        th.join(BOUND_S)
    assert time.monotonic() - t0 < BOUND_S
