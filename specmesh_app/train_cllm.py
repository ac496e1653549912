"""`specmesh train-cllm`: fine-tune a copy of a target into a consistency LLM (CLLM, Kou et al., 2024).

Jacobi decoding guesses an n-token block after the context and iterates y <- argmax p(. | x, y) on all n
positions at once until y stops changing; the fixed point y* is exactly the greedy continuation. A plain
model rarely gets more than one position right per iteration. A CLLM is trained so that from *any* point of
a Jacobi trajectory it predicts the fixed point, so the iteration converges in fewer steps: more tokens per
forward under the `jacobi` proposer.

Pipeline, one pure function per step:
    prompts (corpus windows) -> jacobi_trajectory (the base model's states y_0..y_k and fixed point y*)
    -> train: global consistency loss + AR loss -> evaluate (held-out loss, tokens per Jacobi step)
    -> save (a model directory, labelled as a CLLM of its base).

Losses per example (x, y_j, y*):
    consistency  KL( p(. | x, y*) [fixed, no gradient] || p_theta(. | x, y_j) ) over the block's n positions:
                 any trajectory state maps to the fixed point's predictions (CLLM's global consistency loss);
    AR           next-token cross-entropy on corpus text: the window the context came from, as long as
                 x + y* (``--ar-on corpus``, the default; CLLM uses the dataset's ground truth), or on x + y*
                 itself (``--ar-on model``: the base model's own greedy text, which loops on a small model
                 and overfits); it keeps the model's language modelling;
    loss = consistency + ar_weight * AR.

The loss is batched: examples whose contexts have the same length share one forward per term.

A CLLM is a different model from its base: its greedy output differs. Every table must say which one ran.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from drafter_service.ingest import DEFAULT_GLOBS, corpus_files, documents
from specmesh.atomic_io import atomic_write

AR_TEXTS = ("corpus", "model")


@dataclass(frozen=True)
class CllmConfig:
    base: Path  # the model to fine-tune (a local Hugging Face directory)
    out_dir: Path
    corpus: tuple[Path, ...]  # files, directories (as `specmesh ingest` reads them) or JSONL
    jsonl_field: str = "text"
    block: int = 16  # n: tokens per Jacobi block
    prompt_len: int = 64  # context tokens before the first block
    blocks_per_prompt: int = 2  # consecutive blocks collected after each context
    num_prompts: int = 256
    heldout_prompts: int = 16  # evaluation contexts, drawn from files not used for training
    minutes: float = 10.0
    max_steps: int | None = None
    batch_size: int = 8
    lr: float = 5e-5
    ar_weight: float = 1.0
    ar_on: str = "corpus"  # the AR loss's text: "corpus" (ground truth) or "model" (the fixed points)
    checkpoint_every: int = 200  # steps; 0 = only at the end
    seed: int = 0
    threads: int = 1

    def __post_init__(self) -> None:
        if self.block < 2 or self.prompt_len < 1 or self.num_prompts < 1 or self.blocks_per_prompt < 1:
            raise ValueError("block >= 2, prompt_len >= 1, num_prompts >= 1 and blocks_per_prompt >= 1")
        if self.ar_on not in AR_TEXTS:
            raise ValueError(f"ar_on must be one of {', '.join(AR_TEXTS)}, got {self.ar_on!r}")

    @property
    def window_len(self) -> int:
        """Corpus tokens a training window holds: the context and the text after it for every block."""
        return self.prompt_len + self.blocks_per_prompt * self.block


# ----------------------------------------------------------------------------- data
def context_windows(token_docs: list[list[int]], prompt_len: int, count: int, rng: np.random.Generator
                    ) -> list[list[int]]:
    """Up to ``count`` random ``prompt_len``-token windows, from documents long enough to hold one."""
    usable = [d for d in token_docs if len(d) >= prompt_len]
    if not usable:
        raise ValueError(f"no document of the corpus has {prompt_len} tokens (--prompt-len)")
    out = []
    for _ in range(count):
        doc = usable[int(rng.integers(len(usable)))]
        start = int(rng.integers(len(doc) - prompt_len + 1))
        out.append(doc[start:start + prompt_len])
    return out


@torch.no_grad()
def block_predictions(model, context: torch.Tensor, guess: torch.Tensor) -> torch.Tensor:
    """[n] the model's greedy prediction for each block position given the context and the guesses before it:
    one Jacobi iteration. context: [L] ids; guess: [n] ids."""
    ids = torch.cat([context, guess]).unsqueeze(0)
    logits = model(input_ids=ids).logits[0]  # [L + n, V]
    return logits[context.shape[0] - 1: -1].argmax(-1)  # the rows before each block position


def jacobi_trajectory(model, context: torch.Tensor, init: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Iterate from ``init`` ([n]) to the fixed point: (the states before it, the fixed point). At most n
    iterations (each fixes at least one more leading position)."""
    states, guess = [], init
    for _ in range(init.shape[0] + 1):
        nxt = block_predictions(model, context, guess)
        if torch.equal(nxt, guess):
            return states, guess
        states.append(guess)
        guess = nxt
    return states, guess  # (unreachable for greedy argmax; kept total)


def jacobi_decode(model, context: torch.Tensor, n: int, max_new: int, rng: np.random.Generator
                  ) -> tuple[list[int], int]:
    """Jacobi decoding of ``max_new`` tokens with a window of ``n`` guesses, committing after each iteration
    the converged prefix plus the one token every iteration fixes, as the `jacobi` proposer does (its tail
    filled with random context tokens): (the tokens, which are the greedy continuation; forwards run)."""
    produced: list[int] = []
    forwards = 0
    guess = torch.as_tensor(rng.choice(context.numpy(), size=n))
    while len(produced) < max_new:
        nxt = block_predictions(model, context, guess)
        forwards += 1
        # nxt[0] is right; nxt[i] is right when every guess before it was (guess[j] == nxt[j], j < i)
        keep = min(1 + int((guess[:-1] == nxt[:-1]).long().cumprod(0).sum()), max_new - len(produced))
        context = torch.cat([context, nxt[:keep]])
        produced += nxt[:keep].tolist()
        guess = torch.cat([nxt[keep:], torch.as_tensor(rng.choice(context.numpy(), size=keep))])
    return produced, forwards


@dataclass
class Example:
    context: torch.Tensor  # [L]
    states: list[torch.Tensor]  # [n] each: trajectory points before the fixed point
    fixed: torch.Tensor  # [n]
    truth: torch.Tensor | None = None  # [L + n] corpus text for the AR loss; None = the context + fixed point


def collect(model, windows: list[list[int]], cfg: CllmConfig, rng: np.random.Generator) -> list[Example]:
    """Jacobi trajectories of the base model after each window's first ``prompt_len`` tokens,
    ``blocks_per_prompt`` consecutive blocks (each next context = the last one + its fixed point); blocks that
    converge at once teach nothing. With ``ar_on == "corpus"`` an example keeps the window's text as long as
    its context + block (when the window has it) for the AR loss."""
    out = []
    for ids in tqdm(windows, desc="trajectories", unit="prompt", dynamic_ncols=True):
        context = torch.tensor(ids[: cfg.prompt_len])
        for _ in range(cfg.blocks_per_prompt):
            init = torch.as_tensor(rng.choice(context.numpy(), size=cfg.block))  # random tokens of the context
            states, fixed = jacobi_trajectory(model, context, init)
            span = context.shape[0] + cfg.block
            truth = torch.tensor(ids[:span]) if cfg.ar_on == "corpus" and len(ids) >= span else None
            if states:
                out.append(Example(context, states, fixed, truth))
            context = torch.cat([context, fixed])
    return out


# ----------------------------------------------------------------------------- training
def cllm_loss(model, examples: list[Example], rng: np.random.Generator, ar_weight: float
              ) -> tuple[torch.Tensor, float, float]:
    """(loss, consistency, AR) of one batch: for each example one trajectory state drawn uniformly. Examples
    whose contexts have the same length are stacked: two forwards per group (fixed point, state), a third for
    the AR loss on corpus text when the group has it (else the AR loss reads the fixed point's forward)."""
    states = [ex.states[int(rng.integers(len(ex.states)))] for ex in examples]
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault((ex.context.shape[0], ex.truth is not None), []).append(i)
    consistency, ar = torch.zeros(()), torch.zeros(())
    for (length, has_truth), members in groups.items():
        start, n = length - 1, examples[members[0]].fixed.shape[0]  # row start predicts the block's first position
        fixed_ids = torch.stack([torch.cat([examples[i].context, examples[i].fixed]) for i in members])  # [B, L+n]
        state_ids = torch.stack([torch.cat([examples[i].context, states[i]]) for i in members])  # [B, L+n]
        fixed_logits = model(input_ids=fixed_ids).logits  # [B, L + n, V]
        target = F.log_softmax(fixed_logits[:, start:start + n].detach(), -1)  # [B, n, V]
        noisy = F.log_softmax(model(input_ids=state_ids).logits[:, start:start + n], -1)
        kl = F.kl_div(noisy, target, log_target=True, reduction="none").sum(-1).mean(-1)  # [B]: per example
        consistency = consistency + kl.sum()
        if has_truth:
            truth = torch.stack([examples[i].truth for i in members])  # [B, L + n]
            ar_logits = model(input_ids=truth).logits
        else:
            truth, ar_logits = fixed_ids, fixed_logits
        ce = F.cross_entropy(ar_logits[:, :-1].flatten(0, 1), truth[:, 1:].flatten(), reduction="none")
        ar = ar + ce.view(len(members), -1).mean(-1).sum()
    c, a = consistency / len(examples), ar / len(examples)
    return c + ar_weight * a, c.item(), a.item()


def save(model, tokenizer_dir: Path, out_dir: Path, report: dict) -> None:
    """The model directory: weights, config, the base's tokenizer files, and cllm.json (what it is)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tokenizer_dir / name).is_file() and not (out_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    (out_dir / "cllm.json").write_text(json.dumps(report, indent=2, default=str) + "\n")


def heldout_loss(model, contexts: list[list[int]]) -> float:
    """Mean next-token cross-entropy (nats) over held-out windows."""
    with torch.no_grad():
        losses = [F.cross_entropy(model(input_ids=torch.tensor([c])).logits[0, :-1], torch.tensor(c[1:])).item()
                  for c in contexts]
    return float(np.mean(losses))


def evaluate(model, heldout: list[list[int]], cfg: CllmConfig) -> dict:
    rng = np.random.default_rng(cfg.seed + 1)
    half = cfg.prompt_len // 2  # contexts for Jacobi decoding; the whole window for the loss
    runs = [jacobi_decode(model, torch.tensor(c[:half]), cfg.block, 2 * cfg.block, rng) for c in heldout]
    tps = [len(tokens) / forwards for tokens, forwards in runs]
    return {"heldout_loss": round(heldout_loss(model, heldout), 4),
            "jacobi_tokens_per_step": round(float(np.mean(tps)), 3)}


def train_cllm(cfg: CllmConfig) -> dict:
    from transformers import AutoModelForCausalLM

    from specmesh.models import load_tokenizer

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    rng = np.random.default_rng(cfg.seed)
    tokenizer = load_tokenizer(cfg.base)
    files = corpus_files(list(cfg.corpus), DEFAULT_GLOBS)
    if not files:
        raise ValueError("the corpus has no files")
    order = rng.permutation(len(files))
    split = max(1, len(files) // 20) if len(files) > 1 else 0  # 1 in 20 files held out (none if only one)
    heldout_files, train_files = [files[i] for i in order[:split]], [files[i] for i in order[split:]]

    def tokenized(paths):
        return [tokenizer.encode(text) for p in paths for text in documents(p, cfg.jsonl_field)]

    train_docs = tokenized(train_files)
    heldout_docs = tokenized(heldout_files) or train_docs
    model = AutoModelForCausalLM.from_pretrained(cfg.base, dtype=torch.float32)
    model.eval()
    heldout = context_windows(heldout_docs, cfg.prompt_len, cfg.heldout_prompts, np.random.default_rng(cfg.seed + 2))
    before = evaluate(model, heldout, cfg)
    checkpoint = cfg.out_dir / "checkpoint.pt"
    long_docs = [d for d in train_docs if len(d) >= cfg.window_len]  # hold the text after every block
    windows = context_windows(long_docs or train_docs, cfg.window_len if long_docs else cfg.prompt_len,
                              cfg.num_prompts, rng)
    examples = collect(model, windows, cfg, rng)
    if not examples:
        raise ValueError("every Jacobi block converged at once: nothing to learn from (a longer --block?)")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    step = 0
    if checkpoint.is_file():  # resume
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, rng = state["step"], state["rng"]
    model.train()
    t0, ema = time.perf_counter(), None
    bar = tqdm(total=cfg.max_steps, initial=step, desc="cllm", unit="step", dynamic_ncols=True)
    while (cfg.max_steps is None or step < cfg.max_steps) and time.perf_counter() - t0 < cfg.minutes * 60:
        batch = [examples[int(i)] for i in rng.integers(len(examples), size=cfg.batch_size)]
        loss, consistency, ar = cllm_loss(model, batch, rng, cfg.ar_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = (consistency, ar) if ema is None else (0.95 * ema[0] + 0.05 * consistency, 0.95 * ema[1] + 0.05 * ar)
        bar.set_postfix(consistency=f"{ema[0]:.3f}", ar=f"{ema[1]:.3f}", refresh=False)
        bar.update(1)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            cfg.out_dir.mkdir(parents=True, exist_ok=True)
            with atomic_write(checkpoint) as f:  # killed mid-save, the last checkpoint still resumes
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "rng": rng}, f)
    bar.close()
    model.eval()
    after = evaluate(model, heldout, cfg)
    report = {"kind": "cllm", "base": str(cfg.base), "config": asdict(cfg), "steps": step,
              "train_minutes": round((time.perf_counter() - t0) / 60, 2), "examples": len(examples),
              "mean_trajectory_states": round(float(np.mean([len(e.states) for e in examples])), 2),
              "before": before, "after": after,
              "note": "a CLLM is a different model from its base: label it so wherever it is measured"}
    save(model, Path(cfg.base), cfg.out_dir, report)
    checkpoint.unlink(missing_ok=True)
    return report


# ----------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", type=Path, required=True, help="the model to fine-tune (a local Hugging Face directory)")
    p.add_argument("--out", type=Path, required=True,
                   help="where to save the CLLM (a model directory; name it so it says CLLM, e.g. target-cllm)")
    p.add_argument("corpus", type=Path, nargs="+", metavar="PATH",
                   help="files or directories (.py/.md/.rst/.txt/.jsonl, as `specmesh ingest` reads them); 1 in 20 "
                        "files is held out for evaluation")
    p.add_argument("--jsonl-field", default="text", help="the text field of .jsonl lines (default: text)")
    p.add_argument("--block", type=int, default=16, help="n, tokens per Jacobi block (default: 16)")
    p.add_argument("--prompt-len", type=int, default=64, help="context tokens before a block (default: 64)")
    p.add_argument("--num-prompts", type=int, default=256, help="contexts whose trajectories are collected (default: 256)")
    p.add_argument("--blocks-per-prompt", type=int, default=2, help="consecutive blocks per context (default: 2)")
    p.add_argument("--minutes", type=float, default=10.0, help="training time budget (default: 10)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (default: time only)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-5, help="AdamW learning rate (default: 5e-5)")
    p.add_argument("--ar-weight", type=float, default=1.0, help="weight of the AR loss (default: 1)")
    p.add_argument("--ar-on", choices=AR_TEXTS, default="corpus",
                   help="the AR loss's text: corpus = the text that followed each context in the corpus (ground "
                        "truth, as CLLM), model = the base model's own fixed points (default: corpus)")
    p.add_argument("--checkpoint-every", type=int, default=200,
                   help="steps between resumable checkpoints in OUT/checkpoint.pt (default: 200; 0 = none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = CllmConfig(args.base, args.out, tuple(args.corpus), args.jsonl_field, args.block, args.prompt_len,
                         args.blocks_per_prompt, args.num_prompts, minutes=args.minutes, max_steps=args.max_steps,
                         batch_size=args.batch_size, lr=args.lr, ar_weight=args.ar_weight, ar_on=args.ar_on,
                         checkpoint_every=args.checkpoint_every, seed=args.seed, threads=args.threads)
        report = train_cllm(cfg)
    except (ValueError, FileNotFoundError, OSError) as exc:
        raise SystemExit(f"specmesh train-cllm: {exc}") from None
    b, a = report["before"], report["after"]
    print(f"CLLM of {cfg.base} -> {cfg.out_dir} ({report['steps']} steps, {report['train_minutes']} min, "
          f"{report['examples']} trajectories)")
    print(f"held-out loss {b['heldout_loss']:.3f} -> {a['heldout_loss']:.3f} nats/token; Jacobi tokens per step "
          f"{b['jacobi_tokens_per_step']:.2f} -> {a['jacobi_tokens_per_step']:.2f}")
    return 0 if math.isfinite(a["heldout_loss"]) else 1
