"""SGLang's native /generate and vLLM's /tokenize, /detokenize and /tokenizer_info.

/generate answers ``{"text", "output_ids", "meta_info"}`` per prompt (a list for a batch or n > 1);
streamed chunks carry the cumulative text and ids so far (SGLang's default; with --stream-output
only what is new since the previous chunk), plus ``index`` when there are several outputs.
``image_data`` gives the prompts' images (the text carries the model's image marker for each);
``meta_info.prompt_tokens`` counts their placeholder tokens.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from servelm.engine.outputs import RequestOutput, TokenLogprob
from servelm.errors import EngineRequestError, InvalidRequestError
from servelm.server.errors import APIError, api_error_from, error_body
from servelm.server.openai_serving import SSE_HEADERS, open_stream, render_chat_request
from servelm.server.structured import native_structured_spec
from servelm.server.structured import validate as validate_structured
from servelm.server.protocol import (DetokenizeRequest, GenerateRequest, NativeSamplingParams,
                                     TokenizeRequest, check_native_supported, choice_seed,
                                     native_to_sampling_params, requested_max_tokens)
from servelm.server.serving import Prompt, ServingContext, new_id, safe_logprob
from servelm.server.disagg import attach_transfers
from servelm.multimodal.front_door import ImageRef
from servelm.server.streaming import SSE_DONE, ClientDisconnected, Submission, sse, stream_outputs


class _NativeOutput:
    """Accumulated output of one /generate request, in SGLang's response shape."""

    def __init__(self, ctx: ServingContext, request_id: str, prompt: Prompt, request: GenerateRequest,
                 start_s: float) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.prompt = prompt
        self.request = request
        self.start_s = start_s
        self.text = ""
        self.output_ids: list[int] = []
        self.output_logprobs: list[list[Any]] = []
        self.output_top: list[list[list[Any]]] = []
        self.input_logprobs: list[list[Any]] = []
        self.input_top: list[list[list[Any]]] = []
        self.cached_tokens = 0
        self.finish_reason: dict[str, Any] | None = None
        self.num_sent = (0, 0, 0)
        """--stream-output: (text characters, output ids, output logprobs) already streamed."""

    def _triple(self, logprob: float | None, token_id: int) -> list[Any]:
        text = self.ctx.token_text(token_id) if self.request.return_text_in_logprobs else None
        return [None if logprob is None else safe_logprob(logprob), token_id, text]

    def _top(self, entry: TokenLogprob | None) -> list[list[Any]]:
        if entry is None:
            return []
        return [self._triple(lp, tid) for tid, lp in entry.top[:self.request.top_logprobs_num]]

    def add(self, output: RequestOutput) -> None:
        self.text += output.new_text
        self.output_ids.extend(output.new_token_ids)
        self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
        if self.request.return_logprob:
            for token_id, entry in zip(output.new_token_ids, output.logprobs or []):
                self.output_logprobs.append(self._triple(entry.logprob, token_id))
                self.output_top.append(self._top(entry))
            if output.prompt_logprobs is not None and self.request.logprob_start_len >= 0:
                start = self.request.logprob_start_len
                for token_id, entry in list(zip(self.prompt.token_ids, output.prompt_logprobs))[start:]:
                    self.input_logprobs.append(self._triple(entry.logprob if entry else None, token_id))
                    self.input_top.append(self._top(entry))
        if output.finish_reason == "stop":
            self.finish_reason = {"type": "stop", "matched": output.stop_reason}
        elif output.finish_reason == "length":
            self.finish_reason = {"type": "length", "length": len(self.output_ids)}
        elif output.finish_reason is not None:
            self.finish_reason = {"type": output.finish_reason, "message": output.error}

    def segment(self, index: int | None) -> dict[str, Any]:
        """--stream-output: the chunk of what is new since the previous one (disjoint segments)."""
        text, ids, logprobs = self.num_sent
        body = self.body(index)
        body["text"], body["output_ids"] = self.text[text:], self.output_ids[ids:]
        meta = body["meta_info"]
        for key in ("output_token_logprobs", "output_top_logprobs"):
            if key in meta:
                meta[key] = meta[key][logprobs:]
        self.num_sent = (len(self.text), len(self.output_ids), len(self.output_logprobs))
        return body

    def body(self, index: int | None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.request_id,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt.token_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "e2e_latency": time.monotonic() - self.start_s,
        }
        if self.request.return_logprob:
            meta["output_token_logprobs"] = self.output_logprobs
            meta["input_token_logprobs"] = self.input_logprobs
            if self.request.top_logprobs_num > 0:
                meta["output_top_logprobs"] = self.output_top
                meta["input_top_logprobs"] = self.input_top
        result: dict[str, Any] = {"text": self.text, "output_ids": list(self.output_ids),
                                  "meta_info": meta}
        if index is not None:
            result["index"] = index
        return result


def _native_inputs(request: GenerateRequest) -> tuple[list[str | list[int]], bool]:
    """The prompts of a /generate request and whether it was a batch."""
    if (request.text is None) == (request.input_ids is None):
        raise InvalidRequestError("give exactly one of text and input_ids", "text")
    if request.text is not None:
        if isinstance(request.text, str):
            return [request.text], False
        return list(request.text), True
    ids = request.input_ids
    assert ids is not None
    if ids and all(isinstance(token_id, int) for token_id in ids):
        return [list(ids)], False  # type: ignore[arg-type]
    return [list(item) for item in ids], True  # type: ignore[union-attr]


def _image_item(item: Any, param: str) -> ImageRef:
    if isinstance(item, dict):
        item = item.get("url")
    if not isinstance(item, str) or not item:
        raise InvalidRequestError(f"{param}: an image is a URL (data:, file://, http(s)) or base64 "
                                  'string, or {"url": ...}', param)
    return ImageRef(item, param, allow_bare_base64=True)


def _image_refs(request: GenerateRequest, num_inputs: int, is_batch: bool) -> list[list[ImageRef]]:
    """Each prompt's images from SGLang's ``image_data``: one image or a list for one prompt;
    for a batch, one entry (an image, a list, or null) per prompt."""
    data = request.image_data
    if data is None:
        return [[] for _ in range(num_inputs)]
    if not is_batch:
        items = data if isinstance(data, list) else [data]
        return [[_image_item(item, f"image_data[{i}]" if isinstance(data, list) else "image_data")
                 for i, item in enumerate(items)]]
    if not isinstance(data, list) or len(data) != num_inputs:
        raise InvalidRequestError(f"image_data: a batch of {num_inputs} prompts needs a list of "
                                  f"{num_inputs} entries (an image, a list of images, or null each)",
                                  "image_data")
    refs = []
    for index, entry in enumerate(data):
        if entry is None:
            refs.append([])
        elif isinstance(entry, list):
            refs.append([_image_item(item, f"image_data[{index}][{i}]") for i, item in enumerate(entry)])
        else:
            refs.append([_image_item(entry, f"image_data[{index}]")])
    return refs


def _lora_names(ctx: ServingContext, request: GenerateRequest, num_inputs: int) -> list[str | None]:
    """Each prompt's LoRA adapter from ``lora_path`` (one for all, or one per prompt)."""
    if not isinstance(request.lora_path, list):
        return [ctx.resolve_lora_path(request.lora_path, "lora_path")] * num_inputs
    if len(request.lora_path) != num_inputs:
        raise InvalidRequestError(f"lora_path has {len(request.lora_path)} entries for {num_inputs} "
                                  "prompts", "lora_path")
    return [ctx.resolve_lora_path(value, f"lora_path[{index}]")
            for index, value in enumerate(request.lora_path)]


async def generate(ctx: ServingContext, request: GenerateRequest, raw: Request) -> Response:
    inputs, is_batch = _native_inputs(request)
    if not inputs:
        raise InvalidRequestError("the batch must not be empty", "text")
    params_list = request.sampling_params if isinstance(request.sampling_params, list) \
        else [request.sampling_params or NativeSamplingParams()] * len(inputs)
    if len(params_list) != len(inputs):
        raise InvalidRequestError(f"sampling_params has {len(params_list)} entries for "
                                  f"{len(inputs)} prompts", "sampling_params")
    if request.return_logprob and not 0 <= request.top_logprobs_num <= 20:
        raise InvalidRequestError("top_logprobs_num must be in [0, 20]", "top_logprobs_num")
    ctx.check_num_sequences(sum(native.n for native in params_list))
    rids = [request.rid] if isinstance(request.rid, str) else request.rid
    if rids is not None and len(set(rids)) != len(rids):
        raise InvalidRequestError("rid: every request id in a batch must be different", "rid")
    priority = ctx.request_priority(request.priority)
    lora_names = _lora_names(ctx, request, len(inputs))
    image_refs = _image_refs(request, len(inputs), is_batch)
    for refs in image_refs:
        ctx.multimodal.check(refs)
    base_id = new_id("gen")
    start_s = time.monotonic()
    submissions: list[Submission] = []
    outputs: list[_NativeOutput] = []
    for prompt_index, (item, native) in enumerate(zip(inputs, params_list)):
        check_native_supported(native)
        structured, structured_param = native_structured_spec(native)
        await validate_structured(ctx.config, structured, structured_param)
        ctx.check_stop(native.stop, native.stop_token_ids, "sampling_params.stop",
                       "sampling_params.stop_token_ids")
        max_tokens, is_default = requested_max_tokens(native)
        refs = image_refs[prompt_index]
        if isinstance(item, str):
            prompt = await ctx.prompt_from_text(item, max_tokens, add_special_tokens=True,
                                                param="text", is_default_max_tokens=is_default,
                                                images=refs)
        else:
            images = await ctx.multimodal.load(refs) if refs else None
            prompt = await ctx.prompt_from_ids(item, None, max_tokens, param="input_ids",
                                               is_default_max_tokens=is_default, images=images)
        seed = native.sampling_seed if native.sampling_seed is not None else native.seed
        for sample in range(native.n):
            params = native_to_sampling_params(
                native, max_tokens=prompt.max_tokens, seed=choice_seed(seed, sample),
                logprobs=request.top_logprobs_num if request.return_logprob else None,
                prompt_logprobs=request.top_logprobs_num
                if request.return_logprob and request.logprob_start_len >= 0 else None,
                structured=structured)
            index = len(submissions)
            if rids is not None and len(rids) == len(inputs) and native.n == 1:
                request_id = rids[prompt_index]
            else:
                request_id = f"{base_id}-{index}"
            submissions.append(Submission(index, request_id, prompt.token_ids, params, priority,
                                          group=base_id, lora_name=lora_names[prompt_index],
                                          mm_inputs=prompt.mm_inputs))
            outputs.append(_NativeOutput(ctx, request_id, prompt, request, start_s))
    is_list = is_batch or len(submissions) > 1
    attach_transfers(ctx.config, request, submissions)

    if request.stream:
        opened = await open_stream(ctx, submissions, raw)
        return StreamingResponse(_stream(opened, outputs, is_list, ctx.config.server.stream_output),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        async with aclosing(stream_outputs(ctx.engine, submissions, raw)) as stream:
            async for index, output in stream:
                if output.finish_reason == "error":
                    raise EngineRequestError.from_output(output)
                outputs[index].add(output)
    except ClientDisconnected:
        raise APIError(499, "client disconnected") from None
    bodies = [output.body(None) for output in outputs]
    return JSONResponse(bodies if is_list else bodies[0])


async def _stream(opened: Any, outputs: list[_NativeOutput], is_list: bool,
                  disjoint: bool):  # type: ignore[no-untyped-def]
    try:
        async with aclosing(opened) as stream:
            async for index, output in stream:
                if output.finish_reason == "error":
                    raise EngineRequestError.from_output(output)
                outputs[index].add(output)
                position = index if is_list else None
                yield sse(outputs[index].segment(position) if disjoint
                          else outputs[index].body(position))
    except ClientDisconnected:
        return
    except Exception as error:
        api_error = api_error_from(error)
        yield sse(error_body(api_error.message, api_error.type, api_error.param, api_error.code))
    yield SSE_DONE


async def tokenize(ctx: ServingContext, request: TokenizeRequest) -> dict[str, Any]:
    ctx.resolve_model(request.model)  # an adapter shares the base tokenizer
    tokenizer = ctx.require_tokenizer("/tokenize", "prompt")
    if (request.prompt is None) == (request.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", "prompt")
    if request.messages is not None:
        text, refs = await render_chat_request(ctx, request)
        images = await ctx.multimodal.load(refs) if refs else []  # counted: their tokens too
        text = await ctx.multimodal.expand_text(text, images)
        tokens = await ctx.encode(text, add_special_tokens=bool(request.add_special_tokens),
                                  param="messages")
        if images:
            tokens = (await ctx.multimodal.expand(tokens, images, "messages")).prompt_token_ids
    else:
        add_special_tokens = True if request.add_special_tokens is None else request.add_special_tokens
        tokens = await ctx.encode(request.prompt or "", add_special_tokens=add_special_tokens)
    body: dict[str, Any] = {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.context_length}
    if request.return_token_strs:
        body["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
    return body


async def detokenize(ctx: ServingContext, request: DetokenizeRequest) -> dict[str, Any]:
    ctx.resolve_model(request.model)
    ctx.require_tokenizer("/detokenize", "tokens")
    ctx.check_token_ids(request.tokens, "tokens")
    return {"prompt": ctx.decode(request.tokens)}


def tokenizer_info(ctx: ServingContext) -> dict[str, Any]:
    """vLLM's /tokenizer_info: what a client needs to tokenize like the server without
    downloading the tokenizer (lm-eval's remote tokenizer reads the special tokens and the chat
    template, then calls /tokenize and /detokenize)."""
    tokenizer = ctx.require_tokenizer("/tokenizer_info", "model")
    template = ctx.chat_template or getattr(tokenizer, "chat_template", None)
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__,
                            "model_max_length": ctx.context_length,
                            "vocab_size": ctx.vocab_size or len(tokenizer),
                            "chat_template": template if isinstance(template, str) else None}
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        info[name] = str(value) if value is not None else None
        token_id = getattr(tokenizer, f"{name}_id", None)
        info[f"{name}_id"] = int(token_id) if token_id is not None else None
    info["add_bos_token"] = bool(getattr(tokenizer, "add_bos_token", False))
    return info
