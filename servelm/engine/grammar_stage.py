"""The structured-output stage: grammars compile off the step, then jump-forward after each update.

A structured request waits in the queue until its grammar has compiled (``Request.is_compiling``:
the scheduler skips it, the batch goes on); a grammar that fails or runs past
--grammar-compile-timeout ends its request with a 400. The executor masks each grammar request's
rows with the backend this stage's compiler created (``backend``); the scheduler feeds accepted
tokens to the matcher (``stop_rules``); after the update this stage appends the text the grammar
forces next (jump-forward).
"""

from __future__ import annotations

from typing import Any

from servelm.config import EngineConfig
from servelm.constrained.compile_process import BackendRecipe
from servelm.constrained.compiler import GrammarCompiler
from servelm.constrained.grammar import GrammarBackend, GrammarError
from servelm.engine.outputs import RequestOutput
from servelm.engine.frontdoor import SubmitRequest
from servelm.engine.request import FinishReason, GrammarState, Request
from servelm.engine.scheduler import Scheduler
from servelm.engine.stage import Refusal, Stage, StepCore

MAX_JUMP_FORWARD_CHARS = 256
"""Most forced text one step appends to a request (a grammar may force far more: a 100k-character
const, or with llguidance a recursion with no way out): the rest comes on later steps."""
IDLE_COMPILE_WAIT_S = 0.01
"""How long an engine with nothing to run but compiling grammars sleeps per step."""


def make_grammar_compiler(config: EngineConfig, tokenizer: Any | None, vocab_size: int,
                          eos_token_ids: list[int], task: str) -> GrammarCompiler | None:
    """None: no tokenizer, --grammar-backend none or an embedding model."""
    structured = config.structured
    if tokenizer is None or structured.grammar_backend == "none" or task != "generate":
        return None
    recipe = BackendRecipe(structured.grammar_backend, tokenizer, vocab_size, list(eos_token_ids),
                           structured.constrained_json_whitespace_pattern)
    # The backend is created on a compile worker (2.5-8 s for a real vocab).
    return GrammarCompiler(recipe.create, structured.grammar_compile_timeout,
                           structured.max_grammar_spec_bytes,
                           recipe=None if structured.disable_grammar_compile_process else recipe)


class Grammars(Stage):
    """Compiles grammars on worker threads and jumps forward over forced text."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, tokenizer: Any | None,
                 compiler: GrammarCompiler | None) -> None:
        self.is_jump_forward_enabled = not config.structured.disable_jump_forward
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.compiler = compiler
        """The backend itself is created on a worker at start-up (None: structured output off)."""
        self.compiling: list[Request] = []
        """Waiting requests whose grammar job is not resolved yet, in arrival order."""
        self.num_jump_forward_tokens = 0
        """Output tokens appended by jump-forward instead of a model step."""

    @property
    def backend(self) -> GrammarBackend | None:
        """The executor's masks: the compiler's backend once a worker has created it."""
        return self.compiler.backend if self.compiler is not None else None

    def check(self, request: Request, submission: SubmitRequest) -> Refusal | None:
        """A structured request needs the compiler (a tokenizer and a grammar backend)."""
        if request.params.structured is None or self.compiler is not None:
            return None
        if self.tokenizer is None:
            return Refusal("structured output needs a tokenizer (the server runs with "
                           "--skip-tokenizer-init)")
        return Refusal("structured output is disabled (--grammar-backend none)")

    def on_add(self, request: Request, submission: SubmitRequest) -> bool:
        """Start compiling a structured request's grammar (off the step); it waits meanwhile."""
        structured = request.params.structured
        if structured is None:
            return False
        assert self.compiler is not None
        request.grammar = GrammarState(job=self.compiler.submit(structured.kind, structured.spec))
        self.compiling.append(request)
        return False

    def before_schedule(self, core: StepCore) -> list[RequestOutput]:
        """Give each request whose grammar has compiled its matcher (the scheduler may then
        admit it); end with a 400 those whose grammar failed or ran past its time budget."""
        if not self.compiling:
            return []
        assert self.compiler is not None
        outputs = []
        still_compiling = []
        for request in self.compiling:
            if request.is_finished:  # aborted while compiling
                continue
            grammar = request.grammar
            assert grammar is not None and grammar.job is not None
            try:
                compiled = self.compiler.poll(grammar.job)
                if compiled is None:
                    still_compiling.append(request)
                    continue
                grammar.matcher = self.compiler.make_matcher(compiled)
            except GrammarError as error:
                self.scheduler.finish(request, FinishReason.ERROR, error=str(error), error_status=400)
                outputs.append(core.output_of(request))
            grammar.job = None
        self.compiling = still_compiling
        return outputs

    def on_new_tokens(self, request: Request) -> None:
        """Append the text the grammar forces next (e.g. '": ' after a key) without sampling it.

        The forced text is tokenized and each token fed to the matcher; the first token it refuses
        (a tokenization that does not line up with the grammar) ends the jump. The appended tokens
        are ordinary output tokens: the scheduler computes their K/V next step with the same
        catch-up arithmetic as a prompt chunk, and samples after the last one.
        """
        params = request.params
        matcher = request.grammar.matcher if request.grammar is not None else None
        if (matcher is None or not self.is_jump_forward_enabled or self.tokenizer is None
                or params.logprobs is not None):
            return
        forced = matcher.forced_text()
        if not forced:
            return
        token_ids = self.tokenizer.encode(forced[:MAX_JUMP_FORWARD_CHARS], add_special_tokens=False)
        if len(forced) > MAX_JUMP_FORWARD_CHARS:
            token_ids = token_ids[:-1]  # the cut may split a token: its text comes next step
        for token_id in token_ids[:request.num_appendable_tokens()]:
            if not matcher.accept_token(token_id):
                break
            request.output_token_ids.append(token_id)
            self.num_jump_forward_tokens += 1

    def wait_idle(self) -> bool:
        if not self.compiling:
            return False
        assert self.compiler is not None
        self.compiler.wait([r.grammar.job for r in self.compiling if r.grammar is not None and r.grammar.job],
                           IDLE_COMPILE_WAIT_S)
        return True

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
