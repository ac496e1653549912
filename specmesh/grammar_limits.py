"""What one request's grammar may cost a server, named once (without torch or llguidance: ``--help`` stays fast).

A grammar's spec is at most ``MAX_GRAMMAR_CHARS``, but counted repetitions expand: ``(a{1000}){1000}`` (25 bytes)
takes llguidance's default budgets 4-5 s of a core and ~200 MB on its first mask. So a server compiles a grammar
on a worker before the request is admitted (specmesh/grammar.py, ``GrammarCompiler``), under these budgets; a
grammar over one is refused (400 / INVALID_ARGUMENT) with the budget's option named.

Budgets chosen (measured on the demo tokenizer, 2-core CPU): every grammar of the structured-output tests and a
60-property nested JSON Schema compile in < 30 ms with 50,000 lexer fuel; the bomb above takes 0.5 s and ~12 MB
at 200,000 (4.3 s and ~200 MB at llguidance's 1,000,000), so the fuel default leaves legitimate grammars 4x room
and bounds a hostile one to half a second of a worker. The compile timeout bounds what the fuel does not model
(one fuel unit is ~100 ns on simple expressions but microseconds on huge ones). The cache holds compiled grammars
(each one bounded by the fuel) and refusals, so a repeated spec, good or bad, costs a dictionary lookup.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DEFAULT_LEXER_FUEL = 200_000  # llguidance's initial_lexer_fuel (its default: 1,000,000)
DEFAULT_COMPILE_TIMEOUT = 2.0  # seconds of a worker for one grammar's compile and first mask
DEFAULT_CACHE_ENTRIES = 32  # compiled grammars (and refusals) kept per server, least recently used dropped first
DEFAULT_COMPILE_WORKERS = 2  # threads compiling grammars (llguidance drops the interpreter lock meanwhile)


@dataclass(frozen=True)
class GrammarLimits:
    """``lexer_fuel``: llguidance's ``initial_lexer_fuel``, the regex derivatives its lexer may build at compile
    time and per step (memory and time grow with it); ``compile_timeout``: seconds a compile may take;
    ``cache_entries``: compiled grammars kept; ``workers``: compile threads."""

    lexer_fuel: int = DEFAULT_LEXER_FUEL
    compile_timeout: float = DEFAULT_COMPILE_TIMEOUT
    cache_entries: int = DEFAULT_CACHE_ENTRIES
    workers: int = DEFAULT_COMPILE_WORKERS

    def __post_init__(self) -> None:
        if self.lexer_fuel < 1 or self.compile_timeout <= 0 or self.cache_entries < 1 or self.workers < 1:
            raise ValueError(f"grammar limits must be positive, got {self}")


def add_grammar_limit_arguments(p: argparse.ArgumentParser) -> None:
    # a command may hand in one of its own groups: argparse deprecates groups inside groups (Python 3.11)
    g = p if isinstance(p, argparse._ArgumentGroup) else p.add_argument_group(
        "structured output budgets (per grammar; over one: 400 / INVALID_ARGUMENT)")
    g.add_argument("--grammar-lexer-fuel", type=int, default=DEFAULT_LEXER_FUEL, metavar="N",
                   help="llguidance's initial lexer fuel: regex derivatives one grammar may build (its memory and "
                        f"compile time grow with it; default: {DEFAULT_LEXER_FUEL:,})")
    g.add_argument("--grammar-compile-timeout", type=float, default=DEFAULT_COMPILE_TIMEOUT, metavar="SECONDS",
                   help=f"seconds one grammar's compile may take (default: {DEFAULT_COMPILE_TIMEOUT})")
    g.add_argument("--grammar-cache", type=int, default=DEFAULT_CACHE_ENTRIES, metavar="N",
                   help="compiled grammars (and refused ones) kept, so a repeated spec is not compiled again "
                        f"(default: {DEFAULT_CACHE_ENTRIES})")


def grammar_limits(args: argparse.Namespace) -> GrammarLimits:
    """The limits of ``add_grammar_limit_arguments``' options (defaults where a command has none)."""
    return GrammarLimits(getattr(args, "grammar_lexer_fuel", DEFAULT_LEXER_FUEL),
                         getattr(args, "grammar_compile_timeout", DEFAULT_COMPILE_TIMEOUT),
                         getattr(args, "grammar_cache", DEFAULT_CACHE_ENTRIES))
