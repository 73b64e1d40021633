"""`servelm router` (and `python -m servelm.router`), and `servelm serve --run_mode pd_master`.

The options are generated from RouterConfig's fields; sglang-router's spellings are aliases
(``--worker-urls``, ``--pd-disaggregation``, ``--prefill URL [BOOTSTRAP_PORT]``,
``--health-check-interval-secs``, ``--retry-max-retries``, ...). Bad options exit 2 with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from collections.abc import Sequence
from typing import Any

from servelm.router.config import PrefillSpec, RouterConfig

PROG = "servelm router"

ALIASES: dict[str, tuple[str, ...]] = {
    "workers": ("--worker-urls",),
    "health_check_interval_s": ("--health-check-interval-secs",),
    "health_check_timeout_s": ("--health-check-timeout-secs",),
    "request_timeout_s": ("--request-timeout-secs",),
    "connect_timeout_s": ("--connect-timeout-secs",),
    "max_retries": ("--retry-max-retries",),
}
"""sglang-router's spellings of our fields."""

_EPILOG = ("Data parallel: servelm router --worker http://127.0.0.1:30001 http://127.0.0.1:30002 "
           "--policy cache_aware. Prefill/decode (SGLang's protocol): servelm router "
           "--pd-disaggregation --prefill http://p:30001 8998 --decode http://d:30002.")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Extend(argparse.Action):
    """``--worker A B --worker C`` -> [A, B, C]."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        getattr(namespace, self.dest).extend(values)


class _Prefill(argparse.Action):
    """``--prefill URL [BOOTSTRAP_PORT|none]``, repeatable."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if len(values) > 2:
            parser.error(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(values)} "
                         "(repeat --prefill for each server)")
        port: int | None = None
        if len(values) == 2 and values[1].lower() not in ("none", "null"):
            try:
                port = int(values[1])
            except ValueError:
                parser.error(f"--prefill {values[0]}: bootstrap port {values[1]!r} is not an integer")
        getattr(namespace, self.dest).append(PrefillSpec(values[0], port))


def _field_type(annotation: Any) -> Any:
    if annotation in ("int", int):
        return int
    if annotation in ("float", float):
        return float
    return str


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, allow_abbrev=False, epilog=_EPILOG,
                     description="Route OpenAI-API requests over servelm (or SGLang) servers: "
                                 "data-parallel workers or prefill/decode pairs.")
    for field in dataclasses.fields(RouterConfig):
        flags = field.metadata.get("flags") or ("--" + field.name.replace("_", "-"),)
        flags = (*flags, *ALIASES.get(field.name, ()))
        help_text = field.metadata["help"]
        if field.name == "is_pd_master":
            continue  # set by `serve --run_mode pd_master` only
        if field.name in ("workers", "decode"):
            parser.add_argument(*flags, dest=field.name, nargs="+", action=_Extend, default=[],
                                metavar="URL", help=help_text)
        elif field.name == "prefill":
            parser.add_argument(*flags, dest=field.name, nargs="+", action=_Prefill, default=[],
                                metavar="URL [BOOTSTRAP_PORT]", help=help_text)
        else:
            annotation = field.type
            parser.add_argument(*flags, dest=field.name, default=field.default,
                                type=_field_type(annotation), choices=field.metadata.get("choices"),
                                help=f"{help_text} (default: {field.default})")
    parser.add_argument("--pd-disaggregation", action="store_true",
                        help="sglang-router's switch for PD mode: requires --prefill and --decode "
                             "(they alone already select it).")
    return parser


def config_from_args(argv: Sequence[str], prog: str = PROG, **overrides: Any) -> RouterConfig:
    """Parse ``argv`` into a RouterConfig; exits 2 with the reason on bad input."""
    parser = build_parser(prog)
    namespace = parser.parse_args(list(argv))
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(RouterConfig)
              if hasattr(namespace, f.name)}
    if namespace.pd_disaggregation and not (values["prefill"] and values["decode"]):
        parser.error("--pd-disaggregation needs --prefill URL [PORT] and --decode URL")
    values.update(overrides)
    for name in ("workers", "prefill", "decode"):
        values[name] = tuple(values[name])
    try:
        return RouterConfig(**values)
    except ValueError as error:
        parser.error(str(error))


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `servelm router`."""
    from servelm.router.app import run_router

    config = config_from_args(sys.argv[1:] if argv is None else argv)
    run_router(config)


# --- LightLLM's run modes on `servelm serve` -------------------------------------------------

SERVE_PD_MASTER_PROG = "servelm serve --run_mode pd_master"


def run_mode_of(argv: Sequence[str]) -> str | None:
    """The value of ``--run_mode`` in a `serve` command line (None when absent)."""
    for index, arg in enumerate(argv):
        if arg == "--run_mode" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--run_mode="):
            return arg.split("=", 1)[1]
    return None


def pd_master_config(argv: Sequence[str]) -> RouterConfig:
    """`serve --run_mode pd_master --host H --port P [router options]`: a router with no static
    workers that prefill/decode servers join with POST /register.

    LightLLM's ``--pd_master_ip``/``--pd_master_port`` name this master for the prefill and
    decode servers; here they must agree with --host/--port (an IP is accepted when --host is a
    wildcard address, as the address others reach it at)."""
    args = list(argv)
    index = args.index("--run_mode") if "--run_mode" in args else None
    if index is not None:
        del args[index:index + 2]
    else:
        args = [a for a in args if not a.startswith("--run_mode=")]
    master: dict[str, str] = {}
    for flag in ("--pd_master_ip", "--pd_master_port"):
        while flag in args:
            position = args.index(flag)
            if position + 1 >= len(args):
                _fail(SERVE_PD_MASTER_PROG, f"{flag} needs a value")
            master[flag] = args[position + 1]
            del args[position:position + 2]
    positional = [a for a in args if not a.startswith("-")]
    if args and not args[0].startswith("-"):
        _fail(SERVE_PD_MASTER_PROG, f"the pd_master loads no model ({positional[0]!r} given): it "
              "only routes requests to the prefill and decode servers that register with it")
    config = config_from_args(args, SERVE_PD_MASTER_PROG, is_pd_master=True)
    if "--pd_master_port" in master and master["--pd_master_port"] != str(config.port):
        _fail(SERVE_PD_MASTER_PROG, f"--pd_master_port {master['--pd_master_port']} contradicts "
              f"--port {config.port}: the master listens on --port")
    if "--pd_master_ip" in master and config.host not in ("0.0.0.0", "::") \
            and master["--pd_master_ip"] != config.host:
        _fail(SERVE_PD_MASTER_PROG, f"--pd_master_ip {master['--pd_master_ip']} contradicts "
              f"--host {config.host}: the master listens on --host")
    return config


def serve_run_mode(argv: Sequence[str]) -> None:
    """`servelm serve --run_mode pd_master|config_server ...` (the other run modes are serve's)."""
    from servelm.router.app import run_router

    mode = run_mode_of(argv)
    if mode == "config_server":
        _fail("servelm serve --run_mode config_server",
              "not supported: LightLLM's config_server coordinates several pd_master processes; "
              "servelm runs one `--run_mode pd_master`, which holds the registry itself")
    args = list(argv)
    is_dry_run = "--dry-run" in args
    config = pd_master_config([a for a in args if a != "--dry-run"])
    if is_dry_run:  # as `serve --dry-run`: the resolved options, and nothing started
        sys.stdout.write(json.dumps(dataclasses.asdict(config), indent=2) + "\n")
        return
    run_router(config)


def _fail(prog: str, message: str) -> typing.NoReturn:
    sys.stderr.write(f"{prog}: error: {message}\n")
    raise SystemExit(2)
