"""`python -m domino_lab.train --config experiments/configs/domino.yaml [key=value ...]`: train a drafter.

Lightning runs the loop, checkpoints (resume with --resume) and logs to MLflow; the best drafter by val/tau
and the final one are exported with save_pretrained under <out_dir>/best and <out_dir>/final.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .errors import UserError, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m domino_lab.train", description=__doc__)
    p.add_argument("--config", help="YAML recipe (experiments/configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. max_steps=200 loss.gamma=5")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in out_dir")
    p.add_argument("--devices", help="devices per node (Trainer)")
    p.add_argument("--num-nodes", type=int, help="number of nodes (Trainer)")
    p.add_argument("--strategy", help="auto, ddp, fsdp, ... (Trainer)")
    p.add_argument("--accelerator", help="auto, cpu, gpu (Trainer)")
    return p


def resolve_config(argv):
    from .config import load_config
    from .training.config import TrainConfig

    args = build_parser().parse_intermixed_args(argv)
    overrides = list(args.overrides)
    for flag, key in (("devices", "devices"), ("num_nodes", "num_nodes"), ("strategy", "strategy"),
                      ("accelerator", "accelerator")):
        v = getattr(args, flag)
        if v is not None:
            overrides.append(f"{key}={v}")
    return load_config(TrainConfig, args.config, overrides), args.resume


def build_drafter_config(cfg, target):
    from .models import DrafterConfig
    from .target import default_tap_layers

    d = cfg.drafter
    taps = d.target_layer_ids or default_tap_layers(target.num_layers, d.num_taps)
    extra = {"intermediate_size": d.intermediate_size} if d.intermediate_size else {}
    return DrafterConfig.for_target(target, d.method, num_layers=d.num_layers, block_size=d.block_size,
                                    gru_hidden=d.gru_hidden, rank=d.rank, shift_label=d.shift_label,
                                    target_layer_ids=taps, **extra)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest of last.ckpt (periodic) and on_exception.ckpt (written when the run was killed)."""
    cands = [p for p in (ckpt_dir / "last.ckpt", ckpt_dir / "on_exception.ckpt") if p.exists()]
    return max(cands, key=lambda p: p.stat().st_mtime) if cands else None


def train(cfg, resume: bool = False, extra_callbacks=None, logger=None, target=None) -> dict:
    """Train one drafter; returns {"best_tau", "best_dir", "final_dir", "run_id", "steps"}. Used by the sweep."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    from .config import to_dict
    from .target import Target
    from .training.callbacks import ExportBest
    from .training.datamodule import DrafterDataModule
    from .training.module import DrafterModule
    from .training.tracking import make_logger, plot_curves, remember_run
    import yaml

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out_dir = Path(cfg.out_dir)
    ckpt_dir = out_dir / "checkpoints"
    if out_dir.exists() and any(ckpt_dir.glob("*.ckpt")) and not resume:
        raise UserError(f"{out_dir} already holds a training run; pass --resume to continue it or choose "
                        "another out_dir")
    if not Path(cfg.data.path).exists():
        raise UserError(f"training data {cfg.data.path} does not exist; create it with "
                        "`python -m domino_lab.regenerate --out <dir>` and set data.path")
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    target = target or Target.from_pretrained(cfg.target, dtype=cfg.dtype)
    dcfg = build_drafter_config(cfg, target)
    dm = DrafterDataModule(cfg.data, seed=cfg.seed)
    dm.setup("fit")
    module = DrafterModule(cfg, dcfg, target)
    module.tau_prompts = dm.tau_prompts(cfg.eval.tau_prompts)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create out_dir {out_dir}: {e.strerror}") from None

    if logger is None:
        logger = make_logger(cfg.tracking_uri, cfg.experiment, cfg.run_name or out_dir.name, out_dir, resume,
                             tags={"method": dcfg.method})
    best = ExportBest(out_dir / "best")
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=cfg.checkpoint_every_n_steps,
                                 save_last=True, save_top_k=0),
                 OnExceptionCheckpoint(ckpt_dir), best] + list(extra_callbacks or [])
    accel = cfg.accelerator
    precision = cfg.precision or ("bf16-mixed" if torch.cuda.is_available() and accel != "cpu" else "32-true")
    trainer = pl.Trainer(max_steps=cfg.max_steps, accelerator=accel, devices=cfg.devices, num_nodes=cfg.num_nodes,
                         strategy=cfg.strategy, precision=precision, logger=logger, callbacks=callbacks,
                         val_check_interval=cfg.eval.every_n_steps, check_val_every_n_epoch=None,
                         num_sanity_val_steps=0, log_every_n_steps=cfg.log_every_n_steps,
                         gradient_clip_val=cfg.optim.grad_clip, use_distributed_sampler=False,
                         enable_model_summary=False, enable_progress_bar=cfg.progress_bar, default_root_dir=str(out_dir), deterministic=False)
    if trainer.is_global_zero:
        remember_run(logger, out_dir)
        logger.experiment.log_text(logger.run_id, yaml.safe_dump(to_dict(cfg), sort_keys=False), "config.yaml")
        logger.experiment.log_dict(logger.run_id, json.loads(dcfg.to_json()), "drafter_config.json")
        logger.log_hyperparams({f"drafter.{k}": v for k, v in module.drafter.param_counts().items()})
    ckpt = latest_checkpoint(ckpt_dir) if resume else None
    trainer.fit(module, datamodule=dm, **({"ckpt_path": str(ckpt)} if ckpt else {}))
    # a final validation if the last step wasn't one, so best/ is judged on the trained weights too
    if trainer.global_step % cfg.eval.every_n_steps:
        trainer.validate(module, datamodule=dm, verbose=False)
    result = {"steps": trainer.global_step, "run_id": logger.run_id, "best_tau": best.best_tau,
              "best_draft_ms": best.best.get("val/draft_ms"), "best_verify_ms": best.best.get("val/verify_ms"),
              "best_dir": str(best.path) if best.best_tau is not None else None}
    if trainer.is_global_zero:
        final = module.drafter.save_pretrained(out_dir / "final")
        result["final_dir"] = str(final)
        client = logger.experiment
        if best.best_tau is not None:
            client.log_artifacts(logger.run_id, str(best.path), "drafter_best")
            client.log_metric(logger.run_id, "val/best_tau", best.best_tau)
        png = plot_curves(client, logger.run_id, out_dir / "curves.png")
        if png:
            client.log_artifact(logger.run_id, str(png))
        (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv=None) -> int:
    import sys

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    cfg, resume = resolve_config(argv)
    try:
        result = train(cfg, resume=resume)
    except SIGTERMException:
        # Lightning saved on_exception.ckpt (OnExceptionCheckpoint); say how to continue, exit like a killed job
        print(f"error: training stopped by SIGTERM; continue it with the same command plus --resume "
              f"(state in {cfg.out_dir}/checkpoints)", file=sys.stderr)
        return 143
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    run_cli(main)
