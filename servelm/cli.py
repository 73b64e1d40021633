"""The `servelm` command: `servelm serve` (the server), `servelm bench` (benchmarks),
`servelm tune` (measure a model's GGUF routes on this machine: servelm.model.routes),
`servelm router` (servelm.router; also `serve --run_mode pd_master`) and `servelm build-kernels`
(compile the C++ kernels for this CPU before serving: servelm.model.kernel_build).

Parsing lives in ``servelm.cli_args``; this module only dispatches. ``serve --dry-run`` checks the
command line without loading a model: it prints the resolved options as YAML (a file --config
reads back to the same configuration) and exits 0, or exits 2 with the reason.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from servelm import cli_args
from servelm.cli_args import SERVE_PROG, CliError, add_engine_arguments
from servelm.config import EngineConfig

_ROUTER_HELP = ("Route requests over several servers: data-parallel workers or prefill/decode "
                "pairs (`servelm router --help`).")
_ROUTER_RUN_MODES = ("pd_master", "config_server")
"""LightLLM run modes of `serve` that are the router's (servelm.router.cli), not a server's."""
_BENCH_HELP = "Benchmark the engine offline or a running server (`servelm bench --help`)."
_BUILD_KERNELS_HELP = "Compile the C++ kernels for this CPU, in parallel (scripts/setup.sh runs it)."
_TUNE_HELP = ("Measure which kernel each GGUF linear of MODEL runs at each batch size on this machine and "
              "cache it (serve measures what is missing within a few seconds at start-up); takes serve's flags.")


def build_parser() -> argparse.ArgumentParser:
    """The top-level `servelm` parser with its subcommands."""
    parser = cli_args.Parser(prog="servelm", allow_abbrev=False,
                             description="servelm: an LLM inference and serving engine.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND",
                                     parser_class=cli_args.Parser)
    serve_parser = commands.add_parser("serve", help="Start the OpenAI-compatible server.",
                                       **cli_args.SERVE_PARSER_OPTIONS)
    add_engine_arguments(serve_parser)
    tune_parser = commands.add_parser("tune", help=_TUNE_HELP, **cli_args.SERVE_PARSER_OPTIONS)
    add_engine_arguments(tune_parser)
    # Listed for --help only: main() hands `bench` to servelm.bench before parsing.
    commands.add_parser("bench", add_help=False, help=_BENCH_HELP)
    commands.add_parser("router", add_help=False, help=_ROUTER_HELP)
    commands.add_parser("build-kernels", add_help=False, help=_BUILD_KERNELS_HELP)
    return parser


def serve(config: EngineConfig) -> None:
    """Runs the server until it is stopped."""
    from servelm.engine.launch import EngineLaunch
    from servelm.logging_utils import configure_logging
    from servelm.model.threads import configure_front_end_threads, export_front_end_environment

    configure_logging(config.server.log_level)
    if config.parallel.node_rank > 0:
        serve_worker_node(config)
        return
    export_front_end_environment()  # before the engine processes start: they inherit it
    # The engine processes import torch and the engine while this one imports the server stack
    # and checks the model (servelm.engine.launch): seconds of every start-up.
    with EngineLaunch.begin(config) as launch:
        from servelm.server.app import run_server  # deferred: the CLI must not import the server stack

        configure_front_end_threads()  # the cores belong to the engine process (README, Threads)
        run_server(config, launch)


def serve_worker_node(config: EngineConfig) -> None:
    """Node R > 0 of a multi-node server: no HTTP, only this node's ranks (servelm.workers.node)."""
    from servelm.workers.node import NodeError, run_node

    try:
        status = run_node(config)
    except NodeError as error:
        sys.stderr.write(f"servelm: {error}\n")
        status = 1
    raise SystemExit(status)


def tune(config: EngineConfig) -> None:
    """Measures the model's route table again and prints it."""
    from servelm.logging_utils import configure_logging
    from servelm.model.routes import format_report, tune as tune_routes  # deferred: parsing loads no model

    configure_logging(config.server.log_level)
    report = tune_routes(config)
    if report is not None and "row_classes" in report:
        sys.stdout.write(f"block kernel build: {report['kernel_build']}\n{report['source']}\n"
                         + "\n".join(format_report(report)) + "\n")
    attention = (report or {}).get("prefill_attention")
    if attention:
        sys.stdout.write(f"prefill attention ({attention['source']}):\n" + "".join(
            f"  {name}: " + " ".join(f"{rows}:{route}" for rows, route in routes.items()) + "\n"
            for name, routes in attention["routes"].items()))


def dry_run(config: EngineConfig) -> None:
    """Print the resolved configuration as a --config YAML file."""
    sys.stdout.write(cli_args.config_to_yaml(config))


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `servelm` command."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["bench"]:
        from servelm.bench import main as bench_main  # deferred: serve never loads the bench

        bench_main(args[1:])
        return
    if args[:1] == ["router"]:
        from servelm.router.cli import main as router_main  # deferred, like bench

        router_main(args[1:])
        return
    if args[:1] == ["build-kernels"]:
        from servelm.model.kernel_build import main as build_main  # deferred, like bench

        build_main(args[1:])
        return
    if args[:1] == ["serve"]:
        from servelm.router.cli import run_mode_of, serve_run_mode

        if run_mode_of(args[1:]) in _ROUTER_RUN_MODES:
            serve_run_mode(args[1:])
            return
    parser = build_parser()
    try:
        namespace = parser.parse_args(args)
        if namespace.command is None:
            parser.print_help(sys.stderr)
            raise SystemExit(2)
        config = cli_args.config_from_namespace(namespace)
    except CliError as exc:
        cli_args.fail(SERVE_PROG if args[:1] == ["serve"] else "servelm", str(exc))
    if namespace.dry_run:
        dry_run(config)
        return
    if namespace.command == "tune":
        tune(config)
        return
    serve(config)


if __name__ == "__main__":
    main()
