"""Session fixtures for the end-to-end tests: the tiny model, the unified references
(bf16 and float32) and the pull and push pairs, each started once per session and
shared by every module that needs that configuration.

Set ``KVXFER_SKIP_E2E=1`` (or ``KVXFER_SKIP_VLLM=1``, as scripts/setup_env.sh
uses) to skip every ``e2e`` test; otherwise a missing vLLM is an error, not a skip,
so CI cannot go green without running them. ``KVXFER_E2E_LOGS`` keeps the server
logs in a fixed directory (default: pytest's temporary directory).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .model import build_tiny_model
from .pd import PDPair, start_pair
from .servers import F32_ARGS, VllmServer, kvxfer_log_report, start_server, thread_report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed e2e test's report carries every live vLLM server's last warnings and
    errors (why a request failed) and what its threads did in the second after the
    test failed: a stall (issue 25) shows there as it happens."""
    report = yield
    if report.failed and call.when in ("setup", "call"):
        report.sections.append(("vLLM server warnings and errors", kvxfer_log_report()))
        report.sections.append(("vLLM server threads", thread_report()))
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = os.environ.get("KVXFER_SKIP_E2E") == "1" or os.environ.get("KVXFER_SKIP_VLLM") == "1"
    if not skip:
        return
    marker = pytest.mark.skip(reason="KVXFER_SKIP_E2E/KVXFER_SKIP_VLLM set")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(marker)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Qwen2 model directory (built once, then cached under .cache/)."""
    return build_tiny_model()


@pytest.fixture(scope="session")
def e2e_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    fixed = os.environ.get("KVXFER_E2E_LOGS")
    if fixed:
        path = Path(fixed)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("vllm-logs")


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed: run scripts/setup_env.sh (or set KVXFER_SKIP_E2E=1)")


@pytest.fixture(scope="session")
def unified_server(tiny_model_dir: Path, e2e_log_dir: Path) -> Iterator[VllmServer]:
    """One plain vLLM instance (no connector): the reference P/D output must equal."""
    _require_vllm()
    server = start_server("unified", tiny_model_dir, e2e_log_dir)
    try:
        # The first generation pays one-off costs (kernel selection, detokenizer
        # set-up); take them here so test timings measure steady state.
        server.complete("warm up", max_tokens=2)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def unified_f32(tiny_model_dir: Path, e2e_log_dir: Path) -> Iterator[VllmServer]:
    """The float32 reference (TP1): test_pd_tp's pairs across TP sizes and
    test_pd_two_hosts' sites compare against the same instance. Started without
    waiting: each user waits for it together with its own servers, so the start-ups
    overlap (``wait_all_healthy`` returns at once for a server already up)."""
    _require_vllm()
    server = start_server(
        "unified-f32", tiny_model_dir, e2e_log_dir, extra_args=F32_ARGS, wait=False
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pull_pair(tiny_model_dir: Path, e2e_log_dir: Path) -> Iterator[PDPair]:
    """Prefill and decode with the pull connector, host bounce (session-wide: the
    push tests pair them with push instances)."""
    _require_vllm()
    pair = start_pair("pull", tiny_model_dir, e2e_log_dir)
    try:
        yield pair
    finally:
        pair.stop()


@pytest.fixture(scope="session")
def push_pair(tiny_model_dir: Path, e2e_log_dir: Path) -> Iterator[PDPair]:
    """Prefill and decode with the push connector, host bounce."""
    _require_vllm()
    pair = start_pair("push", tiny_model_dir, e2e_log_dir)
    try:
        yield pair
    finally:
        pair.stop()
