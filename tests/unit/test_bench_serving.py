"""`servelm bench serving` datasets and arrivals, and `servelm bench one-batch` on a tiny model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root, for tests.tiny_models

from servelm import bench, bench_common, cli, cli_args  # noqa: E402
from servelm.bench_serving import (arrival_offsets_s, random_dataset, shared_prefix_dataset,  # noqa: E402
                                   sharegpt_dataset)
from tests.tiny_models import make_tiny_hf_model  # noqa: E402


def test_random_dataset_lengths_within_range_ratio() -> None:
    requests = random_dataset(50, 40, 20, vocab_size=100, seed=3, range_ratio=0.5)
    assert all(20 <= len(r.prompt) <= 40 and 10 <= r.output_len <= 20 for r in requests)
    assert len({len(r.prompt) for r in requests}) > 1
    assert requests == random_dataset(50, 40, 20, vocab_size=100, seed=3, range_ratio=0.5)
    assert {len(r.prompt) for r in random_dataset(5, 40, 20, 100, 3)} == {40}


def test_shared_prefix_groups_share_their_system_prompt() -> None:
    requests = shared_prefix_dataset(3, 4, system_len=16, question_len=5, output_len=7, vocab_size=1000, seed=1)
    assert len(requests) == 12 and all(len(r.prompt) == 21 and r.output_len == 7 for r in requests)
    prefixes = {tuple(r.prompt[:16]) for r in requests}
    assert len(prefixes) == 3
    assert all(sum(tuple(r.prompt[:16]) == p for r in requests) == 4 for p in prefixes)


def test_sharegpt_takes_first_turn_and_reply_length(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "a b c d e f g h i j"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
    ]))
    (request,) = sharegpt_dataset(str(path), 10, None, seed=0)
    assert request.prompt == "hi there" and request.output_len == 13
    assert sharegpt_dataset(str(path), 10, 5, seed=0)[0].output_len == 5


def test_poisson_arrivals() -> None:
    assert arrival_offsets_s(4, float("inf"), 0) == [0.0] * 4
    offsets = arrival_offsets_s(2000, 10.0, 0)
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    assert 180 < offsets[-1] < 220   # 2000 arrivals at 10 req/s


def test_serving_parser_defaults() -> None:
    args, rest = bench.parse_args(["serving", "--request-rate", "4", "--max-concurrency", "2"])
    assert rest == [] and args.request_rate == 4.0 and args.max_concurrency == 2
    assert args.dataset_name == "random" and args.num_prompts == 100
    assert bench.parse_args(["serving"])[0].request_rate == float("inf")


def test_one_batch_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "tiny"
    make_tiny_hf_model("qwen2").save_pretrained(model_dir)
    out = tmp_path / "one.json"
    cli.main(["bench", "one-batch", str(model_dir), "--skip-tokenizer-init", "--device", "cpu",
              "--max-total-tokens", "512", "--batch-sizes", "1,3", "--input-len", "6", "--output-len", "4",
              "--quantization", "w8a8_int8", "--output-json", str(out)])
    assert "decode_step_ms" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert [r["batch_size"] for r in results] == [1, 3]
    assert all(r["prefill_latency_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in results)


def test_one_batch_reports_speculative_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "tiny"
    make_tiny_hf_model("qwen2").save_pretrained(model_dir)
    out = tmp_path / "one.json"
    cli.main(["bench", "one-batch", str(model_dir), "--skip-tokenizer-init", "--device", "cpu",
              "--max-total-tokens", "512", "--batch-sizes", "2", "--input-len", "6", "--output-len", "12",
              "--speculative-algorithm", "NGRAM", "--ngram-prompt-lookup-min", "1",
              "--output-json", str(out)])
    assert "speculative decoding (NGRAM): accept length" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["speculative_algorithm"] == "NGRAM" and data["spec_num_verify_passes"] > 0
