"""Fixtures for model tests: tiny HF models, a runner over them, and a toy block allocator."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # repo root, for tests.tiny_models

from servelm.config import CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from servelm.model.forward_batch import SequencePlan  # noqa: E402
from servelm.model.runner import ModelRunner  # noqa: E402
from tests.tiny_models import TINY_MLA_ARCHS, TINY_MOE_ARCHS, make_tiny_hf_model  # noqa: E402

BLOCK_SIZE = 4
POOL_TOKENS = 4096


def make_source(hf_model: Any) -> SimpleNamespace:
    """A ModelSource-compatible object over an in-memory transformers model."""
    state = {name: tensor.detach().clone() for name, tensor in hf_model.state_dict().items()}
    return SimpleNamespace(hf_config=hf_model.config, weights=lambda: iter(state.items()),
                           tokenizer_path=None, eos_token_ids=[], context_length=512,
                           description="tiny test model")


def make_runner(source: Any, dtype: str = "float32", parallel: Any = None,
                residual_dtype: str = "auto") -> ModelRunner:
    config = EngineConfig(model=ModelConfig(model="tiny", device="cpu", dtype=dtype, residual_dtype=residual_dtype),
                          cache=CacheConfig(page_size=BLOCK_SIZE, max_total_tokens=POOL_TOKENS))
    return ModelRunner(config, source, parallel=parallel)


class BlockAllocator:
    """Hands out blocks in a shuffled order so sequences are never contiguous in the pool."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}

    def plan(self, sequence_id: int, token_ids: list[int], num_logits: int) -> SequencePlan:
        """Plan ``token_ids`` after what the sequence already cached, allocating blocks as needed."""
        table = self.tables.setdefault(sequence_id, [])
        start = self.num_cached.get(sequence_id, 0)
        while len(table) * BLOCK_SIZE < start + len(token_ids):
            table.append(self.free.pop())
        self.num_cached[sequence_id] = start + len(token_ids)
        return SequencePlan(token_ids=list(token_ids), start_position=start, block_ids=list(table),
                            num_logits=num_logits)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def hf_model(arch: str) -> Any:
    return make_tiny_hf_model(arch)


@pytest.fixture(scope="module")
def runner_factory(hf_model: Any) -> Any:
    return lambda: make_runner(make_source(hf_model))


@pytest.fixture(scope="module")
def vlm_runner(hf_vlm: Any) -> ModelRunner:
    """A runner over the module's ``hf_vlm`` fixture (a vision-language model's test module)."""
    return make_runner(make_source(hf_vlm))


@pytest.fixture
def allocator() -> BlockAllocator:
    return BlockAllocator(POOL_TOKENS // BLOCK_SIZE)


def prompts_for(arch: str, vocab_size: int, seed: int = 1) -> list[list[int]]:
    """Prompts of mixed lengths; the longest exceeds the Gemma sliding window several times; the MoE
    models' are longer, so that every expert of every sparse layer gets tokens."""
    generator = torch.Generator().manual_seed(seed)
    lengths = ([3, 11, 29] if arch == "gemma3" else [5, 23, 41] if arch in TINY_MOE_ARCHS + TINY_MLA_ARCHS
               else [3, 9, 17])
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture
def float32_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--dtype auto`` as a CPU without a native bf16 GEMM resolves it: the rest of a block-served
    model (activations, attention, KV cache, the dense copies) in float32. A test whose tolerance is
    the block routes' own 16-bit activation rounding then holds on every CPU; with AVX512-BF16 or AMX
    the rest runs in bf16, whose rounding is beyond it (1-14% of the logits' norm on the tiny random
    models, Zen 5)."""
    from servelm.model import loader
    from servelm.model.gguf import gguf_weights
    for module in (loader, gguf_weights):
        monkeypatch.setattr(module, "cpu_bf16_feature", lambda flags=None: None)
