"""The draft-model spellings of the three engines resolve to one SpeculativeConfig, and what is
not built is refused with its reason (no model is loaded: flags only)."""

from __future__ import annotations

import pytest

from servelm import cli_args
from servelm.config import SpeculativeConfig


@pytest.mark.parametrize("argv", [
    ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d"],  # SGLang
    ["--speculative-draft-model", "d"],                                                # SGLang
    ["--speculative-model", "d"],                                                      # vLLM
    ["--mtp_draft_model_dir", "d", "--mtp_mode", "None"],                               # LightLLM
])
def test_draft_model_spellings(argv: list[str]) -> None:
    speculative = cli_args.parse_args(argv).speculative
    assert speculative.speculative_algorithm == "STANDALONE"
    assert speculative.speculative_draft_model_path == "d"


def test_steps_and_ngram_spellings() -> None:
    config = cli_args.parse_args(["--speculative-model", "[ngram]", "--mtp_step", "3"]).speculative
    assert (config.speculative_algorithm, config.speculative_draft_model_path,
            config.num_speculative_tokens) == ("NGRAM", None, 3)
    config = cli_args.parse_args(["--speculative-model", "d", "--speculative-num-steps", "2"]).speculative
    assert config.num_speculative_tokens == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative_algorithm="STANDALONE"), "needs a draft model"),
    (dict(speculative_algorithm="NGRAM", speculative_draft_model_path="d"), "contradicts"),
    (dict(speculative_algorithm="EAGLE"), "needs its head checkpoint"),
    (dict(speculative_algorithm="EAGLE3"), "needs its head checkpoint"),
    (dict(speculative_algorithm="NEXTN"), "multi-token-prediction"),
    (dict(speculative_algorithm="EAGLE", speculative_draft_model_path="h",
          speculative_eagle_topk=4), "tree of drafts is not built"),
    (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=1), "applies to EAGLE"),
    (dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="h",
          speculative_token_map="m.pt"), "own reduced vocabulary"),
])
def test_refusals(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)  # type: ignore[arg-type]
