"""--enable-nan-detection and --crash-on-nan on an engine whose runner puts NaN in the logits of
one request (prompts starting with BAD), away from the token the model predicts."""

from __future__ import annotations

import logging

import pytest
import torch

from servelm.config import EngineConfig, ObservabilityConfig
from servelm.engine.engine import LLMEngine
from servelm.engine.executor import NaNLogitsError
from servelm.sampling.params import SamplingParams

from .fake_runner import FakeRunner

EOS = 96
BAD = 77
GOOD_PROMPT, BAD_PROMPT = [5, 6, 7], [BAD, 6, 7]


class NaNRunner(FakeRunner):
    def execute(self, plan):  # type: ignore[no-untyped-def]
        logits = super().execute(plan)
        row = 0
        for seq in plan.sequences:
            if self.slots[self._slot(seq.block_ids, 0)] == BAD:
                for r in range(row, row + seq.num_logits):
                    wrong = (int(logits[r].argmax()) + 1) % self.vocab_size
                    logits[r, wrong] = float("nan")
            row += seq.num_logits
        return logits


def run(nan_check: dict[str, bool]) -> tuple[LLMEngine, NaNRunner, dict[str, list[int]], dict[str, str]]:
    runner = NaNRunner()
    engine = LLMEngine(EngineConfig(observability=ObservabilityConfig(**nan_check)), runner=runner,
                       tokenizer=None, eos_token_ids=[EOS], context_length=512)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert engine.add_request("good", GOOD_PROMPT, params) is None
    assert engine.add_request("bad", BAD_PROMPT, params) is None
    tokens: dict[str, list[int]] = {"good": [], "bad": []}
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        try:
            step_outputs = engine.step()
        except NaNLogitsError:  # fatal (a dead engine reports unfinished work until it exits)
            break
        for output in step_outputs:
            tokens[output.request_id] += output.new_token_ids
            if output.is_finished:
                reasons[output.request_id] = output.finish_reason or ""
    return engine, runner, tokens, reasons


def test_without_detection_nan_takes_the_argmax() -> None:
    """The case the check exists for: argmax over a row with NaN picks the NaN."""
    _, runner, tokens, _ = run({})
    assert tokens["good"] == runner.reference(GOOD_PROMPT, 4)
    assert tokens["bad"] != runner.reference(BAD_PROMPT, 4)


def test_detection_logs_and_samples_around_nan(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("servelm.engine.executor")
    logger.addHandler(caplog.handler)  # servelm's loggers may not propagate (configure_logging)
    try:
        with caplog.at_level(logging.WARNING, logger="servelm.engine.executor"):
            _, runner, tokens, reasons = run({"enable_nan_detection": True})
    finally:
        logger.removeHandler(caplog.handler)
    assert tokens["bad"] == runner.reference(BAD_PROMPT, 4)
    assert tokens["good"] == runner.reference(GOOD_PROMPT, 4)
    assert reasons == {"good": "length", "bad": "length"}
    records = {id(r): r for r in caplog.records}.values()  # once, whichever handler caught it
    warnings = [r.getMessage() for r in records if "NaN in the logits" in r.getMessage()]
    assert len(warnings) == 4 and all("['bad']" in line for line in warnings)


def test_crash_on_nan_ends_every_request_and_the_engine() -> None:
    engine, _, _, reasons = run({"crash_on_nan": True})
    assert reasons == {"good": "error", "bad": "error"}
    assert isinstance(engine.fatal_error, NaNLogitsError)
    with pytest.raises(NaNLogitsError, match="--crash-on-nan"):
        engine.step()


def test_nan_fill_is_only_where_nan() -> None:
    logits = torch.tensor([[1.0, float("nan"), float("-inf")]])
    from servelm.engine.executor import NAN_FILL

    filled = logits.masked_fill(torch.isnan(logits), NAN_FILL)
    assert filled.tolist() == [[1.0, NAN_FILL, float("-inf")]]


class ScreenedRunner(NaNRunner):
    """The LM-head screen's contract: for the GOOD request's rows the runner gives the token in
    ``plan.argmax_tokens``, as the screen does for a row whose values are finite; a NaN is then planted
    in that row's logits (which the screen never leaves) to show the check does not read them."""

    def execute(self, plan):  # type: ignore[no-untyped-def]
        logits = super().execute(plan)
        row = 0
        for seq in plan.sequences:
            if self.slots[self._slot(seq.block_ids, 0)] != BAD:
                for r in range(row, row + seq.num_logits):
                    best = int(logits[r].argmax())
                    plan.argmax_tokens[r] = best
                    logits[r, (best + 1) % self.vocab_size] = float("nan")
            row += seq.num_logits
        return logits


def test_rows_the_screen_answered_are_not_read_by_the_check(caplog: pytest.LogCaptureFixture) -> None:
    """The check reads only the rows without a screened token (a 32-stream step's logits are nearly all
    screened rows: -inf but for their candidates): the other request's NaN is still found and logged."""
    runner = ScreenedRunner()
    engine = LLMEngine(EngineConfig(observability=ObservabilityConfig(enable_nan_detection=True)), runner=runner,
                       tokenizer=None, eos_token_ids=[EOS], context_length=512)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("good", GOOD_PROMPT, params)
    engine.add_request("bad", BAD_PROMPT, params)
    logger = logging.getLogger("servelm.engine.executor")
    logger.addHandler(caplog.handler)
    tokens: dict[str, list[int]] = {"good": [], "bad": []}
    try:
        with caplog.at_level(logging.WARNING, logger="servelm.engine.executor"):
            while engine.has_unfinished():
                for output in engine.step():
                    tokens[output.request_id] += output.new_token_ids
    finally:
        logger.removeHandler(caplog.handler)
    assert tokens == {"good": runner.reference(GOOD_PROMPT, 4), "bad": runner.reference(BAD_PROMPT, 4)}
    records = {id(r): r for r in caplog.records}.values()
    warnings = [r.getMessage() for r in records if "NaN in the logits" in r.getMessage()]
    assert len(warnings) == 4 and all("1 row(s)" in line and "['bad']" in line for line in warnings)
