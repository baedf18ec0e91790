"""moelink's MOELINK_* settings, as the library declares them (src/common/settings.cpp).

``python3 -m moelink.settings`` prints the README's variable tables (``--area collectives`` or
``--area ep`` for one); ``value(name)`` is a setting as the library reads it.
"""

from __future__ import annotations

import argparse

from . import _C

AREAS = ("collectives", "ep")


def table() -> list:
    """Every setting: name, area, kind, default, min/max or choices, default_text, doc."""
    return list(_C.settings_table())


def value(name: str):
    """A setting as the library reads it: int, bool or str (None: unset, with a default that
    depends on the group). Raises ValueError for a value that does not fit."""
    return _C.setting(name)


def _default_cell(s: dict) -> str:
    if s["default_text"]:
        return s["default_text"]
    if s["kind"] == "choice":
        return f"`{s['choices'].split('|')[0]}`"
    if s["kind"] == "text":
        return "unset"
    return f"`{s['default']}`"


def markdown(area: str) -> str:
    """The README's table of one area."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for s in table():
        if s["area"] == area:
            rows.append(f"| `{s['name']}` | {_default_cell(s)} | {s['doc']} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--area", choices=AREAS, help="one table (default: both)")
    args = parser.parse_args()
    for area in [args.area] if args.area else AREAS:
        print(markdown(area))
        print()


if __name__ == "__main__":
    main()
