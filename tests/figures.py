"""Figures a test prints at the end of the session, whatever the capture mode (-s or not): a test
calls `report(request.config, section, line)`; the lines appear under their section in pytest's
terminal summary, next to the pass/fail counts."""

from __future__ import annotations

from collections import defaultdict

_NAME = "canary-test-figures"


class _Figures:
    def __init__(self):
        self.lines: dict[str, list[str]] = defaultdict(list)

    def pytest_terminal_summary(self, terminalreporter):
        for section, lines in self.lines.items():
            terminalreporter.section(section)
            for line in lines:
                terminalreporter.write_line(line)


def report(config, section: str, line: str) -> None:
    plugin = config.pluginmanager.get_plugin(_NAME)
    if plugin is None:
        plugin = _Figures()
        config.pluginmanager.register(plugin, _NAME)
    plugin.lines[section].append(line)
    print(f"[{section}] {line}")  # also in the test's captured output
