"""Labelled items for a suite's labelled scorer (vocabulary/labelled.py): convert lm-eval's
`--log_samples` output into an items file, and list the built-in tasks."""

from __future__ import annotations

import json
import pathlib
import re
import sys

import typer

from app.cli.base import console, fail, tasks_app

_SAMPLES = re.compile(r"^samples_(.+)_\d{4}-\d{2}-\d{2}T[\d\-.]+\.jsonl$")  # samples_<task>_<timestamp>.jsonl


@tasks_app.command("import-lm-eval")
def import_lm_eval(
    samples: list[pathlib.Path] = typer.Argument(..., help="lm-eval's samples_<task>_<timestamp>.jsonl files "
                                                           "(lm_eval --log_samples --output_path DIR)"),
    output: pathlib.Path | None = typer.Option(None, "--output", "-o", help="the items file to write (default: "
                                                                             "standard output)"),
    task: str | None = typer.Option(None, help="the task name in each item's id (default: from the file's name)"),
) -> None:
    """Convert lm-eval samples into labelled items (one JSON object per line) for a suite's
    `labelled.items`: a multiple-choice task's choices and right index, or a generate_until
    task's prompt and target (scored by exact match). The canary then asks every config the same
    items and compares them item by item."""
    from vocabulary.labelled import ItemError, from_lm_eval_sample, parse_item

    items: list[dict] = []
    for path in samples:
        name = task or (m.group(1) if (m := _SAMPLES.match(path.name)) else path.stem)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            fail(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e}); give lm-eval's samples .jsonl file")
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = from_lm_eval_sample(json.loads(line), name)
                parse_item(item, f"{path.name} line {lineno}")  # what a suite would refuse is refused here
            except json.JSONDecodeError as e:
                fail(f"{path.name} line {lineno} is not JSON ({e.msg}); give lm-eval's samples .jsonl file")
            except ItemError as e:
                fail(f"{path.name} line {lineno}: {e}")
            items.append(item)
    if not items:
        fail("no samples in the files given; run lm_eval with --log_samples and give its samples_*.jsonl files")
    ids = [item["id"] for item in items]
    if len(set(ids)) != len(ids):
        fail("two files give the same task's samples; give each task once, or name them apart with --task")
    text = "".join(json.dumps(item) + "\n" for item in items)
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text, encoding="utf-8")
    console.print(f"{len(items)} items from {len(samples)} file(s)" + (f" written to {output}" if output else ""),
                  highlight=False)


@tasks_app.command("builtin")
def builtin(name: str | None = typer.Argument(None, help="a built-in task: print its items as JSON lines")) -> None:
    """List the built-in tasks (labelled.items: builtin:NAME), or print one task's items: one JSON
    object per line, the answer as the right choice's index (what an lm-eval multiple_choice task
    reads: docs/lm_eval/pydoc_next_word.yaml)."""
    from vocabulary.labelled import BUILTIN_TASKS, ItemError, builtin_items

    if name is None:
        for task, what in BUILTIN_TASKS.items():
            sys.stdout.write(f"builtin:{task}\t{what}\n")
        return
    try:
        items = builtin_items(name.removeprefix("builtin:"))
    except ItemError as e:
        fail(str(e))
    for item in items:
        sys.stdout.write(json.dumps({"id": item.key, "prompt": item.prompt, "choices": list(item.choices),
                                     "answer": item.answer_index}) + "\n")
