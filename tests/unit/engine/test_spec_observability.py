"""The speculative-decoding figures reach every place issue 15 names, whatever the proposer:
the engine's stats (/get_server_info reads them), the /metrics gauges, the stats log line and the
`servelm bench` report. The figures come from ``Speculation.record`` (verify results), never from
the proposer, so a proposer added later (EAGLE) gets them by having a ``name``: checked here with
n-gram, a forced proposer of another name and the draft-model proposer over the fake runner."""

from __future__ import annotations

import pytest
import torch

from servelm.bench_common import format_speculative, speculative_summary
from servelm.cache.block_pool import BlockPool
from servelm.config import CacheConfig, EngineConfig, SpeculativeConfig
from servelm.engine.engine import LLMEngine
from servelm.engine.monitor import StatsLogger
from servelm.server.observe import ServerMetrics
from servelm.spec.draft_model import DraftModelProposer, DraftSequence

from .fake_runner import FakeRunner
from .test_engine_core import EOS, PROMPTS, greedy, run_all
from .test_speculative import OracleProposer


class FakeDraftRunner:
    """A draft 'model' that predicts the fake model's next token (logits of the last position)."""

    block_size = 4

    def __init__(self, target: FakeRunner) -> None:
        self.target = target
        self.cached: dict[tuple[int, ...], list[int]] = {}

    def forward_last(self, sequences: list[DraftSequence]) -> torch.Tensor:
        logits = torch.zeros(len(sequences), self.target.vocab_size)
        for row, sequence in enumerate(sequences):
            key = tuple(sequence.block_ids)
            context = self.cached.get(key, [])[:sequence.start_position] + list(sequence.token_ids)
            self.cached[key] = context
            logits[row, self.target.predict(context)] = 5.0
        return logits


def make(proposer: str) -> LLMEngine:
    runner = FakeRunner(num_blocks=64, block_size=4)
    chosen = {"ngram": None, "oracle": OracleProposer(runner),
              "draft": DraftModelProposer(FakeDraftRunner(runner), BlockPool(64), seed=0)}[proposer]
    config = EngineConfig(speculative=SpeculativeConfig(speculative_algorithm="NGRAM",
                                                        num_speculative_tokens=4,
                                                        ngram_prompt_lookup_min=1),
                          cache=CacheConfig(disable_radix_cache=True))
    return LLMEngine(config, runner=runner, eos_token_ids=[EOS], context_length=512, proposer=chosen)


@pytest.mark.parametrize("proposer, name", [("ngram", "NGRAM"), ("oracle", "ORACLE"),
                                            ("draft", "STANDALONE")])
def test_figures_reach_stats_metrics_log_line_and_bench(proposer: str, name: str) -> None:
    engine = make(proposer)
    requests = {str(i): (prompt, greedy(20)) for i, prompt in enumerate(PROMPTS[:4])}
    requests["every token"] = (list(range(1, 97)), greedy(20))  # n-gram always finds a match
    run_all(engine, requests)
    stats = engine.stats()
    assert stats["speculative_algorithm"] == name
    passes, drafted, accepted = (stats["spec_num_verify_passes"], stats["spec_num_draft_tokens"],
                                 stats["spec_num_accepted_tokens"])
    assert passes > 0 and 0 <= accepted <= drafted, stats
    assert accepted > 0 or proposer == "ngram"  # the fake model rarely repeats its prompt
    assert stats["spec_accept_length"] == round((accepted + passes) / passes, 4)
    assert stats["spec_acceptance_rate"] == round(accepted / drafted, 4)

    line = StatsLogger(engine, engine.config.observability).line(10, 1.0)
    assert f"spec_accept_length={stats['spec_accept_length']:.2f}" in line
    assert f"spec_acceptance_rate={100 * stats['spec_acceptance_rate']:.1f}%" in line

    metrics = ServerMetrics(engine.config)
    metrics.set_engine_stats(stats)
    text = metrics.render()[0].decode()
    for gauge, key in (("spec_accept_length", "spec_accept_length"),
                       ("spec_acceptance_rate", "spec_acceptance_rate"),
                       ("spec_num_draft_tokens", "spec_num_draft_tokens"),
                       ("spec_num_accepted_tokens", "spec_num_accepted_tokens")):
        sample = next(row for row in text.splitlines() if row.startswith(f"servelm:{gauge}{{"))
        assert float(sample.split()[-1]) == pytest.approx(stats[key]), sample

    # `servelm bench`: the figures of the requests between two snapshots.
    before = dict(stats)
    run_all(engine, {"late": (list(range(96, 0, -1)), greedy(12))})
    summary = speculative_summary(before, engine.stats())
    assert summary["speculative_algorithm"] == name
    assert summary["spec_num_draft_tokens"] == engine.stats()["spec_num_draft_tokens"] - drafted
    report = format_speculative(summary)
    assert report is not None and report.startswith(f"speculative decoding ({name}): accept length")
    assert speculative_summary(None, {"num_running": 0}) == {} and format_speculative({}) is None
