"""Tiny random targets and a briefly-trained drafter, shared by the core tests.

float64 targets: with random tiny models, near-ties between the top two logits are common, and fp32
rounding differences between a 1-token and an n-token forward would flip the argmax and make
"speculative == plain greedy" flaky for reasons that have nothing to do with the algorithm.
"""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from domino_lab import Drafter, Target
from domino_lab.training.objective import sample_anchors, weighted_ce


def tiny_target(vocab: int = 64, layers: int = 4, hidden: int = 32, eos: int | None = 3, seed: int = 0,
                logit_scale: float = 1.0, max_pos: int = 512, dtype=torch.float64) -> Target:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=max_pos, eos_token_id=eos, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return Target(model, None, mask_token_id=vocab - 1, taps=[1, layers - 2] if layers > 2 else [0])


def greedy_sequences(target: Target, n: int, length: int, seed: int = 0) -> torch.Tensor:
    """Sequences [n, 4 + length]: a random 4-token prompt then the target's own greedy continuation."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, target.vocab_size - 1, (n, 4), generator=g)
    with torch.no_grad():
        out = target.model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                    max_new_tokens=length, min_new_tokens=length, eos_token_id=None, pad_token_id=0)
    return out


def brief_train(drafter: Drafter, seqs: torch.Tensor, steps: int = 60, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """A few optimiser steps of the shared objective on target-generated sequences (response = after the prompt)."""
    target = drafter.target
    with torch.no_grad():
        feats = target.forward(seqs, taps=drafter.config.target_layer_ids).features
    loss_mask = torch.zeros_like(seqs)
    loss_mask[:, 4:] = 1
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    losses = []
    drafter.train()
    for _ in range(steps):
        anchors, keep = sample_anchors(loss_mask, 8, g)
        bb = drafter.training_blocks(feats, seqs, loss_mask, anchors, keep)
        loss = 0.5 * weighted_ce(bb.logits_base, bb.labels, bb.valid, 4.0) + \
            0.5 * weighted_ce(bb.logits_final, bb.labels, bb.valid, 4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().item())
    drafter.eval()
    return losses


TEXT = ("def add(a, b):\n    return a + b\n\nQuestion: Tom has 3 apples and buys 4 more. How many?\n"
        "Answer: 3 + 4 = <<3+4=7>>7\n#### 7\n") * 20


def make_target_dir(path, hidden=32, max_pos=64, seed=0):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|mask|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(fast), hidden_size=hidden, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=max_pos, eos_token_id=fast.eos_token_id)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def make_regenerated(root, n_prompts: int = 48, max_new_tokens: int = 40):
    """A tiny target with a tokenizer, and its own greedy continuations in the regenerated-data format."""
    from pathlib import Path

    from domino_lab.data.regenerate import regenerate

    root = Path(root)
    tdir = make_target_dir(root / "target", max_pos=256)
    target = Target.from_pretrained(str(tdir))
    words = ["def f", "Question:", "return", "Answer", "apples", "x = ", "for i in", "Tom has"]
    prompts = [{"id": f"p{i}", "prompt": words[i % 8] + " " + words[(i * 3 + i // 8) % 8]} for i in range(n_prompts)]
    regenerate(target, prompts, root / "data", max_new_tokens=max_new_tokens, batch_size=16, progress=False)
    return str(tdir), str(root / "data")


def tiny_sweep_yaml(root, n_trials: int, data_path: str | None = None, **extra):
    """A sweep config over a tiny target and its regenerated data (12 steps per trial), written to root/sweep.yaml.
    Returns (path, config dict). `data_path`: None regenerates the data here, now (root/data); a path (e.g.
    `runs/regenerated/tiny`, under the sweep's runs folder) is left for the sweep to create on first use, from a
    few math prompts. A key given as None in `extra` (e.g. out_dir=None) is left out: the sweep's default."""
    from pathlib import Path

    import yaml

    root = Path(root)
    if data_path is None:
        tdir, data = make_regenerated(root)
    else:
        tdir, data = str(make_target_dir(root / "target", max_pos=256)), data_path
        extra = {"regen_math": 12, "regen_code": 0, "regen_max_new_tokens": 24, **extra}
    cfg = {"study_name": "tiny", "base_config": None,
           "overrides": [f"target={tdir}", f"data.path={data}", "max_steps=12", "eval.every_n_steps=6",
                         "data.batch_size=4", "eval.tau_prompts=2", "eval.tau_max_new_tokens=16",
                         "loss.num_anchors=8", "checkpoint_every_n_steps=6", "drafter.rank=8", "drafter.gru_hidden=16"],
           "n_trials": n_trials, "out_dir": str(root / "sweeps"), **extra,
           "sampler": {"type": "tpe", "seed": 0, "n_startup_trials": 2},
           "pruner": {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 3},
           "space": {"drafter.rank": {"type": "int", "low": 4, "high": 16, "log": True},
                     "drafter.gru_hidden": {"type": "int", "low": 8, "high": 32, "log": True},
                     "loss.curriculum.type": {"type": "categorical", "choices": ["linear", "cosine"]}}}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    path = root / "sweep.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def experiment_script(name: str):
    """experiments/<name>.py loaded as a module (the scripts are not a package), for tests that call its main()."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_experiment", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_main(main, argv, capsys) -> tuple[int, str, str]:
    """A CLI's `main` run as the command line runs it (errors.run_cli): its exit code, stdout and stderr."""
    import pytest

    from domino_lab.errors import run_cli

    with pytest.raises(SystemExit) as e:
        run_cli(main, argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err
