"""`kvxfer probe` against a live side channel."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from kvxfer.agent import Agent, AgentConfig
from kvxfer.core.compat import Fingerprint
from kvxfer.testing.kvcache import HostKVCache, ModelShape
from kvxfer.tools import probe
from kvxfer.types import Direction, Role

FP = Fingerprint(
    model="org/model",
    dtype="bfloat16",
    kv_cache_dtype="bfloat16",
    attention_backend="flash",
    direction=Direction.PULL,
)
SECRET = "probe-test-shared-secret"


@pytest.fixture(scope="module")
def instance() -> Iterator[Agent]:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    cache = HostKVCache(ModelShape(name="t", layers=2, kv_heads=2, head_dim=32), 16, 16)
    agent = Agent(
        AgentConfig(
            engine_id="prefill-probe", fingerprint=FP, role=Role.PRODUCER, auth_secret=SECRET
        )
    )
    agent.register(cache.layout())
    agent.serve()
    yield agent
    agent.close()


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, object]]:
    rc = probe.main([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_probe_reports_identity_and_layout(
    instance: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    addr = f"127.0.0.1:{instance.address[1]}"
    rc, out = _run(capsys, addr, "--secret", SECRET)
    assert rc == 0
    assert out["engine_id"] == "prefill-probe"
    assert out["compat_hash"] == FP.digest()
    assert out["registered"] is True
    assert out["role"] == "kv_producer" and out["direction"] == "pull"
    assert "block_size=16" in str(out["layout_summary"]) or "16" in str(out["layout_summary"])


def test_probe_compatibility_verdicts(instance: Agent, capsys: pytest.CaptureFixture[str]) -> None:
    addr = f"127.0.0.1:{instance.address[1]}"
    same = ["--model", "org/model", "--attention-backend", "flash", "--block-size", "16"]
    rc, out = _run(capsys, addr, "--secret", SECRET, *same)
    assert rc == 0 and out["compatible"] is True
    rc, out = _run(capsys, addr, "--secret", SECRET, *same[:-1], "32")
    assert rc == 1 and any("block_size 16 vs local 32" in p for p in out["problems"])  # type: ignore[union-attr]
    rc, out = _run(capsys, addr, "--secret", SECRET, "--model", "org/other")
    assert rc == 1 and any("compatibility hash" in p for p in out["problems"])  # type: ignore[union-attr]
    rc, out = _run(
        capsys, addr, "--secret", SECRET, *same, "--kv-connector", "RblnNixlPushConnector"
    )
    assert rc == 1


def test_probe_resolves_kv_cache_dtype_auto_as_vllm_does(
    instance: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    # The instance hashed kv_cache_dtype="bfloat16" (its model dtype): the probe's default
    # --kv-cache-dtype auto must resolve to --dtype to match it, an explicit other must not.
    addr = f"127.0.0.1:{instance.address[1]}"
    same = ["--model", "org/model", "--attention-backend", "flash"]
    rc, out = _run(capsys, addr, "--secret", SECRET, *same, "--kv-cache-dtype", "auto")
    assert rc == 0 and out["compatible"] is True
    rc, out = _run(capsys, addr, "--secret", SECRET, *same, "--kv-cache-dtype", "float16")
    assert rc == 1 and out["compatible"] is False
    with pytest.raises(SystemExit):
        probe.main([addr, "--secret", SECRET, *same, "--dtype", "auto"])


def test_probe_without_secret_is_refused(
    instance: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out = _run(capsys, f"127.0.0.1:{instance.address[1]}")
    assert rc == 1 and out["reachable"] is False and "auth" in str(out["error"]).lower()


def test_probe_unreachable_names_address(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys, "127.0.0.1:9", "--timeout", "0.2", "--retries", "0")
    assert rc == 1 and "127.0.0.1:9" in str(out["error"])


def test_probe_bad_address(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys, "nohostport")
    assert rc == 1 and "HOST:PORT" in str(out["error"])
