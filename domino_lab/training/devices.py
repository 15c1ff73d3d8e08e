"""accelerator, devices and strategy of a TrainConfig, checked as Lightning's Trainer will read them on this machine.

Lightning only looks at them when the Trainer is built, which is after the training folder and the MLflow store
exist; a typo or a GPU this machine lacks would end in a traceback with both left behind. These checks run in
`TrainConfig.validate`, before anything is created.
"""
from __future__ import annotations

from ..errors import UserError

# the accelerator names Lightning takes besides its registry's "tpu", which this project does not train on
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
DEVICES_FORMS = "a number of devices (>= 1), 'auto', -1 (every GPU) or a comma list of GPU ids such as 0,1"


def check_trainer_flags(accelerator, devices, strategy) -> None:
    kind = device_kind(accelerator)
    check_devices(devices, kind, accelerator)
    check_strategy(strategy, kind)


def device_kind(accelerator) -> str:
    """'cpu', 'cuda' or 'mps': what Lightning trains on for `accelerator` here ('auto' and 'gpu' pick as it does:
    MPS, then CUDA, then the CPU for 'auto')."""
    import torch

    if accelerator not in ACCELERATORS:
        raise UserError(f"accelerator must be one of {list(ACCELERATORS)}, got {accelerator!r}")
    mps, cuda = torch.backends.mps.is_available(), torch.cuda.is_available()
    if accelerator == "cpu":
        return "cpu"
    if accelerator == "auto":
        return "mps" if mps else "cuda" if cuda else "cpu"
    if accelerator == "mps":
        if not mps:
            raise UserError("accelerator=mps: this machine has no Apple GPU (MPS); use accelerator=cpu or auto")
        return "mps"
    if accelerator == "gpu" and mps:
        return "mps"
    if not cuda:
        raise UserError(f"accelerator={accelerator}: no GPU is available on this machine (torch sees no CUDA "
                        "device); use accelerator=cpu or auto")
    return "cuda"


def parse_devices(devices) -> int | list[int] | str | None:
    """`devices` as Lightning reads it: 'auto', a count (-1: every GPU) or a list of GPU ids; None if it is none of
    these."""
    if devices == "auto":
        return "auto"
    if isinstance(devices, int) and not isinstance(devices, bool):
        return devices
    if isinstance(devices, str):
        s = devices.strip()
        if s == "-1" or s.isdigit():
            return int(s)
        ids = [p.strip() for p in s.split(",") if p.strip()]
        if "," in s and ids and all(p.isdigit() for p in ids):
            return [int(p) for p in ids]
    return None


def check_devices(devices, kind: str, accelerator: str) -> None:
    import torch

    parsed = parse_devices(devices)
    if parsed is None or (isinstance(parsed, int) and (parsed < -1 or parsed == 0)):
        raise UserError(f"devices must be {DEVICES_FORMS}; got {devices!r}")
    if kind == "cpu":
        # Lightning's CPU accelerator takes a number of processes only
        if parsed == -1 or isinstance(parsed, list):
            raise UserError(f"devices={devices} names GPUs, but training runs on the CPU here "
                            f"(accelerator={accelerator}); give a number of processes such as devices=1, or 'auto'")
        return
    n_gpus = torch.cuda.device_count() if kind == "cuda" else 1
    if isinstance(parsed, list):
        bad = [i for i in parsed if i >= n_gpus]
        if bad or len(set(parsed)) != len(parsed):
            raise UserError(f"devices={devices}: this machine has {n_gpus} GPU(s), ids 0 to {n_gpus - 1}, each "
                            "named once; name GPUs it has, or give a count")
    elif isinstance(parsed, int) and parsed > n_gpus:
        raise UserError(f"devices={devices}: this machine has {n_gpus} GPU(s); give at most {n_gpus}, or -1 for "
                        "all of them")


def check_strategy(strategy, kind: str) -> None:
    """A strategy name Lightning's registry holds, usable on `kind` with what is installed (building the strategy
    object is how Lightning itself finds a missing package such as deepspeed)."""
    if strategy == "auto":
        return
    from lightning.pytorch.strategies import StrategyRegistry

    known = StrategyRegistry.available_strategies()
    if not isinstance(strategy, str) or strategy.lower() not in known:
        raise UserError(f"strategy must be 'auto' or a strategy Lightning knows ({', '.join(known)}), "
                        f"got {strategy!r}")
    name = strategy.lower()
    check_not_spawned(name, "strategy=")
    if "xla" in name or "tpu" in name:
        raise UserError(f"strategy={name} runs on TPUs, which this project does not train on; use auto, ddp or fsdp")
    if name.startswith("fsdp") and kind != "cuda":
        raise UserError(f"strategy={name} needs CUDA GPUs and training runs on the {kind.upper()} here; use "
                        "strategy=ddp or auto, or train on a machine with GPUs")
    if kind == "mps" and ("ddp" in name or "deepspeed" in name):
        raise UserError(f"strategy={name} does not run on the MPS accelerator; use strategy=auto or accelerator=cpu")
    try:
        StrategyRegistry.get(name)
    except Exception as e:      # MisconfigurationException, ImportError: a package the strategy needs is missing
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"strategy={name} cannot be used here ({first}); install what it needs or choose another "
                        "strategy (auto, ddp)") from None


def check_not_spawned(strategy, prefix: str = "--strategy ") -> None:
    """Strategies that start their processes by spawning (ddp_spawn, ddp_notebook...) hand each one a pickled copy
    of the target, whose forward then returns no hidden states (`output_hidden_states` comes back None there), so
    the drafter gets no features: one error instead of that crash."""
    if isinstance(strategy, str) and ("spawn" in strategy.lower() or "notebook" in strategy.lower()):
        raise UserError(f"{prefix}{strategy} starts processes by spawning, where the target's hidden states come "
                        "back empty; use ddp (started by the launcher or torchrun) or auto")


def quiet_lightning() -> None:
    """Drop what Lightning prints that a user cannot act on: its advertisements (an info line suggesting another
    package to install), which on a command line stand between the command and its result or its one error line, and
    the deprecation notice torch 2.13 raises inside Lightning's own pytree helper on every run. Lightning's other info
    lines (which accelerator it uses) and every other warning stay. The filter sits on the loggers that Lightning's
    rank-zero messages come from, so it holds whichever handler prints them."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            module=r"lightning\.pytorch\.utilities\._pytree")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(getattr(f, "_domino_lab", False) for f in logger.filters):
            def no_tips(record: logging.LogRecord) -> bool:
                return "Tip:" not in record.getMessage()
            no_tips._domino_lab = True
            logger.addFilter(no_tips)
