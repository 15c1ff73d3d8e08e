"""Entry of the compose `sweep-worker` service: claim one GPU, then run `python -m domino_lab.sweep ARGS` on it.

    python docker/sweep_worker.py --config experiments/sweeps/default.yaml --storage postgresql+psycopg://...

Docker gives every replica of a scaled service the same GPU when the service reserves `count: 1`
(docker/compose#11863). docker/compose.gpu.yml therefore hands every worker all the GPUs of its host and each
worker claims one here: a PostgreSQL advisory lock per GPU on the study's database, keyed by the GPU's UUID
(so workers of several hosts sharing one database never collide), held for the worker's lifetime (a killed
worker's connection closes and frees its GPU), and CUDA_VISIBLE_DEVICES set to that GPU. A worker that finds
every GPU taken waits for one. Without GPUs (no nvidia-smi), with CUDA_VISIBLE_DEVICES already set, or with a
storage that is not PostgreSQL, it runs the sweep as it is.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time


def gpu_uuids() -> list[str]:
    """UUIDs of the GPUs this container sees (empty without an NVIDIA driver)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def lock_key(uuid: str) -> int:
    """A signed 64-bit advisory-lock key for one GPU."""
    return int.from_bytes(hashlib.sha256(f"domino-lab gpu {uuid}".encode()).digest()[:8], "big", signed=True)


def claim_gpu(conn, uuids: list[str]) -> str | None:
    """The first GPU of `uuids` no other worker holds, now locked by `conn`'s session; None if all are taken."""
    import sqlalchemy as sa

    for uuid in uuids:
        got = conn.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": lock_key(uuid)}).scalar()
        conn.commit()
        if got:
            return uuid
    return None


def storage_url(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--storage" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--storage="):
            return a.split("=", 1)[1]
    return os.environ.get("OPTUNA_STORAGE")


def main(argv: list[str]) -> int:
    cmd = [sys.executable, "-m", "domino_lab.sweep", *argv]
    env = dict(os.environ)
    url = storage_url(argv)
    uuids = [] if "CUDA_VISIBLE_DEVICES" in env else gpu_uuids()
    conn = None
    if len(uuids) > 0 and url and url.startswith("postgresql"):
        import sqlalchemy as sa

        conn = sa.create_engine(url, poolclass=sa.pool.NullPool).connect()
        waited = False
        while (uuid := claim_gpu(conn, uuids)) is None:
            if not waited:
                print(f"[sweep-worker] all {len(uuids)} GPU(s) are taken by other workers; waiting for one",
                      file=sys.stderr, flush=True)
                waited = True
            time.sleep(15)
        env["CUDA_VISIBLE_DEVICES"] = uuid
        print(f"[sweep-worker] running on GPU {uuid}", file=sys.stderr, flush=True)
    child = subprocess.Popen(cmd, env=env)
    # docker stop sends SIGTERM to this process: pass it on so the trial checkpoints and the sweep stops cleanly
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    code = child.wait()
    if conn is not None:
        conn.close()                     # frees the GPU for the next worker
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
