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


def paired(a: dict, b: dict) -> dict:
    """Per-prompt paired differences τ_a − τ_b (same prompts, same order): mean, 95% CI, wins/losses."""
    da = {r["id"]: r["tau"] for r in a["per_prompt"]}
    diffs = [da[r["id"]] - r["tau"] for r in b["per_prompt"] if r["id"] in da and r["steps"] > 0]
    if not diffs:
        return {"n": 0}
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return {"n": len(diffs), "mean_diff": mean, "ci95": [mean - 1.96 * se, mean + 1.96 * se],
            "wins": sum(d > 0 for d in diffs), "losses": sum(d < 0 for d in diffs), "ties": sum(d == 0 for d in diffs),
            "ratio": a["tau"] / b["tau"] if b["tau"] else float("nan")}


def named_drafters(items: list[str], target) -> dict:
    """`NAME=SPEC` command-line items -> {name: drafter}; SPEC is a checkpoint dir or shipped name, `SPEC:head-off`
    the same model with its Domino head off."""
    from .models import load_drafter

    out = {}
    for name, spec, path in _drafter_items(items):
        d = load_drafter(path, target)
        if spec.endswith(":head-off"):
            d.head_enabled = False
        out[name] = d
    return out


def drafter_provenance(items: list[str]) -> dict:
    """`NAME=SPEC` items -> {name: {"spec": SPEC, ...what the drafter recorded about its training}} (e.g. the
    content digest of its training data), so a result file says which drafters, trained on what, it compares."""
    from .models.drafter import read_provenance

    return {name: {"spec": spec, **read_provenance(path)} for name, spec, path in _drafter_items(items)}


def _drafter_items(items: list[str]) -> list[tuple[str, str, str]]:
    """`NAME=SPEC` -> (name, SPEC, the drafter SPEC names: SPEC without a `:head-off` suffix)."""
    out = []
    for item in items:
        if "=" not in item:
            raise UserError(f"--drafter {item!r} must be NAME=SPEC")
        name, spec = item.split("=", 1)
        out.append((name, spec, spec.removesuffix(":head-off")))
    return out


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
