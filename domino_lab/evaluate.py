"""τ of a drafter over an eval set, per prompt, and paired comparisons between drafters.

τ is read from the engine's step records and counted by decoding.metrics.StepTally: per prompt, committed
tokens / verify steps; per set, the same ratio over all steps (each step weighs the same). Per-position
acceptance is conditional: accepted at position i / steps that reached position i.
"""
from __future__ import annotations

import math
import statistics

from .decoding import speculative_generate
from .decoding.metrics import StepTally
from .errors import UserError


def evaluate(target, drafter, prompts: list[dict], max_new_tokens: int = 128, temperature: float = 0.0,
             seed: int = 0, progress: bool = False, keep_ids: bool = False, samples: int = 1,
             sampler: str = "rejection") -> dict:
    """τ and timings over `prompts`; `keep_ids` adds each prompt's generated token ids (lossless checks).

    samples > 1 (T > 0 only): each prompt is decoded with sampling seeds seed, seed + 1, ...; its row pools their
    steps, so a paired comparison still has one difference per prompt but far less sampling noise in it.
    `sampler` (T > 0): "gumbel" makes every drafter sample the same text as plain decoding for a seed, so a paired
    difference compares two drafters on identical texts (docs/design.md#gumbel-coupled-sampling)."""
    from tqdm.auto import tqdm

    if samples < 1 or (samples > 1 and temperature <= 0):
        raise UserError(f"samples={samples}: use 1, or more than 1 only with a temperature > 0 (greedy decoding "
                        "gives the same output for every sampling seed)")
    rows = []
    tally = StepTally(drafter.config.num_drafts if drafter is not None else 0)
    for p in tqdm(prompts, disable=not progress, desc="decode"):
        own = StepTally()
        tokens, wall = 0, 0.0
        for k in range(samples):
            res = speculative_generate(target, drafter, prompt=p["prompt"], max_new_tokens=max_new_tokens,
                                       temperature=temperature, seed=seed + k, sampler=sampler)
            tally.add(res.steps)
            own.add(res.steps)
            tokens, wall = tokens + len(res.token_ids), wall + res.wall_time_s
        rows.append({"id": p["id"], "tau": own.tau or 0.0, "steps": own.steps, "tokens": tokens, "wall_s": wall,
                     **({"token_ids": res.token_ids} if keep_ids else {})})
    return {"tau": tally.tau or 0.0, "per_prompt": rows, "accept_pos": tally.accept_pos,
            "draft_ms": tally.draft_ms or 0.0, "verify_ms": tally.verify_ms or 0.0}


def must_equal_plain(temperature: float, sampler: str, samples: int = 1) -> bool:
    """Whether every drafter's output must be plain decoding's, token for token: greedy, or the gumbel sampler with one
    sampling seed per prompt (the seed then fixes the text); the rejection sampler is lossless in distribution only."""
    return temperature <= 0 or (sampler == "gumbel" and samples == 1)


def differing_prompts(res: dict, plain: dict) -> list:
    """Ids of the prompts whose output in `res` differs from plain decoding's (`plain`: evaluate with drafter None);
    both evaluated with keep_ids=True. The ids were kept for this check only: they are dropped from `res`'s rows."""
    ref = {p["id"]: p["token_ids"] for p in plain["per_prompt"]}
    bad = [p["id"] for p in res["per_prompt"] if p["token_ids"] != ref[p["id"]]]
    res["per_prompt"] = [{k: x for k, x in p.items() if k != "token_ids"} for p in res["per_prompt"]]
    return bad


def t_interval(xs: list[float]) -> tuple[float, float, float]:
    """The mean of xs and its 95% Student-t interval (len(xs) - 1 degrees of freedom; NaN ends for one value). At
    laptop scale n is 12-32 prompts, where the normal 1.96 would cover ~92-94% instead of 95%."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan"), float("nan")
    from scipy.stats import t

    half = float(t.ppf(0.975, len(xs) - 1)) * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - half, m + half


def paired_pooled(pairs: list[tuple[dict, dict]]) -> dict:
    """Per-prompt differences τ_a − τ_b over one or more (a, b) result pairs on the same prompts (one pair per seed,
    or per seed pair), matched by prompt id; a prompt either side decoded in zero steps has no τ and is left out.

    A prompt's differences in several seeds are correlated (the prompt decides much of its τ), so the prompts are
    the independent units: the mean and its 95% t-interval are over each prompt's mean difference. `n` counts every
    difference, `prompts` the prompts; wins / losses / ties count every difference."""
    groups: dict[str, list[float]] = {}
    for a, b in pairs:
        da = {r["id"]: r for r in a["per_prompt"]}
        for r in b["per_prompt"]:
            ra = da.get(r["id"])
            if ra is not None and ra.get("steps", 1) > 0 and r.get("steps", 1) > 0:
                groups.setdefault(r["id"], []).append(ra["tau"] - r["tau"])
    diffs = [d for ds in groups.values() for d in ds]
    if not diffs:
        return {"n": 0, "prompts": 0, "mean_diff": float("nan"), "ci95": [float("nan")] * 2, "wins": 0, "losses": 0,
                "ties": 0}
    mean, lo, hi = t_interval([statistics.fmean(ds) for ds in groups.values()])
    return {"n": len(diffs), "prompts": len(groups), "mean_diff": mean, "ci95": [lo, hi],
            "wins": sum(d > 0 for d in diffs), "losses": sum(d < 0 for d in diffs), "ties": sum(d == 0 for d in diffs)}


def paired(a: dict, b: dict) -> dict:
    """Per-prompt paired differences τ_a − τ_b of one pair of results (`paired_pooled`), and the ratio of their τ."""
    return dict(paired_pooled([(a, b)]), ratio=a["tau"] / b["tau"] if b["tau"] else float("nan"))


def named_drafters(items: list[str], target) -> dict:
    """`NAME=SPEC[:head-off][@key=value,...]` command-line items -> {name: drafter}; SPEC is a checkpoint dir or
    shipped name, `SPEC:head-off` the same model with its Domino head off; `@key=value,...` sets inference options
    (e.g. `@candidate_pool=16`), as in the bench. Every item is checked before any model loads."""
    from .models.drafter import load_item
    from .models.options import drafter_items

    return {it.label: load_item(it, target) for it in drafter_items(items)}


def drafter_provenance(items: list[str]) -> dict:
    """`NAME=SPEC` items -> {name: {"spec": SPEC, ...what the drafter recorded about its training}} (e.g. the
    content digest of its training data), so a result file says which drafters, trained on what, it compares."""
    from .models.drafter import read_provenance
    from .models.options import drafter_items

    return {it.label: {"spec": it.describe(), **read_provenance(it.path)} for it in drafter_items(items)}


def run_record() -> dict:
    """The command, machine and time a result file records."""
    import sys
    import time

    from .target import machine_line

    return {"command": " ".join(sys.argv), "machine": machine_line(),
            "date": time.strftime("%Y-%m-%d %H:%M")}


def save_results(out: str, results: dict, lines: list[str]) -> None:
    """Print the markdown table `lines`; write the JSON results at `out` and the table beside it (same name, .md),
    headed by the command, each whole or not at all."""
    import json
    from pathlib import Path

    from .errors import atomic_path

    table = "\n".join(lines)
    print(table)
    path = Path(out)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(results, indent=1))
    with atomic_path(path.with_suffix(".md")) as tmp:
        tmp.write_text(f"`{results['command']}` ({results['machine']}, {results['date']})\n\n{table}\n")


if __name__ == "__main__":
    # A library module whose name reads like a command: say where the commands are instead of exiting silently.
    raise SystemExit("domino_lab.evaluate is a library (evaluate, paired); to measure drafters run "
                     "python experiments/compare_drafters.py (τ per prompt, paired), python -m domino_lab.bench "
                     "(τ and tokens/s) or python -m domino_lab.experiments list")
