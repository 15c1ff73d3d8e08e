"""`python -m domino_lab.generate`: the JSON contract and one-line errors for bad input."""
import json
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from domino_lab import Drafter, Target
from domino_lab.errors import run_cli
from domino_lab.generate import main

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


@pytest.fixture(scope="module")
def tdir(tmp_path_factory):
    return str(make_target_dir(tmp_path_factory.mktemp("target")))


def run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        run_cli(main, argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_json_contract_and_lossless(tdir, capsys):
    res = {}
    for drafter in ("none", "untrained:dflash", "untrained:domino"):
        code, out, err = run(["--target", tdir, "--drafter", drafter, "--prompt", "def add(a, b):",
                              "--max-new-tokens", "20", "--dtype", "float64", "--json", "--block-size", "4"], capsys)
        assert code == 0, err
        d = json.loads(out)
        for key in ("token_ids", "text", "acceptance_lengths", "mean_acceptance_length", "target_forward_calls",
                    "wall_time_s", "tokens_per_s"):
            assert key in d
        assert d["target_forward_calls"] == len(d["acceptance_lengths"]) + 1
        res[drafter] = d["token_ids"]
    assert res["none"] == res["untrained:dflash"] == res["untrained:domino"]


def test_prompts_file(tdir, tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "prompt": "def add"}\n{"id": "b", "prompt": "Question: Tom"}\n')
    code, out, err = run(["--target", tdir, "--drafter", "untrained:domino", "--prompts", str(f),
                          "--max-new-tokens", "5", "--json"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"]


def one_error_line(code, err):
    lines = [x for x in err.strip().splitlines() if x.strip()]
    return code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err


def test_bad_inputs(tdir, tmp_path, capsys):
    base = ["--target", tdir, "--drafter", "none", "--max-new-tokens", "4"]
    code, _, err = run(base + ["--prompt", "   "], capsys)
    assert one_error_line(code, err) and "empty" in err
    code, _, err = run(base + ["--prompt", "x " * 200], capsys)
    assert one_error_line(code, err) and "context" in err
    code, _, err = run(["--target", str(tmp_path / "nope"), "--prompt", "hi"], capsys)
    assert one_error_line(code, err) and "not a model directory" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "ok"}\n{not json\n')
    code, _, err = run(["--target", tdir, "--drafter", "none", "--prompts", str(bad)], capsys)
    assert one_error_line(code, err) and "bad.jsonl:2" in err
    # a drafter trained for another target (different width)
    other = Target.from_pretrained(str(make_target_dir(tmp_path / "other", hidden=48)))
    Drafter.untrained(other, "domino").save_pretrained(tmp_path / "dr")
    code, _, err = run(base + ["--drafter", str(tmp_path / "dr"), "--prompt", "hi"], capsys)
    assert one_error_line(code, err) and "does not fit" in err


def test_cli_subprocess_no_traceback(tdir):
    """The real entry point, as a user runs it."""
    p = subprocess.run([sys.executable, "-m", "domino_lab.generate", "--target", tdir, "--drafter", "none",
                        "--prompt", ""], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr
