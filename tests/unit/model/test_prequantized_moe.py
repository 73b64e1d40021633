"""Pre-quantized mixture-of-experts checkpoints (issue 34's "one of the MoE architectures"): tiny
random Qwen3-MoE and Mixtral whose every expert projection is quantized, written as GPTQ int4 (its
published layout, per-expert ``qweight``/``qzeros``/``scales``/``g_idx``; the reference is its
documented dequantization) and as compressed-tensors pack-quantized int4 and int8 (made by the
compressed-tensors library itself on the experts unfused into Linear layers, as llm-compressor
quantizes them; the reference is the library's own decompression). Mixtral's tensors carry its
published names (``block_sparse_moe.experts.<e>.w1`` / ``w3`` / ``w2``).

- ``--dtype float32``: every quantized module dequantized exactly at load, as the dense path does;
  logits and greedy tokens equal the reference's in float32.
- ``--dtype auto`` (tp 1): each expert's integer codes run on the GGUF block routes at their own
  precision (each expert split into its own linears, as a GGUF MoE file's are), no float expert
  stack left; logits within the routes' 16-bit activation rounding, greedy tokens equal.
- ``--ep-size 2 --tp-size 2`` (slow): each rank loads the dequantized weights of its experts (the block
  routes serve tp 1 only, as for dense pre-quantized models); logits equal one process's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from servelm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from servelm.model.forward_batch import BatchPlan
from servelm.model.layers.moe import FusedMoE
from servelm.model.runner import ModelRunner
from servelm.model.source import resolve_model_source
from tests.prequantized_checkpoints import make_quant_hf_model, reference_model, write_ct_with_library, write_gptq

from .conftest import BLOCK_SIZE, POOL_TOKENS, BlockAllocator, prompts_for
from .test_prequantized import assert_parity, logits_and_greedy, make_quant_runner, reference_logits_and_greedy

SLOW = pytest.mark.slow
NUM_EXPERTS = 4          # top-2 of 4: every expert gets rows of the prompts
HIDDEN, EXPERT_FFN = 128, 64   # both multiples of 64: the block kernels take every expert projection
CT_INT4 = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}
CT_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
KINDS = {"gptq": "GPTQ-int4", "gptq-desc-act": "GPTQ-int4-act", "ct-int4": "CT-int4", "ct-int8": "CT-int8"}
"""Checkpoint kind -> the block weights' kind its experts are served as."""
STORED = {"gptq": "qweight", "gptq-desc-act": "qweight", "ct-int4": "weight_packed", "ct-int8": "weight_packed"}


def moe_model(arch: str) -> Any:
    if arch == "mixtral":
        return make_quant_hf_model(arch, hidden=HIDDEN, intermediate=EXPERT_FFN, seed=2, num_local_experts=NUM_EXPERTS)
    return make_quant_hf_model(arch, hidden=HIDDEN, intermediate=128, moe_intermediate_size=EXPERT_FFN,
                               num_experts=NUM_EXPERTS)


def write_checkpoint(path: Path, model: Any, kind: str) -> dict[str, torch.Tensor]:
    """The checkpoint of ``kind``; returns the reference weights (HF name -> dequantized float32)."""
    if kind.startswith("gptq"):
        return write_gptq(path, model, 4, 32, sym=False, desc_act=kind == "gptq-desc-act")
    return write_ct_with_library(path, model, CT_INT4 if kind == "ct-int4" else CT_INT8, "pack-quantized")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``(arch, kind) -> (directory, the float model, the dequantized reference model)``, written once."""
    made: dict[tuple[str, str], tuple[Path, Any, Any]] = {}

    def get(arch: str, kind: str) -> tuple[Path, Any, Any]:
        if (arch, kind) not in made:
            model = moe_model(arch)
            path = tmp_path_factory.mktemp(f"{arch}-{kind}") / "checkpoint"
            made[arch, kind] = (path, model, reference_model(model, write_checkpoint(path, model, kind)))
        return made[arch, kind]
    return get


def stored_expert_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys() if ".experts." in name}


@pytest.mark.parametrize(("arch", "kind"), [
    pytest.param("qwen3_moe", "gptq", marks=SLOW), ("mixtral", "ct-int4"),
    pytest.param("qwen3_moe", "ct-int8", marks=SLOW),
    pytest.param("mixtral", "gptq", marks=SLOW), pytest.param("qwen3_moe", "ct-int4", marks=SLOW),
    pytest.param("mixtral", "gptq-desc-act", marks=SLOW)])
def test_dequantized_experts_match_the_reference(checkpoints: Any, arch: str, kind: str) -> None:
    """The checkpoint stores every expert projection quantized (no float expert weight), under the
    family's published names; servelm in float32 gives the reference's logits and greedy tokens."""
    if kind.startswith("ct"):
        pytest.importorskip("compressed_tensors")
    path, model, reference = checkpoints(arch, kind)
    stored = stored_expert_tensors(path)
    projections = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    layer = "block_sparse_moe" if arch == "mixtral" else "mlp"
    for expert in range(NUM_EXPERTS):
        for projection in projections:
            packed = stored[f"model.layers.0.{layer}.experts.{expert}.{projection}.{STORED[kind]}"]
            assert packed.dtype == torch.int32
    assert not any(name.endswith(".weight") for name in stored)
    # the reference holds the quantized experts, not the float ones they came from
    assert not torch.equal(reference.model.layers[0].mlp.experts.down_proj, model.model.layers[0].mlp.experts.down_proj)
    assert_parity(make_quant_runner(path), reference, arch)


@pytest.mark.parametrize(("arch", "kind"), [
    ("mixtral", "gptq"), pytest.param("qwen3_moe", "ct-int8", marks=SLOW),
    pytest.param("qwen3_moe", "gptq", marks=SLOW),
    pytest.param("mixtral", "ct-int4", marks=SLOW), pytest.param("mixtral", "gptq-desc-act", marks=SLOW)])
def test_experts_run_at_their_own_precision_on_the_block_routes(checkpoints: Any, arch: str, kind: str) -> None:
    """--dtype auto: every expert's gate_up and down are block linears of the checkpoint's codes (the
    stacks dropped); logits within the block routes' activation rounding of the reference's, greedy
    tokens equal. desc_act: each expert's inputs sorted by group (a permuted input)."""
    from servelm.model.layers.gguf_kernel import load_kernel
    from servelm.model.prequantized import PermutedInputMethod
    if load_kernel() is None:
        pytest.skip("no GGUF block kernel on this machine")
    if kind.startswith("ct"):
        pytest.importorskip("compressed_tensors")
    path, _, reference = checkpoints(arch, kind)
    runner = make_quant_runner(path, dtype="auto")
    moes = [module for module in runner.model.modules() if isinstance(module, FusedMoE)]
    assert len(moes) == 2   # Mixtral's two layers; Qwen3-MoE's layers 0 and 2 (1 is dense)
    for moe in moes:
        assert moe.gate_up_proj is None and moe.down_proj is None and moe.expert_layers is not None
        for layers in moe.expert_layers:
            for linear in (layers.gate_up_proj, layers.down_proj):
                assert getattr(linear, "gguf_weight", None) is not None
                assert linear.gguf_weight.kind == KINDS[kind]
                assert isinstance(linear.linear_method, PermutedInputMethod) == (kind == "gptq-desc-act")
    prompts = prompts_for(arch, runner.vocab_size)
    logits, greedy = logits_and_greedy(runner, prompts)
    expected_logits, expected_greedy = reference_logits_and_greedy(reference, prompts)
    assert (logits - expected_logits).norm() <= 2e-3 * expected_logits.norm()
    assert greedy == expected_greedy


def expert_parallel_logits(path: Path, prompts: list[list[int]], parallel: Any, size: int,
                           quantization: str = "auto") -> torch.Tensor:
    """Prompt logits of ``path`` in float32 at ``--tp-size size --ep-size size`` (``parallel``: this
    rank's context, None for one process)."""
    model_config = ModelConfig(model=str(path), device="cpu", dtype="float32", quantization=quantization)
    config = EngineConfig(model=model_config, cache=CacheConfig(page_size=BLOCK_SIZE, max_total_tokens=POOL_TOKENS),
                          parallel=ParallelConfig(tensor_parallel_size=size, expert_parallel_size=size))
    runner = ModelRunner(config, resolve_model_source(model_config), parallel=parallel)
    assert runner.parallel.ep_size == size
    allocator = BlockAllocator(POOL_TOKENS // BLOCK_SIZE)
    return runner.execute(BatchPlan([allocator.plan(i, p, num_logits=len(p)) for i, p in enumerate(prompts)]))


@SLOW
def test_expert_parallel_2_with_tensor_parallel_2_equals_one_process(checkpoints: Any) -> None:
    """--ep-size 2 --tp-size 2 on the GPTQ Qwen3-MoE: each rank dequantizes exactly the experts it
    holds (the block routes are tp-1 only); the logits of every rank equal one process's."""
    from tests.unit.distributed.test_parallel import run_ranks

    path, _, _ = checkpoints("qwen3_moe", "gptq")
    prompts = prompts_for("qwen3_moe", 320)
    expected = expert_parallel_logits(path, prompts, None, 1)
    for got in run_ranks(2, lambda parallel: expert_parallel_logits(path, prompts, parallel, 2)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
