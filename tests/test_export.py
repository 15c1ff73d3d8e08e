"""Checkpoint interop with the Domino / DFlash releases (domino_lab/models/export.py, python -m domino_lab.export).

The fixture tests/fixtures/interop (made by experiments/interop/make_fixture.py with the releases' own modeling
code, which is not in this repository) holds a tiny float64 target, three exported drafters (Domino with
shift_label true / false in the Domino layout, DFlash in the DFlash layout) and what the release code computed
with them: per-round draft logits, drafts, decoded tokens and acceptance lengths. Here this project loads the same
release-layout directories and must reproduce those numbers without the release code.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from domino_lab import Drafter, Target, speculative_generate
from domino_lab.errors import UserError, run_cli
from domino_lab.models import registry
from domino_lab.models.drafter import family_of
from domino_lab.models.export import (export_drafter, is_release_dir, load_release, release_default_taps,
                                      release_state_dict)

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "interop"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
CASES = sorted(EXPECTED["cases"])
# the release code's numbers were computed in float64 like ours; the measured difference is ~1e-15
LOGIT_TOL = 1e-9


@pytest.fixture(scope="module")
def ftarget() -> Target:
    cfg = json.loads((FIXTURE / "target" / "config.json").read_text())
    cfg.pop("model_type")
    model = Qwen3ForCausalLM(Qwen3Config(**cfg)).double()
    model.load_state_dict(load_file(str(FIXTURE / "target" / "model.safetensors")), strict=True)
    return Target(model, None, mask_token_id=EXPECTED["mask_token_id"], taps=EXPECTED["taps"])


def block_logits(drafter, target, seq, start, anchor, drafts):
    """Final logits [n, V] of the block anchored at `start` (context: target features of seq[:start]), the GRU
    reading the given drafts; and the drafter's own greedy drafts for that block."""
    with torch.no_grad():
        feats = target.forward(torch.tensor([seq[:start]]), taps=drafter.config.target_layer_ids).features
        final = drafter.block_logits(feats, start, anchor, drafts[:-1])
        own = drafter.draft(feats, 0, torch.tensor([anchor]), start, None).tokens[0].tolist()
    return final[0], own


# ---- against the release code (fixture) ----------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_release_layout_loads_and_logits_match_the_release_code(ftarget, case):
    exp = load_file(str(FIXTURE / case / "expected.safetensors"))
    info = EXPECTED["cases"][case]
    drafter = Drafter.from_pretrained(FIXTURE / case, ftarget)          # a release-layout directory
    assert drafter.config.method == info["method"] and drafter.config.shift_label == info["shift_label"]
    seq = EXPECTED["prompt"] + info["release_tokens"]
    for impl in ("eager", "fast", "fused"):
        drafter.set_head(impl, 0)
        for r in range(exp["logits"].shape[0]):
            drafts = exp["drafts"][r].tolist()
            final, own = block_logits(drafter, ftarget, seq, int(exp["starts"][r]), int(exp["anchors"][r]), drafts)
            assert (final - exp["logits"][r]).abs().max() <= LOGIT_TOL, (case, r)
            assert own == drafts, (case, impl, r)


@pytest.mark.parametrize("case", CASES)
def test_decoding_matches_the_release_loop(ftarget, case):
    info = EXPECTED["cases"][case]
    drafter = Drafter.from_pretrained(FIXTURE / case, ftarget)
    res = speculative_generate(ftarget, drafter, prompt_ids=EXPECTED["prompt"],
                               max_new_tokens=EXPECTED["max_new_tokens"])
    assert res.token_ids == info["release_tokens"]
    rel = info["release_acceptance_lengths"]
    if info["release"] == "zlab":
        # the DFlash release verifies a whole block even past the token budget; this engine drafts only what fits
        assert res.acceptance_lengths[:-1] == rel[:len(res.acceptance_lengths) - 1]
    else:
        assert res.acceptance_lengths == rel


# ---- round trips through every layout ---------------------------------------------------------------------------
def _decode(target, drafter, prompts, n=16):
    out = []
    for p in prompts:
        r = speculative_generate(target, drafter, prompt=p, max_new_tokens=n)
        out.append((r.token_ids, r.acceptance_lengths, [s.draft_tokens for s in r.steps]))
    return out


@pytest.fixture(scope="module")
def default_target():
    return Target.from_pretrained("default")


@pytest.fixture(scope="module")
def default_prompts():
    from domino_lab.data.eval_sets import load_eval_set

    return [load_eval_set(s)[0]["prompt"] for s in ("math", "humaneval", "code")]


@pytest.mark.parametrize("spec,fmt", [("default-nocopy", "domino"), ("default-nocopy", "speculators"),
                                      ("default-dflash-nocopy", "speculators")])
def test_shipped_drafters_round_trip(tmp_path, default_target, default_prompts, spec, fmt):
    original = Drafter.from_pretrained(spec, default_target)
    out = export_drafter(original, fmt, tmp_path / "export")
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md"}
    assert is_release_dir(out) and family_of(str(out)) is type(original)
    back = Drafter.from_pretrained(out, default_target)
    assert back.config.method == original.config.method
    assert back.config.target_layer_ids == original.config.target_layer_ids
    # the shipped drafters carry an FR-Spec list; the export is the same weights over the whole vocabulary
    assert original.config.frspec_k and not back.config.frspec_k
    a = {k: v for k, v in original.state_dict().items() if k != "frspec_ids"}
    b = back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _decode(default_target, back, default_prompts) == _decode(default_target, original, default_prompts)


@pytest.mark.parametrize("fmt", ["dflash", "speculators"])
def test_dflash_without_shift_round_trips(tmp_path, ftarget, fmt):
    original = Drafter.from_pretrained(FIXTURE / "dflash", ftarget)
    assert not original.config.shift_label
    back = Drafter.from_pretrained(export_drafter(original, fmt, tmp_path / fmt), ftarget)
    ids = EXPECTED["prompt"]
    r1 = speculative_generate(ftarget, original, prompt_ids=ids, max_new_tokens=30)
    r2 = speculative_generate(ftarget, back, prompt_ids=ids, max_new_tokens=30)
    assert (r1.token_ids, r1.acceptance_lengths) == (r2.token_ids, r2.acceptance_lengths)


def test_domino_layout_config_and_tensor_names(tmp_path, ftarget):
    d = Drafter.from_pretrained(FIXTURE / "domino", ftarget)
    c = d.config
    cfg = json.loads((export_drafter(d, "domino", tmp_path / "x") / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] == c.num_layers and cfg["num_target_layers"] == ftarget.num_layers
    assert cfg["block_size"] == c.block_size and cfg["emb_dim"] == c.rank
    assert cfg["dflash_config"] == {"mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids,
                                    "shift_label": True, "projector_type": "domino", "emb_dim": c.rank,
                                    "gru_hidden_dim": c.gru_hidden, "pure_draft_prefix_len": 1}
    shapes = {k: list(v.shape) for k, v in load_file(str(tmp_path / "x" / "model.safetensors")).items()}
    H, g, r, V = c.hidden_size, c.gru_hidden, c.rank, c.vocab_size
    assert shapes["fc.weight"] == [H, len(c.target_layer_ids) * H]
    assert shapes["prefix_gru.weight_ih_l0"] == [3 * g, H] and shapes["prefix_gru.weight_hh_l0"] == [3 * g, g]
    assert shapes["embed_proj.0.weight"] == [r, H + g] and shapes["embed_proj.2.weight"] == [V, r]
    assert {"hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
            "layers.0.mlp.gate_proj.weight", "layers.0.post_attention_layernorm.weight"} <= shapes.keys()
    assert not any(k.startswith(("embed_tokens", "lm_head", "backbone.", "head.")) for k in shapes)


def test_speculators_layout(tmp_path, ftarget):
    d = Drafter.from_pretrained(FIXTURE / "domino", ftarget)
    out = export_drafter(d, "speculators", tmp_path / "s", verifier="org/tiny")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "domino"
    assert cfg["aux_hidden_state_layer_ids"] == [t + 1 for t in d.config.target_layer_ids]
    assert cfg["sample_from_anchor"] is True and cfg["logits_correction_emb_dim"] == d.config.rank
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == d.config.num_drafts
    w = load_file(str(out / "model.safetensors"))
    assert "logits_correction.prefix_gru.weight_ih_l0" in w and "logits_correction.embed_proj.2.weight" in w
    assert torch.equal(w["lm_head.weight"], ftarget.lm_head.weight.float())


# ---- aliases and what the loader refuses -----------------------------------------------------------------------
def _copy_release(tmp_path, case, edit_cfg=None, edit_weights=None, name="r"):
    out = tmp_path / name
    out.mkdir()
    cfg = json.loads((FIXTURE / case / "config.json").read_text())
    w = load_file(str(FIXTURE / case / "model.safetensors"))
    if edit_cfg:
        edit_cfg(cfg)
    if edit_weights:
        w = edit_weights(w)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("prefix", ["logit_head.", "logits_correction.", "model."])
def test_head_aliases_load_identically(tmp_path, ftarget, prefix):
    def rename(w):
        w = {(prefix + k if k.startswith(("prefix_gru", "embed_proj")) or prefix == "model." else k): v
             for k, v in w.items()}
        return w | {"embed_tokens.weight": torch.zeros(64, 32), "lm_head.weight": torch.zeros(64, 32)}

    def older(cfg):    # early checkpoints: causal_v5, emb_dim only at the top level, target tensors carried along
        cfg["dflash_config"]["projector_type"] = "causal_v5"
        del cfg["dflash_config"]["emb_dim"]

    d = load_release(_copy_release(tmp_path, "domino", older, rename), ftarget)
    ref = Drafter.from_pretrained(FIXTURE / "domino", ftarget)
    a, b = ref.state_dict(), d.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_default_taps_follow_the_release_rule(tmp_path, ftarget):
    assert release_default_taps(36, 1) == [18] and release_default_taps(36, 5) == [1, 9, 17, 25, 33]

    def drop(cfg):
        del cfg["dflash_config"]["target_layer_ids"]
        cfg["num_hidden_layers"] = 1

    def fc_for_one_tap(w):
        return w | {"fc.weight": w["fc.weight"][:, : w["fc.weight"].shape[0]].contiguous()}

    d = load_release(_copy_release(tmp_path, "dflash", drop, fc_for_one_tap), ftarget)
    assert d.config.target_layer_ids == [ftarget.num_layers // 2]


REFUSALS = [
    ("domino", lambda c: c["dflash_config"].update(pure_draft_prefix_len=0), None, "pure_draft_prefix_len"),
    ("domino", lambda c: c["dflash_config"].update(projector_type="dspark"), None, "projector_type 'dspark'"),
    ("domino", lambda c: c.update(num_target_layers=36), None, "36 layers"),
    ("domino", lambda c: c.update(hidden_size=64), None, "hidden 64"),
    ("domino", lambda c: c["dflash_config"].update(target_layer_ids=[1, 9]), None, "taps layers [1, 9]"),
    ("domino", lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), None, "RoPE scaling"),
    ("domino", lambda c: c.update(hidden_act="gelu"), None, "activation"),
    ("domino", lambda c: c.update(architectures=["Eagle3LlamaForCausalLM"]), None, "not one this project"),
    ("domino", None, lambda w: w | {"prefix_gru.bias_ih_l0": torch.zeros(3)}, "no place for"),
    ("domino", None, lambda w: {k: v for k, v in w.items() if k != "norm.weight"}, "lacks tensors"),
    ("domino", lambda c: c["dflash_config"].update(gru_hidden_dim=7), None, "does not match its config"),
    ("dflash", None, lambda w: w | {"embed_proj.0.weight": torch.zeros(2, 2)}, "no place for"),
]


@pytest.mark.parametrize("case,edit_cfg,edit_weights,msg", REFUSALS)
def test_release_directories_that_do_not_fit_are_one_clear_error(tmp_path, ftarget, case, edit_cfg, edit_weights,
                                                                 msg):
    path = _copy_release(tmp_path, case, edit_cfg, edit_weights)
    with pytest.raises(UserError, match=re.escape(msg)):
        Drafter.from_pretrained(path, ftarget)


def test_what_a_layout_cannot_hold_is_refused(tmp_path, ftarget, default_target):
    dfl = Drafter.from_pretrained(FIXTURE / "dflash", ftarget)
    dom = Drafter.from_pretrained(FIXTURE / "domino", ftarget)
    with pytest.raises(UserError, match="no place for the Domino head"):
        export_drafter(dom, "dflash", tmp_path / "a")
    with pytest.raises(UserError, match="this is a dflash drafter"):
        export_drafter(dfl, "domino", tmp_path / "b")
    with pytest.raises(UserError, match="shift_label=True"):
        export_drafter(Drafter.from_pretrained("default-dflash-nocopy", default_target), "dflash", tmp_path / "c")
    with pytest.raises(UserError, match="'eagle' drafter"):
        export_drafter(Drafter.untrained(ftarget, "eagle"), "domino", tmp_path / "d")
    with pytest.raises(UserError, match="anchor_feature"):
        release_state_dict(Drafter.untrained(ftarget, "domino", anchor_feature=True), "domino")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not an earlier export"):
        export_drafter(dom, "domino", tmp_path / "busy")
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())     # nothing half-written left behind


def test_release_dir_of_another_target_is_refused(tmp_path, default_target):
    with pytest.raises(UserError, match="does not fit this target"):
        Drafter.from_pretrained(FIXTURE / "domino", default_target)


def test_family_of_and_the_dashboard_catalog_see_release_dirs(tmp_path):
    assert family_of(str(FIXTURE / "domino")) is registry.family("domino")
    assert family_of(str(FIXTURE / "dflash")) is registry.family("dflash")
    assert family_of(str(FIXTURE / "target")) is None
    from app.catalog import scan_runs_folder

    run = tmp_path / "runs" / "exported"
    run.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        (run / f).write_bytes((FIXTURE / "domino" / f).read_bytes())
    drafters, _ = scan_runs_folder(tmp_path / "runs")
    assert drafters == [run]


# ---- the CLI -----------------------------------------------------------------------------------------------------
def test_cli_writes_an_export_and_reports_bad_input(tmp_path, capsys):
    from domino_lab.export import main

    with pytest.raises(SystemExit) as e:
        run_cli(main, ["--drafter", "default-nocopy", "--format", "domino", "--out", str(tmp_path / "out")])
    assert e.value.code == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dflash_config"]["projector_type"] == "domino"
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "sglang.launch_server" in readme and "not run" in readme
    # the shipped drafter's FR-Spec list cannot travel in the layout: the user is told, in the output and the README
    assert "note:" in printed and "FR-Spec list of its 1024" in printed and "all 8192 tokens" in printed
    assert "FR-Spec list of its 1024" in readme
    for argv in (["--drafter", "default-dflash-nocopy", "--format", "dflash", "--out", str(tmp_path / "x")],
                 ["--drafter", "default", "--format", "domino", "--out", str(tmp_path / "w")],      # copy input
                 ["--drafter", "nowhere", "--format", "domino", "--out", str(tmp_path / "y")],
                 ["--drafter", "none", "--format", "domino", "--out", str(tmp_path / "z")]):
        with pytest.raises(SystemExit) as e:
            run_cli(main, argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
