"""What a Domino head adds, counted on identical texts: every verify step of a greedy decode drafted again from the
same text by the drafter's backbone alone (its head switched off).

Decoding the same prompt twice, head on and head off, compares two different texts after their first different
step, so a step-by-step comparison of whole decodes mixes the head's effect with where each text went. Here the
head-off step starts from exactly the tokens the head-on step started from: the text before the anchor is the
prompt of a short real decode, whose prefill makes the anchor (greedy decoding is deterministic) and whose first
verify step is the head-off counterpart. Both steps see the same context, the same target and the same budget.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from .engine import speculative_generate
from .records import GenerationResult, StepRecord


@dataclass
class StepPair:
    """One verify step of a decode with the head, and the step drafted from the same text by the backbone alone."""
    index: int           # the step's number in the decode (0 = the first verify step)
    on: StepRecord       # head on
    off: StepRecord      # head off, from the same tokens

    @property
    def gain(self) -> int:
        """Tokens this step committed with the head, minus without it."""
        return self.on.acceptance_length - self.off.acceptance_length


def tally(pairs: list[StepPair]) -> dict:
    """The pairs' totals: steps, tokens committed with the head and by the backbone alone, and the steps where the
    head committed more or fewer."""
    return {"steps": len(pairs), "on_tokens": sum(p.on.acceptance_length for p in pairs),
            "off_tokens": sum(p.off.acceptance_length for p in pairs),
            "more": sum(p.gain > 0 for p in pairs), "fewer": sum(p.gain < 0 for p in pairs)}


def load_with_baseline(target, spec: str, baseline: str | None):
    """The drafter `spec` names, which must have a head (one UserError otherwise), and the `baseline` drafter to
    compare it with (None or 'none': no baseline), both for `target`."""
    from ..errors import UserError
    from ..models import load_drafter

    drafter = load_drafter(spec, target)
    if not drafter.has_head:
        raise UserError(f"drafter {spec!r} has no Domino head (method {drafter.config.method}); the comparison is "
                        "of a head with its backbone alone: pass a drafter with a head (e.g. default)")
    return drafter, None if baseline in (None, "none") else load_drafter(baseline, target)


def backbone_alone(drafter):
    """The drafter with its head switched off: a shallow copy sharing its weights, so the caller's drafter (which
    other decodes may be using) is left as it is."""
    off = copy.copy(drafter)
    off.head_enabled = False
    return off


def pair_steps(target, drafter, prompt_ids: list[int], result: GenerationResult, max_new_tokens: int,
               topk: int = 0, block_size: int | None = None) -> list[StepPair]:
    """Every step of `result`, a greedy chain decode of `prompt_ids` by `drafter` with `max_new_tokens` (and
    `block_size`), beside the step its backbone alone drafts from the same text. `topk` as in
    `speculative_generate` (the records' top-k)."""
    if not drafter.has_head:
        raise ValueError("pair_steps compares a drafter's head with its backbone alone; this drafter has no head")
    if any(s.tree_tokens is not None for s in result.steps):
        raise ValueError("pair_steps reads chain decodes; this one verified trees")
    if drafter.options.lookup or drafter.options.adaptive_drafts:
        # a step that copied text or took a plain step has no drafted block for the backbone to redo
        raise ValueError("pair_steps compares drafted blocks; turn lookup drafting and adaptive drafts off")
    off_drafter = backbone_alone(drafter)
    text = list(prompt_ids) + list(result.token_ids)
    pairs = []
    for i, step in enumerate(result.steps):
        left = max_new_tokens - (step.start - len(prompt_ids) + 1)       # the anchor is an output token too
        res = speculative_generate(target, off_drafter, prompt_ids=text[:step.start], max_new_tokens=1 + left,
                                   topk=topk, block_size=block_size)
        off = res.steps[0]
        if off.start != step.start or off.anchor != step.anchor:
            raise RuntimeError(f"step {i}: the head-off decode anchored at {off.start} ({off.anchor}), "
                               f"not at {step.start} ({step.anchor}); pair_steps needs a greedy decode")
        pairs.append(StepPair(i, step, off))
    return pairs
