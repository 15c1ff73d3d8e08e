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

from domino_lab.errors import CliParser, UserError, run_cli  # noqa: E402
from domino_lab.validation import check_int, check_threads  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = CliParser(prog="python -m app", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1; 0.0.0.0 in docker)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--runs-dir", default=None, help="where to look for drafter checkpoints and local targets "
                                                     "(default: the repository's runs folder)")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow store for the Runs view and sweep drafters (default sqlite:///<runs-dir>/mlflow.db)")
    p.add_argument("--target", action="append", default=[], metavar="SPEC",
                   help="offer another target (HF id or local dir; loaded at launch); repeatable")
    p.add_argument("--drafter", action="append", default=[], metavar="DIR",
                   help="offer another drafter checkpoint directory (its files checked at launch); repeatable")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--concurrency", type=int, default=4, help="decodes running at once (default 4)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting in the queue at most (>= 1)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    return p.parse_args(argv)


def validate_args(args: argparse.Namespace) -> dict:
    """Every launch argument checked before anything is served, each failure one UserError; returns the --target
    models, loaded by the library's own resolution (Target.from_pretrained) and handed to the catalog, by name.
    The cheap checks come first, so a typo does not wait for a model to load."""
    check_int(args.port, "--port", 1, 65535)
    check_int(args.concurrency, "--concurrency", 1, what=" (decodes running at once)")
    check_int(args.max_queue, "--max-queue", 1, what=" (requests waiting at most)")
    check_threads(args.threads)
    if args.runs_dir is not None and Path(args.runs_dir).expanduser().exists() \
            and not Path(args.runs_dir).expanduser().is_dir():
        raise UserError(f"--runs-dir {args.runs_dir} is a file, not a folder; pass the folder that holds the runs")
    from domino_lab.training.tracking import check_tracking_uri

    check_tracking_uri(args.tracking_uri)       # the check train and sweep use
    for d in args.drafter:
        check_drafter_dir(d)
    check_bindable(args.host, args.port)
    from domino_lab import Target

    return {spec: Target.from_pretrained(spec, dtype=args.dtype) for spec in dict.fromkeys(args.target)}


def check_drafter_dir(d: str) -> None:
    """A --drafter directory the library reads as a drafter: a config of a known family and complete weights that
    match it (checked from the files, with the library's own readers: which target it fits is checked when the
    two are picked together, since the dashboard offers several targets)."""
    import torch

    from domino_lab.models.config import DrafterConfig
    from domino_lab.models.drafter import Drafter, check_weights, family_of, read_config_json
    from domino_lab.models.export import is_release_dir
    from domino_lab.models.weights_file import safetensors_shapes

    path = Path(d).expanduser()
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file() or not weights.is_file() or family_of(str(path)) is None:
        raise UserError(f"--drafter {d}: not a drafter directory (needs config.json of a known drafter family and "
                        "model.safetensors); pass a directory written by domino_lab.train or domino_lab.export")
    fix = "re-export the drafter (Drafter.save_pretrained / domino_lab.train) or restore its files"
    try:
        if is_release_dir(path):     # another layout's tensor names: only that the file is complete
            safetensors_shapes(weights, fix)
            return
        cfg = DrafterConfig.from_dict(read_config_json(cfg_file), source=str(cfg_file))
        with torch.device("meta"):       # the expected shapes, without allocating the weights
            expected = Drafter(cfg).state_dict()
        check_weights(weights, expected, cfg_file)
    except UserError as e:
        raise UserError(f"--drafter {d}: {e}") from None


def check_bindable(host: str, port: int) -> None:
    """--host is an address of this machine and --port is free there, tried with a socket bound as the server will
    bind it (SO_REUSEADDR), so a bad pair is one error line before any model loads instead of Gradio's traceback."""
    import errno
    import socket

    addr = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, port))
    except socket.gaierror:
        raise UserError(f"--host {host} is not an address or a host name this machine can resolve; use 127.0.0.1 "
                        "(this machine only) or 0.0.0.0 (every interface)") from None
    except OverflowError:
        raise UserError(f"--port must be in 1..65535, got {port}") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"--port {port} is already in use on {host} (another dashboard?); choose another port "
                            "with --port, or stop what holds it") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"--host {host} is not an address of this machine; use 127.0.0.1 (this machine only) or "
                            "0.0.0.0 (every interface)") from None
        if e.errno == errno.EACCES:
            raise UserError(f"--port {port} needs privileges to bind (ports below 1024); choose a port of 1024 or "
                            "more") from None
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --host or --port") from None


def url_host(host: str) -> str:
    """`host` as it goes in a URL: an IPv6 literal (`::1`) in brackets, anything else as given."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def make_demo(args: argparse.Namespace, targets: dict | None = None):
    """The dashboard for checked arguments (`validate_args`); `targets`: the --target models it loaded."""
    import torch

    from app.catalog import Catalog
    from app.ui import build_demo

    torch.set_num_threads(max(1, args.threads))
    from domino_lab.config import default_runs_dir

    runs_dir = Path(args.runs_dir) if args.runs_dir else default_runs_dir()
    uri = args.tracking_uri or f"sqlite:///{runs_dir / 'mlflow.db'}"
    catalog = Catalog(runs_dir=runs_dir, tracking_uri=uri, dtype=args.dtype, extra_drafters=args.drafter,
                      extra_targets=targets if targets is not None else args.target)
    demo = build_demo(catalog)
    demo.queue(default_concurrency_limit=max(1, args.concurrency), max_size=args.max_queue)
    return demo


def _main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    targets = validate_args(args)
    demo = make_demo(args, targets)
    server = url_host(args.host)
    print(f"domino-lab dashboard on http://{server}:{args.port}", file=sys.stderr)
    try:
        # Gradio puts server_name into the URLs it requests itself, so an IPv6 literal goes in brackets (it strips
        # them again to bind)
        demo.launch(server_name=server, server_port=args.port, footer_links=["api"])
    except OSError as e:
        # the port was free when checked, but something took it while the models loaded (or Gradio refused it)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"cannot serve on {args.host}:{args.port} ({first}); choose another --host or --port") \
            from None
    return 0


def main(argv=None) -> None:
    run_cli(_main, argv)


if __name__ == "__main__":
    main()
