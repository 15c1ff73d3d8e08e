"""Speculative inference as a LightningModule: `Trainer.predict` over an eval set runs the engine on every
prompt, so the same code runs on CPU, on a GPU (bf16 via `precision`), and data-parallel over devices.

    from domino_lab.inference import predict
    rows = predict("default", "default", "math", max_new_tokens=128)          # one dict per prompt

or `python -m domino_lab.inference --prompts math --out runs/predict.jsonl [--devices 2 --strategy ddp]`; with
`--batched --batch-size N` each batch's prompts are decoded together (decoding/batched.py), and with `--slots S` as
a queue through S rows at a time (continuous batching: a finished row's place goes to the batch's next prompt).
"""

_LAZY = {"SpeculativeDecoder": ".decoder", "predict": ".decoder", "make_trainer": ".decoder",
         "parse_devices": ".decoder", "check_batched": ".decoder", "check_batching": ".decoder", "main": ".__main__"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    # lazy, so that `python -m domino_lab.inference --help` (which imports this package first) loads no torch
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
