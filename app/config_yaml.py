"""Reading a canary.yaml: YAML loaded with bounds on its size, depth, aliases and lists before any
of it is parsed against the schema (app/config_file.py), so a hostile file costs no memory."""

from __future__ import annotations

import pathlib
from typing import Any

import yaml

from app.config_file import CanaryFile, ConfigFileError, list_limits, parse_config


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that stops early, before the work grows with the input: at a nesting depth
    over max_config_depth (deep nesting would otherwise end in a RecursionError), at more than
    max_config_values values (aliases counted as expanded, so an alias bomb stops too), and at
    the first entry past a top-level list's limit (a 200,000-config file stops at config 201)."""

    def __init__(self, stream: str) -> None:
        from app.settings import get_settings

        super().__init__(stream)
        st = get_settings()
        self.max_depth, self.max_values = st.max_config_depth, st.max_config_values
        self.list_limits = {field: (name, limit) for field, name, limit in list_limits()}
        self.path: list = []  # the key or index of every node being composed, root first
        self.values = 0
        self.anchored: dict[str, int] = {}  # anchor → values under it

    def _where(self) -> str:
        mark = self.peek_event().start_mark
        return f" (line {mark.line + 1})" if mark else ""

    # index: the key node of a mapping's value, the position in a sequence, None at the root (yaml is untyped)
    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        key = index.value if isinstance(index, yaml.ScalarNode) else index
        if len(self.path) >= self.max_depth:
            raise ConfigFileError(f"nesting deeper than {self.max_depth} levels{self._where()}; the limit is the "
                                  "setting CANARY_MAX_CONFIG_DEPTH")
        if isinstance(parent, yaml.SequenceNode) and len(self.path) == 2 and self.path[-1] in self.list_limits:
            name, limit = self.list_limits[self.path[-1]]
            if index >= limit:
                raise ConfigFileError(f"{self.path[-1]}: more than {limit} entries{self._where()}; the limit is "
                                      f"{limit} (setting CANARY_{name}); split the file or raise the limit")
        event = self.peek_event()
        start = self.values
        self.values += self.anchored.get(event.anchor, 1) if isinstance(event, yaml.AliasEvent) else 1
        if self.values > self.max_values:
            raise ConfigFileError(f"more than {self.max_values} values{self._where()}; the limit is the setting "
                                  "CANARY_MAX_CONFIG_VALUES")
        self.path.append(key)
        try:
            node = super().compose_node(parent, index)
        finally:
            self.path.pop()
        if not isinstance(event, yaml.AliasEvent) and getattr(event, "anchor", None):
            self.anchored[event.anchor] = self.values - start
        return node


def load_config_text(text: str, source: str) -> CanaryFile:
    """Parse and validate a config file's text; `source` names it in errors."""
    try:
        data = yaml.load(text, Loader=_BoundedLoader)  # a SafeLoader with bounds
    except ConfigFileError as e:
        raise ConfigFileError(f"{source}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigFileError(f"{source}: malformed YAML{where}: {getattr(e, 'problem', e)}") from None
    return parse_config(data, source)


def load_config_file(path: str | pathlib.Path) -> CanaryFile:
    """A config file, or standard input for '-'. Files over max_config_file_bytes are refused unread."""
    import sys

    from app.settings import get_settings

    limit = get_settings().max_config_file_bytes
    too_big = f"is larger than {limit} bytes, the limit (setting CANARY_MAX_CONFIG_FILE_BYTES)"
    if str(path) == "-":
        raw = sys.stdin.buffer.read(limit + 1)
        source = "<stdin>"
        if len(raw) > limit:
            raise ConfigFileError(f"{source} {too_big}")
    else:
        path = pathlib.Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigFileError(f"config file '{path}' not found; create one from canary.example.yaml")
        if path.stat().st_size > limit:
            raise ConfigFileError(f"{source} {too_big}")
        raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigFileError(f"{source}: not UTF-8 text (byte {e.start})") from None
    return load_config_text(text, source)
