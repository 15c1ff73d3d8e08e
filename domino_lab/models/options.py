"""Inference options: how a trained drafter is run, never what it is. They are chosen per call by the CLIs, the
bench and the dashboard and are not saved with a checkpoint (DrafterConfig is the architecture; it is)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from ..errors import UserError

HEAD_IMPLS = ("fused", "fast", "compiled", "eager")
BACKBONE_IMPLS = ("eager", "compiled")
BATCH_DRAFTS = ("adaptive", "all")
LOOKUP_MAX = 16      # the longest text suffix lookup drafting matches (decoding/lookup.py): a larger minimum never copies


@dataclass
class InferenceOptions:
    # The Domino head's inference path (docs/design.md#inference-paths-of-the-head): "fused" = the rollout as one
    # C++ loop on the CPU, greedy or sampled (GPUs and machines without a C++ compiler fall back to
    # "fast"); "fast" = precomputed GRU input table + candidate pool in torch ops; "compiled" = the fast greedy
    # rollout under torch.compile; "eager" = nn.GRU + full-vocabulary correction (the reference the others are
    # checked against).
    head_impl: str = "fused"
    # The block drafters' pass at batch 1: "eager" = module by module; "compiled" = embeddings, copy input, backbone
    # and draft LM head as one torch.compile graph (BlockDrafter._draft_pass), which fuses the small ops around the
    # matmuls: on a CPU where those ops' dispatch, not the matmuls, is most of a draft step
    # (experiments/results/draft_floor), a shorter step. The first draft compiles (20-50 s on the 2-core CPU); batches
    # and training stay eager.
    backbone_impl: str = "eager"
    # Greedy drafting scores the head's correction only on the top-K tokens of the block's per-token max base
    # logits; 0 = the full vocabulary (exact). 64 keeps τ equal to the exact head on the embedded default
    # (experiments/results/head_pool.md). Sampling (T > 0) always scores the whole draft vocabulary: a pool would
    # leave q no mass where the target's p has some (models/domino_head.py, DominoHead.rollout).
    candidate_pool: int = 64
    # At most this many slots per block (the drafter's architecture sets the maximum); None = all of them.
    block_size: int | None = None
    # Draft over the whole vocabulary even when the drafter carries an FR-Spec token list (the shipped drafters
    # do: docs/design.md#fr-spec-for-the-shipped-drafters); for comparisons: the list only makes drafting cheaper.
    full_vocab: bool = False
    # Verify only the drafts whose estimated prefix-acceptance probability is >= this (sampling.confident_prefix);
    # 0 = every draft. Each verified token costs target compute whether or not it is accepted, which on a CPU is
    # what decides low-acceptance prompts (docs/design.md#draft-length-cutoff).
    draft_cutoff: float = 0.0
    # Lookup drafting (decoding/lookup.py): when the text's last `lookup` or more tokens occurred before, verify the
    # tokens that followed them instead of the drafter's block or tree (the drafter skips that step); 0 = off.
    # Exact at any temperature (docs/design.md#lookup-drafting).
    lookup: int = 0
    # Tree verification: keep only nodes whose path probability under the drafter is >= this (the tree then has at
    # most --tree-nodes nodes, fewer when the drafter is sure); 0 = always fill the budget. Every node costs target
    # compute whether or not it is accepted, which on a CPU can outweigh an unlikely node's chance
    # (docs/design.md#tree-verification).
    tree_min_prob: float = 0.0
    # Tree verification at T > 0: draw each node's children from the drafter's distribution (without replacement,
    # verified by recursive rejection sampling) instead of taking its most probable ones; greedy decoding always
    # builds the best-first tree (docs/design.md#tree-verification).
    tree_sampled: bool = False
    # Batched decoding: how many drafts each step verifies. "adaptive" = the count (0 = a plain step) that maximises
    # tokens per second under the acceptance and step costs measured so far in the batch (decoding/adaptive.py);
    # "all" = the whole block every step. Large batches make a verified position cost real compute
    # (docs/design.md#adaptive-batched-drafts).
    batch_drafts: str = "adaptive"
    # Batch-1 decoding (chain verification): take plain steps while the text's measured tokens per drafting step
    # do not pay for a draft and a verify, probing now and then (decoding/adaptive.py, PlainFallback); False =
    # draft every step. A drafter below its break-even τ on some text then costs little more than plain decoding
    # there (docs/design.md#adaptive-drafts-at-batch-1).
    adaptive_drafts: bool = False

    def __post_init__(self):
        # types first: a string or a float count would otherwise fail deep inside a decode, far from its cause
        for name in ("candidate_pool", "lookup") + (("block_size",) if self.block_size is not None else ()):
            v = getattr(self, name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool):
                raise UserError(f"{name.replace('_', ' ')} must be a whole number, got {v!r}")
        for name in ("draft_cutoff", "tree_min_prob"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Real) or isinstance(v, bool):
                raise UserError(f"{name.replace('_', ' ')} must be a number, got {v!r}")
        for name in ("full_vocab", "tree_sampled", "adaptive_drafts"):
            if not isinstance(getattr(self, name), bool):     # "no" would be truthy, and switch it on
                raise UserError(f"{name.replace('_', ' ')} must be true or false, got {getattr(self, name)!r}")
        if self.head_impl not in HEAD_IMPLS:
            raise UserError(f"unknown head implementation '{self.head_impl}'; use one of {list(HEAD_IMPLS)}")
        if self.backbone_impl not in BACKBONE_IMPLS:
            raise UserError(f"unknown backbone implementation '{self.backbone_impl}'; use one of "
                            f"{list(BACKBONE_IMPLS)}")
        if self.candidate_pool < 0:
            raise UserError(f"candidate pool must be >= 0 (0 = full vocabulary), got {self.candidate_pool}")
        if not 0.0 <= self.draft_cutoff < 1.0:
            raise UserError(f"draft cutoff must be in [0, 1) (0 = verify every draft), got {self.draft_cutoff}")
        if not 0 <= self.lookup <= LOOKUP_MAX:
            raise UserError(f"lookup must be from 0 to {LOOKUP_MAX} (the shortest suffix match that drafts by copying; "
                            f"0 = off), got {self.lookup}")
        if not 0.0 <= self.tree_min_prob < 1.0:
            raise UserError(f"tree min prob must be in [0, 1) (0 = fill the node budget), got {self.tree_min_prob}")
        if self.tree_sampled and self.tree_min_prob > 0:
            raise UserError("a sampled tree keeps every child it draws (dropping unlikely ones would bias the "
                            "sampling), so tree min prob does not apply to it: set tree min prob 0 or leave "
                            "tree sampled off")
        if self.batch_drafts not in BATCH_DRAFTS:
            raise UserError(f"unknown batch drafts policy '{self.batch_drafts}'; use one of {list(BATCH_DRAFTS)}")
        if self.block_size is not None and self.block_size < 1:
            raise UserError(f"block size must be >= 1, got {self.block_size}")

    @classmethod
    def from_args(cls, args) -> "InferenceOptions":
        """From the flags `add_inference_args` defines (absent flags keep the defaults)."""
        kw = {k: getattr(args, k, None) for k in ("head_impl", "backbone_impl", "candidate_pool", "block_size", "full_vocab",
                                               "draft_cutoff", "lookup", "tree_min_prob", "batch_drafts",
                                               "adaptive_drafts", "tree_sampled")}
        return cls(**{k: v for k, v in kw.items() if v is not None})


TREE_FLAGS = ("tree_min_prob", "tree_sampled")


def check_tree_flags(args, tree_nodes: int) -> None:
    """A tree flag without a tree would be ignored without a word: one error instead, so that a run does what its
    command line says. (Drafter flags with `--drafter none` are let through: a comparison script passes the same
    flags to plain decoding as to each drafter.)"""
    given = [k for k in TREE_FLAGS if getattr(args, k, None) is not None]
    if given and not tree_nodes:
        raise UserError(f"--{given[0].replace('_', '-')} shapes a draft tree, and this run verifies chains: add "
                        "--tree-nodes N (N > 0) or drop the flag")
    if getattr(args, "tree_sampled", None) and not getattr(args, "temperature", 0):
        raise UserError("--tree-sampled samples a tree's nodes at T > 0, and at temperature 0 a tree is built "
                        "best-first: set --temperature or drop --tree-sampled")
    if tree_nodes and getattr(args, "draft_cutoff", None):
        raise UserError("--draft-cutoff shortens a chain's drafts, and this run verifies trees: drop it, or bound the "
                        "tree with --tree-min-prob P")


def add_inference_args(p, block_size: bool = False) -> None:
    """--head-impl / --candidate-pool (and --block-size) for every CLI that runs a drafter."""
    p.add_argument("--head-impl", default=None, choices=HEAD_IMPLS,
                   help="Domino head inference path: fused (one C++ loop on the CPU, greedy or sampled; the default), "
                        "fast (table + pool in torch ops), compiled (torch.compile), eager (reference)")
    p.add_argument("--backbone-impl", default=None, choices=BACKBONE_IMPLS,
                   help="block drafters at batch 1: eager (the default) or compiled (the pass up to the head as one "
                        "torch.compile graph; the first draft compiles for 20-50 s)")
    p.add_argument("--candidate-pool", type=int, default=None,
                   help="greedy: score the head's correction on the top-K candidates only (0 = full vocabulary, "
                        "exact; default 64); sampling always scores the whole draft vocabulary")
    p.add_argument("--full-vocab", action="store_true", default=None,
                   help="draft over the whole vocabulary, ignoring the drafter's FR-Spec token list if it has one")
    p.add_argument("--draft-cutoff", type=float, default=None,
                   help="verify only the drafts whose estimated probability of being accepted as a prefix is at "
                        "least this (0 = all; chain verification)")
    p.add_argument("--lookup", type=int, default=None, metavar="N",
                   help="draft by copying when the text's last N+ tokens occurred before (the continuation of their "
                        "latest occurrence replaces the drafter's block or tree; 0 = off, the default)")
    p.add_argument("--adaptive-drafts", action="store_true", default=None,
                   help="batch 1: take plain steps while the text's measured tokens per drafting step do not pay "
                        "for a draft and a verify (probing now and then); default: draft every step")
    p.add_argument("--tree-min-prob", type=float, default=None, metavar="P",
                   help="tree verification: keep only nodes the drafter gives a path probability of at least P "
                        "(0 = fill the --tree-nodes budget, the default)")
    p.add_argument("--tree-sampled", action="store_true", default=None,
                   help="tree verification at T > 0: sample each node's children from the drafter instead of taking "
                        "its most probable ones (exact either way)")
    if block_size:
        p.add_argument("--block-size", type=int, default=None,
                       help="use at most this many slots of each block (default: all the drafter has)")


def with_options(options, text: str, item: str):
    """`options` with the `key=value,...` of a --drafter item applied (e.g. `draft_cutoff=0.2,full_vocab=true`)."""
    from dataclasses import fields, replace

    import yaml

    names = [f.name for f in fields(options)]
    kw = {}
    for pair in filter(None, text.split(",")):
        k, sep, v = pair.partition("=")
        if not sep or k.strip() not in names:
            raise UserError(f"--drafter {item!r}: '{pair}' must be key=value with key one of {names}")
        key, value = k.strip(), yaml.safe_load(v)
        # the type of the default (an optional field, block_size, is a count): draft_cutoff=abc fails here by name
        want = type(getattr(options, key)) if getattr(options, key) is not None else int
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or (want is not bool and isinstance(value, bool)):
            raise UserError(f"--drafter {item!r}: {key} must be {'an' if want is int else 'a'} {want.__name__}, "
                            f"got {v.strip()!r}")
        kw[key] = value
    return replace(options, **kw)


HEAD_OFF = ":head-off"


@dataclass(frozen=True)
class DrafterItem:
    """One `LABEL=SPEC[:head-off][@key=value,...]` command-line item (the --drafter of the bench and the experiment
    scripts): SPEC is a shipped name or checkpoint dir, `:head-off` the same model with its Domino head off (its
    backbone's base logits alone), the pairs inference options over a base."""
    label: str
    spec: str                   # as given, `:head-off` included
    options: InferenceOptions
    option_text: str = ""       # the `key=value,...` as given ("" for none)
    item: str = ""              # the whole item as given (for errors)

    @property
    def path(self) -> str:
        """What load_drafter resolves: SPEC without `:head-off`."""
        return self.spec.removesuffix(HEAD_OFF)

    @property
    def head_off(self) -> bool:
        return self.spec.endswith(HEAD_OFF)

    @property
    def keys(self) -> list[str]:
        """The option keys the item sets."""
        return [pair.partition("=")[0].strip() for pair in filter(None, self.option_text.split(","))]

    def describe(self) -> str:
        """SPEC and its options as given, the label left out (what a result file records)."""
        return self.spec + (f"@{self.option_text}" if self.option_text else "")


def drafter_items(items: list[str], base: InferenceOptions | None = None, reserved=(),
                  flag: str = "--drafter") -> list[DrafterItem]:
    """Command-line `LABEL=SPEC[:head-off][@key=value,...]` items, every one checked (a label of its own, not one of
    `reserved`; a SPEC; known option keys with values of their types) before any model loads; the options apply
    over `base` (default InferenceOptions()). `flag` names the option in errors."""
    base = InferenceOptions() if base is None else base
    out: list[DrafterItem] = []
    for item in items:
        label, sep, rest = item.partition("=")
        spec, _, text = rest.partition("@")
        if not sep or not label or not spec:
            raise UserError(f"{flag} {item!r} must be LABEL=SPEC[@key=value,...], e.g. domino=default")
        if label in reserved or any(it.label == label for it in out):
            raise UserError(f"{flag} {item!r} must be LABEL=SPEC[@key=value,...] with a label of its own: {label!r} "
                            "is taken (the items need different labels"
                            + (f", none of {list(reserved)})" if reserved else ")"))
        out.append(DrafterItem(label, spec, with_options(base, text, item), text, item))
    return out
