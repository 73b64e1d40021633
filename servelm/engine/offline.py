"""servelm.Engine: offline generation and embeddings through the same engine process as the server.

The engine's asyncio client runs on a private event loop in a background thread; the public
methods here are synchronous and block until their requests finish.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from servelm.config import EngineConfig
from servelm.engine.async_engine import AsyncEngine
from servelm.engine.outputs import TokenLogprob
from servelm.multimodal.inputs import ImageItem, MultimodalInputs
from servelm.sampling.params import BeamParams, SamplingParams

T = TypeVar("T")


@dataclass
class GenerationResult:
    """One prompt's completion."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_token_ids: list[int]
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    beam_score: float | None = None
    """Beam search: the beam's score (cumulative logprob / length ** length_penalty)."""
    cumulative_logprob: float | None = None
    """Beam search: the sum of the beam's token log-probabilities."""


class Engine:
    """Load a model and run batches of prompts: ``Engine(model_path=...).generate(prompts, params)``.

    Keyword arguments are EngineConfig field names (``max_total_tokens=4096``,
    ``chunked_prefill_size=256``, ...). Use it as a context manager, or call ``shutdown()``.
    ``fair_step_tokens`` defaults to 0 here (a batch job wants throughput; the server's default
    bounds prompt tokens per step while users decode).
    """

    def __init__(self, model_path: str | None = None, **server_args: Any) -> None:
        if model_path is not None:
            server_args["model"] = model_path
        server_args.setdefault("fair_step_tokens", 0)  # a batch job: throughput, not latency
        self.config = EngineConfig.from_flat(server_args)
        self._ids = itertools.count()
        self._processor: Any = None
        """The model's image processor (servelm.multimodal.processor), loaded on first use."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="servelm-engine-client",
                                        daemon=True)
        self._thread.start()
        try:
            self._engine = self._run(AsyncEngine.start(self.config))
        except BaseException:
            self._stop_loop()
            raise

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def model_info(self) -> dict[str, Any]:
        """The model's description, as /get_model_info answers it (a plain dict)."""
        info = self._engine.model_info.as_dict()
        if self._engine.model_info.lora is not None:
            info["lora_adapters"] = self._engine.lora_adapters
        return info

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | dict[str, Any] | Sequence[SamplingParams] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        lora_path: str | Sequence[str | None] | None = None,
        image_data: Any = None,
    ) -> Any:
        """Generate for each prompt (text or token ids). A single prompt gives one result,
        a list gives a list in the same order. ``lora_path``: the LoRA adapter (its name) for
        every prompt, or one per prompt (None: the base model). ``image_data`` (a
        vision-language model): the images of a single prompt (a list of PIL images or
        ImageItems, or one image), or one such list per prompt; each prompt names its images
        with the model's marker (Gemma 3: ``<start_of_image>``) in its text or ids, in order."""
        token_lists, is_single = self._token_lists(prompts, input_ids)
        mm_inputs: list[MultimodalInputs | None] = [None] * len(token_lists)
        if image_data is not None:
            mm_inputs = self._images(prompts, token_lists, image_data, is_single)
            token_lists = [mm.prompt_token_ids if mm is not None else ids
                           for ids, mm in zip(token_lists, mm_inputs)]
        params = self._params(sampling_params, len(token_lists))
        if lora_path is None or isinstance(lora_path, str):
            adapters: list[str | None] = [lora_path] * len(token_lists)
        else:
            adapters = list(lora_path)
            if len(adapters) != len(token_lists):
                raise ValueError(f"{len(adapters)} lora_path entries for {len(token_lists)} prompts")
        results = self._run(self._generate_all(token_lists, params, adapters, mm_inputs))
        return results[0] if is_single else results

    def _images(self, prompts: Any, token_lists: list[list[int]], image_data: Any,
                is_single: bool) -> list[MultimodalInputs | None]:
        """Each prompt's MultimodalInputs (None where it has no images)."""
        from servelm.multimodal.processor import get_processor, image_item
        if self._processor is None:
            self._processor = get_processor(self._engine.model_info.model_path or self.config.model.model,
                                            self.tokenizer)
        processor = self._processor
        if processor is None:
            raise ValueError("this model does not take images (it is not a vision-language model)")
        per_prompt = [image_data] if is_single else list(image_data)
        if len(per_prompt) != len(token_lists):
            raise ValueError(f"{len(per_prompt)} image lists for {len(token_lists)} prompts")
        texts = None if prompts is None else ([prompts] if is_single else list(prompts))
        result: list[MultimodalInputs | None] = []
        for index, images in enumerate(per_prompt):
            if images is None or (isinstance(images, list) and not images):
                result.append(None)
                continue
            items = [image if isinstance(image, ImageItem) else image_item(image)
                     for image in (images if isinstance(images, (list, tuple)) else [images])]
            ids = token_lists[index]
            if texts is not None and processor.tokenizer is not None:   # transformers' text-level expansion
                ids = self.tokenizer.encode(processor.expand_text(texts[index], items))
            result.append(processor.process(ids, items))
        return result

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Load a LoRA adapter (needs enable_lora=True): {"success", "message", ...}."""
        return self._run(self._engine.load_lora_adapter(lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload a LoRA adapter; requests using it finish first."""
        return self._run(self._engine.unload_lora_adapter(lora_name))

    def _token_lists(self, prompts: Any, input_ids: Any) -> tuple[list[list[int]], bool]:
        if (prompts is None) == (input_ids is None):
            raise ValueError("give exactly one of prompts and input_ids")
        if input_ids is not None:
            is_single = bool(input_ids) and isinstance(input_ids[0], int)
            lists = [list(input_ids)] if is_single else [list(ids) for ids in input_ids]
            return lists, is_single
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init): pass input_ids")
        is_single = isinstance(prompts, str)
        texts = [prompts] if is_single else list(prompts)
        return [self.tokenizer.encode(text) for text in texts], is_single

    @staticmethod
    def _params(sampling_params: Any, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(sampling_params, dict):
            return [SamplingParams(**sampling_params) for _ in range(count)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"{len(params)} sampling params for {count} prompts")
        return params

    async def _generate_all(self, token_lists: list[list[int]], params: list[SamplingParams],
                            adapters: list[str | None],
                            mm_inputs: list[MultimodalInputs | None] | None = None) -> list[GenerationResult]:
        images = mm_inputs if mm_inputs is not None else [None] * len(token_lists)
        return list(await asyncio.gather(*(
            self._generate_one(f"offline-{next(self._ids)}", ids, p, adapter, mm_inputs=mm)
            for ids, p, adapter, mm in zip(token_lists, params, adapters, images, strict=True))))

    def beam_search(self, prompts: str | Sequence[str] | None = None, beam_width: int = 4,
                    max_tokens: int = 16, *, input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                    length_penalty: float = 1.0, early_stopping: bool | str = False,
                    **params: Any) -> Any:
        """Beam search (vLLM's ``LLM.beam_search``): for each prompt, its ``beam_width`` best beams,
        best first, each a GenerationResult with ``beam_score``; a single prompt gives one list.
        ``params``: other SamplingParams fields (ignore_eos, stop, stop_token_ids, ...)."""
        token_lists, is_single = self._token_lists(prompts, input_ids)
        searches = [[SamplingParams(temperature=0.0, max_tokens=max_tokens, **params, beam=BeamParams(
            width=beam_width, num_returns=beam_width, rank=rank, length_penalty=length_penalty,
            early_stopping=early_stopping)) for rank in range(beam_width)] for _ in token_lists]
        beams = self._run(self._beam_all(token_lists, searches))
        return beams[0] if is_single else beams

    async def _beam_all(self, token_lists: list[list[int]], searches: list[list[SamplingParams]]
                        ) -> list[list[GenerationResult]]:
        groups = [f"offline-{next(self._ids)}" for _ in token_lists]
        return list(await asyncio.gather(*(
            asyncio.gather(*(self._generate_one(f"{group}-{rank}", ids, params, None, group=group)
                             for rank, params in enumerate(ranks)))
            for group, ids, ranks in zip(groups, token_lists, searches, strict=True))))

    async def _generate_one(self, request_id: str, prompt_token_ids: list[int],
                            params: SamplingParams, lora_name: str | None,
                            group: str = "", mm_inputs: MultimodalInputs | None = None) -> GenerationResult:
        result = GenerationResult("", [], "", prompt_token_ids)
        async for output in self._engine.generate(request_id, prompt_token_ids, params,
                                                  group=group, lora_name=lora_name, mm_inputs=mm_inputs):
            result.text += output.new_text
            result.token_ids.extend(output.new_token_ids)
            result.logprobs.extend(output.logprobs or [])
            if output.is_finished:
                result.finish_reason = output.finish_reason or ""
                result.stop_reason = output.stop_reason
                result.error = output.error
                result.beam_score = output.beam_score
                result.cumulative_logprob = output.cumulative_logprob
        return result

    def encode(
        self,
        prompts: str | Sequence[str] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> Any:
        """Embed each input (text or token ids) with a model served with ``task="embed"`` (or an
        encoder under auto): one vector (list of floats) per input, in order; a single input
        gives one vector. Raises ValueError when the engine refuses an input."""
        token_lists, is_single = self._token_lists(prompts, input_ids)
        vectors = self._run(self._encode_all(token_lists))
        return vectors[0] if is_single else vectors

    embed = encode

    async def _encode_all(self, token_lists: list[list[int]]) -> list[list[float]]:
        outputs = await asyncio.gather(*(self._engine.encode(f"offline-{next(self._ids)}", ids)
                                         for ids in token_lists))
        for output in outputs:
            if output.embedding is None:
                raise ValueError(output.error or "the engine returned no embedding")
        return [list(output.embedding or []) for output in outputs]

    def get_server_info(self) -> dict[str, Any]:
        return self._run(self._engine.get_server_info())

    def shutdown(self) -> None:
        if self._loop.is_running():
            self._run(self._engine.shutdown())
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
