"""Running ``kvxfer bench`` as a user does, in a child process, for the bench's tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def bench(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m kvxfer.cli bench ARGV``: its exit status and output."""
    return subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "bench", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rereport(tmp_path: Path, jsonl: str) -> subprocess.CompletedProcess[str]:
    """Save a ``--json`` run's output and report it again with ``--from-json``."""
    saved = tmp_path / "run.jsonl"
    saved.write_text(jsonl)
    return bench("--from-json", str(saved), timeout=60)
