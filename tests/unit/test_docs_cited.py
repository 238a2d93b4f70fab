"""Every markdown file the repository cites is in the repository: a clone has nothing else.

Code comments cite docs/design.md and docs/reference.md (with a section), the README and docs/
link each other. The scan reads every *.py, *.toml, *.md, *.yml and *.yaml file (not .venv, .git,
node_modules or other dot folders) and checks

- markdown links to a .md target, resolved from the citing file's folder, as a renderer would;
- paths ending in .md whose first part is a folder of this repository (docs/…, benchmarks/…), from
  the repository root;
- bare names: design.md, reference.md and upper-case names (README.md), in the root or docs/.

Not citations: anything inside a URL; paths that start with no folder of ours (mit-han-lab/llm-awq's
files); a path that is not here when the same line names another project just before it (vLLM's
tests/v1/…); bare lower-case names (output files such as canary-summary.md). A cited file must exist
with the exact case of the citation.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from tests.conftest import ROOT

SUFFIXES = (".py", ".toml", ".md", ".yml", ".yaml")
SKIP_DIRS = {"node_modules", "__pycache__", "build", "dist", "out"}  # and every folder whose name starts with "."
OUR_FOLDERS = {"docs", "benchmarks", "deploy", "app", "engines", "vocabulary", "evals", "workers", "dashboard", "tests", "migrations"}
BARE_NAMES = {"design.md", "reference.md"}

URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s)\]>\"'`]+|\b(?:[\w-]+\.)+(?:com|org|io|net|ai|dev)/[^\s)\]>\"'`]*")
LINK = re.compile(r"\]\(([^()\s#]+\.md)(?:#[^()\s]*)?\)")
PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w.-]+\.md)(?![\w-])")
UPPER = re.compile(r"[A-Z][A-Z0-9_-]*\.md")
# the two documents that once lived outside the repository, named without docs/ (built here so that
# this file does not name them itself)
OUTSIDE = re.compile(r"(?<!docs/)\b(?:" + "|".join(name + r"\.md" for name in ("DESIGN", "REFERENCE")) + r")\b")
REFERENCE_SECTION = re.compile(r"docs/reference\.md §(\d+)")
# a project whose files a comment may cite by their path in that project's repository
OTHER_PROJECT = re.compile(r"(?i)\b(?:vllm|sglang|lm-eval|lm-evaluation-harness|llama\.cpp|gpt-fast|transformers|autoawq|"
                           r"llm-awq|kivi|qjl|ragas|deepeval|triton|pytorch|celery|kombu)\b[^\n]{0,60}$")
DESIGN_SECTION = re.compile(r"docs/design\.md(?:'s)? §([A-Z][\w-]*(?: [a-z][\w-]*)*)")


def scanned() -> list[tuple[str, str]]:
    """(path relative to the root, text) of every file the scan reads."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for name in sorted(files):
            if name.endswith(SUFFIXES):
                path = Path(folder) / name
                out.append((path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8", errors="replace")))
    return out


@functools.cache
def _names(folder: Path) -> frozenset[str]:
    return frozenset(os.listdir(folder)) if folder.is_dir() else frozenset()


def exists(path: Path) -> bool:
    """A file inside the repository, every part spelled with the exact case on disk."""
    try:
        parts = Path(os.path.normpath(path)).relative_to(ROOT).parts
    except ValueError:
        return False
    folder = ROOT
    for part in parts:
        if part not in _names(folder):
            return False
        folder = folder / part
    return folder.is_file()


def citations(rel: str, text: str) -> list[tuple[str, Path]]:
    """(the citation as written, the file it must be) for every citation of a .md file in `text`."""
    text = URL.sub(" ", text)
    here = (ROOT / rel).parent
    out = [(target, here / target) for target in LINK.findall(text)]
    linked = {m.span(1) for m in LINK.finditer(text)}
    for m in PATH.finditer(text):
        if m.span(1) in linked:
            continue  # counted as a link
        target = m.group(1)
        first = target.split("/", 1)[0]
        if "/" in target:
            line = text[text.rfind("\n", 0, m.start()) + 1 : m.start()]
            if first in OUR_FOLDERS and (exists(ROOT / target) or not OTHER_PROJECT.search(line)):
                out.append((target, ROOT / target))
        elif target in BARE_NAMES or UPPER.fullmatch(target):
            out.append((target, ROOT / target if exists(ROOT / target) else ROOT / "docs" / target))
    return out


@functools.lru_cache(maxsize=1)
def _all() -> tuple[tuple[str, str, Path], ...]:
    return tuple((rel, cited, path) for rel, text in scanned() for cited, path in citations(rel, text))


def test_every_cited_markdown_file_exists():
    found = _all()
    missing = [f"{rel}: {cited}" for rel, cited, path in found if not exists(path)]
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)
    assert len(found) > 30, f"only {len(found)} citations found: the scan is not reading the repository"
    assert sum(path == ROOT / "docs" / "reference.md" for _, _, path in found) > 20


def test_the_design_documents_are_cited_by_their_path_in_the_repository():
    wrong = [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
             for rel, text in scanned() for m in OUTSIDE.finditer(text)]
    assert not wrong, "cite docs/design.md or docs/reference.md instead:\n" + "\n".join(wrong)


def test_cited_sections_exist():
    reference = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    numbers = set(re.findall(r"^## (\d+)\. ", reference, re.MULTILINE))
    assert numbers == {str(n) for n in range(1, 13)}, "docs/reference.md's sections are §1 to §12; citations rely on them"
    headings = re.findall(r"^## (.+)$", (ROOT / "docs" / "design.md").read_text(encoding="utf-8"), re.MULTILINE)
    bad, checked = [], 0
    for rel, text in scanned():
        for number in REFERENCE_SECTION.findall(text):
            checked += 1
            if number not in numbers:
                bad.append(f"{rel}: docs/reference.md §{number}")
        for name in DESIGN_SECTION.findall(text):
            checked += 1
            if not any(h.startswith(name) for h in headings):
                bad.append(f"{rel}: docs/design.md §{name}")
    assert not bad, "no such section:\n" + "\n".join(bad)
    assert checked > 30
