"""Optuna's RDB storage, made safe for several workers on one SQLite file.

Optuna hands an enqueued (WAITING) trial to a worker by reading its state and then writing RUNNING. On
PostgreSQL and MySQL the read is a SELECT ... FOR UPDATE, so only one worker wins; SQLite ignores FOR UPDATE, and
two workers that read at the same moment both win and train the same trial (measured: 4 processes popping 60
enqueued trials popped 70-74). Here that read-then-write is serialised by an OS file lock beside the database
file, which covers every worker that can open the file (one machine, or a file system with working locks).
"""
from __future__ import annotations

from pathlib import Path

import optuna
from optuna.trial import TrialState

from ..errors import file_lock


def sqlite_path(url: str) -> Path | None:
    """The database file of a `sqlite:///...` URL (None for servers and in-memory databases)."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or url[len(prefix):] in ("", ":memory:"):
        return None
    return Path(url[len(prefix):].split("?", 1)[0])


class LockedSQLiteStorage(optuna.storages.RDBStorage):
    """RDBStorage whose WAITING -> RUNNING claim holds a lock file next to the SQLite database."""

    def __init__(self, url: str, **kwargs):
        super().__init__(url, **kwargs)
        db = sqlite_path(url)
        self._claim_lock = db.with_name(db.name + ".claim.lock") if db else None

    def set_trial_state_values(self, trial_id, state, values=None) -> bool:
        if state != TrialState.RUNNING or self._claim_lock is None:
            return super().set_trial_state_values(trial_id, state, values)
        with file_lock(self._claim_lock):
            return super().set_trial_state_values(trial_id, state, values)


def sweep_storage(url: str, **kwargs) -> optuna.storages.RDBStorage:
    """The storage a sweep worker uses: RDBStorage, with the claim lock when the URL is a SQLite file."""
    cls = LockedSQLiteStorage if sqlite_path(url) else optuna.storages.RDBStorage
    return cls(url, **kwargs)
