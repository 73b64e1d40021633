"""``python -m servelm ...``: the same as the `servelm` command."""

from servelm.cli import main

if __name__ == "__main__":
    main()
