"""Every flag in the seed documents (../shared/seeds) is catalogued and does what its kind says.

implemented/alias: passing it with a plausible value changes the EngineConfig (parallel sizes,
where only 1 exists, reject 2 naming the flag instead); already-the-behaviour: accepted without
changing anything (other values rejected); rejected: exit status 2 and a message naming the flag.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from servelm import cli, cli_flags
from servelm.config import EngineConfig

SEEDS_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "seeds"

# Text-extraction artifacts in the seeds: a flag glued to the next word of prose.
ARTIFACTS = {
    "--enable-p2p-checkto": "--enable-p2p-check",  # 001: "add--enable-p2p-checkto the server"
    "--shm-sizefor": "--shm-size",                 # 001: "See --shm-sizefor docker"
}
# Options of the parser itself, not of the engine.
PARSER_OPTIONS = {"--help", "-h", "--config"}

# Fields whose other values this build refuses (naming the flag), with the one value it accepts.
REFUSED_FIELDS = {"pipeline_parallel_size": "1", "data_parallel_size": "1",
                  "distributed_executor_backend": "mp"}
DEFAULT = EngineConfig()


def extract_seed_flags(text: str) -> set[str]:
    """``--flag`` tokens (and SGLang's page rendering ``–flag`` with an en dash) plus the
    single-dash short forms listed in help output (``, -tp N``)."""
    text = re.sub(r"(--[\w-]*-)\n\s+", r"\1", text)  # a flag hyphen-wrapped across lines
    long_flags = {"--" + m for m in re.findall(r"(?<!-)(?:--|\u2013)([A-Za-z][\w-]*[A-Za-z0-9])", text)}
    short_flags = set(re.findall(r"(?:^[ \t]*|,[ \t])(-[A-Za-z][\w-]*)(?=[\s,])", text, re.M))
    return {ARTIFACTS.get(flag, flag) for flag in long_flags | short_flags}


def seed_flags() -> list[str]:
    if not SEEDS_DIR.is_dir():
        return []
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(SEEDS_DIR.glob("*.txt")))
    return sorted(extract_seed_flags(text) - PARSER_OPTIONS)


def catalogue_flags() -> list[str]:
    flags = set(cli_flags.implemented_flags())
    for alias in cli_flags.ALIASES:
        flags.update(alias.flags)
    for entry in cli_flags.ALREADY_BEHAVIOUR:
        flags.update(entry.flags)
    for rejection in cli_flags.REJECTIONS:
        flags.update(rejection.flags)
    return sorted(flags)


def field_example(field_name: str) -> list[str]:
    """A valid value for one of our fields that differs from its default."""
    if field_name == "hf_overrides":
        return ['{"rope_theta": 10000.0}']
    if field_name == "override_pooler_config":
        return ['{"pooling_type": "mean", "normalize": false}']
    field = cli_flags.config_fields()[field_name]
    hints: dict[str, typing.Any] = {}
    for section in EngineConfig.sections().values():
        hints.update(typing.get_type_hints(section))
    base = [a for a in typing.get_args(hints[field_name]) if a is not type(None)] or [hints[field_name]]
    default = field.default if field.default is not dataclasses.MISSING else None
    if base[0] is bool:
        return []
    if typing.get_origin(base[0]) is list:
        return ["0.1", "1"]
    if field.metadata.get("choices"):
        return [next(c for c in field.metadata["choices"] if c != default)]
    if base[0] is int:
        return ["4096" if default is None else str(default + 1)]
    if base[0] is float:
        return ["0.5" if default != 0.5 else "0.4"]
    return ["x"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[EngineConfig | None, str]:
    try:
        config = cli.parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 2, argv
        return None, capsys.readouterr().err
    return config, ""


@pytest.fixture(scope="module")
def parser_options() -> set[str]:
    return set(cli.build_serve_parser()._option_string_actions)


def test_seed_directory_present() -> None:
    if not SEEDS_DIR.is_dir():
        pytest.skip(f"seed documents not found at {SEEDS_DIR} (the ../shared checkout is absent)")
    assert len(seed_flags()) > 250


def test_extraction_handles_wrapped_and_en_dash_flags() -> None:
    text = "Use --no-enable-\n    prefix-caching and \u2013enable-trace, --x-y -tp N, -O3"
    assert extract_seed_flags(text) == {"--no-enable-prefix-caching", "--enable-trace", "--x-y"}


def test_catalogue_is_consistent() -> None:
    cli_flags.check_catalogue()
    counts = cli_flags.counts()
    assert sum(counts.values()) == len(catalogue_flags())


@pytest.mark.parametrize("flag", seed_flags() or ["<no seeds>"])
def test_seed_flag_is_catalogued_and_known_to_parser(flag: str, parser_options: set[str]) -> None:
    if flag == "<no seeds>":
        pytest.skip(f"seed documents not found at {SEEDS_DIR}")
    assert cli_flags.classify(flag) is not None, f"{flag} from the seeds is not catalogued"
    assert flag in parser_options, f"{flag} is catalogued but not known to the parser"


@pytest.mark.parametrize("flag", sorted(set(seed_flags()) | set(catalogue_flags())))
def test_flag_behaves_as_catalogued(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    kind = cli_flags.classify(flag)
    if kind == "implemented":
        field_name = cli_flags.implemented_flags()[flag]
        check_sets_field(flag, field_name, field_example(field_name), capsys)
    elif kind == "alias":
        alias = next(a for a in cli_flags.ALIASES if flag in a.flags)
        assert alias.example or not alias.takes_value, f"{flag}: alias without an example"
        check_sets_field(flag, alias.field, list(alias.example), capsys)
    elif kind == "already":
        entry = next(e for e in cli_flags.ALREADY_BEHAVIOUR if flag in e.flags)
        if entry.values is None:
            config, err = run([flag], capsys)
            assert config == DEFAULT, err
        else:
            for value in entry.values:
                config, err = run([flag, value], capsys)
                assert config == DEFAULT, err
            assert entry.bad_value is not None, f"{flag}: give a bad_value to test rejection"
            config, err = run([flag, entry.bad_value], capsys)
            assert config is None and flag in err and "not supported" in err
    elif kind == "rejected":
        config, err = run([flag, "1"], capsys)
        assert config is None, f"{flag} was accepted"
        assert f"servelm: {flag} is not" in err
    else:
        pytest.fail(f"{flag} is not catalogued")


def check_sets_field(flag: str, field_name: str, values: list[str],
                     capsys: pytest.CaptureFixture[str]) -> None:
    config, err = run([flag, *values], capsys)
    if field_name in REFUSED_FIELDS:
        # Only one value exists in this build: the example is rejected naming the flag.
        assert config is None and flag in err, err
        config, err = run([flag, REFUSED_FIELDS[field_name]], capsys)
        assert config == DEFAULT, err
        return
    assert config is not None, err
    assert config != DEFAULT, f"{flag} {values} did not change the config"
    assert cli._field_value(config, field_name) != cli._field_value(DEFAULT, field_name)
