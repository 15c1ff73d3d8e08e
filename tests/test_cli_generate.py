"""`python -m domino_lab.generate`: the JSON contract and one-line errors for bad input."""
import json
import subprocess
import sys

import pytest

from domino_lab import Drafter, Target
from domino_lab.generate import main
from core_helpers import make_target_dir, run_main


@pytest.fixture(scope="module")
def tdir(tmp_path_factory):
    return str(make_target_dir(tmp_path_factory.mktemp("target")))


def run(argv, capsys):
    return run_main(main, argv, capsys)


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
    # an untrained drafter's options are typed like a config file's
    for spec, word in (("untrained:domino:block_size=abc", "block_size must be an int"),
                       ("untrained:dflash:shift_label=3", "shift_label must be a bool")):
        code, _, err = run(base + ["--drafter", spec, "--prompt", "hi"], capsys)
        assert one_error_line(code, err) and word in err, (spec, err)


def test_prompts_file_is_checked_whole_before_decoding(tdir, tmp_path, capsys):
    """A prompt too long for the context on line 2: nothing is decoded or printed, and the error names it."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "short", "prompt": "def add"}\n{"id": "long-one", "prompt": "' + "x " * 200 + '"}\n')
    code, out, err = run(["--target", tdir, "--drafter", "none", "--prompts", str(f), "--max-new-tokens", "4",
                          "--json"], capsys)
    assert one_error_line(code, err) and out == ""
    assert "'long-one'" in err and "number 2" in err and "context" in err


def test_seed_and_device_out_of_reach(tdir, capsys):
    import torch

    base = ["--target", tdir, "--drafter", "none", "--prompt", "hi", "--max-new-tokens", "2"]
    for seed in (str(2 ** 64), str(2 ** 70), "-1"):
        code, out, err = run(base + ["--seed", seed], capsys)
        assert one_error_line(code, err) and "--seed" in err and out == "", (seed, err)
    code, out, err = run(base + ["--device", "quantum"], capsys)
    assert one_error_line(code, err) and "unknown device" in err
    if not torch.cuda.is_available():
        code, out, err = run(base + ["--device", "cuda"], capsys)
        assert one_error_line(code, err) and "CUDA is not available" in err


def test_cli_subprocess_no_traceback(tdir):
    """The real entry point, as a user runs it."""
    p = subprocess.run([sys.executable, "-m", "domino_lab.generate", "--target", tdir, "--drafter", "none",
                        "--prompt", ""], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr


def test_prompt_longer_than_the_tokenizers_limit_is_one_error_line():
    """The embedded tokenizer declares a longer model_max_length than the target's context; a prompt past both
    gets our error line alone, not the tokenizer's warning first."""
    p = subprocess.run([sys.executable, "-m", "domino_lab.generate", "--drafter", "none", "--max-new-tokens", "2",
                        "--prompt", "def f(x):\n    return x + 1\n\n" * 200], capture_output=True, text=True)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith("error: the prompt has") and "context is 512" in lines[0]


def test_gumbel_sampler_gives_one_text_per_seed(tdir, capsys):
    """--sampler gumbel: plain decoding and a drafter sample the same tokens for a seed; a sampled tree with it is
    one error line."""
    base = ["--target", tdir, "--prompt", "def add(a, b):", "--max-new-tokens", "16", "--temperature", "0.9",
            "--seed", "2", "--sampler", "gumbel", "--json", "--block-size", "4"]
    toks = []
    for drafter in ("none", "untrained:domino", "untrained:dflash"):
        code, out, err = run(base + ["--drafter", drafter], capsys)
        assert code == 0, err
        toks.append(json.loads(out)["token_ids"])
    assert toks[0] == toks[1] == toks[2]
    code, _, err = run(base + ["--drafter", "untrained:domino", "--tree-nodes", "4", "--tree-sampled"], capsys)
    assert one_error_line(code, err) and "rejection sampler" in err
