"""Broken drafter and target directories, and prompts that are not text: one UserError each, nothing written.

Every case is a copy of a shipped asset with one thing broken, loaded through the library or a CLI's `main`.
"""
import json
import shutil
from pathlib import Path

import pytest

from domino_lab import Drafter, Target
from domino_lab.errors import UserError
from domino_lab.models.drafter import SHIPPED_DRAFTERS, family_of

ASSETS = Path(__file__).resolve().parent.parent / "domino_lab" / "assets"
DRAFTER = SHIPPED_DRAFTERS["default-nocopy"]      # a domino drafter the release layouts can hold


@pytest.fixture(scope="module")
def target():
    return Target.from_pretrained("default")


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory, target):
    from domino_lab.models.export import export_drafter

    out = tmp_path_factory.mktemp("release") / "domino"
    export_drafter(Drafter.from_pretrained("default-nocopy", target), "domino", out)
    return out


def drafter_copy(tmp_path, src=DRAFTER) -> Path:
    return Path(shutil.copytree(src, tmp_path / "drafter"))


def edit_config(path: Path, **changes) -> None:
    cfg = path / "config.json"
    cfg.write_text(json.dumps(json.loads(cfg.read_text()) | changes))


def prompts_file(tmp_path, prompts) -> Path:
    f = tmp_path / "prompts.jsonl"
    # ensure_ascii: the file holds the escape "\udcff", as json.dumps writes text read with surrogateescape
    f.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}, ensure_ascii=True) + "\n"
                         for i, p in enumerate(prompts)))
    return f


# ---- drafter directories ----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["ours", "release"])
def test_a_config_that_is_not_an_object(tmp_path, target, release_dir, layout):
    d = drafter_copy(tmp_path, DRAFTER if layout == "ours" else release_dir)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match=r"drafter config .*config\.json must be a JSON object.*got a list"):
        Drafter.from_pretrained(d, target)
    assert family_of(str(d)) is None


def test_a_config_json_that_is_a_directory(tmp_path, target):
    d = drafter_copy(tmp_path)
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    with pytest.raises(UserError, match=r"cannot read drafter config .*config\.json"):
        Drafter.from_pretrained(d, target)


@pytest.mark.parametrize("mask", [10**9, -1])
def test_a_mask_token_outside_the_vocabulary_is_refused_at_load(tmp_path, target, mask):
    d = drafter_copy(tmp_path)
    edit_config(d, mask_token_id=mask)
    with pytest.raises(UserError, match=rf"config\.json: mask_token_id {mask} is outside the vocabulary \[0, 8192\)"):
        Drafter.from_pretrained(d, target)


def test_a_release_mask_token_outside_the_vocabulary(tmp_path, target, release_dir):
    d = drafter_copy(tmp_path, release_dir)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["mask_token_id"] = 10**9
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"release config .*config\.json: mask_token_id 1000000000 is outside"):
        Drafter.from_pretrained(d, target)


@pytest.mark.parametrize("field,value,want", [
    ("target_fingerprint", "abc", "a JSON object"),
    ("target_layer_ids", "abc", "a list of ints"),
    ("target_layer_ids", [1, "2"], "a list of ints"),
    ("target_layer_ids", [], "at least one target layer"),
    ("block_size", "8", "an int"),
    ("mask_token_id", 1e9, "an int"),
    ("shift_label", 1, "a bool"),
])
def test_a_field_of_the_wrong_type_names_the_field_and_the_file(tmp_path, target, field, value, want):
    from domino_lab.generate import main

    d = drafter_copy(tmp_path)
    edit_config(d, **{field: value})
    with pytest.raises(UserError, match=rf"drafter config {d}/config\.json: .*{field}.*{want}"):
        main(["--drafter", str(d), "--prompt", "hi", "--max-new-tokens", "8"])


def test_a_cut_off_release_checkpoint(tmp_path, target, release_dir):
    d = drafter_copy(tmp_path, release_dir)
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    with pytest.raises(UserError, match=r"drafter weights .*model\.safetensors are cut off"):
        Drafter.from_pretrained(d, target)


# ---- target directories -----------------------------------------------------------------------------------
def test_a_cut_off_target_checkpoint(tmp_path):
    t = Path(shutil.copytree(ASSETS / "target", tmp_path / "target"))
    weights = t / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    with pytest.raises(UserError, match=rf"cannot load target '{t}': its weights in {t} are not a readable"):
        Target.from_pretrained(str(t))


def test_a_target_without_tokenizer_files_says_so(tmp_path):
    from domino_lab.data.regenerate import regenerate
    from domino_lab.generate import main

    t = Path(shutil.copytree(ASSETS / "target", tmp_path / "target"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (t / name).unlink()
    with pytest.raises(UserError, match=rf"target '{t}' has no tokenizer.*add its tokenizer files"):
        main(["--target", str(t), "--drafter", "none", "--prompt", "hi", "--max-new-tokens", "8"])
    with pytest.raises(UserError, match="has no tokenizer"):
        regenerate(str(t), [{"id": "a", "prompt": "hi"}], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# ---- prompts that are not text ----------------------------------------------------------------------------
NOT_TEXT = r"prompt 3 of .*prompts\.jsonl \(line 3\) is not valid UTF-8 text \(a lone surrogate at character 2\)"


def test_a_prompt_argument_that_is_not_text():
    from domino_lab.generate import main

    with pytest.raises(UserError, match=r"--prompt is not valid UTF-8 text \(a lone surrogate at character 1\)"):
        main(["--prompt", "\udcff\udcfe", "--max-new-tokens", "8"])


def test_a_prompts_file_that_is_not_text_is_refused_by_every_reader(tmp_path):
    from domino_lab.bench import main as bench
    from domino_lab.data.eval_sets import load_eval_set
    from domino_lab.generate import main as generate
    from domino_lab.regenerate import main as regenerate

    f = prompts_file(tmp_path, ["hello", "world", "a\udcff"])
    assert "\\udcff" in f.read_text()
    with pytest.raises(UserError, match=NOT_TEXT):
        load_eval_set(str(f))
    with pytest.raises(UserError, match=NOT_TEXT):
        generate(["--prompts", str(f), "--max-new-tokens", "8"])
    with pytest.raises(UserError, match=NOT_TEXT):
        bench(["--sets", str(f), "--out", str(tmp_path / "bench")])
    with pytest.raises(UserError, match=NOT_TEXT):
        regenerate(["--prompts", str(f), "--out", str(tmp_path / "regen"), "--no-progress"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]      # nothing half-written


def test_regenerate_refuses_prompts_that_are_not_text_before_creating_anything(tmp_path):
    from domino_lab.data.regenerate import regenerate

    with pytest.raises(UserError, match=r"prompt 'b' is not valid UTF-8 text \(a lone surrogate at character 2\)"):
        regenerate("default", [{"id": "a", "prompt": "ok"}, {"id": "b", "prompt": "x\udcff"}], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_encoding_a_prompt_that_is_not_text(target):
    with pytest.raises(UserError, match=r"the prompt is not valid UTF-8 text"):
        target.encode("a\udcff")


def test_a_hub_id_without_network_fails_at_once(monkeypatch):
    """No route to the hub: the cache alone is asked (no half-minute of retries), and the error says why."""
    import socket

    from domino_lab import target as target_mod

    def no_dns(*a, **k):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    assert not target_mod.hub_reachable()
    import transformers

    asked = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*a, **k):
        asked.append(k.get("local_files_only"))
        return real(*a, **k)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    with pytest.raises(UserError, match="'nosuch/model': the Hugging Face hub cannot be reached from this machine "
                                        "and the model is not in the local cache"):
        target_mod.Target.from_pretrained("nosuch/model")
    assert asked == [True]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [])
    assert target_mod.hub_reachable()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not target_mod.hub_reachable()
