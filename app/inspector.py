"""Token inspector: for one drafted position, the backbone's (base) top-k, the Domino-corrected top-k, the
correction ΔL = corrected − base for those tokens, and the target's own top-k — read from the step record.

The engine keeps the top `TOPK_STORED` logits per position, so ΔL is exact when a token is in both stored
lists and otherwise a bound (a token missing from a stored list has a logit at most that list's smallest).
"""
from __future__ import annotations

import html
import math

from domino_lab.decoding import StepRecord
from domino_lab.errors import UserError

SHOWN = 5


def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    z = sum(e)
    return [x / z for x in e]


def _delta(t: int, base: dict, final: dict) -> tuple[float, str]:
    """(ΔL, relation): '=' exact, '≥' / '≤' a bound from the smallest stored logit of the other list."""
    if t in base and t in final:
        return final[t] - base[t], "="
    if t in final:
        return final[t] - min(base.values()), "≥"
    return min(final.values()) - base[t], "≤"


def _rows(ids: list[int], logits: list[float], texts, k: int, base: dict | None = None,
          final: dict | None = None) -> list[dict]:
    ps = _softmax(logits)
    rows = []
    for t, lg, p in list(zip(ids, logits, ps))[:k]:
        r = {"id": t, "text": texts.raw(t), "logit": round(lg, 4), "p_topk": round(p, 4)}
        if base is not None and final is not None:
            d, rel = _delta(t, base, final)
            r["delta"], r["delta_rel"] = round(d, 4), rel
        rows.append(r)
    return rows


def inspect_position(steps: list[StepRecord], texts, step: int, position: int, k: int = SHOWN) -> dict:
    """Step and draft position are 1-based, as the chain shows them (step 3, d2)."""
    if not steps:
        raise UserError("nothing to inspect yet: run a decode first")
    try:
        step, position = int(step), int(position)
    except (TypeError, ValueError):
        raise UserError("step and position must be whole numbers") from None
    if not 1 <= step <= len(steps):
        raise UserError(f"step must be between 1 and {len(steps)} for this decode")
    s = steps[step - 1]
    if not s.draft_tokens:
        raise UserError(f"step {step} drafted nothing (plain decoding): there is no drafted token to inspect")
    if not 1 <= position <= len(s.draft_tokens):
        raise UserError(f"step {step} drafted {len(s.draft_tokens)} tokens: position must be between 1 and "
                        f"{len(s.draft_tokens)}")
    if s.copied:
        raise UserError(f"step {step} copied its drafts from earlier text (lookup drafting): the drafter was not "
                        "called, so there are no base or corrected logits to inspect; pick a drafted step")
    pos = position - 1
    bmap = dict(zip(s.base_topk_ids[pos], s.base_topk_logits[pos]))
    fmap = dict(zip(s.final_topk_ids[pos], s.final_topk_logits[pos]))
    base = _rows(s.base_topk_ids[pos], s.base_topk_logits[pos], texts, k, bmap, fmap)
    corrected = _rows(s.final_topk_ids[pos], s.final_topk_logits[pos], texts, k, bmap, fmap)
    target = _rows(s.target_topk_ids[pos], s.target_topk_logits[pos], texts, k)
    drafted = s.draft_tokens[pos]
    b_arg, f_arg, t_arg = s.base_topk_ids[pos][0], s.final_topk_ids[pos][0], s.target_topk_ids[pos][0]
    notes = []
    if s.gumbel_scores:
        notes.append("gumbel sampler: every column shows scores, logit + T·g with the same Gumbel noise g at this "
                     "position for drafter and target; each side drafted or chose the argmax of its scores (the "
                     "target within the top-p nucleus), so ΔL is still the head's correction, and p* is a softmax "
                     "over scores, not the sampling probability")
    if pos == 0:
        notes.append("d1 is never corrected: the head has no drafted prefix to condition on yet")
    if pos > s.accepted:
        notes.append(f"an earlier draft (d{s.accepted + 1}) was rejected, so the target's top-k here is conditioned "
                     "on a prefix that was thrown away")
    elif pos == s.accepted and s.bonus is not None:
        notes.append("first rejected position: the target's own token here became the bonus")
    return {"step": step, "position": position, "drafted": {"id": drafted, "text": texts.raw(drafted)},
            "status": "accepted" if pos < s.accepted else "rejected",
            "base": base, "corrected": corrected, "target": target,
            "head_changed_argmax": b_arg != f_arg,
            "target_agrees_with_base": t_arg == b_arg, "target_agrees_with_corrected": t_arg == f_arg,
            "notes": notes}


def interesting_position(steps: list[StepRecord]) -> tuple[int, int] | None:
    """Where to open the inspector after a decode: the first draft whose argmax the head changed and the target
    confirmed, else the first one it changed, else the first rejected draft, else the first draft (1-based)."""
    changed = rejected = first = None
    for i, s in enumerate(steps):
        if s.copied:                 # copied drafts have no drafter logits to show
            continue
        for j in range(len(s.draft_tokens)):
            first = first or (i + 1, j + 1)
            if j >= len(s.base_topk_ids) or not s.base_topk_ids[j]:
                continue
            if s.base_topk_ids[j][0] != s.final_topk_ids[j][0]:
                changed = changed or (i + 1, j + 1)
                if s.final_topk_ids[j][0] == s.target_topk_ids[j][0] and j <= s.accepted:
                    return i + 1, j + 1
            if j == s.accepted and rejected is None:
                rejected = (i + 1, j + 1)
    return changed or rejected or first


def _table(title: str, rows: list[dict], drafted: int, target_arg: int, delta: bool) -> str:
    head = "<tr><th>#</th><th>token</th><th>logit</th><th>p*</th>" + ("<th>ΔL</th>" if delta else "") + "</tr>"
    body = []
    for i, r in enumerate(rows):
        cls = " ".join(c for c, on in (("drafted", r["id"] == drafted), ("tgt", r["id"] == target_arg)) if on)
        mark = " ★" if r["id"] == target_arg else ""
        d = ""
        if delta:
            sign = "" if r["delta_rel"] == "=" else r["delta_rel"] + " "
            d = f'<td class="{"pos" if r["delta"] > 0 else "neg"}">{sign}{r["delta"]:+.2f}</td>'
        body.append(f'<tr class="{cls}"><td>{i + 1}</td><td><code>{html.escape(repr(r["text"]))}</code>{mark}</td>'
                    f'<td>{r["logit"]:.2f}</td><td>{r["p_topk"]:.2f}</td>{d}</tr>')
    return f'<div class="panel"><div class="ttl">{title}</div><table>{head}{"".join(body)}</table></div>'


def inspector_html(info: dict | None) -> str:
    if info is None:
        return '<div class="hint">Run a decode, then click a drafted token (green or struck) to inspect it.</div>'
    d, t_arg = info["drafted"]["id"], info["target"][0]["id"]
    changed = "the head <b>changed</b> the argmax" if info["head_changed_argmax"] else "the head kept the argmax"
    agrees = ("the target agrees with the corrected argmax" if info["target_agrees_with_corrected"] else
              "the target agrees with the base argmax" if info["target_agrees_with_base"] else
              "the target prefers another token")
    summary = (f'<div class="sum">step {info["step"]}, draft d{info["position"]}: drafted '
               f'<code>{html.escape(repr(info["drafted"]["text"]))}</code> ({info["status"]}) · {changed} · {agrees}'
               "</div>")
    notes = "".join(f'<div class="note">{html.escape(n)}</div>' for n in info["notes"])
    panels = (_table("base (parallel backbone)", info["base"], d, t_arg, True) +
              _table("corrected (backbone + Domino head)", info["corrected"], d, t_arg, True) +
              _table("target (verifier)", info["target"], d, t_arg, False))
    foot = ('<div class="foot">bold = drafted token · ★ = target argmax · ΔL = corrected − base logit (≥/≤: a bound, '
            'the token is outside the other list\'s stored top-32) · p* = softmax over the stored top-32 logits (an '
            'upper bound on the true probability)</div>')
    return f'{summary}{notes}<div class="panels">{panels}</div>{foot}'


INSPECTOR_CSS = """
.panels { display: flex; gap: 10px; flex-wrap: wrap; }
.panel { flex: 1; min-width: 220px; }
.ttl { font-weight: 600; font-size: 13px; margin-bottom: 2px; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { border-bottom: 1px solid #e2e8f0; padding: 2px 6px; text-align: left; }
tr.drafted td { font-weight: 700; }
tr.tgt td { background: #dcfce7; }
td.pos { color: #15803d; } td.neg { color: #b91c1c; }
.sum { font-size: 14px; margin-bottom: 4px; } .note { font-size: 12px; color: #b45309; }
.foot, .hint { font-size: 11px; color: #64748b; margin-top: 4px; }
"""
