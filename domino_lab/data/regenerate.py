"""Target regeneration: the target writes the responses its drafter will learn from (docs/design.md#data-flow).

DFlash and Domino train the drafter on the *target's own* continuations of training prompts, so
that the drafter learns to predict what the target will actually say. This module runs the frozen
target over prompts (batched, left-padded, through HF `generate`), and stores

    DIR/                 a `datasets` dataset (save_to_disk) with columns
                         id, domain, input_ids (prompt + response), loss_mask (0 prompt / 1 response,
                         incl. a generated EOS), prompt_len
    DIR/meta.json        target, sampling settings, counts; written last = "this output is complete"
    DIR/_shards/         the work log: one Arrow file per finished batch (written atomically), the
                         run's settings, and a lock. A restarted run skips every id already in a
                         shard, so an interruption costs at most one batch and never duplicates rows.

The command line is `python -m domino_lab.regenerate` (domino_lab/regenerate.py); this module is the library:
`regenerate(target, prompts, out_dir, ...) -> datasets.Dataset`, `load_regenerated(dir)`, `load_meta(dir)`,
`training_prompts(n_math, n_code)`, `ensure_regenerated(path, target, ...)` (create on first use),
`data_digest(dir)` (a hash of the rows, so runs can say, and check, which data they trained on) and
`frequent_tokens_from_dataset(path, k, vocab_size)` (FR-Spec's draft vocabulary of a dataset).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from .. import errors
from ..errors import UserError, atomic_path
from ..validation import check_number
from .eval_sets import check_prompt_text

SHARD_DIR = "_shards"
META = "meta.json"
# `Dataset.save_to_disk` writes data-*.arrow, dataset_info.json and state.json; `load_from_disk`
# needs state.json, so it is moved into place last and removed first when rewriting.
_DATASET_STATE = "state.json"


# ----------------------------------------------------------------------------- prompts

def training_prompts(n_math: int, n_code: int, cache_dir=None, n_prose: int = 0) -> list[dict]:
    """Prompts from the TRAINING splits: `format_prompt` of the first `n_math` train seeds,
    `n_code` function-header prompts of the training stdlib files (built exactly like the `code`
    eval set, so training and evaluation prompts have the same shape) and `n_prose` openings of their
    comments and docstrings (`prose.prose_prompts`).

    A text is asked once (the first id keeps it) and never when it is an evaluation prompt (`eval_prompt_texts`):
    the stdlib repeats boilerplate in many files and the math generator repeats questions at large `n_math`, and a
    repeat would cost a second generation and could fall on both sides of the train/validation split. So a domain
    can come out a few prompts short of its count (the default 2000 code prompts lose 8 encodings modules' copies)."""
    from .eval_sets import code_prompts, eval_prompt_texts, math_prompts

    out: list[dict] = []
    if n_math:
        out += [dict(p, domain="math") for p in math_prompts("train", n_math)]
    if n_code:
        code = _all_of(code_prompts("train", n_code, cache_dir=cache_dir), n_code, "function", "--n-code")
        out += [dict(p, domain="code") for p in code]
    if n_prose:
        from .prose import prose_prompts

        prose = _all_of(prose_prompts("train", n_prose, cache_dir=cache_dir), n_prose, "prose", "--n-prose")
        out += [{"id": p["id"], "prompt": p["prompt"], "domain": "prose"} for p in prose]
    skip = set(eval_prompt_texts(cache_dir))
    return [p for p in out if not (p["prompt"] in skip or skip.add(p["prompt"]))]


def _all_of(rows: list[dict], n: int, what: str, flag: str) -> list[dict]:
    """`rows` when the training files yielded the `n` prompts asked for, else one error naming the most there are."""
    if len(rows) < n:
        raise UserError(f"the training stdlib files yield only {len(rows)} {what} prompts; use {flag} {len(rows)} "
                        "or less")
    return rows


# ----------------------------------------------------------------------------- work log (shards)

def _shard_schema():
    import pyarrow as pa

    return pa.schema([("id", pa.string()), ("domain", pa.string()), ("input_ids", pa.list_(pa.int32())),
                      ("prompt_len", pa.int32()), ("finished", pa.bool_()), ("prompt_sha", pa.string())])


def _prompt_key(p: dict) -> tuple[str, str]:
    # A row is reusable only for the same id AND the same prompt text: if a generator or corpus
    # changes what an id means, the stale response must not be resumed into the new dataset.
    return str(p["id"]), hashlib.sha1(p["prompt"].encode()).hexdigest()


def _write_shard(shard_dir: Path, index: int, rows: list[dict]) -> None:
    import pyarrow as pa

    table = pa.Table.from_pylist(rows, schema=_shard_schema())
    # atomic_path renames only after the whole file is written: a kill mid-write leaves no shard,
    # so the batch is simply redone on restart and never half-counted.
    with atomic_path(shard_dir / f"shard-{index:06d}.arrow") as tmp:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        _public(tmp)


def _public(path: Path) -> None:
    # atomic_path's temp files are private (0600); outputs should get the usual umask permissions
    # like the dataset files next to them, so other users and containers can read them.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _read_shards(shard_dir: Path):
    """All finished rows as one Arrow table (first occurrence of an (id, prompt) wins), and the next
    shard index."""
    import pyarrow as pa

    tables, next_index = [], 0
    for f in sorted(shard_dir.glob("shard-*.arrow")):
        next_index = max(next_index, int(f.stem.split("-")[1]) + 1)
        try:
            with pa.memory_map(str(f)) as src:
                tables.append(pa.ipc.open_file(src).read_all())
        except (pa.ArrowInvalid, OSError) as e:
            # Cannot happen through atomic writes; if a file was damaged some other way, its
            # prompts are regenerated rather than the whole run failing.
            warnings.warn(f"ignoring unreadable shard {f}: {e}")
    if not tables:
        return _shard_schema().empty_table(), next_index
    table = pa.concat_tables(tables)
    keys = list(zip(table.column("id").to_pylist(), table.column("prompt_sha").to_pylist()))
    seen: set[tuple[str, str]] = set()
    keep = [i for i, k in enumerate(keys) if not (k in seen or seen.add(k))]
    if len(keep) < len(keys):
        table = table.take(keep)
    return table, next_index


@contextmanager
def _locked(shard_dir: Path) -> Iterator[None]:
    """One writer per output folder: two runs appending shards to the same folder would redo each
    other's prompts. flock is released by the OS when the process dies, so a killed run never
    leaves a stale lock behind."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform: run unlocked
        yield
        return
    fh = open(shard_dir / ".lock", "w")
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UserError(f"another regenerate run is writing to {shard_dir.parent}; wait for it or "
                            "choose another --out") from None
        yield
    finally:
        fh.close()


def _check_settings(shard_dir: Path, settings: dict) -> dict:
    """Resuming must not mix responses produced under different settings in one dataset. Returns the settings of
    the folder's responses, which meta.json records."""
    path = shard_dir / "settings.json"
    if path.exists():
        old = json.loads(path.read_text())
        # folders made before the dtype was recorded resume as before: their responses' dtype is unknown
        diff = {k: (old.get(k), v) for k, v in settings.items()
                if old.get(k) != v and not (k == "dtype" and k not in old)}
        if diff:
            desc = ", ".join(f"{k}: {a!r} there vs {b!r} now" for k, (a, b) in diff.items())
            raise UserError(f"{shard_dir.parent} holds responses made with other settings ({desc}); "
                            "rerun with the same settings to resume, or choose another --out")
        return {**settings, "dtype": old.get("dtype")}
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(settings, indent=2))
    return settings


def check_out_dir(out_dir: str | os.PathLike) -> Path:
    """Fail fast on an unusable --out without creating anything (nothing written for bad input): what every output
    folder must be (errors.check_out_dir), and new, empty or an earlier regenerate output (never clobber user data)."""
    out_dir = errors.check_out_dir(out_dir, "--out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / SHARD_DIR).is_dir():
        raise UserError(f"--out {out_dir} is a non-empty folder that is not a regenerate output; "
                        "choose a new or empty folder")
    return out_dir


def _prepare_out_dir(out_dir: Path) -> Path:
    """Create DIR and DIR/_shards, refusing folders that are not ours (never clobber user data)."""
    check_out_dir(out_dir)
    shard_dir = out_dir / SHARD_DIR
    try:
        shard_dir.mkdir(parents=True, exist_ok=True)
        # mkdir succeeds on an existing read-only folder, so probe with a real write
        with tempfile.NamedTemporaryFile(dir=shard_dir, prefix=".probe-"):
            pass
    except OSError as e:
        raise UserError(f"cannot write to --out {out_dir}: {e.strerror}; choose a writable folder") from None
    return shard_dir


# ----------------------------------------------------------------------------- generation

def _resolve_target(target, dtype=None, device="cpu"):
    from ..target import Target

    if isinstance(target, (str, os.PathLike)):
        return Target.from_pretrained(str(target), dtype=dtype, device=device)
    if not hasattr(target, "model") or not hasattr(target, "tokenizer"):
        raise TypeError("target must be a domino_lab.target.Target (or a name/path to load one)")
    return target


def _generation_kwargs(temperature: float, max_new_tokens: int, eos: list[int], pad: int) -> dict:
    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad, num_beams=1, min_length=0,
              repetition_penalty=1.0, no_repeat_ngram_size=0, return_dict_in_generate=False)
    if temperature > 0:
        # Neutralise the sampling knobs a model's own generation_config may set (HF fills unset
        # fields from it, and Qwen3 ships top_k=20 / top_p=0.95): the drafter must learn the
        # target's plain distribution at `temperature`, nothing truncated.
        kw.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0, typical_p=1.0)
    else:
        kw.update(do_sample=False)
    return kw


def _generate_batch(model, prompt_ids: list[list[int]], pad_id: int, gen_kwargs: dict, device):
    """Left-pad a batch so every prompt ends at the same column, then decode them together.
    The attention mask hides the pads and HF derives position ids from it, so each row sees
    exactly what it would see alone (tested: batched greedy == one-at-a-time)."""
    import torch

    from ..decoding.kv_cache import new_cache

    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    extra = {}
    # the decoders' cache, whose layers write each step in place (docs/design.md#kv-cache): regeneration with the
    # embedded target 1.16x faster at batch 16, 1.27x at 64, same tokens; a model with its own kind of cache keeps it
    if getattr(model, "_supports_default_dynamic_cache", lambda: False)() and \
            getattr(model.generation_config, "cache_implementation", None) is None:
        extra["cache"] = new_cache(model.config.get_text_config(decoder=True))
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **gen_kwargs, **extra)
    return out[:, width:].tolist()


def _cut_at_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
    # HF keeps emitting pad after a row finishes; everything past the first EOS is filler.
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], True
    return tokens, False


def regenerate(target, prompts: Sequence[dict], out_dir: str | os.PathLike, *, max_new_tokens: int = 256,
               temperature: float = 0.0, batch_size: int = 16, seed: int = 0, target_name: str | None = None,
               max_length: int | None = None, dtype=None, device: str = "cpu", progress: bool = True):
    """Generate a response for every prompt (skipping those already in DIR's shards), then write the
    final dataset to `out_dir` and return it.

    `target`: a `domino_lab.target.Target` or a name/path for `Target.from_pretrained`.
    `prompts`: dicts with `id`, `prompt` and optionally `domain` (default "custom"); ids must be unique.
    Responses stop at EOS or after `max_new_tokens`; temperature 0 is greedy. Sampling uses a seed
    derived from `seed` and the batch index, so a fresh run is reproducible. Prompts longer than
    `max_length - max_new_tokens` tokens keep their last tokens; `max_length` defaults to the
    target's `max_position_embeddings` (set it to the length the target was trained on if smaller).
    """
    import torch
    from tqdm.auto import tqdm

    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    check_number(temperature, "temperature", low=0)
    if batch_size < 1:
        raise UserError(f"batch_size must be at least 1, got {batch_size}")
    prompts = list(prompts)
    if not prompts:
        raise UserError("no prompts to regenerate")
    dup = [x for x, c in Counter(str(p["id"]) for p in prompts).items() if c > 1]
    if dup:
        raise UserError(f"prompt ids must be unique; {dup[0]!r} occurs more than once")
    for p in prompts:
        if not isinstance(p.get("prompt"), str) or not p["prompt"].strip():
            raise UserError(f"prompt {p['id']!r} is empty or not a string")
        # text that cannot be encoded fails in the tokenizer or the shard writer, after _shards/ exists
        check_prompt_text(p["prompt"], f"prompt {p['id']!r}")
        check_prompt_text(str(p["id"]), f"prompt id {p['id']!r}", "give ids as UTF-8 text")

    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    if target_name is None:
        target_name = str(target) if isinstance(target, (str, os.PathLike)) else getattr(target, "name", "custom")
    tgt = _resolve_target(target, dtype=dtype, device=device)
    model, tok = tgt.model, tgt.tokenizer
    if tok is None:
        raise UserError(f"target '{target_name}' has no tokenizer, and regenerate writes responses to text prompts; "
                        "add its tokenizer files (tokenizer.json, tokenizer_config.json) to the model directory")
    eos = sorted(getattr(tgt, "eos_token_ids", None) or {tok.eos_token_id})
    if not eos or eos[0] is None:
        raise UserError("the target defines no EOS token; responses could never stop")
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    context = getattr(model.config, "max_position_embeddings", None)
    if max_length is not None and context is not None and max_length > context:
        raise UserError(f"max_length={max_length} is longer than the target's {context}-token context; pass at most "
                        f"{context} (or leave it out)")
    max_positions = max_length or context
    if max_positions is not None and max_new_tokens >= max_positions:
        raise UserError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in a "
                        f"{max_positions}-token context")
    settings = {"target": str(target_name), "temperature": float(temperature), "max_new_tokens": int(max_new_tokens),
                "seed": int(seed) if temperature > 0 else None, "vocab_size": len(tok), "eos_token_ids": eos,
                "max_length": max_positions, "weights_digest": getattr(tgt, "weights_digest", None),
                # the same weights answer differently in another dtype, and the weights digest need not differ
                "dtype": str(model.dtype).removeprefix("torch.")}
    gen_kwargs = _generation_kwargs(temperature, max_new_tokens, eos, pad)
    shard_dir = _prepare_out_dir(out_dir)  # only now: nothing is created for input rejected above

    with _locked(shard_dir):
        settings = _check_settings(shard_dir, settings)
        for partial in shard_dir.glob(".shard-*"):  # temp file of a batch killed mid-write
            partial.unlink(missing_ok=True)
        done, next_index = _read_shards(shard_dir)
        done_keys = set(zip(done.column("id").to_pylist(), done.column("prompt_sha").to_pylist()))
        todo = [p for p in prompts if _prompt_key(p) not in done_keys]
        # Whole batch tokenised in one fast-tokenizer call. No special tokens: the same encoding
        # `Target.encode` (and so generate/bench) uses, so drafter training sees identical prefixes.
        enc = tok([p["prompt"] for p in todo], add_special_tokens=False)["input_ids"] if todo else []
        if max_positions is not None:
            # keep the end of over-long prompts: the continuation depends on what comes last
            room = max_positions - max_new_tokens
            enc = [e[-room:] for e in enc]
        # Longest first, similar lengths together: little padding per batch, and a batch that
        # does not fit in memory fails at the start rather than hours in.
        order = sorted(range(len(todo)), key=lambda i: (-len(enc[i]), i))
        bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), unit="resp",
                   desc="regenerating", disable=not progress, dynamic_ncols=True)
        t0, new_tokens = time.perf_counter(), 0
        try:
            for b in range(0, len(order), batch_size):
                idx = order[b: b + batch_size]
                if temperature > 0:
                    torch.manual_seed(seed * 1_000_003 + next_index)
                outs = _generate_batch(model, [enc[i] for i in idx], pad, gen_kwargs, tgt.device)
                rows = []
                for i, gen in zip(idx, outs):
                    resp, finished = _cut_at_eos(gen, set(eos))
                    new_tokens += len(resp)
                    pid, sha = _prompt_key(todo[i])
                    rows.append({"id": pid, "domain": str(todo[i].get("domain", "custom")),
                                 "input_ids": enc[i] + resp, "prompt_len": len(enc[i]), "finished": finished,
                                 "prompt_sha": sha})
                _write_shard(shard_dir, next_index, rows)
                next_index += 1
                bar.update(len(rows))
                bar.set_postfix(tok_s=f"{new_tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
        finally:
            bar.close()
        elapsed = time.perf_counter() - t0
        table, _ = _read_shards(shard_dir)
        run_info = {"batch_size": batch_size, "generated_this_run": len(todo),
                    "seconds_this_run": round(elapsed, 2), "new_tokens_this_run": new_tokens}
        _finalize(out_dir, table, [_prompt_key(p) for p in prompts], {**settings, **run_info}, progress)
    return load_regenerated(out_dir)


@contextmanager
def _quiet_datasets(quiet: bool) -> Iterator[None]:
    # `progress=False` should silence datasets' own "Saving the dataset" bars too, then restore them.
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    change = quiet and not are_progress_bars_disabled()
    if change:
        disable_progress_bars()
    try:
        yield
    finally:
        if change:
            enable_progress_bars()


def _finalize(out_dir: Path, table, keys: list[tuple[str, str]], info: dict, progress: bool = True) -> None:
    """Write the requested rows, in prompt order, as the final dataset. Crash-safe: meta.json (the
    completeness marker) and state.json go first and come back last, so a crash part-way leaves a
    folder that `load_regenerated` reports as incomplete and a rerun repairs."""
    import datasets

    row_of = {k: i for i, k in enumerate(zip(table.column("id").to_pylist(),
                                             table.column("prompt_sha").to_pylist()))}
    missing = [k[0] for k in keys if k not in row_of]
    if missing:
        raise RuntimeError(f"{len(missing)} prompts have no response after generation (e.g. {missing[0]!r})")
    sub = table.take([row_of[k] for k in keys])
    ids = [k[0] for k in keys]
    input_ids = sub.column("input_ids").to_pylist()
    prompt_len = sub.column("prompt_len").to_pylist()
    domains = sub.column("domain").to_pylist()
    finished = sub.column("finished").to_pylist()
    features = datasets.Features({
        "id": datasets.Value("string"), "domain": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "prompt_len": datasets.Value("int32"),
    })
    ds = datasets.Dataset.from_dict({
        "id": ids, "domain": domains, "input_ids": input_ids,
        "loss_mask": [[0] * p + [1] * (len(x) - p) for x, p in zip(input_ids, prompt_len)],
        "prompt_len": prompt_len,
    }, features=features)

    counts: dict[str, int] = {}
    for d in domains:
        counts[d] = counts.get(d, 0) + 1
    resp_tokens = sum(len(x) - p for x, p in zip(input_ids, prompt_len))
    meta = {**info, "rows": len(ids), "counts": counts, "truncated_without_eos": finished.count(False),
            "response_tokens": resp_tokens, "mean_response_tokens": round(resp_tokens / len(ids), 2),
            "prompt_tokens": sum(prompt_len), "columns": list(features), "data_digest": content_digest(ds),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    for stale in out_dir.glob(".final-*"):  # left by a run killed while finalizing (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".final-", dir=out_dir))
    try:
        with _quiet_datasets(not progress):
            ds.save_to_disk(str(tmp))
        for marker in (META, _DATASET_STATE):
            (out_dir / marker).unlink(missing_ok=True)
        for old in out_dir.glob("data-*.arrow"):
            old.unlink()
        new_files = sorted(p for p in tmp.iterdir() if p.name != _DATASET_STATE)
        for f in new_files:
            os.replace(f, out_dir / f.name)
        os.replace(tmp / _DATASET_STATE, out_dir / _DATASET_STATE)
        with atomic_path(out_dir / META) as t:
            t.write_text(json.dumps(meta, indent=2) + "\n")
            _public(t)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_regenerated(out_dir: str | os.PathLike):
    """The dataset a finished `regenerate` run wrote (columns id, domain, input_ids, loss_mask, prompt_len)."""
    import datasets

    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise UserError(f"no regenerated data at {out_dir}; run `python -m domino_lab.regenerate --out {out_dir}`")
    if not (out_dir / META).exists() or not (out_dir / _DATASET_STATE).exists():
        if not (out_dir / SHARD_DIR).is_dir():     # a regenerate run makes it first and keeps it
            raise UserError(f"{out_dir} is not a folder of regenerated data (it has no {META} and no {SHARD_DIR}); "
                            f"give a folder that `python -m domino_lab.regenerate --out DIR` wrote")
        raise UserError(f"regenerated data at {out_dir} is incomplete (the run was interrupted); rerun the "
                        "same regenerate command to finish it")
    return datasets.load_from_disk(str(out_dir))


def load_meta(out_dir: str | os.PathLike) -> dict:
    load_regenerated(out_dir)  # same completeness checks
    return json.loads((Path(out_dir) / META).read_text())


def content_digest(ds) -> str:
    """sha256 (first 16 hex digits) of what a drafter learns from: every row's id, tokens and loss mask, in row
    order. Two datasets with the same digest train the same drafter (for a given recipe and seed), however and
    whenever they were written; the Arrow chunking does not enter it."""
    import numpy as np
    import pyarrow.compute as pc

    h = hashlib.sha256(b"regenerated-v1")
    h.update("\n".join(ds["id"]).encode())
    for name in ("input_ids", "loss_mask"):
        col = ds.data.column(name).combine_chunks()
        h.update(name.encode())
        h.update(np.asarray(pc.list_value_length(col), dtype=np.int64).tobytes())
        h.update(np.asarray(col.flatten(), dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def data_digest(out_dir: str | os.PathLike, meta: dict | None = None) -> str:
    """The content digest of regenerated data: from meta.json (`meta`, when the caller has already read it), or
    computed for data written before meta.json recorded it."""
    meta = meta if meta is not None else load_meta(out_dir)
    return meta.get("data_digest") or content_digest(load_regenerated(out_dir))


def ensure_regenerated(path: str | os.PathLike, target, *, n_math: int, n_code: int, max_new_tokens: int,
                       target_name: str | None = None, log_prefix: str = "[data]") -> None:
    """Training data made on first use: a fresh clone has none, so the target writes `n_math` + `n_code`
    training-split responses into `path` (resumable). Data made by another target (its weights digest differs,
    e.g. an older shipped default) is moved aside to `<path>.target-<digest>`, never deleted, and remade."""
    import sys

    path = Path(path)
    if path.exists() and (path / META).exists():
        made_by = load_meta(path).get("weights_digest")
        if made_by in (None, getattr(target, "weights_digest", None)):
            return
        aside = path.with_name(f"{path.name}.target-{made_by}")
        print(f"{log_prefix} {path} was made by another target; moved to {aside}, regenerating", file=sys.stderr)
        if aside.exists():
            shutil.rmtree(aside)
        path.rename(aside)
    print(f"{log_prefix} regenerating training data into {path} ({n_math} math + {n_code} code prompts)",
          file=sys.stderr)
    regenerate(target, training_prompts(n_math, n_code), path, max_new_tokens=max_new_tokens,
               target_name=target_name)


def frequent_tokens_from_dataset(path: str | os.PathLike, k: int, vocab_size: int) -> list[int]:
    """FR-Spec's draft vocabulary over a regenerated dataset: the k most frequent response tokens."""
    from ..models.frspec import frequent_tokens

    return frequent_tokens(load_regenerated(path), k, vocab_size)

