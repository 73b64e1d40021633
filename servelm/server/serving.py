"""What every endpoint shares: the engine handle, the served name, tokenization and prompt checks.

Invariants:
- Every prompt handed to the engine has passed ``ServingContext.fit_prompt``: non-empty, token ids inside the
  model's vocabulary, and prompt + max_tokens within the context (or truncated at the head or the
  center with --allow-auto-truncate / --long-truncation-mode), so a bad request fails here and never reaches a batch with others.
- Tokenizer work on long inputs runs on one worker thread (fast tokenizers are not safe to call
  from several threads at once), so the event loop keeps serving streams meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from servelm.config import EngineConfig
from servelm.engine.frontdoor import EngineClient
from servelm.errors import InvalidRequestError
from servelm.parsers.tool_templates import ToolParserChoice, choose_tool_parser
from servelm.server.chat import load_chat_template
from servelm.multimodal.inputs import ImageItem, MultimodalInputs
from servelm.server.errors import APIError
from servelm.multimodal.front_door import (ImageProcessor, ImageRef, MultimodalFrontDoor,
                                       load_image_processor)
from servelm.server.template_sandbox import TemplateSandbox

T = TypeVar("T")
logger = logging.getLogger(__name__)

_INLINE_TOKENIZE_CHARS = 4096
"""Shorter texts are tokenized on the event loop: a thread hop costs more than the work."""

LOGPROB_FLOOR = -9999.0
"""JSON has no -inf; a logprob of -inf (a masked token) is reported as this."""


@dataclass(slots=True)
class Prompt:
    """One prompt ready for the engine."""

    token_ids: list[int]
    text: str | None
    """The prompt text when the client sent text and it was not truncated (for echo)."""
    max_tokens: int
    """Resolved output budget: the request's max_tokens, or what is left of the context."""
    mm_inputs: MultimodalInputs | None = None
    """The prompt's images (``token_ids`` holds their placeholder tokens); None: text only."""


def require_prompt(prompt: str | list[Any], param: str) -> None:
    """The one empty-prompt rule: a prompt (text, token ids, or a list of prompts) has something in it."""
    if not prompt:
        raise InvalidRequestError("the prompt must not be empty", param)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def safe_logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


class ServingContext:
    """The engine plus everything derived once from the config and the model."""

    def __init__(self, engine: EngineClient, config: EngineConfig,
                 image_processor: ImageProcessor | None | Literal["load"] = "load") -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self._token_texts: dict[int, str] = {}
        """Token id -> its text in logprobs (``token_text``): an echo with logprobs shows ~6 tokens
        per prompt position, and a tokenizer's decode of one id costs tens of microseconds of the
        event loop every response waits on."""
        info = engine.model_info
        self.served_model_name = config.model.name
        self.context_length = info.context_length
        self.vocab_size = info.vocab_size or None
        self.kv_pool_tokens = info.kv_tokens_per_request or info.kv_pool_tokens or None
        """Tokens of K/V one request can hold (under DP attention one rank's pool), None: no check."""
        self._pool_words = ("the KV cache pool" if self.kv_pool_tokens == info.kv_pool_tokens else
                            "one DP-attention rank's KV cache pool (a request runs on one rank)")
        self.task = info.task
        """generate or embed: the engine serves one; routes of the other answer 400."""
        self.embedding_size = info.embedding_size or None
        self.pooler: dict[str, Any] = dict(info.pooler or {})
        self.max_embedding_tokens = info.max_embedding_tokens or self.context_length
        self.chat_template = load_chat_template(config.server.chat_template)
        self.tool_parser: ToolParserChoice = choose_tool_parser(
            self.chat_template or getattr(self.tokenizer, "chat_template", None),
            config.server.tool_call_parser, config.server.enable_auto_tool_choice)
        """The parser behind tool_choice "auto" (None: refused), chosen once (parsers/tool_templates)."""
        if self.tool_parser.parser is not None:
            logger.info("tool calls: tool_choice auto parsed as %s (%s)", self.tool_parser.parser,
                        self.tool_parser.reason)
        else:
            logger.info("tool calls: tool_choice auto refused (%s); --tool-call-parser sets a parser",
                        self.tool_parser.reason)
        self.accepted_model_names = {name for name in (
            *config.model.served_names, config.model.model, info.served_model_name,
            info.model_path) if name}
        if image_processor == "load":
            image_processor = load_image_processor(config, info.model_path or config.model.model,
                                                   self.tokenizer)
        self.multimodal = MultimodalFrontDoor(config, image_processor, self.served_model_name)
        """Whether and how requests may carry images (server/multimodal.py)."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servelm-tokenizer")
        self._template_sandbox: TemplateSandbox | None = None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._template_sandbox is not None:
            self._template_sandbox.close()

    def template_sandbox(self) -> TemplateSandbox:
        """The worker that renders request-supplied chat templates (started on first use)."""
        if self._template_sandbox is None:
            self._template_sandbox = TemplateSandbox()
        return self._template_sandbox

    async def run_on_tokenizer_thread(self, work: Callable[[], T]) -> T:
        """Run blocking tokenizer or template work on the tokenizer thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    # -- checks -------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name and name not in self.accepted_model_names:
            raise APIError(404, f"The model {name!r} does not exist; this server serves "
                                f"{self.served_model_name!r}", param="model", code="model_not_found")

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The LoRA adapters requests may name now (they change with load/unload)."""
        return list(self.engine.lora_adapters)

    def resolve_model(self, name: str | None) -> str | None:
        """The LoRA adapter an OpenAI ``model`` field asks for: None for the base model, the adapter
        for an adapter's name (vLLM) or ``base:adapter`` (SGLang); 404 for anything else."""
        if not name or name in self.accepted_model_names:
            return None
        names = {adapter["name"] for adapter in self.lora_adapters()}
        if name in names:
            return name
        base, sep, adapter = name.rpartition(":")
        if sep and base in self.accepted_model_names:
            if adapter in names:
                return adapter
            raise APIError(404, f"The LoRA adapter {adapter!r} is not loaded; loaded adapters: "
                                f"{sorted(names) or 'none'}", param="model", code="model_not_found")
        self.check_model(name)
        return None

    def resolve_lora_path(self, value: str | None, param: str) -> str | None:
        """SGLang's ``lora_path`` on /generate: an adapter's name (or the path it was loaded from)."""
        if value is None or value == "":
            return None
        for adapter in self.lora_adapters():
            if value in (adapter["name"], adapter.get("path")):
                return str(adapter["name"])
        raise APIError(404, f"The LoRA adapter {value!r} is not loaded", param=param,
                       code="model_not_found")

    def require_task(self, task: str, api: str) -> None:
        """400 when ``api`` needs the other task than the one this server runs (as vLLM does)."""
        if task == self.task:
            return
        how = ("it serves embeddings (--task embed); use /v1/embeddings" if self.task == "embed"
               else "start the server with --task embed (--is-embedding) to serve embeddings")
        raise InvalidRequestError(f"The model {self.served_model_name!r} does not support the {api} "
                                  f"API: {how}", "model", code="model_not_supported")

    def require_tokenizer(self, what: str, param: str) -> Any:
        if self.tokenizer is None:
            raise InvalidRequestError(f"{what} needs a tokenizer, but the server runs with "
                                      "--skip-tokenizer-init; send token ids instead", param)
        return self.tokenizer

    def check_num_sequences(self, num_sequences: int, param: str = "n",
                            what: str = "prompts x n") -> None:
        """400 when one request would create more sequences (prompts x n, or embedding inputs)
        than allowed."""
        limit = self.config.server.max_sequences_per_request
        if num_sequences > limit:
            raise InvalidRequestError(
                f"this request would create {num_sequences} sequences ({what}); the server "
                f"allows at most {limit} per request (--max-sequences-per-request)", param)

    def check_stop(self, stop: str | list[str] | None, stop_token_ids: list[int] | None,
                   param: str = "stop", token_ids_param: str | None = "stop_token_ids") -> None:
        """Stop strings are matched in decoded text, so they need a tokenizer; stop token ids must
        be in the vocabulary. The one place for both rules: every route calls this
        (``token_ids_param`` None: the API has no stop token ids)."""
        if stop and self.tokenizer is None:
            hint = f"; use {token_ids_param}" if token_ids_param is not None else ""
            raise InvalidRequestError("stop strings need a tokenizer (the server runs with "
                                      f"--skip-tokenizer-init){hint}", param)
        if token_ids_param is not None:
            self.check_token_ids(list(stop_token_ids or []), token_ids_param)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        upper = self.vocab_size
        for token_id in token_ids:
            if token_id < 0 or (upper is not None and token_id >= upper):
                raise InvalidRequestError(f"{param}: token id {token_id} is outside the vocabulary "
                                          f"[0, {upper})", param)

    # -- tokenizer ----------------------------------------------------------------------------
    async def encode(self, text: str, *, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        tokenizer = self.require_tokenizer("a text prompt", param)
        if len(text) < _INLINE_TOKENIZE_CHARS:
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(
            self._executor, lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(ids)

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def logprob_token(self, token_id: int) -> str:
        """A token as OpenAI logprobs show it: its text, or ``token_id:ID`` with
        --return-tokens-as-token-ids."""
        if self.config.server.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return self.token_text(token_id)

    def token_text(self, token_id: int) -> str:
        """Readable text of one token, as shown in logprobs."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = str(self.tokenizer.decode([token_id], skip_special_tokens=False))
        return text

    # -- prompts ------------------------------------------------------------------------------
    def fit_prompt(self, token_ids: list[int], text: str | None, max_tokens: int | None,
                   param: str = "prompt", *, is_default_max_tokens: bool = False,
                   mm_inputs: MultimodalInputs | None = None) -> Prompt:
        """Check a tokenized prompt against the vocabulary and the context (see module invariants).

        A default ``max_tokens`` (one the client did not send) is capped at what the context
        leaves; a value the client sent is never changed. A prompt with images (``mm_inputs``,
        whose ids are ``token_ids``) is never truncated: that would cut an image's tokens.
        """
        if is_default_max_tokens and max_tokens is not None:
            fitted = self.fit_prompt(token_ids, text, None, param, mm_inputs=mm_inputs)
            return Prompt(fitted.token_ids, fitted.text, min(max_tokens, fitted.max_tokens),
                          mm_inputs)
        require_prompt(token_ids, param)
        self.check_token_ids(token_ids, param)
        context = self.context_length
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        budget = context - (max_tokens if max_tokens is not None else 1)
        if len(token_ids) > budget:
            if max_tokens is not None and max_tokens >= context:
                raise InvalidRequestError(
                    f"max_tokens ({max_tokens}) must be smaller than the model's context length "
                    f"({context})", "max_tokens", code="context_length_exceeded")
            mode = self.config.server.truncation_mode if mm_inputs is None else None
            if mode is None:
                asked = f" + max_tokens {max_tokens}" if max_tokens is not None else ""
                raise InvalidRequestError(
                    f"This model's maximum context length is {context} tokens; the prompt has "
                    f"{len(token_ids)} tokens{asked}, leaving no room for output. Shorten the "
                    "prompt or lower max_tokens.", param, code="context_length_exceeded")
            if mode == "center":  # keep the start (instructions) and the end (the question)
                head = budget // 2
                token_ids = token_ids[:head] + token_ids[len(token_ids) - (budget - head):]
            else:
                token_ids = token_ids[-budget:]
            text = None
        resolved = max_tokens if max_tokens is not None else context - len(token_ids)
        resolved = self._fit_pool(len(token_ids), resolved, max_tokens is not None, param)
        return Prompt(token_ids=token_ids, text=text, max_tokens=resolved, mm_inputs=mm_inputs)

    def _fit_pool(self, num_prompt_tokens: int, max_tokens: int, is_given: bool, param: str) -> int:
        """A request must fit the KV pool alone (prompt + max_tokens - 1 positions hold K/V):
        one that never can is refused here with a 400. A default max_tokens is capped instead."""
        pool = self.kv_pool_tokens
        if pool is None:
            return max_tokens
        if num_prompt_tokens + 1 > pool:
            raise InvalidRequestError(
                f"the prompt has {num_prompt_tokens} tokens but {self._pool_words} holds only {pool} "
                "(--max-total-tokens): it can never be served", param, code="context_length_exceeded")
        if num_prompt_tokens + max_tokens - 1 <= pool:
            return max_tokens
        if not is_given:
            return pool - num_prompt_tokens + 1
        raise InvalidRequestError(
            f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) needs more KV cache "
            f"than {self._pool_words} holds ({pool} tokens, --max-total-tokens): lower max_tokens to at most "
            f"{pool - num_prompt_tokens + 1}", "max_tokens", code="context_length_exceeded")

    def request_priority(self, priority: int | None) -> int:
        """The engine priority of a request; 400 when priority scheduling is off."""
        if priority is None:
            return 0
        if not self.config.scheduler.is_priority_scheduling:
            raise InvalidRequestError(
                "priority is set but priority scheduling is off (start the server with "
                "--enable-priority-scheduling or --scheduling-policy priority)", "priority")
        return priority

    async def prompt_from_text(self, text: str, max_tokens: int | None, *, add_special_tokens: bool,
                               param: str = "prompt", is_default_max_tokens: bool = False,
                               images: list[ImageRef] | None = None) -> Prompt:
        """A text prompt, tokenized and checked; with ``images``, their markers expanded by the
        model's image processor first (so the checks count image tokens)."""
        require_prompt(text, param)
        self.multimodal.check(images or [])
        loaded = await self.multimodal.load(images) if images else []
        expanded = await self.multimodal.expand_text(text, loaded)
        token_ids = await self.encode(expanded, add_special_tokens=add_special_tokens, param=param)
        return await self.prompt_from_ids(token_ids, text, max_tokens, param=param,
                                          is_default_max_tokens=is_default_max_tokens,
                                          images=loaded)

    async def prompt_from_ids(self, token_ids: list[int], text: str | None, max_tokens: int | None,
                              *, param: str = "prompt", is_default_max_tokens: bool = False,
                              images: list[ImageItem] | None = None) -> Prompt:
        """``fit_prompt``, after the image processor has expanded the images' markers."""
        mm_inputs = None
        if images:
            mm_inputs = await self.multimodal.expand(token_ids, images, param)
            token_ids = mm_inputs.prompt_token_ids
        return self.fit_prompt(token_ids, text, max_tokens, param,
                               is_default_max_tokens=is_default_max_tokens, mm_inputs=mm_inputs)
