"""Offline target features (domino_lab/data/features.py): the cache holds exactly the target's tapped hidden
states, is keyed by target, taps and data, and training from it follows the online run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from domino_lab.config import load_config
from domino_lab.data.features import FeatureCache, cache_key, ensure
from domino_lab.target import Target
from domino_lab.training.config import TrainConfig
from domino_lab.training.datamodule import DrafterDataModule

from test_training import base_args


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from core_helpers import make_regenerated

    return make_regenerated(tmp_path_factory.mktemp("feat"), n_prompts=24)


def test_cache_equals_online_features_and_is_keyed(tiny, tmp_path):
    tdir, data = tiny
    target = Target.from_pretrained(tdir)
    cfg = load_config(TrainConfig, None, [f"target={tdir}", f"data.path={data}"])
    dm = DrafterDataModule(cfg.data)
    dm.setup()
    rows = dm.train_rows + dm.val_rows
    cache = ensure(target, rows, [1, 2], tmp_path / "f", progress=False)
    assert len(cache) == len(rows) and cache.width == 2 * target.hidden_size
    for r in rows[:6]:
        online = target.forward(torch.tensor([r["input_ids"]]), taps=[1, 2]).features[0]
        got = cache[r["id"]]
        assert got.dtype == torch.float16 and got.shape == online.shape
        torch.testing.assert_close(got.float(), online.float(), atol=2e-3, rtol=2e-3)   # fp16 storage
    # the same request reuses the folder; other taps or other data get another one
    assert ensure(target, rows, [1, 2], tmp_path / "f", progress=False).path == cache.path
    assert cache_key(target, [1], rows) != cache_key(target, [1, 2], rows)
    assert cache_key(target, [1, 2], rows[1:]) != cache_key(target, [1, 2], rows)
    assert len(list((tmp_path / "f").iterdir())) == 2          # the cache and its lock file, no temp folder
    (cache.path / "index.json").write_text("{")
    from domino_lab.errors import UserError
    with pytest.raises(UserError, match="delete the folder"):
        FeatureCache(cache.path)


def test_training_from_cached_features_follows_the_online_run(tiny, tmp_path):
    from domino_lab.train import train

    losses = {}
    for mode in ("online", "offline"):
        args = base_args(tiny, tmp_path / mode, steps=12, every=12) + [
            f"data.features={mode}", f"data.features_dir={tmp_path / 'features'}", "progress_bar=false"]
        res = train(load_config(TrainConfig, None, args))
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
        losses[mode] = [m.value for m in sorted(client.get_metric_history(res["run_id"], "train/loss"),
                                               key=lambda m: m.step)]
    assert len(losses["offline"]) == len(losses["online"]) == 12
    # same seed, same batches and anchors; only the fp16 storage of the features differs
    for a, b in zip(losses["online"], losses["offline"]):
        assert abs(a - b) < 1e-2 * max(1.0, abs(a)), (losses["online"], losses["offline"])
    assert any((tmp_path / "features").iterdir())
    json.loads(next(p for p in (tmp_path / "features").iterdir() if p.is_dir()).joinpath("index.json").read_text())


def test_bad_features_value_is_one_line():
    from domino_lab.errors import UserError
    with pytest.raises(UserError, match="data.features"):
        load_config(TrainConfig, None, ["data.features=disk"])


def test_extra_data_folders_join_with_their_own_rows_and_features(tiny, tmp_path, capsys):
    """data.extra_paths: a second folder answering the same prompts (here sampled at T = 1) adds its own rows, with
    ids of their own so the offline cache holds each response's features; a prompt's rows share a split side."""
    from domino_lab.data.regenerate import load_regenerated, regenerate
    from domino_lab.errors import run_cli
    from domino_lab.train import main

    tdir, data = tiny
    target = Target.from_pretrained(tdir)
    base = load_regenerated(data)
    sampled = tmp_path / "t1"
    regenerate(target, [{"id": r["id"], "prompt": target.tokenizer.decode(r["input_ids"][: r["prompt_len"]])}
                        for r in base], sampled, max_new_tokens=24, temperature=1.0, seed=3, progress=False)
    one = load_config(TrainConfig, None, [f"target={tdir}", f"data.path={data}", "data.val_fraction=0.3"])
    both = load_config(TrainConfig, None, [f"target={tdir}", f"data.path={data}", "data.val_fraction=0.3",
                                           f"data.extra_paths=[{sampled}]"])
    dm1, dm2 = DrafterDataModule(one.data), DrafterDataModule(both.data)
    dm1.setup()
    dm2.setup()
    rows1, rows2 = dm1.train_rows + dm1.val_rows, dm2.train_rows + dm2.val_rows
    assert len(rows2) > len(rows1) and len({r["id"] for r in rows2}) == len(rows2)
    assert {r["id"] for r in rows1} <= {r["id"] for r in rows2}        # the first folder's rows are unchanged
    val_prompts = {r["prompt_id"] for r in dm2.val_rows}
    assert val_prompts and not val_prompts & {r["prompt_id"] for r in dm2.train_rows}
    # the split hashes the prompt's id, so a prompt held out alone is held out with the second folder too; a prompt
    # can also be new to the split (its first response too short to keep, its sampled one long enough)
    assert {p for p in val_prompts if p in {r["prompt_id"] for r in rows1}} == {r["prompt_id"] for r in dm1.val_rows}
    tau = dm2.tau_prompts(100)
    assert len(tau) == len(val_prompts)                                   # each held-out prompt once
    # the offline cache keeps both responses of a prompt apart
    cache = ensure(target, rows2, [1, 2], tmp_path / "f", progress=False)
    by_id = {r["id"]: r for r in rows2}
    pair = next(i for i in by_id if i.endswith("#1") and by_id[i]["input_ids"] != by_id[i[:-2]]["input_ids"])
    for rid in (pair, pair[:-2]):
        online = target.forward(torch.tensor([by_id[rid]["input_ids"]]), taps=[1, 2]).features[0]
        torch.testing.assert_close(cache[rid].float(), online.float(), atol=2e-3, rtol=2e-3)
    # a missing folder: one error line, exit 2, nothing written
    with pytest.raises(SystemExit) as e:
        run_cli(main, base_args(tiny, tmp_path / "run") + [f"data.extra_paths=[{tmp_path / 'nope'}]"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert e.value.code == 2 and len(err) == 1 and "nope" in err[0] and "does not exist" in err[0]
    assert not (tmp_path / "run").exists()
