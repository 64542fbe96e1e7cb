"""The table of docs/model_gallery.md: rendering the gallery's reports, and writing them between the page's markers.

A run over some models only (``--only``) replaces their rows, failures and errors and keeps every other model's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

TABLE_START, TABLE_END = "<!-- gallery-table:start -->", "<!-- gallery-table:end -->"
FAILURES_HEAD, ERRORS_HEAD = "Failed checks (✗ in the table):", "Errors raised:"


def cell(ratios: tuple[float, ...] | str, asserted: bool, failed: bool) -> str:
    if isinstance(ratios, str):
        text = f"raises {ratios.split(':', 1)[0]}"
    else:
        low, high = f"{min(ratios):.3g}", f"{max(ratios):.3g}"
        text = low if low == high else f"{low}–{high}"
    return (f"**{text}**" if asserted else text) + (" ✗" if failed else "")


Parts = tuple[dict[str, str], list[tuple[str, str]], list[tuple[str, str]]]


def table_parts(
    reports: Sequence[Any],
    presets: Sequence[str],
    checks: Mapping[str, Callable[[Any], dict[str, str]]],
    conserving: Callable[[Any], tuple[str, ...]],
) -> Parts:
    """Per model: its row; and (model, line) for each failed check and each error raised."""
    rows: dict[str, str] = {}
    failures: list[tuple[str, str]] = []
    errors: dict[tuple[str, str], list[str]] = {}  # (model, message with the preset's name left out) -> presets
    for r in reports:
        failed = {}
        for check, judge in checks.items():
            for column, what in judge(r).items():
                failed[column] = what
                failures.append((r.case.name, f"* {r.case.name}, {column} ({check}): {what}"))
        if isinstance(r.lrp0_error, str):
            lrp0 = f"raises {r.lrp0_error.split(':', 1)[0]}"
            errors.setdefault((r.case.name, r.lrp0_error[:200]), []).append("LRP-0")
        else:
            lrp0 = f"{r.lrp0_error:.1e}" + (" (p.l.)" if r.piecewise_linear else "")
        cells = [r.case.name, f"{r.case.size}²", r.case.kind, lrp0 + (" ✗" if "LRP-0" in failed else "")]
        for preset in presets:
            if preset not in r.ratios:
                cells.append("—")
                continue
            ratios = r.ratios[preset]
            cells.append(cell(ratios, preset in conserving(r), preset in failed))
            if isinstance(ratios, str):
                message = ratios.replace(preset, "<preset>")[:200]  # the same error under several presets, once
                errors.setdefault((r.case.name, message), []).append(preset)
        rows[r.case.name] = "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
    listed = [(model, f"* {model}, {', '.join(names)}: `{message}`") for (model, message), names in errors.items()]
    return rows, failures, listed


def render(header: Sequence[str], parts: Parts) -> str:
    rows, failures, errors = parts
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [rows[name] for name in sorted(rows, key=str.lower)]
    text = ["\n".join(lines), f"{FAILURES_HEAD}\n\n" + ("\n".join(line for _, line in failures) or "none")]
    if errors:
        text.append(f"{ERRORS_HEAD}\n\n" + "\n".join(line for _, line in errors))
    return "\n\n".join(text)


def _parsed(block: str, header: Sequence[str]) -> Parts:
    """The rows, failures and errors of a table as :func:`render` wrote it."""
    rows: dict[str, str] = {}
    failures: list[tuple[str, str]] = []
    errors: list[tuple[str, str]] = []
    target: list | None = None
    for line in block.splitlines():
        if line.startswith("| ") and not line.startswith(f"| {header[0]} |"):
            rows[line[2:].split(" | ", 1)[0]] = line
        elif line.startswith((FAILURES_HEAD, ERRORS_HEAD)):
            target = failures if line.startswith(FAILURES_HEAD) else errors
        elif line.startswith("* ") and target is not None:
            target.append((line[2:].split(", ", 1)[0], line))
    return rows, failures, errors


def write_table(path: str, header: Sequence[str], parts: Parts, keep_others: bool) -> None:
    """Replace the table between the markers of ``path``; with ``keep_others`` only the measured models' lines."""
    with open(path, encoding="utf-8") as f:
        page = f.read()
    head, rest = page.split(TABLE_START, 1)
    old, tail = rest.split(TABLE_END, 1)
    if keep_others:
        rows, failures, errors = _parsed(old, header)
        measured = set(parts[0])
        rows = {name: row for name, row in rows.items() if name not in measured} | parts[0]
        failures = [f for f in failures if f[0] not in measured] + parts[1]
        errors = [e for e in errors if e[0] not in measured] + parts[2]
        parts = rows, sorted(failures, key=lambda f: f[0].lower()), sorted(errors, key=lambda e: e[0].lower())
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{TABLE_START}\n{render(header, parts)}\n{TABLE_END}{tail}")
