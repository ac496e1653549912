"""`specmesh train-pair`: train a small draft/target Llama pair on Python source, on CPU.

The pair shares one byte-level BPE tokenizer and one token stream, so the draft
(q) is a weaker copy of the target (p) that agrees with it often -- the property
speculative decoding needs. Output layout::

    OUT/target/{config.json, model.safetensors, tokenizer.json, tokenizer_config.json, ...}
    OUT/draft/{...same...}
    OUT/report.json

Pipeline, one pure function per step:
    collect_files -> read_corpus -> train_tokenizer -> tokenize_corpus (np.ndarray)
    -> sample_batch / train_model (time budget) -> evaluate -> save.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

EOS_TOKEN = "<|endoftext|>"  # id 0; doubles as bos and pad
SKIP_DIR_NAMES = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ModelSize:
    """Llama architecture knobs that differ between draft and target."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int


@dataclass(frozen=True)
class TrainPairConfig:
    out_dir: Path
    corpus: tuple[Path, ...] = ()  # files or directories; () = stdlib of the running interpreter
    vocab_size: int = 4096
    seq_len: int = 256
    target: ModelSize = field(default_factory=lambda: ModelSize(256, 4, 4, 704))
    draft: ModelSize = field(default_factory=lambda: ModelSize(128, 2, 2, 352))
    max_position_embeddings: int = 2048
    # The draft gets less time than the target so it ends clearly weaker: on one core a 4x smaller
    # model sees ~3x more tokens per minute and would otherwise catch up with the target.
    target_minutes: float = 19.0
    draft_minutes: float = 4.0
    max_steps: int | None = None  # per model; stops at whichever of steps / minutes comes first
    batch_size: int = 8
    lr: float = 1.5e-3  # target peak; see peak_lr_for_width for the draft's
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    max_corpus_bytes: int = 16_000_000
    heldout_fraction: float = 0.02
    max_eval_tokens: int = 131_072
    threads: int = 1
    bf16_autocast: bool = True  # ~2x faster on CPUs with avx512_bf16; master weights stay fp32

    def __post_init__(self) -> None:
        if self.vocab_size < 257:
            raise ValueError(f"vocab_size must hold 256 byte symbols + {EOS_TOKEN}, got {self.vocab_size}")
        if self.seq_len < 2 or self.seq_len > self.max_position_embeddings:
            raise ValueError(f"seq_len must be in [2, {self.max_position_embeddings}], got {self.seq_len}")
        if self.target_minutes <= 0 or self.draft_minutes <= 0:
            raise ValueError("time budgets must be > 0 minutes")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if not 0.0 < self.heldout_fraction < 0.5:
            raise ValueError(f"heldout_fraction must be in (0, 0.5), got {self.heldout_fraction}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


# ----------------------------------------------------------------------------- corpus


def default_corpus() -> tuple[Path, ...]:
    return (Path(sysconfig.get_paths()["stdlib"]),)


def collect_files(paths: tuple[Path, ...]) -> list[Path]:
    """*.py files under `paths` (files are taken as given), sorted, skipping test dirs and site-packages."""
    files: list[Path] = []
    for root in paths:
        if root.is_file():
            files.append(root)
            continue
        if not root.is_dir():
            raise FileNotFoundError(f"corpus path does not exist: {root}")
        for path in root.rglob("*.py"):
            rel_parts = path.relative_to(root).parts
            if any(p in SKIP_DIR_NAMES for p in rel_parts[:-1]) or path.name.startswith("test_"):
                continue
            files.append(path)
    return sorted(set(files))


def read_corpus(files: list[Path], max_bytes: int, seed: int) -> list[str]:
    """Documents in a seeded random order, up to `max_bytes` of UTF-8; undecodable files are skipped.

    Shuffling first makes the held-out tail a random sample of files, not the alphabet's end.
    """
    order = np.random.default_rng(seed).permutation(len(files))
    docs: list[str] = []
    total = 0
    for i in order:
        try:
            raw = files[i].read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip() or total + len(raw) > max_bytes:
            continue
        docs.append(text)
        total += len(raw)
    if not docs:
        raise ValueError("corpus is empty: no readable UTF-8 files found")
    return docs


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(docs: list[str], vocab_size: int, model_max_length: int):
    """Byte-level BPE (GPT-2 style) with `<|endoftext|>` as id 0. Returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    assert tok.token_to_id(EOS_TOKEN) == 0
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,  # otherwise decode rewrites " ." etc. and breaks round-trips
        model_max_length=model_max_length,
    )


def save_tokenizer(tokenizer, model_dir: Path) -> None:
    """save_pretrained, plus a class name every transformers version resolves.

    transformers 5 writes "TokenizersBackend", which 4.x (still allowed by pyproject) cannot load;
    "PreTrainedTokenizerFast" is an alias of it in 5.x and the real class in 4.x.
    """
    tokenizer.save_pretrained(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def tokenize_corpus(tokenizer, docs: list[str]) -> np.ndarray:
    """Concatenate documents, each followed by eos. Returns tokens [num_tokens] (uint16 if the vocab fits)."""
    eos = tokenizer.eos_token_id
    ids = tokenizer.backend_tokenizer.encode_batch(docs, add_special_tokens=False)
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.int32
    parts = []
    for enc in ids:
        parts.append(np.asarray(enc.ids, dtype=dtype))
        parts.append(np.asarray([eos], dtype=dtype))
    return np.concatenate(parts)


def split_heldout(tokens: np.ndarray, fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, heldout): heldout is the last `fraction` of the stream, at least one window + 1 token."""
    num_heldout = max(int(len(tokens) * fraction), seq_len + 1)
    if len(tokens) - num_heldout < seq_len + 1:
        raise ValueError(f"corpus too small: {len(tokens)} tokens for seq_len {seq_len}")
    return tokens[:-num_heldout], tokens[-num_heldout:]


# ----------------------------------------------------------------------------- training core


def sample_batch(
    tokens: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows from tokens [num_tokens]. Returns (inputs, labels), each int64 [batch_size, seq_len]."""
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size, endpoint=True)
    windows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    windows_t = torch.from_numpy(windows)
    return windows_t[:, :-1], windows_t[:, 1:]


def lr_at(step: int, progress: float, peak_lr: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to min_lr_ratio * peak as progress goes 0 -> 1.

    `progress` is the fraction of the budget (time or steps) used, so the schedule ends on time
    without knowing the step count in advance.
    """
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return peak_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


def next_token_loss(model, inputs: torch.Tensor, labels: torch.Tensor, bf16_autocast: bool) -> torch.Tensor:
    """Mean cross-entropy of labels [B, T] under model(inputs [B, T]); computed in fp32."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
        logits = model(input_ids=inputs).logits  # [B, T, vocab]
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def build_model(size: ModelSize, vocab_size: int, max_position_embeddings: int, eos_id: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def peak_lr_for_width(target_lr: float, target_hidden: int, hidden: int) -> float:
    """Scale the peak LR as 1/width (muP-style), anchored at the target.

    Measured on the stdlib corpus (300 steps, 8x256 tokens): hidden 256 is best near 1.5e-3 and clearly
    worse at 3e-3, while hidden 128 trains well at 3e-3.
    """
    return target_lr * target_hidden / hidden


def train_model(
    model,
    train_tokens: np.ndarray,
    cfg: TrainPairConfig,
    peak_lr: float,
    minutes: float,
    seed: int,
    desc: str,
) -> dict:
    """Train `model` in place until `minutes` elapse (or cfg.max_steps). Returns step/token/time stats."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr,
        betas=(0.9, 0.95),
    )
    rng = np.random.default_rng(seed)
    budget_s = minutes * 60.0
    model.train()
    step, loss_ema, t0 = 0, None, time.perf_counter()
    bar = tqdm(total=cfg.max_steps, desc=desc, unit="step", dynamic_ncols=True)
    while True:
        elapsed = time.perf_counter() - t0
        progress = elapsed / budget_s
        if cfg.max_steps is not None:
            progress = max(progress, step / cfg.max_steps)
        if progress >= 1.0:
            break
        lr = lr_at(step, progress, peak_lr, cfg.warmup_steps, cfg.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        inputs, labels = sample_batch(train_tokens, cfg.batch_size, cfg.seq_len, rng)
        loss = next_token_loss(model, inputs, labels, cfg.bf16_autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        value = loss.item()  # host sync, once per step, for the progress bar
        loss_ema = value if loss_ema is None else 0.95 * loss_ema + 0.05 * value
        tok_s = step * cfg.batch_size * cfg.seq_len / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix(loss=f"{loss_ema:.3f}", tok_s=f"{tok_s:.0f}", lr=f"{lr:.1e}", refresh=False)
        bar.update(1)
    bar.close()
    model.eval()
    return {
        "steps": step,
        "train_tokens": step * cfg.batch_size * cfg.seq_len,
        "minutes": round((time.perf_counter() - t0) / 60.0, 2),
        "final_train_loss_ema": round(loss_ema, 4) if loss_ema is not None else None,
    }


def eval_windows(tokens: np.ndarray, seq_len: int, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows of tokens [num_tokens]. Returns (inputs, labels), each [num_windows, seq_len]."""
    num_windows = max(1, min((len(tokens) - 1) // seq_len, max_tokens // seq_len))
    flat = torch.from_numpy(tokens[: num_windows * seq_len + 1].astype(np.int64))
    return flat[:-1].view(num_windows, seq_len), flat[1:].view(num_windows, seq_len)


@torch.no_grad()
def evaluate(models: dict, inputs: torch.Tensor, labels: torch.Tensor, batch_size: int) -> dict:
    """Held-out loss per model (fp32, as loaded by users) and, with two models, greedy top-1 agreement.

    inputs, labels: [num_windows, seq_len]. Returns {"<name>_loss": float, "top1_agreement": float}.
    """
    sums = {name: 0.0 for name in models}
    agree, count = 0, 0
    for i in range(0, inputs.shape[0], batch_size):
        x, y = inputs[i : i + batch_size], labels[i : i + batch_size]
        argmaxes = []
        for name, model in models.items():
            logits = model(input_ids=x).logits.float()  # [b, T, vocab]
            sums[name] += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), y.flatten(), reduction="sum"
            ).item()
            argmaxes.append(logits.argmax(-1))
        if len(argmaxes) == 2:
            agree += (argmaxes[0] == argmaxes[1]).sum().item()
        count += y.numel()
    out = {f"{name}_loss": round(s / count, 4) for name, s in sums.items()}
    if len(models) == 2:
        out["top1_agreement"] = round(agree / count, 4)
    return out


def round_to_bf16(model) -> None:
    """Round weights through bfloat16 in place, so evaluation sees exactly what save() writes."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def greedy_sample(model_dir: Path, prompt: str, max_new_tokens: int) -> str:
    """Load `model_dir` the way users do and greedily continue `prompt`. Returns prompt + continuation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return tokenizer.decode(out[0], skip_special_tokens=False)


# ----------------------------------------------------------------------------- shell


def train_pair(cfg: TrainPairConfig) -> dict:
    """Tokenizer + target + draft, saved under cfg.out_dir. Returns (and writes) the report dict."""
    # Thread caps must be in place before tokenizers/torch spin up their pools.
    os.environ.setdefault("RAYON_NUM_THREADS", str(cfg.threads))
    if cfg.threads == 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()

    paths = cfg.corpus or default_corpus()
    files = collect_files(paths)
    docs = read_corpus(files, cfg.max_corpus_bytes, cfg.seed)
    num_bytes = sum(len(d.encode("utf-8")) for d in docs)
    if cfg.corpus:
        corpus_desc = f"{len(docs)} *.py files ({num_bytes} bytes) from {', '.join(str(p) for p in paths)}"
    else:
        corpus_desc = (
            f"CPython {platform.python_version()} standard library, *.py without test dirs: "
            f"{len(docs)} files, {num_bytes} bytes"
        )
    print(f"[train-pair] corpus: {corpus_desc}")

    tokenizer = train_tokenizer(docs, cfg.vocab_size, cfg.max_position_embeddings)
    tokens = tokenize_corpus(tokenizer, docs)
    train_tokens, heldout_tokens = split_heldout(tokens, cfg.heldout_fraction, cfg.seq_len)
    print(
        f"[train-pair] tokens: {len(train_tokens)} train, {len(heldout_tokens)} held out "
        f"({num_bytes / len(tokens):.2f} bytes/token)"
    )

    models, stats = {}, {}
    for offset, (name, size, minutes) in enumerate(
        [("target", cfg.target, cfg.target_minutes), ("draft", cfg.draft, cfg.draft_minutes)]
    ):
        model = build_model(
            size, len(tokenizer), cfg.max_position_embeddings, tokenizer.eos_token_id, cfg.seed + offset
        )
        peak_lr = peak_lr_for_width(cfg.lr, cfg.target.hidden_size, size.hidden_size)
        stats[name] = {
            "params": sum(p.numel() for p in model.parameters()),
            **asdict(size),
            "peak_lr": peak_lr,
        }
        stats[name].update(
            train_model(model, train_tokens, cfg, peak_lr, minutes, cfg.seed + offset, desc=name)
        )
        round_to_bf16(model)
        models[name] = model

    inputs, labels = eval_windows(heldout_tokens, cfg.seq_len, cfg.max_eval_tokens)
    metrics = evaluate(models, inputs, labels, cfg.batch_size)

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    for name, model in models.items():
        model_dir = cfg.out_dir / name
        model.to(torch.bfloat16)
        model.config.dtype = "bfloat16"
        # safetensors: the only format in transformers 5, the default in 4.x.
        model.save_pretrained(model_dir)
        save_tokenizer(tokenizer, model_dir)
        stats[name]["heldout_loss"] = metrics[f"{name}_loss"]

    prompt = "def fibonacci(n):"
    report = {
        "corpus": corpus_desc,
        "vocab_size": len(tokenizer),
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "threads": cfg.threads,
        "num_train_tokens_available": int(len(train_tokens)),
        "num_heldout_tokens_evaluated": int(labels.numel()),
        "uniform_loss": round(math.log(len(tokenizer)), 4),
        "target": stats["target"],
        "draft": stats["draft"],
        "heldout_top1_agreement": metrics["top1_agreement"],
        "samples": {name: greedy_sample(cfg.out_dir / name, prompt, 40) for name in models},
        "total_minutes": round((time.perf_counter() - t_start) / 60.0, 2),
    }
    (cfg.out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


# (flag, TrainPairConfig field, type, help); the default comes from TrainPairConfig, so it is defined once.
_SCALAR_OPTIONS = (
    ("--vocab-size", "vocab_size", int, f"byte-level BPE vocabulary size, including {EOS_TOKEN}"),
    ("--seq-len", "seq_len", int, "training window length in tokens"),
    ("--target-minutes", "target_minutes", float, "wall-clock training budget of the target model"),
    ("--draft-minutes", "draft_minutes", float, "wall-clock training budget of the draft model"),
    ("--batch-size", "batch_size", int, "windows per optimizer step"),
    (
        "--lr",
        "lr",
        float,
        "peak AdamW learning rate of the target (the draft's is scaled by "
        "target/draft hidden size); linear warmup then cosine decay",
    ),
    ("--seed", "seed", int, "seed for file order, model init and batch sampling"),
    ("--max-corpus-bytes", "max_corpus_bytes", int, "read at most this many bytes of source"),
    ("--threads", "threads", int, "CPU threads for torch and the tokenizer"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TrainPairConfig(out_dir=Path("."))
    parser.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="DIR",
        help="output directory; receives target/, draft/ and report.json",
    )
    parser.add_argument(
        "--corpus",
        nargs="+",
        type=Path,
        default=None,
        metavar="PATH",
        help="Python files or directories (searched recursively for *.py, skipping test dirs "
        "and site-packages); default: the running interpreter's standard library",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="optional step cap per model; training stops at the time budget or the cap, "
        "whichever comes first (default: no cap)",
    )
    for flag, dest, type_, help_ in _SCALAR_OPTIONS:
        parser.add_argument(
            flag,
            dest=dest,
            type=type_,
            default=getattr(defaults, dest),
            help=f"{help_} (default: %(default)s)",
        )


def config_from_args(args: argparse.Namespace) -> TrainPairConfig:
    return TrainPairConfig(
        out_dir=args.out,
        corpus=tuple(args.corpus or ()),
        max_steps=args.max_steps,
        **{dest: getattr(args, dest) for _, dest, _, _ in _SCALAR_OPTIONS},
    )


def run(args: argparse.Namespace) -> int:
    report = train_pair(config_from_args(args))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="specmesh train-pair", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
