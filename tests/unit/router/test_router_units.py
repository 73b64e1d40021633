"""The router's pieces without servers: the prefix tree, the policies, the PD body, the flags."""

from __future__ import annotations

import json

import pytest

from servelm.router.cli import config_from_args, pd_master_config, run_mode_of
from servelm.router.config import PrefillSpec, RouterConfig
from servelm.router.pd import MAX_ROOM, batch_size, merge_prompt_logprobs, with_bootstrap
from servelm.router.policies import CacheAware, RoundRobin, ShortestQueue
from servelm.router.prefix_tree import PrefixTree
from servelm.router.workers import Role, Worker


def test_prefix_tree_longest_match_wins_and_most_recent_first() -> None:
    tree = PrefixTree()
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")
    assert tree.match("hello world!").num_chars == 11
    assert tree.match("hello world!").tenants == ("a",)
    assert tree.match("hello x") == tree.match("hello y")
    assert tree.match("hello x").num_chars == 6
    assert tree.match("hello x").tenants == ("b", "a")  # b inserted last
    assert tree.match("zzz").tenants == ()
    assert tree.size_chars == {"a": 11, "b": 11}


def test_prefix_tree_evicts_least_recent_leaves_of_one_tenant() -> None:
    tree = PrefixTree()
    tree.insert("aaaa1111", "w")
    tree.insert("bbbb2222", "w")
    tree.insert("aaaa1111", "v")
    tree.evict("w", 8)
    assert tree.size_chars["w"] == 8
    assert tree.match("aaaa1111").tenants == ("v",)  # w's older branch went
    assert tree.match("bbbb2222").tenants == ("w",)
    tree.remove_tenant("w")
    assert tree.match("bbbb2222").tenants == ()
    assert tree.size_chars == {"v": 8}


def workers(*loads: int) -> list[Worker]:
    result = []
    for index, load in enumerate(loads):
        worker = Worker(f"http://w{index}:1", Role.NORMAL, is_healthy=True)
        worker.num_in_flight = load
        result.append(worker)
    return result


def test_round_robin_and_shortest_queue() -> None:
    pool = workers(0, 0, 0)
    policy = RoundRobin()
    assert [policy.pick(pool, "").url for _ in range(4)] == [pool[0].url, pool[1].url,
                                                           pool[2].url, pool[0].url]
    assert ShortestQueue().pick(workers(2, 1, 1), "").url == "http://w1:1"


def test_cache_aware_keeps_a_prefix_on_its_worker_until_the_load_is_unbalanced() -> None:
    config = RouterConfig(workers=("http://w0:1", "http://w1:1"), balance_abs_threshold=4)
    policy = CacheAware(config)
    pool = workers(0, 0)
    first = policy.pick(pool, "system prompt, question one")
    other = policy.pick(pool, "a different prompt entirely")
    assert other is not first  # the smallest tree takes a new prefix
    assert policy.pick(pool, "system prompt, question two") is first
    first.num_in_flight = 10  # 10 - 0 > 4: shortest queue decides
    assert policy.pick(pool, "system prompt, question three") is other


def test_bootstrap_fields_follow_sglang_for_single_and_batched_prompts() -> None:
    prefill = Worker("http://[::1]:30001", Role.PREFILL, bootstrap_port=8998)
    single = with_bootstrap({"text": "hi", "sampling_params": {"n": 2}}, prefill)
    assert single["bootstrap_host"] == "[::1]" and single["bootstrap_port"] == 8998
    assert 0 <= single["bootstrap_room"] < MAX_ROOM - 2
    batch = with_bootstrap({"text": ["a", "b", "c"]}, prefill)
    assert batch["bootstrap_port"] == [8998] * 3 and len(set(batch["bootstrap_room"])) == 3
    assert batch_size({"input_ids": [[1, 2], [3]]}) == 2
    assert batch_size({"input_ids": [1, 2]}) is None
    assert batch_size({"prompt": ["x", "y"]}) == 2


def test_prompt_logprobs_come_from_prefill_first() -> None:
    merged = merge_prompt_logprobs({"meta_info": {"input_token_logprobs": [[None, 1, None]]}},
                                   {"text": "x", "meta_info": {"input_token_logprobs": [[-1.0, 2, None]]}})
    assert merged["meta_info"]["input_token_logprobs"] == [[None, 1, None], [-1.0, 2, None]]


def test_flags_sglang_spellings_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    config = config_from_args(["--pd-disaggregation", "--prefill", "http://p:30001", "8998",
                               "--prefill", "p2:30003", "--decode", "http://d:30002",
                               "--health-check-interval-secs", "2", "--policy", "round_robin"])
    assert config.prefill == (PrefillSpec("http://p:30001", 8998), PrefillSpec("http://p2:30003", None))
    assert config.decode == ("http://d:30002",) and config.health_check_interval_s == 2.0
    dp = config_from_args(["--worker-urls", "http://a:1/", "http://b:2"])
    assert dp.workers == ("http://a:1", "http://b:2") and dp.policy == "cache_aware"
    for argv, reason in ((["--worker", "http://a:1", "--decode", "http://d:2"], "cannot be mixed"),
                         (["--prefill", "http://p:1"], "at least one --prefill and one --decode"),
                         (["--worker", "http://a:1", "http://a:1"], "given twice"),
                         (["--pd-disaggregation", "--worker", "http://a:1"], "--pd-disaggregation needs"),
                         (["--worker", "ftp://a"], "not an http(s) URL"),
                         (["--prefill", "http://p:1", "x", "--decode", "http://d:1"], "not an integer")):
        with pytest.raises(SystemExit) as exit_info:
            config_from_args(argv)
        assert exit_info.value.code == 2
        assert reason in capsys.readouterr().err


def test_pd_master_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--run_mode", "pd_master", "--host", "0.0.0.0", "--port", "60011",
            "--pd_master_ip", "10.0.0.2", "--pd_master_port", "60011"]
    assert run_mode_of(argv) == "pd_master"
    config = pd_master_config(argv)
    assert config.is_pd_master and config.port == 60011 and not config.workers
    for bad, reason in ((["--run_mode", "pd_master", "--port", "1", "--pd_master_port", "2"],
                         "contradicts --port"),
                        (["qwen2.5-coder-0.5b", "--run_mode", "pd_master"], "loads no model")):
        with pytest.raises(SystemExit):
            pd_master_config(bad)
        assert reason in capsys.readouterr().err


def test_pd_master_dry_run_prints_the_options_and_starts_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    from servelm.cli import main

    main(["serve", "--run_mode", "pd_master", "--port", "60011", "--dry-run"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["is_pd_master"] and printed["port"] == 60011
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--run_mode", "config_server"])
    assert exit_info.value.code == 2 and "config_server" in capsys.readouterr().err
