"""How well each draft slot's distribution matches the target's, on identical contexts: Σ_x min(p(x), q(x)) at a
temperature, which is the probability that speculative sampling accepts the draft (1 − total variation).

    python experiments/first_draft_overlap.py --drafter domino=default --drafter dflash=default-dflash \
        --sets math humaneval --limit 16 --temperature 1.0 --out experiments/results/first_draft_overlap.json

`compare_drafters.py` at T > 0 measures acceptance along each drafter's own sampled text, so two drafters are
scored on different contexts, and a drafter that commits more tokens reaches its first draft at different places.
Here every drafter scores the same contexts: the target's greedy continuation of each eval prompt, with blocks
anchored at up to `--anchors` random positions of it, the head reading the true prefix (teacher forcing). Slot 0
is then exactly the first draft's acceptance probability at those contexts; later slots are conditioned on the
true tokens before them, not on earlier drafts. q is over the drafter's draft vocabulary (FR-Spec), as in drafting.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from domino_lab.data.eval_sets import load_eval_set
from domino_lab.decoding import speculative_generate
from domino_lab.decoding.lookup import block_copy_inputs
from domino_lab.errors import CliParser, UserError, check_out_file, run_cli
from domino_lab.evaluate import named_drafters, run_record, save_results
from domino_lab.target import Target
from domino_lab.training.objective import sample_anchors


@torch.no_grad()
def slot_overlap(target, drafter, seqs: list[tuple[list[int], int]], temperature: float, anchors: int, seed: int
                 ) -> dict:
    """Per slot: mean overlap Σ min(p, q), greedy agreement (argmax q = argmax p) and the number of contexts, over
    sequences (token ids, prompt length) whose generated part holds the anchors."""
    cfg = drafter.config
    n = cfg.num_drafts
    sums, agree, count = torch.zeros(n, dtype=torch.float64), torch.zeros(n), torch.zeros(n)
    gen = torch.Generator().manual_seed(seed)
    vm = drafter.draft_vocab
    for ids, prompt_len in seqs:
        x = torch.tensor([ids])
        lm = torch.zeros_like(x)
        lm[0, prompt_len:] = 1
        out = target.forward(x, taps=cfg.target_layer_ids)         # one forward: the taps and p's logits
        feats, p_logits = out.features, out.logits[0].double()
        a, keep = sample_anchors(lm, anchors, gen)
        copy = block_copy_inputs(x, a, n, cfg.copy_ngram) if cfg.copy_ngram else None
        bb = drafter.training_blocks(feats, x, lm, a, keep, "teacher_forcing", copy=copy)
        q_logits = bb.logits_final[0].double()                     # [N, n, V]
        if vm is not None:
            q_logits = torch.full_like(q_logits, float("-inf")).index_copy(-1, vm, q_logits.index_select(-1, vm))
        for i in range(n):
            ok = bb.valid[0, :, i]
            pos = a[0, ok] + i                                      # the target's logits there predict the label
            p = F.softmax(p_logits[pos] / temperature, -1)
            q = F.softmax(q_logits[ok, i] / temperature, -1)
            sums[i] += torch.minimum(p, q).sum(-1).sum()
            agree[i] += (q.argmax(-1) == p.argmax(-1)).sum()
            count[i] += int(ok.sum())
    return {"overlap": (sums / count.clamp_min(1)).tolist(), "greedy_agree": (agree / count.clamp_min(1)).tolist(),
            "contexts": count.int().tolist()}


def main(argv=None) -> int:
    p = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default")
    p.add_argument("--drafter", action="append", required=True, help="NAME=SPEC (repeat)")
    p.add_argument("--sets", nargs="+", default=["math", "humaneval"])
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    p.add_argument("--out", required=True, help="JSON results (a markdown table is written beside it)")
    args = p.parse_args(argv)
    check_out_file(args.out)
    if args.temperature <= 0:
        raise UserError(f"--temperature {args.temperature}: the overlap needs a temperature > 0 (greedy acceptance "
                        "is the agreement column, reported at any temperature)")
    torch.set_num_threads(1)
    target = Target.from_pretrained(args.target)
    drafters = named_drafters(args.drafter, target)
    results = {**run_record(), "sets": {}}
    lines = [f"| set | drafter | overlap Σ min(p, q) at T = {args.temperature:g}, slot 0, 1, … | "
             "greedy agreement, slot 0 | contexts (slot 0) |", "|---|---|---|---|---|"]
    for s in args.sets:
        seqs = []
        for row in load_eval_set(s, limit=args.limit):
            ids = target.encode(row["prompt"])
            out = speculative_generate(target, None, prompt_ids=ids, max_new_tokens=args.max_new_tokens)
            seqs.append((ids + out.token_ids, len(ids)))
        results["sets"][s] = {}
        for name, d in drafters.items():
            r = slot_overlap(target, d, seqs, args.temperature, args.anchors, seed=0)
            results["sets"][s][name] = r
            lines.append(f"| {s} | {name} | {' '.join(f'{v:.3f}' for v in r['overlap'])} | "
                         f"{r['greedy_agree'][0]:.3f} | {r['contexts'][0]} |")
    save_results(args.out, results, lines)
    return 0


if __name__ == "__main__":
    run_cli(main)
