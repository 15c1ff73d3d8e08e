"""Data integrity: no prompt text on both sides of the train/validation split, no evaluation prompt and no outside
set in the training data, one dtype per regenerated dataset, and offline features keyed by the target's dtype and
checked whole before training reads them."""
from __future__ import annotations

import json

import pytest
import torch

from domino_lab.data.features import cache_key, ensure
from domino_lab.data.regenerate import SHARD_DIR, load_meta, regenerate, training_prompts
from domino_lab.errors import UserError
from domino_lab.training.config import DataOptions
from domino_lab.training.datamodule import DrafterDataModule, _is_val


@pytest.fixture(scope="module")
def tdir(tmp_path_factory):
    from core_helpers import make_target_dir

    return str(make_target_dir(tmp_path_factory.mktemp("integrity") / "target", max_pos=256))


def _ids(side: bool, n: int, frac: float) -> list[str]:
    """`n` prompt ids that the id hash puts on validation (`side` True) or training at `val_fraction` `frac`."""
    found = []
    i = 0
    while len(found) < n:
        if _is_val(f"q{i}", frac) == side:
            found.append(f"q{i}")
        i += 1
    return found


def _split(paths: list[str], frac: float) -> DrafterDataModule:
    dm = DrafterDataModule(DataOptions(path=paths[0], extra_paths=paths[1:], val_fraction=frac,
                                       min_response_tokens=1))
    dm.setup("fit")
    return dm


def _prompt(r: dict) -> tuple[int, ...]:
    return tuple(r["input_ids"][: r["prompt_len"]])


def test_a_prompt_text_under_two_ids_stays_on_one_side_of_the_split(tdir, tmp_path):
    frac = 0.3
    (held,), (trained, *others) = _ids(True, 1, frac), _ids(False, 5, frac)
    texts = ["x = 1", "def add(a, b):", "Question: Tom has", "return a", "Answer: 3"]
    prompts = ([{"id": held, "prompt": "def f(x):"}, {"id": trained, "prompt": "def f(x):"}]
               + [{"id": i, "prompt": t} for i, t in zip(others, texts)])
    regenerate(tdir, prompts, tmp_path / "d", max_new_tokens=6, progress=False)
    dm = _split([str(tmp_path / "d")], frac)
    assert not {_prompt(r) for r in dm.train_rows} & {_prompt(r) for r in dm.val_rows}
    assert {r["id"] for r in dm.val_rows} == {held, trained}
    # every other row keeps the side its id hashes to, as in runs made before
    assert [r["id"] for r in dm.train_rows] == others


def test_training_prompts_ask_each_text_once_and_never_an_eval_prompt(monkeypatch):
    from domino_lab.data import eval_sets

    texts = ["Question: a\nAnswer:", "Question: b\nAnswer:", "Question: a\nAnswer:", "Question: held\nAnswer:",
             "Question: c\nAnswer:"]
    monkeypatch.setattr(eval_sets, "math_prompts",
                        lambda split, n: [{"id": f"math/{i}", "prompt": t} for i, t in enumerate(texts[:n])])
    monkeypatch.setattr(eval_sets, "eval_prompt_texts", lambda cache_dir=None: frozenset({texts[3]}),
                        raising=False)
    assert [p["id"] for p in training_prompts(5, 0)] == ["math/0", "math/1", "math/4"]


def test_default_training_prompts_are_distinct_and_hold_no_eval_prompt():
    """The default `--n-code 2000` met the stdlib's encodings modules: one `getregentry` prompt under six ids, and
    two such prompts verbatim in the held-out files the `code` eval set is cut from."""
    from domino_lab.data.eval_sets import EVAL_SETS, load_eval_set
    from domino_lab.regenerate import N_DEFAULTS

    prompts = training_prompts(N_DEFAULTS["n_math"], N_DEFAULTS["n_code"])
    texts = [p["prompt"] for p in prompts]
    assert len(set(texts)) == len(texts)
    assert not {x["prompt"] for name in EVAL_SETS for x in load_eval_set(name)} & set(texts)
    assert len(prompts) > 0.99 * (N_DEFAULTS["n_math"] + N_DEFAULTS["n_code"])     # only the repeats are gone


@pytest.mark.parametrize("spec", ["fresh+math", "math+unseen"])
def test_outside_sets_joined_by_plus_are_refused(tmp_path, capsys, spec):
    from domino_lab.errors import run_cli
    from domino_lab.regenerate import main

    with pytest.raises(SystemExit) as e:
        run_cli(main, ["--prompts", spec, "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "evaluation ground" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_outside_prompts_are_cached_where_asked(tmp_path, monkeypatch):
    from domino_lab.data.eval_sets import load_eval_set

    monkeypatch.setenv("DOMINO_LAB_CACHE", str(tmp_path / "env"))
    load_eval_set("unseen", cache_dir=tmp_path / "asked")
    assert any(p.name.startswith("outside-prompts-unseen-") for p in (tmp_path / "asked").iterdir())
    assert not (tmp_path / "env").exists() or not any((tmp_path / "env").iterdir())


def test_extra_folders_hold_out_a_whole_prompt_and_too_little_data_is_an_error(tdir, tmp_path):
    prompts = [{"id": f"p{i}", "prompt": t} for i, t in enumerate(["x = 1", "def f(x):", "return a", "Answer: 3"])]
    regenerate(tdir, prompts, tmp_path / "greedy", max_new_tokens=6, progress=False)
    regenerate(tdir, prompts, tmp_path / "sampled", max_new_tokens=6, temperature=1.0, seed=1, progress=False)
    dm = _split([str(tmp_path / "greedy"), str(tmp_path / "sampled")], 0.0)     # no id hashes into validation
    val = {r["prompt_id"] for r in dm.val_rows}
    assert len(val) == 1 and len(dm.val_rows) == 2
    assert not val & {r["prompt_id"] for r in dm.train_rows}
    regenerate(tdir, prompts[:1], tmp_path / "one", max_new_tokens=6, progress=False)
    with pytest.raises(UserError, match="too small to split"):
        _split([str(tmp_path / "one")], 0.0)


def test_resuming_with_another_dtype_is_refused(tdir, tmp_path):
    prompts = [{"id": f"p{i}", "prompt": t} for i, t in enumerate(["x = 1", "def f(x):", "return a"])]
    out = tmp_path / "d"
    regenerate(tdir, prompts[:2], out, max_new_tokens=6, dtype="float64", progress=False)
    assert load_meta(out)["dtype"] == "float64"
    with pytest.raises(UserError, match="other settings.*dtype"):
        regenerate(tdir, prompts, out, max_new_tokens=6, dtype="float32", progress=False)
    # a folder made before the dtype was recorded resumes as before, and its dtype stays unknown
    settings = out / SHARD_DIR / "settings.json"
    settings.write_text(json.dumps({k: v for k, v in json.loads(settings.read_text()).items() if k != "dtype"}))
    regenerate(tdir, prompts, out, max_new_tokens=6, dtype="float32", progress=False)
    meta = load_meta(out)
    assert meta["rows"] == 3 and meta["dtype"] is None


def _rows(n: int = 6) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"id": f"r{i}", "input_ids": torch.randint(4, 60, (5 + 3 * i,), generator=g).tolist()} for i in range(n)]


def test_feature_cache_key_holds_the_targets_compute_dtype():
    from core_helpers import tiny_target

    rows = _rows()
    t32, t64 = tiny_target(dtype=torch.float32), tiny_target(dtype=torch.float64)
    assert t32.weights_digest == t64.weights_digest        # the digest alone cannot tell the two loads apart
    assert cache_key(t32, [1, 2], rows) != cache_key(t64, [1, 2], rows)
    assert cache_key(t32, [1, 2], rows) == cache_key(tiny_target(dtype=torch.float32), [1, 2], rows)


@pytest.mark.parametrize("damage", ["truncate", "missing", "index"])
def test_a_damaged_feature_cache_is_one_error_naming_it(tmp_path, damage):
    from core_helpers import tiny_target

    target, rows = tiny_target(), _rows()
    cache = ensure(target, rows, [1, 2], tmp_path / "f", progress=False)
    assert cache[rows[-1]["id"]].shape == (len(rows[-1]["input_ids"]), cache.width)
    shard = cache.path / cache.shards[0]
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "missing":
        shard.unlink()
    else:
        (cache.path / "index.json").write_text(json.dumps({"version": 1}))
    with pytest.raises(UserError, match="damaged.*delete the folder") as e:
        ensure(target, rows, [1, 2], tmp_path / "f", progress=False)
    assert str(cache.path) in str(e.value)
