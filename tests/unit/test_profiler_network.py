"""Network probe, pure parts: the alpha-beta fit, which pairs are probed, and the measured
cluster's link entries (full and sampled)."""

from __future__ import annotations

import numpy as np
import pytest

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.errors import ProfileError, SpecError
from deepcee.profiler.network import (
    ACK_BYTES,
    CONTROL_BYTES,
    LinkFit,
    NetworkBudget,
    fit_alpha_beta,
    link_entries,
    probe_pairs,
)

FAST = LinkSpec(latency_s=50e-6, bandwidth_bytes_per_s=1.25e9)


def _round_trips(latency_s: float, bandwidth: float, sizes: list[int], repeats: int, noise: float, seed: int = 0):
    """Samples as the sender records them: a control message per level, then ``repeats`` payloads."""
    rng = np.random.default_rng(seed)
    out_n, out_t, reps = [], [], []
    for n in sizes:
        for r, m in [(-1, CONTROL_BYTES)] + [(r, n) for r in range(repeats)]:
            t = 2 * latency_s + (m + ACK_BYTES) / bandwidth
            out_n.append(m)
            out_t.append(t * (1 + noise * rng.standard_normal()))
            reps.append(r)
    return out_n, out_t, reps


def test_fit_recovers_latency_and_bandwidth_with_spread():
    sizes = [1024 * 4**k for k in range(5)]
    n, t, reps = _round_trips(20e-3, 12.5e6, sizes, repeats=3, noise=0.01)
    fit = fit_alpha_beta("a", "b", n, t, repeat_index=reps, bytes_sent=sum(n), seconds=1.0)
    assert fit.latency_s == pytest.approx(20e-3, rel=0.03)
    assert fit.bandwidth_bytes_per_s == pytest.approx(12.5e6, rel=0.03)
    assert fit.bandwidth_resolved
    lo, hi = fit.latency_range_s
    assert lo <= fit.latency_s * 1.01 and hi >= fit.latency_s * 0.99 and hi > lo
    assert fit.bandwidth_range_bytes_per_s[0] < fit.bandwidth_range_bytes_per_s[1]
    assert 0 < fit.residual_iqr_fraction < 0.05
    assert fit.sizes_bytes == (CONTROL_BYTES, *sizes) and fit.messages == len(n)
    assert LinkFit.from_dict(fit.to_dict()) == fit


def test_fit_flags_bandwidth_lost_in_noise():
    # a flat round trip: the transfer term never shows; bandwidth is only a lower bound
    n = [16, 1024, 4096, 16, 1024, 4096]
    t = [1e-3, 0.99e-3, 1.01e-3, 1.0e-3, 1.0e-3, 0.98e-3]
    fit = fit_alpha_beta("a", "b", n, t, repeat_index=[0, 0, 0, 1, 1, 1])
    assert not fit.bandwidth_resolved
    assert fit.bandwidth_bytes_per_s == pytest.approx(4096 / 0.03e-3)
    with pytest.raises(ProfileError, match=">= 2 message sizes"):
        fit_alpha_beta("a", "b", [16, 16], [1e-3, 1e-3], repeat_index=[0, 1])


def test_budget_ladder_and_validation():
    assert NetworkBudget().ladder == (1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
    with pytest.raises(SpecError, match="duty_cycle"):
        NetworkBudget(duty_cycle=0)


def _cluster(nodes: dict[str, tuple[str, int]]) -> Cluster:
    """``nodes``: name -> (island, devices)."""
    kinds = {"k": DeviceKind(name="k", peak_flops_per_s=1e12, memory_bytes=1e9)}
    islands = tuple(Island(name=i, intra=FAST) for i in dict.fromkeys(i for i, _ in nodes.values()))
    ns, ds = [], []
    for name, (isl, count) in nodes.items():
        names = tuple(f"{name}:{k}" for k in range(count))
        ns.append(Node(name=name, island=isl, kind="k", devices=names, intra=FAST))
        ds += [Device(name=d, kind="k", node=name, island=isl) for d in names]
    declared = tuple(LinkEntry(a=a.name, b=b.name, spec=LinkSpec(latency_s=1.0, bandwidth_bytes_per_s=1e3))
                     for i, a in enumerate(islands) for b in islands[i + 1:])  # overridden by the measured entries
    return Cluster(name="t", kinds=kinds, islands=islands, nodes=tuple(ns), devices=tuple(ds), links=declared)


def _fit(src: str, dst: str, latency_s: float, bw: float) -> LinkFit:
    return LinkFit(src=src, dst=dst, latency_s=latency_s, bandwidth_bytes_per_s=bw, bandwidth_resolved=True,
                   latency_range_s=(latency_s, latency_s), bandwidth_range_bytes_per_s=(bw, bw),
                   residual_iqr_fraction=0.0, sizes_bytes=(16, 1024), median_round_trip_s=(0.0, 0.0), messages=2,
                   bytes_sent=1040, seconds=0.1)


def test_pairs_all_or_sampled_by_node():
    c = _cluster({"a0": ("a", 3), "a1": ("a", 1), "b0": ("b", 2)})
    devices = c.device_names
    pairs, mode = probe_pairs(c, devices)
    assert mode == "all" and len(pairs) == 15
    pairs, mode = probe_pairs(c, devices, max_full_ranks=4)
    # representatives a0:0 (0), a1:0 (3), b0:0 (4): 3 pairs; plus one pair inside a0 and b0
    assert mode == "sampled" and pairs == [(0, 3), (0, 4), (3, 4), (0, 1), (4, 5)]


def test_link_entries_full_and_sampled_reproduce_the_fits():
    c = _cluster({"a0": ("a", 2), "b0": ("b", 2)})
    wan = {("a0", "b0"): (20e-3, 12.5e6), ("b0", "a0"): (20e-3, 6.25e6)}
    fits = []
    for s in c.device_names:
        for d in c.device_names:
            if s == d:
                continue
            ns, nd = s.split(":")[0], d.split(":")[0]
            fits.append(_fit(s, d, *(wan[(ns, nd)] if ns != nd else (0.2e-3, 1e9))))
    entries, intra = link_entries(c, fits, "all")
    measured = c.with_links(entries)
    for f in fits:
        link = measured.link(f.src, f.dst)
        assert (link.latency_s, link.bandwidth_bytes_per_s) == (f.latency_s, f.bandwidth_bytes_per_s)
    assert measured.link("a0:0", "b0:1").resource == "a0->b0"  # pipes between nodes stay shared
    assert intra == {}
    # island-level entries carry the median of the measured pairs between the islands
    isl = {(e.a, e.b): e.spec for e in entries if e.a in ("a", "b")}
    assert isl[("b", "a")].bandwidth_bytes_per_s == 6.25e6 and isl[("a", "b")].latency_s == 20e-3
    sampled = [f for f in fits if (f.src, f.dst) in {("a0:0", "b0:0"), ("b0:0", "a0:0"), ("a0:0", "a0:1")}]
    entries, intra = link_entries(c, sampled, "sampled")
    assert intra == {"a0": LinkSpec(latency_s=0.2e-3, bandwidth_bytes_per_s=1e9)}
    measured = c.with_links(entries)
    assert measured.link("b0:1", "a0:1").bandwidth_bytes_per_s == 6.25e6  # inferred from its nodes
