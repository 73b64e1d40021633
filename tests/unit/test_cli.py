"""The command line: flags -> EngineConfig, aliases, --config files, errors and help."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from servelm import cli, cli_args, cli_flags, launch_server
from servelm.config import EngineConfig, opt
from servelm.engine.launch import EngineLaunch


def fail_message(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli_args.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("servelm: ")
    return err


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[EngineConfig]:
    """Replaces servelm.server.app.run_server with a recorder, and starts no engine process."""
    calls: list[EngineConfig] = []
    fake = types.ModuleType("servelm.server.app")
    fake.run_server = lambda config, launch: calls.append(config)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "servelm.server.app", fake)
    monkeypatch.setattr(EngineLaunch, "begin", classmethod(lambda cls, config: cls(None)))
    return calls


# --- model selection ---------------------------------------------------------------------------

def test_defaults_without_flags() -> None:
    assert cli_args.parse_args([]) == EngineConfig()


def test_positional_model() -> None:
    config = cli_args.parse_args(["/models/qwen.gguf", "--port", "8001"])
    assert config.model.model == "/models/qwen.gguf"
    assert config.server.port == 8001


def test_positional_after_flags_and_model_flag() -> None:
    assert cli_args.parse_args(["--port", "8001", "smollm2-135m"]).model.model == "smollm2-135m"
    assert cli_args.parse_args(["--model", "smollm2-135m"]).model.model == "smollm2-135m"
    assert cli_args.parse_args(["smollm2-135m", "--model", "smollm2-135m"]).model.model == "smollm2-135m"


def test_two_different_models_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    err = fail_message(["a", "--model", "b"], capsys)
    assert "MODEL 'a'" in err and "--model 'b'" in err
    err = fail_message(["--model-path", "a", "--model_dir", "b"], capsys)
    assert "--model-path" in err and "--model_dir" in err


def test_same_flag_twice_last_wins() -> None:
    assert cli_args.parse_args(["--port", "1", "--port", "2"]).server.port == 2
    assert cli_args.parse_args(["--tp", "1", "-tp", "1"]).parallel.tensor_parallel_size == 1


def test_sglang_launch_server(served: list[EngineConfig]) -> None:
    launch_server.main(["--model-path", "qwen2.5-coder-0.5b", "--mem-fraction-static", "0.5",
                        "--tp-size", "1", "--random-seed", "3", "--json-model-override-args",
                        '{"rope_theta": 1.0}', "--disable-cuda-graph", "--disable-radix-cache"])
    (config,) = served
    assert config.model.model == "qwen2.5-coder-0.5b"
    assert config.cache.mem_fraction_static == 0.5
    assert config.model.seed == 3
    assert config.model.hf_overrides == '{"rope_theta": 1.0}'


def test_servelm_serve_main(served: list[EngineConfig]) -> None:
    cli.main(["serve", "smollm2-135m", "--port", "8123", "--api-key", "k"])
    (config,) = served
    assert (config.model.model, config.server.port, config.server.api_key) == ("smollm2-135m", 8123, "k")


def test_main_without_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2


def test_main_reports_errors_with_exit_2(served: list[EngineConfig],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "m", "--enable-lmcache"])
    assert exc.value.code == 2
    assert "servelm: --enable-lmcache is not supported: LMCache" in capsys.readouterr().err
    assert served == []


# --- aliases -----------------------------------------------------------------------------------

def test_lightllm_aliases() -> None:
    config = cli_args.parse_args([
        "--model_dir", "/m", "--max_total_token_num", "6000", "--running_max_req_size", "8",
        "--tp", "1", "--mem_fraction", "0.6", "--batch_max_tokens", "2048", "--host", "0.0.0.0",
        "--port", "8000", "--data_type", "bf16", "--tokenizer_mode", "slow",
        "--max_req_total_len", "3072", "--chunked_prefill_size", "256",
        "--long_truncation_mode", "head", "--model_name", "mine", "--run_mode", "normal",
        "--load_way", "HF", "--disable_dynamic_prompt_cache"])
    assert config.model.model == "/m"
    assert config.cache.max_total_tokens == 6000
    assert config.scheduler.max_running_requests == 8
    assert config.cache.mem_fraction_static == 0.6
    assert config.scheduler.max_prefill_tokens == 2048
    assert (config.server.host, config.server.port) == ("0.0.0.0", 8000)
    assert config.model.dtype == "bfloat16"
    assert config.model.tokenizer_mode == "slow"
    assert config.model.context_length == 3072
    assert config.scheduler.chunked_prefill_size == 256
    assert config.server.truncation_mode == "head"
    assert config.model.served_model_name == ["mine"]


def test_lightllm_value_transforms() -> None:
    assert cli_args.parse_args(["--tokenizer_mode", "fast"]).model.tokenizer_mode == "auto"
    assert cli_args.parse_args(["--data_type", "fp32"]).model.dtype == "float32"
    assert cli_args.parse_args(["--disable_chunked_prefill"]).scheduler.chunked_prefill_size == -1
    assert cli_args.parse_args(["--long_truncation_mode", "None"]).server.truncation_mode is None
    assert cli_args.parse_args(["--long_truncation_mode", "center"]).server.truncation_mode == "center"
    assert cli_args.parse_args(["--allow-auto-truncate"]).server.truncation_mode == "head"


@pytest.mark.parametrize("argv, expected", [
    (["--nccl_host", "10.0.0.5"], "10.0.0.5:28765"),  # LightLLM's default port
    (["--nccl_port", "29001"], "127.0.0.1:29001"),  # LightLLM's default host
    (["--nccl_host", "10.0.0.5", "--nccl_port", "29001"], "10.0.0.5:29001"),
    (["--nccl_port", "29001", "--nccl_host", "10.0.0.5"], "10.0.0.5:29001"),
    (["--nccl_host", "fe80::1", "--nccl_port", "7"], "[fe80::1]:7"),
])
def test_lightllm_nccl_host_and_port_make_dist_init_addr(argv: list[str], expected: str) -> None:
    """LightLLM's two rendezvous flags (node 0's address with --nnodes > 1) are one
    --dist-init-addr host:port, in either order."""
    config = cli_args.parse_args(["--nnodes", "2", "--node_rank", "1", "--tp", "2", *argv])
    assert config.parallel.dist_init_addr == expected
    assert config.parallel.nnodes == 2 and config.parallel.node_rank == 1


def test_lightllm_nccl_flags_refused_where_they_mean_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    multi = ["--nnodes", "2", "--tp", "2"]
    err = fail_message([*multi, "--nccl_port", "29001", "--dist-init-addr", "10.0.0.1:5000"], capsys)
    assert "--nccl_port" in err and "--dist-init-addr" in err and "give only one" in err
    err = fail_message([*multi, "--nccl_port", "70000"], capsys)
    assert "--nccl_port" in err and "1-65535" in err
    err = fail_message(["--tp", "2", "--nccl_port", "29001"], capsys)  # one node: loopback, any port
    assert "--nccl_port" in err and "on one node" in err


def test_vllm_aliases() -> None:
    config = cli_args.parse_args([
        "Qwen/Qwen2.5-0.5B", "--gpu-memory-utilization", "0.4", "--block-size", "32",
        "--max-num-seqs", "16", "--max-num-batched-tokens", "1024", "--max-model-len", "2048",
        "-tp", "1", "-pp", "1", "--seed", "5", "--tokenizer", "/tok", "--enforce-eager",
        "--no-enable-prefix-caching", "--served-model-name", "qwen"])
    assert config.model.model == "Qwen/Qwen2.5-0.5B"
    assert config.cache.mem_fraction_static == 0.4
    assert config.cache.page_size == 32
    assert config.scheduler.max_running_requests == 16
    assert config.scheduler.max_prefill_tokens == 1024
    assert config.model.context_length == 2048
    assert config.model.seed == 5
    assert config.model.tokenizer == "/tok"
    assert config.model.name == "qwen"


def test_vllm_enable_chunked_prefill(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_args.parse_args(["--enable-chunked-prefill"]) == EngineConfig()
    assert cli_args.parse_args(["--enable-chunked-prefill", "true"]) == EngineConfig()
    assert cli_args.parse_args(["--enable-chunked-prefill", "false"]).scheduler.chunked_prefill_size == -1
    config = cli_args.parse_args(["--enable-chunked-prefill", "--chunked-prefill-size", "128"])
    assert config.scheduler.chunked_prefill_size == 128
    err = fail_message(["--enable-chunked-prefill", "--chunked-prefill-size", "-1"], capsys)
    assert "--enable-chunked-prefill contradicts --chunked-prefill-size -1" in err
    assert "--enable-chunked-prefill" in fail_message(["--enable-chunked-prefill", "maybe"], capsys)


def test_prefix_caching_forms(capsys: pytest.CaptureFixture[str]) -> None:
    off = EngineConfig.from_flat({"disable_radix_cache": True})
    for argv in (["--no-enable-prefix-caching"], ["--disable-radix-cache"],
                 ["--disable_dynamic_prompt_cache"], ["--enable-prefix-caching", "false"]):
        assert cli_args.parse_args(argv) == off, argv
    for argv in (["--enable-prefix-caching"], ["--use_dynamic_prompt_cache"], []):
        assert cli_args.parse_args(argv) == EngineConfig(), argv
    vllm = cli_args.parse_args(["--scheduling-policy", "priority"]).scheduler
    assert vllm.is_priority_scheduling and vllm.is_low_priority_value_first
    assert cli_args.parse_args(["--enable-prompt-tokens-details"]).server.enable_cache_report


def test_already_behaviour_checks_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_args.parse_args(["--preemption-mode", "recompute", "--expert-parallel-size", "1",
                           "--cpu-offload-gb", "0.0", "-O", "0"]) == EngineConfig()
    err = fail_message(["--preemption-mode", "swap"], capsys)
    assert "--preemption-mode swap is not supported" in err and "accepted: recompute" in err
    assert "-O 3 is not supported" in fail_message(["-O3"], capsys)


def test_rejected_flag_message(capsys: pytest.CaptureFixture[str]) -> None:
    err = fail_message(["m", "--worker-cls", "x.Worker"], capsys)
    assert err.startswith("servelm: --worker-cls is not supported: rank processes run servelm's "
                          "own worker")
    assert "--quantization hqq is not supported: HQQ checkpoints" in fail_message(["--quantization", "hqq"], capsys)
    # a bitsandbytes checkpoint loads; any other is refused when the model is read (prequantized.resolve)
    assert cli_args.parse_args(["m", "--load-format", "bitsandbytes"]).model.load_format == "bitsandbytes"
    assert "--quantization-param-path is not supported: servelm's fp8 K/V cache" in fail_message(
        ["--quantization-param-path", "x.json"], capsys)
    assert "--quant_cfg is not supported: LightLLM's --quant_cfg files" in fail_message(
        ["--quant_cfg", "x.yaml"], capsys)
    assert "choose from int8dq, int8wo" in fail_message(["--torchao-config", "fp8wo"], capsys)
    assert "got 'ao-int4wo-100'" in fail_message(["--quant_type", "ao-int4wo-100"], capsys)


@pytest.mark.parametrize(("argv", "expected"), [
    (["--torchao-config", "int8dq"], "w8a8_int8"), (["--torchao-config", "int8wo"], "int8wo"),
    (["--torchao-config", "int4wo-128"], "int4wo-128"), (["--quant_type", "ao-int8wo"], "int8wo"),
    (["--quant_type", "ao-int4wo-32"], "int4wo-32"), (["--quant_type", "vllm-w8a8"], "w8a8_int8"),
    (["--quantization", "int4wo-64"], "int4wo-64"), (["-q", "int8wo"], "int8wo"),
    (["--quantization", "gptq"], "gptq"), (["-q", "awq_marlin"], "awq_marlin"), (["-q", "fp8"], "fp8"),
    (["--quantization", "compressed-tensors"], "compressed-tensors"),
])
def test_quantization_aliases(argv: list[str], expected: str) -> None:
    assert cli_args.parse_args(argv).model.quantization == expected


def test_unknown_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert "unrecognized arguments: --no-such-flag" in fail_message(["--no-such-flag"], capsys)


def test_no_abbreviations(capsys: pytest.CaptureFixture[str]) -> None:
    assert "unrecognized arguments: --max-run" in fail_message(["--max-run", "4"], capsys)


# --- bool flags ---------------------------------------------------------------------------------

def test_bool_flags_take_no_value() -> None:
    config = cli_args.parse_args(["--skip-tokenizer-init", "--allow-auto-truncate", "--enable-metrics"])
    assert config.model.skip_tokenizer_init and config.server.allow_auto_truncate
    assert config.observability.enable_metrics


def test_negatable_bool_field_gets_no_form() -> None:
    @dataclasses.dataclass(frozen=True)
    class Toy:
        enable_thing: bool = opt(True, "A switch.", negatable=True)

    parser = cli_args.Parser(allow_abbrev=False)
    (field,) = dataclasses.fields(Toy)
    cli_args._add_field(parser.add_argument_group("toy"), field, bool)
    on = parser.parse_args(["--enable-thing"])
    off = parser.parse_args(["--enable-thing", "--no-enable-thing"])
    assert cli_args._settings(on)["enable_thing"].value is True
    assert cli_args._settings(off)["enable_thing"].value is False  # same family: last wins
    assert "--no-enable-thing" in parser.format_help()


# --- bad values ---------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flags", [
    (["--port", "70000"], ["--port"]),
    (["--port", "x"], ["--port"]),
    (["--page-size", "0"], ["--page-size"]),
    (["--mem_fraction", "1.5"], ["--mem-fraction-static", "--mem_fraction"]),
    (["--gpu-memory-utilization", "0"], ["--mem-fraction-static", "--gpu-memory-utilization"]),
    (["--max-num-seqs", "0"], ["--max-running-requests", "--max-num-seqs"]),
    (["--chunked-prefill-size", "0"], ["--chunked-prefill-size"]),
    (["--context-length", "-5"], ["--context-length"]),
    (["--hf-overrides", "[1]"], ["--hf-overrides"]),
    (["--json-model-override-args", "{bad"], ["--hf-overrides", "--json-model-override-args"]),
    (["--tp", "0"], ["--tensor-parallel-size", "--tp"]),
    (["--pp-size", "0"], ["--pipeline-parallel-size", "--pp-size"]),
    (["--pp-max-micro-batch-size", "0"], ["--pp-max-micro-batch-size"]),
    (["--nnodes", "2", "--tp", "3", "--dist-init-addr", "h:1"], ["--tp-size", "--nnodes"]),
    (["--nnodes", "2", "--node-rank", "2"], ["--node-rank"]),
    (["--nnodes", "2", "--tp", "2"], ["--dist-init-addr"]),
    (["--nnodes", "2", "--tp", "2", "--dist-init-addr", "nohost"], ["--dist-init-addr"]),
    (["--nnodes", "2", "--tp", "2", "--pp-size", "2", "--dist-init-addr", "h:1"], ["--pp-size", "--nnodes"]),
    (["--dtype", "int8"], ["--dtype"]),
    (["--data_type", "int8"], ["--data_type"]),
    (["--long_truncation_mode", "middle"], ["--long_truncation_mode"]),
    (["--log-requests-level", "4"], ["--log-requests-level"]),
    (["--bucket-time-to-first-token", "1", "0.5"], ["--bucket-time-to-first-token"]),
    (["--skip-tokenizer-init", "--tokenizer-path", "t"], ["--skip-tokenizer-init"]),
])
def test_bad_values_name_the_flag(argv: list[str], flags: list[str]) -> None:
    with pytest.raises(ValueError) as exc:
        cli_args.build_config(argv)
    for flag in flags:
        assert flag in str(exc.value)


def test_config_validation_raises_value_error() -> None:
    with pytest.raises(ValueError, match="--page-size"):
        EngineConfig.from_flat({"page_size": -1})


# --- config file ---------------------------------------------------------------------------------

def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_with_cli_override(tmp_path: Path) -> None:
    path = write(tmp_path, """
model-path: /models/a
host: 0.0.0.0
port: 30000
tensor-parallel-size: 1
max_total_token_num: 8192
mem_fraction_static: 0.5
--max-running-requests: 4
allow-auto-truncate: true
skip_tokenizer_init: false
enable-prefix-caching: false
disable-cuda-graph: true
enable-metrics: false
hf-overrides: {rope_theta: 1000.0}
""")
    config = cli_args.parse_args(["--config", path, "--port", "9000", "--max-num-seqs", "2"])
    assert config.model.model == "/models/a"
    assert config.server.host == "0.0.0.0"
    assert config.server.port == 9000  # the command line wins
    assert config.scheduler.max_running_requests == 2  # an alias on the command line wins too
    assert config.cache.max_total_tokens == 8192
    assert config.cache.mem_fraction_static == 0.5
    assert config.server.allow_auto_truncate
    assert not config.model.skip_tokenizer_init
    assert config.model.hf_overrides == '{"rope_theta": 1000.0}'


def test_positional_model_overrides_config_file(tmp_path: Path) -> None:
    path = write(tmp_path, "model-path: /models/a\n")
    assert cli_args.parse_args(["/models/b", "--config", path]).model.model == "/models/b"
    assert cli_args.parse_args(["--config", path]).model.model == "/models/a"


@pytest.mark.parametrize("text, expected", [
    ("no-such-option: 1\n", "no-such-option: unknown option"),
    ("enable-lmcache: true\n", "--enable-lmcache is not supported: LMCache"),
    ("port: abc\n", "argument --port: invalid int value"),
    ("page-size: 0\n", "--page-size must be positive, got 0 (given as --page-size (in "),
    ("tp: 0\n", "(given as --tp (in "),
    ("allow-auto-truncate: 1\n", "allow-auto-truncate: takes true or false"),
    ("port: [1, 2]\n", "port: takes one value, got a list"),
    ("- port\n", "expected a mapping"),
    ("port: [\n", "not valid YAML"),
])
def test_config_file_errors(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as exc:
        cli_args.build_config(["--config", path])
    assert expected in str(exc.value)


def test_config_file_missing() -> None:
    with pytest.raises(ValueError, match="--config /no/such.yaml"):
        cli_args.build_config(["--config", "/no/such.yaml"])


def test_empty_config_file(tmp_path: Path) -> None:
    assert cli_args.build_config(["--config", write(tmp_path, "")]) == EngineConfig()


# --- help ---------------------------------------------------------------------------------------

def help_text(argv: list[str], capsys: pytest.CaptureFixture[str], entry: Any = cli.main) -> str:
    with pytest.raises(SystemExit) as exc:
        entry(argv)
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    out = help_text(["--help"], capsys)
    assert "serve" in out and "usage: servelm" in out


def test_serve_help_lists_every_field_and_alias(capsys: pytest.CaptureFixture[str]) -> None:
    out = help_text(["serve", "--help"], capsys)
    assert out.startswith("usage: servelm serve [MODEL]")
    for flag in cli_flags.implemented_flags():
        assert flag in out
    for alias in cli_flags.ALIASES:
        assert alias.flags[0] in out
    assert "Tokens per KV block" in out  # help comes from the field metadata
    assert "{auto,cpu,cuda}" in out       # choices too
    assert "--enable-p2p-check" not in out  # rejected flags stay out of the help
    assert "servelm.cli_flags` lists them all" in out


def test_launch_server_help(capsys: pytest.CaptureFixture[str]) -> None:
    out = help_text(["--help"], capsys, launch_server.main)
    assert out.startswith("usage: python -m servelm.launch_server [MODEL]")
    assert "--model-path" in out


def test_catalogue_listing() -> None:
    text = cli_flags.describe()
    assert "--gpu-memory-utilization" in text and "--enable-p2p-check" in text


def test_parser_is_argparse() -> None:
    assert isinstance(cli_args.build_serve_parser(), argparse.ArgumentParser)


# --- contradictions and flags that need another flag (issue 11) --------------------------------

@pytest.mark.parametrize("argv", [
    ["--disable-log-requests", "--log-requests"],
    ["-O", "0", "--enable-torch-compile"],
    ["--compilation-config", "0", "--enable-torch-compile"],
    ["--enforce-eager", "--enable-torch-compile"],
    ["--use_dynamic_prompt_cache", "--disable-radix-cache"],
    ["--scheduler-delay-factor", "0", "--router_max_wait_tokens", "4"],
    ["--splitfuse_mode", "--disable_chunked_prefill"],
    ["--constrained-json-disable-any-whitespace", "--constrained-json-whitespace-pattern", "[ ]*"],
])
def test_already_behaviour_contradicted_by_another_flag(argv: list[str],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    first = argv[0]
    second = next(a for a in argv[1:] if a.startswith("-"))
    for order in (argv, argv[argv.index(second):] + argv[:argv.index(second)]):
        err = fail_message(order, capsys)
        assert "contradicts" in err and first in err and second in err, err


def test_already_behaviour_alone_and_with_compatible_flags() -> None:
    assert cli_args.parse_args(["--disable-log-requests", "--splitfuse_mode",
                                "--chunked-prefill-size", "256"]).scheduler.chunked_prefill_size == 256
    assert cli_args.parse_args(["-O", "0", "--scheduler-delay-factor", "0"]) == EngineConfig()


@pytest.mark.parametrize("flag, value", [("--allowed-methods", "GET"), ("--allowed-headers", "X-A"),
                                         ("--allow-credentials", None)])
def test_cors_options_need_allowed_origins(flag: str, value: str | None,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    argv = [flag] + ([value] if value else [])
    err = fail_message(argv, capsys)
    assert f"{flag} has no effect without --allowed-origins" in err
    config = cli_args.parse_args(argv + ["--allowed-origins", "*"])
    assert config.server.allowed_origins == "*"


def test_whitespace_pattern_xgrammar_cannot_honour(capsys: pytest.CaptureFixture[str]) -> None:
    err = fail_message(["--constrained-json-whitespace-pattern", " ?"], capsys)
    assert "xgrammar" in err and "llguidance" in err
    for pattern in (r"[ \t\n]*", r"\s*", r"[ \t\n\r]*"):
        assert cli_args.parse_args(["--constrained-json-whitespace-pattern", pattern])
    assert cli_args.parse_args(["--constrained-json-whitespace-pattern", " ?", "--grammar-backend",
                                "llguidance"]).structured.grammar_backend == "llguidance"


def test_trust_remote_code_is_refused_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--trust-remote-code", "--trust_remote_code"):
        assert cli_flags.classify(flag) == "rejected"
        assert "never executes code from a checkpoint" in fail_message([flag], capsys)


def test_parser_options_are_catalogued() -> None:
    assert cli_flags.classify("--config") == "implemented"
    assert cli_flags.classify("--dry-run") == "implemented"


# --- --dry-run ----------------------------------------------------------------------------------

def dry_run(argv: list[str], capsys: pytest.CaptureFixture[str],
            entry: Any = cli.main) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        entry(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_dry_run_prints_yaml_that_config_reads_back(tmp_path: Path, served: list[EngineConfig],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["smollm2-135m", "--port", "8123", "--max-num-seqs", "3", "--hf-overrides",
            '{"rope_theta": 1000.0}', "--enable-metrics", "--bucket-time-to-first-token", "0.1",
            "1", "--disable-radix-cache", "--allowed-origins", "*", "--allow-credentials",
            "--disable-cuda-graph", "--api-key", "k"]
    code, out, err = dry_run(["serve", *argv, "--dry-run"], capsys)
    assert code == 0, err
    assert served == []  # nothing was started
    path = tmp_path / "resolved.yaml"
    path.write_text(out)
    assert cli_args.build_config(["--config", str(path)]) == cli_args.build_config(argv)
    assert "port: 8123" in out and "max-running-requests: 3" in out


def test_dry_run_with_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "model-path: /models/a\nport: 9001\n")
    code, out, _ = dry_run(["serve", "--config", path, "--dry-run", "--port", "9002"], capsys)
    assert code == 0 and "model: /models/a" in out and "port: 9002" in out
    code, out, _ = dry_run(["--config", path, "--dry-run"], capsys, launch_server.main)
    assert code == 0 and "port: 9001" in out


def test_dry_run_refusal_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = dry_run(["serve", "--fully-sharded-loras", "--dry-run"], capsys)
    assert code == 2 and out == ""
    assert "--fully-sharded-loras is not supported: vLLM's fully sharded LoRA" in err
    path = write(tmp_path, "dry-run: true\n")
    code, _, err = dry_run(["serve", "--config", path, "--dry-run"], capsys)
    assert code == 2 and "dry-run: unknown option" in err


def test_served_model_name_takes_a_list() -> None:
    config = cli_args.parse_args(["--served-model-name", "a", "b", "--model", "smollm2-135m"])
    assert config.model.served_model_name == ["a", "b"]
    assert config.model.model == "smollm2-135m"  # b is not taken for the model path
    assert (config.model.name, config.model.served_names) == ("a", ("a", "b"))
    assert cli_args.parse_args(["m", "--served-model-name", "x"]).model.served_names == ("x",)
    assert cli_args.parse_args(["m"]).model.served_names == ("m",)


# --- --dry-run refuses what start-up refuses (issue 31, part 6) ----------------------------------

@pytest.mark.parametrize("argv, reason", [
    (["--enable-torch-compile", "--tp-size", "2"], "--enable-torch-compile cannot be combined with --tp-size"),
    (["--enable-torch-compile", "--task", "embedding"], "an embedding model (--task embed) has none"),
    (["--enable-torch-compile", "--task", "embed"], "an embedding model (--task embed) has none"),
    (["--ssl-keyfile", "key.pem"], "--ssl-keyfile has no effect without --ssl-certfile"),
    (["--chat-template", "chatml"], "--chat-template 'chatml': no such file"),
    (["--task", "embedding", "--enable-lora"], "--enable-lora serves generation"),
    (["--task", "embedding", "--disaggregation-mode", "prefill"], "serves generation"),
    (["--task", "embedding", "--enable-hierarchical-cache"], "--enable-hierarchical-cache serves generation"),
])
def test_dry_run_refuses_what_start_up_refuses(argv: list[str], reason: str, served: list[EngineConfig],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = dry_run(["serve", "smollm2-135m", *argv, "--dry-run"], capsys)
    assert code == 2 and out == "" and reason in err, (code, err)
    assert served == []


def test_fp32_lm_head_is_a_config_field_with_a_16_bit_dtype() -> None:
    config = cli_args.parse_args(["--enable-fp32-lm-head", "--dtype", "bfloat16"])
    assert config.model.enable_fp32_lm_head and config.model.dtype == "bfloat16"
    assert cli_flags.classify("--enable-fp32-lm-head") == "implemented"


def test_chat_template_file_or_inline_text_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert cli_args.parse_args(["--chat-template", str(path)]).server.chat_template == str(path)
    assert cli_args.parse_args(["--chat-template", "{{ messages }}"]).server.chat_template == "{{ messages }}"
