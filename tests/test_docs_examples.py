"""The docs' Python examples that run as they stand on this machine, run.

(`docs/engines.md`'s example runs in tests/trainer_worker/test_engine.py.)
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def python_blocks(page: str, section: str) -> list[str]:
    """The ```python blocks of one `## section` of ``page``."""
    text = (DOCS / page).read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.DOTALL)


def test_the_embedding_example_serves_on_loopback() -> None:
    (block,) = python_blocks("coordinator.md", "Embedding it")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "docs/coordinator.md", "exec"), {"__name__": "docs_example"})
    target, metrics_url = out.getvalue().split()
    assert re.fullmatch(r"127\.0\.0\.1:\d+", target), target
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", metrics_url), metrics_url
