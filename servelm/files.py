"""Writing cache files that other processes may read or write at the same time."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file of this writer's own in the same directory,
    renamed over ``path``: a reader sees the old file or the new one, never a part, and writers
    saving one path at once (ranks of one machine, threads of a test) never rename each other's
    temporary away. The temporary is removed if the write fails."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
