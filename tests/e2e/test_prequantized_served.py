"""A served pre-quantized checkpoint answers the openai client (issue 34): a tiny GPTQ directory
(desc_act, asymmetric, written to the published layout by tests/prequantized_checkpoints.py) with a
real tokenizer and chat template, served by ``servelm serve DIR``; the chat completion's greedy
tokens equal the dequantized reference's (transformers, float32), streamed and not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.prequantized_checkpoints import make_quant_hf_model, reference_model, write_gptq
from tests.tiny_models import write_tiny_vlm_tokenizer

from .server_process import ServerProcess

openai = pytest.importorskip("openai")

MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Pack int4 weights, please."}]


def token_ids(logprobs: list[object]) -> list[int]:
    """Token ids from OpenAI logprobs entries shown as ``token_id:ID``."""
    return [int(str(entry.token).removeprefix("token_id:")) for entry in logprobs]  # type: ignore[attr-defined]


def test_served_gptq_chat_equals_the_dequantized_reference(tmp_path: Path) -> None:
    path = tmp_path / "gptq"
    model = make_quant_hf_model("qwen2")
    reference = reference_model(model, write_gptq(path, model, 4, 32, sym=False, desc_act=True))
    write_tiny_vlm_tokenizer(path)   # a byte-level BPE tokenizer with a chat template, vocab 320
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    # --dtype float32: the exact dequantized weights (the block routes round activations to 16 bits)
    args = [str(path), "--dtype", "float32", "--return-tokens-as-token-ids", "--max-total-tokens", "1024"]
    with ServerProcess(args) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        request = dict(model=str(path), messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS, logprobs=True,
                       extra_body={"ignore_eos": True})
        reply = client.chat.completions.create(**request)
        chunks = list(client.chat.completions.create(**request, stream=True))
        log = server.log(None)
    assert "quantization gptq" in log and "GPTQ int4, group 32, asym, desc_act" in log
    assert reply.usage.prompt_tokens == len(prompt)
    assert token_ids(reply.choices[0].logprobs.content) == expected
    assert reply.choices[0].message.content == tokenizer.decode(expected)
    streamed = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert token_ids(streamed) == expected
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == \
        reply.choices[0].message.content
