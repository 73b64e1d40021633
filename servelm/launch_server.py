"""SGLang-style entry point: ``python -m servelm.launch_server --model-path MODEL [flags]``.

Takes the same arguments as `servelm serve` (see servelm.cli_args), --dry-run included.
"""

from __future__ import annotations

import sys

from servelm import cli_args
from servelm.cli import dry_run, serve

PROG = "python -m servelm.launch_server"


def main(argv: list[str] | None = None) -> None:
    """Parse the flags into an EngineConfig and run the server (or print it, with --dry-run)."""
    parser = cli_args.build_serve_parser(PROG)
    try:
        namespace = parser.parse_args(sys.argv[1:] if argv is None else argv)
        config = cli_args.config_from_namespace(namespace, PROG)
    except cli_args.CliError as exc:
        cli_args.fail(PROG, str(exc))
    if namespace.dry_run:
        dry_run(config)
        return
    serve(config)


if __name__ == "__main__":
    main()
