"""Every flag in the seed documents (../shared/seeds) is catalogued and does what its kind says.

The flags come from the five seed texts (literal ``--x`` tokens) and from 001_flag_names.tsv, which
names the flag(s) of each of seed 001's 250 rows (its text lost most flag names). Each flag goes
through `servelm serve ... --dry-run`: implemented/alias: a plausible value changes the printed
configuration (parallel sizes, where only 1 exists, reject 2 naming the flag instead);
already-the-behaviour: accepted without changing anything (other values rejected); rejected: exit
status 2 and a message naming the flag.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from servelm import cli, cli_args, cli_flags
from servelm.config import EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
# ../shared/seeds beside the checkout (or beside a folder of worktrees holding it).
SEEDS_DIR = next((folder / "shared" / "seeds" for folder in REPO_ROOT.parents
                  if (folder / "shared" / "seeds").is_dir()), REPO_ROOT.parent / "shared" / "seeds")
SEED_001_TABLE = SEEDS_DIR / "001_flag_names.tsv"
NUM_SEED_TEXTS = 5
NUM_SEED_001_ROWS = 250

# Text-extraction artifacts in the seeds: a flag glued to the next word of prose.
ARTIFACTS = {
    "--enable-p2p-checkto": "--enable-p2p-check",  # 001: "add--enable-p2p-checkto the server"
    "--shm-sizefor": "--shm-size",                 # 001: "See --shm-sizefor docker"
}
# Options of the parser itself, not of the engine (catalogued in cli_flags.PARSER_OPTIONS).
PARSER_OPTIONS = set(cli_flags.PARSER_OPTIONS)

# Fields whose other values this build refuses (naming the flag), with the one value it accepts.
REFUSED_FIELDS: dict[str, str] = {
    "hicache_io_backend": "direct",
    "moe_dense_tp_size": "1",   # the size the dense layers run at (--tp-size, 1 by default)
    # a decode server is one engine (dp: the router's), a prefill server one pipeline stage
    "disaggregation_decode_dp": "1", "disaggregation_prefill_pp": "1"}
DEFAULT = EngineConfig()


def extract_seed_flags(text: str) -> set[str]:
    """``--flag`` tokens (and SGLang's page rendering ``–flag`` with an en dash) plus the
    single-dash short forms listed in help output (``, -tp N``)."""
    text = re.sub(r"(--[\w-]*-)\n\s+", r"\1", text)  # a flag hyphen-wrapped across lines
    long_flags = {"--" + m for m in re.findall(r"(?<!-)(?:--|\u2013)([A-Za-z][\w-]*[A-Za-z0-9])", text)}
    short_flags = set(re.findall(r"(?:^[ \t]*|,[ \t])(-[A-Za-z][\w-]*)(?=[\s,])", text, re.M))
    return {ARTIFACTS.get(flag, flag) for flag in long_flags | short_flags}


def seed_001_rows() -> list[tuple[str, list[str], str]]:
    """(section, flag names, description) for each row of seed 001's table."""
    if not SEED_001_TABLE.is_file():
        return []
    lines = SEED_001_TABLE.read_text(encoding="utf-8").splitlines()
    assert lines[0].split("\t")[:2] == ["section", "flags"], "unexpected header in the 001 table"
    rows = []
    for line in lines[1:]:
        section, flags, description = line.split("\t")
        rows.append((section, flags.split(), description))
    return rows


def seed_flags() -> list[str]:
    if not SEEDS_DIR.is_dir():
        return []
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(SEEDS_DIR.glob("*.txt")))
    table = {flag for _, flags, _ in seed_001_rows() for flag in flags}
    return sorted((extract_seed_flags(text) | table) - PARSER_OPTIONS)


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
    if field_name == "chat_template":
        return ["{{ messages }}"]  # a name such as chatml is refused: neither a file nor a template
    if field_name == "hf_overrides":
        return ['{"rope_theta": 10000.0}']
    if field_name == "constrained_json_whitespace_pattern":
        return ["[ \\t\\n]*"]
    if field_name == "dist_init_addr":
        return ["127.0.0.1:5001"]
    if field_name == "override_pooler_config":
        return ['{"pooling_type": "mean", "normalize": false}']
    if field_name == "hicache_storage_backend_extra_config":
        return ['{"file_path": "/tmp/servelm-hicache-flag-test"}']
    if field_name == "kv_transfer_config":
        return ['{"kv_connector": "ZmqConnector", "kv_role": "kv_producer"}']
    if field_name == "lora_target_modules":
        return ["q_proj", "v_proj"]
    if field_name == "limit_mm_per_prompt":
        return ['{"image": 2}']
    if field_name == "mm_processor_kwargs":
        return ['{"do_pan_and_scan": true}']
    if field_name == "allowed_local_media_path":
        return [str(Path(__file__).resolve().parent)]
    if field_name == "allowed_media_domains":
        return ["images.example.com"]
    if field_name == "speculative_eagle_topk":
        return ["1"]  # a chain: the only top-k built (a tree is refused)
    if field_name == "collect_detailed_traces":
        return ["model,worker"]
    if field_name in ("prompt_tokens_buckets", "generation_tokens_buckets"):
        return ["tse", "1000", "2", "5"]
    if field_name == "tokenizer_metrics_allowed_custom_labels":
        return ["tenant"]
    if field_name == "grouping_key":
        return ["instance=node1"]
    if field_name == "max_logprobs":
        return ["5"]  # at most 20 (the sampler's limit), the default
    if field_name == "preferred_sampling_params":
        return ['{"temperature": 0.7}']
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


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""safe_load's loader with libyaml's scanner and parser where PyYAML has it (the same safe
constructor and resolver, so the same values): the pure-Python one took ~25 ms of each dry run's
~85 ms here, over 500 runs."""


@pytest.fixture(autouse=True, scope="module")
def _one_parser() -> Iterator[None]:
    """One `servelm` parser for the module's dry runs: cli.main builds it anew on every call (the
    serve and tune subcommands, some 750 arguments: ~35 ms a run). A parse leaves what it records
    in its namespace, never in the parser, so each run still parses its own argv from scratch."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "build_parser", functools.cache(cli.build_parser))
        yield


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any] | None, str]:
    """`servelm serve ARGV --dry-run`: the printed configuration (flag name -> value), or None
    and the error after exit status 2."""
    capsys.readouterr()
    try:
        cli.main(["serve", *argv, "--dry-run"])
    except SystemExit as exc:
        assert exc.code == 2, argv
        return None, capsys.readouterr().err
    return yaml.load(capsys.readouterr().out, Loader=_YAML_LOADER), ""


DEFAULT_PRINTED = yaml.load(cli_args.config_to_yaml(DEFAULT), Loader=_YAML_LOADER)


def printed(field_name: str, config: dict[str, Any]) -> Any:
    return config.get(cli_flags.flag_name(field_name)[2:])


@pytest.fixture(scope="module")
def parser_options() -> set[str]:
    return set(cli_args.build_serve_parser()._option_string_actions)


def test_seed_directory_present() -> None:
    if not SEEDS_DIR.is_dir():
        pytest.skip(f"seed documents not found at {SEEDS_DIR} (the ../shared checkout is absent)")
    assert len(sorted(SEEDS_DIR.glob("*.txt"))) == NUM_SEED_TEXTS
    assert len(seed_001_rows()) == NUM_SEED_001_ROWS
    assert len(seed_flags()) > 250


def test_every_seed_001_row_is_catalogued() -> None:
    """Row by row, so a row whose names are all unknown cannot hide behind the other seeds."""
    if not SEED_001_TABLE.is_file():
        pytest.skip(f"{SEED_001_TABLE} not found")
    missing = [(section, flag) for section, flags, _ in seed_001_rows() for flag in flags
               if cli_flags.classify(flag) is None]
    assert not missing, f"seed 001 rows not catalogued: {missing}"
    assert all(flags for _, flags, _ in seed_001_rows()), "a 001 row without a flag name"


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
            assert config == DEFAULT_PRINTED, err
        else:
            for value in entry.values:
                config, err = run([flag, value], capsys)
                assert config == DEFAULT_PRINTED, err
            assert entry.bad_value is not None, f"{flag}: give a bad_value to test rejection"
            config, err = run([flag, entry.bad_value], capsys)
            assert config is None and flag in err and "not supported" in err
    elif kind == "rejected":
        config, err = run([flag, "1"], capsys)
        assert config is None, f"{flag} was accepted"
        assert f"servelm: {flag} is not" in err
    else:
        pytest.fail(f"{flag} is not catalogued")


# The multi-node flags are checked together by ParallelConfig: each needs the others.
_MULTI_NODE = ["--nnodes", "2", "--tp-size", "2", "--dist-init-addr", "127.0.0.1:5000"]
MULTI_NODE_COMPANIONS = {"nnodes": _MULTI_NODE[2:], "node_rank": _MULTI_NODE,
                         "dist_init_addr": _MULTI_NODE[:4]}
_EAGLE = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "head"]
EAGLE_COMPANIONS = {"speculative_eagle_topk": _EAGLE, "speculative_token_map": _EAGLE}
"""EAGLE head options: refused with any other --speculative-algorithm (SpeculativeConfig)."""
LORA_OPTIONS = {f.name for f in dataclasses.fields(EngineConfig().lora)} - {"enable_lora", "lora_paths"}
"""LoRA options refused without --enable-lora (LoRAConfig checks it: --lora-paths enables too)."""


NIXL_COMPANIONS = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl"]
"""--disaggregation-ib-device names the nixl backend's devices: it needs that backend (installed)."""


def companions(field_name: str) -> list[str]:
    """The flags ``field_name`` needs to mean anything (cli_flags.NEEDS, followed through the
    flags those need), with example values."""
    if field_name in LORA_OPTIONS:
        return ["--enable-lora"]
    if field_name in EAGLE_COMPANIONS:
        return EAGLE_COMPANIONS[field_name]
    if field_name == "collect_detailed_traces":
        return ["--enable-trace"]
    if field_name == "disaggregation_ib_device":
        if importlib.util.find_spec("nixl") is None and importlib.util.find_spec("nixl_cu12") is None:
            pytest.skip("--disaggregation-ib-device needs the nixl backend: pip install --no-deps "
                        "nixl nixl-cu12")
        return NIXL_COMPANIONS
    return MULTI_NODE_COMPANIONS.get(field_name, []) + [
        arg for name, needed in cli_flags.NEEDS if name == field_name
        for arg in (*companions(needed), cli_flags.flag_name(needed), *field_example(needed))]


def check_sets_field(flag: str, field_name: str, values: list[str],
                     capsys: pytest.CaptureFixture[str]) -> None:
    config, err = run([*companions(field_name), flag, *values], capsys)
    if field_name in REFUSED_FIELDS:
        # Only one value exists in this build: the example is rejected naming the flag.
        assert config is None and flag in err, err
        config, err = run([flag, REFUSED_FIELDS[field_name]], capsys)
        assert config == DEFAULT_PRINTED, err
        return
    assert config is not None, err
    assert config != DEFAULT_PRINTED, f"{flag} {values} did not change the config"
    assert printed(field_name, config) != printed(field_name, DEFAULT_PRINTED)


CONTRADICTIONS = [(entry, contradiction) for entry in cli_flags.ALREADY_BEHAVIOUR
                  for contradiction in entry.contradicts]


@pytest.mark.parametrize("entry, contradiction", CONTRADICTIONS,
                         ids=[f"{e.flags[0]}-{c.field}" for e, c in CONTRADICTIONS])
def test_already_behaviour_refused_when_contradicted(entry: cli_flags.AlreadyBehaviour,
                                                     contradiction: cli_flags.Contradiction,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Every flag of an "already the behaviour" entry, next to a flag undoing that behaviour, is
    a start-up error naming both flags."""
    other = cli_flags.flag_name(contradiction.field)
    if isinstance(contradiction.values, cli_flags.NonDefault):
        undo = [other, *field_example(contradiction.field)]
    else:
        undo = [other, str(contradiction.values[0])]
    for flag in entry.flags:
        asked = [flag] if entry.values is None else [flag, entry.values[0]]
        config, err = run([*asked, *undo], capsys)
        assert config is None, f"{asked} {undo} was accepted"
        assert f"{flag}" in err and "contradicts" in err and other in err, err
