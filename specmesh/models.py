"""Finding and loading models: local Hugging Face directories, the bundled demo pair, dtypes.

Every command that runs a model (the verifier and drafter servers, `generate`, `bench`)
loads it through here, and shares the model options defined here. torch and transformers
are imported only by the functions that load something, so that building a parser (and
``--help``) stays fast.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from specmesh.runner_options import ATTENTION_BACKENDS, COMPILE_MODES, GRAPH_MODES, cpu_has_fast_bf16

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from specmesh.model_runner import ModelRunner

DEMO_DIR = Path(__file__).resolve().parent / "demo_models"
DTYPES = ("float32", "bfloat16", "float64")
# vLLM's --dtype names: "float" is float32; float16 is refused with what to use (``check_dtype_name``)
DTYPE_ALIASES = {"float": "float32", "half": None, "float16": None}
DEVICE_HELP = ("where the model runs: auto (the first CUDA GPU if there is one, else the CPU), cpu, cuda or cuda:N "
               "(default: auto)")
RUNNERS = ("auto", "fast", "hf")


def demo_model(kind: str) -> Path:
    """Path of the bundled demo pair's ``target`` or ``draft`` model."""
    return DEMO_DIR / kind


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # ORG/NAME on the Hugging Face hub
HUB_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")  # no .bin/.pt/.gguf copies


def model_dir(path: str | Path) -> Path:
    """The Hugging Face model directory ``path`` names: a local directory, a ``.gguf`` file (``gguf_dir``), or
    ``ORG/NAME`` on the hub, found in
    the local hub cache (``$HF_HOME``/``$HF_HUB_CACHE``) or downloaded into it (with a progress bar; offline,
    ``HF_HUB_OFFLINE=1``, the cache only). ValueError saying why not otherwise."""
    local = Path(path)
    if (local / "config.json").is_file():
        return local
    if local.suffix == ".gguf" and local.is_file():
        return gguf_dir(local)
    if local.exists() or not HUB_ID.fullmatch(str(path)):
        raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
    return hub_snapshot(str(path))


GGUF_CACHE = "SPECMESH_GGUF_CACHE"  # where .gguf files are dequantized to (default ~/.cache/specmesh/gguf)
GGUF_EXACT_TYPES = ("F32", "F16")  # tensor types a float32 checkpoint holds exactly; any other: bfloat16


def gguf_dir(file: Path) -> Path:
    """The Hugging Face directory a ``.gguf`` file is dequantized to, once: under $SPECMESH_GGUF_CACHE (default
    ~/.cache/specmesh/gguf), named by the file's SHA-256, so an edited file is converted again. The weights
    go through transformers' GGUF reader and are saved as safetensors, in float32 when every tensor of the
    file is F32 or F16 (exact), else (quantized or BF16 tensors) in bfloat16; the tokenizer and chat template
    come from the file. ValueError saying what to do when the optional ``gguf`` package is missing or the
    file cannot be read."""
    import hashlib
    import shutil
    import sys

    try:
        import gguf
    except ImportError:
        raise ValueError(f"{file}: reading a GGUF file needs the gguf package: pip install 'specmesh[gguf]'") from None
    root = Path(os.environ.get(GGUF_CACHE) or Path.home() / ".cache" / "specmesh" / "gguf")
    stat = file.stat()  # a file seen before, unchanged, is not hashed again (seconds for a multi-GB file)
    seen = root / "seen" / hashlib.sha256(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    if seen.is_file() and (root / seen.read_text() / "config.json").is_file():
        return root / seen.read_text()
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    target = root / f"{file.stem}-{digest.hexdigest()[:16]}"
    if (target / "config.json").is_file():
        _remember(seen, target.name)
        return target
    print(f"specmesh: dequantizing {file} into {target} (once)", file=sys.stderr)
    try:
        types = {t.tensor_type.name for t in gguf.GGUFReader(str(file)).tensors}
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file} cannot be read as a GGUF file: {exc}") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ValueError(f"{file}: transformers cannot load this GGUF file: {exc}") from None
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a plain checkpoint from here on
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    dtype = torch.float32 if types <= set(GGUF_EXACT_TYPES) else torch.bfloat16
    partial = root / f".{target.name}.{os.getpid()}"  # written whole, then renamed: no half directory is ever seen
    shutil.rmtree(partial, ignore_errors=True)
    plain.to(dtype).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(target)
    except OSError:  # another process converted it meanwhile
        shutil.rmtree(partial, ignore_errors=True)
    _remember(seen, target.name)
    return target


def _remember(seen: Path, name: str) -> None:
    seen.parent.mkdir(parents=True, exist_ok=True)
    seen.write_text(name)


def served_name(spec: str | Path | None) -> str:
    """The model id a server answers under for the target ``spec`` given to it: a hub id as given, a local
    directory's name, ``demo`` for the bundled demo target (None)."""
    if spec is None or Path(spec).resolve() == demo_model("target").resolve():
        return "demo"
    if HUB_ID.fullmatch(str(spec)) and not Path(spec).exists():
        return str(spec)
    return Path(spec).resolve().name


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of the hub model ``repo_id`` (config, tokenizer, safetensors weights), downloaded
    unless it is cached; ValueError saying what to do when it cannot be had."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        snapshot = Path(snapshot_download(repo_id, allow_patterns=list(HUB_FILES)))
    except RepositoryNotFoundError:
        raise ValueError(f"{repo_id} is neither a local directory nor a model on the Hugging Face hub (a gated "
                         "or private one needs `hf auth login` or $HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise ValueError(f"{repo_id} is not in the local Hugging Face cache and cannot be downloaded (offline, or "
                         "HF_HUB_OFFLINE=1): download it once online, or give a local directory") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ValueError(f"{repo_id}: cannot download it from the Hugging Face hub: {exc}") from None
    if not (snapshot / "config.json").is_file():
        raise ValueError(f"{repo_id} on the Hugging Face hub has no config.json: not a transformers model")
    return snapshot


def torch_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """torch dtype from its name ("float32", "bfloat16", ...); "auto": bfloat16 on a GPU, float32 on the CPU
    (where float32 keeps greedy output exactly that of the model)."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    check_dtype_name(name)
    return getattr(torch, DTYPE_ALIASES.get(name) or name)


def check_dtype_name(name: str | None) -> None:
    """ValueError for a dtype the runners do not support (vLLM's float16), saying what to use."""
    if name in DTYPE_ALIASES and DTYPE_ALIASES[name] is None:
        raise ValueError(f"--dtype {name}: float16 is not supported; use bfloat16 (the same memory, and the default "
                         "on a GPU)")


DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")
GPU_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd")  # NVIDIA's driver, ROCm's


def check_device_name(name: str | None) -> None:
    """A quick look at --device before torch is imported (a second, not ten): a name resolve_device can take,
    and for cuda a GPU driver on this machine. ValueError saying why not; resolve_device checks the rest."""
    if name is None or name == "auto" or name == "cpu":
        return
    if not DEVICE_NAME.fullmatch(name):
        raise ValueError(f"device {name!r}: choose auto, cpu, cuda or cuda:N")
    if not any(os.path.exists(f) for f in GPU_DRIVER_FILES):
        raise ValueError(f"device {name!r}: no GPU driver on this machine (use --device cpu)")


def resolve_device(name: str | None) -> torch.device:
    """``auto`` / None: cuda:0 when torch sees a GPU, else cpu; else the named device, checked."""
    import torch

    if name in (None, "auto"):
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {name!r}: {exc}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: torch sees no CUDA GPU here (use --device cpu)")
        if (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type != "cpu":
        raise ValueError(f"device {name!r}: choose auto, cpu, cuda or cuda:N")
    return device


def draft_dtype(name: str | None, otherwise: str, device: torch.device | None = None) -> torch.dtype:
    """The draft's dtype: ``name``, or for "auto"/None bfloat16 on a GPU or where the CPU multiplies it
    natively, else ``otherwise``. A draft's numerics never change the output, only acceptance."""
    if name in (None, "auto"):
        fast = (device is not None and device.type == "cuda") or cpu_has_fast_bf16()
        return torch_dtype("bfloat16") if fast else torch_dtype(otherwise, device)
    return torch_dtype(name)


def set_threads(threads: int | None) -> None:
    """torch intra-op threads (None or 0: torch's choice)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


# oneDNN (bf16/fp16 matrix products on the CPU) caches a compiled primitive per input shape: one in PyTorch's
# ideep layer (LRU_CACHE_CAPACITY) and one in oneDNN itself (ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1024 entries
# each by default, some 250 KB per entry. A drafter sees a new row count at every prompt and catch-up feed,
# so both fill up: +263 MB after two minutes of load, still rising (issue 17); capped at 64 it stays flat,
# and the shapes it repeats (one-token decode steps, short feeds) stay cached. A miss costs about 0.5 ms (a
# new primitive), which a verifier, whose batches do repeat shapes, cannot afford: capped like this, the
# embedded bf16 engine lost ~10% tokens/s (fused, 1 and 16 clients), so only `specmesh drafter` caps.
KERNEL_CACHE_ENTRIES = 64
KERNEL_CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> None:
    """Cap oneDNN's per-shape primitive caches unless the environment already sets them. Takes effect only
    before the process's first oneDNN matrix product (both caches read their capacity once)."""
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))


def load_model(path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> PreTrainedModel:
    """Load any local Hugging Face causal LM directory (never touches the network); float32 by default."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load of a local model is noise on a command's stderr
    model = AutoModelForCausalLM.from_pretrained(str(model_dir(path)), dtype=dtype or torch.float32,
                                                 local_files_only=True)
    return model.to(device).eval()


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_runner(path: str | Path, dtype: torch.dtype | None = None, backend: str = "auto",
                device: str | torch.device = "cpu", attention: str = "auto", hf_module: bool = False,
                compile_layers: str = "auto", cuda_graphs: str = "auto") -> ModelRunner:
    """A model runner over the model in ``path`` on ``device``: ``backend`` auto (the fast Llama path where it
    is exact, else transformers), fast or hf; ``attention``: the fast path's attention (auto, sdpa, triton);
    ``compile_layers``: whether the fast path torch.compiles its layers (auto, on, off); ``cuda_graphs``: whether
    it replays its steps as CUDA graphs (auto, on, off).
    The fast path reads a Llama-family checkpoint without importing transformers' modelling code (seconds of a
    command's start, ``specmesh.checkpoint``) unless ``hf_module`` asks for the transformers module as well
    (``runner.model``: the HF peers of `bench`, training)."""
    import torch

    from specmesh.checkpoint import fast_reason
    from specmesh.fast_llama import FastLlamaRunner, make_runner

    directory = model_dir(path)
    if backend in ("auto", "fast") and not hf_module and fast_reason(directory) is None:
        return FastLlamaRunner.from_checkpoint(directory, dtype or torch.float32, device, attention, compile_layers,
                                               cuda_graphs)
    return make_runner(load_model(directory, dtype, device), backend, attention, compile_layers, cuda_graphs)


# ------------------------------------------------------------ model options
def add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runner", choices=RUNNERS, default="auto",
                   help="forward implementation: 'fast' = specmesh's lean Llama-family path, 'hf' = transformers; "
                        "'auto' picks fast where it applies (default: auto)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--device", default="auto", metavar="DEVICE", help=DEVICE_HELP)
    p.add_argument("--attention", choices=ATTENTION_BACKENDS, default="auto",
                   help="the fast runner's attention: 'triton' = the fused tree-attention kernel (CUDA), 'sdpa' = "
                        "PyTorch SDPA per session; 'auto' = $SPECMESH_ATTENTION when set, else triton on CUDA when "
                        "it imports, else sdpa (default: auto)")
    p.add_argument("--compile", choices=COMPILE_MODES, default="auto", dest="compile_layers",
                   help="torch.compile the fast runner's layers, compiled and checked against eager at start-up. "
                        "'on': each layer's dense work (fused norm, rotary and MLP kernels: fewer launches per step; "
                        "for CUDA); 'frozen' (CPU only): the whole stack as one graph with the weights frozen in as "
                        "constants, its matrix products inductor's autotuned C++ GEMMs, 1.3-1.6x faster than eager "
                        "for a verify step's 2-24 rows, at the cost of minutes of compiling at start-up and a packed "
                        "copy of the weights; 'auto' = $SPECMESH_COMPILE when set, else on for CUDA (falling back to "
                        "eager, with a warning, if compiling fails) and off on the CPU (default: auto)")
    p.add_argument("--cuda-graphs", choices=GRAPH_MODES, default="auto", dest="cuda_graphs",
                   help="replay the fast runner's steps over its KV pool as CUDA graphs (padded to row/session "
                        "buckets, captured on first use), checked against eager at start-up; needs the triton "
                        "attention; 'auto' = on for CUDA (eager, with a warning, if the check fails), 'on' "
                        "fails instead (default: auto)")


def int_at_least(minimum: int):
    """An argparse type: an int no smaller than ``minimum`` (a clear usage error otherwise)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its "invalid int value" message
    return parse


positive_int = int_at_least(1)


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


positive_float.__name__ = "float"


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    """The target model's options (`specmesh verifier`, and the target half of generate/bench)."""
    p.add_argument("--target", type=Path, default=None,
                   help="target model: any local Hugging Face causal-LM directory, a .gguf file (dequantized once into "
                        "$SPECMESH_GGUF_CACHE, default ~/.cache/specmesh/gguf; needs the gguf extra), or ORG/NAME on "
                        "the Hugging Face hub (its local cache; downloaded when missing) (default: the bundled demo "
                        "target)")
    p.add_argument("--dtype", choices=("auto", *DTYPES, *DTYPE_ALIASES), default="auto",
                   help="target weights dtype; 'auto' = bfloat16 on a GPU, float32 on the CPU; vLLM's 'float' = "
                        "float32 ('half'/'float16' are refused: use bfloat16) (default: auto)")


def add_draft_dtype_argument(p: argparse.ArgumentParser, otherwise: str) -> None:
    p.add_argument("--draft-dtype", choices=("auto", *DTYPES), default="auto",
                   help="draft weights dtype; drafts never change the output, so a faster dtype is safe. "
                        f"'auto' = bfloat16 on CPUs with native bf16 matmul (AVX512-BF16/AMX), {otherwise}")

