"""The engine core: requests in, one step at a time, RequestOutputs out. Single-threaded (grammars
compile on GrammarCompiler's worker threads; the step only polls them).

``submit`` is the one way in (generations and embeddings): generic checks, then the stages'
``check`` and ``on_add`` hooks. ``step()`` is the stages' before-schedule hooks -> schedule ->
execute -> ``apply`` (the update, with the stages around it; ``engine/stage.py``). The optional
features (beam search, grammars, disaggregation, speculation, prompt sharing, LoRA, the
hierarchical cache) are stages built here at construction, each given its collaborators; neither
``submit`` nor ``step()`` names any of them. The core never raises for a single
request's failure: the request ends with finish_reason "error" and its blocks are freed. A failed
forward pass ends every request in that batch with an error and the loop goes on.
The runner's task (generate or embed) is fixed: a request for the other one is refused (400).
A failed rank (``RankFailedError``) is different: no later step can run. That step ends every
request with the rank's error, and the next ``step()`` raises it, so the engine process exits."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from servelm.cache.block_pool import BlockPool
from servelm.cache.hicache import HiCacheController
from servelm.cache.radix_tree import RadixTree
from servelm.config import HEAD_ALGORITHMS, EngineConfig
from servelm.constrained.grammar import check_backend_available
from servelm.disagg.spec import KVTransfer
from servelm.distributed.errors import RankFailedError
from servelm.engine.beam import BeamSearches
from servelm.engine.detokenizer import IncrementalDetokenizer
from servelm.engine.disaggregation import CO_LOCATED, Disaggregation
from servelm.engine.executor import Executor, NaNLogitsError, Runner
from servelm.engine.expert_stage import ExpertCounts, ExpertLoadStage, expert_distribution_call
from servelm.engine.grammar_stage import Grammars, make_grammar_compiler
from servelm.engine.heap import keep_large_buffers, release_free_memory
from servelm.engine.hicache import HiCacheStage, build_hicache
from servelm.engine.kv_manager import KVManager
from servelm.engine.frontdoor import SubmitRequest
from servelm.engine.lora_stage import LORA_OFF, NOT_ENABLED, AdapterSlots, LoRAStage
from servelm.engine.outputs import RequestOutput
from servelm.engine.prompt_sharing import SharedPrompts
from servelm.engine.request import FinishReason, PoolingState, Request
from servelm.engine.scheduler import Scheduler, SchedulerOutput, StepResult
from servelm.engine.speculation import Speculation
from servelm.engine.stage import Hooks, Refusal, Stage
from servelm.lora.adapter import BaseShapes, LoRAAdapterError
from servelm.lora.manager import LoRAManager, LoRASlots
from servelm.multimodal.inputs import MultimodalInputs
from servelm.multimodal.processor import supports_images
from servelm.sampling.params import SamplingParams, SamplingParamsError
from servelm.sampling.sampler import request_seed
from servelm.spec.proposer import Proposer

if TYPE_CHECKING:
    from servelm.model.eagle import DraftHeadRunner
    from servelm.model.runner import ModelRunner

logger = logging.getLogger(__name__)

_EMBEDDING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
"""What an embedding request's scheduling reads of SamplingParams: no output beyond its prompt."""


class LLMEngine:
    """Scheduler + model executor + detokenizers, driven by ``step()``."""

    def __init__(self, config: EngineConfig, runner: Runner | None = None,
                 tokenizer: Any | None = None, eos_token_ids: list[int] | None = None,
                 context_length: int | None = None, proposer: Proposer | None = None,
                 extra_stages: Sequence[Callable[[LLMEngine], Stage]] = ()) -> None:
        """``proposer`` replaces the one --speculative-algorithm names (tests force drafts);
        ``extra_stages`` build further stages (``engine/stage.py``) from the constructed engine's
        collaborators (scheduler, KV manager, runner); they run after the built-in ones."""
        self.config = config
        check_backend_available(config.structured.grammar_backend)  # fail at start, not per request
        keep_large_buffers()   # a step's big buffers (logits) reused, not mapped and faulted afresh
        self.model_info: dict[str, Any] = {}
        self._draft_proposer: Proposer | None = None
        """STANDALONE: the draft model's proposer, built by ``_load`` beside the model."""
        if runner is None:
            runner, tokenizer, eos_token_ids, context_length = self._load(config)
            release_free_memory()   # the load's freed buffers (e.g. GGUF int8 codes dropped once packed)
        assert eos_token_ids is not None and context_length is not None
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self.task: str = runner.task
        """generate or embed (servelm.model.pooling.resolve_task); requests of the other are refused."""
        self.block_pool = BlockPool(runner.num_blocks, config.parallel.attention_dp_size)
        self.prefix_cache = None if config.cache.disable_radix_cache else RadixTree(
            self.block_pool, runner.block_size, config.cache.radix_eviction_policy)
        self.lora = self._make_lora_manager(runner)
        """The adapter registry (None without --enable-lora)."""
        hicache = build_hicache(config, runner, self.prefix_cache, self.block_pool)
        """Host and storage tiers below the pool (None without --enable-hierarchical-cache)."""
        self.kv = KVManager(self.block_pool, runner.block_size, self.prefix_cache, hicache)
        """Which blocks each request holds (prefix hits, growth, rollback, forks, parking)."""
        self.scheduler = Scheduler(config.scheduler, self.kv, seed=config.model.seed, adapter_slot=(
            AdapterSlots(self.lora, config.lora.max_loras_per_batch) if self.lora else None))
        self.disaggregation = self._make_disaggregation(runner)
        """The prefill or decode side of K/V transfers (None: co-located, the default)."""
        self.speculation = Speculation(config.speculative, self.scheduler, runner,
                                       proposer or self._draft_proposer)
        """Drafts tokens before each schedule (--speculative-algorithm); off: does nothing."""
        self.beams = BeamSearches(self.scheduler, tokenizer, is_speculating=self.speculation.is_enabled)
        """Beam-search requests (params.beam): their beams run as scheduler requests."""
        self.grammars = Grammars(config, self.scheduler, tokenizer, make_grammar_compiler(
            config, tokenizer, runner.vocab_size, eos_token_ids, self.task))
        """Structured output: grammars compile on worker threads (started here, after everything
        that may refuse to start); jump-forward after updates."""
        self.executor = Executor(runner, grammars=self.grammars,
                                 verification=self.speculation.verification,
                                 nan_check=config.observability.nan_check,
                                 deterministic=config.runtime.enable_deterministic_inference)
        self.shared_prompts = SharedPrompts(self.scheduler)
        """n copies of one prompt compute it (and its prompt logprobs) once, then fork."""
        self._lora_stage = LoRAStage(self.lora, self.scheduler) if self.lora else None
        self.stages: list[Stage] = [
            self.beams, self.grammars, self.disaggregation or CO_LOCATED, self.speculation,
            self.shared_prompts, self._lora_stage or LORA_OFF, *([HiCacheStage(hicache)] if hicache else [])]
        self.expert_load: ExpertCounts | None = getattr(runner, "expert_load", None)
        """The MoE routing counts (model/expert_load.py: rank 0's, every stage's under pipeline
        parallelism), None where no flag asks for them."""
        if self.expert_load is not None:
            self.stages.append(ExpertLoadStage(self.expert_load,
                                               config.observability.enable_expert_distribution_metrics))
        """The optional features, each plugged into the step through ``engine/stage.py`` (a beam
        search first: it takes its requests before the others start work on them)."""
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.num_steps = 0
        self._num_arrivals = 0
        """Requests added so far: the arrival index that seeds an unseeded request's sampling."""
        self.num_generated_tokens = 0
        self.fatal_error: RankFailedError | NaNLogitsError | None = None
        """Set when a rank failed or logits held NaN under --crash-on-nan: every request has been
        ended and the next step raises it."""
        self.stages += [make_stage(self) for make_stage in extra_stages]
        self._hooks = Hooks(self.stages)
        self.model_info.update({
            "context_length": context_length,
            "eos_token_ids": eos_token_ids,
            "num_blocks": runner.num_blocks,
            "block_size": runner.block_size,
            "kv_pool_tokens": runner.num_blocks * runner.block_size,
            # DP attention: one rank's pool, where each request runs (else the pool)
            "kv_tokens_per_request": self.kv.pool_capacity_tokens,
            "task": self.task,
            "is_generation": self.task == "generate",
            # the GGUF linears' measured routes (model/routes.py); None off GGUF blocks or on rank workers
            "routes": getattr(runner, "routes_summary", lambda: None)(),
            # what a token costs in the pool (latent rows for MLA models), DP attention's per-rank pool
            "kv_pool": getattr(runner, "kv_pool_layout", lambda: None)(),
        })
        if self.lora is not None:
            self.model_info["lora"] = {"max_loras_per_batch": config.lora.max_loras_per_batch,
                                       "max_lora_rank": config.lora.max_lora_rank}
            self.model_info["lora_adapters"] = self.lora.describe()
        pooler = runner.pooler
        if pooler is not None:
            self.model_info.update({"embedding_size": runner.hidden_size,
                                    "pooler": pooler.as_dict(),
                                    "max_embedding_tokens": self.max_embedding_tokens})

    def _make_disaggregation(self, runner: Runner) -> Disaggregation | None:
        if not self.config.disaggregation.is_enabled:
            return None
        kv_cache = getattr(runner, "kv_cache", None)
        if kv_cache is None and hasattr(runner, "transfer_pool"):  # tensor parallel: every rank's share
            kv_cache = runner.transfer_pool()
        if kv_cache is None:
            raise ValueError("--disaggregation-mode needs the in-process model runner or the mp "
                             "executor (--distributed-executor-backend mp)")
        disaggregation = Disaggregation(self.config, self.scheduler, kv_cache)
        self.model_info.update(disaggregation.describe())
        return disaggregation

    def _load(self, config: EngineConfig) -> tuple[Runner, Any, list[int], int]:
        from servelm.model.source import resolve_model_source
        from servelm.model.tokenizer import load_tokenizer

        start_s = time.monotonic()
        source = resolve_model_source(config.model)
        tokenizer = load_tokenizer(config.model, source)
        draft = None
        if config.speculative.speculative_algorithm == "STANDALONE":
            from servelm.engine.draft_model import load_draft_runner

            draft, draft_tokenizer = load_draft_runner(config)
        eagle_head = None
        if config.speculative.speculative_algorithm in HEAD_ALGORITHMS:
            from servelm.engine.eagle import prepare_eagle_head

            eagle_head = prepare_eagle_head(config, source)
        runner = self._start_runner(config, source, draft or eagle_head)
        if draft is not None:
            from servelm.engine.draft_model import check_vocab, make_draft_proposer

            check_vocab(draft, draft_tokenizer, runner.vocab_size, tokenizer)
            self._draft_proposer = make_draft_proposer(config, draft)
        if eagle_head is not None:
            from servelm.engine.eagle import attach_eagle_head
            from servelm.model.runner import ModelRunner

            assert isinstance(runner, ModelRunner), "EAGLE runs beside an in-process model (tp, pp 1)"
            self._draft_proposer = attach_eagle_head(config, eagle_head, runner)
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
            "parallel": runner.layout(),
            "takes_images": supports_images(hf_config),
        })
        return runner, tokenizer, list(source.eos_token_ids), source.context_length

    @staticmethod
    def _start_runner(config: EngineConfig, source: Any,
                      draft: ModelRunner | DraftHeadRunner | None = None) -> Runner:
        """The model side: in-process at tp 1 (no extra process or copy), else one worker per rank.
        The engine sizes the KV pool: the minimum of what every rank can hold (less a STANDALONE
        ``draft``'s share, whose pool is sized here too: ``engine.draft_model.split_kv_blocks``)."""
        from servelm.model.runner import ModelRunner

        runner: Runner
        if config.parallel.tensor_parallel_size == 1 and config.parallel.pipeline_parallel_size == 1:
            runner = model_runner = ModelRunner(config, source, defer_kv_cache=True)
            if draft is not None:
                from servelm.engine.draft_model import split_kv_blocks

                num_blocks, draft_blocks = split_kv_blocks(
                    config, model_runner.kv_capacity_blocks(), model_runner.kv_bytes_per_token,
                    draft.kv_bytes_per_token)
                draft.init_kv_cache(draft_blocks)
                model_runner.init_kv_cache(num_blocks)
                return model_runner
        else:
            from servelm.workers import start_executor

            runner = start_executor(config, source)
        try:
            capacities = runner.rank_kv_capacity_blocks()
            if len(capacities) > 1:
                logger.info("KV pool: %d blocks, the minimum over the ranks' capacities %s",
                            min(capacities), capacities)
            runner.init_kv_cache(min(capacities))
        except BaseException:
            runner.shutdown()
            raise
        return runner

    def _make_lora_manager(self, runner: Runner) -> LoRAManager | None:
        """The adapter registry with the --lora-paths adapters loaded (a bad one fails start-up)."""
        if not self.config.lora.is_enabled:
            return None
        if not isinstance(runner, LoRASlots):
            raise ValueError("--enable-lora: this runner cannot hold LoRA adapters")
        manager = LoRAManager(self.config.lora, BaseShapes.from_hf_config(runner.hf_config), runner)
        for source in self.config.lora.sources:
            try:
                manager.load(source.name, source.path, set())
            except LoRAAdapterError as error:
                raise ValueError(f"--lora-paths: {error}") from None
        return manager

    # -- LoRA adapters ----------------------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Register and load an adapter: {"success", "message", "status"} (400 naming the reason)."""
        if self._lora_stage is None:
            return {"success": False, "status": 400, "message": NOT_ENABLED}
        result = self._lora_stage.load(name, path)
        self.model_info["lora_adapters"] = self._lora_stage.manager.describe()
        return result

    def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        """Unregister an adapter; requests using it run to the end first (then its weights go)."""
        if self._lora_stage is None:
            return {"success": False, "status": 400, "message": NOT_ENABLED}
        result = self._lora_stage.unload(name)
        self.model_info["lora_adapters"] = self._lora_stage.manager.describe()
        return result

    @property
    def num_jump_forward_tokens(self) -> int:
        """Output tokens appended by grammar jump-forward instead of a model step."""
        return self.grammars.num_jump_forward_tokens

    @property
    def hicache(self) -> HiCacheController | None:
        """Host and storage tiers below the pool (None without --enable-hierarchical-cache)."""
        return self.kv.hicache

    @property
    def max_embedding_tokens(self) -> int:
        """Longest embedding input: it fits the context and one step (it is never chunked)."""
        return min(self.context_length, self.config.scheduler.max_tokens_per_step, self.kv.pool_capacity_tokens)

    # -- requests ---------------------------------------------------------------------------
    def add_embedding_request(self, request_id: str, prompt_token_ids: list[int],
                              priority: int = 0) -> RequestOutput | None:
        """Queue an embedding request (task embed): it finishes with ``embedding`` set."""
        return self.submit(SubmitRequest(request_id, prompt_token_ids, None, priority))

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0, *, group: str = "",
                    lora_name: str | None = None, kv_transfer: KVTransfer | None = None,
                    mm_inputs: MultimodalInputs | None = None) -> RequestOutput | None:
        """Queue a generation request (``submit``'s fields as arguments)."""
        return self.submit(SubmitRequest(request_id, prompt_token_ids, params, priority, group,
                                         lora_name, kv_transfer, mm_inputs))

    def submit(self, message: SubmitRequest) -> RequestOutput | None:
        """Queue a request: the one path of generations and embeddings (``params`` None). Returns
        a finished error output when it can never run (or when the waiting queue is full:
        ``error_status`` 503). The stages check it, then start their work on it (``Stage.check``,
        ``Stage.on_add``); one may take it instead of queueing it (a beam search)."""
        request = self._new_request(message)
        max_queued = self.config.scheduler.max_queued_requests
        if max_queued is not None and len(self.scheduler.waiting) >= max_queued:
            return _refused(request, Refusal(f"the server is busy: {max_queued} requests are already "
                                             "waiting (--max-queued-requests); retry later", 503))
        error = self._check(request)
        if error is None and request.mm_inputs is not None:
            error = self._check_images(request)
        if error is not None:
            return _refused(request, Refusal(error))
        for check in self._hooks["check"]:
            refusal: Refusal | None = check(request, message)
            if refusal is not None:
                return _refused(request, refusal)
        for on_add in self._hooks["on_add"]:
            if on_add(request, message):
                return None  # the stage serves it
        if self.tokenizer is not None and request.pooling is None:
            self._detokenizers[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.params)
        self.scheduler.add_request(request)
        return None

    def _new_request(self, message: SubmitRequest) -> Request:
        """The engine's request for a submission; its arrival index seeds unseeded sampling."""
        mm_inputs = message.mm_inputs
        request = Request(request_id=message.request_id, prompt_token_ids=list(message.prompt_token_ids),
                          params=message.params or _EMBEDDING_PARAMS, eos_token_ids=self.eos_token_ids,
                          max_context_tokens=self.context_length, priority=message.priority,
                          group=message.group,
                          default_seed=request_seed(self.config.model.seed, self._num_arrivals),
                          pooling=PoolingState() if message.params is None else None,
                          mm_inputs=mm_inputs if mm_inputs is not None and mm_inputs.images else None)
        self._num_arrivals += 1
        return request

    def _check_images(self, request: Request) -> str | None:
        """Why a request with images cannot run here (None: it can). Under prefill/decode
        disaggregation both sides take the images: the prefill side encodes them, the decode side
        keys its prefix cache and its M-RoPE positions by them (their K/V arrives like any other)."""
        assert request.mm_inputs is not None
        if not self.model_info.get("takes_images", getattr(self.runner, "takes_images", False)):
            return "this model does not take images (it is not a vision-language model)"
        if request.pooling is not None:
            return "embedding requests take text only"
        previous_end = 0
        for span in request.mm_inputs.images:
            if span.offset < previous_end or span.length <= 0 or span.offset + span.length > request.num_prompt_tokens:
                return "image spans must be ordered, disjoint and inside the prompt"
            previous_end = span.offset + span.length
        return None

    def _check(self, request: Request) -> str | None:
        if not request.prompt_token_ids:
            return "the prompt is empty"
        if (request.pooling is not None) != (self.task == "embed"):
            return ("this model serves embeddings (--task embed): it does not support generation"
                    if self.task == "embed" else "this model does not support embeddings: start "
                    "the server with --task embed (--is-embedding) to serve them")
        if request.request_id in self.scheduler.requests:
            return f"duplicate request id {request.request_id}"
        vocab_size = self.runner.vocab_size
        if vocab_size is not None:
            if not all(0 <= t < vocab_size for t in request.prompt_token_ids):
                return f"prompt token ids must be in [0, {vocab_size})"
            try:
                request.params.validate_token_ids(vocab_size)
            except SamplingParamsError as error:
                return str(error)
        if request.pooling is not None:
            if request.num_prompt_tokens > self.max_embedding_tokens:
                return (f"the input has {request.num_prompt_tokens} tokens; this model embeds at "
                        f"most {self.max_embedding_tokens} (context length, --max-prefill-tokens "
                        "and the KV pool bound it: an input is computed in one step)")
            return None
        if request.num_prompt_tokens >= self.context_length:
            return (f"prompt has {request.num_prompt_tokens} tokens; the context length is "
                    f"{self.context_length}")
        max_tokens = request.params.max_tokens
        pool_tokens = self.kv.pool_capacity_tokens
        if max_tokens is not None and request.num_prompt_tokens + max_tokens - 1 > pool_tokens:
            return (f"prompt ({request.num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) needs "
                    f"more KV cache than the pool holds ({pool_tokens} tokens)")
        if request.params.stop and self.tokenizer is None:
            return "stop strings need a tokenizer (the server runs with --skip-tokenizer-init)"
        return None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        for abort in self._hooks["abort"]:  # a stage's own ids (a beam search's clients)
            answer: RequestOutput | None = abort(request_id)
            if answer is not None:
                return answer
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        output = self._make_output(request)
        for on_finish in self._hooks["on_finish"]:
            on_finish(request, output)
        return output

    def has_unfinished(self) -> bool:
        return self.fatal_error is not None or self.scheduler.has_unfinished()

    def shutdown(self) -> None:
        """Close the stages (grammar compile workers, tiers, transfers), then the rank workers."""
        for close in self._hooks["close"]:
            close()
        self.runner.shutdown()

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Stages prepare, the scheduler plans, the model runs, the update applies the results."""
        if self.fatal_error is not None:
            raise self.fatal_error
        outputs: list[RequestOutput] = []
        for before_schedule in self._hooks["before_schedule"]:
            outputs += before_schedule(self)
        scheduled = self.scheduler.schedule()
        _mark_scheduled(scheduled)
        results = self._execute(scheduled)
        if scheduled.is_empty:
            self._wait_while_idle()
        return outputs + self.apply(scheduled, results)

    def _execute(self, scheduled: SchedulerOutput) -> list[StepResult]:
        if scheduled.is_empty:
            return []
        try:
            return self.executor.execute(scheduled)
        except (RankFailedError, NaNLogitsError) as error:  # no step can run again: end every request, then exit
            logger.error("%s; ending all %d requests", error, len(self.scheduler.requests))
            self.fatal_error = error
            for request in list(self.scheduler.requests.values()):
                self.scheduler.finish(request, FinishReason.ERROR, error=str(error))
                scheduled.finished.append(request)
            scheduled.scheduled = []
            return []
        except Exception as error:  # one bad batch must not take the server down
            logger.exception("forward pass failed; ending the %d requests in the batch",
                             len(scheduled.scheduled))
            for item in scheduled.scheduled:
                self.scheduler.finish(item.request, FinishReason.ERROR,
                                      error=f"forward pass failed: {error}")
                scheduled.finished.append(item.request)
            scheduled.scheduled = []
            return []

    def _wait_while_idle(self) -> None:
        """Nothing was scheduled: the first stage with something to wait for (grammar compiles,
        disk reads of the hierarchical cache, K/V from a prefill server) blocks briefly on it
        instead of spinning."""
        for wait_idle in self._hooks["wait_idle"]:
            if wait_idle():
                return

    def apply(self, scheduled: SchedulerOutput, results: list[StepResult]) -> list[RequestOutput]:
        """The update: the scheduler applies the results, the stages follow, and each touched
        request is detokenized and reported (every ``stream_interval`` tokens, and at its end)."""
        self.num_steps += 1
        for before_update in self._hooks["before_update"]:
            before_update(scheduled, results)
        touched = self.scheduler.update(scheduled, results)
        outputs: list[RequestOutput] = []
        for after_update in self._hooks["after_update"]:
            outputs += after_update(scheduled, results)
        on_new_tokens, on_finish = self._hooks["on_new_tokens"], self._hooks["on_finish"]
        interval = self.config.scheduler.stream_interval
        for request in touched:
            if request.is_internal:
                continue  # a stage answers for it (a beam: its search)
            if not request.is_finished:
                for hook in on_new_tokens:
                    hook(request)
            if request.first_token_wall_s is None and request.output_token_ids:
                request.first_token_wall_s = time.time()
            detokenize_start_s = time.perf_counter()
            self._detokenize(request)
            request.detokenize_s += time.perf_counter() - detokenize_start_s
            num_new = len(request.output_token_ids) - request.num_sent_tokens
            if not request.is_finished and num_new < interval:
                continue
            output = self._make_output(request)
            if request.is_finished:
                for hook in on_finish:
                    hook(request, output)
            outputs.append(output)
        self.num_generated_tokens += sum(len(r.token_ids) for r in results)
        return outputs

    def output_of(self, request: Request) -> RequestOutput:
        return self._make_output(request)

    def _detokenize(self, request: Request) -> None:
        """Decode the request's new tokens; a matched stop string ends it with reason "stop"."""
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is None or request.finish_reason is FinishReason.ERROR:
            return
        stop = detokenizer.add_tokens(request.output_token_ids)
        if stop is None:
            return
        # With speculation several tokens arrive at once: those after the one completing the stop
        # string were never generated as far as the client is concerned.
        request.truncate_output(detokenizer.num_output_tokens)
        if request.is_finished:  # the same token also hit a length limit: the stop string wins
            request.finish_reason, request.stop_reason = FinishReason.STOP, stop
        else:
            self.scheduler.finish(request, FinishReason.STOP, stop_reason=stop)

    def _make_output(self, request: Request) -> RequestOutput:
        new_ids = request.output_token_ids[request.num_sent_tokens:]
        detokenizer = self._detokenizers.get(request.request_id)
        text = ""
        if detokenizer is not None:
            detokenize_start_s = time.perf_counter()
            text = detokenizer.take_new_text(request.is_finished)
            request.detokenize_s += time.perf_counter() - detokenize_start_s
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
            num_cached_tokens=request.num_cached_tokens,
            error=request.error,
            error_status=request.error_status,
            embedding=request.pooling.embedding if request.pooling is not None else None,
            timings=_timings(request) if request.is_finished else None,
        )

    def flush_cache(self) -> dict[str, Any]:
        """Empty the prefix cache; refused while requests are queued or running."""
        if not self.scheduler.flush_cache():
            return {"success": False, "message": (
                f"cannot flush the cache while {len(self.scheduler.running)} requests are running "
                f"and {len(self.scheduler.waiting)} waiting; retry when the server is idle")}
        if self.kv.hicache is not None:
            self.kv.hicache.flush()
        return {"success": True, "message": "cache flushed"}

    def expert_distribution(self, action: str) -> dict[str, Any]:
        """The expert distribution recorder: start, stop or dump (engine/expert_stage.py)."""
        return expert_distribution_call(self.expert_load, action)

    def stats(self) -> dict[str, Any]:
        """Live pool, queue and cache figures. Used blocks (and ``token_usage``) are those held by
        requests; cached blocks nobody holds can be evicted at once, so they count as free and
        are also reported apart (``num_cached_blocks`` counts every cached block)."""
        pool = self.block_pool
        scheduler = self.scheduler
        cache = self.prefix_cache
        num_cached = cache.num_blocks if cache is not None else 0
        num_evictable = cache.num_evictable_blocks() if cache is not None else 0
        num_held = pool.num_used_blocks - num_evictable
        return {
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "num_used_blocks": num_held,
            "num_free_blocks": pool.num_free_blocks + num_evictable,
            "kv_pool_tokens": pool.num_blocks * self.runner.block_size,
            "token_usage": round(num_held / pool.num_blocks, 4),
            "prefix_cache": cache is not None,
            "num_cached_blocks": num_cached,
            "num_evictable_blocks": num_evictable,
            "num_prompt_tokens": scheduler.num_prompt_tokens,
            "num_cached_prompt_tokens": scheduler.num_cached_prompt_tokens,
            "num_prefill_tokens": scheduler.num_prefill_tokens,
            "cache_hit_rate": round(scheduler.num_cached_prompt_tokens
                                    / max(1, scheduler.num_prompt_tokens), 4),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "parallel": self.model_info.get("parallel"),
            "routes": self.model_info.get("routes"),
            "kv_pool": self.model_info.get("kv_pool"),
            **{key: value for stats in self._hooks["stats"] for key, value in stats().items()},
        }


def _refused(request: Request, refusal: Refusal) -> RequestOutput:
    """The finished error output of a request refused at submission."""
    return RequestOutput(request.request_id, [], "", finish_reason=FinishReason.ERROR.value,
                         error=refusal.reason, num_prompt_tokens=request.num_prompt_tokens,
                         error_status=refusal.status)


def _mark_scheduled(scheduled: SchedulerOutput) -> None:
    """The wall-clock time a request is first computed (the end of its queueing)."""
    now = None
    for item in scheduled.scheduled:
        if item.request.scheduled_wall_s is None:
            now = now or time.time()
            item.request.scheduled_wall_s = now


def _timings(request: Request) -> dict[str, float]:
    """A finished request's phase times (RequestOutput.timings)."""
    if request.finished_wall_s is None:
        request.finished_wall_s = time.time()
    phases = {"arrival": request.arrival_wall_s, "scheduled": request.scheduled_wall_s,
              "first_token": request.first_token_wall_s, "finished": request.finished_wall_s}
    timings = {name: value for name, value in phases.items() if value is not None}
    timings["detokenize_s"] = request.detokenize_s
    return timings
