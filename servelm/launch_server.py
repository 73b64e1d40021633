"""SGLang-style entry point: ``python -m servelm.launch_server --model-path MODEL [flags]``.

Takes the same arguments as `servelm serve` (see servelm.cli).
"""

from __future__ import annotations

from servelm.cli import parse_args, serve

PROG = "python -m servelm.launch_server"


def main(argv: list[str] | None = None) -> None:
    """Parse the flags into an EngineConfig and run the server."""
    serve(parse_args(argv, prog=PROG))


if __name__ == "__main__":
    main()
