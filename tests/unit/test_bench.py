"""`servelm bench`: argument parsing, prompts, statistics and formatting (no model is loaded)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from servelm import bench, bench_common, cli, cli_args
from servelm.bench_common import OfflineResult, RequestTiming


# --- argument parsing ----------------------------------------------------------------------------

def test_offline_leaves_engine_flags_in_order() -> None:
    args, engine_argv = bench.parse_args(
        ["offline", "smollm2-135m", "--batch-sizes", "1,8", "--max-total-tokens", "16384",
         "--input-len", "32", "--chunked-prefill-size", "-1", "--output-len=4"])
    assert args.mode == "offline"
    assert args.batch_sizes == [1, 8]
    assert (args.input_len, args.output_len, args.num_warmup, args.prompt_seed) == (32, 4, 1, 0)
    assert engine_argv == ["smollm2-135m", "--max-total-tokens", "16384",
                           "--chunked-prefill-size", "-1"]
    config = cli_args.build_config(engine_argv)
    assert config.model.model == "smollm2-135m"
    assert config.cache.max_total_tokens == 16384
    assert config.scheduler.max_chunk_tokens is None


def test_offline_engine_args_round_trip_through_engine_kwargs() -> None:
    config = cli_args.build_config(["smollm2-135m", "--max-num-seqs", "3", "--dtype", "float32"])
    flat = bench.flat_engine_args(config)
    assert flat["model"] == "smollm2-135m"
    assert flat["max_running_requests"] == 3
    assert type(config).from_flat(flat) == config


def test_serve_defaults_and_values() -> None:
    args, rest = bench.parse_args(["serve", "--num-prompts", "4", "--concurrency", "2",
                                   "--model", "m", "--output-json", "out.json"])
    assert rest == []
    assert (args.base_url, args.num_prompts, args.concurrency) == ("http://127.0.0.1:30000", 4, 2)
    assert (args.model, args.input_len, args.output_len, args.output_json) == ("m", 128, 64, "out.json")


@pytest.mark.parametrize("argv, message", [
    (["serve", "--max-total-tokens", "5"], "unrecognized arguments: --max-total-tokens 5"),
    (["offline", "--batch-sizes", "1,x"], "comma-separated integers"),
    (["offline", "--batch-sizes", "0,2"], "positive"),
    (["offline", "--input-len", "0"], "must be positive"),
    (["offline", "--num-warmup", "-1"], "--num-warmup"),
    (["serve", "--concurrency", "0"], "must be positive"),
    ([], "MODE"),
])
def test_bad_arguments_raise(argv: list[str], message: str) -> None:
    with pytest.raises(bench.BenchError, match=message):
        bench.parse_args(argv)


def test_cli_dispatches_bench_and_reports_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "offline", "--batch-sizes", "nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("servelm: ") and "--batch-sizes" in err


def test_bad_engine_flag_fails_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "offline", "smollm2-135m", "--page-size", "0"])
    assert exc.value.code == 2
    assert "--page-size" in capsys.readouterr().err


def test_top_level_help_lists_bench(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "serve" in out and "bench" in out


# --- prompts -------------------------------------------------------------------------------------

def test_random_prompts_are_deterministic_and_in_range() -> None:
    first = bench_common.random_prompts(3, 50, 100, seed=7)
    assert first == bench_common.random_prompts(3, 50, 100, seed=7)
    assert first != bench_common.random_prompts(3, 50, 100, seed=8)
    assert [len(p) for p in first] == [50, 50, 50]
    assert all(0 <= t < 100 for p in first for t in p)
    assert len({tuple(p) for p in first}) == 3


def test_random_prompts_reject_bad_sizes() -> None:
    with pytest.raises(ValueError):
        bench_common.random_prompts(1, 0, 100, seed=0)
    with pytest.raises(ValueError):
        bench_common.random_prompts(1, 4, 0, seed=0)


# --- statistics ----------------------------------------------------------------------------------

def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert bench_common.percentile(values, 0) == 1.0
    assert bench_common.percentile(values, 100) == 4.0
    assert bench_common.percentile(values, 50) == 2.5
    assert bench_common.percentile(values, 99) == pytest.approx(3.97)
    assert bench_common.percentile([5.0], 99) == 5.0
    assert math.isnan(bench_common.percentile([], 50))
    with pytest.raises(ValueError):
        bench_common.percentile(values, 101)


def test_offline_result_derives_rates() -> None:
    result = OfflineResult(batch_size=8, input_len=128, output_len=64, prefill_s=2.0, total_s=9.0)
    assert result.prefill_tokens_per_s == 8 * 128 / 2.0
    assert result.decode_tokens_per_s == 8 * 63 / 7.0
    assert result.output_tokens_per_s == 8 * 64 / 9.0
    assert math.isnan(OfflineResult(1, 8, 1, 1.0, 1.0).decode_tokens_per_s)
    assert math.isnan(OfflineResult(1, 8, 4, 2.0, 1.5).decode_tokens_per_s)
    assert result.to_dict()["decode_tokens_per_s"] == 72.0


def test_summarize_counts_errors_and_latencies() -> None:
    timings = [
        RequestTiming(latency_s=1.0, ttft_s=0.2, chunk_gaps_s=[0.1, 0.3], num_output_tokens=5),
        RequestTiming(latency_s=2.0, ttft_s=0.4, chunk_gaps_s=[0.2], num_output_tokens=3),
        RequestTiming(latency_s=0.1, error="HTTP 400"),
    ]
    summary = bench_common.summarize(timings, duration_s=2.0)
    assert (summary.num_requests, summary.num_errors) == (3, 1)
    assert summary.request_throughput == 1.0
    assert summary.output_tokens_per_s == 4.0
    assert summary.ttft_ms["mean"] == pytest.approx(300.0)
    assert summary.ttft_ms["median"] == pytest.approx(300.0)
    assert summary.itl_ms["median"] == pytest.approx(200.0)
    assert summary.tpot_ms["mean"] == pytest.approx(1000 * (0.8 / 4 + 1.6 / 2) / 2)


def test_summarize_all_failed_gives_nan_latencies() -> None:
    summary = bench_common.summarize([RequestTiming(error="boom")], duration_s=1.0)
    assert summary.num_errors == 1 and summary.output_tokens_per_s == 0.0
    assert math.isnan(summary.ttft_ms["p99"])


# --- formatting ----------------------------------------------------------------------------------

def test_format_table_aligns_columns() -> None:
    text = bench_common.format_table(("batch", "tok/s"), [(1, 12.345), (16, 1234.5)])
    assert text.splitlines() == ["batch    tok/s",
                                 "-----  -------",
                                 "    1    12.35",
                                 "   16  1234.50"]


def test_format_offline_and_serve() -> None:
    text = bench_common.format_offline([OfflineResult(1, 128, 64, 1.0, 4.0)], startup_s=3.25)
    assert text.splitlines()[0] == "start-up time: 3.25 s"
    assert "decode_tok/s" in text and "21.00" in text
    summary = bench_common.summarize([RequestTiming(1.0, 0.5, [0.25], 3)], duration_s=1.0)
    serve_text = bench_common.format_serve(summary)
    assert "request throughput: 1.00 req/s" in serve_text
    assert "output throughput: 3.00 tok/s" in serve_text
    assert "TTFT" in serve_text and "500.00" in serve_text


def test_write_json(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    bench_common.write_json(str(path), {"results": [OfflineResult(2, 4, 1, 1.0, 1.0).to_dict()]})
    data = json.loads(path.read_text())
    assert data["results"][0]["prefill_tokens_per_s"] == 8.0
    assert math.isnan(data["results"][0]["decode_tokens_per_s"])


# --- end to end ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_offline_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "offline.json"
    cli.main(["bench", "offline", "smollm2-135m", "--batch-sizes", "1,2", "--input-len", "8",
              "--output-len", "3", "--num-warmup", "0", "--max-total-tokens", "1024",
              "--output-json", str(path)])
    assert "start-up time" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert [r["batch_size"] for r in data["results"]] == [1, 2]
    assert data["startup_s"] > 0


# --- the serve client against a fake SSE endpoint -----------------------------------------------

def _sse_transport(status: int = 200) -> object:
    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] is True and body["ignore_eos"] is True
        assert isinstance(body["prompt"], list)
        chunks = [{"choices": [{"text": "a"}]}, {"choices": [{"text": ""}]},
                  {"choices": [{"text": "b"}]}, {"choices": [], "usage": {"completion_tokens": 3}}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(status, text=text if status == 200 else "bad")

    return httpx.MockTransport(handler)


@pytest.mark.parametrize("status", [200, 400])
def test_one_request_reads_the_stream(status: int) -> None:
    import asyncio

    import httpx

    async def go() -> RequestTiming:
        async with httpx.AsyncClient(transport=_sse_transport(status)) as client:  # type: ignore[arg-type]
            body = {"model": "m", "prompt": [1, 2], "stream": True, "ignore_eos": True}
            return await bench_common.one_request(client, "http://test/v1/completions", body)

    timing = asyncio.run(go())
    if status == 200:
        assert timing.error is None and timing.num_output_tokens == 3
        assert timing.ttft_s is not None and len(timing.chunk_gaps_s) == 1  # empty chunk skipped
    else:
        assert timing.error is not None and timing.error.startswith("HTTP 400")


def test_server_info_snapshots_give_the_runs_speculative_figures() -> None:
    """`bench serve`/`serving` read /get_server_info before and after their requests: the
    figures are those of the difference (earlier traffic on the server does not count); a
    server without the endpoint, or without speculation, gives none."""
    import asyncio

    import httpx

    snapshots = iter([
        {"speculative_algorithm": "NGRAM", "spec_num_verify_passes": 10,
         "spec_num_draft_tokens": 40, "spec_num_accepted_tokens": 30},
        {"speculative_algorithm": "NGRAM", "spec_num_verify_passes": 30,
         "spec_num_draft_tokens": 100, "spec_num_accepted_tokens": 60},
    ])

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json=next(snapshots))
        return httpx.Response(404, text="not here")

    async def go() -> tuple[dict, dict]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:  # type: ignore[arg-type]
            before = await bench_common.server_info(client, "http://test")
            after = await bench_common.server_info(client, "http://test")
            return before, after

    before, after = asyncio.run(go())
    summary = bench_common.speculative_summary(before, after)
    assert summary == {"speculative_algorithm": "NGRAM", "spec_num_verify_passes": 20,
                       "spec_num_draft_tokens": 60, "spec_num_accepted_tokens": 30,
                       "spec_acceptance_rate": 0.5, "spec_accept_length": 2.5}
    assert bench_common.format_speculative(summary) == (
        "speculative decoding (NGRAM): accept length 2.50 tokens per verify pass, acceptance "
        "rate 50.0% of 60 drafted tokens")

    async def missing() -> dict:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:  # type: ignore[arg-type]
            return await bench_common.server_info(client, "http://test/elsewhere")

    assert asyncio.run(missing()) == {}
    assert bench_common.speculative_summary({}, {"num_running": 1}) == {}
