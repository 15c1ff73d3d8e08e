"""One GPU per sweep worker when several workers share a host (`python -m domino_lab.sweep --claim-gpu`).

Docker gives every replica of a scaled service the same GPU when the service reserves `count: 1`
(docker/compose#11863), so docker/compose.gpu.yml hands every worker all the GPUs of its host and each worker
claims one: a PostgreSQL advisory lock per GPU on the study's database, keyed by the GPU's UUID (workers of
several hosts sharing one database never collide), held for the worker's lifetime (a killed worker's connection
closes and frees its GPU), and CUDA_VISIBLE_DEVICES set to that GPU before CUDA starts. A worker that finds
every GPU taken waits for one. Without GPUs (no nvidia-smi), with CUDA_VISIBLE_DEVICES already set, or with a
storage that is not PostgreSQL, nothing is claimed.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time


def gpu_uuids() -> list[str]:
    """UUIDs of the GPUs this machine (container) sees; empty without an NVIDIA driver."""
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


def claim_for_worker(storage_url: str | None, poll_s: float = 15.0):
    """Claim a GPU for this process (see the module docstring) and set CUDA_VISIBLE_DEVICES; returns the
    connection that holds the claim (keep it open for the worker's lifetime), or None when nothing was claimed.
    Call it before anything initialises CUDA."""
    if "CUDA_VISIBLE_DEVICES" in os.environ or not storage_url or not storage_url.startswith("postgresql"):
        return None
    uuids = gpu_uuids()
    if not uuids:
        return None
    import sqlalchemy as sa

    from ..errors import UserError, mask_credentials

    try:
        conn = sa.create_engine(storage_url, poolclass=sa.pool.NullPool).connect()
    except Exception as e:   # bad URL, unreachable server, missing driver: one clear line
        raise UserError(mask_credentials(f"cannot open Optuna storage {storage_url}: "
                                         f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}")) from None
    waited = False
    while (uuid := claim_gpu(conn, uuids)) is None:
        if not waited:
            print(f"[sweep] all {len(uuids)} GPU(s) are taken by other workers; waiting for one",
                  file=sys.stderr, flush=True)
            waited = True
        time.sleep(poll_s)
    os.environ["CUDA_VISIBLE_DEVICES"] = uuid
    print(f"[sweep] running on GPU {uuid}", file=sys.stderr, flush=True)
    return conn
