"""The engine core: requests in, one step at a time, RequestOutputs out. Single-threaded.

``step()`` is schedule -> execute -> update. The core never raises for a single request's
failure: the request ends with finish_reason "error" and its blocks are freed. A failed forward
pass ends every request in that batch with an error and the loop goes on.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from servelm.cache.block_pool import BlockPool
from servelm.config import EngineConfig
from servelm.engine.detokenizer import IncrementalDetokenizer
from servelm.engine.executor import Executor, Runner
from servelm.engine.outputs import RequestOutput
from servelm.engine.request import FinishReason, Request
from servelm.engine.scheduler import Scheduler, SchedulerOutput, StepResult
from servelm.sampling.params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)


class LLMEngine:
    """Scheduler + model executor + detokenizers, driven by ``step()``."""

    def __init__(self, config: EngineConfig, runner: Runner | None = None,
                 tokenizer: Any | None = None, eos_token_ids: list[int] | None = None,
                 context_length: int | None = None) -> None:
        self.config = config
        self.model_info: dict[str, Any] = {}
        if runner is None:
            runner, tokenizer, eos_token_ids, context_length = self._load(config)
        assert eos_token_ids is not None and context_length is not None
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self.block_pool = BlockPool(runner.num_blocks)
        self.scheduler = Scheduler(config.scheduler, self.block_pool, runner.block_size)
        self.executor = Executor(runner)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.model_info.update({
            "context_length": context_length,
            "eos_token_ids": eos_token_ids,
            "num_blocks": runner.num_blocks,
            "block_size": runner.block_size,
            "kv_pool_tokens": runner.num_blocks * runner.block_size,
        })

    def _load(self, config: EngineConfig) -> tuple[Runner, Any, list[int], int]:
        from servelm.model.runner import ModelRunner
        from servelm.model.source import resolve_model_source
        from servelm.model.tokenizer import load_tokenizer

        start_s = time.monotonic()
        source = resolve_model_source(config.model)
        tokenizer = load_tokenizer(config.model, source)
        runner = ModelRunner(config, source)
        hf_config = source.hf_config
        self.model_info.update({
            "model_path": config.model.model,
            "served_model_name": config.model.name,
            "architecture": (getattr(hf_config, "architectures", None) or ["unknown"])[0],
            "vocab_size": runner.vocab_size,
            "description": source.description,
            "kv_cache_bytes": runner.kv_cache_bytes,
            "load_time_s": round(time.monotonic() - start_s, 2),
            "device": str(runner.device),
        })
        return runner, tokenizer, list(source.eos_token_ids), source.context_length

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> RequestOutput | None:
        """Queue a request. Returns a finished error output when it can never run."""
        request = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                          params=params, eos_token_ids=self.eos_token_ids,
                          max_context_tokens=self.context_length)
        error = self._check(request)
        if error is not None:
            return RequestOutput(request_id, [], "", finish_reason=FinishReason.ERROR.value,
                                 error=error, num_prompt_tokens=request.num_prompt_tokens)
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params)
        self.scheduler.add_request(request)
        return None

    def _check(self, request: Request) -> str | None:
        if not request.prompt_token_ids:
            return "the prompt is empty"
        if request.request_id in self.scheduler.requests:
            return f"duplicate request id {request.request_id}"
        vocab_size = getattr(self.runner, "vocab_size", None)
        if vocab_size is not None:
            if not all(0 <= t < vocab_size for t in request.prompt_token_ids):
                return f"prompt token ids must be in [0, {vocab_size})"
            try:
                request.params.validate_token_ids(vocab_size)
            except SamplingParamsError as error:
                return str(error)
        if request.num_prompt_tokens >= self.context_length:
            return (f"prompt has {request.num_prompt_tokens} tokens; the context length is "
                    f"{self.context_length}")
        max_tokens = request.params.max_tokens
        pool_tokens = self.block_pool.num_blocks * self.runner.block_size
        if max_tokens is not None and request.num_prompt_tokens + max_tokens - 1 > pool_tokens:
            return (f"prompt ({request.num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) needs "
                    f"more KV cache than the pool holds ({pool_tokens} tokens)")
        if request.params.stop and self.tokenizer is None:
            return "stop strings need a tokenizer (the server runs with --skip-tokenizer-init)"
        return None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        return self._make_output(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        results = self._execute(scheduled)
        return self._update(scheduled, results)

    def _execute(self, scheduled: SchedulerOutput) -> list[StepResult]:
        if scheduled.is_empty:
            return []
        try:
            return self.executor.execute(scheduled)
        except Exception as error:  # one bad batch must not take the server down
            logger.exception("forward pass failed; ending the %d requests in the batch",
                             len(scheduled.scheduled))
            for item in scheduled.scheduled:
                self.scheduler.finish(item.request, FinishReason.ERROR,
                                      error=f"forward pass failed: {error}")
                scheduled.finished.append(item.request)
            scheduled.scheduled = []
            return []

    def _update(self, scheduled: SchedulerOutput, results: list[StepResult]) -> list[RequestOutput]:
        self.num_steps += 1
        touched = self.scheduler.update(scheduled, results)
        outputs = []
        interval = self.config.scheduler.stream_interval
        for request in touched:
            self._detokenize(request)
            num_new = len(request.output_token_ids) - request.num_sent_tokens
            if not request.is_finished and num_new < interval:
                continue
            outputs.append(self._make_output(request))
        self.num_generated_tokens += sum(len(r.token_ids) for r in results)
        return outputs

    def _detokenize(self, request: Request) -> None:
        """Decode the request's new tokens; a matched stop string ends it with reason "stop"."""
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is None or request.finish_reason is FinishReason.ERROR:
            return
        stop = detokenizer.add_tokens(request.output_token_ids)
        if stop is None:
            return
        if request.is_finished:  # the same token also hit a length limit: the stop string wins
            request.finish_reason, request.stop_reason = FinishReason.STOP, stop
        else:
            self.scheduler.finish(request, FinishReason.STOP, stop_reason=stop)

    def _make_output(self, request: Request) -> RequestOutput:
        new_ids = request.output_token_ids[request.num_sent_tokens:]
        detokenizer = self._detokenizers.get(request.request_id)
        text = ""
        if detokenizer is not None:
            text = detokenizer.take_new_text(request.is_finished)
        request.num_sent_tokens = len(request.output_token_ids)
        logprobs = None
        if request.params.logprobs is not None:
            logprobs, request.pending_logprobs = request.pending_logprobs, []
        prompt_logprobs = None
        if (request.prompt_logprobs is not None and not request.is_prompt_logprobs_sent
                and len(request.prompt_logprobs) == request.num_prompt_tokens):
            prompt_logprobs = request.prompt_logprobs
            request.is_prompt_logprobs_sent = True
        if request.is_finished:
            self._detokenizers.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            new_text=text,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stop_reason=request.stop_reason,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
            num_cached_tokens=0,
            error=request.error,
        )

    def stats(self) -> dict[str, Any]:
        pool = self.block_pool
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_used_blocks": pool.num_used_blocks,
            "num_free_blocks": pool.num_free_blocks,
            "kv_pool_tokens": pool.num_blocks * self.runner.block_size,
            "token_usage": round(pool.num_used_blocks / pool.num_blocks, 4),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
        }
