"""Drafter training (docs/design.md#training-objective): objective, schedules, config errors, end-to-end, resume, DDP."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
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



def test_soft_labels_read_the_targets_distribution_where_each_draft_predicts(tiny):
    """Draft i of the block at anchor a predicts x_{a+1+i}: the soft label is the target's distribution at position
    a+i. On the target's own greedy responses its argmax there is the hard label; KL is 0 exactly at a match."""
    from domino_lab.data.regenerate import load_regenerated
    from domino_lab.models.drafter import draft_labels
    from domino_lab.target import Target
    from domino_lab.training.objective import target_log_probs, weighted_kl

    tdir, data = tiny
    target = Target.from_pretrained(tdir)
    rows = [r for r in load_regenerated(data)][:4]
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [0] * (n - len(r["input_ids"])) for r in rows])
    lm = torch.tensor([r["loss_mask"] + [0] * (n - len(r["loss_mask"])) for r in rows])
    feats, states = target.features(ids, [1, 2], final_states=True)
    torch.testing.assert_close(feats, target.features(ids, [1, 2]))
    anchors, keep = sample_anchors(lm, 6, torch.Generator().manual_seed(0))
    logp = target_log_probs(states, target.lm_head, anchors, 4)
    labels, valid = draft_labels(ids, lm, anchors, keep, 4)
    full = target.forward(ids).logits.float().log_softmax(-1)
    for b in range(len(rows)):
        for j, a in enumerate(anchors[b].tolist()):
            for i in range(4):
                if valid[b, j, i]:
                    torch.testing.assert_close(logp[b, j, i], full[b, a + i], atol=1e-4, rtol=1e-4)
    assert valid.sum() > 10 and (logp.argmax(-1)[valid] == labels[valid]).float().mean() > 0.95
    assert weighted_kl(logp, logp, valid, 4.0).abs() < 1e-5
    sure = torch.zeros_like(logp)
    sure[..., 0] = 20.0                            # a drafter sure of one token the target does not favour
    assert weighted_kl(sure, logp, valid, 4.0) > 5.0


def test_soft_label_training_runs_and_fits_the_target(tiny, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from domino_lab.train import main, train

    with pytest.raises(SystemExit) as e:
        run_cli(main, base_args(tiny, tmp_path / "x") + ["loss.soft_weight=0.5", "data.features=offline"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert e.value.code == 2 and len(err) == 1 and "data.features=online" in err[0]
    with pytest.raises(UserError, match="loss.soft_weight"):
        load_config(TrainConfig, None, ["loss.soft_weight=1.5"])
    cfg = load_config(TrainConfig, None, base_args(tiny, tmp_path / "run", steps=40, every=40) +
                      ["loss.soft_weight=1.0", "eval.tau_prompts=0"])
    res = train(cfg)
    hist = [m.value for m in MlflowClient(cfg.tracking_uri).get_metric_history(res["run_id"], "train/loss_final")]
    assert len(hist) >= 8
    first, last = sum(hist[:4]) / 4, sum(hist[-4:]) / 4
    assert last < 0.7 * first, (first, last)          # the KL to the target's distribution falls

def test_config_errors(tmp_path):
    with pytest.raises(UserError, match="unknown config key 'loss.gama'"):
        load_config(TrainConfig, None, ["loss.gama=3"])
    with pytest.raises(UserError, match="max_steps: expected int"):
        load_config(TrainConfig, None, ["max_steps=many"])
    cfg = load_config(TrainConfig, REPO / "experiments/configs/domino.yaml")
    assert cfg.drafter.method == "domino" and cfg.loss.curriculum.type == "linear"
    recipes = [p for p in sorted((REPO / "experiments/configs").glob("*.yaml"))
               if "\nmodel:" not in p.read_text()]      # the target's pretraining recipes have their own schema
    assert len(recipes) >= 8
    for path in recipes:                                 # every drafter recipe loads with no unknown key
        load_config(TrainConfig, path)
    big = load_config(TrainConfig, REPO / "experiments/configs/domino_copy.yaml",
                      ["drafter.rank=256", "drafter.gru_hidden=512", "max_steps=4000"])
    assert (big.drafter.rank, big.drafter.gru_hidden, big.max_steps) == (256, 512, 4000)


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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = train(cfg)
    # a fresh run is not a resume: Lightning's "ckpt_path=None ... last checkpoint" warnings would only confuse
    assert not [w for w in caught if "ckpt_path" in str(w.message)], [str(w.message) for w in caught]
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


def test_a_step_that_validates_is_checkpointed_after_its_validation(tiny, tmp_path):
    """A run killed after a step's checkpoint and before its validation used to resume past that validation: the
    checkpoint was written first, so best/ never judged those weights (with steps = validation interval = checkpoint
    interval, as in the prose recipes, a resumed run ended with no best/ at all). Now the checkpoint of a validating
    step is written after the validation and holds its result; resuming from it validates nothing again."""
    import torch as _torch

    from domino_lab.train import main

    out = tmp_path / "run"
    args = quick_args(tiny, out, steps=4, every=4, ckpt_every=4)
    assert main(args) == 0
    first = json.loads((out / "result.json").read_text())
    assert first["best_tau"] is not None
    ckpt = _torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    best = [v for k, v in ckpt["callbacks"].items() if "ExportBest" in k]
    assert best and best[0]["best"].get("val/tau") == first["best_tau"]
    # what a run killed right after that checkpoint resumes from: the best drafter and its numbers come back
    (out / "result.json").unlink()
    assert main(args + ["--resume"]) == 0
    again = json.loads((out / "result.json").read_text())
    assert again["best_tau"] == first["best_tau"] and again["steps"] == 4


def test_an_exception_checkpoint_is_written_only_where_a_resume_is_exact(tmp_path):
    """on_exception.ckpt for a SIGTERM between steps; none for one during or right before a validation, or for an
    error inside a step, whose saved state Lightning resumes past the validation or one step off."""
    from types import SimpleNamespace

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from domino_lab.training.callbacks import BoundaryExceptionCheckpoint

    saved = []
    cb = BoundaryExceptionCheckpoint(tmp_path, validate_every=4)
    for step, validating, exc, want in ((5, False, SIGTERMException(), True), (8, False, SIGTERMException(), False),
                                        (5, True, SIGTERMException(), False), (5, False, RuntimeError("oom"), False),
                                        (5, False, KeyboardInterrupt(), False)):
        saved.clear()
        trainer = SimpleNamespace(global_step=step, validating=validating, save_checkpoint=saved.append)
        cb.on_exception(trainer, None, exc)
        assert bool(saved) == want, (step, validating, exc)


def quick_args(tiny, out, steps, every=100, ckpt_every=4):
    """A few fast steps: a small head, one short val/tau prompt."""
    tdir, data = tiny
    return [f"target={tdir}", f"data.path={data}", f"max_steps={steps}", f"out_dir={out}",
            f"eval.every_n_steps={every}", "data.batch_size=4", "drafter.gru_hidden=16", "drafter.rank=8",
            "eval.tau_prompts=1", "eval.tau_max_new_tokens=8", "loss.num_anchors=8", "optim.lr=3e-3",
            f"tracking_uri=sqlite:///{Path(out).parent / 'mlflow.db'}", f"checkpoint_every_n_steps={ckpt_every}",
            "progress_bar=false"]


def _history(out, key="train/loss"):
    from mlflow.tracking import MlflowClient

    run_id = json.loads((Path(out) / "mlflow_run.json").read_text())["run_id"]
    return [(m.step, m.value) for m in sorted(MlflowClient(f"sqlite:///{Path(out).parent / 'mlflow.db'}")
                                               .get_metric_history(run_id, key), key=lambda m: m.step)]


def test_resumed_run_trains_on_the_same_batches(tiny, tmp_path):
    """Killed at step 7 with its last checkpoint at step 4 (the crash's own checkpoint is removed, as after a
    SIGKILL): the resumed run draws the batches and anchors of steps 5-10 an uninterrupted run draws, so the two
    loss curves agree, with one point per step."""
    from lightning.pytorch.callbacks import Callback

    from domino_lab.train import train

    class Crash(Exception):
        pass

    class CrashAtStep7(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 7:
                raise Crash()

    whole = train(load_config(TrainConfig, None, quick_args(tiny, tmp_path / "whole", 10)))
    out = tmp_path / "resumed"
    cfg = load_config(TrainConfig, None, quick_args(tiny, out, 10) + ["threads=1"])
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    try:
        with pytest.raises(Crash):
            train(cfg, extra_callbacks=[CrashAtStep7()])
        assert torch.get_num_threads() == before + 1    # the run's threads do not outlive it, even when it fails
    finally:
        torch.set_num_threads(before)
    # an error inside a step leaves no on_exception.ckpt (Lightning would resume that mid-step state one step off):
    # the run resumes from the last periodic checkpoint
    assert not (out / "checkpoints" / "on_exception.ckpt").exists()
    assert [s for s, _ in _history(out)] == list(range(6))          # steps 5 and 6 came after the checkpoint
    res = train(load_config(TrainConfig, None, quick_args(tiny, out, 10) + ["threads=1"]), resume=True)
    assert res["steps"] == whole["steps"] == 10
    a, b = _history(tmp_path / "whole"), _history(out)
    assert [s for s, _ in b] == [s for s, _ in a] == list(range(10))
    torch.testing.assert_close([v for _, v in b], [v for _, v in a], rtol=1e-5, atol=1e-6)


def test_sigkilled_run_resumes_with_one_point_per_step(tiny, tmp_path):
    """SIGKILL leaves no checkpoint of its own: the steps logged after the last periodic checkpoint are trained and
    logged again by the resumed run, and MLflow must still hold exactly one train/loss point per step."""
    import sqlite3

    out = tmp_path / "run"
    args = quick_args(tiny, out, 30, ckpt_every=10)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "domino_lab.train", *args], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    db, logged, deadline = tmp_path / "mlflow.db", 0, time.time() + 240
    # kill once steps after the step-10 checkpoint are in MLflow, well before the next checkpoint (step 20)
    while logged < 13 and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
        try:
            with sqlite3.connect(db, timeout=5) as con:
                logged = con.execute("SELECT COUNT(*) FROM metrics WHERE key = 'train/loss'").fetchone()[0]
        except sqlite3.Error:       # not created yet, or locked by the writer
            pass
    assert p.poll() is None, p.stderr.read()[-2000:]
    p.kill()
    p.wait(timeout=60)
    assert not (out / "checkpoints" / "on_exception.ckpt").exists()
    ckpt_step = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]
    before = [s for s, _ in _history(out)]
    assert max(before) >= ckpt_step, (before, ckpt_step)             # steps past the checkpoint were logged
    q = subprocess.run([sys.executable, "-m", "domino_lab.train", *args, "--resume"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert q.returncode == 0, q.stderr[-2000:]
    assert json.loads((out / "result.json").read_text())["steps"] == 30
    assert [s for s, _ in _history(out)] == list(range(30))


def test_resume_refuses_what_it_cannot_continue(tiny, tmp_path, capsys):
    from domino_lab.train import main

    def run(argv):
        with pytest.raises(SystemExit) as e:
            run_cli(main, argv)
        err = [x for x in capsys.readouterr().err.strip().splitlines() if x.strip()]
        return e.value.code, err

    # nothing to resume: an error, not a silent fresh run
    fresh = tmp_path / "fresh"
    code, err = run(quick_args(tiny, fresh, 2) + ["--resume"])
    assert code == 2 and err[-1].startswith("error: --resume") and "no checkpoint" in err[-1]
    assert not fresh.exists()
    # the run trains on a copy of the data, whose content digest it records (result, checkpoint, exported drafter)
    from domino_lab.data.regenerate import data_digest
    from domino_lab.models.drafter import read_provenance
    data = tmp_path / "data"
    shutil.copytree(tiny[1], data)
    out = tmp_path / "run"
    args = quick_args((tiny[0], str(data)), out, 2, ckpt_every=1)
    code, err = run(args)
    assert code == 0
    digest = data_digest(data)
    assert json.loads((out / "result.json").read_text())["data_digest"] == digest
    assert read_provenance(out / "final") == {"data_digest": digest, "seed": 0, "step": 2,
                                              "target_digest": read_provenance(out / "final")["target_digest"]}
    # other data at the same path (here: its recorded digest changed): refused, not one run of two datasets
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps(dict(meta, data_digest="0123456789abcdef")))
    code, err = run(args + ["--resume"])
    assert code == 2 and "is not the data the checkpoint" in err[-1] and digest in err[-1]
    (data / "meta.json").write_text(json.dumps(meta))
    # another config: MLflow cannot change a run's parameters; name what differs instead of its traceback
    code, err = run(args + ["optim.lr=1e-3", "--resume"])
    assert code == 2 and len([x for x in err if x.startswith("error:")]) == 1 and "Traceback" not in "".join(err)
    assert "optim.lr was 0.003, now 0.001" in err[-1]
    # an empty run record (a write cut short)
    (out / "mlflow_run.json").write_text("")
    code, err = run(args + ["--resume"])
    assert code == 2 and "mlflow_run.json is not a valid MLflow run record" in err[-1]
    # a damaged checkpoint
    (out / "mlflow_run.json").unlink()
    for c in (out / "checkpoints").glob("*.ckpt"):
        c.write_bytes(c.read_bytes()[:100])
    code, err = run(args + ["--resume"])
    assert code == 2 and "cannot read checkpoint" in err[-1]


def test_result_file_is_replaced_whole(tiny, tmp_path, monkeypatch):
    """A write cut short (disk full, a kill) leaves the previous result.json / mlflow_run.json, never half a file."""
    from domino_lab.train import train
    from domino_lab.training.tracking import remember_run

    real, failing = Path.write_text, ["mlflow_run.json"]

    def disk_full(self, text, *a, **k):
        if self.name.lstrip(".").startswith(failing[0]):
            real(self, "")                                          # truncated, then the write fails
            raise OSError(28, "No space left on device")
        return real(self, text, *a, **k)

    out = tmp_path / "run"
    out.mkdir()
    (out / "result.json").write_text('{"steps": 1}')
    (out / "mlflow_run.json").write_text('{"run_id": "abc"}')
    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError):
        remember_run(type("L", (), {"run_id": "new", "experiment_id": "0"})(), out)
    assert (out / "mlflow_run.json").read_text() == '{"run_id": "abc"}'
    (out / "mlflow_run.json").unlink()
    failing[0] = "result.json"
    with pytest.raises(OSError):
        train(load_config(TrainConfig, None, quick_args(tiny, out, 1)))
    assert (out / "result.json").read_text() == '{"steps": 1}'
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_out_of_range_values_fail_before_training(tiny, tmp_path, capsys):
    """One error line naming the key, from the config itself, for every entry point (train, sweep, experiments)."""
    from domino_lab.train import main

    for override, key in (("data.batch_size=0", "data.batch_size"), ("eval.every_n_steps=0", "eval.every_n_steps"),
                          ("loss.num_anchors=0", "loss.num_anchors"), ("max_steps=0", "max_steps"),
                          ("max_steps=-1", "max_steps"), ("checkpoint_every_n_steps=0", "checkpoint_every_n_steps"),
                          ("optim.lr=0", "optim.lr"), ("seed=-1", "seed"), (f"seed={2**70}", "seed"),
                          ("data.val_fraction=1.5", "data.val_fraction"), ("loss.prefix_mode=tf", "loss.prefix_mode"),
                          ("tracking_uri=bogus://x", "tracking URI"), ("precision=half", "precision")):
        with pytest.raises(UserError, match=key.replace(".", r"\.")):
            load_config(TrainConfig, None, [override])
        out = tmp_path / override.split("=")[0]
        with pytest.raises(SystemExit) as e:
            run_cli(main, quick_args(tiny, out, 2) + [override])
        err = [x for x in capsys.readouterr().err.strip().splitlines() if x.strip()]
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and key in err[0], (override, err)
        assert not out.exists(), override


def test_fewer_batches_than_processes_is_one_error_before_the_run(tiny, tmp_path, capsys):
    """Each process trains on its own share of the batches; a share that is empty made Lightning stop without a
    step, and the run exited 0 with an untrained drafter exported."""
    from domino_lab.train import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        run_cli(main, base_args(tiny, out, steps=2) + ["data.batch_size=64", "--devices", "2", "--accelerator", "cpu",
                                                      "--strategy", "ddp"])
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x.strip()]
    assert e.value.code == 2 and len(err) == 1, err
    assert "1 batch(es) of data.batch_size 64, for 2 processes" in err[0] and "fewer --devices" in err[0]
    assert not out.exists()


def test_two_process_ddp_on_cpu(tiny, tmp_path):
    out = tmp_path / "ddp"
    args = base_args(tiny, out, steps=6, every=3) + ["--devices", "2", "--strategy", "ddp", "--accelerator", "cpu",
                                                     "threads=1"]
    q = subprocess.run([sys.executable, "-m", "domino_lab.train", *args], capture_output=True, text=True,
                       timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert q.returncode == 0, q.stderr[-3000:]
    assert json.loads((out / "result.json").read_text())["steps"] == 6
    assert "world_size: 2" in q.stderr or "distributed_backend=gloo" in q.stderr


def test_bf16_mixed_training_on_cpu(tiny, tmp_path):
    """precision=bf16-mixed on a CPU: the drafter trains under bf16 autocast and exports float32 weights, while the
    target's features and the val τ decode stay at the target's own dtype (what the drafter reads when decoding)."""
    from domino_lab.config import load_config
    from domino_lab.target import Target
    from domino_lab.train import train
    from domino_lab.training.module import measure_tau
    from safetensors.torch import load_file

    target = Target.from_pretrained(tiny[0])
    seen = []
    features = target.features

    def spy(ids, taps):
        out = features(ids, taps)
        seen.append((torch.is_autocast_enabled("cpu"), out.dtype))
        return out

    target.features = spy
    cfg = load_config(TrainConfig, None, quick_args(tiny, tmp_path / "run", 4, every=4) + ["precision=bf16-mixed"])
    res = train(cfg, target=target)
    assert res["steps"] == 4 and res["best_tau"] >= 1.0
    assert seen and all(s == (False, torch.float32) for s in seen), seen
    weights = load_file(str(Path(res["final_dir"]) / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {torch.float32}
    trained = Drafter.from_pretrained(res["final_dir"], target)
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    plain = measure_tau(target, trained, prompts, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = measure_tau(target, trained, prompts, 16)
    assert [p["tau"] for p in inside["per_prompt"]] == [p["tau"] for p in plain["per_prompt"]]


# ---- warm start and head-only training ---------------------------------------------------------------
def test_head_only_training_keeps_the_backbone(tiny, tmp_path):
    """optim.train=head on a dflash backbone (drafter.init_from): the drafter takes the source's architecture
    (its taps, not the recipe's default), the backbone comes out bit-identical, the new head trains, batched
    val τ equals one-at-a-time val τ prompt by prompt."""
    from safetensors.torch import load_file

    from domino_lab.config import load_config
    from domino_lab.target import Target
    from domino_lab.train import train
    from domino_lab.training.config import drafter_config
    from domino_lab.training.datamodule import DrafterDataModule
    from domino_lab.training.module import measure_tau

    target = Target.from_pretrained(tiny[0])
    src = Drafter.untrained(target, "dflash", seed=3, target_layer_ids=[0, 2])
    src.save_pretrained(tmp_path / "src")
    args = base_args(tiny, tmp_path / "run", steps=6, every=6) + [
        f"drafter.init_from={tmp_path / 'src'}", "optim.train=head", "eval.tau_prompts=2", "eval.tau_batch=2"]
    cfg = load_config(TrainConfig, None, args)
    dcfg = drafter_config(cfg.drafter, target)
    assert dcfg.method == "domino" and dcfg.target_layer_ids == [0, 2] and dcfg.rank == 16
    res = train(cfg, target=target)
    out = load_file(str(Path(res["final_dir"]) / "model.safetensors"))
    before = src.state_dict()
    assert set(before) < set(out) and any(k.startswith("head.") for k in out)
    for k, v in before.items():
        assert torch.equal(out[k].to(v.dtype), v), k                      # the backbone did not move
    fresh = Drafter(dcfg, target).state_dict()
    assert any(not torch.equal(out[k].to(fresh[k].dtype), fresh[k]) for k in out if k.startswith("head."))
    trained = Drafter.from_pretrained(res["final_dir"], target)
    dm = DrafterDataModule(cfg.data)
    dm.setup()
    prompts = dm.tau_prompts(4)
    one, batched = measure_tau(target, trained, prompts, 24), measure_tau(target, trained, prompts, 24, batch=3)
    assert [p["tau"] for p in one["per_prompt"]] == [p["tau"] for p in batched["per_prompt"]]
    assert one["tau"] == pytest.approx(batched["tau"]) and batched["verify_ms"] > 0


def test_backbone_only_training_keeps_the_head(tiny, tmp_path):
    """optim.train=backbone on a domino source: the head comes out bit-identical to the source's, the backbone
    trains. A source without a head (dflash) or a drafter without one is refused before any step."""
    from safetensors.torch import load_file

    from domino_lab.target import Target
    from domino_lab.train import train
    from domino_lab.training.config import drafter_config
    from domino_lab.training.module import DrafterModule

    target = Target.from_pretrained(tiny[0])
    src = Drafter.untrained(target, "domino", seed=5, rank=16, gru_hidden=32)
    src.save_pretrained(tmp_path / "src")
    args = base_args(tiny, tmp_path / "run", steps=6, every=6) + [
        f"drafter.init_from={tmp_path / 'src'}", "optim.train=backbone", "eval.tau_prompts=2"]
    res = train(load_config(TrainConfig, None, args), target=target)
    out = load_file(str(Path(res["final_dir"]) / "model.safetensors"))
    before = src.state_dict()
    heads = [k for k in before if k.startswith("head.")]
    assert heads and all(torch.equal(out[k].to(before[k].dtype), before[k]) for k in heads)
    moved = [k for k in before if not k.startswith("head.") and before[k].is_floating_point()
             and not torch.equal(out[k].to(before[k].dtype), before[k])]
    assert any(k.startswith("backbone.") for k in moved), moved

    Drafter.untrained(target, "dflash").save_pretrained(tmp_path / "flat")
    cfg = load_config(TrainConfig, None, base_args(tiny, tmp_path / "a") + [
        f"drafter.init_from={tmp_path / 'flat'}", "optim.train=backbone", "drafter.method=domino"])
    with pytest.raises(UserError, match="optim.train=backbone freezes the head.*no head of this shape"):
        DrafterModule(cfg, drafter_config(cfg.drafter, target), target)
    cfg = load_config(TrainConfig, None, base_args(tiny, tmp_path / "b") + [
        f"drafter.init_from={tmp_path / 'flat'}", "optim.train=backbone", "drafter.method=dflash"])
    with pytest.raises(UserError, match="optim.train=backbone needs a drafter with a head"):
        DrafterModule(cfg, drafter_config(cfg.drafter, target), target)


def test_head_only_and_warm_start_errors(tiny, tmp_path):
    from domino_lab.target import Target
    from domino_lab.training.config import drafter_config
    from domino_lab.training.module import DrafterModule

    with pytest.raises(UserError, match="optim.train must be one of"):
        load_config(TrainConfig, None, ["optim.train=everything"])
    for part in ("head", "backbone"):
        with pytest.raises(UserError, match=f"optim.train={part} freezes .* set drafter.init_from"):
            load_config(TrainConfig, None, [f"optim.train={part}"])
    target = Target.from_pretrained(tiny[0])
    Drafter.untrained(target, "domino", rank=8).save_pretrained(tmp_path / "dom")
    # a dflash drafter has no head to train
    cfg = load_config(TrainConfig, None, base_args(tiny, tmp_path / "a") + [
        f"drafter.init_from={tmp_path / 'dom'}", "optim.train=head", "drafter.method=dflash"])
    with pytest.raises(UserError, match="needs a drafter with a head"):
        DrafterModule(cfg, drafter_config(cfg.drafter, target), target)
    # the whole drafter from a source whose head has another shape: named, not silently re-initialised
    cfg = load_config(TrainConfig, None, base_args(tiny, tmp_path / "b") + [f"drafter.init_from={tmp_path / 'dom'}"])
    with pytest.raises(UserError, match=r"do not fit this drafter \(head\."):
        DrafterModule(cfg, drafter_config(cfg.drafter, target), target)
    with pytest.raises(UserError, match="not a readable drafter directory"):
        drafter_config(load_config(TrainConfig, None, [f"drafter.init_from={tmp_path / 'nothing'}"]).drafter, target)


def test_warm_starts_from_a_release_export_and_into_another_frspec_size(tiny, tmp_path):
    """A release-layout export names its fields otherwise: the warm start reads it as from_pretrained does and takes
    its taps and label convention (it took the recipe's, and trained layer-2 weights on tap 1). A source without an
    FR-Spec list, or with one of another size, leaves the list to be made from the data (it was refused)."""
    from domino_lab.models.export import export_drafter
    from domino_lab.target import Target
    from domino_lab.training.config import drafter_config
    from domino_lab.training.module import DrafterModule

    target = Target.from_pretrained(tiny[0])
    src = Drafter.untrained(target, "domino", target_layer_ids=[2], shift_label=False, rank=16, gru_hidden=32)
    export_drafter(src, "domino", tmp_path / "rel")
    cfg = load_config(TrainConfig, None, base_args(tiny, tmp_path / "a") + [f"drafter.init_from={tmp_path / 'rel'}"])
    dcfg = drafter_config(cfg.drafter, target)
    assert dcfg.target_layer_ids == [2] and dcfg.shift_label is False
    module = DrafterModule(cfg, dcfg, target)
    assert torch.equal(module.drafter.backbone.fc.weight, src.backbone.fc.weight)
    src.save_pretrained(tmp_path / "own")                     # no FR-Spec list
    cfg = load_config(TrainConfig, None, base_args(tiny, tmp_path / "b") + [f"drafter.init_from={tmp_path / 'own'}",
                                                                            "drafter.frspec_k=16"])
    module = DrafterModule(cfg, drafter_config(cfg.drafter, target), target)
    assert "frspec_ids" not in module.warm_started and module.drafter.config.frspec_k == 16


def test_the_progress_bar_of_step_limited_training_shows_no_epoch_limit():
    """Training ends at max_steps, so Lightning holds max_epochs = -1, and its rich bar would read "Epoch 0/-2"."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import RichProgressBar

    from domino_lab.training.callbacks import StepProgressBar

    assert "_get_train_description" in vars(RichProgressBar)     # the Lightning method the bar refines is still there
    bar = StepProgressBar()
    for max_epochs, shown in ((-1, "Epoch 0"), (5, "Epoch 0/4")):
        bar._trainer = SimpleNamespace(max_epochs=max_epochs)
        assert bar._get_train_description(0).rstrip() == shown



def test_a_fresh_run_ends_the_abandoned_run_of_its_folder(tmp_path):
    """A run killed before its first checkpoint left its MLflow run RUNNING and its folder without a checkpoint; a
    fresh run there marks the old one KILLED (it cannot be resumed any more). A resume, a damaged record and a run
    that already ended are left alone."""
    from mlflow.tracking import MlflowClient

    from domino_lab.training.tracking import RUN_FILE, ensure_experiment, make_logger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = ensure_experiment(uri, "e")
    out = tmp_path / "run"
    out.mkdir()

    def abandoned(status="RUNNING"):
        rid = client.create_run(exp).info.run_id
        if status != "RUNNING":
            client.set_terminated(rid, status)
        (out / RUN_FILE).write_text(json.dumps({"run_id": rid}))
        return rid

    def status(rid):
        return client.get_run(rid).info.status

    rid = abandoned()
    make_logger(uri, "e", None, out, resume=True)
    assert status(rid) == "RUNNING"
    make_logger(uri, "e", None, out, resume=False)
    assert status(rid) == "KILLED"
    done = abandoned("FINISHED")
    make_logger(uri, "e", None, out, resume=False)
    assert status(done) == "FINISHED"
    (out / RUN_FILE).write_text("")
    make_logger(uri, "e", None, out, resume=False)          # damaged: nothing to end, no error
    (out / RUN_FILE).write_text(json.dumps({"run_id": "0" * 32}))
    make_logger(uri, "e", None, out, resume=False)          # a run this store does not have


def test_a_damaged_tracking_store_is_one_error_before_the_run_folder_exists(tiny, tmp_path, capsys):
    """The store was first opened by the logger, after the target, the data and the run folder: a traceback, and an
    empty folder left where the run was to be."""
    from domino_lab.train import main

    bad = tmp_path / "mlflow.db"
    bad.write_bytes(b"not a database " * 400)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        run_cli(main, quick_args(tiny, out, 2) + [f"tracking_uri=sqlite:///{bad}"])
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x.strip()]
    assert e.value.code == 2 and len(err) == 1, err
    assert "cannot use the MLflow tracking store" in err[0] and "file is not a database" in err[0]
    assert not out.exists()
