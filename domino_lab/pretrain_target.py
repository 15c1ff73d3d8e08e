"""Pretrain the embedded default target: a small Qwen3 causal LM from scratch on code + math (DESIGN §5).

    python -m domino_lab.pretrain_target --config experiments/configs/target.yaml [--quick] [--out DIR]

The full recipe writes `domino_lab/assets/target/` (fp16 safetensors, config, tokenizer and
`train_meta.json`) atomically; `--quick` trains a few hundred tokens of a toy shape into `--out` (or a
temporary folder) for tests and never touches the shipped asset.

The learning-rate schedule runs on a *wall-clock* budget as well as a step budget: progress is
max(step / max_steps, elapsed / max_minutes), and training stops when progress reaches 1. On a shared
2-core machine the step rate varies with other load; a step-only cosine would then either overrun
the time budget or be cut off before the learning rate has decayed. The steps actually taken are
recorded in train_meta.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml

from domino_lab.errors import UserError, run_cli

SHIPPED_DIR = Path(__file__).resolve().parent / "assets" / "target"
DEFAULT_CONFIG = Path("experiments/configs/target.yaml")


# ----------------------------------------------------------------------------- recipe

@dataclass
class ModelShape:
    vocab_size: int = 8192
    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0


@dataclass
class DataRecipe:
    seq_len: int = 512
    code_share: float = 0.5            # share of training windows (= tokens) drawn from code
    math_train_problems: int = 60_000  # more than one run consumes, so math is never repeated
    math_heldout_problems: int = 2_000
    tokenizer_math_problems: int = 40_000
    code_files: int | None = None      # first N train files only (quick runs); None = all
    val_windows: int = 32              # held-out windows per domain for validation
    # train on a target's regenerated responses instead of the corpora (an assistant model for
    # `hf-assisted` learns the target's own distribution): a `python -m domino_lab.regenerate` folder
    regenerated: str | None = None


@dataclass
class TrainRecipe:
    seed: int = 0
    batch_size: int = 4
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    max_steps: int = 100_000
    max_minutes: float = 60.0
    val_every_steps: int = 500
    checkpoint_every_steps: int = 500
    threads: int = 2
    # continue from an exported target (a second stage with another data mix / budget); its tokenizer is
    # reused as is, and train_meta.json accumulates tokens, steps and wall time over the stages
    init_from: str | None = None
    # from scratch, but with this exported model's tokenizer (an assistant must share the target's)
    tokenizer_from: str | None = None


@dataclass
class TargetRecipe:
    model: ModelShape = field(default_factory=ModelShape)
    data: DataRecipe = field(default_factory=DataRecipe)
    train: TrainRecipe = field(default_factory=TrainRecipe)
    out_dir: str | None = None         # None: the shipped default target (domino_lab/assets/target)


# Toy shape for `--quick`: a few hundred tokens end to end in seconds.
QUICK_OVERRIDES = {
    "model": dict(vocab_size=384, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=16, intermediate_size=64, max_position_embeddings=256),
    "data": dict(seq_len=64, math_train_problems=200, math_heldout_problems=20, tokenizer_math_problems=200,
                 code_files=10, val_windows=2),
    "train": dict(batch_size=2, max_steps=3, warmup_steps=1, max_minutes=5.0, val_every_steps=1000,
                  checkpoint_every_steps=0),
}


def recipe_from_dict(raw: dict, where: str = "recipe") -> TargetRecipe:
    """Typed recipe from a mapping; unknown keys and wrong types name the key (shared loader, domino_lab.config)."""
    from domino_lab.config import from_dict

    if not isinstance(raw, dict):
        raise UserError(f"{where} must be a YAML mapping with sections model, data, train")
    return from_dict(TargetRecipe, raw)


def load_recipe(path: str | os.PathLike) -> TargetRecipe:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise UserError(f"recipe file {path} not found; pass --config experiments/configs/target.yaml") from None
    except yaml.YAMLError as e:
        raise UserError(f"recipe file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    return recipe_from_dict(raw, str(path))


def apply_quick(recipe: TargetRecipe) -> TargetRecipe:
    d = asdict(recipe)
    for sec, over in QUICK_OVERRIDES.items():
        d[sec].update(over)
    return recipe_from_dict(d)


# ----------------------------------------------------------------------------- model

def qwen3_config(shape: ModelShape, eos_id: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim, intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings, rope_theta=shape.rope_theta,
        tie_word_embeddings=True,  # halves the parameter count of a small-vocab model; the asset must stay < 20 MB
        eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None,
    )


def _lightning_module():
    # Lightning and transformers import slowly; only training paths pay for them.
    import lightning.pytorch as pl
    import torch
    from transformers import Qwen3ForCausalLM

    from domino_lab.data.packing import DOMAINS

    class TargetLM(pl.LightningModule):
        """Next-token LM training of a from-scratch Qwen3; the loss is the HF causal-LM loss."""

        def __init__(self, shape: ModelShape, train: TrainRecipe, eos_id: int):
            super().__init__()
            self.save_hyperparameters({"model": asdict(shape), "train": asdict(train), "eos_id": eos_id})
            self.shape, self.train_cfg = shape, train
            if train.init_from:
                self.model = Qwen3ForCausalLM.from_pretrained(train.init_from, dtype=torch.float32)
                if self.model.config.hidden_size != shape.hidden_size or \
                        self.model.config.num_hidden_layers != shape.num_hidden_layers:
                    raise UserError(f"train.init_from {train.init_from} has another shape than the recipe's model")
            else:
                self.model = Qwen3ForCausalLM(qwen3_config(shape, eos_id))
            self._t0: float | None = None
            self.recent_losses: deque[float] = deque(maxlen=50)
            self.tokens_seen = 0

        # progress in [0, 1] on both budgets (see module docstring)
        def progress(self, step: int) -> float:
            by_steps = step / self.train_cfg.max_steps
            if self._t0 is None:
                return by_steps
            return max(by_steps, (time.monotonic() - self._t0) / (60.0 * self.train_cfg.max_minutes))

        def lr_factor(self, step: int) -> float:
            c = self.train_cfg
            if step < c.warmup_steps:
                return (step + 1) / c.warmup_steps
            p = min(1.0, self.progress(step))
            return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))

        def on_train_start(self):
            self._t0 = time.monotonic()

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.tokens_seen += batch.numel()
            self.recent_losses.append(float(loss.detach()))
            self.log("train/loss", loss, prog_bar=True)
            self.log("train/lr", self.optimizers().param_groups[0]["lr"])
            self.log("train/tokens", float(self.tokens_seen))
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.progress(self.global_step) >= 1.0:
                self.trainer.should_stop = True

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.log(f"val/loss_{DOMAINS[dataloader_idx]}", loss, add_dataloader_idx=False, prog_bar=True)

        def configure_optimizers(self):
            decay, no_decay = [], []
            for name, p in self.model.named_parameters():
                # norms' gains stay undecayed; the (tied) embedding is a matrix and is decayed like the rest
                (decay if p.ndim >= 2 else no_decay).append(p)
            c = self.train_cfg
            opt = torch.optim.AdamW([{"params": decay, "weight_decay": c.weight_decay},
                                     {"params": no_decay, "weight_decay": 0.0}], lr=c.lr, betas=tuple(c.betas))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_factor)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return TargetLM


def _progress_printer(every: int = 25):
    """One plain line per `every` steps (the nohup'd full run logs to a file, where a tqdm bar is noise)."""
    import lightning.pytorch as pl

    class ProgressLines(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step % every == 0 and module._t0 is not None:
                el = time.monotonic() - module._t0
                loss = sum(module.recent_losses) / max(1, len(module.recent_losses))
                print(f"step {step} loss {loss:.3f} lr {trainer.optimizers[0].param_groups[0]['lr']:.2e} "
                      f"tokens {module.tokens_seen} tok/s {module.tokens_seen / max(el, 1e-9):.0f} "
                      f"elapsed {el / 60:.1f}min progress {module.progress(step):.3f}", file=sys.stderr, flush=True)

        def on_validation_end(self, trainer, module):
            vals = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
            print(f"step {trainer.global_step} validation {vals}", file=sys.stderr, flush=True)

    return ProgressLines()


# ----------------------------------------------------------------------------- export

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


# ----------------------------------------------------------------------------- run

def _texts(recipe: TargetRecipe, cache_dir) -> dict[tuple[str, str], list[str]]:
    from domino_lab.data.corpora import load_code_corpus, load_math_corpus

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

    from domino_lab.data.packing import DOMAINS
    from domino_lab.regenerate import load_meta, load_regenerated

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
    from domino_lab.target import SHIPPED_TARGETS

    return SHIPPED_TARGETS.get(name, Path(name))


def train(recipe: TargetRecipe, out_dir: Path, runs_dir: Path, cache_dir=None, quick: bool = False) -> dict:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from domino_lab.data.packing import TargetLMData
    from domino_lab.data.tokenizer import EOS_TOKEN, MASK_TOKEN, load_or_train_tokenizer

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

    TargetLM = _lightning_module()
    module = TargetLM(recipe.model, recipe.train, eos_id)
    n_params = sum(p.numel() for p in module.model.parameters())
    print(f"target: {n_params / 1e6:.2f}M parameters; streams {data.stream_tokens()}", file=sys.stderr)

    logger = CSVLogger(save_dir=str(runs_dir), name="pretrain_target")
    callbacks = [_progress_printer()]
    if recipe.train.checkpoint_every_steps:
        callbacks.append(ModelCheckpoint(dirpath=Path(logger.log_dir) / "checkpoints", save_last=True,
                                         save_top_k=1, every_n_train_steps=recipe.train.checkpoint_every_steps))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision="32-true", max_steps=recipe.train.max_steps,
        gradient_clip_val=recipe.train.grad_clip, logger=logger, callbacks=callbacks,
        enable_checkpointing=bool(callbacks), val_check_interval=recipe.train.val_every_steps,
        check_val_every_n_epoch=None, num_sanity_val_steps=0, log_every_n_steps=10,
        enable_progress_bar=sys.stderr.isatty(), enable_model_summary=False,
    )
    fit_start = time.time()
    trainer.fit(module, datamodule=data)
    fit_wall = time.time() - fit_start
    final_val = trainer.validate(module, datamodule=data, verbose=False)
    val = {k: float(v) for res in final_val for k, v in res.items()}

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m domino_lab.pretrain_target", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="recipe YAML (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="toy shape, a few hundred tokens; for tests")
    ap.add_argument("--out", help=f"output folder (default: {SHIPPED_DIR} for the full recipe, a temp folder for --quick)")
    ap.add_argument("--runs-dir", default=None, help="Lightning CSV logs and checkpoints (default: runs/)")
    ap.add_argument("--cache-dir", default=None, help="dataset/tokenizer cache (default: $DOMINO_LAB_CACHE or ~/.cache/domino_lab)")
    args = ap.parse_args(argv)

    recipe = load_recipe(args.config)
    from domino_lab.data.cache import cache_root

    cache_root(args.cache_dir)  # an unwritable cache is a user error: say so before any slow work
    if args.quick:
        recipe = apply_quick(recipe)
        out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="domino-target-quick-"))
        if out.resolve() == SHIPPED_DIR.resolve():
            raise UserError("--quick must not overwrite the shipped target; pass another --out")
        runs = Path(args.runs_dir) if args.runs_dir else out.parent / f".{out.name}-runs"
    else:
        out = Path(args.out or recipe.out_dir or SHIPPED_DIR)
        runs = Path(args.runs_dir or "runs")
    meta = train(recipe, out, runs, cache_dir=args.cache_dir, quick=args.quick)
    print(json.dumps({"out": str(out), **{k: meta[k] for k in ("parameters", "tokens_seen", "steps",
                                                               "train_wall_time_s", "val_loss_code",
                                                               "val_loss_math")}}))
    return 0


if __name__ == "__main__":
    run_cli(main)
