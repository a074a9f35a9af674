"""``kvxfer bench --hybrid``: the hybrid-model savings table (algebra only)."""

from __future__ import annotations

import pytest

from kvxfer.tools.bench import hybrid
from kvxfer.tools.bench.cli import main as bench_main


def test_rows_count_the_bytes_each_mode_moves() -> None:
    tokens, bs = 1000, 512
    by_mode = {r.mode: r for r in hybrid.rows([(tokens, bs)], repeats=1)}
    assert list(by_mode) == list(hybrid.MODES)
    layer_block = hybrid.KV_HEADS * 2 * bs * hybrid.HEAD_DIM * hybrid.ELT
    half = hybrid.LAYERS // 2
    # Without the hybrid manager every layer moves both blocks of the prompt; with it a
    # sliding layer moves only the last one (the window [872, 1000) lies in block 1).
    assert by_mode["no-HMA"].nbytes == hybrid.LAYERS * 2 * layer_block
    assert by_mode["whole"].nbytes == half * 2 * layer_block + half * layer_block
    # swa: the window [872, 1000) touches granules 6 and 7, tokens [768, 1024): half of
    # block 1; chunk: 488 tokens in the last block fill all 4 chunks of 128.
    head_tokens = hybrid.KV_HEADS * 2 * hybrid.HEAD_DIM * hybrid.ELT
    assert by_mode["swa"].nbytes == half * 2 * layer_block + half * 256 * head_tokens
    assert by_mode["chunk"].nbytes == by_mode["whole"].nbytes
    # Whole blocks merge into one run per layer (contiguous ids); cut ones do not.
    assert by_mode["whole"].runs == hybrid.LAYERS
    assert by_mode["swa"].descs > by_mode["swa"].runs > by_mode["whole"].runs


def test_bench_cli_prints_the_table(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hybrid, "CASES", ((600, 512),))
    assert bench_main(["--hybrid"]) == 0
    out = capsys.readouterr().out
    assert "| prompt | block | mode |" in out and "| 600 | 512 | swa+chunk |" in out
