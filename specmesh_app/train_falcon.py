"""`specmesh train-falcon`: train a Falcon SAR draft head (``drafter_service/falcon_head.py``) for a target.

Pipeline, one pure function per step:
    corpus (files / JSONL, as `specmesh ingest` reads them) -> ``corpus_sequences`` (tokenized windows of
    ``seq_len``; 1 in 20 files held out) -> ``dump_features`` (the target's final-layer features of every
    position, bf16, cached in WORK/features.pt; WORK defaults to OUT-work beside OUT) -> ``csgd_loss`` per batch -> ``evaluate`` (held-out loss and
    per-slot agreement with the target's argmax) -> ``save_head`` (config.json + model.safetensors).

Coupled Sequential Glancing Distillation (CSGD), per batch at epoch e of E (``csgd_loss``):
    inputs at position j: [f[j-1] + U(-0.1, 0.1) noise; embed(x[j])], rows in blocks of k (the relaxed mask);
    row j is trained to give the target's feature f[j-1+k] and its token Y[j+k] = argmax lm_head(f[j-1+k]);
    1. a first pass (no gradient) predicts Ŷ;
    2. per sequence, N = round(λ · Hamming(Y, Ŷ)) over its rows, λ = 0.4 · (E - e) / E;
    3. glancing: in randomly chosen blocks, a run of consecutive rows from the block's start (at most k-1, so
       every block keeps a row to predict) gets, instead of its own input, the target's feature and token of
       the position it predicts (f[j-1+k], Y[j+k]) — the reference implementation's reading of "the N
       consecutive tokens and features preceding the positions to predict are replaced by the target's" —,
       N rows per sequence in all; glanced rows are left out of the loss (they see their answer);
    4. the second pass gives L = SmoothL1(out, f) + 0.1 · (0.9 · KL(p_target ‖ p_draft) + 0.1 · CE(p_draft, Y)).
``--no-glancing`` trains the plain SAR head (one pass, N = 0); ``--k 1`` the EAGLE-like head.
``--draft-vocab N``: the head drafts from the N most frequent tokens of the training windows (``draft_vocabulary``);
its KL is to the target's distribution restricted to them (renormalised) and its CE counts the rows whose Y is
among them; agreement is always with the target's own argmax (a Y outside the vocabulary is a miss).

A checkpoint (head, optimizer, epoch, step, RNG) is written every ``--checkpoint-every`` steps and at every
epoch's end in WORK/checkpoint.pt; rerunning the command resumes from it (the features are reused).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from drafter_service.falcon_head import (
    SUPPORTED_K,
    FalconConfig,
    FalconHead,
    TargetTables,
    save_head,
    target_tables,
)
from drafter_service.ingest import DEFAULT_GLOBS, corpus_files, documents
from specmesh.atomic_io import atomic_write

GLANCE_START = 0.4  # λ at the first epoch, falling linearly to 0 (the schedule)
NOISE = 0.1  # U(-NOISE, NOISE) on input features
FEATURE_FILE = "features.pt"
CHECKPOINT_FILE = "checkpoint.pt"


@dataclass(frozen=True)
class FalconTrainConfig:
    target: Path
    out_dir: Path
    corpus: tuple[Path, ...]
    jsonl_field: str = "text"
    exclude: tuple[str, ...] = ()  # corpus files to leave out (paths relative to a corpus directory, or names)
    k: int = 2
    glancing: bool = True
    seq_len: int = 256
    num_seqs: int = 512  # training windows dumped (features: num_seqs x seq_len x hidden, bf16)
    heldout_seqs: int = 16
    epochs: int = 4
    batch_size: int = 4
    lr: float = 3e-4
    intermediate: int | None = None  # the head's MLP width (default: the target's)
    minutes: float | None = None  # stop (and save) after this long, wherever training is
    checkpoint_every: int = 100
    seed: int = 0
    threads: int = 1
    work_dir: Path | None = None  # features cache and checkpoint (default: OUT's sibling OUT-work)
    draft_vocab: int = 0  # the head drafts from the N most frequent tokens of the training windows (0: all)

    @property
    def glances(self) -> bool:
        """CSGD's glancing runs: asked for, and k > 1 (a block of one keeps its one row to predict)."""
        return self.glancing and self.k > 1

    @property
    def work(self) -> Path:
        return self.work_dir if self.work_dir is not None else self.out_dir.with_name(self.out_dir.name + "-work")

    def __post_init__(self) -> None:
        if self.k not in SUPPORTED_K:
            raise ValueError(f"k must be one of {SUPPORTED_K}, got {self.k}")
        if self.seq_len < 2 * self.k + 2 or self.num_seqs < 1 or self.epochs < 1 or self.batch_size < 1:
            raise ValueError("seq_len >= 2k + 2, num_seqs >= 1, epochs >= 1 and batch_size >= 1")
        if self.draft_vocab < 0:
            raise ValueError("draft_vocab must be 0 (the whole vocabulary) or a number of tokens")


# ------------------------------------------------------------------------------------------- the data
def corpus_sequences(files: list[Path], encode, seq_len: int, num_seqs: int, heldout: int, jsonl_field: str,
                     seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train [num_seqs, seq_len], heldout [heldout, seq_len]) token windows; 1 in 20 files (at least one) is
    kept for the held-out windows, so they come from text never trained on."""
    rng = random.Random(seed)
    files = list(files)
    rng.shuffle(files)
    held = files[: max(1, len(files) // 20)] if len(files) > 1 else []
    out = []
    for group, want in ((files[len(held):], num_seqs), (held or files, heldout)):
        windows: list[np.ndarray] = []
        for path in group:
            for text in documents(path, jsonl_field):
                ids = np.asarray(encode(text), np.int64)
                windows += [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
            if len(windows) >= 4 * want:
                break
        if not windows:
            raise ValueError(f"the corpus has no text of {seq_len} tokens or more")
        rng.shuffle(windows)
        out.append(np.stack(windows[:want]))
    return out[0], out[1]


@torch.inference_mode()
def dump_features(runner, seqs: np.ndarray, progress: bool = True) -> torch.Tensor:
    """The target's final-layer features (what its LM head reads) of every position, [N, T, H] bfloat16."""
    rows = []
    for seq in tqdm(seqs, desc="[train-falcon] target features", unit="seq", disable=not progress):
        cache = runner.new_cache()
        _, hidden = runner.forward_batch([cache], seq, np.arange(len(seq)), [len(seq)], [None], slice(0, 0),
                                         torch.arange(len(seq), device=runner.device))
        rows.append(hidden.to(torch.bfloat16).cpu())
    return torch.stack(rows)


# ------------------------------------------------------------------------------------------- the loss
def glance_lambda(epoch: float, epochs: int) -> float:
    """λ = 0.4 · (E − e) / E, with e the (fractional) epochs done: it falls step by step, so that a run of one
    epoch, or one stopped by ``--minutes``, still anneals the glancing rate."""
    return GLANCE_START * max(0.0, epochs - epoch) / epochs


def glanced_rows(hamming: list[int], num_rows: int, k: int, lam: float, gen: random.Random) -> list[list[int]]:
    """Per sequence, the rows whose inputs are replaced: N = round(lam * hamming) rows, as runs of up to k-1
    consecutive rows from the start of randomly chosen blocks (within the first ``num_rows`` rows)."""
    out = []
    blocks = list(range(0, num_rows - k + 1, k))
    for h in hamming:
        want, rows = round(lam * h), []
        if k > 1 and want:
            for start in gen.sample(blocks, len(blocks)):
                run = min(k - 1, want - len(rows))
                rows += range(start, start + run)
                if len(rows) >= want:
                    break
        out.append(rows)
    return out


def csgd_loss(head: FalconHead, feats: torch.Tensor, ids: torch.Tensor, lam: float, glancing: bool,
              gen: random.Random, noise: float = NOISE) -> tuple[torch.Tensor, dict]:
    """One batch's CSGD loss. feats: [B, T, H] target features, ids: [B, T] tokens. Returns (loss, stats)."""
    k = head.config.k
    batch, length, hidden = feats.shape
    feats = feats.float()
    prev = torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], dim=1)  # row j: f[j-1]
    prev = prev + (torch.rand_like(prev) * 2 - 1) * noise
    rows = length - k  # rows j = 0..T-k-1 have a target (f[j-1+k], x[j+k]); f[-1] is never a target
    target_f = feats[:, k - 1 : k - 1 + rows]  # [B, rows, H]
    with torch.no_grad():
        target_logits = head.target_logits(target_f)
        target_y = target_logits.argmax(-1)  # Y: the target's tokens
        if head.vocab_ids is not None:  # a reduced head: the target's distribution over the head's vocabulary
            target_logits = target_logits[..., head.vocab_ids]
        target_p = torch.softmax(target_logits, dim=-1)
        draft_y = head.to_draft(target_y)  # Y's index in the head's vocabulary (-1: outside it)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[:, rows:] = False
    n_glanced = 0
    if glancing and lam > 0 and k > 1:
        with torch.no_grad():
            first = head(prev, ids)[:, :rows]
            hamming = (head.to_target(head.logits(first).argmax(-1)) != target_y).sum(dim=1).tolist()
        prev, ids = prev.clone(), ids.clone()
        for b, glanced in enumerate(glanced_rows(hamming, rows, k, lam, gen)):
            if glanced:
                g = torch.tensor(glanced)
                prev[b, g] = target_f[b, g]  # the feature and token of the position the row predicts
                ids[b, g] = target_y[b, g]
                valid[b, g] = False
                n_glanced += len(glanced)
    out = head(prev, ids)[:, :rows]
    mask = valid[:, :rows]
    logits = head.logits(out)
    logq = torch.log_softmax(logits, dim=-1)
    feat_loss = F.smooth_l1_loss(out, target_f, reduction="none").mean(-1)
    kl = (target_p * (torch.log(target_p.clamp_min(1e-12)) - logq)).sum(-1)
    ce = F.cross_entropy(logq.reshape(-1, logq.shape[-1]), draft_y.reshape(-1), reduction="none",
                         ignore_index=-1).view_as(kl)
    per_row = feat_loss + 0.1 * (0.9 * kl + 0.1 * ce)
    denom = mask.sum().clamp_min(1)
    loss = (per_row * mask).sum() / denom
    with torch.no_grad():
        agree = ((head.to_target(logits.argmax(-1)) == target_y) & mask).sum().item() / float(denom)
    with torch.no_grad():
        stats = {"loss": loss.item(), "feature": float((feat_loss * mask).sum() / denom),
                 "kl": float((kl * mask).sum() / denom), "agree": agree, "glanced": n_glanced}
    return loss, stats


@torch.no_grad()
def evaluate(head: FalconHead, feats: torch.Tensor, ids: torch.Tensor) -> dict:
    """Held-out loss (no glancing, no noise) and per-slot agreement with the target's argmax: slot s of a block
    is row s within the block of k (slot 0 drafts the first token of a block, slot k-1 the last)."""
    head.eval()
    loss, stats = csgd_loss(head, feats, ids, 0.0, False, random.Random(0), noise=0.0)
    k = head.config.k
    rows = feats.shape[1] - k
    out = head(torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], dim=1).float(), ids)[:, :rows]
    target_y = head.target_logits(feats[:, k - 1 : k - 1 + rows].float()).argmax(-1)
    agree = head.to_target(head.logits(out).argmax(-1)) == target_y
    slots = [float(agree[:, s::k].float().mean()) for s in range(k)]
    coverage = float((head.to_draft(target_y) >= 0).float().mean())  # the target's argmax within the vocabulary
    return {"heldout_loss": float(loss), "agree": stats["agree"], "agree_per_slot": slots, "vocab_coverage": coverage}


def draft_vocabulary(ids: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``ids`` (any shape), ascending ids; ties (and tokens never seen, to
    fill up) go to the lower id."""
    counts = torch.bincount(ids.flatten().long(), minlength=vocab_size)
    return torch.argsort(-counts, stable=True)[:size].sort().values  # stable: equal counts keep id order


# ------------------------------------------------------------------------------------------- training
def _encode(tokenizer):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def _features(cfg: FalconTrainConfig, runner, tokenizer) -> dict:
    """Windows and their target features, from OUT/features.pt when it holds the same configuration."""
    path = cfg.work / FEATURE_FILE
    key = {"target": str(cfg.target), "corpus": [str(p) for p in cfg.corpus], "exclude": list(cfg.exclude),
           "seq_len": cfg.seq_len, "num_seqs": cfg.num_seqs, "heldout": cfg.heldout_seqs, "seed": cfg.seed}
    if path.exists():
        data = torch.load(path, weights_only=False)
        if data.get("key") == key:
            print(f"[train-falcon] features: reusing {path}")
            return data
    files = [f for f in corpus_files(list(cfg.corpus), DEFAULT_GLOBS) if not _excluded(f, cfg)]
    if not files:
        raise ValueError("no corpus files left (check the paths and --exclude)")
    train, held = corpus_sequences(files, _encode(tokenizer), cfg.seq_len, cfg.num_seqs, cfg.heldout_seqs,
                                   cfg.jsonl_field, cfg.seed)
    print(f"[train-falcon] corpus: {len(files)} files -> {len(train)} training and {len(held)} held-out windows "
          f"of {cfg.seq_len} tokens")
    start = time.perf_counter()
    data = {"key": key, "train_ids": torch.from_numpy(train), "held_ids": torch.from_numpy(held),
            "train_feats": dump_features(runner, train), "held_feats": dump_features(runner, held, progress=False)}
    data["dump_seconds"] = time.perf_counter() - start
    cfg.work.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:  # a cut-short write never passes for a cache to reuse
        torch.save(data, f)
    return data


def _excluded(path: Path, cfg: FalconTrainConfig) -> bool:
    posix = path.as_posix()
    return any(posix.endswith("/" + e) or posix == e for e in cfg.exclude)


def train_falcon(cfg: FalconTrainConfig, runner=None, tokenizer=None, progress: bool = True) -> dict:
    """Train and save a head; returns the report (also in the head's config.json under ``training``).
    ``runner`` / ``tokenizer``: an already loaded target (tests); by default loaded from ``cfg.target``."""
    torch.set_num_threads(cfg.threads)
    if runner is None:
        from specmesh import models

        runner = models.load_runner(cfg.target, torch.float32, "auto", "cpu", "sdpa", hf_module=True)
        tokenizer = models.load_tokenizer(cfg.target)
    tables: TargetTables = target_tables(runner).to(torch.float32)
    data = _features(cfg, runner, tokenizer)
    torch.manual_seed(cfg.seed)
    if cfg.draft_vocab > tables.vocab_size:
        raise ValueError(f"--draft-vocab {cfg.draft_vocab} is larger than the target's vocabulary ({tables.vocab_size})")
    draft_vocab = 0 if cfg.draft_vocab == tables.vocab_size else cfg.draft_vocab
    head_cfg = FalconConfig.for_target(tables, cfg.k, glancing=cfg.glances, draft_vocab=draft_vocab,
                                       intermediate_size=cfg.intermediate or _intermediate(runner))
    head = FalconHead(head_cfg)
    if draft_vocab:
        head.set_vocab(draft_vocabulary(data["train_ids"], tables.vocab_size, draft_vocab))
    head.attach(tables)
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95))
    n = len(data["train_ids"])
    steps_per_epoch = math.ceil(n / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    state = {"epoch": 0, "step": 0, "seconds": 0.0, "losses": []}
    ckpt = cfg.work / CHECKPOINT_FILE
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        if saved.get("config") == asdict(head_cfg):
            head.load_state_dict(saved["head"])
            optimizer.load_state_dict(saved["optimizer"])
            state = saved["state"]
            torch.set_rng_state(saved["torch_rng"])
            print(f"[train-falcon] resuming at epoch {state['epoch']}, step {state['step']} of {total}")
    before = evaluate(head, data["held_feats"], data["held_ids"]) if state["step"] == 0 else state.get("before")
    state["before"] = before
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / total),
                                                 last_epoch=state["step"] - 1)
    gen = random.Random(cfg.seed + state["step"])
    started = time.perf_counter() - state["seconds"]
    deadline = None if cfg.minutes is None else started + 60 * cfg.minutes
    bar = tqdm(total=total, initial=state["step"], desc=f"[train-falcon] k={cfg.k} "
               f"{'CSGD' if cfg.glances else 'plain SAR'}", unit="step", disable=not progress)
    stopped = False
    while state["epoch"] < cfg.epochs and not stopped:
        epoch = state["epoch"]
        order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        head.train()
        for b in range(state["step"] - epoch * steps_per_epoch, steps_per_epoch):
            pick = order[b * cfg.batch_size : (b + 1) * cfg.batch_size]
            lam = glance_lambda(state["step"] / steps_per_epoch, cfg.epochs)
            loss, stats = csgd_loss(head, data["train_feats"][pick], data["train_ids"][pick], lam, cfg.glances, gen)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            state["step"] += 1
            state["losses"].append(stats["loss"])
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", agree=f"{stats['agree']:.2f}", lam=f"{lam:.2f}")
            state["seconds"] = time.perf_counter() - started
            if cfg.checkpoint_every and state["step"] % cfg.checkpoint_every == 0:
                _checkpoint(ckpt, head, head_cfg, optimizer, state)
            if deadline is not None and time.perf_counter() > deadline:
                stopped = True
                break
        else:
            state["epoch"] += 1
            _checkpoint(ckpt, head, head_cfg, optimizer, state)
    bar.close()
    after = evaluate(head, data["held_feats"], data["held_ids"])
    report = {"steps": state["step"], "epochs_done": state["epoch"], "stopped_by_time": stopped,
              "train_minutes": round(state["seconds"] / 60, 2), "dump_seconds": round(data.get("dump_seconds", 0.0), 1),
              "windows": n, "seq_len": cfg.seq_len, "lr": cfg.lr, "batch_size": cfg.batch_size,
              "draft_vocab": draft_vocab or tables.vocab_size,
              "before": before, "after": after, "first_losses": state["losses"][:5],
              "last_losses": state["losses"][-5:], "target": str(cfg.target)}
    save_head(head, cfg.out_dir, extra={"training": report})
    _checkpoint(ckpt, head, head_cfg, optimizer, state)
    return report


def _intermediate(runner) -> int:
    return int(getattr(runner.model.config, "intermediate_size", 4 * runner.model.config.hidden_size))


def _checkpoint(path: Path, head: FalconHead, head_cfg: FalconConfig, optimizer, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        torch.save({"config": asdict(head_cfg), "head": head.state_dict(), "optimizer": optimizer.state_dict(),
                    "state": state, "torch_rng": torch.get_rng_state()}, f)


# ------------------------------------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    d = FalconTrainConfig(Path("."), Path("."), ())
    p.add_argument("--target", type=Path, required=True, help="the target model (a local Hugging Face directory)")
    p.add_argument("--out", type=Path, required=True,
                   help="where to save the head (a folder whose name says falcon, e.g. heads/stdlib-code-falcon)")
    p.add_argument("corpus", type=Path, nargs="+", metavar="PATH",
                   help="files or directories (.py/.md/.rst/.txt/.jsonl, as `specmesh ingest` reads them); 1 in 20 "
                        "files is held out for evaluation")
    p.add_argument("--jsonl-field", default=d.jsonl_field, help="the text field of .jsonl lines (default: text)")
    p.add_argument("--exclude", nargs="*", default=[], metavar="FILE",
                   help="corpus files to leave out (paths relative to a corpus directory, e.g. a held-out split)")
    p.add_argument("--exclude-split", type=Path, default=None, metavar="SPLIT_JSON",
                   help="a split.json whose 'heldout' list is left out (as ../shared/models/stdlib-code/split.json)")
    p.add_argument("--k", type=int, default=d.k, choices=SUPPORTED_K, help="tokens per block (default: 2; 1 = EAGLE-like)")
    p.add_argument("--no-glancing", action="store_true", help="train a plain SAR head (no CSGD)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help=f"tokens per training window (default: {d.seq_len})")
    p.add_argument("--num-seqs", type=int, default=d.num_seqs, help=f"training windows (default: {d.num_seqs})")
    p.add_argument("--heldout-seqs", type=int, default=d.heldout_seqs,
                   help=f"held-out windows for evaluation (default: {d.heldout_seqs})")
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"epochs (default: {d.epochs}; λ falls over them)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"windows per step (default: {d.batch_size})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"AdamW peak learning rate (default: {d.lr})")
    p.add_argument("--intermediate", type=int, default=None, help="the head's MLP width (default: the target's)")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab, metavar="N",
                   help="draft from the N most frequent tokens of the training windows only (EAGLE-3's reduced "
                        "vocabulary: the head's LM head is N rows of the target's, every other token gets draft "
                        "probability 0, still lossless); default 0: the target's whole vocabulary")
    p.add_argument("--minutes", type=float, default=None, help="stop and save after this long (default: no limit)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help=f"steps between resumable checkpoints in WORK/{CHECKPOINT_FILE} (default: {d.checkpoint_every})")
    p.add_argument("--work", type=Path, default=None,
                   help="features cache and resumable checkpoint (default: OUT-work, beside OUT)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (default: 1)")


def run(args: argparse.Namespace) -> int:
    exclude = list(args.exclude)
    try:
        if args.exclude_split is not None:
            exclude += json.loads(args.exclude_split.read_text())["heldout"]
        cfg = FalconTrainConfig(args.target, args.out, tuple(args.corpus), args.jsonl_field, tuple(exclude), args.k,
                                not args.no_glancing, args.seq_len, args.num_seqs, args.heldout_seqs, args.epochs,
                                args.batch_size, args.lr, args.intermediate, args.minutes, args.checkpoint_every,
                                args.seed, args.threads, args.work, args.draft_vocab)
        report = train_falcon(cfg)
    except (ValueError, FileNotFoundError, OSError, KeyError) as exc:
        raise SystemExit(f"specmesh train-falcon: {exc}") from None
    b, a = report["before"], report["after"]
    print(f"Falcon head (k={cfg.k}, {'CSGD' if cfg.glances else 'plain SAR'}) for {cfg.target} -> {cfg.out_dir} "
          f"({report['steps']} steps, {report['train_minutes']} min)")
    print(f"held-out loss {b['heldout_loss']:.3f} -> {a['heldout_loss']:.3f}; agreement with the target's argmax "
          f"per slot {[round(x, 3) for x in a['agree_per_slot']]}"
          + (f"; draft vocabulary {report['draft_vocab']} tokens holds {a['vocab_coverage']:.3f} of the target's "
             "argmax tokens" if cfg.draft_vocab else ""))
    return 0 if math.isfinite(a["heldout_loss"]) else 1
