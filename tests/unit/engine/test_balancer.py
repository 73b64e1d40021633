"""Data-parallel dispatch: each policy's exact choice of replica."""

import pytest

from servelm.engine.balancer import LoadBalancer


def test_round_robin_cycles_whatever_the_load():
    balancer = LoadBalancer("round_robin", 3)
    assert [balancer.choose(100 if i == 0 else 1) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [load.served_requests for load in balancer.loads] == [3, 2, 2]


def test_shortest_queue_fills_the_least_busy_replica_lowest_index_first():
    balancer = LoadBalancer("shortest_queue", 3)
    assert [balancer.choose(10) for _ in range(4)] == [0, 1, 2, 0]
    balancer.finish(1, 10)
    balancer.finish(2, 10)
    assert balancer.choose(10) == 1  # replicas 1 and 2 tie at zero: the lower index wins
    assert balancer.choose(10) == 2
    assert balancer.choose(10) == 1  # 0: 2 running, 1: 1, 2: 1 → replica 1
    assert [load.running_requests for load in balancer.loads] == [2, 2, 1]


def test_minimum_tokens_weighs_requests_by_their_tokens():
    balancer = LoadBalancer("minimum_tokens", 2)
    assert balancer.choose(1000) == 0
    assert balancer.choose(10) == 1
    assert balancer.choose(10) == 1  # 1 holds 10 tokens against 0's 1000
    assert balancer.choose(900) == 1  # 20 < 1000
    assert balancer.choose(200) == 1  # 920 < 1000: replica 1 now holds 1120
    assert balancer.choose(5) == 0  # 1000 < 1120
    balancer.finish(1, 900)
    assert balancer.choose(1) == 1  # 220 < 1005
    assert [load.running_tokens for load in balancer.loads] == [1005, 221]
    assert [load.running_requests for load in balancer.loads] == [2, 4]


def test_unknown_method_and_no_replica_are_refused():
    with pytest.raises(ValueError, match="shortest_queue"):
        LoadBalancer("random", 2)
    with pytest.raises(ValueError, match="at least one"):
        LoadBalancer("round_robin", 0)
