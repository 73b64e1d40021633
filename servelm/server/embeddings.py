"""/v1/embeddings (OpenAI) and SGLang's native /encode, for a server running --task embed.

Every input (a string, a list of strings, token ids or a list of token id lists) becomes one
engine embedding request; they are submitted together, so the scheduler computes them in the
same forward when they fit its step.

Invariants:
- Inputs are checked here: at most ``--max-sequences-per-request`` of them (each is an engine
  request; counted before any is tokenized), none may be empty, token ids must be in the
  vocabulary, and each input must fit ``max_embedding_tokens`` (the context, one step and the
  KV pool: an input is never chunked) unless ``truncate_prompt_tokens`` asks to keep only its
  last k tokens (vLLM's rule).
- ``dimensions`` other than the model's size is served only when the pooler config says the model
  is Matryoshka-trained; the vector is then cut and renormalized (when the model normalizes).
- ``encoding_format`` base64 is the little-endian float32 bytes of the vector, as OpenAI sends it.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
from typing import Any

from fastapi.responses import JSONResponse

from servelm.engine.outputs import RequestOutput
from servelm.errors import EngineRequestError, InvalidRequestError
from servelm.server.protocol import EmbeddingRequest, EncodeRequest
from servelm.server.serving import ServingContext, new_id

_API = "Embeddings"


def _items(ctx: ServingContext, value: Any, param: str) -> list[str | list[int]]:
    """One input or a batch -> a list of inputs (a string or a token id list each), at most
    ``--max-sequences-per-request`` of them (each becomes an engine request)."""
    if isinstance(value, str):
        items: list[str | list[int]] = [value]
    elif value and all(isinstance(item, int) for item in value):
        items = [list(value)]
    else:
        items = list(value or [])
    if not items:
        raise InvalidRequestError(f"{param} must not be empty", param)
    ctx.check_num_sequences(len(items), param, "one per input")
    for item in items:
        if not item:
            raise InvalidRequestError(f"{param} must not contain an empty string or token list", param)
    return items


async def _tokens(ctx: ServingContext, item: str | list[int], param: str, *,
                  add_special_tokens: bool, truncate_prompt_tokens: int | None) -> list[int]:
    if isinstance(item, str):
        tokens = await ctx.encode(item, add_special_tokens=add_special_tokens, param=param)
    else:
        tokens = list(item)
        ctx.check_token_ids(tokens, param)
    limit = ctx.max_embedding_tokens
    if truncate_prompt_tokens is not None:
        keep = limit if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if not 1 <= keep <= limit:
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be -1 or in [1, {limit}] (the most tokens this "
                f"model embeds), got {truncate_prompt_tokens}", "truncate_prompt_tokens")
        tokens = tokens[-keep:]
    if not tokens:
        raise InvalidRequestError(f"{param}: an input has no tokens", param)
    if len(tokens) > limit:
        raise InvalidRequestError(
            f"This model embeds at most {limit} tokens per input; an input has {len(tokens)} "
            "tokens. Shorten it, or set truncate_prompt_tokens to keep its last tokens.", param,
            code="context_length_exceeded")
    return tokens


async def _embed_all(ctx: ServingContext, token_lists: list[list[int]], base_id: str,
                     priority: int) -> list[list[float]]:
    """Submit every input at once; the vectors in input order (engine errors raise)."""
    outputs: list[RequestOutput] = await asyncio.gather(*(
        ctx.engine.encode(f"{base_id}-{index}", tokens, priority)
        for index, tokens in enumerate(token_lists)))
    for output in outputs:
        if output.embedding is None:
            raise EngineRequestError.from_output(output)
    return [list(output.embedding or []) for output in outputs]


def _check_dimensions(ctx: ServingContext, dimensions: int | None) -> None:
    size = ctx.embedding_size
    if dimensions is None or dimensions == size:
        return
    pooler = ctx.pooler
    allowed = pooler.get("matryoshka_dimensions")
    if not pooler.get("is_matryoshka"):
        raise InvalidRequestError(
            f"This model does not support Matryoshka representations: dimensions must be {size} "
            f"(its embedding size) or left out, got {dimensions}", "dimensions")
    if size is None or not 1 <= dimensions <= size or (allowed and dimensions not in allowed):
        choices = allowed or f"1..{size}"
        raise InvalidRequestError(f"dimensions must be one of {choices}, got {dimensions}",
                                  "dimensions")


def _shape(ctx: ServingContext, vector: list[float], dimensions: int | None) -> list[float]:
    """Cut a Matryoshka vector to ``dimensions``, renormalizing when the model normalizes."""
    if dimensions is None or dimensions == len(vector):
        return vector
    cut = vector[:dimensions]
    if ctx.pooler.get("normalize"):
        norm = math.sqrt(sum(x * x for x in cut)) or 1.0
        cut = [x / norm for x in cut]
    return cut


def encode_base64(vector: list[float]) -> str:
    """Little-endian float32 bytes, base64 (OpenAI's ``encoding_format: base64``)."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def create_embedding(ctx: ServingContext, request: EmbeddingRequest) -> JSONResponse:
    ctx.check_model(request.model)
    ctx.require_task("embed", _API)
    _check_dimensions(ctx, request.dimensions)
    priority = ctx.request_priority(request.priority)
    token_lists = [await _tokens(ctx, item, "input", add_special_tokens=request.add_special_tokens,
                                 truncate_prompt_tokens=request.truncate_prompt_tokens)
                   for item in _items(ctx, request.input, "input")]
    base_id = new_id("embd")
    vectors = await _embed_all(ctx, token_lists, base_id, priority)
    data = []
    for index, vector in enumerate(vectors):
        shaped = _shape(ctx, vector, request.dimensions)
        embedding: list[float] | str = (encode_base64(shaped) if request.encoding_format == "base64"
                                        else shaped)
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    num_tokens = sum(len(tokens) for tokens in token_lists)
    return JSONResponse({"id": base_id, "object": "list", "created": int(time.time()),
                         "model": ctx.served_model_name, "data": data,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


async def encode(ctx: ServingContext, request: EncodeRequest) -> JSONResponse:
    """SGLang's /encode: ``{"embedding", "meta_info"}`` per input, a list for a batch."""
    ctx.require_task("embed", "encode")
    if (request.text is None) == (request.input_ids is None):
        raise InvalidRequestError("give exactly one of text and input_ids", "text")
    param = "text" if request.text is not None else "input_ids"
    value = request.text if request.text is not None else request.input_ids
    items = _items(ctx, value, param)
    is_batch = not isinstance(value, str) and not (value and isinstance(value[0], int))
    token_lists = [await _tokens(ctx, item, param, add_special_tokens=True,
                                 truncate_prompt_tokens=None) for item in items]
    rids = [request.rid] if isinstance(request.rid, str) else list(request.rid or [])
    if rids and len(rids) != len(items):
        raise InvalidRequestError(f"rid has {len(rids)} ids for {len(items)} inputs", "rid")
    base_id = new_id("encode")
    start_s = time.perf_counter()
    vectors = await _embed_all(ctx, token_lists, base_id, ctx.request_priority(request.priority))
    elapsed_s = time.perf_counter() - start_s
    results = [{"embedding": vector,
                "meta_info": {"id": rids[index] if rids else f"{base_id}-{index}",
                              "prompt_tokens": len(tokens), "e2e_latency": elapsed_s}}
               for index, (vector, tokens) in enumerate(zip(vectors, token_lists, strict=True))]
    return JSONResponse(results if is_batch else results[0])
