"""The data-parallel routing policy (kvtide/engine/dp_balancer.py) on its own: load (running +
4 x waiting), prefix affinity, the load threshold, n > 1 grouping and the bounded prefix index.
No processes."""

from __future__ import annotations

import pytest

from kvtide.engine.dp_balancer import DPLoadBalancer, PrefixIndex, block_hashes

BS = 4


def prompt(prefix: int, length: int, suffix: int = 0) -> list[int]:
    """`length` tokens: a run determined by `prefix`, then `suffix` tokens unique to the call."""
    head = [1000 * prefix + i for i in range(length)]
    return head + [500_000 + suffix * 100 + i for i in range(BS)] if suffix else head


def test_block_hashes_are_chained_over_full_blocks():
    assert block_hashes([1, 2, 3], BS) == []
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert len(a) == 2  # the partial block is not hashed
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS) == a
    # Same second block after another first block: another hash (it hashes the whole prefix).
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], BS)
    assert b[0] != a[0] and b[1] != a[1]
    assert block_hashes([5, 6, 7, 8], BS)[0] != a[1]
    assert block_hashes([1, 2, 3, 4], BS, cache_salt="s") != block_hashes([1, 2, 3, 4], BS)
    with pytest.raises(ValueError):
        block_hashes([1], 0)


def test_load_only_spreads_round_robin_and_prefers_the_least_loaded():
    lb = DPLoadBalancer(3, block_size=BS, enable_prefix_affinity=False)
    engines = [lb.route([f"r{i}"], prompt(i, 8)) for i in range(6)]
    assert engines == [0, 1, 2, 0, 1, 2]
    assert lb.held == [2, 2, 2] and lb.waiting == [2, 2, 2] and lb.loads == [8, 8, 8]
    lb.mark_scheduled([f"r{i}" for i in range(6)])
    lb.mark_scheduled(["r0", "unknown"])  # idempotent
    assert lb.waiting == [0, 0, 0] and lb.loads == [2, 2, 2]
    lb.finish(["r1", "r4"])  # engine 1 is now idle
    assert lb.loads == [2, 0, 2]
    assert lb.route(["x"], prompt(9, 8)) == 1
    lb.mark_scheduled(["x"])
    assert lb.route(["y"], prompt(10, 8)) == 1  # 1 running there, 2 on the others
    assert lb.loads == [2, 5, 2] and lb.num_requests == 6


def test_waiting_requests_weigh_more_so_a_burst_spreads():
    """A wave of arrivals at an engine that just emptied: running + 4 x waiting sends every other
    one elsewhere, instead of queueing all their prefills behind each other on one engine."""

    def busy_engine_1(waiting_weight: int) -> DPLoadBalancer:
        lb = DPLoadBalancer(2, block_size=BS, enable_prefix_affinity=False, waiting_weight=waiting_weight)
        for i in range(6):
            lb.route([f"old{i}"], prompt(i, 8))
        lb.mark_scheduled([f"old{i}" for i in range(6)])
        lb.finish(["old0", "old2", "old4"])  # engine 0 emptied; engine 1 runs three
        assert lb.loads == [0, 3]
        return lb

    lb = busy_engine_1(4)
    assert [lb.route([f"new{i}"], prompt(10 + i, 8)) for i in range(4)] == [0, 1, 0, 1]
    assert lb.held == [2, 5] and lb.waiting == [2, 2] and lb.loads == [8, 11]
    plain = busy_engine_1(1)  # waiting + running, unweighted: the wave queues on engine 0
    assert [plain.route([f"new{i}"], prompt(10 + i, 8)) for i in range(4)] == [0, 0, 0, 1]


def test_shared_prefix_sticks_to_one_engine_while_sequential():
    lb = DPLoadBalancer(2, block_size=BS)
    first = lb.route(["a"], prompt(1, 16, suffix=1))
    lb.finish(["a"])
    for i in range(2, 8):
        assert lb.route([f"r{i}"], prompt(1, 16, suffix=i)) == first
        lb.finish([f"r{i}"])
    assert lb.counters[first].requests == 7 and lb.counters[first].affinity_requests == 6
    assert lb.counters[first].matched_blocks == 6 * 4
    assert lb.counters[1 - first].requests == 0
    # An unrelated prompt, all idle: round robin moves on to the other engine.
    assert lb.route(["other"], prompt(2, 16)) == 1 - first


def test_longest_match_wins_and_ties_go_to_the_less_loaded():
    lb = DPLoadBalancer(2, block_size=BS)
    assert lb.route(["a"], prompt(1, 8)) == 0  # blocks P1[0:2] on engine 0
    lb.finish(["a"])
    assert lb.route(["b"], prompt(1, 16)) == 0  # matches 2 blocks there; now holds P1[0:4]
    lb.mark_scheduled(["b"])
    # Engine 0 busy beyond the threshold: the same prefix's first 2 blocks go to engine 1.
    lb.held[0] += 5
    assert lb.route(["c"], prompt(1, 8)) == 1
    lb.held[0] -= 5
    lb.finish(["b", "c"])
    assert lb.choose(prompt(1, 16)).engine == 0  # 4 blocks on 0 beat 2 on 1
    assert lb.choose(prompt(1, 16)).matched_blocks == 4
    # Equal matches (2 blocks each): the less loaded of the two.
    lb.held[0] += 1
    assert lb.choose(prompt(1, 8)).engine == 1
    assert lb.choose(prompt(1, 8)).by_affinity


def test_threshold_bounds_how_much_more_loaded_the_affinity_engine_may_be():
    lb = DPLoadBalancer(2, block_size=BS, load_threshold=2)
    assert lb.route(["p0"], prompt(1, 16, suffix=1)) == 0
    lb.mark_scheduled(["p0"])
    # Requests with the prefix pile on engine 0 (once running) until its load is 2 above engine 1's.
    assert lb.route(["p1"], prompt(1, 16, suffix=2)) == 0  # loads 1-0: chosen (diff 1 <= 2)
    lb.mark_scheduled(["p1"])
    assert lb.route(["p2"], prompt(1, 16, suffix=3)) == 0  # 2-0: diff 2 <= 2
    lb.mark_scheduled(["p2"])
    assert lb.loads == [3, 0]
    d = lb.choose(prompt(1, 16, suffix=4))  # 3-0: diff 3 > 2
    assert d.engine == 1 and not d.by_affinity
    assert lb.route(["p3"], prompt(1, 16, suffix=4)) == 1
    # Waiting, p3 weighs 4: engine 0 (3) is the less loaded and matches as well.
    assert lb.route(["p4"], prompt(1, 16, suffix=5)) == 0
    lb.mark_scheduled(["p3", "p4"])
    assert lb.loads == [4, 1]
    # Engine 1 holds the prefix too now: equal matches, the less loaded one takes the next.
    assert lb.route(["p5"], prompt(1, 16, suffix=6)) == 1
    lb.mark_scheduled(["p5"])
    lb.finish(["p0", "p1", "p2"])
    assert lb.loads == [1, 2]
    assert lb.route(["p6"], prompt(1, 16, suffix=7)) == 0


def test_zero_threshold_is_pure_least_loaded_among_matches():
    lb = DPLoadBalancer(2, block_size=BS, load_threshold=0)
    assert lb.route(["a"], prompt(1, 8)) == 0
    lb.mark_scheduled(["a"])
    assert lb.route(["b"], prompt(1, 8)) == 1  # engine 0 holds one more: load wins


def test_n_children_stay_on_one_engine_and_follow_aborts():
    lb = DPLoadBalancer(2, block_size=BS)
    lb.route(["x"], prompt(5, 8))  # engine 0 busy with one request
    lb.mark_scheduled(["x"])
    children = ["0_req", "1_req", "2_req"]
    engine = lb.route(children, prompt(1, 8))
    assert engine == 1 and lb.held == [1, 3] and lb.waiting == [0, 3]
    assert {lb.engine_of(c) for c in children} == {1}
    assert lb.group_by_engine(["x", *children, "unknown"]) == {0: ["x"], 1: children}
    assert lb.counters[1].requests == 1  # one user request
    lb.finish(["1_req"])
    lb.finish(["1_req"])  # idempotent: a stop, then the finished output of the same child
    assert lb.held == [1, 2] and lb.waiting == [0, 2] and lb.engine_of("1_req") is None
    lb.finish(iter(["0_req", "2_req", "x"]))
    assert lb.loads == [0, 0] and lb.waiting == [0, 0] and lb.num_requests == 0
    with pytest.raises(ValueError, match="already routed"):
        lb.route(["y"], prompt(1, 8))
        lb.route(["y"], prompt(1, 8))
    with pytest.raises(ValueError):
        lb.route([], prompt(1, 8))


def test_prefix_index_is_a_bounded_lru():
    index = PrefixIndex(max_blocks=4)
    index.insert([1, 2, 3])
    index.insert([4, 5])  # 1 is the oldest: dropped
    assert len(index) == 4 and 1 not in index and index.match([2, 3, 4]) == 3
    index.insert([2])  # refreshed: 3 is the oldest now
    index.insert([6])
    assert 3 not in index and 2 in index
    assert index.match([2, 3]) == 1
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_evicted_prefix_no_longer_attracts_requests():
    lb = DPLoadBalancer(2, block_size=BS, max_blocks_per_engine=[4, 4])
    assert lb.route(["a"], prompt(1, 16)) == 0  # 4 blocks: fills engine 0's index
    lb.finish(["a"])
    assert lb.route(["b"], prompt(2, 16)) == 1
    lb.finish(["b"])
    assert lb.route(["c"], prompt(3, 16)) == 0  # round robin; evicts prefix 1 on engine 0
    lb.finish(["c"])
    assert len(lb.indexes[0]) == 4
    assert lb.choose(prompt(1, 16)).matched_blocks == 0
    assert lb.choose(prompt(3, 16)).engine == 0 and lb.choose(prompt(2, 16)).engine == 1


def test_forget_prefixes_and_affinity_off():
    lb = DPLoadBalancer(2, block_size=BS)
    lb.route(["a"], prompt(1, 16))
    lb.finish(["a"])
    lb.forget_prefixes(0)
    assert len(lb.indexes[0]) == 0 and lb.choose(prompt(1, 16)).matched_blocks == 0
    off = DPLoadBalancer(2, block_size=BS, enable_prefix_affinity=False)
    off.route(["a"], prompt(1, 16))
    off.finish(["a"])
    assert len(off.indexes[0]) == 0 and off.route(["b"], prompt(1, 16)) == 1


def test_bad_arguments():
    with pytest.raises(ValueError):
        DPLoadBalancer(0)
    with pytest.raises(ValueError):
        DPLoadBalancer(2, load_threshold=-1)
    with pytest.raises(ValueError):
        DPLoadBalancer(2, max_blocks_per_engine=[4])
    with pytest.raises(ValueError):
        DPLoadBalancer(2, waiting_weight=0)
