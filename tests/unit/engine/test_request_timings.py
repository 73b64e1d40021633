"""The engine's phase times on a finished output (RequestOutput.timings), which traces and the
request time stats log turn into queue, prefill, decode and detokenize durations."""

from __future__ import annotations

import time

from servelm.config import EngineConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from servelm.server.tracing import phase_durations

from .fake_runner import FakeRunner

EOS = 96


def test_second_request_queues_while_the_first_runs() -> None:
    """One running request at a time: b's queue phase spans a's whole run, and every request's
    phases are ordered arrival <= scheduled <= first token <= finished."""
    config = EngineConfig(scheduler=SchedulerConfig(max_running_requests=1))
    engine = LLMEngine(config, runner=FakeRunner(), tokenizer=None, eos_token_ids=[EOS],
                       context_length=512)
    before = time.time()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for request_id in ("a", "b"):
        assert engine.add_request(request_id, [3, 1, 4, 1, 5], params) is None
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            assert (output.timings is not None) == output.is_finished
            if output.is_finished:
                finished[output.request_id] = output.timings
    after = time.time()
    for timings in finished.values():
        order = [timings[k] for k in ("arrival", "scheduled", "first_token", "finished")]
        assert before <= order[0] and order == sorted(order) and order[-1] <= after
        assert timings["detokenize_s"] >= 0
    a, b = finished["a"], finished["b"]
    assert b["scheduled"] >= a["finished"] - 1e-3  # b waited for a's slot
    durations = phase_durations(b)
    assert durations["queue"] >= a["finished"] - a["arrival"] - 0.05
    assert durations["queue"] > phase_durations(a)["queue"]
