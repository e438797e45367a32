"""Pairing policies and pair choice (plain objects stand in for workers: the policies
only read address, inflight and the LoadReport)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest

from pdpb.v1 import common_pb2
from router.pairing import Avoid, choose_pair
from router.policies import POLICIES, LeastLoad, PrefixAware, RoundRobin, make_policy


@dataclass(eq=False)
class W:
    address: str
    inflight: int = 0
    load: common_pb2.LoadReport | None = None
    peers: dict = field(default_factory=dict)


def pool(n):
    return [W(f"10.0.0.{i}:50051") for i in range(n)]


def test_registry_of_policies():
    assert set(POLICIES) == {"round_robin", "least_load", "prefix_aware"}
    assert isinstance(make_policy("least_load"), LeastLoad)
    with pytest.raises(ValueError):
        make_policy("random")


def test_round_robin_cycles():
    ws = pool(3)
    rr = RoundRobin()
    assert [rr.choose(ws, "k").address for _ in range(6)] == [w.address for w in ws * 2]


def test_least_load_uses_inflight_and_reports():
    ws = pool(3)
    ll = LeastLoad()
    ws[0].inflight, ws[1].inflight, ws[2].inflight = 3, 1, 2
    assert ll.choose(ws, "") is ws[1]
    # another router's requests show up in the worker's LoadReport
    ws[1].load = common_pb2.LoadReport(num_running=4, num_waiting=1)
    assert ll.choose(ws, "") is ws[2]
    # KV usage breaks ties on request counts
    for w in ws:
        w.inflight, w.load = 0, common_pb2.LoadReport(num_free_blocks=50, num_total_blocks=100)
    ws[0].load.num_free_blocks = 90
    assert ll.choose(ws, "") is ws[0]


def test_least_load_spreads_ties():
    ws = pool(4)
    ll = LeastLoad()
    assert Counter(ll.choose(ws, "").address for _ in range(8)) == {w.address: 2 for w in ws}


def test_prefix_aware_is_consistent_and_stable():
    ws = pool(5)
    pa = PrefixAware()
    keys = [f"text:system prompt {i}" for i in range(200)]
    first = {k: pa.choose(ws, k).address for k in keys}
    assert all(pa.choose(list(reversed(ws)), k).address == first[k] for k in keys)  # order-free
    assert len(set(first.values())) == 5  # keys spread over every worker
    # removing one worker moves only the keys it had
    gone = ws[2].address
    after = {k: pa.choose([w for w in ws if w.address != gone], k).address for k in keys}
    moved = [k for k in keys if after[k] != first[k]]
    assert moved and all(first[k] == gone for k in moved)


def test_prefix_aware_balances_a_hot_key():
    ws = pool(3)
    pa = PrefixAware(balance_threshold=4)
    hot = pa.choose(ws, "hot")
    hot.inflight = 5
    assert pa.choose(ws, "hot") is not hot
    hot.inflight = 4
    assert pa.choose(ws, "hot") is hot


def test_choose_pair_and_avoid():
    d1, d2 = W("d1:1"), W("d2:1")
    p1, p2 = W("p1:1"), W("p2:1")
    pairs = [(d1, p1), (d1, p2), (d2, p1), (d2, p2)]
    rr_d, rr_p = RoundRobin(), RoundRobin()
    assert choose_pair([], "k", rr_d, rr_p) is None
    seen = {
        (d.address, p.address) for d, p in (choose_pair(pairs, "k", rr_d, rr_p) for _ in range(4))
    }
    assert len({d for d, _ in seen}) == 2
    avoid = Avoid()
    avoid.add("d1:1", "p1:1")
    # both failed workers are avoided while another option exists
    for _ in range(4):
        assert choose_pair(pairs, "k", rr_d, rr_p, avoid) == (d2, p2)
    # only pairs with the failed decode worker left: its other prefill peer is tried
    assert choose_pair([(d1, p1), (d1, p2)], "k", rr_d, rr_p, avoid) == (d1, p2)
    # a pair that failed is never tried again
    assert choose_pair([(d1, p1)], "k", rr_d, rr_p, avoid) is None


def test_choose_pair_picks_decode_then_its_prefills():
    d1, d2, p1, p2, p3 = W("d1:1", inflight=5), W("d2:1"), W("p1:1"), W("p2:1"), W("p3:1")
    pairs = [(d1, p1), (d2, p2), (d2, p3)]  # d2 is not paired with p1
    for _ in range(6):
        d, p = choose_pair(pairs, "k", LeastLoad(), RoundRobin())
        assert d is d2 and p in (p2, p3)
