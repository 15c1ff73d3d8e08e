"""`python -m app` (or `python app/main.py`): launch the domino-lab dashboard.

Binds 127.0.0.1 unless `--host` says otherwise (`--host 0.0.0.0` in docker). Requests go through Gradio's
queue, so several users decode at once (`--concurrency`); torch uses `--threads` intra-op threads in total.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):          # `python app/main.py`: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from domino_lab.errors import UserError, run_cli  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m app", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1; 0.0.0.0 in docker)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--runs-dir", default=None, help="where to look for drafter checkpoints and local targets "
                                                     "(default: the repository's runs folder)")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow store for the Runs view and sweep drafters (default sqlite:///<runs-dir>/mlflow.db)")
    p.add_argument("--target", action="append", default=[], metavar="SPEC",
                   help="offer another target (HF id or local dir); repeatable")
    p.add_argument("--drafter", action="append", default=[], metavar="DIR",
                   help="offer another drafter checkpoint directory; repeatable")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--concurrency", type=int, default=4, help="decodes running at once (default 4)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting in the queue at most")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    return p.parse_args(argv)


def make_demo(args: argparse.Namespace):
    for d in args.drafter:
        if not (Path(d) / "config.json").is_file() or not (Path(d) / "model.safetensors").is_file():
            raise UserError(f"--drafter {d}: not a drafter directory (needs config.json and model.safetensors)")
    import torch

    from app.catalog import Catalog
    from app.ui import build_demo

    torch.set_num_threads(max(1, args.threads))
    from domino_lab.config import default_runs_dir

    runs_dir = Path(args.runs_dir) if args.runs_dir else default_runs_dir()
    uri = args.tracking_uri or f"sqlite:///{runs_dir / 'mlflow.db'}"
    catalog = Catalog(runs_dir=runs_dir, tracking_uri=uri, extra_targets=args.target,
                      extra_drafters=args.drafter, dtype=args.dtype)
    demo = build_demo(catalog)
    demo.queue(default_concurrency_limit=max(1, args.concurrency), max_size=args.max_queue)
    return demo


def _main(argv=None) -> int:
    args = parse_args(argv)
    if args.concurrency < 1 or args.threads < 1 or not 0 < args.port < 65536:
        raise UserError("--concurrency and --threads must be >= 1 and --port in 1..65535")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    demo = make_demo(args)
    print(f"domino-lab dashboard on http://{args.host}:{args.port}", file=sys.stderr)
    demo.launch(server_name=args.host, server_port=args.port, footer_links=["api"])
    return 0


def main(argv=None) -> None:
    run_cli(_main, argv)


if __name__ == "__main__":
    main()
