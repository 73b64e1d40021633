"""Images with tensor and pipeline parallelism and prefill/decode disaggregation, on tiny random
VLMs (float32): --tp-size 2 (rank 1 a real process, gloo collectives) and --pp-size 2 (the first
stage a real process) give the one-rank engine's greedy tokens with 0, 1 and 2 images in one
batch (Gemma 3: the image block mask on every rank's heads and stage's layers); a
prefill and a decode engine (K/V over real zmq sockets) give one engine's greedy tokens for
requests with images, the decode side's prefix cache keyed by the image (same text with another
image: its blocks are pulled, not shared), and Qwen2-VL's M-RoPE offsets carried into decode on
the decode side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("PIL")

from servelm.config import (CacheConfig, DisaggregationConfig, EngineConfig, ModelConfig,  # noqa: E402
                            ParallelConfig, RuntimeConfig)
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.multimodal.inputs import MultimodalInputs  # noqa: E402
from servelm.multimodal.processor import get_processor, image_item  # noqa: E402
from servelm.sampling.params import SamplingParams  # noqa: E402
from tests.e2e.server_process import free_port  # noqa: E402
from tests.e2e.test_disaggregation_tiny import assert_idle  # noqa: E402
from tests.tiny_models import (TINY_QWEN2_VL_END, TINY_QWEN2_VL_IMAGE, TINY_QWEN2_VL_START,  # noqa: E402
                               TINY_VLM_BOI, TINY_VLM_NEWLINES, make_tiny_qwen2_vl_dir, make_tiny_vlm_dir,
                               random_image)

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
TEXT = [21, 22, 23, 24, 25, 26, 27]


def vlm(tmp_path: Path, family: str) -> tuple[Path, Any, list[int]]:
    """The tiny VLM's folder, its processor and the token ids that name one image."""
    if family == "gemma3":
        path = make_tiny_vlm_dir(tmp_path)
        processor = get_processor(str(path))
        processor.newline_ids = [TINY_VLM_NEWLINES]
        return path, processor, [TINY_VLM_BOI]
    path = make_tiny_qwen2_vl_dir(tmp_path)
    return path, get_processor(str(path)), [TINY_QWEN2_VL_START, TINY_QWEN2_VL_IMAGE, TINY_QWEN2_VL_END]


def requests(processor: Any, marker: list[int]) -> dict[str, MultimodalInputs]:
    first, second = image_item(random_image(1, 40, 56)), image_item(random_image(2, 30, 22))
    return {"one": processor.process(TEXT + marker + [30, 31], [first]),
            "other": processor.process(TEXT + marker + [30, 31], [second]),
            "two": processor.process(TEXT[:3] + marker + [40] + marker + [41, 42], [second, first]),
            "text": processor.process(TEXT + [50, 51], [])}


def engine(path: Path, **sections: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="float32"),
                                  cache=CacheConfig(max_total_tokens=1024, page_size=4),
                                  runtime=RuntimeConfig(num_threads=1), **sections))


def scored(target: LLMEngine, batch: dict[str, MultimodalInputs]) -> dict[str, list[tuple[int, float]]]:
    """Each request's greedy (token, logprob) pairs."""
    for request_id, inputs in batch.items():
        assert target.add_request(request_id, inputs.prompt_token_ids, PARAMS, mm_inputs=inputs) is None
    steps: dict[str, list[tuple[int, float]]] = {request_id: [] for request_id in batch}
    while target.has_unfinished():
        for output in target.step():
            assert output.error is None, output.error
            assert output.logprobs is not None
            steps[output.request_id].extend((entry.token_id, entry.logprob) for entry in output.logprobs)
    return steps


def greedy(target: LLMEngine, batch: dict[str, MultimodalInputs]) -> dict[str, list[int]]:
    return {request_id: [token for token, _ in pairs] for request_id, pairs in scored(target, batch).items()}


def one_engine(path: Path, batch: dict[str, MultimodalInputs]) -> dict[str, list[int]]:
    """The batch's greedy tokens from one co-located, one-rank engine (the reference)."""
    single = engine(path)
    try:
        return greedy(single, batch)
    finally:
        single.shutdown()


@pytest.mark.slow   # a rank process and two engines: ~50 s on the loaded 2-core build machine
def test_tp2_images_equal_one_rank(tmp_path: Path) -> None:
    path, processor, marker = vlm(tmp_path, "gemma3")
    batch = requests(processor, marker)
    expected = one_engine(path, batch)
    assert len({tuple(tokens) for tokens in expected.values()}) > 1   # the images change the answer
    tp2 = engine(path, parallel=ParallelConfig(tensor_parallel_size=2))
    try:
        assert greedy(tp2, batch) == expected
    finally:
        tp2.shutdown()


@pytest.mark.slow   # a stage process and two engines: ~16 s each on the loaded 2-core build machine
@pytest.mark.parametrize("family", ["gemma3", "qwen2_vl"])
def test_pp2_images_equal_one_stage(tmp_path: Path, family: str) -> None:
    """--pp-size 2 (the first stage a real process: it encodes the images; the engine's last stage
    gets hidden states, the image block mask and Qwen2-VL's M-RoPE positions from the plan)."""
    path, processor, marker = vlm(tmp_path, family)
    batch = requests(processor, marker)
    single = engine(path)
    try:
        expected = scored(single, batch)
    finally:
        single.shutdown()
    pp2 = engine(path, parallel=ParallelConfig(pipeline_parallel_size=2))
    try:
        got = scored(pp2, batch)
    finally:
        pp2.shutdown()
    for request_id, pairs in expected.items():
        assert [token for token, _ in got[request_id]] == [token for token, _ in pairs], request_id
        assert [logprob for _, logprob in got[request_id]] == pytest.approx([logprob for _, logprob in pairs],
                                                                            abs=1e-4), request_id


def disaggregated(path: Path, batch: dict[str, MultimodalInputs]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Each request through a prefill and a decode engine, one after another (so the decode side's
    prefix cache holds the earlier ones); tokens and prompt tokens sent per request."""
    port = free_port()
    prefill = engine(path, disaggregation=DisaggregationConfig(disaggregation_mode="prefill",
                                                               disaggregation_bootstrap_port=port))
    decode = engine(path, disaggregation=DisaggregationConfig(disaggregation_mode="decode"))
    from servelm.disagg.spec import KVTransfer
    tokens: dict[str, list[int]] = {}
    sent: dict[str, int] = {}
    try:
        for index, (request_id, inputs) in enumerate(batch.items()):
            key = f"{2000 + index}/0"
            assert prefill.add_request(request_id, inputs.prompt_token_ids, PARAMS, mm_inputs=inputs,
                                       kv_transfer=KVTransfer("prefill", key)) is None
            assert decode.add_request(request_id, inputs.prompt_token_ids, PARAMS, mm_inputs=inputs,
                                      kv_transfer=KVTransfer("decode", key, "127.0.0.1", port)) is None
            tokens[request_id] = []
            while decode.has_unfinished():
                prefill.step()
                for output in decode.step():
                    assert output.error is None, output.error
                    tokens[request_id].extend(output.new_token_ids)
            sent[request_id] = prefill.stats()["disaggregation_tokens_sent"] - sum(sent.values())
        prefill.step()
        assert_idle(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()
    return tokens, sent


@pytest.mark.parametrize("family", ["gemma3", "qwen2_vl"])
def test_prefill_decode_with_images_equals_one_engine(tmp_path: Path, family: str) -> None:
    path, processor, marker = vlm(tmp_path, family)
    batch = requests(processor, marker)
    expected = one_engine(path, batch)
    tokens, sent = disaggregated(path, batch)
    assert tokens == expected
    # "other" has "one"'s text (Gemma 3: its very token ids): on the decode side it shares only
    # the blocks before its image (another image), the rest is pulled
    one, other = batch["one"], batch["other"]
    assert sent["one"] == len(one.prompt_token_ids)
    assert sent["other"] == len(other.prompt_token_ids) - other.images[0].offset // 4 * 4
