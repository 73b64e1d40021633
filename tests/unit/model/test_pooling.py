"""Pooling math, the pooler config (sentence-transformers files, overrides) and task resolution."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from servelm.model.pooling import (PoolerConfig, parse_pooler_override, pool, resolve_pooler_config,
                                   resolve_task)

BERT = SimpleNamespace(architectures=["BertModel"], model_type="bert")
LLAMA = SimpleNamespace(architectures=["LlamaForCausalLM"], model_type="llama")


def test_pool_last_mean_cls_and_normalize() -> None:
    hidden = torch.arange(24, dtype=torch.float32).view(6, 4)  # sequences of 2, 3 and 1 rows
    lens = [2, 3, 1]
    last = pool(hidden, lens, PoolerConfig("last", normalize=False))
    torch.testing.assert_close(last, hidden[[1, 4, 5]])
    cls = pool(hidden, lens, PoolerConfig("cls", normalize=False))
    torch.testing.assert_close(cls, hidden[[0, 2, 5]])
    mean = pool(hidden, lens, PoolerConfig("mean", normalize=False))
    expected = torch.stack([hidden[0:2].mean(0), hidden[2:5].mean(0), hidden[5]])
    torch.testing.assert_close(mean, expected)
    normalized = pool(hidden.half(), lens, PoolerConfig("mean", normalize=True))
    assert normalized.dtype == torch.float32
    torch.testing.assert_close(normalized, F.normalize(expected, dim=-1), atol=1e-3, rtol=1e-3)


def write_sentence_transformers(path: Path, pooling: dict[str, bool], normalize: bool,
                                extra: list[dict[str, str]] | None = None) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    modules += extra or []
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 8, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False, **pooling}))


def test_pooler_defaults_and_sentence_transformers_files(tmp_path: Path) -> None:
    assert resolve_pooler_config("", BERT, None) == PoolerConfig("mean", True)
    assert resolve_pooler_config("/no/such/model.gguf", LLAMA, None) == PoolerConfig("last", True)
    write_sentence_transformers(tmp_path, {"pooling_mode_cls_token": True}, normalize=False)
    assert resolve_pooler_config(str(tmp_path), BERT, None) == PoolerConfig("cls", False)
    override = '{"pooling_type": "MEAN", "normalize": true}'
    assert resolve_pooler_config(str(tmp_path), BERT, override) == PoolerConfig("mean", True)
    matryoshka = resolve_pooler_config(str(tmp_path), BERT, '{"matryoshka_dimensions": [4, 8]}')
    assert matryoshka.allows_dimensions(4, 8) and not matryoshka.allows_dimensions(5, 8)
    assert not PoolerConfig("mean", True).allows_dimensions(4, 8)


@pytest.mark.parametrize("pooling, extra, message", [
    ({"pooling_mode_max_tokens": True}, None, "pooling_mode_max_tokens"),
    ({"pooling_mode_mean_tokens": True}, [{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
     "Dense"),
])
def test_unsupported_sentence_transformers_pipelines(tmp_path: Path, pooling: dict[str, bool],
                                                     extra: list[dict[str, str]] | None,
                                                     message: str) -> None:
    write_sentence_transformers(tmp_path, pooling, normalize=True, extra=extra)
    with pytest.raises(ValueError, match=message):
        resolve_pooler_config(str(tmp_path), BERT, None)


@pytest.mark.parametrize("text, message", [
    ("[1]", "JSON object"), ("{", "not valid JSON"), ('{"softmax": true}', "softmax"),
    ('{"pooling_type": "max"}', "max"), ('{"normalize": 1}', "true or false"),
    ('{"matryoshka_dimensions": [0]}', "positive"),
])
def test_bad_pooler_overrides(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_pooler_override(text)


def test_task_resolution() -> None:
    assert resolve_task("auto", BERT) == "embed" and resolve_task("auto", LLAMA) == "generate"
    assert resolve_task("embedding", LLAMA) == "embed" and resolve_task("embed", BERT) == "embed"
    with pytest.raises(ValueError, match="encoder-only"):
        resolve_task("generate", BERT)
    with pytest.raises(ValueError, match="not supported"):
        resolve_task("classify", LLAMA)
