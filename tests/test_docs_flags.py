"""docs/training.md's flag table is what `lossreduce train --help` prints.

The page says so; this keeps it true when a flag is added, renamed, described
anew or given another default.
"""

from __future__ import annotations

import html
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "training.md"


@dataclass(frozen=True)
class Flag:
    usage: str  # "--placement PACK|SPREAD|...", "--verify, --no-verify"
    meaning: str
    default: str


def printed_flags() -> dict[str, Flag]:
    """Flag -> what `lossreduce train --help` prints of it."""
    out = subprocess.run(
        [sys.executable, "-m", "lossreduce.cli", "train", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    options = out.split("\noptions:\n", 1)[1]
    flags = {}
    # One entry per flag: its first line starts at two spaces of indent, and its
    # usage ends where argparse leaves a gap of two spaces (or at the line's end).
    for entry in re.split(r"\n(?=  -)", options.strip("\n")):
        usage = re.split(r"\s{2,}", entry.strip().splitlines()[0], maxsplit=1)[0]
        if usage.startswith("-h"):
            continue
        text = " ".join(entry.split())[len(usage) :].strip()
        found = re.fullmatch(r"(.*?)\s*\[default:\s+(.*?)\]", text)
        assert found, f"--help prints no default for {usage}"
        flags[usage.split()[0].rstrip(",")] = Flag(usage, found.group(1), found.group(2))
    return flags


def _plain(cell: str) -> str:
    """A table cell as text: no backticks, escaped pipes and entities undone."""
    return html.unescape(cell.replace("\\|", "|").replace("`", ""))


def documented_flags() -> dict[str, Flag]:
    """Flag -> the row of the page's "Every flag" table."""
    section = PAGE.read_text().split("\n## Every flag\n", 1)[1].split("\n## ", 1)[0]
    flags = {}
    for line in section.splitlines():
        if line.startswith("| `--"):
            usage, default, meaning = (c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1])
            usage = _plain(usage).replace(" / ", ", ")
            flags[usage.split()[0].rstrip(",")] = Flag(usage, _plain(meaning), _plain(default))
    return flags


def test_the_flag_table_is_what_help_prints() -> None:
    printed, documented = printed_flags(), documented_flags()
    assert sorted(documented) == sorted(printed), (
        f"docs/training.md lacks {sorted(set(printed) - set(documented))}, "
        f"lists {sorted(set(documented) - set(printed))} that --help does not"
    )
    for name, flag in printed.items():
        row = documented[name]
        assert row.usage == flag.usage, (row.usage, flag.usage)
        # The page may add a link after the text --help prints (its code marks aside).
        assert row.meaning.startswith(flag.meaning.replace("`", "")), (name, row, flag)
        # --address's default is read from $RAY_ADDRESS at run time; --help shows None.
        expected = "$RAY_ADDRESS" if name == "--address" else flag.default
        assert row.default == expected, (name, row.default, flag.default)
