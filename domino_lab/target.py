"""The target LM: any Hugging Face causal LM, frozen, with the pieces a drafter borrows.

A drafter reads three things from its target: the frozen token embedding (block inputs, GRU inputs),
the frozen LM head (base logits) and the hidden states of a few tapped layers (context features).
`hidden_states[j + 1]` is the output of decoder layer j; the last entry of `output_hidden_states` is
after the final norm in HF, so we never treat it as a raw layer output (docs/design.md#backbone).
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import UserError
from .head_screen import ArgmaxScreen
from .models.packed_linear import use_packed
from .validation import check_device, check_threads

ASSETS = Path(__file__).resolve().parent / "assets"
# Names of things the project ships; `default` is the embedded target (docs/design.md#embedded-default).
SHIPPED_TARGETS = {"default": ASSETS / "target"}
MASK_TOKEN = "<|mask|>"

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype '{dtype}'; use one of {sorted(set(DTYPES))}")
    return DTYPES[dtype]


def default_tap_layers(num_layers: int, k: int = 5) -> list[int]:
    """k decoder layers spread evenly from layer 1 to L-3 (DFlash's rule); one tap -> L//2."""
    if k <= 1:
        return [num_layers // 2]
    lo = min(1, num_layers - 1)
    hi = max(lo, num_layers - 3)
    return sorted({round(lo + i * (hi - lo) / (k - 1)) for i in range(k)})


# Below this many parameters a CPU decode is dispatch-bound: one sequence's forwards are too small to split across
# cores, and a second intra-op thread made the 9-token verify ~1.4x slower under passive OpenMP waits (the package's
# default) and no faster under spinning ones. A batch's forwards are larger, and whether they gain from more threads
# depends on the OpenMP wait policy and the machine, so that is measured (docs/design.md#threads-for-small-targets).
SMALL_TARGET_PARAMS = 50_000_000
_DEFAULT_THREADS = torch.get_num_threads()     # torch's own choice (OMP_NUM_THREADS or the cores), before any change
# more threads must make decoding's forwards this much faster to be chosen: one thread is deterministic and leaves the
# other cores to the rest of the machine
THREADS_MARGIN = 0.95


def decode_threads(target: "Target", requested: int | None = None, rows: int = 1) -> int:
    """Intra-op threads for decoding `rows` sequences at a time with `target`: `requested` if given; else, for a
    small target on a CPU, 1 for one sequence and, for a batch, whichever of 1 and torch's default count runs its
    forwards faster here (measured once per target and row count, `measure_threads`); else torch's default (all
    cores)."""
    if requested is not None:
        return check_threads(requested)
    small = sum(p.numel() for p in target.model.parameters()) < SMALL_TARGET_PARAMS
    if not small or target.device.type != "cpu":
        return _DEFAULT_THREADS
    if rows == 1 or _DEFAULT_THREADS == 1:
        return 1
    chosen = target.__dict__.setdefault("_decode_threads", {})
    if rows not in chosen:
        chosen[rows] = pick_threads(measure_threads(target, (1, _DEFAULT_THREADS), rows))
    return chosen[rows]


def openmp_waits() -> str:
    """How idle OpenMP threads wait in this process, as the environment set it before torch started: what a
    benchmark records beside its thread count (docs/design.md#threads-for-small-targets)."""
    import os

    spin, policy = os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY")
    if spin is not None:
        return f"GOMP_SPINCOUNT={spin}"
    return f"OMP_WAIT_POLICY={policy}" if policy else "libgomp default"


def last_level_cache() -> tuple[int, float] | None:
    """(level, size in MiB) of the largest cache level that sysfs reports for the first CPU, or None where it reports
    none. sysfs gives what one core can use ("32768K" on a core complex's L3, as lscpu reads it); CPUID's total over a
    whole package can be larger."""
    import glob
    import re

    caches = {}
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(f"{d}/level") as f_level, open(f"{d}/size") as f_size:
                level, size = int(f_level.read()), f_size.read().strip()
        except (OSError, ValueError):
            continue
        m = re.fullmatch(r"(\d+)([KM]?)", size)
        if m:
            caches[level] = int(m[1]) * {"K": 1, "M": 1024, "": 1 / 1024}[m[2]] / 1024
    return (max(caches), caches[max(caches)]) if caches else None


def cpu_description() -> str:
    """The processor's model name and its last-level cache as the OS reports them ("AMD EPYC, L3 32 MB"), or the
    architecture where the OS does not say. Timings need both: the same 2-core VM kind has come up on processors whose
    caches hold the embedded target and its drafter together (a Xeon) and on one whose cache does not (an EPYC with
    32 MB), where a draft step after a target step reads the drafter's weights from memory
    (docs/design.md#cpu-caches)."""
    import platform

    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = " ".join(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    cache = last_level_cache()
    if cache is None:
        return name
    return f"{name}, L{cache[0]} {cache_size(cache[1])}"


def cache_size(mib: float) -> str:
    """A cache size as the OS states it: "32 MB", "512 KB"."""
    return f"{mib:g} MB" if mib >= 1 else f"{mib * 1024:g} KB"


def cpu_line() -> str:
    """The architecture with the processor and its last-level cache, e.g. "x86_64 (AMD EPYC, L3 32 MB)": what a
    report's machine line starts with."""
    import platform

    return f"{platform.machine()} ({cpu_description()})"


def machine_line(threads_note: str = "") -> str:
    """The machine and software a measurement ran on, for a report's header: architecture, processor and its
    last-level cache, cores, torch threads (with `threads_note`, e.g. the OpenMP waits, in brackets), torch and Python.
    Python matters for results as well as times: the `code` eval set comes from the running interpreter's standard
    library."""
    import os
    import platform

    note = f" ({threads_note})" if threads_note else ""
    return (f"{cpu_line()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads{note}, "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def pick_threads(seconds: dict[int, float]) -> int:
    """The thread count to decode with, from the measured time of the same work at each count: the fewest threads
    unless more are faster by more than THREADS_MARGIN."""
    fewest = min(seconds)
    best = min(seconds, key=lambda n: (seconds[n], n))
    return best if seconds[best] < THREADS_MARGIN * seconds[fewest] else fewest


@torch.no_grad()
def measure_threads(target: "Target", counts: tuple[int, ...], rows: int = 1, reps: int = 6,
                    blocks: int = 2) -> dict[int, float]:
    """Seconds per round of decoding's two kinds of forward, a one-token step and a 9-token verify, for `rows`
    sequences over a 64-token cache, at each thread count: the median over `blocks` blocks per count, run in
    alternation so that a slow moment of the machine hits every count, of `reps` rounds each after two warm-up
    rounds (a count's first forwards after a change wake its threads and are not what a decode at that count sees);
    on the embedded target about 0.7 s for 4 rows and 1.7 s for 16."""
    import time

    from .decoding.kv_cache import new_cache, record_past

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (rows, 64), generator=g).to(target.device)
    one, nine = ids[:, :1], ids[:, :9]
    times: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(blocks):
        for n in counts:
            with torch_threads(n):
                cache = new_cache(target.model.config)
                target.forward(ids, cache=cache, last_logits_only=True, greedy=True)
                record_past(cache, 9)       # (linear-attention layers can be cut back only while recording)
                for rep in range(reps + 2):
                    t0 = time.perf_counter()
                    for x in (one, nine):
                        target.forward(x, cache=cache, greedy=True)
                        cache.crop(-x.shape[1])
                    if rep >= 2:
                        times[n].append(time.perf_counter() - t0)
    return {n: sorted(v)[len(v) // 2] for n, v in times.items()}


def use_decode_threads(target: "Target", requested: int | None = None, rows: int = 1) -> int:
    """Set torch's intra-op threads to `decode_threads(target, requested, rows)` (every decoding CLI calls this once
    the target is loaded; `rows` > 1 for one that decodes batches) and return the count."""
    n = decode_threads(target, requested, rows)
    torch.set_num_threads(n)
    return n


@contextmanager
def torch_threads(n: int | None):
    """torch's intra-op threads set to `n` inside the block (None: left as they are) and the caller's count back
    afterwards, also on an exception: a training run's or a timing's threads must not outlive it in the process."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def hub_reachable() -> bool:
    """Whether the Hugging Face hub's host name resolves (HF_ENDPOINT, or huggingface.co; HF_HUB_OFFLINE=1 counts
    as no): a machine without network fails here at once, where a download would retry for half a minute."""
    import os
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
    try:
        socket.getaddrinfo(host, 443)
    except (OSError, UnicodeError):
        return False
    return True


def own_cache_class(decoder: nn.Module) -> str | None:
    """The name of the cache class a decoder's forward insists on when it is not Hugging Face's `DynamicCache`, which
    every decoder of domino-lab passes (MiniMax and xLSTM keep their state in classes of their own and refuse any
    other), else None. Read from the forward's annotation of `cache`, so no forward is needed to find out."""
    import inspect
    import typing

    from transformers.cache_utils import DynamicCache

    try:
        param = inspect.signature(decoder.forward).parameters.get("cache")
    except (TypeError, ValueError):
        return None
    if param is None:
        return None
    kinds = typing.get_args(param.annotation) or (param.annotation,)
    own = [t for t in kinds if isinstance(t, type) and t is not type(None) and not issubclass(DynamicCache, t)]
    return own[0].__name__ if own else None


def takes_argument(module: nn.Module, name: str) -> bool:
    """Whether a module's forward has a parameter `name`. Hugging Face forwards end in **kwargs, which takes any other
    keyword without a word, so an argument they do not name is silently ignored. A forward whose signature cannot be
    read, or that names no parameter at all (a wrapper passing everything on), counts as taking it."""
    import inspect

    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return True
    named = [p for p in params.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return name in params or not named


def longrope_limit(config) -> int | None:
    """The positions a LongRoPE target (Phi-3 128k, Phi-3.5, Phi-4-mini) rotates with its short factors, else None.
    Past them Hugging Face switches the rotation of every token of a forward to the long factors, chosen per forward
    from its largest position, and its own `generate` then prefills the whole sequence again (keys cached with the
    short factors are wrong from there on). A verify block that reaches past the limit would rotate its tokens unlike
    the one-token steps of plain decoding, and caches that are cut back cannot be rotated anew, so decoding here
    stops at the limit (Target.max_length)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    # one set of parameters, or one per layer type (Gemma 3's layout)
    sets = [rope] if "rope_type" in rope or "type" in rope else [p for p in rope.values() if isinstance(p, dict)]
    limits = [p.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
              for p in sets if p.get("rope_type", p.get("type")) == "longrope"]
    limits = [int(n) for n in limits if n]
    return min(limits) if limits else None


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _knows_text(tokenizer):
    """`tokenizer`, or None when it has no vocabulary beyond its special tokens: for a model directory without
    tokenizer files transformers builds the model type's tokenizer class empty, and it encodes every text to no
    tokens at all, which would then pass for an empty prompt."""
    if tokenizer is None or len(tokenizer.get_vocab()) > len(getattr(tokenizer, "added_tokens_decoder", {})):
        return tokenizer
    return None


@dataclass
class TargetOutput:
    logits: torch.Tensor | None   # [b, t, V] (with `logits_rows`: [b, len(logits_rows), V]; None with `greedy`)
    features: torch.Tensor | None  # [b, t, len(taps) * H], raw outputs of the tapped layers, concatenated
    hidden: torch.Tensor | None = None   # [b, t, H] final-normed states (with `logits_rows`, or `greedy` through the
    #                                      LM-head screen; see logits_at and greedy_tokens)
    tokens: torch.Tensor | None = None   # with `greedy`: the argmax of each row's logits, [b, t] (or the rows asked)


OLDEST_TRANSFORMERS = "5.25"     # pyproject's lower bound


@functools.cache
def installed_transformers() -> str:
    """The installed distribution's version, read once per process (every Target construction checks it)."""
    from importlib.metadata import version

    return version("transformers")


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers older than the engine needs, whatever installed it: before 5.24 the models' forward
    silently ignores the `cache=` argument the engine passes (every step would then see no prefix, and decoding
    would be wrong without an error), and 5.25 brought the recurrent-state rollback of hybrid layers."""
    from packaging.version import Version

    version = version or installed_transformers()
    if Version(version) < Version(OLDEST_TRANSFORMERS):
        raise UserError(f"transformers {version} is installed; domino-lab needs {OLDEST_TRANSFORMERS} or later "
                        f"(older releases ignore the cache argument its decoders pass): "
                        f"pip install 'transformers>={OLDEST_TRANSFORMERS},<6'")


class Target:
    """A frozen causal LM plus its tokenizer. Build with `Target.from_pretrained` or wrap a model directly."""

    def __init__(self, model: nn.Module, tokenizer=None, *, mask_token_id: int | None = None,
                 taps: list[int] | None = None, name: str = "custom", head_screen: bool | str = "auto",
                 packed_linears: bool = True):
        check_transformers()
        self.model = model.eval().requires_grad_(False)
        # float32 linear layers on a CPU through oneDNN's packed weights for calls whose rows it is measured to be
        # faster at (models/packed_linear.py): the model's nn.Linear modules change class in place, their weights
        # stay as they are
        if packed_linears:
            use_packed(model)
        self.tokenizer = tokenizer
        self.name = name
        cfg = model.config
        self.num_layers: int = cfg.num_hidden_layers
        self.hidden_size: int = cfg.hidden_size
        # the borrowed pieces, looked up once: HF finds them by walking the model on every call, and a draft step
        # reads them several times (the model is frozen; moving it to a device keeps the same modules)
        self._embed_tokens, self._lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        self.vocab_size: int = self._lm_head.weight.shape[0]
        # the decoder stack (states before the LM head); Llama 4's causal LM keeps it as `model` under another prefix,
        # where HF's lookup returns the causal LM itself
        decoder = model.get_decoder()
        self.decoder: nn.Module = model.model if decoder is model and isinstance(getattr(model, "model", None),
                                                                                  nn.Module) else decoder
        kind = getattr(cfg, "model_type", None) or type(model).__name__
        # every decoder here hands the model its cache as `cache=`: a forward without that parameter (RWKV keeps its
        # state in `state=`) would take it into **kwargs and run every step without its context, silently wrong
        if not all(takes_argument(m, "cache") for m in (model, self.decoder)):
            raise UserError(f"target '{name}' ({kind}) takes no `cache` argument (it keeps its decoding state in "
                            "some other way), and domino-lab's decoders pass the cache they cut back to undo "
                            "rejected drafts, so this model family cannot be decoded here (Hugging Face's `generate` "
                            "can decode it)")
        # ALiBi targets (BLOOM, MPT, Falcon with alibi) bias attention by the keys' columns in the cache: a forward
        # without `position_ids` drops the positions given, and Falcon's alibi does not read them. Trees and batches
        # give tokens positions other than their columns (a tree's nodes side by side, a batch's holes), so they
        # refuse such a target (kv_cache.check_positions); a chain's columns are its positions.
        self.ignores_positions: bool = bool(getattr(cfg, "alibi", False)) or not all(
            takes_argument(m, "position_ids") for m in (model, self.decoder))
        # (a LongRoPE target's context here ends where its long factors would take over: longrope_limit)
        self.max_length: int = min(getattr(cfg, "max_position_embeddings", 1 << 30), longrope_limit(cfg) or 1 << 30)
        self.taps = list(taps) if taps is not None else default_tap_layers(self.num_layers)
        for j in self.taps:
            if not 0 <= j < self.num_layers:
                raise UserError(f"tap layer {j} is outside the target's {self.num_layers} decoder layers")
        self.eos_token_ids = self._find_eos()
        self.mask_token_id = mask_token_id if mask_token_id is not None else self._find_mask()
        # greedy tokens from a half-precision read of the LM head, exact (head_screen.py): "auto" where it reads them
        # faster than the full head on this machine (timed at its first use, ArgmaxScreen.pays), True always, False
        # never
        if head_screen not in (True, False, "auto"):
            raise ValueError(f"head_screen must be True, False or 'auto', got {head_screen!r}")
        self._use_screen = head_screen
        self._screen: ArgmaxScreen | None = None
        self.own_cache = own_cache_class(self.decoder)

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: str | torch.dtype | None = None,
                        device: str | torch.device = "cpu", taps: list[int] | None = None,
                        num_taps: int | None = None, trust_remote_code: bool = False,
                        head_screen: bool | str = "auto", packed_linears: bool = True) -> "Target":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = parse_dtype(dtype) or torch.float32
        check_device(device)      # before any weights are read
        if name_or_path in SHIPPED_TARGETS:
            path = SHIPPED_TARGETS[name_or_path]
            if not (path / "config.json").exists():
                raise UserError(f"the embedded target '{name_or_path}' is not in this install ({path}); "
                                "train it with `python -m domino_lab.pretrain`")
            source = str(path)
        else:
            source = name_or_path
            # a Hugging Face id is owner/name: a trailing slash, a backslash or more than one slash is a path
            looks_local = (name_or_path.startswith((".", "/", "~")) or name_or_path.endswith(("/", "\\"))
                           or name_or_path.count("/") > 1 or Path(name_or_path).exists())
            if looks_local and not (Path(name_or_path).expanduser() / "config.json").exists():
                raise UserError(f"target '{name_or_path}' is not a model directory (no config.json there); "
                                "pass a Hugging Face model id, a local model directory, or 'default'")
        if Path(source).exists():
            # a local (small) model loads in well under a second; the bar is only noise on stderr
            from transformers.utils import logging as hf_logging
            hf_logging.disable_progress_bar()
        from safetensors import SafetensorError

        # a hub id on a machine that cannot reach the hub: only the local cache can have it, and asking the hub
        # would cost ~25 s of retries (and a screen of their warnings) before the same error
        offline = {} if Path(source).exists() or hub_reachable() else {"local_files_only": True}
        try:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code,
                                                         **offline)
            try:
                tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, **offline)
            except (OSError, ValueError):
                # a model directory may hold the weights alone (a model's save_pretrained writes no tokenizer), and
                # for some model types transformers then fails where for others it builds an empty tokenizer
                # (_knows_text): either way the target has no tokenizer, and token-id prompts still decode
                if not Path(source).exists():
                    raise
                tokenizer = None
        except SafetensorError as e:
            raise UserError(f"cannot load target '{name_or_path}': its weights in {source} are not a readable "
                            f"safetensors file, corrupted or cut off ({_first_line(e)}); download or copy the "
                            "model again") from None
        except (OSError, ValueError) as e:
            why = ("the Hugging Face hub cannot be reached from this machine and the model is not in the local "
                   "cache" if offline and "cached files" in str(e) else _first_line(e))
            raise UserError(f"cannot load target '{name_or_path}': {why}; pass a Hugging Face model id "
                            "(needs network or a local HF cache), a local model directory, or 'default'") from None
        model.to(device)
        n_layers = model.config.num_hidden_layers
        if taps is None and num_taps is not None:
            taps = default_tap_layers(n_layers, num_taps)
        return cls(model, _knows_text(tokenizer), taps=taps, name=name_or_path, head_screen=head_screen,
                   packed_linears=packed_linears)

    def _find_eos(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if eos is None:
                continue
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return ids

    def _find_mask(self) -> int | None:
        tok = self.tokenizer
        if tok is not None:
            mid = tok.convert_tokens_to_ids(MASK_TOKEN)
            if isinstance(mid, int) and mid != tok.unk_token_id and mid is not None and mid >= 0:
                return mid
            # Qwen-style padded vocabularies: the first unused embedding row is never trained (DFlash §1.5).
            if self.vocab_size > len(tok):
                return len(tok)
        return None

    # ---- the pieces a drafter borrows ----------------------------------------------------------
    @property
    def embed_tokens(self) -> nn.Module:
        return self._embed_tokens

    @property
    def lm_head(self) -> nn.Module:
        return self._lm_head

    @property
    def screen(self) -> ArgmaxScreen | None:
        """The LM-head screen greedy tokens are read through, or None (the full head): built for the head as it is
        now, so a model moved to another device or dtype after loading gets a new one or none."""
        if not self._use_screen:
            return None
        if self._screen is None or not self._screen.reads(self._lm_head.weight):
            self._screen = ArgmaxScreen.for_head(self._lm_head)
        return self._screen

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def fingerprint(self) -> dict:
        """What a drafter must match to be usable with this target: its shape and, where the config names it, its
        model type (another architecture of the same shape has other features; DrafterConfig.check_target)."""
        fp = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_layers": self.num_layers}
        kind = getattr(self.model.config, "model_type", None)
        return fp | {"model_type": kind} if kind else fp

    @property
    def weights_digest(self) -> str:
        """A cheap content hash of the weights (the first values of every tensor): data regenerated by
        one target must not silently train drafters for a retrained one with the same shape."""
        import hashlib

        h = hashlib.sha256()
        for name, p in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(p.detach().reshape(-1)[:64].to("cpu", torch.float32).numpy().tobytes())
        return h.hexdigest()[:16]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache=None, taps: list[int] | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                logits_rows: list[int] | None = None, last_logits_only: bool = False,
                greedy: bool = False) -> TargetOutput:
        """One target forward; `taps` (decoder-layer indices) selects which hidden states become features.

        `logits_rows`: run the LM head on these positions only (none: []) and return every position's final-normed
        state in `hidden` (`logits_at` and `greedy_tokens` score more rows later). Tree verification needs the logits of the rows its walk
        visits, a few of the tree's N + 1; on a small target the LM head is a large share of a forward.
        `last_logits_only`: logits of the last position only (a prefill: nothing reads the prompt's other logits,
        and on the embedded target their LM head costs more than the layers), through the model's own
        `logits_to_keep`, so anything the model does after its head still applies.
        `greedy`: return each row's argmax token (`tokens`) and no logits, which is all greedy decoding reads
        (`greedy_tokens`)."""
        if cache is not None and self.own_cache is not None:
            raise self._own_cache_error()
        tokens = None
        if logits_rows is None and not (greedy and self.screen is not None):
            keep = {"logits_to_keep": 1} if last_logits_only else {}
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, use_cache=cache is not None, output_hidden_states=taps is not None, **keep)
            hidden, logits = None, out.logits
            if greedy:
                logits, tokens = None, logits.argmax(-1)
        else:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                                           position_ids=position_ids, cache=cache, use_cache=cache is not None,
                                           output_hidden_states=taps is not None)
            hidden = out.last_hidden_state
            rows = hidden[:, logits_rows] if logits_rows is not None else hidden[:, -1:] if last_logits_only else hidden
            if greedy:
                logits, tokens = None, self.greedy_tokens(rows)
            else:
                logits = self.logits_at(rows) if rows.shape[1] else None
        feats = None
        if taps is not None:
            feats = torch.cat([out.hidden_states[j + 1] for j in taps], dim=-1)
        return TargetOutput(logits, feats, hidden, tokens)

    def _own_cache_error(self) -> UserError:
        """The error for a target that refuses the cache every decoder here builds (`own_cache_class`), raised before
        a decoder's first forward."""
        kind = getattr(self.model.config, "model_type", type(self.model).__name__)
        return UserError(f"target '{self.name}' ({kind}) keeps its decoding state in a cache class of its own "
                         f"({self.own_cache}) and refuses any other; domino-lab's decoders need a cache they can "
                         "cut back to any position to undo rejected drafts, so this model family cannot be "
                         "decoded here (Hugging Face's `generate` can decode it)")

    @torch.no_grad()
    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax token of the LM head's logits for final-normed states [..., H] -> [...]: through the
        half-precision screen where the head allows it and (`head_screen="auto"`) it is the faster read here (exactly
        the float32 argmax, head_screen.py), else the full head. Models that rescale or soft-cap logits after the
        head (a monotone map) have the same argmax."""
        screen = self.screen
        if screen is not None and (self._use_screen is True or screen.pays(hidden)):
            return screen.argmax(hidden)
        return self.logits_at(hidden).argmax(-1)

    @torch.no_grad()
    def logits_at(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on final-normed states. Models that rescale or soft-cap logits after the head (a monotone
        map) get the same argmax, which is all greedy verification reads."""
        return self.lm_head(hidden)

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, taps: list[int], final_states: bool = False):
        """Only the tapped hidden states [b, t, len(taps) * H] of a whole sequence (training): the decoder without
        the LM head, whose [t, V] logits nobody reads there (on the embedded default they cost about as much as
        the six layers). `final_states`: also return the final-normed states [b, t, H], for a loss that scores a
        few positions with the LM head (`(features, states)`)."""
        out = self.decoder(input_ids=input_ids, use_cache=False, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[j + 1] for j in taps], dim=-1)
        return (feats, out.last_hidden_state) if final_states else feats

    # ---- text ----------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        from .data.eval_sets import check_prompt_text

        if self.tokenizer is None:
            raise UserError(f"target '{self.name}' has no tokenizer, so a text prompt cannot be encoded; add its "
                            "tokenizer files (tokenizer.json, tokenizer_config.json) to the model directory, or "
                            "pass prompt token ids (prompt_ids) from Python")
        check_prompt_text(text, "the prompt")
        # verbose=False: a text longer than the tokenizer's model_max_length would log a warning of its own; the
        # callers check the length against the model's context and say so in one error line
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=False)
