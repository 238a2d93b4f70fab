"""Read a suite's corpus into samples: builtin:NAME, a .jsonl file or a folder of text files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engines.zoo import ModelPathError, resolve_corpus_path

if TYPE_CHECKING:
    from vocabulary.suite import SuiteSpec


class CorpusError(ValueError):
    pass


@dataclass(frozen=True)
class SampleIn:
    key: str
    text: str
    kind: str = "document"
    reference: str | None = None
    contexts: list[str] | None = None
    cluster: str | None = None


def load_corpus(ref: str, field: str = "corpus", max_documents: int = 20000,
                max_chars: int = 200_000) -> list[SampleIn]:
    try:
        return _load_corpus(ref, field, max_documents, max_chars)
    except (OSError, UnicodeDecodeError) as e:  # a name too long, no permission, not UTF-8: a 422 naming the field
        shown = ref if len(ref) <= 80 else ref[:77] + "..."
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise CorpusError(f"{field}: corpus '{shown}' cannot be read ({why}); give a readable UTF-8 .jsonl file or "
                          "folder") from None


def _load_corpus(ref: str, field: str, max_documents: int, max_chars: int) -> list[SampleIn]:
    try:
        path = resolve_corpus_path(ref)
    except ModelPathError as e:
        raise CorpusError(f"{field}: {e}") from None
    if not path.exists():
        raise CorpusError(f"{field}: '{ref}' does not exist; give builtin:pydoc-heldout, a .jsonl file or a folder "
                          "of .txt files")
    samples: list[SampleIn] = []
    if path.is_dir():
        for document in sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".md") and p.is_file()):
            samples.append(SampleIn(key=str(document.relative_to(path)), text=document.read_text(encoding="utf-8")))
    elif path.suffix == ".jsonl":
        from vocabulary.labelled import json_lines

        with path.open(encoding="utf-8") as lines:
            for lineno, row in json_lines(lines, f"{field}: {path}", CorpusError):
                text = row.get("text") if isinstance(row, dict) else None
                if not isinstance(text, str):
                    raise CorpusError(f"{field}: {path} line {lineno} has no string 'text' field")
                key = str(row.get("id") or row.get("doc_id") or f"line-{lineno}")
                samples.append(
                    SampleIn(key=key, text=text, reference=row.get("reference"), contexts=row.get("contexts"),
                             cluster=row.get("cluster") or key.split("#")[0])
                )
    else:
        raise CorpusError(f"{field}: unsupported corpus '{ref}'; use a .jsonl file or a folder of .txt/.md files")
    samples = [sample for sample in samples if sample.text.strip()]
    if not samples:
        raise CorpusError(f"{field}: corpus '{ref}' has no non-empty documents; add documents with a 'text' field")
    if len(samples) > max_documents:
        raise CorpusError(f"{field}: corpus '{ref}' has {len(samples)} documents, above the limit of "
                          f"{max_documents}; split it into suites")
    keys: set[str] = set()
    for sample in samples:
        if len(sample.key) > 256 or (sample.cluster and len(sample.cluster) > 256):
            raise CorpusError(f"{field}: document id '{sample.key[:40]}…' is longer than 256 characters; shorten it")
        if sample.key in keys:
            raise CorpusError(f"{field}: duplicate document id '{sample.key}' in '{ref}'; ids must be unique")
        if len(sample.text) > max_chars:
            raise CorpusError(f"{field}: document '{sample.key}' has {len(sample.text)} characters, above the limit "
                              f"of {max_chars}")
        keys.add(sample.key)
    return samples


def join_long(samples: list[SampleIn], window: int, max_chars: int, field: str = "perplexity.long_documents"
              ) -> list[SampleIn]:
    """The suite's documents joined, in corpus order and separated by a blank line, into documents
    of at least window × LONG_CHARS_PER_TOKEN characters (the window's length in tokens on any
    common tokenizer): long-context documents whose windows fill to the end, so that a loss deep
    in the context is scored (perplexity.long_documents). A document already that long stays as
    it is; a short remainder joins the last document; a group that would pass max_chars ends
    there, shorter. Keyed by the first document's key and how many followed it ("mod.func+9").
    Clusters stay whole for the bootstrap: joined documents that hold parts of one source
    (documents of one cluster) share a cluster."""
    from vocabulary.suite import LONG_CHARS_PER_TOKEN

    if any(s.reference is not None or s.contexts for s in samples):
        raise CorpusError(f"{field}: the corpus's documents carry references or contexts (RAG items), which joining "
                          "would lose; join plain documents only, or set long_documents: false")
    target = window * LONG_CHARS_PER_TOKEN
    if target > max_chars:
        raise CorpusError(f"{field}: a window of {window} tokens needs documents of {target} characters, above the "
                          f"limit of {max_chars} (CANARY_MAX_DOCUMENT_CHARS); use a smaller window")
    groups: list[list[SampleIn]] = []
    size = 0  # characters in the group being filled, with a separator after each document
    for sample in samples:
        n = len(sample.text) + 2
        if not groups or size >= target or size + n > max_chars + 2:
            groups.append([])
            size = 0
        groups[-1].append(sample)
        size += n
    if len(groups) > 1 and size < target and size + sum(len(s.text) + 2 for s in groups[-2]) <= max_chars + 2:
        groups[-2].extend(groups.pop())  # a short remainder: no document below the window
    joined, keys = [], set()
    source_cluster: dict[str, str] = {}  # an original cluster → the joined cluster that holds it
    for i, group in enumerate(groups):
        key = group[0].key if len(group) == 1 else f"{group[0].key[:200]}+{len(group) - 1}"
        if key in keys:  # another document's key, or the same first 200 characters: made unique
            key = f"{key}~{i}"
        keys.add(key)
        sources = [s.cluster or s.key for s in group]
        cluster = next((source_cluster[c] for c in sources if c in source_cluster), key)
        source_cluster.update(dict.fromkeys(sources, cluster))
        joined.append(SampleIn(key=key, text="\n\n".join(s.text for s in group), cluster=cluster))
    return joined


def long_documents(samples: list[SampleIn], suite: SuiteSpec, max_chars: int, field: str = "perplexity.long_documents"
                   ) -> tuple[list[SampleIn], str]:
    """A suite's documents as its runs score them: joined when it sets perplexity.long_documents
    (join_long), with the words a refusal of its `samples` adds ("(long documents joined from 526)")."""
    if not suite.perplexity.long_documents:
        return samples, ""
    return (join_long(samples, suite.perplexity.window, max_chars, field),
            f" (long documents joined from {len(samples)})")


ITEM_PREFIX = "item:"  # a labelled item's key among a suite's samples (kind "item"); documents never start so


def load_items(ref: str, field: str = "labelled.items", max_items: int = 20000) -> list[SampleIn]:
    """A suite's labelled items (vocabulary/labelled.py) as samples of kind "item": the prompt as the
    text, the answer, choices and match as the reference. builtin:NAME is a built-in task."""
    from vocabulary.labelled import ItemError, builtin_items, parse_items

    try:
        if ref.startswith("builtin:"):
            items = builtin_items(ref.removeprefix("builtin:"))
        else:
            path = resolve_corpus_path(ref)
            if path.suffix != ".jsonl" or not path.is_file():
                raise ItemError(f"'{ref}' is not a .jsonl file; give builtin:pydoc-next-word or a .jsonl file of items")
            with path.open(encoding="utf-8") as lines:
                items = parse_items(lines, path.name, max_items)
    except ItemError as e:
        raise CorpusError(f"{field}: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise CorpusError(f"{field}: items '{ref[:80]}' cannot be read ({why}); give a readable UTF-8 .jsonl "
                          "file") from None
    out = []
    for item in items:
        if len(item.key) > 250:
            raise CorpusError(f"{field}: item id '{item.key[:40]}…' is longer than 250 characters; shorten it")
        out.append(SampleIn(key=ITEM_PREFIX + item.key, text=item.prompt, kind="item",
                            reference=json.dumps(item.to_json())))
    return out
