"""docs/training.md's flag table is what `lossreduce train --help` prints.

The page says so; this keeps it true when a flag is added, renamed or given
another default.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def help_defaults() -> dict[str, str]:
    """Flag -> its ``[default: ...]`` as `lossreduce train --help` prints it."""
    out = subprocess.run(
        [sys.executable, "-m", "lossreduce.cli", "train", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    options = out.split("\noptions:\n", 1)[1]
    # One entry per flag: its first line starts at two spaces of indent.
    entries = re.split(r"\n(?=  -)", options.strip("\n"))
    defaults = {}
    for entry in entries:
        flag = entry.split()[0].rstrip(",")
        if flag == "-h":
            continue
        found = re.search(r"\[default:\s+(.*?)\]\s*$", " ".join(entry.split()))
        assert found, f"--help prints no default for {flag}"
        defaults[flag] = found.group(1)
    return defaults


def table_defaults() -> dict[str, str]:
    """Flag -> the default column of the page's "Every flag" table."""
    section = PAGE.read_text().split("\n## Every flag\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `--"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            flag = re.match(r"`(--[a-z0-9-]+)", cells[0])
            assert flag, line
            rows[flag.group(1)] = cells[1].strip("`")
    return rows


def test_the_flag_table_lists_every_flag_with_its_default() -> None:
    printed, documented = help_defaults(), table_defaults()
    assert sorted(documented) == sorted(printed), (
        f"docs/training.md lacks {sorted(set(printed) - set(documented))}, "
        f"lists {sorted(set(documented) - set(printed))} that --help does not"
    )
    # --address's default is read from $RAY_ADDRESS at run time; --help shows None.
    differ = {
        flag: (documented[flag], printed[flag])
        for flag in printed
        if documented[flag] != printed[flag] and flag != "--address"
    }
    assert not differ, f"defaults (table, --help): {differ}"
    assert documented["--address"] == "$RAY_ADDRESS"
