"""How a paced message is cut into chunks (both ends derive the same cut)."""

from __future__ import annotations

from deepcee.cluster import Link
from deepcee.runtime.paced import CHUNK_S, MIN_CHUNK_BYTES, chunk_bounds


def _link(bandwidth_bytes_per_s: float) -> Link:
    return Link(src="a:0", dst="b:0", latency_s=0.02, bandwidth_bytes_per_s=bandwidth_bytes_per_s, resource="a->b")


def test_unpaced_message_is_one_range():
    assert chunk_bounds(1_000_000, None) == [(0, 1_000_000)]


def test_chunks_cover_the_message_in_order_at_the_link_rate():
    link = _link(12.5e6)  # 100 Mbit/s: chunks of 10 ms = 125 kB
    bounds = chunk_bounds(1_000_016, link)
    assert bounds[0] == (0, int(12.5e6 * CHUNK_S))
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert bounds[-1][1] == 1_000_016 and len(bounds) == 9


def test_fast_links_and_small_messages_are_not_cut_finer_than_the_minimum():
    assert chunk_bounds(MIN_CHUNK_BYTES, _link(1e3)) == [(0, MIN_CHUNK_BYTES)]
    assert chunk_bounds(10, _link(1.25e9)) == [(0, 10)]
    assert chunk_bounds(0, _link(1.25e9)) == [(0, 0)]
