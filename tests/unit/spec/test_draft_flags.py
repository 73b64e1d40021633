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
    assert config.max_draft_tokens == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative_algorithm="STANDALONE"), "needs a draft model"),
    (dict(speculative_algorithm="NGRAM", speculative_draft_model_path="d"), "contradicts"),
    (dict(speculative_algorithm="EAGLE"), "needs its head checkpoint"),
    (dict(speculative_algorithm="EAGLE3"), "needs its head checkpoint"),
    (dict(speculative_algorithm="NEXTN", speculative_draft_model_path="d"), "would not be read"),
    (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=2), "EAGLE / EAGLE3 / NEXTN"),
    (dict(speculative_algorithm="EAGLE", speculative_draft_model_path="h",
          speculative_eagle_topk=4), "give its depth with --speculative-num-steps"),
    (dict(speculative_algorithm="EAGLE", speculative_draft_model_path="h", speculative_eagle_topk=2,
          speculative_num_steps=2, num_speculative_tokens=7), "exceeds the 6 candidates"),
    (dict(speculative_algorithm="EAGLE", speculative_draft_model_path="h", speculative_eagle_topk=0),
     "at least 1"),
    (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=1), "applies to EAGLE"),
    (dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="h",
          speculative_token_map="m.pt"), "own reduced vocabulary"),
])
def test_refusals(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)  # type: ignore[arg-type]


def test_lightllm_mtp_flags_map_or_are_refused_naming_the_mtp_layers() -> None:
    """--mtp_draft_model_dir is the draft model and --mtp_step its k; --mtp_mode asks for MTP
    weights extracted into that directory, which servelm does not read (NEXTN reads the model's
    own): only None is accepted."""
    config = cli_args.parse_args(["--mtp_mode", "None", "--mtp_draft_model_dir", "d",
                                  "--mtp_step", "2"]).speculative
    assert (config.speculative_algorithm, config.speculative_draft_model_path,
            config.num_speculative_tokens) == ("STANDALONE", "d", 2)
    refusals = [
        (["--mtp_mode", "deepseekv3", "--mtp_draft_model_dir", "d", "--mtp_step", "1"],
         "multi-token-prediction layer.*--speculative-algorithm NEXTN"),
        (["--mtp_draft_model_dir", "d", "--mtp_step", "0"], "LightLLM's 0 means no speculation"),
        (["--mtp_step", "2"], "--mtp_step has no effect without --speculative-algorithm"),
    ]
    for argv, message in refusals:
        with pytest.raises(cli_args.CliError, match=message):
            cli_args.build_config(argv)



def test_nextn_is_a_head_algorithm() -> None:
    """NEXTN needs no path (the MTP layer is in the model's checkpoint) and takes EAGLE's chain and
    tree flags (the model is checked at start-up: tests/e2e/test_speculative_nextn_tiny.py)."""
    config = cli_args.parse_args(["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"]).speculative
    assert (config.speculative_algorithm, config.speculative_draft_model_path, config.max_draft_tokens,
            config.is_tree) == ("NEXTN", None, 2, False)
    tree = SpeculativeConfig(speculative_algorithm="NEXTN", speculative_eagle_topk=2, speculative_num_steps=3)
    assert tree.is_tree and tree.max_draft_tokens == 6
