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


def test_tree_flags_and_draft_counts() -> None:
    from servelm.config import SpeculativeConfig

    def config(**kwargs):  # type: ignore[no-untyped-def]
        return SpeculativeConfig(speculative_algorithm="EAGLE", speculative_draft_model_path="h", **kwargs)

    assert config().max_draft_tokens == 5
    assert config(speculative_num_steps=8).max_draft_tokens == 8          # SGLang: steps alone
    assert config(speculative_num_steps=3, num_speculative_tokens=2).max_draft_tokens == 2
    tree = config(speculative_eagle_topk=4, speculative_num_steps=3)
    assert tree.is_tree and tree.max_draft_tokens == 12 and tree.max_draft_positions == 12
    parsed = cli_args.parse_args(["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                                  "h", "--speculative-eagle-topk", "4", "--speculative-num-steps", "3",
                                  "--speculative-num-draft-tokens", "8"]).speculative
    assert (parsed.speculative_eagle_topk, parsed.speculative_num_steps, parsed.max_draft_tokens) == (4, 3, 7)
