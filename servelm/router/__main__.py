"""``python -m servelm.router ...``: the same as `servelm router`."""

from servelm.router.cli import main

if __name__ == "__main__":
    main()
