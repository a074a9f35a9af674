"""``kvxfer doctor`` (R-CLI-1): on this machine, and on a fake RDMA host in a netns."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvxfer.tools.doctor import AUTH_SECRET_ENV, main
from tests.ports import free_port
from tests.railfakes import STANDARD_NICS, NetNs, build_sysfs, netns_context

pytestmark = pytest.mark.proc

HAS_RDMA = Path("/sys/class/infiniband").is_dir()
HAS_NIXL = importlib.util.find_spec("nixl") is not None


def checks_of(report: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {c["name"]: c for c in report["checks"]}


def test_doctor_json_on_this_machine_reports_no_rdma() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "doctor", "--json", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)  # stdout is exactly one JSON object
    assert report["ready"] is False
    checks = checks_of(report)
    assert list(checks)[:5] == [
        "accelerator NUMA node",
        "RDMA link state",
        "default route",
        "IPv4 addresses",
        "NIC NUMA nodes",
    ]
    assert {"NIXL plugins", "nixl-rbln", "side-channel port", "rails"} <= set(checks)
    # localhost without a secret: unauthenticated, but only this host can reach it
    assert checks["side-channel auth"]["status"] == "info"
    if not HAS_RDMA:
        assert report["summary"].startswith("NOT READY: this host has no RDMA NIC")
        assert "no RDMA subsystem" in report["summary"]
        assert checks["RDMA link state"]["status"] == "fail"
        assert checks["rails"]["detail"] == "none: no RDMA NIC on this host"
        assert report["nics"] == [] and report["rails"] == []
        assert report["ucx_net_devices"] is None


def test_doctor_text_on_this_machine_says_so_plainly(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--port", str(free_port())])
    out = capsys.readouterr().out
    assert rc == 1
    assert out.startswith("kvxfer doctor: NOT READY")
    if not HAS_RDMA:
        assert "this host has no RDMA NIC" in out.splitlines()[0]
        assert "rails: none" in out
    if shutil.which("rbln-smi") is None:
        assert "rbln-smi not found" in out


# ------------------------------------------------------------ side-channel auth


@pytest.mark.parametrize(
    ("host", "secret", "status", "words"),
    [
        ("0.0.0.0", None, "warn", ("UNAUTHENTICATED on 0.0.0.0", "KVXFER_AUTH_SECRET")),
        ("0.0.0.0", "a-shared-secret-of-32-bytes-long", "ok", ("HMAC-SHA256",)),
        ("127.0.0.1", "short", "fail", ("5 bytes", "under 16 bytes")),
    ],
    ids=["open-on-all-interfaces", "secret", "short-secret"],
)
def test_doctor_judges_side_channel_auth(
    host: str,
    secret: str | None,
    status: str,
    words: tuple[str, ...],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if secret is None:
        monkeypatch.delenv(AUTH_SECRET_ENV, raising=False)
    else:
        monkeypatch.setenv(AUTH_SECRET_ENV, secret)
    _, report = run_json(capsys, "--host", host, "--port", str(free_port()))
    check = checks_of(report)["side-channel auth"]
    assert check["status"] == status, check
    assert all(w in check["detail"] for w in words), check
    assert "side-channel auth" not in report["summary"] or status == "fail"


def test_doctor_reads_the_adapters_secret_variable() -> None:
    from kvxfer.adapters.vllm.startup import AUTH_SECRET_ENV as ADAPTER_ENV

    assert AUTH_SECRET_ENV == ADAPTER_ENV


# ------------------------------------------------------------ a fake RDMA host


@pytest.fixture
def ns() -> Iterator[NetNs]:
    with netns_context() as made:
        yield made.standard()


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    return build_sysfs(tmp_path / "sys", STANDARD_NICS)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    rc = main(["--json", *argv])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.netns
def test_doctor_ready_on_a_host_with_a_qualifying_nic(
    sysfs: Path, ns: NetNs, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--sysfs-root", str(sysfs), "--netns", ns.name, "--port", str(free_port())]
    rc, report = run_json(capsys, *common, "--numa-node", "0")
    assert rc == 0, report["summary"]
    assert report["ready"] is True
    assert report["summary"] == "READY: 1 rail(s) on numa=0"
    assert [r["device"] for r in report["rails"]] == ["mlx5_1"]
    assert report["ucx_net_devices"] == "mlx5_1:1"
    verdicts = {n["nic"]: (n["rail"], n["reasons"]) for n in report["nics"]}
    assert verdicts["mlx5_1:1"] == (True, [])
    assert verdicts["mlx5_0:1"] == (False, ["netdev r0 carries the default route"])
    assert verdicts["mlx5_4:1"] == (False, ["netdev r4 has no IPv4 address"])
    checks = checks_of(report)
    assert checks["default route"]["detail"] == "via r0 (never a rail)"
    assert checks["RDMA link state"]["detail"].startswith("4 ACTIVE: mlx5_0:1 ACTIVE (r0)")
    assert "r1 10.90.1.1/24" in checks["IPv4 addresses"]["detail"]
    assert checks["NIC NUMA nodes"]["status"] == "ok"

    # The same host, text mode: the table carries the verdicts.
    assert main([*common, "--numa-node", "0"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("mlx5_1:1"))
    assert row.split()[1:5] == ["ACTIVE", "ethernet", "r1", "10.90.1.1/24"]
    assert row.rstrip().endswith("RAIL")
    assert "reject: on numa=1, accelerator on numa=0" in out
    assert "UCX_NET_DEVICES=mlx5_1:1" in out

    # Moving the default route moves the rail.
    ns.ip("route", "replace", "default", "via", "10.90.1.254", "dev", "r1", "onlink")
    rc, report = run_json(capsys, *common, "--numa-node", "0")
    assert rc == 0 and report["ucx_net_devices"] == "mlx5_0:1"


@pytest.mark.netns
def test_doctor_not_ready_when_no_nic_on_the_numa_node(
    sysfs: Path, ns: NetNs, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, report = run_json(
        capsys,
        *("--sysfs-root", str(sysfs), "--netns", ns.name, "--port", str(free_port())),
        *("--numa-node", "3"),
    )
    assert rc == 1
    checks = checks_of(report)
    assert checks["rails"]["status"] == "fail"
    assert checks["rails"]["detail"] == "no usable data-plane RoCE NIC on numa=3"
    assert checks["NIC NUMA nodes"]["detail"].endswith("0 on numa=3")
    assert all(not n["rail"] for n in report["nics"])


@pytest.mark.netns
def test_doctor_not_ready_when_side_channel_port_is_taken(
    sysfs: Path, ns: NetNs, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as holder:
        holder.bind(("localhost", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        rc, report = run_json(
            capsys,
            *("--sysfs-root", str(sysfs), "--netns", ns.name, "--numa-node", "0"),
            *("--port", str(port)),
        )
    assert rc == 1
    check = checks_of(report)["side-channel port"]
    assert check["status"] == "fail"
    assert f"localhost:{port} cannot be bound" in check["detail"]
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" in check["detail"]


@pytest.mark.netns
@pytest.mark.skipif(shutil.which("rbln-smi") is not None, reason="rbln-smi present")
def test_doctor_without_accelerator_numa_judges_the_other_rules(
    sysfs: Path, ns: NetNs, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, report = run_json(
        capsys, "--sysfs-root", str(sysfs), "--netns", ns.name, "--port", str(free_port())
    )
    assert rc == 1
    assert report["numa_node"] is None and report["rails"] == []
    checks = checks_of(report)
    assert checks["accelerator NUMA node"]["status"] == "fail"
    assert checks["rails"]["detail"] == "none: the accelerator's NUMA node is unknown"
    reasons = {n["nic"]: n["reasons"] for n in report["nics"]}
    assert reasons["mlx5_1:1"] == [] and reasons["mlx5_2:1"] == []  # NUMA not judged
    assert reasons["mlx5_3:1"] == ["port is DOWN, not ACTIVE"]


# ------------------------------------------------------------ GPU hosts


@pytest.mark.parametrize(
    ("value", "status", "words"),
    [
        (None, "ok", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (kvxfer's default)"),
        ("on", "ok", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on (set)"),
        ("auto", "warn", "then go through host memory over TCP"),
        ("n", "warn", "unset it or set y"),
    ],
)
def test_doctor_says_whether_gpu_pulls_use_cuda_ipc(
    tmp_path: Path, value: str | None, status: str, words: str
) -> None:
    from kvxfer.tools.doctor import cuda_ipc_check

    (tmp_path / "0000:00:06.0").mkdir()
    env = {} if value is None else {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": value}
    check = cuda_ipc_check(env, tmp_path)
    assert check is not None and check.name == "cuda_ipc GETs"
    assert check.status.value == status and words in check.detail


def test_doctor_has_no_cuda_ipc_line_without_a_gpu(tmp_path: Path) -> None:
    from kvxfer.tools.doctor import cuda_ipc_check

    assert cuda_ipc_check({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}, tmp_path / "absent") is None
    assert cuda_ipc_check({}, tmp_path) is None  # the driver's listing, empty
