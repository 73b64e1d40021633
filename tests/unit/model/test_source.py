"""resolve_model_source: GGUF, packaged names, HF directories, dummy, overrides, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from servelm.config import ModelConfig
from servelm.model.packaged import PackagedModelError
from servelm.model.source import ModelSourceError, resolve_model_source


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         eos_token_id=3)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="20KB")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 5]}))
    return path


def test_hf_dir_sharded_safetensors(tiny_hf_dir: Path) -> None:
    from transformers import LlamaForCausalLM
    assert len(list(tiny_hf_dir.glob("*.safetensors"))) > 1
    source = resolve_model_source(ModelConfig(model=str(tiny_hf_dir)))
    assert source.context_length == 256 and source.eos_token_ids == [3, 5]
    assert source.weights is not None and "safetensors" in source.description
    reference = LlamaForCausalLM.from_pretrained(tiny_hf_dir).state_dict()
    weights = dict(source.weights())
    assert set(weights) <= set(reference)
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name


def test_hf_dir_pt_bins(tmp_path: Path, tiny_hf_dir: Path) -> None:
    from safetensors.torch import load_file
    state = {}
    for file in tiny_hf_dir.glob("*.safetensors"):
        state.update(load_file(file))
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((tiny_hf_dir / "config.json").read_text())
    source = resolve_model_source(ModelConfig(model=str(tmp_path), load_format="pt"))
    assert source.weights is not None
    assert {n: t.shape for n, t in source.weights()} == {n: t.shape for n, t in state.items()}


def test_dummy_overrides_and_context(tiny_hf_dir: Path) -> None:
    config = ModelConfig(model=str(tiny_hf_dir), load_format="dummy", context_length=100,
                         hf_overrides='{"rms_norm_eps": 0.001}')
    source = resolve_model_source(config)
    assert source.weights is None and source.context_length == 100
    assert source.hf_config.rms_norm_eps == 0.001
    with pytest.raises(ValueError, match="exceeds the maximum"):
        resolve_model_source(ModelConfig(model=str(tiny_hf_dir), context_length=257))


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="no such file"):
        resolve_model_source(ModelConfig(model=str(tmp_path / "missing.gguf")))
    with pytest.raises(ModelSourceError, match=r"hub id.*--revision noted.*qwen2.5-coder-0.5b"):
        resolve_model_source(ModelConfig(model="Qwen/Qwen2.5-0.5B", revision="main"),
                             hub_cache_dir=tmp_path)
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve_model_source(ModelConfig(model=str(tmp_path)))


def test_hub_id_found_in_local_cache(tmp_path: Path, tiny_hf_dir: Path) -> None:
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((tiny_hf_dir / "config.json").read_text())
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc123")
    source = resolve_model_source(ModelConfig(model="org/tiny", load_format="dummy"), hub_cache_dir=tmp_path)
    assert source.model_path == str(snapshot)


def test_packaged_smollm2_gguf() -> None:
    try:
        source = resolve_model_source(ModelConfig(model="smollm2-135m", load_format="dummy"))
    except PackagedModelError as e:
        pytest.skip(str(e))
    assert source.hf_config.model_type == "llama" and source.hf_config.num_hidden_layers == 30
    assert source.context_length == 8192 and source.eos_token_ids == [2]
    assert source.weights is None and source.description.startswith("smollm2-135m (GGUF Q4_1, ")
    assert source.tokenizer_path is not None and source.tokenizer_path.endswith(".gguf")
    with pytest.raises(ModelSourceError, match="does not match"):
        resolve_model_source(ModelConfig(model="smollm2-135m", load_format="safetensors"))
    skipped = resolve_model_source(ModelConfig(model="smollm2-135m", load_format="dummy",
                                               skip_tokenizer_init=True))
    assert skipped.tokenizer_path is None


def test_packaged_qwen_eos_includes_endoftext() -> None:
    try:
        source = resolve_model_source(ModelConfig(model="qwen2.5-coder-0.5b", load_format="dummy"))
    except PackagedModelError as e:
        pytest.skip(str(e))
    assert source.eos_token_ids == [151645, 151643]  # <|im_end|>, <|endoftext|>
    assert source.context_length == 32768 and source.hf_config.tie_word_embeddings is False


def test_hub_options_on_a_local_or_packaged_model_are_refused(tiny_hf_dir: Path) -> None:
    for model in (str(tiny_hf_dir), "smollm2-135m"):
        for option in ({"revision": "main"}, {"download_dir": "/tmp/hub"}):
            flag = "--" + next(iter(option)).replace("_", "-")
            with pytest.raises(ModelSourceError, match=f"{flag} .* has no effect"):
                resolve_model_source(ModelConfig(model=model, load_format="dummy", **option))
