"""--hf-overrides rope_theta / rope_scaling on Hugging Face directories under transformers 5,
checked against transformers given the same rope parameters (issue 11: they used to be dropped,
and rope_scaling raised a TypeError)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from servelm.config import ModelConfig
from servelm.model.forward_batch import BatchPlan
from servelm.model.source import resolve_model_source
from tests.tiny_models import make_tiny_model_dir

from .conftest import BlockAllocator, make_runner

PROMPT = [(11 * i + 5) % 300 + 1 for i in range(40)]

# (arch, --hf-overrides, the rope_parameters transformers 5 must be given for the same model)
CASES = [
    ("qwen2", {"rope_theta": 50.0}, {"rope_type": "default", "rope_theta": 50.0}),
    ("qwen2", {"rope_scaling": {"type": "linear", "factor": 4.0}},
     {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}),
    ("qwen2", {"rope_theta": 50.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
     {"rope_type": "linear", "factor": 4.0, "rope_theta": 50.0}),
    ("gemma3", {"rope_theta": 50.0, "rope_local_base_freq": 20.0},
     {"sliding_attention": {"rope_type": "default", "rope_theta": 20.0},
      "full_attention": {"rope_type": "default", "rope_theta": 50.0}}),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("overrides")
    return {arch: make_tiny_model_dir(root, arch) for arch in ("qwen2", "gemma3")}


def servelm_logits(path: Path, overrides: dict[str, Any] | None) -> torch.Tensor:
    config = ModelConfig(model=str(path), device="cpu", dtype="float32",
                         hf_overrides=json.dumps(overrides) if overrides else None)
    runner = make_runner(resolve_model_source(config))
    allocator = BlockAllocator(runner.num_blocks)
    return runner.execute(BatchPlan([allocator.plan(0, PROMPT, num_logits=len(PROMPT))]))


def transformers_logits(path: Path, rope_parameters: dict[str, Any]) -> torch.Tensor:
    config = transformers.AutoConfig.from_pretrained(path)
    config.rope_parameters = rope_parameters
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float()


@pytest.mark.parametrize("arch, overrides, rope_parameters", CASES)
def test_rope_override_matches_transformers(model_dirs: dict[str, Path], arch: str,
                                            overrides: dict[str, Any],
                                            rope_parameters: dict[str, Any]) -> None:
    path = model_dirs[arch]
    source = resolve_model_source(ModelConfig(model=str(path), load_format="dummy",
                                              hf_overrides=json.dumps(overrides)))
    assert source.hf_config.rope_parameters == rope_parameters
    ours = servelm_logits(path, overrides)
    torch.testing.assert_close(ours, transformers_logits(path, rope_parameters), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ours, servelm_logits(path, None), atol=1e-3), "the override had no effect"


def test_bad_rope_overrides_name_the_key(model_dirs: dict[str, Path]) -> None:
    for overrides, key in (({"rope_theta": "big"}, "rope_theta"), ({"rope_scaling": 2}, "rope_scaling"),
                           ({"rope_local_base_freq": 10.0}, "rope_local_base_freq")):
        config = ModelConfig(model=str(model_dirs["qwen2"]), load_format="dummy",
                             hf_overrides=json.dumps(overrides))
        with pytest.raises(ValueError, match=key):
            resolve_model_source(config)
