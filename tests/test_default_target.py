"""The embedded default target ships in the package and works offline end to end."""
import json
import subprocess
import sys

import pytest

from domino_lab import Drafter, Target, speculative_generate
from domino_lab.data.eval_sets import load_eval_set


@pytest.fixture(scope="module")
def target():
    return Target.from_pretrained("default")


def test_default_target_loads_with_reserved_tokens(target):
    tok = target.tokenizer
    assert target.vocab_size == len(tok)
    assert target.mask_token_id == tok.convert_tokens_to_ids("<|mask|>")
    assert tok.convert_tokens_to_ids("<|endoftext|>") in target.eos_token_ids
    assert target.max_length == 512                     # the window it was trained on
    assert target.taps and max(target.taps) < target.num_layers


def test_generate_cli_on_a_humaneval_prompt():
    prompt = load_eval_set("humaneval", limit=1)[0]["prompt"]
    p = subprocess.run([sys.executable, "-m", "domino_lab.generate", "--target", "default", "--drafter", "none",
                        "--prompt", prompt, "--max-new-tokens", "24", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-1500:]
    d = json.loads(p.stdout)
    assert len(d["token_ids"]) > 0 and d["target_forward_calls"] == len(d["token_ids"]) or d["stop_reason"] == "eos"


def test_speculative_equals_plain_on_default(target):
    d = Drafter.untrained(target, "domino", block_size=4)
    for row in load_eval_set("math", limit=3):
        plain = speculative_generate(target, None, prompt=row["prompt"], max_new_tokens=24)
        spec = speculative_generate(target, d, prompt=row["prompt"], max_new_tokens=24)
        assert spec.token_ids == plain.token_ids


@pytest.mark.parametrize("name", ["default", "default-dflash", "default-eagle", "default-mc", "default-dflash-mc",
                                  "default-eagle-mc", "default-nocopy", "default-dflash-nocopy"])
def test_shipped_drafters_are_lossless_and_accept(target, name):
    """The shipped drafters load by name, stay lossless on the default target, and actually get drafts accepted."""
    from domino_lab.models import load_drafter

    d = load_drafter(name, target)
    method = next((m for m in ("dflash", "eagle") if m in name), "domino")
    assert d.config.method == method
    if method != "eagle":
        assert bool(d.config.copy_ngram) != name.endswith("-nocopy")       # the shipped block drafters copy
    assert d.config.frspec_k == 1024
    taus = []
    for row in load_eval_set("math", limit=3) + load_eval_set("humaneval", limit=2):
        plain = speculative_generate(target, None, prompt=row["prompt"], max_new_tokens=32)
        spec = speculative_generate(target, d, prompt=row["prompt"], max_new_tokens=32)
        assert spec.token_ids == plain.token_ids, row["id"]
        taus.append(spec.mean_acceptance_length)
    assert sum(taus) / len(taus) > 1.2          # an untrained drafter stays near 1.0


def test_shipped_assistant_shares_the_target_vocabulary(target):
    """`default-assistant` (hf-assisted in the bench) loads, matches the vocabulary and drafts real tokens."""
    import torch
    from domino_lab.bench import load_assistant
    m = load_assistant("default-assistant", target, None)
    ids = torch.tensor([target.encode("def add(a, b):")])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=m, do_sample=False,
                                max_new_tokens=12, pad_token_id=0)
    plain = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                  pad_token_id=0)
    assert out.tolist() == plain.tolist()


def test_decode_threads_small_target_is_measured(target, monkeypatch):
    """A small CPU target decodes one sequence on 1 thread, and a batch with 1 thread or torch's default count,
    whichever measured faster (once per target and batch rows), unless a count is asked for
    (docs/design.md#threads-for-small-targets)."""
    import torch

    from domino_lab import target as tg
    from domino_lab.errors import UserError

    assert sum(p.numel() for p in target.model.parameters()) < tg.SMALL_TARGET_PARAMS
    assert tg.decode_threads(target, 3) == 3
    for bad in (0, 1 << 70):         # (torch.set_num_threads would overflow on the second)
        with pytest.raises(UserError, match="--threads must be a whole number between 1 and"):
            tg.decode_threads(target, bad)
    monkeypatch.setattr(tg, "_DEFAULT_THREADS", 2)
    calls = []

    def fake(t, counts, rows=1, reps=5):
        calls.append(rows)
        return {1: 1.0, 2: 0.8} if rows > 4 else {1: 1.0, 2: 0.97}     # two threads pay for 16 rows only
    monkeypatch.setattr(tg, "measure_threads", fake)
    monkeypatch.delitem(target.__dict__, "_decode_threads", raising=False)
    assert tg.decode_threads(target) == 1                                  # one sequence: not measured
    assert tg.decode_threads(target, rows=4) == 1 and tg.decode_threads(target, rows=16) == 2
    assert tg.decode_threads(target, rows=4) == 1 and tg.decode_threads(target, rows=16) == 2
    assert calls == [4, 16]                                                # measured once per row count
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        from domino_lab.generate import main
        assert main(["--prompt", "def add(a, b):", "--max-new-tokens", "4", "--drafter", "none"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
        target.__dict__.pop("_decode_threads", None)


def test_pick_threads_needs_a_clear_gain():
    from domino_lab.target import THREADS_MARGIN, pick_threads

    assert pick_threads({1: 1.0, 2: 0.8}) == 2
    assert pick_threads({1: 1.0, 2: THREADS_MARGIN + 0.01}) == 1                # within the margin: one thread
    assert pick_threads({1: 1.0, 2: 1.3}) == 1
    assert pick_threads({1: 1.0}) == 1


def test_measure_threads_times_each_count(target):
    import torch

    from domino_lab.target import measure_threads

    before = torch.get_num_threads()
    m = measure_threads(target, (1, 2), rows=2, reps=1)
    assert set(m) == {1, 2} and all(v > 0 for v in m.values())
    assert torch.get_num_threads() == before                               # the caller's count is restored


def test_openmp_waits_names_the_policy(monkeypatch):
    from domino_lab.target import openmp_waits

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert openmp_waits() == "OMP_WAIT_POLICY=PASSIVE"
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")            # overrides the policy in libgomp
    assert openmp_waits() == "GOMP_SPINCOUNT=300000"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert openmp_waits() == "libgomp default"


def test_machine_line_names_the_processor_and_its_cache(monkeypatch):
    """Timings on this VM kind differ with the processor's last-level cache (whether the target and its drafter fit
    in it together), so every report's machine line names the processor and that cache: the /proc/cpuinfo model name
    and sysfs's largest cache level where the OS has them, the platform's answer where not."""
    import builtins
    import glob
    import io
    import platform

    from domino_lab import target as tmod

    cache = "/sys/devices/system/cpu/cpu0/cache"
    files = {"/proc/cpuinfo": "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD  EPYC 9R14\nflags\t: fpu\n",
             f"{cache}/index0/level": "1\n", f"{cache}/index0/size": "48K\n",
             f"{cache}/index2/level": "2\n", f"{cache}/index2/size": "1024K\n",
             f"{cache}/index3/level": "3\n", f"{cache}/index3/size": "32768K\n"}
    real_open = builtins.open

    def fake_open(p, *a, **k):
        if str(p) in files:
            return io.StringIO(files[str(p)])
        if str(p).startswith(("/proc/cpuinfo", cache)):
            raise FileNotFoundError(p)
        return real_open(p, *a, **k)
    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(glob, "glob", lambda pattern: sorted({f.rsplit("/", 1)[0] for f in files if "index" in f}))
    assert tmod.cpu_description() == "AMD EPYC 9R14, L3 32 MB"          # runs of blanks collapsed; the largest level
    assert "(AMD EPYC 9R14, L3 32 MB)" in tmod.machine_line()
    files[f"{cache}/index3/size"] = "260M\n"
    assert tmod.cpu_description() == "AMD EPYC 9R14, L3 260 MB"
    for k in [k for k in files if "index3" in k or "index2" in k]:
        del files[k]
    assert tmod.cpu_description() == "AMD EPYC 9R14, L1 48 KB"
    files.clear()                           # neither cpuinfo nor sysfs, and no processor string: the architecture
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert tmod.cpu_description() == platform.machine()
