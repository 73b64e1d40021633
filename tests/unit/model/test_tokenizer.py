"""load_tokenizer: GGUF tokenizers converted once and cached; chat template kept; skip."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from servelm.config import ModelConfig
from servelm.model.packaged import PackagedModelError, packaged_model_path
from servelm.model.tokenizer import load_tokenizer, tokenizer_cache_path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the module: the first test converts SmolLM2's tokenizer into it (8 s on
    2 cores), the --tokenizer test reads it from there."""
    return tmp_path_factory.mktemp("tokenizer-cache")


def test_skip_tokenizer_init() -> None:
    assert load_tokenizer(ModelConfig(model="does-not-matter", skip_tokenizer_init=True)) is None


def test_smollm2_gguf_tokenizer_cached(cache_dir: Path) -> None:
    try:
        gguf_path = packaged_model_path("smollm2-135m")
    except PackagedModelError as e:
        pytest.skip(str(e))
    config = ModelConfig(model="smollm2-135m")
    first = load_tokenizer(config, cache_dir=cache_dir)
    assert tokenizer_cache_path(gguf_path, cache_dir / "tokenizers").is_dir()
    start = time.perf_counter()
    second = load_tokenizer(config, cache_dir=cache_dir)
    assert time.perf_counter() - start < 5.0  # measured ~0.4 s; generous for a busy 2-core host
    assert first is not None and second is not None
    text = "Hello world! <|im_start|>user\nhi<|im_end|>"
    assert first.encode(text) == second.encode(text)
    assert second.convert_tokens_to_ids("<|im_end|>") == 2
    assert second.chat_template and "<|im_start|>" in second.chat_template
    rendered = second.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                          add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")


def test_tokenizer_flag_with_gguf_file(cache_dir: Path) -> None:
    try:
        gguf_path = packaged_model_path("smollm2-135m")
    except PackagedModelError as e:
        pytest.skip(str(e))
    tokenizer = load_tokenizer(ModelConfig(model="unused/hub-id", tokenizer=str(gguf_path)), cache_dir=cache_dir)
    assert tokenizer is not None and tokenizer.eos_token == "<|im_end|>"
