"""The step record: the one currency between the engine, benchmarks, MLflow and the dashboard.

Acceptance is computed once, in the engine, and stored here; everything downstream reads it
(docs/design.md#step-record).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepRecord:
    start: int                    # absolute position of the anchor (the token the block extends)
    anchor: int
    draft_tokens: list[int]       # d_0..d_{n-1}
    accepted: int                 # how many drafts the target accepted
    bonus: int | None             # the target's own token after the accepted drafts (None after an accepted EOS)
    committed: list[int]          # tokens this step added to the output (accepted drafts + bonus, cut at EOS/budget)
    base_topk_ids: list[list[int]] = field(default_factory=list)       # per draft position
    base_topk_logits: list[list[float]] = field(default_factory=list)
    final_topk_ids: list[list[int]] = field(default_factory=list)      # after the Domino correction
    final_topk_logits: list[list[float]] = field(default_factory=list)
    target_topk_ids: list[list[int]] = field(default_factory=list)     # per verified position (n+1)
    target_topk_logits: list[list[float]] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    # Tree verification only (None for a chain step; docs/design.md#tree-verification). Nodes are listed parents
    # first; draft_tokens above is then the path the target followed (the accepted nodes, then the tree's best
    # child below them down to a leaf), so every reader of chain records reads tree records the same way.
    tree_tokens: list[int] | None = None      # the token of every drafted node
    tree_parents: list[int] | None = None     # each node's parent node index; -1 = the anchor
    tree_path: list[int] | None = None        # node indices of the accepted path, anchor side first
    copied: bool = False          # the drafts were copied from earlier text (lookup drafting), not drafted
    # T > 0 with the gumbel sampler: every stored top-k holds scores logit + T·g (g: the position's Gumbel noise,
    # shared by drafter and target), the values each side takes the argmax of, not logits
    gumbel_scores: bool = False

    @property
    def acceptance_length(self) -> int:
        """Tokens committed per target call (accepted drafts + bonus): the per-step τ."""
        return len(self.committed)

    def to_dict(self) -> dict:
        return asdict(self) | {"acceptance_length": self.acceptance_length}


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    steps: list[StepRecord]
    target_forward_calls: int     # prefill included
    wall_time_s: float
    prefill_time_s: float
    stop_reason: str              # "eos" | "max_new_tokens" | "context_length" (the target's context was full)

    @property
    def acceptance_lengths(self) -> list[int]:
        return [s.acceptance_length for s in self.steps]

    @property
    def mean_acceptance_length(self) -> float:
        """τ: mean tokens committed per verify step (the prefill's first token is not a step)."""
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def to_dict(self, steps: bool = False) -> dict:
        d = {"token_ids": self.token_ids, "text": self.text, "acceptance_lengths": self.acceptance_lengths,
             "mean_acceptance_length": self.mean_acceptance_length,
             "target_forward_calls": self.target_forward_calls, "wall_time_s": self.wall_time_s,
             "prefill_time_s": self.prefill_time_s, "tokens_per_s": self.tokens_per_s,
             "num_new_tokens": len(self.token_ids), "stop_reason": self.stop_reason}
        if steps:
            d["steps"] = [s.to_dict() for s in self.steps]
        return d
