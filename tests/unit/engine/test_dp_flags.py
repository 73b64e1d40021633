"""Data-parallel flags: every spelling reaches the config; bad values are refused naming the flag."""

import pytest

from servelm import cli_args


@pytest.mark.parametrize("flag", ["--dp-size", "--data-parallel-size", "--dp", "-dp"])
def test_dp_spellings(flag: str) -> None:
    config = cli_args.build_config(["smollm2-135m", flag, "3", "--load-balance-method",
                                    "minimum_tokens"])
    assert config.parallel.data_parallel_size == 3
    assert config.parallel.load_balance_method == "minimum_tokens"


def test_dp_defaults_and_refusals() -> None:
    config = cli_args.build_config(["smollm2-135m"])
    assert (config.parallel.data_parallel_size, config.parallel.load_balance_method) == (1, "round_robin")
    with pytest.raises(cli_args.CliError, match="--load-balance-method.*shortest_queue"):
        cli_args.build_config(["smollm2-135m", "--load-balance-method", "random"])
    with pytest.raises(ValueError, match="--data-parallel-size must be at least 1"):
        cli_args.build_config(["smollm2-135m", "--dp-size", "0"])
