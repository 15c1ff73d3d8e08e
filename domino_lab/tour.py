"""`python -m domino_lab.tour`: one prompt decoded in front of you, step by step, with the numbers of this run.

It decodes one prompt plainly, with a Domino drafter, with the same drafter's head switched off (its parallel
backbone alone) and with a baseline drafter, then shows one verify step in full: the block each drafter proposed,
the target's token at every position, what was accepted, the bonus token, and the Domino head's logits beside the
backbone's. Every number is measured as it runs (docs/tour.md walks through one run).

    python -m domino_lab.tour                                 # the first held-out math prompt
    python -m domino_lab.tour --set humaneval --index 3 --out runs/tour.md
    python -m domino_lab.tour --prompt "def fib(n):"
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .cli_flags import add_threads_arg
from .errors import CliParser, UserError, run_cli

if TYPE_CHECKING:
    from .decoding.same_text import StepPair


def _code(text: str) -> str:
    """Text as inline code in a markdown table: escapes visible, no backtick or cell separator inside."""
    return "`" + repr(text)[1:-1].replace("`", "'").replace("|", "\\|") + "`"


def _tok(target, i: int | None) -> str:
    return "—" if i is None else _code(target.decode([i]))


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _marks(step) -> list[str]:
    """Per draft slot: accepted, rejected (the first draft the target disagreed with), or not checked."""
    n = len(step.draft_tokens)
    return ["accepted" if j < step.accepted else "rejected" if j == step.accepted else "not checked"
            for j in range(n)]


def step_table(target, pair: StepPair) -> str:
    """The two blocks of one step side by side: drafts, the target's token at each position, the verdicts."""
    on, off = pair.on, pair.off
    rows = ["| slot | backbone alone | target | verdict | with the head | target | verdict |",
            "|---|---|---|---|---|---|---|"]
    m_on, m_off = _marks(on), _marks(off)
    for j in range(max(len(on.draft_tokens), len(off.draft_tokens))):
        cells = []
        for s, m in ((off, m_off), (on, m_on)):
            if j < len(s.draft_tokens):
                tgt = s.target_topk_ids[j][0] if j < len(s.target_topk_ids) and m[j] != "not checked" else None
                cells += [_tok(target, s.draft_tokens[j]), _tok(target, tgt), m[j]]
            else:
                cells += ["", "", ""]
        rows.append(f"| {j + 1} | " + " | ".join(cells) + " |")
    rows.append(f"| bonus | | {_tok(target, off.bonus)} | target's own token | | {_tok(target, on.bonus)} | "
                "target's own token |")
    return "\n".join(rows)


def logits_table(target, step, slots: int) -> str:
    """The backbone's (base) and the head's (corrected) top three at each of the first `slots` draft slots."""
    def top(ids, logits):
        return ", ".join(f"{_tok(target, i)} {v:.1f}" for i, v in zip(ids[:3], logits[:3]))

    rows = ["| slot | base logits, top 3 | corrected logits, top 3 | the head |", "|---|---|---|---|"]
    for j in range(min(slots, len(step.draft_tokens))):
        changed = step.base_topk_ids[j][0] != step.final_topk_ids[j][0]
        rows.append(f"| {j + 1} | {top(step.base_topk_ids[j], step.base_topk_logits[j])} | "
                    f"{top(step.final_topk_ids[j], step.final_topk_logits[j])} | "
                    f"{'changed the draft' if changed else 'kept it'} |")
    return "\n".join(rows)


def same_text_summary(pairs: list[StepPair]) -> str:
    """What the head added over a decode's steps, each against its backbone alone on the same text, in a sentence."""
    from .decoding.same_text import tally

    t = tally(pairs)
    return (f"Each of the {t['steps']} steps of the Domino decode was drafted again from the same text with the head "
            f"off. With the head these steps committed {t['on_tokens']} tokens, without it {t['off_tokens']} "
            f"({t['on_tokens'] / max(t['off_tokens'], 1):.2f}×). The head committed more in {_steps(t['more'])}, "
            f"fewer in {_steps(t['fewer'])}, the same in {_steps(t['steps'] - t['more'] - t['fewer'])}.")


def steps_table(target, pairs: list[StepPair]) -> str:
    """One row per step of the Domino decode: the text it committed and its tokens with and without the head."""
    rows = ["| step | text committed with the head | with the head | backbone alone |", "|---|---|---|---|"]
    for p in pairs:
        mark = " (+)" if p.gain > 0 else " (−)" if p.gain < 0 else ""
        rows.append(f"| {p.index + 1} | {_code(target.decode(p.on.committed))} | {p.on.acceptance_length}{mark} | "
                    f"{p.off.acceptance_length} |")
    return "\n".join(rows)


def render(target, prompt: str, runs: dict, pairs: list[StepPair], machine: str, command: str) -> str:
    """The tour as markdown, from measured runs (`runs`: name -> GenerationResult; 'plain' is plain decoding)."""
    plain = runs["plain"]
    n = len(plain.token_ids)
    best = max(pairs, key=lambda p: (p.gain, -p.index))
    lines = ["# A tour of speculative decoding with a Domino drafter", "",
             f"`{command}` — {machine}", "",
             "## 1. The target alone", "",
             f"Prompt ({len(plain.prompt_ids)} tokens):", "", "```", prompt, "```", "",
             f"Plain greedy decoding writes {n} tokens with {plain.target_forward_calls} target forwards (the "
             f"prefill, then one per token after the first):", "", "```", plain.text, "```", "",
             "## 2. One step: a block drafted in parallel, verified in one forward", "",
             f"Step {best.index + 1} of the Domino decode, the step where the head made the largest difference. "
             f"The text so far ends in {_tok(target, best.on.anchor)} (the anchor). The drafter reads the "
             "target's hidden states of the text so far, and its backbone proposes the next tokens in one pass, "
             "every slot at once, each without seeing the drafts before it. The head then runs a GRU over the "
             "drafts already made and adds a low-rank correction to each later slot's logits. \"Backbone alone\" "
             "is the same drafter with its head switched off, drafting from the same text. The target then "
             "checks the whole block in one forward: its greedy token at every position, compared with the "
             "drafts. The drafts up to the first disagreement are accepted, and the target's own token at that "
             "position comes free (the bonus).", "",
             step_table(target, best), "",
             f"With the head: {best.on.accepted} drafts accepted + the bonus = {best.on.acceptance_length} tokens "
             f"for one target forward. The backbone alone, from the same text: {best.off.accepted} + the bonus = "
             f"{best.off.acceptance_length}.", "",
             "The same step in logits (the correction is added to the base logits; a slot where the corrected top "
             "token differs is where the head changed the draft; slot 1 has no draft before it, and the head "
             "leaves its logits as they are unless the drafter was trained with `correct_first`):", "",
             logits_table(target, best.on, best.on.accepted + 1), "",
             "## 3. What the head did over the whole decode", ""]
    lines += [same_text_summary(pairs) + " Step by step (tokens committed by one target forward, accepted drafts + "
              "the bonus):", "", steps_table(target, pairs), "",
              "## 4. The whole decode, every way", "",
              "| decoding | target forwards | τ (tokens per verify step) | tokens/s | same text as plain decoding |",
              "|---|---|---|---|---|"]
    for name, res in runs.items():
        tau = "1 (one token per forward)" if name == "plain" else f"{res.mean_acceptance_length:.2f}"
        same = "—" if name == "plain" else ("yes" if res.token_ids == plain.token_ids else "**no**")
        lines.append(f"| {name} | {res.target_forward_calls} | {tau} | {res.tokens_per_s:.1f} | {same} |")
    lines += ["", "Speculative decoding is lossless: every drafter's text must equal plain greedy decoding's, token "
              "for token; only the number of target forwards changes. Tokens/s come from one run of one short "
              "text and move from run to run; `python -m domino_lab.bench` measures them properly (many prompts, "
              "interleaved).", "",
              "## Next", "",
              "- `python -m domino_lab.tour --set humaneval --index 3` (or `--prompt TEXT`): another text. "
              "`python experiments/same_text.py` counts the same thing over whole prompt sets, with the slots "
              "where the head fixes or breaks a draft.",
              "- `python -m app`: the same steps live in the browser, every block coloured by accepted, rejected "
              "and bonus tokens, with the base and corrected logits of any draft.",
              "- `python -m domino_lab.bench`: tokens/s and τ over whole prompt sets, every method interleaved.",
              "- `python -m domino_lab.sweep`: train and compare heads of other ranks, widths and curricula.", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m domino_lab.tour", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default", help="HF model id, local model dir, or 'default' (embedded)")
    p.add_argument("--drafter", default="default", help="a drafter with a Domino head: shipped name or checkpoint dir")
    p.add_argument("--baseline", default="default-dflash",
                   help="another drafter to decode the same prompt with (shipped name or dir; 'none' to skip)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--set", default="math", help="an eval set (math, humaneval, code, unseen, fresh) or JSONL file")
    p.add_argument("--index", type=int, default=0, help="which prompt of --set (0 = the first)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", help="also write the tour to this markdown file")
    add_threads_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    import sys
    import time

    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.index < 0:
        raise UserError(f"--index must be >= 0, got {args.index}")
    from .errors import atomic_path, check_out_file

    out = check_out_file(args.out) if args.out else None
    if args.prompt is not None:
        from .data.eval_sets import check_prompt_text

        if not args.prompt.strip():
            raise UserError("the prompt is empty; give some text to continue")
        check_prompt_text(args.prompt, "--prompt", "pass it as UTF-8 text")
        prompt = args.prompt
    else:
        from .data.eval_sets import load_eval_set

        rows = load_eval_set(args.set, limit=args.index + 1)
        if args.index >= len(rows):
            raise UserError(f"--index {args.index} is past the end of {args.set!r} ({len(rows)} prompts); "
                            f"use 0..{len(rows) - 1}")
        prompt = rows[args.index]["prompt"]

    from . import Target, speculative_generate
    from .decoding.engine import RECORD_TOPK, prompt_token_ids
    from .decoding.same_text import backbone_alone, load_with_baseline, pair_steps
    from .target import machine_line, use_decode_threads

    target = Target.from_pretrained(args.target, dtype="float32")
    use_decode_threads(target, args.threads)
    drafter, baseline = load_with_baseline(target, args.drafter, args.baseline)
    ids = prompt_token_ids(target, prompt)
    gen = dict(prompt_ids=ids, max_new_tokens=args.max_new_tokens, topk=RECORD_TOPK)
    ways = {"plain": None, f"Domino ({args.drafter})": drafter,
            f"its backbone alone ({args.drafter}, head off)": backbone_alone(drafter)}
    if baseline is not None:
        ways[f"baseline ({args.baseline})"] = baseline
    runs = {}
    for _ in range(2):      # the second round is kept: the first pays one-time costs (kernels, the head's tables)
        for name, d in ways.items():
            runs[name] = speculative_generate(target, d, **gen)
    domino = runs[f"Domino ({args.drafter})"]
    if not domino.steps:
        raise UserError("the decode ended before its first verify step (the first token ended the text); "
                        "pick another prompt or raise --max-new-tokens")
    pairs = pair_steps(target, drafter, ids, domino, args.max_new_tokens, RECORD_TOPK)
    command = "python -m domino_lab.tour" + ("" if argv is None and len(sys.argv) < 2 else
                                             " " + " ".join(argv if argv is not None else sys.argv[1:]))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = render(target, prompt, runs, pairs, f"{machine_line()}; {when}", command)
    if out is not None:
        with atomic_path(out) as tmp:
            tmp.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    run_cli(main)
