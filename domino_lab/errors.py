"""User-facing errors and the CLI wrapper that turns them into one clear line.

Every thin CLI (`python -m domino_lab.X`) runs its body through `run_cli`, so a bad input
prints `error: <what was wrong; how to fix it>` on stderr and exits 2, with no traceback.
Programming errors still raise normally so bugs stay visible.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


class UserError(Exception):
    """A problem with what the user asked for (bad path, bad config, bad prompt)."""


class Stopped(Exception):
    """A run stopped from outside (SIGTERM): `run_cli` prints `error: <message>` and exits 143, as a killed job."""


@contextmanager
def sigterm_stops(what: str, how: str | Callable[[], str]) -> Iterator[None]:
    """Lightning turns a SIGTERM into a SystemExit without a code, which would end a command with exit 0 and no word:
    inside this block it becomes `Stopped("<what> stopped by SIGTERM; <how>")`. `how` (or what it returns, read
    after the stop) says how to continue."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    try:
        yield
    except SIGTERMException:
        raise Stopped(f"{what} stopped by SIGTERM; {how() if callable(how) else how}") from None


# scheme://user:password@host -> scheme://user:***@host (database and server URLs in messages and logs)
_CREDENTIALS = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*:)[^@/\s]*@")


def mask_credentials(text: str) -> str:
    """`text` with the password of every URL in it replaced by ***; every line that may show a storage or
    tracking URL (errors, progress, summaries) goes through this."""
    return _CREDENTIALS.sub(lambda m: m.group("head") + "***@", str(text))


class CliParser(argparse.ArgumentParser):
    """argparse's parser with the project's error line: a bad or missing argument prints
    `error: <argparse's message>; see <prog> --help` on stderr and exits 2, the same one line as a UserError,
    rather than argparse's usage block followed by the message. Subcommand parsers inherit it."""

    def error(self, message: str):
        print(f"error: {mask_credentials(message)}; see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> None:
    try:
        code = main(argv)
    except UserError as e:
        print(f"error: {mask_credentials(e)}", file=sys.stderr)
        sys.exit(2)
    except Stopped as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(143)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        # the reader of stdout left (`| head`): stop quietly, as command-line tools do, and keep Python's exit-time
        # flush of stdout from raising a second time
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    sys.exit(code or 0)


def _check_creatable(folder: Path, shown: Path, flag: str) -> None:
    """Raise a UserError (about `shown`, what the user typed) unless `folder` exists or could be created.

    The nearest existing ancestor must be a folder, and a throwaway folder is made and removed in it: permission
    bits alone do not tell (root passes os.access everywhere, and /proc or a read-only mount refuse anyway)."""
    folder = folder.absolute()      # (no ~ expansion: the writers do not expand it either)
    base = next((p for p in (folder, *folder.parents) if os.path.lexists(p)), Path(folder.anchor))
    if not base.is_dir():
        where = "is a file" if base == shown.absolute() else f"goes through {base}, which is a file"
        raise UserError(f"{flag} {shown} {where}, not a folder; choose another {flag}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=base))
    except OSError as e:
        raise UserError(f"{flag} {shown}: cannot create anything in {base} ({e.strerror}); "
                        f"choose a writable {flag}") from None


def check_out_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """`path` as a folder results can be written into, or one UserError naming it and the fix.

    Called when the arguments are read, so a bad path fails before the measurement or training whose results it
    would otherwise lose. It only checks; the folder is created when the results are written."""
    if not str(path).strip():
        raise UserError(f"{flag} is empty; name a folder to write the results into")
    path = Path(path)
    _check_creatable(path, path, flag)
    return path


def check_out_file(path: str | os.PathLike, flag: str = "--out") -> Path:
    """`path` as a file results can be written to: no folder in its place, and a folder for it as in
    `check_out_dir`."""
    if not str(path).strip():
        raise UserError(f"{flag} is empty; name a file to write the results to")
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; name a file to write the results to")
    _check_creatable(path.parent, path, flag)
    return path


@contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """An exclusive flock on `path` (created, with its folder, if missing) for the block: processes that create
    one shared thing (a SQLite store's schema, a feature cache, a study) take turns. A no-op where fcntl does not
    exist."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def atomic_path(final: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path next to `final`; rename it into place only if the block succeeds.

    Nothing half-written is ever left at `final` (docs/design.md#contracts). Every result file (result.json,
    mlflow_run.json, bench and sweep reports, plots) is written through this. The file gets the permissions a
    plain write would (0666 less the umask), not the temporary file's private 0600.
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
        if tmp_path.exists():
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp_path, 0o666 & ~umask)
        os.replace(tmp_path, final)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """The directory form of `atomic_path`: yield an empty temporary directory next to `final`; if the block
    succeeds it takes the place of `final` (a directory already there is removed only after the swap), otherwise
    it is deleted and `final` is left as it was."""
    import shutil

    final = Path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    except OSError as e:
        raise UserError(f"cannot write to {final.parent}: {e.strerror}; choose a writable location") from None
    old = None
    try:
        yield tmp
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)        # mkdtemp makes it private; give it the usual permissions
        for f in tmp.iterdir():
            if f.is_file():
                os.chmod(f, 0o666 & ~mask)
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
            os.replace(final, old / final.name)
        try:
            os.replace(tmp, final)
        except OSError:
            if old is not None:
                os.replace(old / final.name, final)
            raise
    finally:
        for d in (tmp, old):
            if d is not None and d.exists():
                shutil.rmtree(d, ignore_errors=True)
