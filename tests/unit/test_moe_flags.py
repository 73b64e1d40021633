"""The MoE flags of SGLang, vLLM and LightLLM say what this build does: the fused CPU path is the
only MoE runner (auto), the CUDA-only kernels are refused as such, expert parallelism runs over the
tensor-parallel ranks (--ep-size = --tp-size, and its aliases), EPLB and the recorder need it or a
MoE model, DP attention is sized by --tp-size and refuses what it cannot run with, and an EP
group smaller than TP (--tp 4 --ep 2) splits each expert over its group."""

from __future__ import annotations

import pytest

from servelm import cli_args
from servelm.config import EngineConfig

from .test_cli import fail_message


def test_what_this_build_already_does_is_accepted() -> None:
    for argv in (["--moe-runner-backend", "auto"], ["--moe-a2a-backend", "none"], ["--ep-size", "1"],
                 ["--ep", "1"], ["--expert-parallel-size", "1"], ["--init-expert-location", "trivial"],
                 ["--disable-shared-experts-fusion"]):
        assert cli_args.parse_args(argv) == EngineConfig(), argv


def test_dp_attention_is_sized_by_tp() -> None:
    """SGLang's spelling, --dp-size equal to --tp-size, is one DP-attention engine, not replicas."""
    for argv in (["--tp", "2", "--enable-dp-attention"], ["--tp", "2", "--dp", "2", "--enable-dp-attention"]):
        parallel = cli_args.parse_args(argv + ["--enable-dp-lm-head"]).parallel
        assert parallel.enable_dp_attention and parallel.enable_dp_lm_head, argv
        assert parallel.data_parallel_size == 1 and parallel.ep_size == 2, argv


def test_moe_dense_tp_size_names_the_size_the_dense_layers_run_at() -> None:
    for argv, size in ((["--tp", "2"], "2"), (["--tp", "2", "--enable-dp-attention"], "1")):
        assert cli_args.parse_args(argv + ["--moe-dense-tp-size", size]) == cli_args.parse_args(argv), argv


def test_disable_mla_is_a_flag_of_its_own() -> None:
    assert cli_args.parse_args(["--disable-mla"]).model.disable_mla
    assert not EngineConfig().model.disable_mla


@pytest.mark.parametrize("argv", [["--moe-runner-backend", "triton"], ["--moe-runner-backend", "flashinfer_cutlass"],
                                  ["--enable-deepep-moe"], ["--deepep-mode", "auto"],
                                  ["--enable-flashinfer-trtllm-moe"], ["--enable-triton-kernel-moe"]])
def test_cuda_only_moe_kernels_are_refused_as_such(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    err = fail_message(argv, capsys)
    assert argv[0] in err and "CUDA" in err and "fused CPU path" in err


def test_expert_parallel_spellings_set_the_same_size() -> None:
    assert cli_args.parse_args(["--tp", "4", "--ep", "2"]).parallel.ep_size == 2
    for argv in (["--tp", "2", "--ep-size", "2"], ["--tp", "2", "--ep", "2"], ["--tp", "2", "--enable-ep-moe"],
                 ["--tp", "2", "--enable_ep_moe"], ["--tp", "2", "--enable-expert-parallel"],
                 ["--tp", "2", "--expert-parallel-size", "2"]):
        assert cli_args.parse_args(argv).parallel.ep_size == 2, argv
    config = cli_args.parse_args(["--tp", "2", "--ep", "2", "--auto_update_redundancy_expert",
                                  "--ep-num-redundant-experts", "2", "--eplb-algorithm", "auto",
                                  "--init-expert-location", "trivial", "--moe-a2a-backend", "none"])
    assert config.parallel.enable_eplb and config.parallel.ep_num_redundant_experts == 2
    groups = cli_args.parse_args(["--tp", "4", "--ep", "2", "--enable-eplb", "--ep-num-redundant-experts", "2"])
    assert groups.parallel.ep_size == 2 and groups.parallel.enable_eplb   # EPLB over expert groups
    recorder = cli_args.parse_args(["--expert-distribution-recorder-mode", "per_token",
                                    "--expert-distribution-recorder-buffer-size", "-1"]).observability
    assert recorder.expert_distribution_recorder_mode == "per_token"


@pytest.mark.parametrize("argv, words", [
    (["--ep-size", "2"], "must divide --tp-size 1"),
    (["--tp", "4", "--ep-size", "3"], "must divide --tp-size 4"),
    (["--tp", "4", "--ep-size", "2", "--enable-ep-moe"], "contradicts"),
    (["--enable-eplb"], "need --ep-size > 1"),
    (["--ep-num-redundant-experts", "2"], "need --ep-size > 1"),
    (["--tp", "2", "--ep", "2", "--enable-eplb", "--eplb-rebalance-num-iterations", "0"], "at least 1"),
    (["--enable-expert-distribution-metrics"], "add --enable-metrics"),
    (["--expert-distribution-recorder-buffer-size", "0"], "positive or -1"),
    (["--eplb-algorithm", "deepseek_hierarchical"], "no node hierarchy"),
    (["--moe-a2a-backend", "deepep"], "CUDA/RDMA"),
    (["--ep-dispatch-algorithm", "dynamic"], "round robin"),
    (["--eplb-rebalance-layers-per-chunk", "1"], "same forward pass"),
    (["--tp", "2", "--moe-dense-tp-size", "1"], "with --enable-dp-attention"),
    (["--tp", "4", "--moe-dense-tp-size", "2", "--enable-dp-attention"], "is not built here"),
    (["--enable-dp-attention"], "needs --tp-size > 1"),
    (["--tp", "2", "--dp", "3", "--enable-dp-attention"], "data-parallel size is --tp-size 2"),
    (["--tp", "2", "--pp-size", "2", "--enable-dp-attention"], "--pp-size"),
    (["--tp", "4", "--ep", "2", "--enable-dp-attention"], "--ep-size 2 contradicts it"),
    (["--tp", "2", "--enable-dp-attention", "--speculative-algorithm", "NGRAM"], "--speculative-algorithm"),
    (["--tp", "2", "--enable-dp-attention", "--enable-lora", "--max-lora-rank", "8"], "--enable-lora"),
    (["--tp", "2", "--enable-dp-attention", "--enable-eplb"], "its own requests' routing"),
    (["--tp", "2", "--enable-dp-lm-head"], "needs --enable-dp-attention"),
    (["--load-watch-interval", "0.1"], "no load to poll"),
    (["--prefill-round-robin-balance"], "refuses --disaggregation-mode"),
])
def test_expert_parallel_refusals_say_why(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert words in fail_message(argv, capsys)
