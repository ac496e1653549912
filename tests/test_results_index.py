"""docs/PERFORMANCE.md is the index of benchmarks/results/, and the docs' links lead somewhere.

- Every file under benchmarks/results/ is named on the page (as ``benchmarks/results/NAME``, a link's path
  included), and every such name on the page is a file there: a results file nobody cites has no claim, and a
  claim's raw data is where the page says.
- The commands of the page's table are real ones: each `specmesh ...` span, with the page's variables
  (its first bash block) put in, parses with the CLI's own parser (tests/test_readme.py's check).
- Every relative markdown link in README.md and docs/*.md resolves to a file, and its #anchor to a heading of that
  file by GitHub's slug rule (lower case; letters, digits, ``_``, ``-`` and spaces kept; spaces become ``-``;
  repeated headings numbered ``-1``, ``-2``)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tests.test_readme import parse_line

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "PERFORMANCE.md"
LINKED_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

NAMED = re.compile(r"benchmarks/results/([\w+-]+(?:\.[\w+-]+)+)")  # NAME.ext: a bare NAME is a placeholder
FENCED = re.compile(r"```.*?```", re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)
ASSIGNMENT = re.compile(r"^([A-Za-z_]\w*)=(.*)$")
VARIABLE = re.compile(r"\$(\w+)")


def results_files(directory: Path = RESULTS) -> set[str]:
    """Names of the files under ``directory`` (relative paths; a results file in a subfolder counts too)."""
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


def named_results(text: str) -> set[str]:
    """The NAMEs of ``benchmarks/results/NAME`` anywhere in ``text`` (links, prose, code)."""
    return set(NAMED.findall(text))


def index_problems(text: str, files: set[str]) -> list[str]:
    """What is wrong between a status page's text and the results files: unnamed files, names of no file."""
    named = named_results(text)
    return ([f"benchmarks/results/{f}: not named on the page" for f in sorted(files - named)]
            + [f"benchmarks/results/{n}: named on the page, no such file" for n in sorted(named - files)])


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The #anchors a markdown file's headings make (code blocks left out: their ``#`` lines are comments)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCED.sub("", page.read_text())):
        s = slug(heading)
        n = seen.get(s, 0)
        seen[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return found


def link_problems(page: Path) -> list[str]:
    """Relative links of ``page`` whose file does not exist, or whose #anchor names no heading of it."""
    text = INLINE_CODE.sub("", FENCED.sub("", page.read_text()))
    label = page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name
    wrong = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            wrong.append(f"{label}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            wrong.append(f"{label}: {target}: no heading of {dest.name} makes #{anchor}")
    return wrong


def page_variables(text: str) -> dict[str, str]:
    """The VAR=value lines of the page's first bash block (values unquoted as bash would)."""
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    found = {}
    for line in (block.group(1) if block else "").splitlines():
        if m := ASSIGNMENT.match(line.split("  #")[0].strip()):
            found[m.group(1)] = " ".join(shlex.split(m.group(2)))
    return found


def table_commands(text: str) -> list[str]:
    """The `specmesh ...` spans of the command column (the third) of the page's table rows (``| **N** claim |
    figure | command | machine, date | files |``), the page's $VARIABLES expanded."""
    variables = page_variables(text)
    cells = [line.split("|")[3] for line in text.splitlines() if line.startswith("| **")]
    spans = [span for cell in cells for span in re.findall(r"`(specmesh [^`]+)`", cell)]
    return [VARIABLE.sub(lambda m: variables.get(m.group(1), m.group(0)), span) for span in spans]


def test_every_results_file_is_named_on_the_status_page_and_every_name_exists():
    files = results_files()
    assert files, "no results files: is the checkout whole?"
    problems = index_problems(PAGE.read_text(), files)
    assert not problems, "\n".join(problems)


def test_the_status_pages_commands_parse():
    commands = table_commands(PAGE.read_text())
    assert len(commands) >= 20
    wrong = [f"{c}: {problem}" for c in commands if (problem := parse_line(shlex.split(c)[1:])) is not None]
    assert not wrong, "\n".join(wrong)


def test_every_relative_link_in_the_readme_and_the_docs_resolves():
    problems = [p for page in LINKED_PAGES for p in link_problems(page)]
    assert not problems, "\n".join(problems)


def test_a_broken_index_or_link_is_caught(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "a.md").write_text("x")
    (tmp_path / "results" / "b.json").write_text("{}")
    files = results_files(tmp_path / "results")
    assert index_problems("[a](../benchmarks/results/a.md), benchmarks/results/b.json.", files) == []
    assert index_problems("[a](../benchmarks/results/a.md)", files) == ["benchmarks/results/b.json: not named on the page"]
    assert index_problems("benchmarks/results/a.md benchmarks/results/b.json benchmarks/results/c.md", files) == [
        "benchmarks/results/c.md: named on the page, no such file"]
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## The `serve` options (issue 7)\n\n```bash\n# not a heading\n```\n"
                    "[ok](#the-serve-options-issue-7) [ok](page.md#title) [web](https://example.com/x)\n"
                    "`[in code](missing.md)`\n[gone](missing.md) [bad](#not-a-heading) [bad](page.md#nope)\n")
    assert link_problems(page) == ["page.md: missing.md: no such file",
                                   "page.md: #not-a-heading: no heading of page.md makes #not-a-heading",
                                   "page.md: page.md#nope: no heading of page.md makes #nope"]
    text = ('```bash\nPAIR="--target T --draft D"  # the pair\n```\n'
            '| **1** `specmesh x` | y | `specmesh bench $PAIR --limit 2`; `python z.py` | m | f |\n')
    assert table_commands(text) == ["specmesh bench --target T --draft D --limit 2"]
    assert parse_line(shlex.split("specmesh bench --prompts P --no-such-option")[1:]) is not None
