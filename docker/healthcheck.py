"""Health checks of the compose services that call each service's API, not only a liveness URL.

    python docker/healthcheck.py mlflow http://localhost:5000 --host-header mlflow:5000
    python docker/healthcheck.py optuna-dashboard http://localhost:8080
    python docker/healthcheck.py app http://localhost:7860

mlflow: `/health` answers 200 even when the server refuses every API call from other containers (403
"Invalid Host header" without --allowed-hosts), so the check searches experiments through the REST API and
sends the Host header the other services use. optuna-dashboard: lists the studies (reads the Optuna database).
app (Gradio): reads the API description (`/gradio_api/info`). Exit 0 when healthy, 1 with one line otherwise.
Standard library only: it also runs where nothing else is installed.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

CHECKS = {
    # service: (path, key the JSON answer must hold)
    "mlflow": ("/api/2.0/mlflow/experiments/search?max_results=1", None),
    "optuna-dashboard": ("/api/studies", "study_summaries"),
    "app": ("/gradio_api/info", "named_endpoints"),
}


def check(service: str, base_url: str, host_header: str | None = None, timeout: float = 10.0) -> str:
    """Returns a one-line description of the answer; raises RuntimeError when the service is not healthy."""
    path, key = CHECKS[service]
    req = urllib.request.Request(base_url.rstrip("/") + path, headers={"Host": host_header} if host_header else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{service}: HTTP {e.code} from {path}: {e.read()[:200].decode(errors='replace')}")
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(f"{service}: cannot reach {base_url}: {getattr(e, 'reason', e)}")
    try:
        data = json.loads(body)
    except ValueError:
        raise RuntimeError(f"{service}: {path} did not answer JSON: {body[:200]!r}")
    if not isinstance(data, dict) or (key is not None and key not in data):
        raise RuntimeError(f"{service}: {path} answered without '{key}': {body[:200]!r}")
    if service == "mlflow":
        return f"mlflow: {len(data.get('experiments', []))} experiment(s) listed"
    if service == "optuna-dashboard":
        return f"optuna-dashboard: {len(data['study_summaries'])} stud(y/ies)"
    return f"app: {len(data['named_endpoints'])} API endpoint(s)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("service", choices=sorted(CHECKS))
    p.add_argument("url", help="base URL, e.g. http://localhost:5000")
    p.add_argument("--host-header", help="Host header to send (what other containers send, e.g. mlflow:5000)")
    p.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args(argv)
    try:
        print(check(args.service, args.url, args.host_header, args.timeout))
    except RuntimeError as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
