"""Streaming decode for the dashboard: run the engine in a worker thread, receive each verify step through the
engine's `on_step` hook, and render the domino chain, the live counters and the per-position acceptance.

Everything shown is read from the engine's step records (docs/design.md#step-record); nothing re-derives acceptance.
"""
from __future__ import annotations

import html
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from domino_lab.decoding import GenerationResult, StepRecord, speculative_generate
from domino_lab.decoding.engine import check_adaptive_mode, check_lookup_mode, check_tree_mode
from domino_lab.decoding.lookup import MAX_NGRAM
from domino_lab.errors import UserError
from domino_lab.models.options import InferenceOptions
from domino_lab.sampling import check_sampling
from domino_lab.validation import check_seed
from domino_lab.decoding.metrics import StepTally

TOPK_STORED = 32          # top-k kept per position by the engine (the inspector shows the first few)
MAX_NEW_TOKENS = 512
MAX_BLOCK = 32
MAX_TREE_NODES = 128      # the dashboard's cap (the engine takes more); a tree of 128 nodes is already hard to read


@dataclass
class Request:
    prompt: str
    target: str
    drafter: str
    head_on: bool = True
    block_size: int = 8
    temperature: float = 0.0
    max_new_tokens: int = 64
    seed: int = 0
    tree_nodes: int = 0          # > 0: verify a draft tree of this many nodes per step (0 = the chain)
    lookup: int = 0              # > 0: copy repeats of the text's last >= this many tokens (lookup drafting)
    tree_min_prob: float = 0.0   # > 0: tree nodes need at least this path probability under the drafter
    adaptive: bool = False       # plain steps while the text's measured acceptance does not pay for drafting
    tree_sampled: bool = False   # T > 0: draw each tree node's children from the drafter (not its most probable)
    sampler: str = "rejection"   # T > 0: rejection (speculative sampling) or gumbel (the seed fixes the text)

    def checked(self) -> "Request":
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise UserError("the prompt is empty: type some text or pick an example")
        try:
            self.block_size, self.max_new_tokens = int(self.block_size), int(self.max_new_tokens)
            self.seed, self.temperature = int(self.seed or 0), float(self.temperature or 0.0)
        except (TypeError, ValueError, OverflowError):
            raise UserError("block size, max tokens and seed must be whole numbers, temperature a number") from None
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise UserError(f"max tokens must be between 1 and {MAX_NEW_TOKENS}")
        if not 1 <= self.block_size <= MAX_BLOCK:
            raise UserError(f"block size must be between 1 and {MAX_BLOCK}")
        if not 0.0 <= self.temperature <= 2.0:
            raise UserError("temperature must be between 0 and 2")
        check_seed(self.seed)
        self.tree_nodes = _optional_count(self.tree_nodes, "tree nodes", "chain verification", MAX_TREE_NODES)
        self.lookup = _optional_count(self.lookup, "lookup", "off", MAX_NGRAM)
        try:
            p_min = float(self.tree_min_prob or 0.0)
        except (TypeError, ValueError, OverflowError):
            raise UserError("tree min prob must be a number in [0, 1) (0 = fill the node budget)") from None
        self.tree_min_prob = InferenceOptions(tree_min_prob=p_min).tree_min_prob     # the options' own range check
        self.adaptive, self.tree_sampled = bool(self.adaptive), bool(self.tree_sampled)
        check_adaptive_mode(self.adaptive, self.tree_nodes)
        self.sampler = self.sampler or "rejection"
        check_sampling(self.temperature, 1.0, self.sampler, self.tree_sampled)
        return self


def _optional_count(value, name: str, zero_means: str, most: int) -> int:
    """A whole number in [0, most] for a setting whose 0 turns a feature off (empty = 0)."""
    try:
        n = int(value or 0)
    except (TypeError, ValueError, OverflowError):
        raise UserError(f"{name} must be a whole number (0 = {zero_means})") from None
    if not 0 <= n <= most:
        raise UserError(f"{name} must be between 0 ({zero_means}) and {most}")
    return n


@dataclass
class Snapshot:
    """What has happened so far in one decode."""
    target_value: str
    steps: list[StepRecord] = field(default_factory=list)
    first: int | None = None               # the prefill's token (the target's own; not a verify step)
    elapsed: float = 0.0
    result: GenerationResult | None = None
    plain: GenerationResult | None = None  # plain decoding of the same prompt, for the speedup
    head: str = "on"                       # on | off | n/a (DFlash) | plain
    n_drafts: int = 0
    sampled: bool = False                  # T > 0: "identical to plain" then means plain decoding with the same seed

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def token_ids(self) -> list[int]:
        if self.result is not None:
            return list(self.result.token_ids)
        first = [self.first] if self.first is not None else []
        return first + [t for s in self.steps for t in s.committed]


class _Cancelled(Exception):
    pass


# ---- plain decoding reference (cached per prompt and settings) -----------------------------------------
_PLAIN: OrderedDict = OrderedDict()
_PLAIN_LOCK = threading.Lock()


def plain_reference(catalog, req: Request) -> GenerationResult:
    key = (req.target, req.prompt, req.max_new_tokens, req.temperature, req.seed, req.sampler)
    with _PLAIN_LOCK:
        if key in _PLAIN:
            _PLAIN.move_to_end(key)
            return _PLAIN[key]
    res = speculative_generate(catalog.target(req.target), None, prompt=req.prompt,
                               max_new_tokens=req.max_new_tokens, temperature=req.temperature, seed=req.seed,
                               sampler=req.sampler)
    with _PLAIN_LOCK:
        _PLAIN[key] = res
        while len(_PLAIN) > 64:
            _PLAIN.popitem(last=False)
    return res


def stream(catalog, req: Request, min_interval: float = 0.05, measure_plain: bool = True):
    """Yield a Snapshot after verify steps (at most every `min_interval` s) and a final one with the result."""
    req.checked()
    target = catalog.target(req.target)
    drafter = catalog.drafter(req.target, req.drafter, req.head_on, req.lookup, req.tree_min_prob, req.adaptive,
                              req.tree_sampled)
    if req.tree_nodes:
        check_tree_mode(drafter)
    check_lookup_mode(drafter, req.lookup)      # (plain decoding would ignore it, and the record would still say it)
    snap = Snapshot(req.target, sampled=req.temperature > 0)
    if drafter is None:
        snap.head = "plain"
    else:
        snap.head = ("on" if req.head_on else "off") if drafter.has_head else "n/a"
        cfg = drafter.config
        snap.n_drafts = min(cfg.num_drafts, req.block_size if cfg.shift_label else req.block_size - 1)
    if measure_plain:
        snap.plain = plain_reference(catalog, req)
    q: queue.Queue = queue.Queue()
    stop = threading.Event()

    def on_step(rec: StepRecord) -> None:
        if stop.is_set():
            raise _Cancelled
        q.put(("step", rec, time.perf_counter()))

    def work() -> None:
        try:
            res = speculative_generate(target, drafter, prompt=req.prompt, max_new_tokens=req.max_new_tokens,
                                       temperature=req.temperature, block_size=req.block_size, seed=req.seed,
                                       topk=TOPK_STORED, on_step=on_step, tree_nodes=req.tree_nodes,
                                       sampler=req.sampler)
            q.put(("done", res, time.perf_counter()))
        except BaseException as e:   # handed to the consumer, which raises it in the request's thread
            q.put(("error", e, time.perf_counter()))

    t0 = time.perf_counter()
    threading.Thread(target=work, daemon=True, name="dashboard-decode").start()
    last = 0.0
    try:
        while True:
            kind, obj, ts = q.get()
            if kind == "error":
                if isinstance(obj, _Cancelled):
                    return
                raise obj
            if kind == "done":
                snap.result, snap.steps, snap.elapsed = obj, list(obj.steps), obj.wall_time_s
                yield snap
                return
            if snap.first is None:
                snap.first = obj.anchor
            snap.steps.append(obj)
            snap.elapsed = ts - t0
            if ts - last >= min_interval:
                last = ts
                yield snap
    finally:
        stop.set()


# ---- numbers --------------------------------------------------------------------------------------------
def counters(snap: Snapshot) -> dict:
    ids = snap.token_ids
    n_steps = len(snap.steps)
    tau = StepTally().add(snap.steps).tau
    tps = (snap.result.tokens_per_s if snap.done else (len(ids) / snap.elapsed if snap.elapsed > 0 else None))
    out = {"status": "done" if snap.done else "decoding", "tokens": len(ids), "steps": n_steps,
           "tau": tau, "target_calls": (snap.result.target_forward_calls if snap.done else 1 + n_steps),
           "tokens_per_s": tps, "plain_tokens_per_s": None, "speedup": None, "identical_to_plain": None,
           "head": snap.head, "sampled": snap.sampled,
           # why a finished decode stopped: an EOS, the tokens asked for, or a full context (fewer than asked)
           "stop_reason": snap.result.stop_reason if snap.done else None}
    if snap.plain is not None and snap.plain.wall_time_s > 0:
        out["plain_tokens_per_s"] = snap.plain.tokens_per_s
        if tps:
            out["speedup"] = tps / snap.plain.tokens_per_s
        if snap.done:
            out["identical_to_plain"] = snap.result.token_ids == snap.plain.token_ids
    return out


def acceptance(snap: Snapshot) -> list[dict]:
    """Per draft position: P(accepted | reached), counted by domino_lab.decoding.metrics.StepTally."""
    t = StepTally().add(snap.steps)
    return [{"position": f"d{i + 1}", "acceptance": a, "reached": r}
            for i, (a, r) in enumerate(zip(t.accept_pos, t.reached)) if r]


def acceptance_frame(rows: list[dict]):
    """Bars as a typed DataFrame (an untyped empty frame would make the plot's axes categorical)."""
    import pandas as pd

    return pd.DataFrame({"position": pd.Series([r["position"] for r in rows], dtype=str),
                         "acceptance": pd.Series([r["acceptance"] for r in rows], dtype=float),
                         "reached": pd.Series([r["reached"] for r in rows], dtype=int)})


# ---- rendering ------------------------------------------------------------------------------------------
class Texts:
    """Token id -> display text for one target (decoded one token at a time, whitespace made visible)."""

    def __init__(self, target):
        self.target = target
        self._cache: dict[int, str] = {}

    def raw(self, tid: int) -> str:
        if tid not in self._cache:
            self._cache[tid] = self.target.decode([tid])
        return self._cache[tid]

    def html(self, tid: int) -> str:
        t = html.escape(self.raw(tid))
        if not t:
            return '<span class="ws">∅</span>'
        for ch, shown in ((" ", "·"), ("\n", "↵"), ("\t", "→")):     # spaces first: the spans contain one
            t = t.replace(ch, f"\x00{shown}\x01")
        return t.replace("\x00", '<span class="ws">').replace("\x01", "</span>")


def _tile(cls: str, body: str, title: str, step: int | None = None, pos: int | None = None) -> str:
    data = f' data-step="{step + 1}" data-pos="{pos + 1}"' if step is not None else ""
    return f'<span class="tile {cls}" title="{html.escape(title)}"{data}>{body}</span>'


LEGEND = ('<div class="legend"><span class="tile prefill">prefill</span> the target\'s first token · '
          '<span class="tile acc">accepted</span> drafted and accepted · '
          '<span class="tile bonus">bonus</span> the target\'s own next token · '
          '<span class="tile rej">rejected</span> the lost tail · one box = one target call '
          '(<span class="domino copied">dashed</span>: copied from earlier text by lookup drafting) · '
          'click a drafted token to inspect it</div>')


def chain_html(snap: Snapshot, texts: Texts) -> str:
    if snap.first is None and not snap.done:
        return LEGEND + '<div class="chain empty">waiting for the first token…</div>'
    parts = []
    first = snap.first if snap.first is not None else (snap.result.token_ids[:1] or [None])[0]
    if first is not None:
        parts.append(f'<span class="domino">{_tile("prefill", texts.html(first), f"prefill · id {first}")}</span>')
    for i, s in enumerate(snap.steps):
        tiles = [f'<span class="step-no">{i + 1}</span>']
        for j, t in enumerate(s.draft_tokens[: s.accepted]):
            tiles.append(_tile("acc", texts.html(t), f"step {i + 1} · d{j + 1} accepted · id {t}", i, j))
        if s.bonus is not None and len(s.committed) > s.accepted:
            tiles.append(_tile("bonus", texts.html(s.bonus), f"step {i + 1} · bonus (target) · id {s.bonus}"))
        for j, t in enumerate(s.draft_tokens[s.accepted:], start=s.accepted):
            tiles.append(_tile("rej", texts.html(t), f"step {i + 1} · d{j + 1} rejected · id {t}", i, j))
        title = f"step {i + 1}: {s.accepted}/{len(s.draft_tokens)} drafts accepted, {s.acceptance_length} committed"
        if s.copied:
            title += " (copied from earlier text)"
        parts.append(f'<span class="domino{" copied" if s.copied else ""}" title="{title}">{"".join(tiles)}</span>')
    cursor = "" if snap.done else '<span class="cursor">▌</span>'
    return LEGEND + f'<div class="chain">{"".join(parts)}{cursor}</div>'


TREE_LEGEND = ('<div class="legend">one tree per verify step, drawn from the anchor: '
               '<span class="tile acc">accepted</span> the path the target agreed with · '
               '<span class="tile bonus">bonus</span> the target\'s own next token · '
               '<span class="tile rej">rejected</span> branches the target did not take</div>')


def tree_html(snap: Snapshot | None, texts: Texts | None, last: int | None = None) -> str:
    """Each tree step's draft tree as nested lists: the accepted path highlighted, the bonus hanging off its last
    node, every other branch greyed. Chain steps (no tree fields) are skipped; `last` keeps only the newest trees;
    no snapshot (before a decode) draws the legend and a hint."""
    steps = [(i, s) for i, s in enumerate(snap.steps) if s.tree_tokens is not None] if snap is not None else []
    if not steps:
        return TREE_LEGEND + '<div class="trees empty">no tree steps: set tree nodes above 0 and decode</div>'
    if last is not None:
        steps = steps[-last:]
    parts = []
    for i, s in steps:
        kids: dict[int, list[int]] = {}
        for j, p in enumerate(s.tree_parents):
            kids.setdefault(p, []).append(j)
        on_path = set(s.tree_path or [])
        tail = s.tree_path[-1] if s.tree_path else -1

        def sub(node: int) -> str:
            items = []
            for j in kids.get(node, []):
                t = s.tree_tokens[j]
                cls = "acc" if j in on_path else "rej"
                title = f"step {i + 1} · depth {len(_ancestors(s.tree_parents, j))} · id {t} · " + (
                    "accepted" if cls == "acc" else "not taken")
                items.append(f"<li>{_tile(cls, texts.html(t), title)}{sub(j)}</li>")
            if node == tail and s.bonus is not None:
                items.append(f'<li>{_tile("bonus", texts.html(s.bonus), f"step {i + 1} · bonus · id {s.bonus}")}</li>')
            return f"<ul>{''.join(items)}</ul>" if items else ""

        head = (f'<span class="step-no">{i + 1}</span>{_tile("anchor", texts.html(s.anchor), f"anchor · id {s.anchor}")}'
                f' <span class="tmeta">{len(s.tree_tokens)} nodes · {s.accepted} accepted</span>')
        parts.append(f'<div class="tstep">{head}{sub(-1)}</div>')
    return TREE_LEGEND + f'<div class="trees">{"".join(parts)}</div>'


def _ancestors(parents: list[int], j: int) -> list[int]:
    out = [j]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out


TREE_CSS = """
.legend { font-size: 12px; color: #475569; margin-bottom: 6px; }
.trees { max-height: 520px; overflow-y: auto; font-family: ui-monospace, SFMono-Regular, Menlo, monospace;
         font-size: 13px; }
.tstep { border: 1px solid #cbd5e1; border-radius: 6px; padding: 2px 6px; margin: 3px 0; background: #f8fafc; }
.tstep ul { list-style: none; margin: 0; padding-left: 14px; border-left: 1px dotted #cbd5e1; }
.tstep li { margin: 1px 0; }
.tile { display: inline-block; padding: 0 3px; margin: 0 1px; border-radius: 3px; white-space: pre; color: #0f172a; }
.acc { background: #bbf7d0; color: #14532d; font-weight: 600; }
.bonus { background: #fdba74; color: #7c2d12; font-weight: 600; }
.rej { background: #f1f5f9; color: #94a3b8; }
.anchor { background: #e2e8f0; }
.ws { opacity: 0.45; }
.step-no { font-size: 9px; color: #64748b; vertical-align: super; margin-right: 2px; }
.tmeta { font-size: 11px; color: #64748b; }
"""


def _fmt(x, spec: str, none: str = "–") -> str:
    return none if x is None else format(x, spec)


STOPPED = {"eos": "the target wrote its end-of-text token", "max_new_tokens": "the tokens asked for",
           "context_length": "the target's context is full (fewer tokens than asked)"}


def counters_html(c: dict, title: str = "") -> str:
    same = {None: "", True: '<div class="ok">✓ identical to plain '
                            + ("decoding with the same seed" if c.get("sampled") else "greedy decoding") + "</div>",
            False: '<div class="warn">differs from plain decoding (expected only when sampling)</div>'}
    cards = [("τ so far", _fmt(c["tau"], ".2f")), ("tokens/s", _fmt(c["tokens_per_s"], ".1f")),
             ("target calls", str(c["target_calls"])), ("speedup vs plain", _fmt(c["speedup"], ".2f") + "×"),
             ("tokens", str(c["tokens"])), ("head", c["head"])]
    body = "".join(f'<div class="card"><div class="v">{v}</div><div class="k">{k}</div></div>' for k, v in cards)
    plain = (f'plain decoding of this prompt: {_fmt(c["plain_tokens_per_s"], ".1f")} tokens/s'
             if c["plain_tokens_per_s"] else "")
    head = f"<b>{html.escape(title)}</b> · " if title else ""
    status = c["status"] + (f' ({STOPPED[c["stop_reason"]]})' if c.get("stop_reason") in STOPPED else "")
    return (f'<div class="counters"><div class="cards">{body}</div><div class="sub">{head}{status} · '
            f'{plain}</div>{same[c["identical_to_plain"]] if c["status"] == "done" else ""}</div>')


def record(snap: Snapshot, texts: Texts, req: Request) -> dict:
    """The decode as JSON (also the API's answer): spans per verify step, counters, token ids."""
    steps = []
    for i, s in enumerate(snap.steps):
        rej = s.draft_tokens[s.accepted:]
        steps.append({"step": i + 1, "accepted": s.draft_tokens[: s.accepted], "rejected": rej, "bonus": s.bonus,
                      "committed": s.committed, "accepted_text": [texts.raw(t) for t in s.draft_tokens[: s.accepted]],
                      "rejected_text": [texts.raw(t) for t in rej],
                      "bonus_text": texts.raw(s.bonus) if s.bonus is not None else None,
                      "draft_ms": round(1000 * s.draft_time_s, 3), "verify_ms": round(1000 * s.verify_time_s, 3),
                      "copied": s.copied})
        if s.tree_tokens is not None:
            steps[-1]["tree"] = {"tokens": s.tree_tokens, "parents": s.tree_parents, "path": s.tree_path}
    first = snap.token_ids[:1]
    return {"target": req.target, "drafter": req.drafter, "head": snap.head, "block_size": req.block_size,
            "tree_nodes": req.tree_nodes, "tree_min_prob": req.tree_min_prob, "lookup": req.lookup,
            "adaptive_drafts": req.adaptive, "tree_sampled": req.tree_sampled, "temperature": req.temperature,
            "sampler": req.sampler, "prefill": first[0] if first else None, "steps": steps,
            "counters": counters(snap), "token_ids": snap.token_ids,
            "text": snap.result.text if snap.done else texts.target.decode(snap.token_ids)}


CHAIN_CSS = """
.legend { font-size: 12px; color: #475569; margin-bottom: 6px; }
.chain { line-height: 2.2; font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 14px; }
.domino { display: inline-block; border: 1px solid #cbd5e1; border-radius: 6px; padding: 0 3px; margin: 2px 3px 2px 0;
          background: #f8fafc; white-space: nowrap; }
.tile { display: inline-block; padding: 0 3px; margin: 0 1px; border-radius: 3px; white-space: pre; color: #0f172a; }
.acc { background: #bbf7d0; color: #14532d; cursor: pointer; }
.bonus { background: #fdba74; color: #7c2d12; font-weight: 600; }
.rej { background: #f1f5f9; color: #94a3b8; text-decoration: line-through; cursor: pointer; }
.prefill { background: #e9d5ff; color: #581c87; }
.domino.copied { border-style: dashed; border-color: #64748b; }
.tile.sel { outline: 2px solid #2563eb; }
.ws { opacity: 0.45; }
.step-no { font-size: 9px; color: #64748b; vertical-align: super; margin-right: 1px; }
.cursor { color: #2563eb; }
"""

COUNTERS_CSS = """
.cards { display: flex; gap: 8px; flex-wrap: wrap; }
.card { border: 1px solid #e2e8f0; border-radius: 8px; padding: 6px 12px; min-width: 90px; background: #f8fafc; }
.card .v { font-size: 20px; font-weight: 700; color: #0f172a; }
.card .k { font-size: 11px; color: #64748b; }
.sub { font-size: 12px; color: #475569; margin-top: 4px; }
.ok { color: #15803d; font-size: 13px; } .warn { color: #b45309; font-size: 13px; }
"""

# Delegated click on drafted tokens -> the HTML component's click event with {step, pos}.
CLICK_JS = """
element.addEventListener('click', (e) => {
  const t = e.target.closest('[data-step]');
  if (!t) return;
  element.querySelectorAll('.tile.sel').forEach((x) => x.classList.remove('sel'));
  t.classList.add('sel');
  trigger('click', {step: parseInt(t.dataset.step), pos: parseInt(t.dataset.pos)});
});
"""
