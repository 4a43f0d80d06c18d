"""Atomic file writes (write beside the target, then rename, so that a crash never leaves a half-written file) and
the sha256 of files (checkpoint manifests, the SFT cache's inputs).

    from fileio import write_atomic
    write_atomic("data/train.parquet", lambda tmp: pq.write_table(table, tmp))
    write_atomic("ckpt/latest", lambda tmp: Path(tmp).write_text("step_10"))
"""

import hashlib
import os
from typing import Callable


def write_atomic(path: str, write: Callable[[str], object]) -> None:
    """write(tmp) fills a temporary path beside `path`, which then replaces `path` in one step (atomic on POSIX)."""
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)


def sha256(paths: list[str]) -> str:
    """One sha256 of the files' bytes, in order."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
