"""Result tables of an experiment: per (set, temperature) a row per variant, paired comparisons pooled over
seeds, optional extras (base-loss curves, head overhead), the paper's numbers and the reading, as markdown."""
from __future__ import annotations

import statistics

from ..data.eval_sets import prompts_line
from ..evaluate import paired_pooled
from .spec import ExperimentSpec


def _mean_sd(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def _config_value(cfg: dict, key: str):
    node = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def pooled_pair(cell: dict, a: str, b: str, same_run: bool = False) -> dict | None:
    """Per-prompt τ_a − τ_b pooled over the seeds both variants have (`evaluate.paired_pooled`). A one-seed
    variant (`ar`, a shipped checkpoint, a run trained once) pairs with every seed of the other: its seed label ("0")
    may also be one of the other's, and matching labels would then drop the other's remaining seeds. `same_run`:
    both are the same trained drafters decoded two ways (one perhaps on fewer seeds), so seed k pairs with seed k
    only."""
    if a not in cell or b not in cell:
        return None
    sa, sb = cell[a], cell[b]
    shared = sorted(set(sa) & set(sb))
    seeds = ([(k, k) for k in shared] if shared and (same_run or min(len(sa), len(sb)) > 1)
             else [(x, y) for x in sa for y in sb])
    ratios = [sa[ka]["tau"] / sb[kb]["tau"] if sb[kb]["tau"] else float("nan") for ka, kb in seeds]
    pr = paired_pooled([(sa[ka], sb[kb]) for ka, kb in seeds])
    return dict(pr, ratios=ratios, n_seed_pairs=len(seeds))


def tables(spec: ExperimentSpec, results: dict, trained: dict, extras: dict) -> str:
    cols = spec.columns
    lines = []
    for s, temps in results.items():
        for temp, cell in temps.items():
            how = f", {spec.sampler} sampler" if float(temp) > 0 else ""
            lines += [f"### {s}, T={temp}{how}", "",
                      "| variant | " + "".join(f"{c} | " for c in cols) + "seeds | τ | speedup vs ar | tok/s | "
                      "draft ms | verify ms | lossless | accept per position |",
                      "|---|" + "---|" * (len(cols) + 8)]
            for v in spec.variants:
                if v.name not in cell:
                    continue
                per = cell[v.name]
                rs = list(per.values())
                cfg = trained[(v.run, int(next(iter(per))))].config if v.run else {}
                cvals = "".join(f"{_config_value(cfg, c) if v.run else '–'} | " for c in cols)
                ll = [r.get("lossless") for r in rs]
                lossless = (f"{sum(ll)}/{sum(r['n_prompts'] for r in rs)}" if None not in ll else "–")
                n = len(rs[0]["accept_pos"])
                pos = " ".join(f"{statistics.fmean(a):.2f}" for a in (
                    [r["accept_pos"][i] for r in rs if r["accept_pos"][i] is not None] for i in range(n)) if a)
                # plain decoding drafts nothing: its ~0.01 ms is the engine's empty draft stage
                draft = f"{statistics.fmean(r['draft_ms'] for r in rs):.2f}" if v.run else "–"
                lines.append(f"| {v.name} | {cvals}{len(rs)} | {_mean_sd([r['tau'] for r in rs])} | "
                             f"{_mean_sd([r['speedup'] for r in rs])}× | {statistics.fmean(r['tok_s'] for r in rs):.1f} | "
                             f"{draft} | {statistics.fmean(r['verify_ms'] for r in rs):.2f} | {lossless} | {pos or '–'} |")
            lines.append("")
    if spec.compare:
        lines += ["### Paired per-prompt differences (pooled over seeds)", "",
                  "| a − b | set | T | τ ratio per seed | Δτ (95% CI) | n | wins/losses |", "|---|---|---|---|---|---|---|"]
        run = {v.name: v.run for v in spec.variants}
        for a, b in spec.compare:
            same_run = run.get(a) is not None and run.get(a) == run.get(b)
            for s, temps in results.items():
                for temp, cell in temps.items():
                    pr = pooled_pair(cell, a, b, same_run)
                    if not pr or not pr.get("n"):
                        continue
                    lines.append(f"| {a} − {b} | {s} | {temp} | {' '.join(f'{x:.3f}' for x in pr['ratios'])} | "
                                 f"{pr['mean_diff']:+.3f} ({pr['ci95'][0]:+.3f}, {pr['ci95'][1]:+.3f}) | {pr['n']} | "
                                 f"{pr['wins']}/{pr['losses']} |")
        lines.append("")
    if "head_overhead" in extras:
        lines += ["### Domino head cost per draft step (thread CPU time, median, same cached state; first seed)", "",
                  "| variant | " + "".join(f"{c} | " for c in cols) + "draft ms head on | head off | head ms | on/off |",
                  "|---|" + "---|" * (len(cols) + 4)]
        for name, h in extras["head_overhead"].items():
            v = next(x for x in spec.variants if x.name == name)
            cfg = trained[(v.run, spec.seeds_of(v)[0])].config
            cvals = "".join(f"{_config_value(cfg, c)} | " for c in cols)
            lines.append(f"| {name} | {cvals}{h['draft_ms_head_on']:.2f} | {h['draft_ms_head_off']:.2f} | "
                         f"{h['head_ms']:+.2f} | {h['head_ratio']:.2f}× |")
        lines.append("")
    if "base_loss" in extras:
        bl = extras["base_loss"]
        lines += ["### Base-logit (backbone) loss", "",
                  "| run | seeds | CE of the base logits, mean of the last 50 logged steps |", "|---|---|---|"]
        for name, c in bl["curves"].items():
            tail = c["values"][-50:]
            lines.append(f"| {name} | {c['n_runs']} | {sum(tail) / max(1, len(tail)):.3f} |")
        lines += ["", f"![base loss]({bl['png']})", ""]
    return "\n".join(lines)


def markdown(spec: ExperimentSpec, results: dict, trained: dict, extras: dict, meta: dict) -> str:
    # (reports written before the digests were recorded have no prompts line)
    digests = f" Prompts: {prompts_line(meta['prompts'])}." if meta.get("prompts") else ""
    head = [f"# {spec.title}", "", f"`{meta['command']}` — {meta['machine']}, {meta['date']}, "
            f"{meta['wall_min']} min (training reused or run: {meta['trained']}).{digests}", ""]
    if spec.question:
        head += [f"**Question.** {spec.question.strip()}", ""]
    sampled = f" (the {spec.sampler} sampler at T > 0)" if any(t > 0 for t in spec.temperatures) else ""
    same = (" (at T > 0 with the gumbel sampler: to plain decoding's sample for the same seed; with the rejection "
            "sampler outputs are samples, not compared)") if sampled else ""
    head += [f"Eval: sets {', '.join(spec.sets)}; first {meta['limit']} prompts each; {meta['max_new_tokens']} new "
             f"tokens; T ∈ {spec.temperatures}{sampled}; seeds {meta.get('seeds', spec.seeds)}. Speedup = plain "
             "decoding's s/token ÷ the variant's, both measured in this session on this machine; τ and acceptance "
             f"come from the engine's step records. Lossless = outputs identical to the target's own greedy output"
             f"{same}.", ""]
    if spec.paper:
        head += [f"**Paper.** {spec.paper.strip()}", ""]
    body = tables(spec, results, trained, extras)
    tail = ["## Reading", "", spec.reading.strip(), ""] if spec.reading and not meta.get("quick") else []
    return "\n".join(head) + "\n" + body + "\n" + "\n".join(tail)
