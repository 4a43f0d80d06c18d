"""Atomic file writes: write beside the target, then rename, so that a crash never leaves a half-written file.

    from fileio import write_atomic
    write_atomic("data/train.parquet", lambda tmp: pq.write_table(table, tmp))
    write_atomic("ckpt/latest", lambda tmp: Path(tmp).write_text("step_10"))
"""

import os
from typing import Callable


def write_atomic(path: str, write: Callable[[str], object]) -> None:
    """write(tmp) fills the temporary path beside `path`; then it replaces `path` in one step (os.replace is atomic
    on POSIX: a reader sees the old file or the new one, never half of one)."""
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)
