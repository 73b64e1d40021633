"""The engine core: requests in, one step at a time, RequestOutputs out. Single-threaded (grammars
compile on GrammarCompiler's worker threads; the step only polls them).

``step()`` is grammars -> schedule -> execute -> update. A structured request waits in the queue
until its grammar has compiled (the scheduler skips it, the batch goes on); a grammar that fails
or runs past --grammar-compile-timeout ends its request with a 400. The core never raises for a
single request's failure: the request ends with finish_reason "error" and its blocks are freed. A failed forward
pass ends every request in that batch with an error and the loop goes on.
The runner's task (generate or embed) is fixed: a request for the other one is refused (400).
A failed rank (``RankFailedError``) is different: no later step can run. That step ends every
request with the rank's error, and the next ``step()`` raises it, so the engine process exits.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from servelm.cache.block_pool import BlockPool
from servelm.cache.radix_tree import RadixTree
from servelm.engine.hicache import build_hicache
from servelm.config import EAGLE_ALGORITHMS, EngineConfig
from servelm.constrained.compile_process import BackendRecipe
from servelm.constrained.compiler import GrammarCompiler
from servelm.constrained.grammar import GrammarError, check_backend_available
from servelm.distributed.errors import RankFailedError
from servelm.engine.beam import BeamSearches
from servelm.disagg.spec import KVTransfer
from servelm.engine.detokenizer import IncrementalDetokenizer
from servelm.engine.disaggregation import Disaggregation
from servelm.engine.executor import Executor, Runner
from servelm.engine.heap import keep_large_buffers
from servelm.engine.kv_manager import KVManager
from servelm.engine.outputs import RequestOutput
from servelm.engine.request import FinishReason, Request
from servelm.engine.scheduler import Scheduler, SchedulerOutput, StepResult
from servelm.lora.adapter import BaseShapes, LoRAAdapterError
from servelm.lora.manager import AdapterNotFoundError, LoRAManager, LoRASlots
from servelm.engine.speculation import Speculation
from servelm.sampling.params import SamplingParams, SamplingParamsError
from servelm.sampling.sampler import request_seed
from servelm.spec.proposer import Proposer
from servelm.spec.typical import make_typical_acceptance

if TYPE_CHECKING:
    from servelm.model.eagle import EagleHeadRunner
    from servelm.model.runner import ModelRunner

logger = logging.getLogger(__name__)

MAX_JUMP_FORWARD_CHARS = 256
"""Most forced text one step appends to a request (a grammar may force far more: a 100k-character
const, or with llguidance a recursion with no way out): the rest comes on later steps."""
_IDLE_COMPILE_WAIT_S = 0.01
"""How long an engine with nothing to run but compiling grammars sleeps per step."""

_EMBEDDING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
"""What an embedding request's scheduling reads of SamplingParams: no output beyond its prompt."""


class LLMEngine:
    """Scheduler + model executor + detokenizers, driven by ``step()``."""

    def __init__(self, config: EngineConfig, runner: Runner | None = None,
                 tokenizer: Any | None = None, eos_token_ids: list[int] | None = None,
                 context_length: int | None = None, proposer: Proposer | None = None) -> None:
        """``proposer`` replaces the one --speculative-algorithm names (tests force drafts)."""
        self.config = config
        check_backend_available(config.structured.grammar_backend)  # fail at start, not per request
        keep_large_buffers()   # a step's big buffers (logits) reused, not mapped and faulted afresh
        self.model_info: dict[str, Any] = {}
        self._draft_proposer: Proposer | None = None
        """STANDALONE: the draft model's proposer, built by ``_load`` beside the model."""
        if runner is None:
            runner, tokenizer, eos_token_ids, context_length = self._load(config)
        assert eos_token_ids is not None and context_length is not None
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self.task: str = runner.task
        """generate or embed (servelm.model.pooling.resolve_task); requests of the other are refused."""
        self.block_pool = BlockPool(runner.num_blocks)
        self.prefix_cache = None if config.cache.disable_radix_cache else RadixTree(
            self.block_pool, runner.block_size, config.cache.radix_eviction_policy)
        self.lora = self._make_lora_manager(runner)
        """The adapter registry (None without --enable-lora)."""
        self.hicache = build_hicache(config, runner, self.prefix_cache, self.block_pool)
        """Host and storage tiers below the pool (None without --enable-hierarchical-cache)."""
        self.kv = KVManager(self.block_pool, runner.block_size, self.prefix_cache, self.hicache)
        """Which blocks each request holds (prefix hits, growth, rollback, forks, parking)."""
        self.scheduler = Scheduler(config.scheduler, self.kv, seed=config.model.seed,
                                   max_adapters=config.lora.max_loras_per_batch if self.lora else None,
                                   adapter_slot=self._adapter_slot if self.lora else None)
        self.executor = Executor(runner)
        self.disaggregation = self._make_disaggregation(runner)
        """The prefill or decode side of K/V transfers (None: co-located, the default)."""
        self.speculation = Speculation(config.speculative, proposer or self._draft_proposer)
        """Drafts tokens before each schedule (--speculative-algorithm); off: does nothing."""
        self.executor.typical_acceptance = make_typical_acceptance(config.speculative)
        self.beams = BeamSearches(self.scheduler, tokenizer)
        """Beam-search requests (params.beam): their beams run as scheduler requests."""
        self._grammars = self._make_grammar_compiler()
        """Compiles grammars on worker threads (None: no tokenizer, --grammar-backend none or an
        embedding model); the backend itself is created on a worker at start-up."""
        self._compiling: list[Request] = []
        """Waiting requests whose grammar job is not resolved yet, in arrival order."""
        self.num_jump_forward_tokens = 0
        """Output tokens appended by grammar jump-forward instead of a model step."""
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.num_steps = 0
        self._num_arrivals = 0
        """Requests added so far: the arrival index that seeds an unseeded request's sampling."""
        self.num_generated_tokens = 0
        self.fatal_error: RankFailedError | None = None
        """Set when a rank failed: every request has been ended and the next step raises it."""
        self.model_info.update({
            "context_length": context_length,
            "eos_token_ids": eos_token_ids,
            "num_blocks": runner.num_blocks,
            "block_size": runner.block_size,
            "kv_pool_tokens": runner.num_blocks * runner.block_size,
            "task": self.task,
            "is_generation": self.task == "generate",
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
        if config.speculative.speculative_algorithm in EAGLE_ALGORITHMS:
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
        })
        return runner, tokenizer, list(source.eos_token_ids), source.context_length

    @staticmethod
    def _start_runner(config: EngineConfig, source: Any,
                      draft: ModelRunner | EagleHeadRunner | None = None) -> Runner:
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
    def _adapters_in_use(self) -> set[str]:
        """adapter_ids held by unfinished (queued or running) requests."""
        return {r.adapter_id for r in self.scheduler.requests.values() if r.adapter_id is not None}

    def _running_adapters(self) -> set[str]:
        return {r.adapter_id for r in self.scheduler.running if r.adapter_id is not None}

    def _adapter_slot(self, request: Request) -> int | str | None:
        """The scheduler's hook: the runner slot of a request being admitted (None: wait)."""
        assert self.lora is not None and request.adapter_id is not None
        try:
            return self.lora.acquire(request.adapter_id, self._running_adapters())
        except LoRAAdapterError as error:  # dropped from memory, then its files changed
            return f"the LoRA adapter could not be read again from disk: {error}"

    def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Register and load an adapter: {"success", "message", "status"} (400 naming the reason)."""
        if self.lora is None:
            return {"success": False, "status": 400,
                    "message": "LoRA is not enabled: start the server with --enable-lora"}
        try:
            loaded = self.lora.load(name, path, self._running_adapters())
        except LoRAAdapterError as error:
            return {"success": False, "status": 400, "message": str(error)}
        self.model_info["lora_adapters"] = self.lora.describe()
        return {"success": True, "status": 200,
                "message": f"LoRA adapter {name!r} loaded in {loaded.load_time_s:.3f} s",
                "load_time_s": loaded.load_time_s}

    def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        """Unregister an adapter; requests using it run to the end first (then its weights go)."""
        if self.lora is None:
            return {"success": False, "status": 400,
                    "message": "LoRA is not enabled: start the server with --enable-lora"}
        try:
            draining = self.lora.unload(name, self._adapters_in_use())
        except AdapterNotFoundError as error:
            return {"success": False, "status": 404, "message": str(error)}
        self.model_info["lora_adapters"] = self.lora.describe()
        note = " (its running requests finish first)" if draining else ""
        return {"success": True, "status": 200, "message": f"LoRA adapter {name!r} unloaded{note}"}

    @property
    def max_embedding_tokens(self) -> int:
        """Longest embedding input: it fits the context and one step (it is never chunked)."""
        pool_tokens = self.block_pool.num_blocks * self.runner.block_size
        return min(self.context_length, self.config.scheduler.max_tokens_per_step, pool_tokens)

    # -- requests ---------------------------------------------------------------------------
    def add_embedding_request(self, request_id: str, prompt_token_ids: list[int],
                              priority: int = 0) -> RequestOutput | None:
        """Queue an embedding request (task embed): it finishes with ``embedding`` set."""
        return self.add_request(request_id, prompt_token_ids, _EMBEDDING_PARAMS, priority,
                                is_embedding=True)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0, *,
                    is_embedding: bool = False, group: str = "", adapter_id: str | None = None,
                    lora_slot: int = 0, lora_name: str | None = None,
                    kv_transfer: KVTransfer | None = None) -> RequestOutput | None:
        """Queue a request. Returns a finished error output when it can never run (or when the
        waiting queue is full: ``error_status`` 503). ``lora_name``: the registered adapter it runs
        with (unknown: 404), which sets ``adapter_id`` (the prefix-cache root); its runner slot
        (``lora_slot``) comes at admission. Tests driving a runner's slots directly give
        ``adapter_id``/``lora_slot`` instead. None/0: the base model."""
        if lora_name is not None:
            refusal: tuple[str, int] | None = (
                "LoRA is not enabled: start the server with --enable-lora", 400)
            if self.lora is not None:
                try:
                    adapter_id, lora_slot, refusal = self.lora.resolve(lora_name), 0, None
                except AdapterNotFoundError as not_found:  # the slot comes at admission
                    refusal = (str(not_found), 404)
            if refusal is not None:
                return RequestOutput(request_id, [], "", finish_reason=FinishReason.ERROR.value,
                                     error=refusal[0], num_prompt_tokens=len(prompt_token_ids),
                                     error_status=refusal[1])
        request = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                          params=params, eos_token_ids=self.eos_token_ids,
                          max_context_tokens=self.context_length, priority=priority,
                          is_embedding=is_embedding, group=group,
                          default_seed=request_seed(self.config.model.seed, self._num_arrivals),
                          adapter_id=adapter_id, lora_slot=lora_slot)
        self._num_arrivals += 1
        max_queued = self.config.scheduler.max_queued_requests
        if max_queued is not None and len(self.scheduler.waiting) >= max_queued:
            return RequestOutput(request_id, [], "", finish_reason=FinishReason.ERROR.value,
                                 error=(f"the server is busy: {max_queued} requests are already "
                                        "waiting (--max-queued-requests); retry later"),
                                 num_prompt_tokens=request.num_prompt_tokens, error_status=503)
        error = self._check(request)
        if error is None and kv_transfer is not None:
            error = ("this server runs co-located (--disaggregation-mode null): it takes no K/V "
                     "transfers" if self.disaggregation is None
                     else self.disaggregation.check(request, kv_transfer))
        if error is not None:
            return RequestOutput(request_id, [], "", finish_reason=FinishReason.ERROR.value,
                                 error=error, num_prompt_tokens=request.num_prompt_tokens,
                                 error_status=400)
        if params.beam is not None:
            return self._add_beam_request(request)
        if params.structured is not None:
            try:
                request.grammar_job = self._compiler().submit(params.structured.kind,
                                                              params.structured.spec)
            except GrammarError as error:
                return RequestOutput(request_id, [], "", finish_reason=FinishReason.ERROR.value,
                                     error=str(error), num_prompt_tokens=request.num_prompt_tokens,
                                     error_status=400)
            self._compiling.append(request)
        if kv_transfer is not None:
            assert self.disaggregation is not None
            self.disaggregation.add(request, kv_transfer)
        if self.tokenizer is not None and not is_embedding:
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params)
        self.scheduler.add_request(request)
        return None

    def _add_beam_request(self, request: Request) -> RequestOutput | None:
        """Serve a beam-search request from its prompt's search (engine/beam.py)."""
        if self.speculation.is_enabled:
            return RequestOutput(request.request_id, [], "", finish_reason=FinishReason.ERROR.value,
                                 error="beam search is not supported with speculative decoding "
                                       "(--speculative-algorithm)",
                                 num_prompt_tokens=request.num_prompt_tokens, error_status=400)
        self.beams.add(request)
        return None

    def _check(self, request: Request) -> str | None:
        if not request.prompt_token_ids:
            return "the prompt is empty"
        if request.is_embedding != (self.task == "embed"):
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
        if request.is_embedding:
            if request.num_prompt_tokens > self.max_embedding_tokens:
                return (f"the input has {request.num_prompt_tokens} tokens; this model embeds at "
                        f"most {self.max_embedding_tokens} (context length, --max-prefill-tokens "
                        "and the KV pool bound it: an input is computed in one step)")
            return None
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

    def _make_grammar_compiler(self) -> GrammarCompiler | None:
        structured = self.config.structured
        if self.tokenizer is None or structured.grammar_backend == "none" or self.task != "generate":
            return None
        recipe = BackendRecipe(structured.grammar_backend, self.tokenizer, self.runner.vocab_size,
                               list(self.eos_token_ids),
                               structured.constrained_json_whitespace_pattern)
        # The backend is created on a compile worker (2.5-8 s for a real vocab).
        return GrammarCompiler(recipe.create, structured.grammar_compile_timeout,
                               structured.max_grammar_spec_bytes,
                               recipe=None if structured.disable_grammar_compile_process else recipe)

    def _compiler(self) -> GrammarCompiler:
        if self._grammars is not None:
            return self._grammars
        if self.tokenizer is None:
            raise GrammarError("structured output needs a tokenizer (the server runs with "
                               "--skip-tokenizer-init)")
        raise GrammarError("structured output is disabled (--grammar-backend none)")

    def _resolve_grammars(self) -> list[RequestOutput]:
        """Give each request whose grammar has compiled its matcher (the scheduler may then
        admit it); end with a 400 those whose grammar failed or ran past its time budget."""
        if not self._compiling:
            return []
        assert self._grammars is not None
        outputs = []
        still_compiling = []
        for request in self._compiling:
            if request.is_finished:  # aborted while compiling
                continue
            assert request.grammar_job is not None
            try:
                compiled = self._grammars.poll(request.grammar_job)
                if compiled is None:
                    still_compiling.append(request)
                    continue
                request.grammar = self._grammars.make_matcher(compiled)
                self.executor.grammar_backend = self._grammars.backend
            except GrammarError as error:
                self.scheduler.finish(request, FinishReason.ERROR, error=str(error), error_status=400)
                outputs.append(self._make_output(request))
            request.grammar_job = None
        self._compiling = still_compiling
        return outputs

    def abort_request(self, request_id: str) -> RequestOutput | None:
        if self.beams.owns(request_id):
            return self.beams.abort(request_id)
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        self.speculation.release(request)
        if self.lora is not None and self.lora.has_unloaded:
            self.lora.release_unused(self._adapters_in_use())
        return self._make_output(request)

    def has_unfinished(self) -> bool:
        return self.fatal_error is not None or self.scheduler.has_unfinished()

    def shutdown(self) -> None:
        """Stop the rank workers (nothing to do at tp 1) and the grammar compile workers."""
        if self._grammars is not None:
            self._grammars.close()
        if self.hicache is not None:
            self.hicache.close()
        if self.disaggregation is not None:
            self.disaggregation.close()
        self.runner.shutdown()

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.fatal_error is not None:
            raise self.fatal_error
        refused = self._resolve_grammars()
        if self.disaggregation is not None:  # K/V that arrived: those requests' first tokens
            arrived = self.disaggregation.before_schedule(len(self.scheduler.running))
            if arrived[0].scheduled or arrived[0].finished:
                refused += self._update(*arrived)
        self.speculation.propose(self.scheduler)
        scheduled = self.scheduler.schedule()
        results = self._execute(scheduled)
        if scheduled.is_empty:
            self._wait_while_idle()
        outputs = refused + self._update(scheduled, results)
        self.speculation.move_accepted_paths(self.scheduler, self.runner)
        if self.lora is not None and self.lora.has_unloaded:
            self.lora.release_unused(self._adapters_in_use())
        return outputs

    def _execute(self, scheduled: SchedulerOutput) -> list[StepResult]:
        if scheduled.is_empty:
            return []
        try:
            return self.executor.execute(scheduled)
        except RankFailedError as error:  # no step can run again: end every request, then exit
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
        """Nothing was scheduled: block briefly on what the waiting requests wait for (grammar
        compiles, disk reads of the hierarchical cache, K/V from a prefill server) instead of
        spinning."""
        if self._compiling:
            assert self._grammars is not None
            self._grammars.wait([r.grammar_job for r in self._compiling if r.grammar_job],
                                _IDLE_COMPILE_WAIT_S)
        elif self.hicache is not None and self.hicache.is_holding_requests:
            self.hicache.wait_for_reads(_IDLE_COMPILE_WAIT_S)
        elif self.disaggregation is not None and self.disaggregation.is_waiting:
            self.disaggregation.wait()

    def _update(self, scheduled: SchedulerOutput, results: list[StepResult]) -> list[RequestOutput]:
        self.num_steps += 1
        self.speculation.record(scheduled, results)
        touched = self.scheduler.update(scheduled, results)
        outputs = self.beams.update(scheduled, results)
        interval = self.config.scheduler.stream_interval
        for request in touched:
            if request.is_beam:
                continue  # its search answers for it
            if request.grammar is not None and not request.is_finished:
                self._jump_forward(request)
            self._detokenize(request)
            num_new = len(request.output_token_ids) - request.num_sent_tokens
            if not request.is_finished and num_new < interval:
                continue
            transfer_params = None
            if request.is_finished:
                self.speculation.release(request)
                if self.disaggregation is not None:
                    transfer_params = self.disaggregation.on_finished(request)
            outputs.append(self._make_output(request))
            outputs[-1].kv_transfer_params = transfer_params
        self.num_generated_tokens += sum(len(r.token_ids) for r in results)
        return outputs

    def _jump_forward(self, request: Request) -> None:
        """Append the text the grammar forces next (e.g. '": ' after a key) without sampling it.

        The forced text is tokenized and each token fed to the matcher; the first token it refuses
        (a tokenization that does not line up with the grammar) ends the jump. The appended tokens
        are ordinary output tokens: the scheduler computes their K/V next step with the same
        catch-up arithmetic as a prompt chunk, and samples after the last one.
        """
        params = request.params
        if (self.config.structured.disable_jump_forward or self.tokenizer is None
                or params.logprobs is not None or request.grammar is None):
            return
        forced = request.grammar.forced_text()
        if not forced:
            return
        token_ids = self.tokenizer.encode(forced[:MAX_JUMP_FORWARD_CHARS], add_special_tokens=False)
        if len(forced) > MAX_JUMP_FORWARD_CHARS:
            token_ids = token_ids[:-1]  # the cut may split a token: its text comes next step
        budget = request.max_context_tokens - request.num_tokens - 1
        if params.max_tokens is not None:
            budget = min(budget, params.max_tokens - len(request.output_token_ids) - 1)
        for token_id in token_ids[:max(budget, 0)]:
            if not request.grammar.accept_token(token_id):
                break
            request.output_token_ids.append(token_id)
            self.num_jump_forward_tokens += 1

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
            num_cached_tokens=request.num_cached_tokens,
            error=request.error,
            error_status=request.error_status,
            embedding=request.embedding,
        )

    def flush_cache(self) -> dict[str, Any]:
        """Empty the prefix cache; refused while requests are queued or running."""
        if not self.scheduler.flush_cache():
            return {"success": False, "message": (
                f"cannot flush the cache while {len(self.scheduler.running)} requests are running "
                f"and {len(self.scheduler.waiting)} waiting; retry when the server is idle")}
        if self.hicache is not None:
            self.hicache.flush()
        return {"success": True, "message": "cache flushed"}

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
            "cache_hit_rate": round(scheduler.num_cached_prompt_tokens
                                    / max(1, scheduler.num_prompt_tokens), 4),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "parallel": self.model_info.get("parallel"),
            **({"lora_adapters": self.lora.describe()} if self.lora is not None else {}),
            **self.speculation.stats(),
            **(self.hicache.stats() if self.hicache is not None else {}),
            **self.beams.stats(),
            **(self.disaggregation.stats() if self.disaggregation is not None else {}),
        }
