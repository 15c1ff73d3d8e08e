"""Pretraining a target LM end to end: the text streams (corpora, or a target's regenerated responses), the
tokenizer, the Lightning run on a step and wall-clock budget, and the atomic fp16 export with train_meta.json."""
from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from ..errors import UserError
from .recipe import TargetRecipe


EXPORT_FILES = ("config.json", "train_meta.json")      # what marks a folder as an earlier export_target


def check_export_dir(out_dir: str | os.PathLike, flag: str = "--out") -> Path:
    """`out_dir` as a place export_target may replace: absent, an empty folder, or an earlier export (a retrained
    target takes its place), and creatable; anything else is refused before training rather than deleted after."""
    from ..errors import check_out_dir

    out = check_out_dir(out_dir, flag)
    if out.exists() and (not out.is_dir() or (any(out.iterdir())
                                              and not all((out / f).is_file() for f in EXPORT_FILES))):
        raise UserError(f"{flag} {out} exists and is not an earlier pretrain output (no "
                        f"{' and '.join(EXPORT_FILES)}); choose a new or empty {flag} folder")
    return out


def export_target(model, tokenizer, meta: dict, out_dir: Path) -> None:
    """Write fp16 safetensors + config + tokenizer + train_meta.json into `out_dir`, atomically:
    everything goes to a sibling temp folder first, which then replaces `out_dir` in one rename."""
    import torch

    out_dir = Path(out_dir)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the asset folder should be readable like any other
    except OSError as e:
        raise UserError(f"cannot write to {out_dir.parent}: {e.strerror}; choose a writable --out") from None
    try:
        half = model.to(torch.float16)
        half.save_pretrained(str(tmp), safe_serialization=True)
        # Weights are stored in fp16 to keep the asset small, but CPU inference wants fp32; `dtype` in
        # config.json is what `from_pretrained(dtype="auto")` loads, so it names float32.
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["dtype"] = "float32"
        # RoPE has no hard limit, but the model never saw a position past its training window; consumers
        # (regeneration, benchmarks) size their prompts from this field, so it states what was trained.
        cfg["max_position_embeddings"] = min(cfg["max_position_embeddings"], meta["recipe"]["data"]["seq_len"])
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        tokenizer.save_pretrained(str(tmp))
        (tmp / "train_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)  # some writers create private files; the asset is meant to be read by anyone
        old = None
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}-old-{os.getpid()}"
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _texts(recipe: TargetRecipe, cache_dir) -> dict[tuple[str, str], list[str]]:
    from ..data.corpora import load_code_corpus, load_math_corpus

    d = recipe.data
    if d.regenerated:
        return _regenerated_texts(d.regenerated)
    code_train = load_code_corpus("train", cache_dir=cache_dir)
    if d.code_files is not None:
        code_train = code_train.select(range(min(d.code_files, len(code_train))))
    return {
        ("code", "train"): code_train["text"],
        ("code", "heldout"): load_code_corpus("heldout", cache_dir=cache_dir)["text"],
        ("math", "train"): load_math_corpus("train", n=d.math_train_problems, cache_dir=cache_dir)["text"],
        ("math", "heldout"): load_math_corpus("heldout", n=d.math_heldout_problems, cache_dir=cache_dir)["text"],
    }


def _regenerated_texts(path: str) -> dict[tuple[str, str], list[str]]:
    """Prompt + response of every regenerated row, per domain; the last 5% of each domain is held out."""
    from transformers import AutoTokenizer

    from ..data.packing import DOMAINS
    from ..data.regenerate import load_meta, load_regenerated

    ds = load_regenerated(path)
    target = load_meta(path)["target"]
    tok = AutoTokenizer.from_pretrained(str(_shipped_or_path(target)))
    out: dict[tuple[str, str], list[str]] = {}
    for domain in DOMAINS:
        rows = [tok.decode(x) for x, dom in zip(ds["input_ids"], ds["domain"]) if dom == domain]
        if len(rows) < 2:
            raise UserError(f"regenerated data {path} has {len(rows)} {domain} rows; regenerate with both domains")
        cut = max(1, len(rows) // 20)
        out[domain, "train"], out[domain, "heldout"] = rows[:-cut], rows[-cut:]
    return out


def _shipped_or_path(name: str) -> Path:
    from ..target import SHIPPED_TARGETS

    return SHIPPED_TARGETS.get(name, Path(name))


def train(recipe: TargetRecipe, out_dir: Path, runs_dir: Path, cache_dir=None, quick: bool = False) -> dict:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from ..data.packing import TargetLMData
    from ..data.tokenizer import EOS_TOKEN, MASK_TOKEN, load_or_train_tokenizer
    from .module import ProgressLines, TargetLM

    check_export_dir(out_dir, "out_dir")        # refused before the run, not replaced after it
    started = time.time()
    torch.set_num_threads(recipe.train.threads)
    pl.seed_everything(recipe.train.seed, workers=True, verbose=False)

    prev_meta = None
    if recipe.train.init_from:
        from transformers import AutoTokenizer

        src = Path(recipe.train.init_from)
        if not (src / "config.json").exists() or not (src / "train_meta.json").exists():
            raise UserError(f"train.init_from {src} is not an exported target (config.json, train_meta.json)")
        tok = AutoTokenizer.from_pretrained(str(src))
        prev_meta = json.loads((src / "train_meta.json").read_text())
    elif recipe.train.tokenizer_from:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(_shipped_or_path(recipe.train.tokenizer_from)))
    else:
        tok = load_or_train_tokenizer(cache_dir, vocab_size=recipe.model.vocab_size,
                                      math_n=recipe.data.tokenizer_math_problems, code_files=recipe.data.code_files)
    if len(tok) != recipe.model.vocab_size:
        raise UserError(f"tokenizer has {len(tok)} tokens but model.vocab_size is {recipe.model.vocab_size}; "
                        "the corpus is too small for that vocabulary, lower model.vocab_size")
    eos_id = tok.convert_tokens_to_ids(EOS_TOKEN)
    data = TargetLMData(tok, _texts(recipe, cache_dir), seq_len=recipe.data.seq_len,
                        batch_size=recipe.train.batch_size, code_share=recipe.data.code_share,
                        val_windows=recipe.data.val_windows, seed=recipe.train.seed)
    data.setup("fit")

    module = TargetLM(recipe.model, recipe.train, eos_id)
    n_params = sum(p.numel() for p in module.model.parameters())
    print(f"target: {n_params / 1e6:.2f}M parameters; streams {data.stream_tokens()}", file=sys.stderr)

    logger = CSVLogger(save_dir=str(runs_dir), name="pretrain_target")
    from ..training.callbacks import step_progress_bar

    callbacks = [ProgressLines()] + (step_progress_bar() if sys.stderr.isatty() else [])
    if recipe.train.checkpoint_every_steps:
        callbacks.append(ModelCheckpoint(dirpath=Path(logger.log_dir) / "checkpoints", save_last=True,
                                         save_top_k=1, every_n_train_steps=recipe.train.checkpoint_every_steps))
    from ..training.devices import quiet_lightning

    quiet_lightning()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision="32-true", max_steps=recipe.train.max_steps,
        gradient_clip_val=recipe.train.grad_clip, logger=logger, callbacks=callbacks,
        enable_checkpointing=bool(recipe.train.checkpoint_every_steps), val_check_interval=recipe.train.val_every_steps,
        check_val_every_n_epoch=None, num_sanity_val_steps=0, log_every_n_steps=10,
        enable_progress_bar=sys.stderr.isatty(), enable_model_summary=False,
    )
    fit_start = time.time()
    trainer.fit(module, datamodule=data)
    fit_wall = time.time() - fit_start
    final_val = trainer.validate(module, datamodule=data, verbose=False)
    val = {k: float(v) for res in final_val for k, v in res.items()}
    diverged = [k for k, v in val.items() if k.startswith("val/loss") and not math.isfinite(v)]
    if diverged:       # a model whose loss is NaN or inf predicts nothing: exported, it would only mislead
        raise UserError(f"training diverged: {diverged[0]} is {val[diverged[0]]} after {module.global_step} steps, "
                        f"so nothing was exported; lower train.lr (now {recipe.train.lr}) or raise train.warmup_steps "
                        f"(logs: {logger.log_dir})")

    meta = {
        "parameters": n_params,
        "tokens_seen": module.tokens_seen,
        "steps": int(module.global_step),
        "train_wall_time_s": round(fit_wall, 1),
        "total_wall_time_s": round(time.time() - started, 1),
        "tokens_per_s": round(module.tokens_seen / max(fit_wall, 1e-9), 1),
        "train_loss_final": round(sum(module.recent_losses) / max(1, len(module.recent_losses)), 4),
        "val_loss_code": round(val.get("val/loss_code", float("nan")), 4),
        "val_loss_math": round(val.get("val/loss_math", float("nan")), 4),
        "eos_token_id": eos_id,
        "mask_token_id": tok.convert_tokens_to_ids(MASK_TOKEN),
        "stream_tokens": data.stream_tokens(),
        "quick": quick,
        "recipe": asdict(recipe),
        "machine": {
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "lightning": pl.__version__,
        },
        "log_dir": str(logger.log_dir),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if prev_meta is not None:
        # cumulative over stages; each stage's own numbers stay in `stages`
        stages = prev_meta.pop("stages", None) or [prev_meta]
        meta["stages"] = stages + [dict(meta)]
        meta["tokens_seen"] += sum(st["tokens_seen"] for st in stages)
        meta["steps"] += sum(st["steps"] for st in stages)
        meta["train_wall_time_s"] = round(meta["train_wall_time_s"] + sum(st["train_wall_time_s"] for st in stages), 1)
        meta["total_wall_time_s"] = round(meta["total_wall_time_s"] + sum(st["total_wall_time_s"] for st in stages), 1)
        meta["tokens_per_s"] = round(meta["tokens_seen"] / max(meta["train_wall_time_s"], 1e-9), 1)
    export_target(module.model, tok, meta, out_dir)
    return meta
