"""--seed at engine level, on a tiny random Llama: a request without a seed
of its own draws from the server's seed and its arrival order, so two engines started with the same
seed give the same samples for the same arrivals, and another seed gives others. (The live check
across two real server starts, with the --random-seed alias, is tests/e2e/test_flags_live.py,
-m slow; tests/unit/test_cli.py parses the alias.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from tests.engine_drive import drain
from tests.tiny_models import make_tiny_model_dir

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8]]
PARAMS = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("seed"), "llama")


def samples(model_dir: Path, seed: int) -> list[list[int]]:
    """The prompts one after another, as the arrivals of a fresh engine."""
    engine = LLMEngine(EngineConfig.from_flat({"model": str(model_dir), "skip_tokenizer_init": True,
                                               "max_total_tokens": 1024, "num_threads": 1, "seed": seed}))
    try:
        outputs = []
        for index, prompt in enumerate(PROMPTS):
            tokens: dict[str, list[int]] = {}
            assert engine.add_request(str(index), prompt, PARAMS) is None
            drain(engine, tokens)
            outputs.append(tokens[str(index)])
        return outputs
    finally:
        engine.shutdown()


def test_same_seed_same_samples_across_engines(model_dir: Path) -> None:
    first = samples(model_dir, 11)
    assert samples(model_dir, 11) == first
    assert first[0] != first[2], "the same prompt later in the arrival order must draw differently"
    assert samples(model_dir, 12) != first
