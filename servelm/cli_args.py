"""The `servelm serve` command line (and a YAML --config file) -> EngineConfig, and back to YAML.

The parser is generated: one option per config field (``servelm.config``: type from the
annotation, help and choices from the field metadata), plus the other engines' flags catalogued in
``servelm.cli_flags`` (aliases onto our fields, flags that ask for what we already do, and flags
rejected with a reason). ``servelm.cli`` (the `servelm` command) and the benchmarks use it.

Invariants:
- A value comes from exactly one layer: the dataclass default, then the --config file, then the
  command line; explicit command-line flags win over the file.
- The same flag given twice: the last wins. Two different flags setting one field to different
  values (``--model-path a --model_dir b``) is an error, never a silent choice; so is a flag
  accepted as "already the behaviour" next to a flag that undoes that behaviour, and a flag that
  means something only with another one given without it.
- Every error names the flag the user typed, and ends the process with exit status 2.
- ``config_to_yaml(config)`` read back with --config gives the same EngineConfig.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from servelm import cli_flags
from servelm.cli_flags import UNCHANGED, Contradiction, flag_name
from servelm.config import EngineConfig

SERVE_PROG = "servelm serve"

_SETTINGS = "servelm_settings"
_REQUIREMENTS = "servelm_requirements"


class CliError(ValueError):
    """A bad command line or config file; the message names the flag."""


@dataclass(frozen=True, slots=True)
class Setting:
    """One field value and where it came from."""

    value: Any
    source: str
    """The flag as typed (or MODEL for the positional), with the file name for --config values."""
    family: str
    """Flags of one family (``--x``/``--no-x``, ``-tp``/``--tp``) override each other silently."""
    is_switch: bool = False
    """The flag takes no value (``--disable_chunked_prefill``): messages name it alone."""


@dataclass(frozen=True, slots=True)
class Requirement:
    """A flag accepted because the config already does what it asks, unless the final config
    contradicts it (``--enable-chunked-prefill`` with ``--chunked-prefill-size -1``)."""

    contradiction: Contradiction
    source: str


class Parser(argparse.ArgumentParser):
    """Raises CliError instead of printing usage and exiting, so errors can be reported once."""

    def error(self, message: str) -> NoReturn:
        raise CliError(message)


def _settings(namespace: argparse.Namespace) -> dict[str, Setting]:
    if not hasattr(namespace, _SETTINGS):
        setattr(namespace, _SETTINGS, {})
    return typing.cast(dict[str, Setting], getattr(namespace, _SETTINGS))


def _requirements(namespace: argparse.Namespace) -> list[Requirement]:
    if not hasattr(namespace, _REQUIREMENTS):
        setattr(namespace, _REQUIREMENTS, [])
    return typing.cast(list[Requirement], getattr(namespace, _REQUIREMENTS))


class _SetField(argparse.Action):
    """Records a value for one config field (ours, an alias's, or the positional model)."""

    def __init__(self, option_strings: list[str], dest: str, *, field_name: str, family: str,
                 convert: Callable[[Any], Any] | None = None, conflict: Any = None,
                 merge: Callable[[Any, Any], Any] | None = None, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.field_name = field_name
        self.family = family
        self.convert = convert
        self.conflict = conflict
        self.merge = merge

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        value = self.const if self.nargs == 0 else values
        if self.convert is not None:
            try:
                value = self.convert(value)
            except ValueError as exc:
                raise argparse.ArgumentError(self, str(exc)) from None
        source = option_string or "MODEL"
        if value is UNCHANGED:
            contradiction = Contradiction(self.field_name, (self.conflict,))
            _requirements(namespace).append(Requirement(contradiction, source))
            return
        settings = _settings(namespace)
        previous = settings.get(self.field_name)
        if self.merge is not None:  # one part of the field's value (cli_flags.Alias.merge)
            value = self.merge(previous.value if previous is not None and previous.family == self.family
                               else None, value)
        if previous is not None and previous.family != self.family and previous.value != value:
            raise argparse.ArgumentError(
                None, f"{previous.source} {previous.value!r} and {source} {value!r} both set "
                f"{flag_name(self.field_name)}; give only one")
        settings[self.field_name] = Setting(value, source, self.family, is_switch=self.nargs == 0)


def _same_value(given: str, accepted: str) -> bool:
    if given.strip().lower() == accepted.lower():
        return True
    try:
        return float(given) == float(accepted)
    except ValueError:
        return False


class _AlreadyBehaviour(argparse.Action):
    """Accepts a flag that asks for what this build already does; checks the value if any."""

    def __init__(self, option_strings: list[str], dest: str, *,
                 entry: cli_flags.AlreadyBehaviour, **kwargs: Any) -> None:
        nargs = 0 if entry.values is None else None
        super().__init__(option_strings, dest, nargs=nargs, default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS, **kwargs)
        self.entry = entry

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        accepted = self.entry.values
        if accepted is not None and not any(_same_value(values, v) for v in accepted):
            raise argparse.ArgumentError(
                None, f"{option_string} {values} is not supported: {self.entry.reason} "
                f"(accepted: {', '.join(accepted)})")
        source = option_string if accepted is None else f"{option_string} {values}"
        for contradiction in self.entry.contradicts:
            _requirements(namespace).append(Requirement(contradiction, source or ""))


class _Reject(argparse.Action):
    """Rejects a catalogued flag at parse time, whatever its values, with the reason."""

    def __init__(self, option_strings: list[str], dest: str, *, reason: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="*", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS, **kwargs)
        self.reason = reason

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        raise argparse.ArgumentError(None, f"{option_string} is {self.reason}")


# --- parser generation -------------------------------------------------------------------------

def _field_types() -> dict[str, Any]:
    hints: dict[str, Any] = {}
    for section in EngineConfig.sections().values():
        hints.update(typing.get_type_hints(section))
    return hints


def _base_type(annotation: Any) -> Any:
    """int for ``int | None``; the annotation itself otherwise."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 else annotation


def _metavar(field_name: str) -> str:
    return field_name.upper()


def _add_field(group: argparse._ArgumentGroup, field: dataclasses.Field[Any], annotation: Any) -> None:
    flag = flag_name(field.name)
    base = _base_type(annotation)
    help_text = field.metadata.get("help", "")
    extra_flags = list(field.metadata.get("flags", ()))
    family = "field:" + field.name
    if base is bool:
        group.add_argument(flag, *extra_flags, action=_SetField, nargs=0, const=True,
                           field_name=field.name, family=family, default=argparse.SUPPRESS,
                           help=help_text)
        if field.metadata.get("negatable"):
            group.add_argument("--no-" + flag[2:], action=_SetField, nargs=0, const=False,
                               field_name=field.name, family=family, default=argparse.SUPPRESS,
                               help=f"Turn {flag} off.")
        return
    default = field.default if field.default is not dataclasses.MISSING else None
    if default is not None:
        help_text += f" (default: {default})"
    if typing.get_origin(base) is list:  # one or more values: --flag 0.1 0.5 1
        group.add_argument(flag, *extra_flags, action=_SetField, type=typing.get_args(base)[0],
                           nargs="+", metavar=_metavar(field.name), field_name=field.name,
                           family=family, default=argparse.SUPPRESS, help=help_text)
        return
    group.add_argument(flag, *extra_flags, action=_SetField, type=base,
                       choices=field.metadata.get("choices"), metavar=None if
                       field.metadata.get("choices") else _metavar(field.name),
                       field_name=field.name, family=family, default=argparse.SUPPRESS,
                       help=help_text)


def _add_alias(group: argparse._ArgumentGroup, alias: cli_flags.Alias,
               fields: dict[str, dataclasses.Field[Any]], types: dict[str, Any]) -> None:
    field = fields[alias.field]
    target = flag_name(alias.field)
    if not alias.takes_value and alias.const is not True:
        target += f" {alias.const}"
    help_text = f"= {target} ({alias.origin})"
    if alias.note:
        help_text += f"; {alias.note}"
    kwargs: dict[str, Any] = {"action": _SetField, "field_name": alias.field,
                              "family": "alias:" + (alias.family or alias.flags[0]),
                              "default": argparse.SUPPRESS, "help": help_text,
                              "conflict": alias.conflict, "merge": alias.merge}
    if not alias.takes_value:
        kwargs.update(nargs=0, const=alias.const)
    else:
        kwargs["metavar"] = alias.metavar or _metavar(alias.field)
        if alias.optional_value:
            kwargs.update(nargs="?", const=alias.const)
        if alias.convert is not None:
            kwargs["convert"] = alias.convert
        else:
            kwargs["type"] = _base_type(types[alias.field])
            if field.metadata.get("choices"):
                kwargs.update(choices=field.metadata["choices"], metavar=None)
    group.add_argument(*alias.flags, **kwargs)


_EPILOG = ("Flags of SGLang, vLLM and LightLLM are recognised: aliases set the options above; "
           "flags asking for what servelm already does are accepted; the others stop start-up "
           "with the reason. `python -m servelm.cli_flags` lists them all.")


_USAGE = "%(prog)s [MODEL] [--config FILE] [options]"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the positional MODEL, --config, one option per config field, and the catalogue."""
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", action=_SetField,
                        field_name="model", family="positional", default=argparse.SUPPRESS,
                        help="Model to serve (same as --model).")
    parser.add_argument("--config", dest="config_file", metavar="FILE", default=argparse.SUPPRESS,
                        help="YAML file of options (keys are flag names, dashes or underscores); "
                        "flags on the command line override it.")
    parser.add_argument("--dry-run", action="store_true", default=False,
                        help="Check the whole command line (and --config file) without loading "
                        "a model, print the resolved options as a YAML --config file and exit.")
    types = _field_types()
    fields = cli_flags.config_fields()
    for section_name, section in EngineConfig.sections().items():
        summary = (section.__doc__ or "").strip().splitlines()[0]
        group = parser.add_argument_group(f"{section_name} options", summary)
        for field in dataclasses.fields(section):
            _add_field(group, field, types[field.name])
    aliases = parser.add_argument_group("aliases", "Other engines' spellings of the options above.")
    for alias in cli_flags.ALIASES:
        _add_alias(aliases, alias, fields, types)
    for entry in cli_flags.ALREADY_BEHAVIOUR:
        parser.add_argument(*entry.flags, action=_AlreadyBehaviour, entry=entry)
    for rejection in cli_flags.REJECTIONS:
        parser.add_argument(*rejection.flags, action=_Reject, reason=rejection.reason)


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, max_help_position=36, width=100)


SERVE_PARSER_OPTIONS: dict[str, Any] = {
    "usage": _USAGE, "description": "Start the OpenAI-compatible server.", "epilog": _EPILOG,
    "allow_abbrev": False, "formatter_class": _formatter}
"""Keyword arguments of the `servelm serve` parser (also used for the `serve` subcommand)."""


def build_serve_parser(prog: str = SERVE_PROG) -> argparse.ArgumentParser:
    """The parser for `servelm serve` (and `python -m servelm.launch_server`)."""
    parser = Parser(prog=prog, **SERVE_PARSER_OPTIONS)
    add_engine_arguments(parser)
    return parser


# --- config file -------------------------------------------------------------------------------

def _option_for_key(parser: argparse.ArgumentParser, key: str) -> tuple[str, argparse.Action] | None:
    options = parser._option_string_actions
    bare = key.lstrip("-")
    for candidate in (key, "--" + bare, "--" + bare.replace("_", "-"), "--" + bare.replace("-", "_"),
                      "-" + bare):
        if candidate in options:
            return candidate, options[candidate]
    return None


def _tokens_for(parser: argparse.ArgumentParser, key: str, flag: str, action: argparse.Action,
                value: Any) -> list[str]:
    if value is None:
        return []
    if action.nargs == 0 or (isinstance(action, _Reject) and isinstance(value, bool)):
        if not isinstance(value, bool):
            raise CliError(f"{key}: takes true or false, got {value!r}")
        if value:
            return [flag]
        negative = "--no-" + flag.lstrip("-")
        # false is a switch's off state: the same as not giving it, unless a --no- form exists
        # (so `enable-metrics: false` is accepted: metrics are off here).
        return [negative] if negative in parser._option_string_actions else []
    if isinstance(value, list):
        if action.nargs not in ("*", "+"):
            raise CliError(f"{key}: takes one value, got a list")
        return [flag, *(str(item) for item in value)]
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, dict):
        text = json.dumps(value)
    else:
        text = str(value)
    return [f"{flag}={text}"]


def _file_layer(path: str, prog: str) -> tuple[dict[str, Setting], list[Requirement]]:
    import yaml  # deferred: only --config needs it

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise CliError(f"--config {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise CliError(f"--config {path}: not valid YAML: {exc}") from None
    if data is None:
        return {}, []
    if not isinstance(data, dict):
        raise CliError(f"--config {path}: expected a mapping of option names to values")
    parser = build_serve_parser(prog)
    tokens: list[str] = []
    try:
        for key, value in data.items():
            found = _option_for_key(parser, str(key))
            if found is None or found[0] in ("--config", "--dry-run"):
                raise CliError(f"{key}: unknown option")
            tokens += _tokens_for(parser, str(key), found[0], found[1], value)
        namespace = parser.parse_args(tokens)
    except CliError as exc:
        raise CliError(f"in --config {path}: {exc}") from None
    settings = {name: dataclasses.replace(s, source=f"{s.source} (in {path})")
                for name, s in _settings(namespace).items()}
    requirements = [dataclasses.replace(r, source=f"{r.source} (in {path})")
                    for r in _requirements(namespace)]
    return settings, requirements


# --- building the config -----------------------------------------------------------------------

def _field_value(config: EngineConfig, field_name: str) -> Any:
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        if hasattr(values, field_name):
            return getattr(values, field_name)
    raise KeyError(field_name)


def _given_as(settings: dict[str, Setting], field_name: str, value: Any = None) -> str:
    """The flag that set ``field_name`` as the user typed it, with ``value`` unless a switch."""
    setting = settings.get(field_name)
    text = setting.source if setting is not None else flag_name(field_name)
    if value is not None and not isinstance(value, bool) and not (setting and setting.is_switch):
        text += f" {value}"
    return text if setting is not None else f"{text} (the default)"


def _build(settings: dict[str, Setting], requirements: list[Requirement]) -> EngineConfig:
    try:
        config = EngineConfig.from_flat({name: s.value for name, s in settings.items()})
    except ValueError as exc:
        message = str(exc)
        for name, setting in settings.items():
            if flag_name(name) in message and setting.source != flag_name(name):
                message += f" (given as {setting.source})"
        raise CliError(message) from None
    defaults = cli_flags.field_defaults()
    for requirement in requirements:
        name = requirement.contradiction.field
        value = _field_value(config, name)
        if requirement.contradiction.is_contradicted_by(value, defaults[name]):
            raise CliError(f"{requirement.source} contradicts {_given_as(settings, name, value)}; "
                           "give only one of them")
    for name, needed in cli_flags.NEEDS:
        if _field_value(config, name) != defaults[name] and \
                _field_value(config, needed) == defaults[needed]:
            raise CliError(f"{_given_as(settings, name)} has no effect without "
                           f"{flag_name(needed)}; add {flag_name(needed)} or drop it")
    _check_environment(config)
    return config


_JSON_WHITESPACE_SAMPLES = ("", " ", "\n", "\t", "  \n\t  \n")


def _check_environment(config: EngineConfig) -> None:
    """Start-up checks that need more than the config: the grammar backend's package (installed;
    the engine imports it), and a whitespace pattern the backend can honour. Loads no model."""
    from servelm.constrained.grammar import check_backend_installed

    structured = config.structured
    try:
        check_backend_installed(structured.grammar_backend)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if config.observability.tracing:
        from servelm.server.tracing import check_sdk_available
        try:
            check_sdk_available()
        except ValueError as exc:
            raise CliError(str(exc)) from None
    pattern = structured.constrained_json_whitespace_pattern
    if pattern is None:
        return
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise CliError(f"--constrained-json-whitespace-pattern {pattern!r} is not a regular "
                       f"expression: {exc}") from None
    if structured.grammar_backend == "xgrammar":
        # xgrammar has one switch, any JSON whitespace or none: any other pattern would be ignored.
        is_any_whitespace = all(compiled.fullmatch(text) for text in _JSON_WHITESPACE_SAMPLES) \
            and not compiled.fullmatch("x") and not compiled.fullmatch(" x")
        if not is_any_whitespace:
            raise CliError(f"--constrained-json-whitespace-pattern {pattern!r}: the xgrammar "
                           "backend can only allow any JSON whitespace (e.g. [ \\t\\n]*) or none; "
                           "use --grammar-backend llguidance for this pattern")


def config_from_namespace(namespace: argparse.Namespace, prog: str = SERVE_PROG) -> EngineConfig:
    """EngineConfig from a parsed namespace: defaults, then its --config file, then its flags."""
    settings: dict[str, Setting] = {}
    requirements: list[Requirement] = []
    config_file = getattr(namespace, "config_file", None)
    if config_file is not None:
        settings, requirements = _file_layer(config_file, prog)
    settings.update(_settings(namespace))
    requirements += _requirements(namespace)
    return _build(settings, requirements)


def build_config(argv: Sequence[str], prog: str = SERVE_PROG) -> EngineConfig:
    """EngineConfig from `servelm serve` arguments; raises CliError (a ValueError) naming the flag."""
    namespace = build_serve_parser(prog).parse_args(list(argv))
    return config_from_namespace(namespace, prog)


def fail(prog: str, message: str) -> NoReturn:
    """Print the error the way every servelm command does and exit with status 2."""
    print(f"servelm: {message}\n(see `{prog} --help`)", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv: Sequence[str] | None = None, prog: str = SERVE_PROG) -> EngineConfig:
    """EngineConfig from `servelm serve` arguments; on a bad argument prints the reason to stderr
    and exits with status 2 (``--help`` prints help and exits 0)."""
    try:
        return build_config(sys.argv[1:] if argv is None else argv, prog)
    except CliError as exc:
        fail(prog, str(exc))


# --- YAML output (--dry-run) -------------------------------------------------------------------

def config_to_yaml(config: EngineConfig) -> str:
    """Every option of ``config`` as a --config YAML file, one commented block per section; unset
    options (None) are left out. Reading it back with --config gives ``config`` again."""
    import yaml  # deferred: only --config and --dry-run need it

    blocks: list[str] = []
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        mapping = {flag_name(f.name)[2:]: getattr(values, f.name)
                   for f in dataclasses.fields(values) if getattr(values, f.name) is not None}
        if mapping:
            body = yaml.safe_dump(mapping, sort_keys=False, default_flow_style=False,
                                  allow_unicode=True, width=100)
            blocks.append(f"# {section.name}\n{body}")
    return "\n".join(blocks)
