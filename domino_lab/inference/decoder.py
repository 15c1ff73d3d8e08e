"""`SpeculativeDecoder`, the LightningModule whose `predict_step` runs the engine on a batch of prompts, and
`predict`, which runs it through `Trainer.predict` (the package docstring has the usage)."""
from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from ..errors import UserError


class SpeculativeDecoder(pl.LightningModule):
    """Wraps a frozen target and drafter; `predict_step(batch)` decodes each prompt of the batch and returns
    one record per prompt (the generate contract of docs/design.md#contracts, with the per-step records)."""

    def __init__(self, target, drafter=None, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, block_size: int | None = None, seed: int = 0, steps: bool = True,
                 tree_nodes: int = 0, sampler: str = "rejection", batched: bool = False, slots: int | None = None):
        super().__init__()
        self.target, self.drafter = target, drafter
        # registered as submodules so Lightning moves them to the device (and casts them for the precision)
        self.target_model = target.model
        self.draft_model = drafter
        from ..decoding.engine import check_lookup_mode, check_tree_mode
        from ..decoding.tree import check_tree_nodes

        tree_nodes = check_tree_nodes(tree_nodes)
        if tree_nodes:               # a misfit fails here, before Lightning starts
            check_tree_mode(drafter)
        check_lookup_mode(drafter, drafter.options.lookup if drafter is not None else 0)
        from ..sampling import check_sampling

        check_sampling(temperature, top_p, sampler, drafter is not None and drafter.options.tree_sampled)
        if batched:
            check_batched(drafter, tree_nodes, temperature, sampler, block_size, steps)
        self.gen = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, block_size=block_size,
                        tree_nodes=tree_nodes, sampler=sampler)
        self.seed, self.steps, self.batched, self.slots = seed, steps, batched, slots

    def predict_step(self, batch: list[dict], batch_idx: int, dataloader_idx: int = 0) -> list[dict]:
        from ..decoding import speculative_generate
        from ..decoding.engine import RECORD_TOPK

        if self.batched:
            return self._batched_step(batch)
        out = []
        for row in batch:
            res = speculative_generate(self.target, self.drafter, prompt=row["prompt"], seed=self._seed(row),
                                       topk=RECORD_TOPK if self.steps else 0, **self.gen)
            out.append({"id": row["id"], "rank": self.global_rank} | res.to_dict(steps=self.steps))
        return out

    def _seed(self, row: dict) -> int:
        """A prompt's sampling seed: `seed` + its place in the prompts `predict` was given, so that its sample does not
        depend on the batch size, on which rank decodes it, or on decoding it alone or in a batch."""
        return self.seed + row.get("_index", 0)

    def _batched_step(self, batch: list[dict]) -> list[dict]:
        """The batch's prompts decoded together (decoding/batched.py): the same tokens as one at a time, each row
        seeded as the one-at-a-time path seeds it. A row's wall time is its batch's, shared with the other rows."""
        from ..decoding.batched import batched_generate
        from ..decoding.engine import prompt_token_ids

        g = self.gen
        ids = [prompt_token_ids(self.target, row["prompt"], what=f"prompt {row['id']!r}") for row in batch]
        res = batched_generate(self.target, self.drafter, ids, g["max_new_tokens"], temperature=g["temperature"],
                               top_p=g["top_p"], sampler=g["sampler"], row_seeds=[self._seed(row) for row in batch],
                               slots=self.slots)
        out = []
        for row, toks, lengths, reason in zip(batch, res.token_ids, res.acceptance_lengths, res.stop_reasons):
            text = self.target.decode(toks) if self.target.tokenizer else ""
            out.append({"id": row["id"], "rank": self.global_rank, "token_ids": toks, "text": text,
                        "acceptance_lengths": lengths,
                        "mean_acceptance_length": sum(lengths) / len(lengths) if lengths else 0.0,
                        "target_forward_calls": 1 + len(lengths), "wall_time_s": res.wall_time_s,
                        "prefill_time_s": None, "tokens_per_s": len(toks) / res.wall_time_s if res.wall_time_s else 0.0,
                        "num_new_tokens": len(toks), "stop_reason": reason, "batch_size": len(batch),
                        "slots": min(self.slots or len(batch), len(batch))})
        return out


def check_batched(drafter, tree_nodes: int, temperature: float, sampler: str, block_size: int | None,
                  steps: bool) -> None:
    """What decoding a batch's prompts together cannot do, as one error each (before Lightning starts): the batched
    engine's own limits, and the one-sequence options inference would otherwise ignore."""
    from ..decoding.batched import check_batched_mode

    if tree_nodes:
        raise UserError("batched inference verifies chains; tree verification decodes one sequence at a time: "
                        "drop --batched or use --tree-nodes 0")
    if block_size is not None:      # (a block size among the drafter's options: check_batched_mode)
        raise UserError("batched inference drafts the drafter's own block: drop --block-size or --batched")
    check_batched_mode(drafter, temperature, sampler=sampler)
    opts = drafter.options if drafter is not None else None
    if opts is not None and opts.draft_cutoff:
        raise UserError("the draft cutoff is a one-sequence option; batched inference chooses its draft count per "
                        "step itself: drop --draft-cutoff or --batched")
    if steps:
        raise UserError("batched inference keeps no per-step records: pass steps=False")
    one_sequence = [flag for flag, on in (("--adaptive-drafts", opts and opts.adaptive_drafts),
                                          ("--tree-min-prob", opts and opts.tree_min_prob),
                                          ("--tree-sampled", opts and opts.tree_sampled)) if on]
    if one_sequence:
        raise UserError(f"{one_sequence[0]} is a one-sequence option that batched inference does not use (it "
                        "chooses each step's draft count itself and verifies chains): drop it or --batched")


def _collate(rows: list[dict]) -> list[dict]:
    return rows


def check_batching(batch_size, batched: bool, slots) -> None:
    """The batch size and slots, checked before any model loads."""
    from ..decoding.batched import check_slots

    if not (isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size >= 1):
        raise UserError(f"batch size must be a whole number >= 1, got {batch_size!r}")
    if check_slots(slots) is not None and not batched:
        raise UserError("--slots without --batched: slots apply to batched inference; add --batched (batched=True) "
                        "or drop --slots")


def parse_devices(text: str) -> int | list[int] | str:
    """--devices as Lightning takes it (the training config's reading: a count, -1 for every GPU, 'auto', or device
    ids such as '0,1'), or one error."""
    from ..training.devices import parse_devices as lightning_devices

    parsed = lightning_devices(str(text).strip())
    if parsed is None or (isinstance(parsed, int) and (parsed == 0 or parsed < -1)):
        raise UserError(f"--devices {text!r}: use a count >= 1, 'auto', -1 (every GPU), or device ids such as 0,1")
    return parsed


# each Trainer setting with the flag that sets it, in the order Lightning resolves them
TRAINER_FLAGS = (("accelerator", "--accelerator"), ("strategy", "--strategy"), ("precision", "--precision"),
                 ("devices", "--devices"))


def make_trainer(accelerator: str = "auto", devices="auto", strategy: str = "auto",
                 precision: str | None = None) -> pl.Trainer:
    """The predict Trainer, or one UserError naming the setting Lightning refused (a GPU this machine lacks, an
    unknown strategy or precision, devices the accelerator cannot give). Built before any model loads, so a
    typo costs nothing."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from ..training.devices import quiet_lightning

    quiet_lightning()
    settings = dict(accelerator=accelerator, devices=devices, strategy=strategy, precision=precision or "32-true")
    try:
        return pl.Trainer(**settings, logger=False, enable_checkpointing=False,
                          enable_progress_bar=sys.stderr.isatty(), enable_model_summary=False)
    except (MisconfigurationException, ValueError, TypeError, ImportError) as e:
        raise _trainer_error(settings, e) from None


def _trainer_error(settings: dict, error: Exception) -> UserError:
    """Which flag made Lightning refuse `settings`: the settings are tried again one more at a time (in Lightning's
    own order, each on top of the ones before) until one fails. Only runs once the Trainer has already failed."""
    import logging
    import warnings

    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    tried = dict(accelerator="auto", devices="auto", strategy="auto", precision="32-true")
    culprit, reason = TRAINER_FLAGS[-1], error
    quiet = logging.getLogger("lightning.pytorch")
    level = quiet.level
    quiet.setLevel(logging.ERROR)                 # the retries would repeat Lightning's info lines
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for key, flag in TRAINER_FLAGS:
                tried[key] = settings[key]
                try:
                    _AcceleratorConnector(**tried)
                except Exception as e:           # whatever Lightning raises, it is this flag's
                    culprit, reason = (key, flag), e
                    break
    finally:
        quiet.setLevel(level)
    key, flag = culprit
    value = settings[key]
    said = " ".join(str(reason).split()).rstrip(".")
    if key == "accelerator" and str(value).lower() in ("gpu", "cuda"):
        return UserError(f"{flag} {value}: this machine has no GPU that Lightning can use; use {flag} cpu or auto")
    return UserError(f"{flag} {value}: {said}; choose another {flag}")


def predict(target, drafter, prompts, *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
            block_size: int | None = None, seed: int = 0, batch_size: int = 1, accelerator: str = "auto",
            devices="auto", strategy: str = "auto", precision: str | None = None, dtype: str | None = None,
            steps: bool = True, options=None, tree_nodes: int = 0, sampler: str = "rejection",
            batched: bool = False, slots: int | None = None, trainer: pl.Trainer | None = None) -> list[dict]:
    """Decode an eval set (name, JSONL path or list of {id, prompt}) with `Trainer.predict`; returns this
    process's rows (all rows on a single device; each rank's share under data parallelism). `options`: the
    InferenceOptions a drafter given by name runs with; `tree_nodes` > 0 verifies draft trees of that many nodes;
    `sampler` how T > 0 verifies (speculative_generate). `batched`: each batch of `batch_size` prompts is decoded
    together (decoding/batched.py: same tokens, no per-step records, so `steps` must be False); `slots`: at most that
    many of a batch's prompts at once, a finished row's place going to the next (continuous batching; batched only;
    None = the whole batch at once). `trainer`: one already made by `make_trainer` (it then stands for accelerator,
    devices, strategy and precision)."""
    from ..data.eval_sets import load_eval_set
    from ..models import load_drafter
    from ..target import Target

    check_batching(batch_size, batched, slots)
    if trainer is None:
        trainer = make_trainer(accelerator, devices, strategy, precision)
    rows = load_eval_set(prompts) if isinstance(prompts, (str, Path)) else list(prompts)
    if not rows:
        raise UserError("no prompts to decode")
    if len(rows) < trainer.world_size:
        # the distributed sampler would hand some process nothing, and it fails inside Lightning
        raise UserError(f"{len(rows)} prompt(s) for {trainer.world_size} processes; data-parallel decoding needs at "
                        "least one prompt per process: pass more prompts or fewer --devices")
    rows = [dict(row, _index=i) for i, row in enumerate(rows)]         # each prompt's seed (SpeculativeDecoder._seed)
    if isinstance(target, str):
        target = Target.from_pretrained(target, dtype=dtype)
    from ..decoding.engine import prompts_token_ids

    prompts_token_ids(target, rows)         # every prompt fits the context, before anything is decoded
    if isinstance(drafter, str):
        drafter = load_drafter(drafter, target, options=options)
    module = SpeculativeDecoder(target, drafter, max_new_tokens, temperature, top_p, block_size, seed, steps,
                                tree_nodes, sampler, batched, slots)
    # the distributed sampler shards the prompts over ranks (Lightning inserts it under ddp)
    loader = DataLoader(rows, batch_size=batch_size, collate_fn=_collate, shuffle=False)
    batches = trainer.predict(module, dataloaders=loader)
    return [r for b in batches or [] for r in b]
