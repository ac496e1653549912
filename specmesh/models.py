"""Finding and loading models: local Hugging Face directories, the bundled demo pair, dtypes.

Every command that runs a model (the verifier and drafter servers, `generate`, `bench`)
loads it through here, and shares the model options defined here. torch and transformers
are imported only by the functions that load something, so that building a parser (and
``--help``) stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from specmesh.model_runner import ModelRunner

DEMO_DIR = Path(__file__).resolve().parent / "demo_models"
DTYPES = ("float32", "bfloat16", "float64")
RUNNERS = ("auto", "fast", "hf")


def demo_model(kind: str) -> Path:
    """Path of the bundled demo pair's ``target`` or ``draft`` model."""
    return DEMO_DIR / kind


def model_dir(path: str | Path) -> Path:
    """``path`` if it is a Hugging Face model directory; ValueError saying why not otherwise."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
    return path


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype from its name ("float32", "bfloat16", ...)."""
    import torch

    return getattr(torch, name)


def cpu_has_fast_bf16() -> bool:
    """True on x86 CPUs whose matmuls run natively in bfloat16 (AVX512-BF16 or AMX), where a bf16 draft is
    about twice as fast as float32. Elsewhere bf16 is emulated and slower."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def draft_dtype(name: str | None, otherwise: str) -> torch.dtype:
    """The draft's dtype: ``name``, or for "auto"/None bfloat16 where the CPU multiplies it natively, else
    ``otherwise``. A draft's numerics never change the output, only acceptance."""
    if name in (None, "auto"):
        return torch_dtype("bfloat16" if cpu_has_fast_bf16() else otherwise)
    return torch_dtype(name)


def set_threads(threads: int | None) -> None:
    """torch intra-op threads (None or 0: torch's choice)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def load_model(path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu") -> PreTrainedModel:
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


def load_runner(path: str | Path, dtype: torch.dtype | None = None, backend: str = "auto") -> ModelRunner:
    """A model runner over the model in ``path``: ``backend`` auto (the fast Llama path where it is exact,
    else transformers), fast or hf."""
    from specmesh.fast_llama import make_runner

    return make_runner(load_model(path, dtype), backend)


# ------------------------------------------------------------ model options
def add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runner", choices=RUNNERS, default="auto",
                   help="forward implementation: 'fast' = specmesh's lean Llama-family path, 'hf' = transformers; "
                        "'auto' picks fast where it applies (default: auto)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's choice)")


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


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    """The target model's options (`specmesh verifier`, and the target half of generate/bench)."""
    p.add_argument("--target", type=Path, default=None,
                   help="target model: any local Hugging Face causal-LM directory (default: the bundled demo target)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="target weights dtype (default: float32)")


def add_draft_dtype_argument(p: argparse.ArgumentParser, otherwise: str) -> None:
    p.add_argument("--draft-dtype", choices=("auto", *DTYPES), default="auto",
                   help="draft weights dtype; drafts never change the output, so a faster dtype is safe. "
                        f"'auto' = bfloat16 on CPUs with native bf16 matmul (AVX512-BF16/AMX), {otherwise}")

