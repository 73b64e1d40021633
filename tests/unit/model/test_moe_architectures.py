"""The MoE families (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE) over the paged cache vs transformers
(CPU, float32): test_architectures' parity tests on the tiny MoE configs, plus what is MoE's own:
every expert runs in these tests, the per-expert checkpoint layout loads as the fused one does, and
a checkpoint missing an expert is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from servelm.model.forward_batch import BatchPlan
from servelm.model.layers.moe import FusedMoE
from tests.tiny_models import TINY_MOE_ARCHS, TINY_NUM_EXPERTS, make_tiny_model_dir

from .conftest import BlockAllocator, make_runner, make_source, prompts_for
from .test_architectures import (  # noqa: F401  (collected here with this module's ``arch``)
    NUM_NEW_TOKENS,
    test_chunked_prefill_matches_full, test_decode_batch_of_mixed_lengths, test_greedy_generation_matches_hf,
    test_prefill_logits_match)


@pytest.fixture(scope="module", params=TINY_MOE_ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


def _expert_rows(runner: Any) -> dict[str, torch.Tensor]:
    """Counts of rows each FusedMoE layer sends to each expert, filled by forward hooks."""
    counts: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Any:
        def count(module: FusedMoE, args: tuple[Any, ...]) -> None:
            ids = args[1].expert_ids.reshape(-1)
            counts[name] = counts.get(name, torch.zeros(module.num_experts, dtype=torch.int64)) + \
                torch.bincount(ids, minlength=module.num_experts)
        return count

    for name, module in runner.model.named_modules():
        if isinstance(module, FusedMoE):
            module.register_forward_pre_hook(hook(name))
    return counts


def test_every_expert_gets_tokens(arch: str, hf_model: Any, allocator: BlockAllocator) -> None:
    """The greedy parity test's rows (its prompts, then its decode steps) reach every expert of every
    sparse layer, so each expert's weights (loaded, stacked, sliced) are held to transformers."""
    runner = make_runner(make_source(hf_model))
    counts = _expert_rows(runner)
    prompts = prompts_for(arch, runner.vocab_size)
    logits = runner.execute(BatchPlan([allocator.plan(i, p, num_logits=1) for i, p in enumerate(prompts)]))
    for _ in range(NUM_NEW_TOKENS - 1):
        tokens = logits.argmax(-1).tolist()
        logits = runner.execute(BatchPlan([allocator.plan(i, [t], num_logits=1) for i, t in enumerate(tokens)]))
    assert counts, "no MoE layer ran"
    for name, rows in counts.items():
        assert rows.shape == (TINY_NUM_EXPERTS,) and bool((rows > 0).all()), (name, rows.tolist())


def _disk_source(path: Path, hf_model: Any, drop: str | None = None) -> Any:
    """A source over the saved checkpoint's own tensors (per-expert names: ``experts.<e>.gate_proj``,
    Mixtral's ``block_sparse_moe.experts.<e>.w1``), without tensors whose name contains ``drop``."""
    state = load_file(str(path / "model.safetensors"))
    source = make_source(hf_model)
    source.weights = lambda: iter((n, t) for n, t in state.items() if drop is None or drop not in n)
    return source


def test_per_expert_checkpoint_loads_as_fused(arch: str, hf_model: Any, tmp_path: Path) -> None:
    path = make_tiny_model_dir(tmp_path, arch)
    names = list(load_file(str(path / "model.safetensors")))
    assert any(".experts.7." in name for name in names), "the saved checkpoint keeps per-expert tensors"
    fused = make_runner(make_source(hf_model)).model.state_dict()
    per_expert = make_runner(_disk_source(path, hf_model)).model.state_dict()
    assert fused.keys() == per_expert.keys()
    for name in fused:
        assert torch.equal(fused[name], per_expert[name]), name


def test_checkpoint_missing_an_expert_is_refused(arch: str, hf_model: Any, tmp_path: Path) -> None:
    path = make_tiny_model_dir(tmp_path, arch)
    with pytest.raises(ValueError, match="expert 3"):
        make_runner(_disk_source(path, hf_model, drop=".experts.3."))
