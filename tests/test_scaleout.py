"""Scale-out (docs/scaling.md): the docker-compose stack checked statically (no Docker daemon needed), and distributed
sweeps / MLflow on a real PostgreSQL server (tests/pg_fixture.py starts a throwaway one on 127.0.0.1)."""
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml

from core_helpers import tiny_sweep_yaml
from pg_fixture import free_port, postgres  # noqa: F401  (session fixture)

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
GPU_OVERRIDE = REPO / "docker" / "compose.gpu.yml"
SERVICES = {"postgres", "mlflow", "sweep-init", "sweep-worker", "optuna-dashboard", "app"}
SERVERS = {"postgres": 5432, "mlflow": 5000, "optuna-dashboard": 8080, "app": 7860}   # service: listening port


def _load(name: str, path: Path):
    """docker/*.py as modules (`docker` itself is the name of an installed package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_load("docker_healthcheck", REPO / "docker" / "healthcheck.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", MLFLOW_DISABLE_TELEMETRY="true", HF_HUB_OFFLINE="1",
           NO_PROXY="localhost,127.0.0.1", no_proxy="localhost,127.0.0.1")


# ---- the compose file, as `docker compose` would resolve it with no .env -----------------------------------
def interpolate(value):
    """Compose variable interpolation with nothing set: ${VAR:-default} -> default, $$ -> $."""
    if isinstance(value, str):
        value = re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)
        return value.replace("$$", "$")
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def load_compose(path=COMPOSE) -> dict:
    return interpolate(yaml.safe_load(path.read_text()))


def argv(service: dict) -> list[str]:
    cmd = service.get("command", [])
    return cmd if isinstance(cmd, list) else cmd.split()


def env(service: dict) -> dict:
    e = service.get("environment", {})
    return e if isinstance(e, dict) else dict(x.split("=", 1) for x in e)


def flag(args: list[str], name: str):
    return args[args.index(name) + 1] if name in args else None


def all_strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, list):
        for v in node:
            yield from all_strings(v)
    elif isinstance(node, dict):
        for v in node.values():
            yield from all_strings(v)


def container_path(p: str) -> Path:
    """A path inside the image -> the same file in this checkout (WORKDIR /app, COPY . .)."""
    return REPO / p[len("/app/"):] if p.startswith("/app/") else REPO / p


@pytest.fixture(scope="module")
def compose():
    return load_compose()


def test_compose_services_and_image(compose):
    assert set(compose["services"]) == SERVICES
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"ARG TORCH_VARIANT=cpu", dockerfile), "the image is CPU by default"
    assert "TORCH_VARIANT" in dockerfile and '"cuda"' in dockerfile, "a build argument selects a CUDA torch"
    assert "psycopg[binary]" in dockerfile and "optuna-dashboard" in dockerfile
    for name, svc in compose["services"].items():
        if name != "postgres":
            assert svc["build"]["context"] == "." and svc["image"].startswith("domino-lab:"), name
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "runs" in ignored and ".git" in ignored


def test_compose_commands_are_real_entry_points(compose, monkeypatch):
    """Every command names a module, script or console command that exists, with options it accepts."""
    from domino_lab.sweep.__main__ import parse_args

    monkeypatch.chdir(REPO)          # the image's WORKDIR: recipes are relative to it

    checked = set()
    for name, svc in compose["services"].items():
        args = argv(svc)
        if name == "postgres":
            assert not args          # the image's own entry point
            continue
        if args[:2] == ["python", "-m"]:
            module = args[2]
            if module == "app" and not (REPO / "app" / "__main__.py").exists():
                continue             # the dashboard package not in this checkout yet: test_compose_app checks it
            target = REPO.joinpath(*module.split("."))
            assert (target / "__main__.py").exists() or target.with_suffix(".py").exists(), f"{name}: {module}"
        elif args[0] == "python":
            assert container_path(args[1]).is_file(), f"{name}: {args[1]} is not in the image"
        elif args[0] == "mlflow":
            from mlflow.cli import server

            assert args[1] == "server"
            options = {o for p in server.params for o in p.opts}
            used = {a for a in args[2:] if a.startswith("--")}
            assert used <= options, f"mlflow server does not know {used - options}"
        elif args[0] == "optuna-dashboard":
            assert args[1].startswith("postgresql")
            exe = shutil.which("optuna-dashboard")
            if exe:                  # not a project dependency; the image installs it
                help_text = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60).stdout
                assert all(a in help_text for a in args[2:] if a.startswith("--"))
        else:
            pytest.fail(f"{name}: unknown command {args[0]}")
        checked.add(name)
        # the sweep services are `python -m domino_lab.sweep ...`: their arguments must load
        if name in ("sweep-init", "sweep-worker"):
            assert args[:3] == ["python", "-m", "domino_lab.sweep"], name
            sweep, parsed = parse_args(args[3:])
            assert sweep.storage == flag(args, "--storage") and sweep.tracking_uri == "http://mlflow:5000"
            assert parsed.prepare_only == (name == "sweep-init")     # init prepares, workers run trials
            assert parsed.claim_gpu == (name == "sweep-worker")      # one GPU each under docker/compose.gpu.yml
            assert svc.get("init") is True, f"{name}: without an init process, python as PID 1 ignores SIGTERM"
    assert {"mlflow", "sweep-init", "sweep-worker", "optuna-dashboard"} <= checked


def test_compose_app(compose):
    """The dashboard service runs `python -m app` bound to 0.0.0.0 (the app package is written alongside)."""
    args = argv(compose["services"]["app"])
    assert args[:3] == ["python", "-m", "app"] and flag(args, "--host") == "0.0.0.0"
    assert env(compose["services"]["app"])["GRADIO_SERVER_NAME"] == "0.0.0.0"
    main = REPO / "app" / "__main__.py"
    assert main.exists(), "the app service runs `python -m app`, which needs app/__main__.py"
    source = "\n".join(p.read_text() for p in (REPO / "app").glob("*.py"))
    for opt in (a for a in args if a.startswith("--")):
        assert f'"{opt}"' in source or f"'{opt}'" in source, f"python -m app has no {opt} option"


def test_compose_databases(compose):
    """Two databases (MLflow's and Optuna's clash in one), both created by the postgres service."""
    pg = compose["services"]["postgres"]
    created = {env(pg)["POSTGRES_DB"]}
    init_dirs = [v.split(":")[0] for v in pg["volumes"] if "docker-entrypoint-initdb.d" in v]
    assert init_dirs, "no init scripts mounted"
    for d in init_dirs:
        for sql in (REPO / d).glob("*.sql"):
            created |= set(re.findall(r"CREATE DATABASE\s+\"?(\w+)", sql.read_text(), flags=re.I))
    assert created == {"mlflow", "optuna"}
    urls = {u for u in all_strings(compose["services"]) if u.startswith("postgresql")}
    dbs = {}
    for u in urls:
        m = re.fullmatch(r"postgresql(\+psycopg)?://(\w+):(\w+)@postgres:5432/(\w+)", u)
        assert m, f"unexpected database URL {u}"
        assert m.group(2) == env(pg)["POSTGRES_USER"] and m.group(3) == env(pg)["POSTGRES_PASSWORD"]
        dbs[u] = m.group(4)
    assert set(dbs.values()) == created
    mlflow_store = flag(argv(compose["services"]["mlflow"]), "--backend-store-uri")
    assert dbs[mlflow_store] == "mlflow"
    for name in ("sweep-init", "sweep-worker"):
        assert dbs[flag(argv(compose["services"][name]), "--storage")] == "optuna"
    assert dbs[argv(compose["services"]["optuna-dashboard"])[1]] == "optuna"


def test_compose_ports_hosts_and_health(compose):
    services = compose["services"]
    host_ports = []
    for name, port in SERVERS.items():
        svc = services[name]
        args = argv(svc)
        if name != "postgres":
            assert flag(args, "--port") == str(port) and flag(args, "--host") == "0.0.0.0", name
        published = [p.rsplit(":", 2) for p in svc.get("ports", [])]
        assert [int(c) for _, _, c in published] == [port], f"{name} publishes {svc.get('ports')}"
        host_ports += [int(h) for _, h, _ in published]
        # a health check that exercises the service, not only a liveness URL
        test = " ".join(svc["healthcheck"]["test"])
        assert not re.search(r"/health(?![a-z])", test), f"{name}: /health alone proves nothing"
        if name == "postgres":
            assert "-d optuna" in test and "-d mlflow" in test and "SELECT 1" in test
        else:
            assert f"healthcheck.py {name} http://localhost:{port}" in test
            assert container_path(svc["healthcheck"]["test"][2]).is_file()
    assert len(host_ports) == len(set(host_ports)), "two services publish one host port"
    # every http://service:port URL points at a service listening there
    for url in all_strings(services):
        for host, port in re.findall(r"http://([\w-]+):(\d+)", url):
            if host in SERVERS:
                assert int(port) == SERVERS[host], url
    # other containers reach MLflow as mlflow:5000: that Host header must be allowed (else 403)
    allowed = flag(argv(services["mlflow"]), "--allowed-hosts").split(",")
    assert "mlflow:5000" in allowed and "mlflow" in allowed
    from docker_healthcheck import CHECKS
    assert set(CHECKS) == {"mlflow", "optuna-dashboard", "app"}


def test_compose_volumes_and_scaling(compose):
    services = compose["services"]
    declared = set(compose["volumes"])
    used = {}
    for name, svc in services.items():
        for v in svc.get("volumes", []):
            src, dst = v.split(":")[:2]
            if src.startswith((".", "/")):
                assert (REPO / src).exists(), f"{name} mounts missing {src}"
            else:
                assert src in declared, f"{name} uses undeclared volume {src}"
                used.setdefault(src, set()).add(dst)
    assert set(used) == declared, f"declared but unused: {declared - set(used)}"
    assert all(len(dsts) == 1 for dsts in used.values()), f"a volume mounted at different paths: {used}"
    for name in ("sweep-init", "sweep-worker", "app"):
        assert "runs:/app/runs" in services[name]["volumes"], name
    worker = services["sweep-worker"]
    assert "container_name" not in worker and "ports" not in worker, "sweep-worker must scale (--scale)"
    assert worker["depends_on"]["sweep-init"]["condition"] == "service_completed_successfully"
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown {dep}"
    # the GPU override only adds a device reservation to the worker
    gpu = interpolate(yaml.safe_load(GPU_OVERRIDE.read_text()))
    assert set(gpu["services"]) == {"sweep-worker"}
    dev = gpu["services"]["sweep-worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]


def compose_cli():
    if shutil.which("docker"):
        r = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if r.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_docker_compose_config():
    """`docker compose config` (or docker-compose v1) validates the files against the Compose schema."""
    cli = compose_cli()
    if cli is None:
        pytest.skip("no docker compose / docker-compose binary (the static tests above still ran)")
    for files in (["-f", "docker-compose.yml"], ["-f", "docker-compose.yml", "-f", "docker/compose.gpu.yml"]):
        r = subprocess.run(cli + files + ["config", "-q"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]


# ---- a real PostgreSQL ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    """test_sweep.py's tiny configuration (tiny target, 12 steps per trial), no tracking URI of its own."""
    root = tmp_path_factory.mktemp("pgsweep")
    path, _ = tiny_sweep_yaml(root, n_trials=2)
    return path, root


@pytest.mark.slow
def test_two_workers_on_one_postgres_study(postgres, tiny_sweep, tmp_path):  # noqa: F811
    """Two workers started together, as on two machines (separate folders, so no shared file lock), on
    fresh databases: both create tables at once, share one study, and log to MLflow on PostgreSQL."""
    path, _ = tiny_sweep
    storage = postgres.create_database("pair_optuna")
    tracking = postgres.create_database("pair_mlflow")
    procs = []
    for i in range(2):
        args = [sys.executable, "-m", "domino_lab.sweep", "--config", str(path), "--study-name", "pair",
                "--storage", storage, "--tracking-uri", tracking, "--runs-dir", str(tmp_path / f"host{i}"),
                "--threads", "1"]
        procs.append(subprocess.Popen(args, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    study = optuna.load_study(study_name="pair", storage=storage)
    numbers = [t.number for t in study.trials]
    assert len(numbers) == 4 and len(set(numbers)) == 4            # n_trials counts per worker
    assert sum(bool(t.user_attrs.get("baseline")) for t in study.trials) == 1   # the baseline runs once
    done = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert done and len({t.user_attrs["best_dir"] for t in done}) == len(done)
    # MLflow on PostgreSQL: one parent run for the study, every trial nested under it
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking)
    parent = study.user_attrs["mlflow_parent_run_id"]
    exp = client.get_experiment_by_name("domino-lab-sweeps")
    kids = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(int(r.data.tags["optuna.trial"]) for r in kids) == sorted(numbers)
    assert all("val/tau" in r.data.metrics for r in kids if r.data.tags.get("optuna.state") == "COMPLETE")
    assert postgres.sql("SELECT count(*) FROM runs WHERE status = 'FINISHED'", db="pair_mlflow")[0][0] >= len(done)


def start_group(args, log: Path, **kw):
    """A server in its own process group (mlflow server leaves children behind a plain kill)."""
    with log.open("w") as out:          # (the child keeps its own copy of the descriptor)
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kw)


def stop_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_healthy(service, url, proc, log, host_header=None, timeout=180):
    from docker_healthcheck import check

    deadline = time.time() + timeout
    while True:
        try:
            return check(service, url, host_header)
        except RuntimeError as e:
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"{service} never became healthy: {e}\n{log.read_text()[-2000:]}")
            time.sleep(1)


@pytest.mark.slow
def test_compose_flow_on_postgres(postgres, tiny_sweep, compose, tmp_path):  # noqa: F811
    """The compose stack's own commands on loopback: the mlflow service's command on a PostgreSQL backend
    (health check with the Host header other containers send; a foreign Host is refused), sweep-init
    (`--prepare-only`), then a worker (`--claim-gpu`, a no-op without GPUs) logging through the server;
    optuna-dashboard if installed."""
    from docker_healthcheck import check

    path, _ = tiny_sweep
    store = postgres.create_database("stack_mlflow")
    storage = postgres.create_database("stack_optuna")
    port = free_port()
    args = argv(compose["services"]["mlflow"])
    args[args.index("--backend-store-uri") + 1] = store
    args[args.index("--artifacts-destination") + 1] = str(tmp_path / "mlartifacts")
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    mlflow_exe = str(Path(sys.executable).with_name("mlflow"))
    server_env = {k: v for k, v in env(compose["services"]["mlflow"]).items() if k.startswith("MLFLOW_SERVER_")}
    assert server_env == {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = start_group([mlflow_exe] + args[1:] + ["--workers", "1"], tmp_path / "mlflow.log", cwd=tmp_path,
                         env={**ENV, **server_env})
    procs = [server]
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy("mlflow", url, server, tmp_path / "mlflow.log", host_header="mlflow:5000")
        with pytest.raises(RuntimeError, match="403"):        # the pitfall the health check exists for
            check("mlflow", url, host_header="elsewhere.example:5000")
        common = ["--config", str(path), "--study-name", "stack", "--storage", storage, "--tracking-uri", url,
                  "--runs-dir", str(tmp_path / "runs"), "--threads", "1"]
        sweep = [sys.executable, "-m", "domino_lab.sweep"]
        init = subprocess.run(sweep + ["--prepare-only"] + common, cwd=tmp_path, env=ENV, capture_output=True,
                              text=True, timeout=300)
        assert init.returncode == 0, init.stderr[-3000:]
        study = optuna.load_study(study_name="stack", storage=storage)
        assert [t.state.name for t in study.trials] == ["WAITING"]          # the baseline, enqueued once
        parent = study.user_attrs["mlflow_parent_run_id"]                    # and the study's MLflow run
        work = subprocess.run(sweep + ["--claim-gpu"] + common + ["--n-trials", "1"], cwd=tmp_path, env=ENV,
                              capture_output=True, text=True, timeout=600)
        assert work.returncode == 0, work.stderr[-3000:]
        study = optuna.load_study(study_name="stack", storage=storage)
        assert len(study.trials) == 1 and study.trials[0].user_attrs.get("baseline")
        from mlflow.tracking import MlflowClient

        client = MlflowClient(url)
        exp = client.get_experiment_by_name("domino-lab-sweeps")
        runs = client.search_runs([exp.experiment_id])
        assert {r.info.run_name for r in runs} >= {"study-stack", "trial-0"}
        assert study.user_attrs["mlflow_parent_run_id"] == parent
        arts = {a.path for a in client.list_artifacts(parent)}
        assert "summary.md" in arts                                          # artifacts through the server
        assert client.get_run(parent).info.status == "FINISHED"              # the study has nothing left to run
        assert postgres.sql("SELECT count(*) FROM runs", db="stack_mlflow")[0][0] == len(runs)
        dash = shutil.which("optuna-dashboard")
        if dash:
            dport = free_port()
            d = start_group([dash, storage, "--host", "127.0.0.1", "--port", str(dport)], tmp_path / "dash.log",
                            env=ENV)
            procs.append(d)
            assert "1 stud" in wait_healthy("optuna-dashboard", f"http://127.0.0.1:{dport}", d, tmp_path / "dash.log")
    finally:
        for p in procs:
            stop_group(p)


def test_gpu_claims_are_exclusive(postgres):  # noqa: F811
    """--claim-gpu: each worker holds its own GPU; a dead worker's GPU is free again."""
    import sqlalchemy as sa

    from domino_lab.sweep.gpu import claim_gpu

    url = postgres.url("optuna")
    gpus = ["GPU-aaaa", "GPU-bbbb"]
    engines = [sa.create_engine(url, poolclass=sa.pool.NullPool) for _ in range(3)]
    a, b, c = (e.connect() for e in engines)
    try:
        assert claim_gpu(a, gpus) == "GPU-aaaa"
        assert claim_gpu(b, gpus) == "GPU-bbbb"
        assert claim_gpu(c, gpus) is None
        a.close()                                                # worker a exits
        # the server drops a closed session's locks when its backend process ends, a moment after the client
        # hangs up (a waiting worker polls, so it gets the GPU on a later try)
        deadline = time.time() + 10
        while (got := claim_gpu(c, gpus)) is None and time.time() < deadline:
            time.sleep(0.1)
        assert got == "GPU-aaaa"
    finally:
        for conn in (a, b, c):
            conn.close()


def test_scaling_docs_recipe_and_commands(tmp_path):
    """docs/scaling.md: the Qwen3-8B recipe is a valid TrainConfig with the paper's values, and every
    domino_lab.train / domino_lab.sweep command line in the docs and the README parses with its CLI."""
    import shlex

    from domino_lab.config import load_config
    from domino_lab.sweep.__main__ import build_parser as sweep_parser
    from domino_lab.train import build_parser as train_parser
    from domino_lab.training.config import TrainConfig

    doc = (REPO / "docs" / "scaling.md").read_text()
    recipe = next(b for b in re.findall(r"```yaml\n(.*?)```", doc, flags=re.S) if "Qwen3-8B" in b)
    shipped = REPO / "experiments" / "configs" / "qwen3-8b-domino.yaml"
    assert shipped.read_text() == recipe, "docs/scaling.md and the shipped recipe differ"
    cfg = load_config(TrainConfig, shipped)
    d = cfg.drafter
    assert (cfg.target, d.num_layers, d.block_size, d.target_layer_ids, d.rank, d.gru_hidden, cfg.optim.lr) == \
        ("Qwen/Qwen3-8B", 5, 16, [1, 9, 17, 25, 33], 256, 1024, 6e-4)
    readme = (REPO / "README.md").read_text()
    scaling = readme[readme.index("## Scaling out"):]
    seen = set()
    for text in (doc, scaling):
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0]
                for mod, parser in (("domino_lab.train", train_parser), ("domino_lab.sweep", sweep_parser)):
                    if f"-m {mod} " in line:
                        parser().parse_intermixed_args(shlex.split(line.split(f"-m {mod} ", 1)[1]))
                        seen.add(mod)
                for path in re.findall(r"(?:docker|experiments|docs)/[\w./-]+\.(?:py|yml|md)", line):
                    assert (REPO / path).exists(), path
    assert seen == {"domino_lab.train", "domino_lab.sweep"}
