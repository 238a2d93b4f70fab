"""Labelled items: a question with its answer, scored as lm-eval scores its tasks, so that a config's
task accuracy can be compared with the baseline's item by item (evals/flips.py).

An item is one JSON object (a line of a .jsonl file, or a row the built-in task makes):

    {"id": "q1", "prompt": "…", "choices": ["…", "…"], "answer": 1}              multiple choice
    {"id": "q2", "prompt": "…", "answer": "42", "match": "number"}               generated, then matched

`match` says how an answer counts as right:
    choice   the choice whose continuation the model finds most likely after the prompt (Σ log p of its
             tokens, lm-eval's `acc`); `answer` is the right choice's index or its text
    exact    the generated text, stripped, equals `answer` stripped (lm-eval's exact_match, ignore-case off)
    regex    the first match of `pattern` in the generated text (its first group if it has one) equals `answer`
    number   the last number in the generated text equals `answer` as a number (GSM8K's flexible extract)
`match` defaults to `choice` where the item has choices, `exact` otherwise.

Torch-free and numpy-free: the API checks a suite's items with it when the suite is registered.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

Match = Literal["choice", "exact", "regex", "number"]
MATCHES: tuple[str, ...] = ("choice", "exact", "regex", "number")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class ItemError(ValueError):
    """An item that cannot be scored; the message names the item and the fix."""


@dataclass(frozen=True)
class LabelledItem:
    key: str
    prompt: str
    answer: str  # the right choice's text (choice), or the expected answer
    match: Match = "exact"
    choices: tuple[str, ...] = ()
    pattern: str | None = None  # regex only

    @property
    def answer_index(self) -> int | None:
        return self.choices.index(self.answer) if self.match == "choice" else None

    def to_json(self) -> dict[str, Any]:
        """What a suite stores of the item beside its prompt (SuiteSample.reference)."""
        out: dict[str, Any] = {"answer": self.answer, "match": self.match}
        if self.choices:
            out["choices"] = list(self.choices)
        if self.pattern is not None:
            out["pattern"] = self.pattern
        return out

    @classmethod
    def from_stored(cls, key: str, prompt: str, stored: str) -> LabelledItem:
        e = json.loads(stored)
        return cls(key, prompt, e["answer"], e["match"], tuple(e.get("choices") or ()), e.get("pattern"))


def parse_item(row: Any, where: str) -> LabelledItem:
    """One item from its JSON object; `where` names it in an error ("items.jsonl line 3")."""
    if not isinstance(row, dict):
        raise ItemError(f"{where}: an item is a JSON object with 'id', 'prompt' and 'answer'")
    key, prompt = row.get("id"), row.get("prompt", row.get("question"))
    if not isinstance(key, (str, int)) or str(key) == "":
        raise ItemError(f"{where}: give each item an 'id' (a string or a number)")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ItemError(f"{where}: item '{key}' has no string 'prompt'; give the question the model answers")
    choices = row.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise ItemError(f"{where}: item '{key}': 'choices' must be a list of strings")
    match = row.get("match") or ("choice" if choices else "exact")
    if match not in MATCHES:
        raise ItemError(f"{where}: item '{key}': unknown match '{match}'; choose from {', '.join(MATCHES)}")
    answer = row.get("answer")
    if match == "choice":
        if len(choices) < 2:
            raise ItemError(f"{where}: item '{key}': a multiple-choice item needs at least 2 'choices'")
        if len(set(choices)) != len(choices):
            raise ItemError(f"{where}: item '{key}': its choices repeat; make each choice different")
        if isinstance(answer, int) and not isinstance(answer, bool):
            if not 0 <= answer < len(choices):
                raise ItemError(f"{where}: item '{key}': answer index {answer} is outside its {len(choices)} choices")
            answer = choices[answer]
        elif not isinstance(answer, str) or answer not in choices:
            raise ItemError(f"{where}: item '{key}': 'answer' must be the right choice's index or its text")
    elif isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = format(answer, "g")
    if not isinstance(answer, str):
        raise ItemError(f"{where}: item '{key}' has no 'answer'; give the expected answer as a string")
    pattern = row.get("pattern")
    if match == "regex":
        if not isinstance(pattern, str):
            raise ItemError(f"{where}: item '{key}': match 'regex' needs a 'pattern'")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ItemError(f"{where}: item '{key}': pattern is not a regular expression ({e})") from None
    elif match == "number" and to_number(answer) is None:
        raise ItemError(f"{where}: item '{key}': match 'number' needs a numeric 'answer', got '{answer}'")
    return LabelledItem(str(key), prompt, answer, cast(Match, match), tuple(choices),
                        pattern if match == "regex" else None)


def json_lines(lines: Iterable[str], source: str, error: type[ValueError] = ValueError) -> Iterator[tuple[int, Any]]:
    """(line number, its JSON value) for each non-blank line; a line that is not JSON raises
    `error` naming `source` and the line (a corpus and an items file read alike)."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{source} line {lineno} is not JSON: {e.msg}") from None


def parse_items(lines: Iterable[str], source: str, limit: int = 20000) -> list[LabelledItem]:
    """Items from JSON lines; ids unique, at most `limit`."""
    items: list[LabelledItem] = []
    seen: set[str] = set()
    for lineno, row in json_lines(lines, source, ItemError):
        item = parse_item(row, f"{source} line {lineno}")
        if item.key in seen:
            raise ItemError(f"{source} line {lineno}: duplicate item id '{item.key}'; ids must be unique")
        seen.add(item.key)
        items.append(item)
        if len(items) > limit:
            raise ItemError(f"{source}: more than {limit} items; split them into suites")
    if not items:
        raise ItemError(f"{source} has no items; add one JSON object per line")
    return items


def to_number(text: str) -> float | None:
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def extract(item: LabelledItem, output: str) -> str | None:
    """The part of a generated answer that `item.match` compares; None when there is none."""
    if item.match == "exact":
        return output.strip()
    if item.match == "regex":
        found = re.search(item.pattern or "", output)
        if found is None:
            return None
        return (found.group(1) if found.groups() else found.group(0)).strip()
    if item.match == "number":
        numbers = _NUMBER.findall(output)
        return numbers[-1].replace(",", "") if numbers else None
    raise ValueError(f"a '{item.match}' item is scored by its choices, not by a generated answer")


def generated_correct(item: LabelledItem, output: str) -> tuple[bool, str | None]:
    """(right?, what was read from the answer) for a generated answer."""
    got = extract(item, output)
    if got is None:
        return False, None
    if item.match == "number":
        a, b = to_number(got), to_number(item.answer)
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9), got
    return got == item.answer.strip(), got


def choice_correct(item: LabelledItem, loglikelihoods: Sequence[float]) -> tuple[bool, int]:
    """(right?, the chosen index): the choice with the highest Σ log p wins, the first on a tie
    (lm-eval's argmax)."""
    if len(loglikelihoods) != len(item.choices):
        raise ValueError(f"item {item.key}: {len(loglikelihoods)} scores for {len(item.choices)} choices")
    chosen = max(range(len(loglikelihoods)), key=lambda i: (loglikelihoods[i], -i))
    return chosen == item.answer_index, chosen


def continuation_loglikelihood(full: Any, prompt_chars: int, prompt: Any | None = None) -> float:
    """Σ log p of a choice's tokens, from the rolling log-likelihood of prompt + choice (an
    engines.protocol.RollingResult): the tokens that cover any character past the prompt, where the
    engine placed its tokens in the text (char_spans), so each has the whole prompt as context.
    Without spans (an HTTP server's tokenizer), the whole text's log-likelihood less the prompt's
    own (`prompt`, scored alone): equal where the prompt's tokens are a prefix of the whole text's
    and both fit one window."""
    if full.char_spans:
        return float(sum(lp for lp, (_, end) in zip(full.logprobs, full.char_spans, strict=True) if end > prompt_chars))
    if prompt is None:
        raise ValueError("the engine gave no token spans: score the prompt alone and pass it as `prompt`")
    return prompt.nll - full.nll


def from_lm_eval_sample(row: dict[str, Any], task: str) -> dict[str, Any]:
    """One line of lm-eval's `--log_samples` output as an item's JSON object.

    A multiple-choice task's sample carries its loglikelihood requests in `arguments` (each a
    context and one choice's continuation, as lm-eval built them from the task's template) and the
    right choice's index in `target`; a generate_until task's carries the prompt and its stop
    settings, with `target` the expected answer, scored here by exact match."""
    doc_id = row.get("doc_id")
    arguments = row.get("arguments")
    if isinstance(arguments, dict):  # as lm-eval's tracker writes them: {"gen_args_0": {"arg_0": …, "arg_1": …}, …}
        arguments = [arguments[k] for k in sorted(arguments, key=_index)]
    if doc_id is None or not isinstance(arguments, list) or not arguments:
        raise ItemError("not an lm-eval sample: each line needs 'doc_id' and 'arguments' (run lm_eval with "
                        "--log_samples and give the samples_<task>_*.jsonl file)")
    pairs = [_argument(a) for a in arguments]
    target = row.get("target")
    key = f"{task}#{doc_id}"
    if all(len(p) == 2 and isinstance(p[1], str) for p in pairs):  # loglikelihood: (context, continuation)
        contexts = {p[0] for p in pairs}
        if len(contexts) != 1:
            raise ItemError(f"sample {doc_id}: its choices have different contexts; only one shared prompt is "
                            "supported")
        answer = int(target) if isinstance(target, (int, str)) and str(target).lstrip("-").isdigit() else target
        return {"id": key, "prompt": pairs[0][0], "choices": [p[1] for p in pairs], "answer": answer,
                "match": "choice"}
    if len(pairs) == 1 and isinstance(pairs[0][0], str):  # generate_until: (context, generation kwargs)
        return {"id": key, "prompt": pairs[0][0], "answer": str(target).strip(), "match": "exact"}
    raise ItemError(f"sample {doc_id}: its request type is neither multiple choice nor generate_until")


def _index(name: str) -> int:
    digits = name.rsplit("_", 1)[-1]
    return int(digits) if digits.isdigit() else 0


def _argument(a: Any) -> list[Any]:
    if isinstance(a, dict):
        return [a[k] for k in sorted(a, key=_index)]
    if isinstance(a, (list, tuple)):
        return list(a)
    raise ItemError(f"an lm-eval sample's argument is {type(a).__name__}, not a list or an object")


# ---------------------------------------------------------------------------------------------------------------
# The built-in task: the zoo's own domain, so the tiny model can do it better than chance

_WORD = re.compile(r" ([A-Za-z]{3,})\b")  # a word of 3+ letters after a space
BUILTIN_TASKS = {
    "pydoc-next-word": "the next word of a held-out docstring: the word that comes next against 3 other words of the "
                       "same docstring nearest it in length; one item per docstring, multiple choice by "
                       "log-likelihood (chance 25 %)",
}


def builtin_items(name: str, n_choices: int = 4) -> list[LabelledItem]:
    """The items of a built-in task (BUILTIN_TASKS), made from the zoo's held-out corpus the same
    way on every machine: nothing random but a hash of each document's id, which picks the word
    (one after the first 40 characters and before the 700th, so the prompt fits a 256-token window)."""
    import hashlib

    from engines.zoo import BUILTIN_CORPORA

    if name not in BUILTIN_TASKS:
        raise ItemError(f"unknown built-in task '{name}'; choose one of: {', '.join(BUILTIN_TASKS)}")
    items = []
    with BUILTIN_CORPORA["pydoc-heldout"].open(encoding="utf-8") as lines:
        for line in lines:
            row = json.loads(line)
            text, key = row["text"], row["doc_id"].removeprefix("stdlib:")
            words = [(m.start(), m.group(1)) for m in _WORD.finditer(text) if 40 < m.start() < 700]
            vocabulary = sorted({word for _, word in words})
            if len(vocabulary) < n_choices:
                continue
            at, word = words[int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % len(words)]
            others = sorted((v for v in vocabulary if v != word), key=lambda v: (abs(len(v) - len(word)), v))
            slot = int.from_bytes(hashlib.sha256(f"{key}/slot".encode()).digest()[:4], "big") % n_choices
            choices = [f" {v}" for v in others[: n_choices - 1]]
            choices.insert(slot, f" {word}")
            items.append(LabelledItem(key, text[:at], f" {word}", "choice", tuple(choices)))
    return items
