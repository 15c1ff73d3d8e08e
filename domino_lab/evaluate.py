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


def evaluate(target, drafter, prompts: list[dict], max_new_tokens: int = 128, temperature: float = 0.0,
             seed: int = 0, progress: bool = False, keep_ids: bool = False) -> dict:
    """τ and timings over `prompts`; `keep_ids` adds each prompt's generated token ids (lossless checks)."""
    from tqdm.auto import tqdm

    rows = []
    tally = StepTally(drafter.config.num_drafts if drafter is not None else 0)
    for p in tqdm(prompts, disable=not progress, desc="decode"):
        res = speculative_generate(target, drafter, prompt=p["prompt"], max_new_tokens=max_new_tokens,
                                   temperature=temperature, seed=seed)
        tally.add(res.steps)
        rows.append({"id": p["id"], "tau": res.mean_acceptance_length, "steps": len(res.steps),
                     "tokens": len(res.token_ids), "wall_s": res.wall_time_s,
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
