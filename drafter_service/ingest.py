"""``specmesh ingest``: tokenize a corpus and fill an n-gram store for retrieval drafting (REST).

Files are read as UTF-8 text (undecodable bytes replaced); directories are walked for
files matching ``--glob``; JSONL files contribute one field per line. Each file (or
line) is tokenized with the model's tokenizer and its n-grams are added to the store:
Redis (every drafter replica pointed at it drafts from the corpus) or an in-memory store
saved as a snapshot file that drafters load with ``--ngram-store FILE``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

DEFAULT_GLOBS = ("*.py", "*.md", "*.rst", "*.txt", "*.jsonl")


def corpus_files(paths: Sequence[Path], globs: Sequence[str]) -> list[Path]:
    """Files named, and files under directories named that match one of ``globs``, sorted, no duplicates."""
    found: dict[Path, None] = {}
    for path in paths:
        if path.is_dir():
            for f in sorted(path.rglob("*")):
                if f.is_file() and any(fnmatch.fnmatch(f.name, g) for g in globs):
                    found[f] = None
        elif path.is_file():
            found[path] = None
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
    return list(found)


def documents(path: Path, jsonl_field: str) -> Iterator[str]:
    """A file's text; for .jsonl, the ``jsonl_field`` of every line that has it."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".jsonl":
        yield text
        return
    for line in text.splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get(jsonl_field), str):
                yield row[jsonl_field]


def ingest(files: Sequence[Path], encode, store, jsonl_field: str = "text", max_tokens: int | None = None,
           progress: bool = True) -> dict:
    """Add every document of ``files`` to ``store``; ``encode``: text -> token ids. Returns counts."""
    from tqdm import tqdm

    stats = {"files": 0, "documents": 0, "tokens": 0, "seconds": 0.0}
    start = time.perf_counter()
    bar = tqdm(files, desc="ingest", unit="file", disable=not progress, file=sys.stderr)
    for path in bar:
        for text in documents(path, jsonl_field):
            ids = encode(text)
            if max_tokens is not None:
                ids = ids[: max(0, max_tokens - stats["tokens"])]
            if not ids:
                continue
            store.add(ids)
            stats["documents"] += 1
            stats["tokens"] += len(ids)
        stats["files"] += 1
        bar.set_postfix(tokens=stats["tokens"])
        if max_tokens is not None and stats["tokens"] >= max_tokens:
            break
    stats["seconds"] = time.perf_counter() - start
    return stats


# ---------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    from drafter_service.ngram_store import StoreConfig

    d = StoreConfig()
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="files and directories to ingest")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="model directory whose tokenizer to use (default: the bundled demo target's); its "
                        "fingerprint is the store namespace, so only drafters of that vocabulary read the n-grams")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--store", metavar="URL", help="Redis URL to fill (redis://HOST:PORT/DB)")
    where.add_argument("--out", type=Path, metavar="FILE",
                       help="write an in-memory store to this snapshot file (for `--ngram-store FILE`)")
    p.add_argument("--append", action="store_true", help="with --out: add to the snapshot already in FILE")
    p.add_argument("--glob", action="append", default=None, metavar="PATTERN",
                   help=f"file name patterns taken from directories (repeatable; default: {' '.join(DEFAULT_GLOBS)})")
    p.add_argument("--jsonl-field", default="text", help="field of .jsonl lines that holds the text (default: text)")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens (default: no limit)")
    p.add_argument("--min-n", type=int, default=d.min_n, help=f"shortest context stored (default: {d.min_n})")
    p.add_argument("--max-n", type=int, default=d.max_n, help=f"longest context stored (default: {d.max_n})")
    p.add_argument("--span", type=int, default=d.span, help=f"tokens per stored continuation (default: {d.span})")
    p.add_argument("--top-n", type=int, default=d.top_n, help=f"continuations kept per context (default: {d.top_n})")
    p.add_argument("--ttl", type=int, default=d.ttl_s,
                   help="Redis: seconds a context lives after its last update, 0 = forever (default: 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from drafter_service.ngram_store import (
        MemoryNGramStore,
        RedisNGramStore,
        StoreConfig,
        tokenizer_fingerprint,
    )
    from specmesh.atomic_io import check_writable
    from specmesh.models import demo_model, load_tokenizer

    try:
        config = StoreConfig(args.min_n, args.max_n, args.span, args.top_n, args.ttl)
        files = corpus_files(args.paths, args.glob or DEFAULT_GLOBS)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"specmesh ingest: {exc}") from None
    if args.out:  # a bad path is refused now, not after the whole corpus is tokenized
        try:
            check_writable(args.out)
        except OSError as exc:
            raise SystemExit(f"specmesh ingest: --out {args.out}: {exc.strerror or exc}") from None
    if not files:
        raise SystemExit("specmesh ingest: no files to ingest")
    tokenizer = load_tokenizer(args.tokenizer or demo_model("target"))
    namespace = tokenizer_fingerprint(tokenizer.get_vocab())
    if args.store:
        store = RedisNGramStore.from_url(args.store, config, namespace, timeout_s=30.0)
    elif args.append and args.out.exists():
        try:
            store = MemoryNGramStore.load(args.out)
        except ValueError as exc:
            raise SystemExit(f"specmesh ingest: {exc}") from None
        if store.namespace != namespace or store.config != config:
            raise SystemExit(f"specmesh ingest: {args.out} was built with another tokenizer or n-gram options")
    else:
        store = MemoryNGramStore(config, namespace)

    def encode(text: str) -> list[int]:
        # a whole file is longer than the model's context; that is fine here (n-grams are cut from it), so
        # transformers' "sequence length is longer than the specified maximum" warning is not a fault
        return tokenizer(text, add_special_tokens=False, verbose=False).input_ids

    try:
        stats = ingest(files, encode, store, args.jsonl_field, args.max_tokens, progress=not args.quiet)
    except Exception as exc:  # a dead Redis, an unwritable file: one line, no traceback
        raise SystemExit(f"specmesh ingest: {type(exc).__name__}: {exc}") from None
    if args.out:
        try:  # written whole or not at all: with --append, a full disk leaves the old snapshot as it was
            store.save(args.out)
        except OSError as exc:
            raise SystemExit(f"specmesh ingest: --out {args.out}: {exc.strerror or exc} "
                             "(the file is unchanged)") from None
    where = args.store or str(args.out)
    print(f"[specmesh] ingested {stats['tokens']} tokens from {stats['documents']} documents "
          f"({stats['files']} files) into {where} (namespace {namespace}) in {stats['seconds']:.1f} s",
          file=sys.stderr)
    return 0
