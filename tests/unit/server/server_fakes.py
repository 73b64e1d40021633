"""Server test helpers: a tiny real tokenizer, a scripted fake AsyncEngine, SSE parsing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelm.config import EngineConfig, ModelConfig, ServerConfig
from servelm.disagg.spec import KVTransfer
from servelm.engine.frontdoor import ModelInfo
from servelm.engine.outputs import RequestOutput, TokenLogprob
from servelm.sampling.params import SamplingParams

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONTEXT_LENGTH = 64
MODEL_NAME = "tiny-model"
EOS_ID = 258  # <|im_end|>


def build_tokenizer(directory: Path, chat_template: str | None) -> Any:
    """A byte-level BPE tokenizer with no merges: one token per byte, exact round trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


@dataclass
class FakeEngine:
    """Scripted stand-in for AsyncEngine: replies with ``reply(prompt_ids, params)``, one token per step.

    Finishes with "length" at max_tokens, else with an extra EOS output ("stop"). Records every
    request and which generators were closed before finishing (= aborted by the consumer).
    """

    tokenizer: Any
    context_length: int = CONTEXT_LENGTH
    reply: Callable[[list[int], SamplingParams], str] = \
        lambda prompt, params: "Hi there" + (f" #{params.seed}" if params.seed is not None else "")
    error: str | None = None
    hang_after: int | None = None
    """Block forever after this many outputs (to test disconnects)."""
    num_cached_tokens: int = 0
    requests: list[tuple[str, list[int], SamplingParams]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    priorities: list[int] = field(default_factory=list)
    error_status: int | None = None
    """With ``error``: the status the engine gives a request it refuses up front."""
    flushes: int = 0
    finished: list[str] = field(default_factory=list)
    healthy: bool = True
    is_alive: bool = True
    lora_adapters: list[dict[str, Any]] = field(default_factory=list)

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(model_path="/models/tiny", served_model_name=MODEL_NAME,
                         context_length=self.context_length, vocab_size=300, eos_token_ids=(EOS_ID,),
                         architecture="FakeForCausalLM", num_blocks=8, block_size=16)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return [ord(c) % 256 for c in text]
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, token_id: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id])

    @staticmethod
    def _logprob(token_id: int, value: float, k: int) -> TokenLogprob:
        top = [(token_id, value)] + [((token_id + j) % 256, value - j) for j in range(1, k)]
        return TokenLogprob(token_id=token_id, logprob=value, top=top[:k])

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0, group: str = "",
                       lora_name: str | None = None,
                       kv_transfer: KVTransfer | None = None) -> AsyncIterator[RequestOutput]:
        self.requests.append((request_id, list(prompt_token_ids), params))
        self.priorities.append(priority)
        is_finished = False
        try:
            await asyncio.sleep(0)
            if self.error is not None:
                is_finished = True
                yield RequestOutput(request_id, [], "", finish_reason="error", error=self.error,
                                    num_prompt_tokens=len(prompt_token_ids),
                                    error_status=self.error_status)
                return
            tokens = self._encode(self.reply(prompt_token_ids, params))
            limit = params.max_tokens if params.max_tokens is not None else 10**9
            steps = [(t, None) for t in tokens[:limit]]
            if len(tokens) < limit:
                steps.append((EOS_ID, "stop"))
            elif steps:
                steps[-1] = (steps[-1][0], "length")
            hang_after = self.hang_after_for(prompt_token_ids)
            for position, (token_id, finish) in enumerate(steps):
                if hang_after is not None and position >= hang_after:
                    await asyncio.Event().wait()
                output = RequestOutput(
                    request_id, [token_id], "" if token_id == EOS_ID else self._decode(token_id),
                    finish_reason=finish, stop_reason=EOS_ID if finish == "stop" else None,
                    num_prompt_tokens=len(prompt_token_ids), num_output_tokens=position + 1,
                    num_cached_tokens=self.num_cached_tokens)
                if params.logprobs is not None:
                    output.logprobs = [self._logprob(token_id, -0.25, params.logprobs)]
                if position == 0 and params.prompt_logprobs is not None:
                    output.prompt_logprobs = [None] + [
                        self._logprob(t, -2.0, params.prompt_logprobs) for t in prompt_token_ids[1:]]
                is_finished = finish is not None
                yield output
                await asyncio.sleep(0)
        finally:
            (self.finished if is_finished else self.aborted).append(request_id)

    def hang_after_for(self, prompt_token_ids: list[int]) -> int | None:
        return self.hang_after

    async def encode(self, request_id: str, prompt_token_ids: list[int],
                     priority: int = 0) -> RequestOutput:
        raise AssertionError("a generation engine is never asked for an embedding")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        return {"success": False, "status": 400, "message": "LoRA is not enabled"}

    async def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        return {"success": False, "status": 400, "message": "LoRA is not enabled"}

    async def get_server_info(self) -> dict[str, Any]:
        return {"num_running": 0, "num_waiting": 0, "num_used_blocks": 0, "num_free_blocks": 8,
                "kv_pool_tokens": 128, "token_usage": 0.0}

    async def health_generate(self) -> bool:
        return self.healthy

    async def expert_distribution(self, action: str) -> dict[str, Any]:
        """The engine's answer through engine/expert_stage.py, with no recorder."""
        from servelm.engine.expert_stage import expert_distribution_call

        return expert_distribution_call(None, action)

    async def flush_cache(self) -> dict[str, Any]:
        self.flushes += 1
        if self.requests and len(self.finished) + len(self.aborted) < len(self.requests):
            return {"success": False, "message": "cannot flush the cache while requests are running"}
        return {"success": True, "message": "cache flushed"}

    async def shutdown(self) -> None:
        pass


def make_config(**server: Any) -> EngineConfig:
    model = server.pop("model", {})
    return EngineConfig(model=ModelConfig(model="/models/tiny", served_model_name=[MODEL_NAME], **model),
                        server=ServerConfig(**server))


def sse_events(response: Any) -> list[Any]:
    """Parse an SSE body into JSON objects, checking the framing and the final [DONE]."""
    import json

    body = response.text
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = [block for block in body.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in events)
    return [json.loads(block[6:]) for block in events[:-1]]

