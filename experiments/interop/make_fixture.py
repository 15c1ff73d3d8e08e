"""Regenerate tests/fixtures/interop: this project's drafters, exported, run by the releases' own code.

    python experiments/interop/make_fixture.py --release-code DIR --release-python PY [--out tests/fixtures/interop]

DIR holds the public modeling code, which is not part of this repository; expected.json (`release_code`) records
the files and commits that made the committed fixture, and DIR/PROVENANCE.json, if present, is copied there:

    DIR/domino/dflash.py        the Domino release's Transformers modeling file (plus the `accelerator.py` it
    DIR/domino/accelerator.py   imports, which only times and may be a CPU stand-in)
    DIR/zlab/model.py           the DFlash release's Transformers modeling file

The release code is written against transformers 4.x (its draft-cache calls `crop(start)` with a positive length,
which transformers 5 refuses), so it runs in a second interpreter PY that has transformers 4.57 and torch (this
script re-runs itself there with --release-side; nothing of domino_lab is imported on that side).

For each case (Domino with shift_label true and false, DFlash) the script builds a tiny float64 Qwen3 target and
a briefly trained drafter, exports the drafter with `domino_lab.models.export`, builds the release's
`DFlashDraftModel` from the exported config.json, loads the exported weights with `strict=True`, and decodes a
prompt with the release's own speculative loop. Forward hooks record what that loop computed in every round: the
draft model's base logits (the target LM head over its block output), the Domino correction of each step, the
drafted tokens, and the acceptance lengths. The same quantities are computed here and the largest difference is
printed. Weights are rounded to float32 before anything runs, so the float32 files in the fixture reproduce the
float64 computation exactly.

Written: target/ (config.json, model.safetensors), and per case <case>/ (the exported drafter: config.json,
model.safetensors) + <case>/expected.safetensors (logits [R, n, V], drafts [R, n], starts [R]); expected.json
(prompt, release tokens and acceptance lengths, measured differences, provenance).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parents[2]

VOCAB, HIDDEN, LAYERS, MASK = 64, 32, 4, 63
CASES = {   # name: (method, format, shift_label, release module)
    "domino": ("domino", "domino", True, "domino"),
    "domino_noshift": ("domino", "domino", False, "domino"),
    "dflash": ("dflash", "dflash", False, "zlab"),
}
DRAFTER = dict(block_size=8, intermediate_size=48, gru_hidden=16, rank=8)
PROMPT_LEN, MAX_NEW, ROUNDS = 6, 40, 6
TARGET_CONFIG = dict(model_type="qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                     num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6, eos_token_id=None,
                     bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def load_module(name: str, path: Path):
    sys.path.insert(0, str(path.parent))      # the Domino code imports its sibling `accelerator`
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fp32_exact(module: torch.nn.Module) -> None:
    """Round every weight to float32 and back: float32 files then hold the exact float64 values."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.float().double())


def target_model() -> Qwen3ForCausalLM:
    cfg = {k: v for k, v in TARGET_CONFIG.items() if k != "model_type"}
    return Qwen3ForCausalLM(Qwen3Config(**cfg)).double().eval()


def make_target(seed: int = 0):
    from domino_lab import Target

    torch.manual_seed(seed)
    model = target_model()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)                     # peaky, so continuations are learnable
        model.lm_head.weight[MASK] = 0.0     # MASK's logit is 0, below the largest of the others: never generated
        # (the Domino release drops every MASK id from its output, so a generated one would misalign it)
    fp32_exact(model)
    return Target(model, None, mask_token_id=MASK, taps=[1, 2])


def brief_train(drafter, target, steps: int = 150, seed: int = 0) -> None:
    from domino_lab.training.objective import sample_anchors, weighted_ce

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, VOCAB - 1, (24, 4), generator=g)
    with torch.no_grad():
        seqs = target.model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                     max_new_tokens=40, min_new_tokens=40, pad_token_id=0)
        feats = target.forward(seqs, taps=drafter.config.target_layer_ids).features
    mask = torch.zeros_like(seqs)
    mask[:, 4:] = 1
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(steps):
        anchors, keep = sample_anchors(mask, 8, g)
        bb = drafter.training_blocks(feats, seqs, mask, anchors, keep)
        loss = 0.5 * weighted_ce(bb.logits_base, bb.labels, bb.valid, 4.0) + \
            0.5 * weighted_ce(bb.logits_final, bb.labels, bb.valid, 4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval()
    fp32_exact(drafter)


def run_release(mod, model, hf, prompt: torch.Tensor, domino: bool) -> dict:
    """Decode with the release's own loop; hooks record its per-round base logits, corrections and drafts."""
    rec = {"base": [], "bias": [], "verify": [], "pos": [], "pending": False}

    def on_draft(_m, _args, _out):
        rec["pending"] = True

    def on_lm_head(_m, _args, out):
        if rec["pending"]:                 # the LM-head call right after the draft forward: base logits
            rec["base"].append(out[0].detach().clone())
            rec["pending"] = False

    def on_target(_m, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        rec["verify"].append(ids[0].tolist())
        rec["pos"].append(kwargs["position_ids"][0].tolist())

    hooks = [model.register_forward_hook(on_draft), hf.lm_head.register_forward_hook(on_lm_head),
             hf.register_forward_pre_hook(on_target, with_kwargs=True)]
    if domino:
        hooks.append(model.embed_proj.register_forward_hook(lambda _m, _a, out: rec["bias"].append(out[0, 0].clone())))
        res = model.spec_generate(input_ids=prompt, target=hf, max_new_tokens=MAX_NEW, temperature=0.0,
                                  stop_token_ids=None, return_dict=True)
    else:
        mod._cuda_time = time.perf_counter       # its timer synchronises CUDA; the decode itself is untouched
        res = mod.dflash_generate(model, target=hf, input_ids=prompt, max_new_tokens=MAX_NEW, stop_token_ids=None,
                                  temperature=0.0, return_stats=True)
    for h in hooks:
        h.remove()
    rounds = []
    bias = iter(rec["bias"])
    n = model.block_size if (domino and model.config.dflash_config.get("shift_label")) else model.block_size - 1
    for r, base in enumerate(rec["base"]):
        verify, pos = rec["verify"][r + 1], rec["pos"][r + 1]        # call 0 is the prefill
        final = base.clone()
        if domino:
            for i in range(1, n):                                       # pure_draft_prefix_len = 1
                final[i] = final[i] + next(bias)
        drafts = final.argmax(-1).tolist()
        assert verify[1:] == drafts[:len(verify) - 1], "hooks out of step with the release loop"
        rounds.append({"start": pos[0], "anchor": verify[0], "drafts": drafts, "logits": final})
    new = res.output_ids[0, prompt.shape[1]:].tolist()
    return {"rounds": rounds, "tokens": new[:MAX_NEW], "acceptance_lengths": list(res.acceptance_lengths)}


def our_block(drafter, target, seq: list[int], start: int, anchor: int, drafts: list[int]):
    """This project's final logits [n, V] of the block at `start` (context = target features of seq[:start]),
    with the GRU reading the given drafts, and its own greedy drafts for that block."""
    with torch.no_grad():
        feats = target.forward(torch.tensor([seq[:start]]), taps=drafter.config.target_layer_ids).features
        final = drafter.block_logits(feats, start, anchor, drafts[:-1])
        own = drafter.draft(feats, 0, torch.tensor([anchor]), start, None).tokens[0].tolist()
    return final[0], own


def dump(obj) -> str:
    """JSON with number lists kept on one line."""
    text = json.dumps(obj, indent=1)
    return re.sub(r"\[\s+([-\d.e+,\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


def release_side(code: Path, out: Path) -> None:
    """Runs in the release's interpreter: decode every case with the release code, write <case>/release.*."""
    torch.set_default_dtype(torch.float64)
    mods = {"domino": load_module("domino_release_dflash", code / "domino" / "dflash.py"),
            "zlab": load_module("zlab_release_model", code / "zlab" / "model.py")}
    hf = target_model()
    hf.load_state_dict(load_file(str(out / "target" / "model.safetensors")), strict=True)
    summary = json.loads((out / "expected.json").read_text())
    prompt = torch.tensor([summary["prompt"]])
    for name, (method, _fmt, _shift, modname) in CASES.items():
        mod = mods[modname]
        model = mod.DFlashDraftModel(Qwen3Config.from_pretrained(str(out / name))).double().eval()
        model.load_state_dict(load_file(str(out / name / "model.safetensors")), strict=True)
        rel = run_release(mod, model, hf, prompt, domino=method == "domino")
        rounds = rel["rounds"][:ROUNDS]
        save_file({"logits": torch.stack([r["logits"] for r in rounds]).double().contiguous(),
                   "drafts": torch.tensor([r["drafts"] for r in rounds]),
                   "starts": torch.tensor([r["start"] for r in rounds]),
                   "anchors": torch.tensor([r["anchor"] for r in rounds])},
                  str(out / name / "expected.safetensors"), metadata={"format": "pt"})
        (out / name / "release.json").write_text(json.dumps(
            {"tokens": rel["tokens"], "acceptance_lengths": rel["acceptance_lengths"]}))
    import transformers
    (out / "release_env.json").write_text(json.dumps({"transformers": transformers.__version__,
                                                      "torch": torch.__version__}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--release-code", required=True, type=Path)
    ap.add_argument("--release-python", default=sys.executable,
                    help="interpreter with the release's transformers (4.x) and torch")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "interop")
    ap.add_argument("--release-side", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = args.out.resolve()
    if args.release_side:
        release_side(args.release_code.resolve(), out)
        return 0

    sys.path.insert(0, str(ROOT))
    from domino_lab import Drafter, speculative_generate
    from domino_lab.models.export import export_drafter

    torch.set_default_dtype(torch.float64)
    out.mkdir(parents=True, exist_ok=True)
    target = make_target()
    tdir = out / "target"
    tdir.mkdir(exist_ok=True)
    (tdir / "config.json").write_text(json.dumps(TARGET_CONFIG, indent=1) + "\n")
    save_file({k: v.float().contiguous() for k, v in target.model.state_dict().items()},
              str(tdir / "model.safetensors"), metadata={"format": "pt"})
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(4, VOCAB - 1, (1, PROMPT_LEN), generator=g)
    summary = {"prompt": prompt[0].tolist(), "max_new_tokens": MAX_NEW, "mask_token_id": MASK, "taps": [1, 2],
               "rounds_compared": ROUNDS, "cases": {}}
    drafters = {}
    for name, (method, fmt, shift, _modname) in CASES.items():
        drafter = Drafter.untrained(target, method, seed=0, shift_label=shift, **DRAFTER)
        brief_train(drafter, target)
        export_drafter(drafter, fmt, out / name, dtype=torch.float32)
        (out / name / "README.md").unlink()
        drafters[name] = drafter
    (out / "expected.json").write_text(dump(summary))

    subprocess.run([args.release_python, __file__, "--release-side", "--release-code",
                    str(args.release_code.resolve()), "--out", str(out)], check=True)

    for name, (method, fmt, shift, modname) in CASES.items():
        rel = json.loads((out / name / "release.json").read_text())
        (out / name / "release.json").unlink()
        exp = load_file(str(out / name / "expected.safetensors"))
        mine = Drafter.from_pretrained(out / name, target).set_head("eager", 0)
        ours = speculative_generate(target, mine, prompt_ids=prompt[0].tolist(), max_new_tokens=MAX_NEW)
        seq = prompt[0].tolist() + rel["tokens"]
        diffs, agree = [], True
        for r in range(exp["logits"].shape[0]):
            drafts = exp["drafts"][r].tolist()
            final, own = our_block(mine, target, seq, int(exp["starts"][r]), int(exp["anchors"][r]), drafts)
            diffs.append(float((final - exp["logits"][r]).abs().max()))
            agree &= own == drafts
        summary["cases"][name] = {
            "method": method, "format": fmt, "shift_label": shift, "release": modname,
            "release_tokens": rel["tokens"], "release_acceptance_lengths": rel["acceptance_lengths"],
            "our_tokens": ours.token_ids, "our_acceptance_lengths": ours.acceptance_lengths,
            "max_abs_logit_diff": max(diffs), "drafts_agree": agree}
        acc = rel["acceptance_lengths"]
        print(f"{name:15s} max |logit diff| {max(diffs):.2e} over {len(diffs)} rounds; drafts agree {agree}; "
              f"tokens equal {ours.token_ids == rel['tokens']}; release tau {sum(acc) / len(acc):.2f} {acc} "
              f"ours {ours.acceptance_lengths}")
    summary["release_env"] = json.loads((out / "release_env.json").read_text())
    (out / "release_env.json").unlink()
    prov = args.release_code / "PROVENANCE.json"
    if prov.is_file():
        summary["release_code"] = json.loads(prov.read_text())
    (out / "expected.json").write_text(dump(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
