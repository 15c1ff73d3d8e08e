"""Drafter training (docs/design.md#training-objective): objective, schedules, config errors, end-to-end, resume, DDP."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from domino_lab import Drafter
from domino_lab.config import load_config
from domino_lab.errors import UserError, run_cli
from domino_lab.training.config import TrainConfig
from domino_lab.training.objective import position_weights, sample_anchors, weighted_ce
from domino_lab.training.schedules import LambdaConfig, make_schedule
from core_helpers import make_regenerated, tiny_target

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_regenerated(tmp_path_factory.mktemp("tiny"))


def base_args(tiny, out, steps=40, every=20):
    tdir, data = tiny
    return [f"target={tdir}", f"data.path={data}", f"max_steps={steps}", f"out_dir={out}",
            f"eval.every_n_steps={every}", "data.batch_size=4", "drafter.gru_hidden=32", "drafter.rank=16",
            "eval.tau_prompts=6", "eval.tau_max_new_tokens=32", "loss.num_anchors=16", "optim.lr=3e-3",
            f"tracking_uri=sqlite:///{Path(out).parent / 'mlflow.db'}", "checkpoint_every_n_steps=5"]


# ---- pieces ---------------------------------------------------------------------------------------
def test_position_weights_and_weighted_mean():
    w = position_weights(4, 2.0)
    torch.testing.assert_close(w, torch.exp(-torch.arange(4.0) / 2.0))
    logits = torch.randn(2, 3, 4, 10)
    labels = torch.randint(0, 10, (2, 3, 4))
    valid = torch.rand(2, 3, 4) > 0.3
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), labels.reshape(-1), reduction="none").view(2, 3, 4)
    ww = w * valid.float()
    want = (ww * ce).sum() / ww.sum()
    torch.testing.assert_close(weighted_ce(logits, labels, valid, 2.0), want, rtol=1e-5, atol=1e-5)


def test_lambda_schedules():
    lin = make_schedule(LambdaConfig("linear", 1.0, 1.0))
    assert lin(0, 100) == 1.0 and lin(50, 100) == pytest.approx(0.5) and lin(100, 100) == 0.0
    half = make_schedule(LambdaConfig("linear", 1.0, 0.5))
    assert half(25, 100) == pytest.approx(0.5) and half(60, 100) == 0.0
    cos = make_schedule(LambdaConfig("cosine", 1.0, 1.0))
    assert cos(50, 100) == pytest.approx(0.5) and cos(25, 100) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    step = make_schedule(LambdaConfig("step", 1.0, milestones=[0.3, 0.6], gamma=0.5))
    assert [step(s, 100) for s in (10, 30, 70)] == [1.0, 0.5, 0.25]
    assert make_schedule(LambdaConfig("constant", 0.0))(10, 100) == 0.0
    with pytest.raises(UserError, match="unknown lambda schedule"):
        make_schedule(LambdaConfig("exp"))


def test_teacher_forcing_vs_ttt_prefix():
    target = tiny_target()
    d = Drafter.untrained(target, "domino", block_size=4)
    ids = torch.randint(4, 60, (2, 24), generator=torch.Generator().manual_seed(0))
    lm = torch.ones_like(ids)
    lm[:, :3] = 0
    feats = target.forward(ids, taps=d.config.target_layer_ids).features
    anchors, keep = sample_anchors(lm, 5, torch.Generator().manual_seed(1))
    tf = d.training_blocks(feats, ids, lm, anchors, keep, "teacher_forcing")
    ttt = d.training_blocks(feats, ids, lm, anchors, keep, "ttt")
    for b in range(2):
        for j, a in enumerate(anchors[b].tolist()):
            want_tf = ids[b, a: a + 4].tolist()                       # x_a, x_{a+1}, ..., x_{a+n-1}
            assert tf.prefix[b, j].tolist()[: len(want_tf)] == want_tf[: 4]
            own = tf.logits_base[b, j].argmax(-1)                     # the drafter's own base argmax
            assert ttt.prefix[b, j, 0] == ids[b, a]
            assert ttt.prefix[b, j, 1:].tolist() == own[:-1].tolist()
    torch.testing.assert_close(tf.logits_base, ttt.logits_base)       # only the GRU inputs differ


def test_config_errors(tmp_path):
    with pytest.raises(UserError, match="unknown config key 'loss.gama'"):
        load_config(TrainConfig, None, ["loss.gama=3"])
    with pytest.raises(UserError, match="max_steps: expected int"):
        load_config(TrainConfig, None, ["max_steps=many"])
    cfg = load_config(TrainConfig, REPO / "experiments/configs/domino.yaml")
    assert cfg.drafter.method == "domino" and cfg.loss.curriculum.type == "linear"
    for name in ("dflash", "domino_no_curriculum", "domino_ttt"):
        load_config(TrainConfig, REPO / f"experiments/configs/{name}.yaml")


def test_cli_bad_inputs(tiny, tmp_path, capsys):
    from domino_lab.train import main

    def run(argv):
        with pytest.raises(SystemExit) as e:
            run_cli(main, argv)
        err = capsys.readouterr().err.strip().splitlines()
        return e.value.code, [x for x in err if x.startswith("error:")]

    code, err = run(["--config", str(REPO / "experiments/configs/domino.yaml"), "loss.bogus=1"])
    assert code == 2 and "loss.bogus" in err[0]
    code, err = run(base_args(tiny, tmp_path / "a") + ["drafter.target_layer_ids=[1, 9]"])
    assert code == 2 and "taps layers" in err[0]
    other = tiny_target(hidden=48)
    Drafter.untrained(other, "domino").save_pretrained(tmp_path / "wrong")
    code, err = run(base_args(tiny, tmp_path / "b") + [f"drafter.init_from={tmp_path / 'wrong'}"])
    assert code == 2 and "does not fit" in err[0]
    empty = tmp_path / "empty"
    from datasets import Dataset
    Dataset.from_list([{"id": "x", "domain": "c", "input_ids": [1, 2], "loss_mask": [0, 0], "prompt_len": 2}]
                      ).save_to_disk(str(empty))
    (empty / "meta.json").write_text("{}")
    code, err = run(base_args(tiny, tmp_path / "c") + [f"data.path={empty}"])
    assert code == 2 and "no sequence" in err[0]
    # same shape, other weights (e.g. a retrained target): its data must not train drafters for this one
    from core_helpers import make_target_dir
    retrained = make_target_dir(tmp_path / "retrained", max_pos=256, seed=1)
    code, err = run(base_args(tiny, tmp_path / "d") + [f"target={retrained}"])
    assert code == 2 and "regenerated by another target" in err[0]
    assert not (tmp_path / "d" / "final").exists()


# ---- end to end -----------------------------------------------------------------------------------
def test_training_raises_tau_and_logs_to_mlflow(tiny, tmp_path):
    from mlflow.tracking import MlflowClient

    from domino_lab.config import load_config
    from domino_lab.target import Target
    from domino_lab.train import train
    from domino_lab.training.config import drafter_config
    from domino_lab.training.datamodule import DrafterDataModule
    from domino_lab.training.module import measure_tau

    cfg = load_config(TrainConfig, None, base_args(tiny, tmp_path / "run", steps=120, every=40))
    res = train(cfg)
    assert res["steps"] == 120 and Path(res["best_dir"], "model.safetensors").exists()
    target = Target.from_pretrained(cfg.target)
    dm = DrafterDataModule(cfg.data)
    dm.setup()
    prompts = dm.tau_prompts(6)
    torch.manual_seed(0)
    untrained = Drafter(drafter_config(cfg.drafter, target), target)
    trained = Drafter.from_pretrained(res["best_dir"], target)
    tau0 = measure_tau(target, untrained, prompts, 32)["tau"]
    tau1 = measure_tau(target, trained, prompts, 32)["tau"]
    assert tau1 > tau0 + 0.2, (tau0, tau1)   # measured: 1.31 -> 1.77 at 120 steps
    client = MlflowClient(cfg.tracking_uri)
    run = client.get_run(res["run_id"])
    for k in ("train/loss", "train/loss_base", "train/loss_final", "train/lambda", "val/tau", "val/accept_pos_0"):
        assert k in run.data.metrics, k
    lam = [m.value for m in client.get_metric_history(res["run_id"], "train/lambda")]
    assert lam[0] > 0.9 and lam[-1] < 0.05                # linear 1 -> 0 over the run
    arts = {a.path for a in client.list_artifacts(res["run_id"])}
    assert {"config.yaml", "drafter_best", "curves.png"} <= arts


def test_killed_run_resumes_without_repeating_steps(tiny, tmp_path):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    args = base_args(tiny, out, steps=60, every=30)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "domino_lab.train", *args], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    # the first periodic checkpoint (step 5) is written: the run is mid-way; kill it like a scheduler would
    while not (out / "checkpoints" / "last.ckpt").exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)
    assert p.poll() is None, p.stderr.read()[-2000:]
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=120)
    assert p.returncode != 0
    assert (out / "checkpoints" / "on_exception.ckpt").exists()
    q = subprocess.run([sys.executable, "-m", "domino_lab.train", *args, "--resume"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert q.returncode == 0, q.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == 60
    hist = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(result["run_id"], "train/loss")
    steps = [m.step for m in hist]
    assert len(steps) == len(set(steps)) == 60, sorted(steps)


def test_two_process_ddp_on_cpu(tiny, tmp_path):
    out = tmp_path / "ddp"
    args = base_args(tiny, out, steps=6, every=3) + ["--devices", "2", "--strategy", "ddp", "--accelerator", "cpu",
                                                     "threads=1"]
    q = subprocess.run([sys.executable, "-m", "domino_lab.train", *args], capture_output=True, text=True,
                       timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert q.returncode == 0, q.stderr[-3000:]
    assert json.loads((out / "result.json").read_text())["steps"] == 6
    assert "world_size: 2" in q.stderr or "distributed_backend=gloo" in q.stderr
