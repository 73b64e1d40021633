"""SGLang's EAGLE / EAGLE-3 spellings resolve to one SpeculativeConfig (flags only; the refusals
sit with the other proposers' in test_draft_flags.py)."""

from __future__ import annotations

import pytest

from servelm import cli_args


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_eagle_spellings(algorithm: str) -> None:
    """SGLang's: --speculative-algorithm EAGLE3 --speculative-draft-model-path HEAD, topk 1 and the
    step count (one draft per step of the chain)."""
    config = cli_args.parse_args([
        "--speculative-algorithm", algorithm, "--speculative-draft-model-path", "head",
        "--speculative-eagle-topk", "1", "--speculative-num-steps", "3"]).speculative
    assert (config.speculative_algorithm, config.speculative_draft_model_path,
            config.speculative_eagle_topk, config.max_draft_tokens) == (algorithm, "head", 1, 3)
    with pytest.raises(SystemExit):
        cli_args.parse_args(["--speculative-eagle-topk", "1"])   # needs --speculative-algorithm
