"""User-facing errors and the CLI wrapper that turns them into one clear line.

Every thin CLI (`python -m domino_lab.X`) runs its body through `run_cli`, so a bad input
prints `error: <what was wrong; how to fix it>` on stderr and exits 2, with no traceback.
Programming errors still raise normally so bugs stay visible.
"""
from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


class UserError(Exception):
    """A problem with what the user asked for (bad path, bad config, bad prompt)."""


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> None:
    try:
        code = main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)


@contextmanager
def atomic_path(final: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path next to `final`; rename it into place only if the block succeeds.

    Nothing half-written is ever left at `final` (docs/design.md#contracts).
    """
    final = Path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=suffix or ".tmp", dir=final.parent)
    except OSError as e:
        raise UserError(f"cannot write to {final.parent}: {e.strerror}; choose a writable location") from None
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, final)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()
