"""The "Python documentation" domain corpus: text every CPython install carries.

Documents are standard-library docstrings (read with ``ast``: no stdlib module is imported, so
nothing with import-time side effects runs) and the pydoc help topics. The split into train and
held-out is by a hash of the document id, so it is stable across runs and machines; the held-out
documents never reach training.
"""

from __future__ import annotations

import ast
import hashlib
import json
import pathlib
import sysconfig
from dataclasses import asdict, dataclass

HELDOUT_PERCENT = 20  # documents whose id hashes into the bottom 20 % are held out
MIN_CHARS = 120  # shorter docstrings carry too little text to score
MAX_CHARS = 1200  # long documents are cut into chunks of about this size at paragraph breaks
# Folders of the stdlib that are tests, tooling or vendored code, not documentation.
SKIP_PARTS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}


@dataclass(frozen=True)
class Document:
    doc_id: str  # e.g. "stdlib:json.decoder.JSONDecoder" or "topic:assert#0"
    text: str


def is_heldout(doc_id: str) -> bool:
    # Chunks "x#1", "x#2" of one source document fall on the same side of the split.
    digest = hashlib.sha256(doc_id.split("#")[0].encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def _chunks(text: str, limit: int = MAX_CHARS) -> list[str]:
    out, cur = [], ""
    for para in text.split("\n\n"):
        if cur and len(cur) + len(para) + 2 > limit:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    if cur:
        out.append(cur)
    return out


def _docstring_documents(path: pathlib.Path, module: str) -> list[Document]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    docs: list[Document] = []
    mod_doc = ast.get_docstring(tree)
    if mod_doc:
        docs.append(Document(f"stdlib:{module}", f"{module}\n\n{mod_doc}"))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc:
                docs.append(Document(f"stdlib:{module}.{node.name}", f"{module}.{node.name}()\n\n{doc}"))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            parts = []
            doc = ast.get_docstring(node)
            if doc:
                parts.append(f"class {module}.{node.name}\n\n{doc}")
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                    mdoc = ast.get_docstring(item)
                    if mdoc:
                        parts.append(f"{node.name}.{item.name}()\n\n{mdoc}")
            if parts:
                docs.append(Document(f"stdlib:{module}.{node.name}", "\n\n".join(parts)))
    return docs


def collect_documents() -> list[Document]:
    """All documents, in a deterministic order (sorted paths, then source order)."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs: list[Document] = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if SKIP_PARTS.intersection(rel.parts) or rel.name.startswith("test_"):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        docs.extend(_docstring_documents(path, module))
    from pydoc_data.topics import topics

    for name in sorted(topics):
        for i, chunk in enumerate(_chunks(topics[name])):
            docs.append(Document(f"topic:{name}#{i}", chunk))
    out, seen = [], set()
    for d in docs:
        text = d.text.strip()
        if len(text) < MIN_CHARS or d.doc_id in seen:
            continue
        seen.add(d.doc_id)
        for i, chunk in enumerate(_chunks(text)):
            out.append(Document(d.doc_id if i == 0 else f"{d.doc_id}#{i}", chunk))
    return out


def split(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    train = [d for d in docs if not is_heldout(d.doc_id)]
    heldout = [d for d in docs if is_heldout(d.doc_id)]
    return train, heldout


def write_jsonl(docs: list[Document], path: pathlib.Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(asdict(d), ensure_ascii=False) + "\n")


def read_jsonl(path: pathlib.Path) -> list[Document]:
    with path.open(encoding="utf-8") as f:
        return [Document(**json.loads(line)) for line in f if line.strip()]
