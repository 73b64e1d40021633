"""The MoE flags of SGLang, vLLM and LightLLM say what this build does: the fused CPU path is the
only MoE runner (auto), the CUDA-only kernels are refused as such, and expert parallelism, load
balancing and DP attention are refused as not built yet (issue 33)."""

from __future__ import annotations

import pytest

from servelm import cli_args
from servelm.config import EngineConfig

from .test_cli import fail_message


def test_what_this_build_already_does_is_accepted() -> None:
    for argv in (["--moe-runner-backend", "auto"], ["--moe-a2a-backend", "none"], ["--ep-size", "1"],
                 ["--ep", "1"], ["--expert-parallel-size", "1"], ["--disable-shared-experts-fusion"]):
        assert cli_args.parse_args(argv) == EngineConfig(), argv


def test_disable_mla_is_a_flag_of_its_own() -> None:
    assert cli_args.parse_args(["--disable-mla"]).model.disable_mla
    assert not EngineConfig().model.disable_mla


@pytest.mark.parametrize("argv", [["--moe-runner-backend", "triton"], ["--moe-runner-backend", "flashinfer_cutlass"],
                                  ["--enable-deepep-moe"], ["--deepep-mode", "auto"],
                                  ["--enable-flashinfer-trtllm-moe"], ["--enable-triton-kernel-moe"]])
def test_cuda_only_moe_kernels_are_refused_as_such(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    err = fail_message(argv, capsys)
    assert argv[0] in err and "CUDA" in err and "fused CPU path" in err


@pytest.mark.parametrize("argv", [["--ep-size", "2"], ["--expert-parallel-size", "4"], ["--moe-a2a-backend", "deepep"],
                                  ["--enable-ep-moe"], ["--enable_ep_moe"], ["--enable-expert-parallel"],
                                  ["--enable-eplb"], ["--ep-num-redundant-experts", "2"],
                                  ["--expert-distribution-recorder-mode", "stat"],
                                  ["--enable-expert-distribution-metrics"], ["--moe-dense-tp-size", "1"],
                                  ["--enable-dp-attention"], ["--auto_update_redundancy_expert"]])
def test_expert_parallelism_is_refused_as_not_built_yet(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    err = fail_message(argv, capsys)
    assert argv[0] in err and "issue 33" in err
    assert "not built yet" in err or "is not supported:" in err   # a value outside "1"/"none": the same reason
