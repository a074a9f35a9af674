"""Prefill and decode on two "hosts": network namespaces joined by a veth pair.

The layout is llm-d's, one pod per namespace: prefill's vLLM on port 8000 of the
prefill host; on the decode host the routing sidecar (tests/e2e/sidecar.py) on 8000
in front of decode's vLLM on 8200. Each engine's side channel listens on its host's
own address, port 5600 (``VLLM_NIXL_SIDE_CHANNEL_HOST`` is the "pod IP", as llm-d
sets it), and its KV goes over the veth: UCX gets ``UCX_TLS=tcp``, as between two
hosts without RDMA (otherwise UCX would take shared memory or CMA, which two
processes of one machine have whatever their network namespaces).

The namespaces come from ``kvxfer.tools.bench.netns.netns_pair`` (root and iproute2
needed); the servers run under ``ip netns exec``, which also gives each its
namespace's ``/sys``, so UCX lists only that host's devices, and its
``/etc/netns/NS/hosts`` as ``/etc/hosts``: there each host resolves the other pod's
"headless Service" name (:data:`SERVICE`) to that pod's address, and the side that
posts connects ahead by that name (``connect_ahead`` with ``refresh_s``), as a
deployment whose router picks the peer per request would. The test process stays
outside and reaches each server from inside its namespace (tests/e2e/netns_http.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvxfer.tools.bench.netns import NetnsPair, netns_pair, netns_unavailable

from . import sidecar
from .pd import PD_ENV, kv_config, tokens
from .servers import F32_ARGS, REPO_ROOT, VllmServer, adopt, start_server, wait_all_healthy

SIDE_CHANNEL_PORT = 5600  # llm-d's
#: The "headless Service" name of each role's pods, resolved in the other's namespace.
SERVICE = {"prefill": "prefill.kvxfer-e2e.svc", "decode": "decode.kvxfer-e2e.svc"}
PREFILL_PORT = 8000
DECODE_PORT = 8200
SIDECAR_PORT = 8000
#: The engines' ``transfer_timeout_s``: twice the other e2e pairs' 10 s, as a shaped veth
#: and a loaded host make a load under concurrency take several seconds (7.4 s seen).
TRANSFER_TIMEOUT_S = 20
#: Float32 (the test bed's float32 tiny model): AVX2-only hosts have no bf16 kernels.
DTYPE_ARGS = F32_ARGS


@dataclasses.dataclass
class Hosts:
    """The two namespaces ("hosts") and the veth between them."""

    pair: NetnsPair

    @property
    def prefill_ns(self) -> str:
        return self.pair.producer_ns

    @property
    def decode_ns(self) -> str:
        return self.pair.consumer_ns

    @property
    def prefill_addr(self) -> str:
        return self.pair.producer_addr

    @property
    def decode_addr(self) -> str:
        return self.pair.consumer_addr

    def _ends(self) -> tuple[tuple[str, str], tuple[str, str]]:
        return (
            (self.pair.producer_ns, self.pair.producer_dev),
            (self.pair.consumer_ns, self.pair.consumer_dev),
        )

    def set_link(self, up: bool) -> None:
        """Decode's end of the veth up or down (down takes the carrier of both ends)."""
        _run("ip", "-n", self.decode_ns, "link", "set", self.pair.consumer_dev,
             "up" if up else "down")  # fmt: skip

    def link_state(self) -> str:
        out = _run("ip", "-n", self.decode_ns, "-j", "link", "show", self.pair.consumer_dev)
        return str(json.loads(out)[0].get("operstate", "?"))

    def shape(self, rate: str) -> None:
        """Limit each direction of the veth to ``rate`` (``tc tbf``), so a transfer
        takes long enough to be caught mid-way."""
        for ns, dev in self._ends():
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
                 "tbf", "rate", rate, "burst", "32kb", "latency", "2s")  # fmt: skip

    def unshape(self) -> None:
        for ns, dev in self._ends():
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                capture_output=True,
                check=False,
            )

    @contextlib.contextmanager
    def shaped(self, rate: str) -> Iterator[None]:
        self.shape(rate)
        try:
            yield
        finally:
            self.unshape()

    def veth_bytes(self) -> int:
        """Bytes received plus sent by decode's end of the veth so far."""
        out = _run("ip", "-n", self.decode_ns, "-s", "-j", "link", "show", self.pair.consumer_dev)
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])


def _run(*args: str) -> str:
    done = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


@contextlib.contextmanager
def two_hosts(tag: str) -> Iterator[Hosts]:
    """Two fresh namespaces joined by a veth pair; ``tag`` (a few characters) keeps
    their names apart from other test sessions' on this machine."""
    why = netns_unavailable()
    if why is not None:  # CI runs as root with iproute2: a missing piece is a failure
        raise RuntimeError(f"two-host tests need network namespaces: {why}")
    with netns_pair(f"{tag}{os.getpid() % 10000}") as pair:
        hosts = Hosts(pair)
        files = [
            _hosts_file(hosts.decode_ns, SERVICE["prefill"], hosts.prefill_addr),
            _hosts_file(hosts.prefill_ns, SERVICE["decode"], hosts.decode_addr),
        ]
        try:
            yield hosts
        finally:
            for path in files:
                path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    path.parent.rmdir()


def _hosts_file(ns: str, name: str, addr: str) -> Path:
    """``/etc/hosts`` inside ``ns`` (``ip netns exec`` mounts it there): ``name`` is the
    other pod's address."""
    path = Path("/etc/netns") / ns / "hosts"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"127.0.0.1 localhost\n::1 localhost\n{addr} {name}\n")
    return path


def ahead_by_name(mode: str) -> dict[str, Any]:
    """The posting side's ``connect_ahead``: the other role's Service name, resolved
    every second (pull: decode names the prefill pods; push: prefill the decode pods)."""
    other = "prefill" if mode == "pull" else "decode"
    return {"connect_ahead": [{"host": SERVICE[other], "port": SIDE_CHANNEL_PORT, "refresh_s": 1}]}


@dataclasses.dataclass
class Site:
    """One P/D deployment across the two hosts: prefill, decode and decode's sidecar."""

    mode: str
    hosts: Hosts
    prefill: VllmServer
    decode: VllmServer
    sidecar: VllmServer

    @property
    def prefill_target(self) -> str:
        """What the EPP puts in ``x-prefiller-host-port``: prefill's pod IP and port."""
        return f"{self.hosts.prefill_addr}:{PREFILL_PORT}"

    def servers(self) -> list[VllmServer]:
        return [self.prefill, self.decode, self.sidecar]

    def stop(self) -> None:
        for s in (self.sidecar, self.decode, self.prefill):
            s.stop()


def _engine_env(addr: str) -> dict[str, str]:
    return {
        **PD_ENV,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": addr,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(SIDE_CHANNEL_PORT),
        "UCX_TLS": "tcp",
    }


def start_sidecar(name: str, hosts: Hosts, log_dir: Path) -> VllmServer:
    """The routing sidecar on the decode host, in front of decode's vLLM."""
    log_path = log_dir / f"{name}.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            sidecar.command(SIDECAR_PORT, f"127.0.0.1:{DECODE_PORT}", hosts.decode_ns),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
    return adopt(
        VllmServer(
            name=name,
            model="tiny",
            port=SIDECAR_PORT,
            log_path=log_path,
            proc=proc,
            started_at=time.monotonic(),
            host=hosts.decode_addr,
            netns=hosts.decode_ns,
        )
    )


def start_site(
    mode: str,
    model_dir: Path,
    log_dir: Path,
    hosts: Hosts,
    *,
    extra_args: Sequence[str] = DTYPE_ARGS,
    also_wait: Sequence[VllmServer] = (),
) -> Site:
    """Start prefill, decode and the sidecar on the two hosts (start-ups overlap) and
    wait for them and ``also_wait`` (servers started elsewhere with ``wait=False``)."""
    started: list[VllmServer] = []
    try:
        started.append(
            start_server(
                f"prefill-{mode}-2hosts",
                model_dir,
                log_dir,
                port=PREFILL_PORT,
                extra_args=extra_args,
                kv_transfer_config=kv_config(
                    "kv_producer",
                    mode,
                    extra={
                        "transfer_timeout_s": TRANSFER_TIMEOUT_S,
                        **(ahead_by_name(mode) if mode == "push" else {}),
                    },
                ),
                env=_engine_env(hosts.prefill_addr),
                wait=False,
                netns=hosts.prefill_ns,
                host="0.0.0.0",
            )
        )
        started.append(
            start_server(
                f"decode-{mode}-2hosts",
                model_dir,
                log_dir,
                port=DECODE_PORT,
                extra_args=extra_args,
                kv_transfer_config=kv_config(
                    "kv_consumer",
                    mode,
                    extra={
                        "transfer_timeout_s": TRANSFER_TIMEOUT_S,
                        **(ahead_by_name(mode) if mode == "pull" else {}),
                    },
                ),
                env=_engine_env(hosts.decode_addr),
                wait=False,
                netns=hosts.decode_ns,
                host="0.0.0.0",
            )
        )
        started.append(start_sidecar(f"sidecar-{mode}-2hosts", hosts, log_dir))
        wait_all_healthy([*also_wait, *started])
    except BaseException:
        for s in started:
            s.stop(grace_s=3.0)
        raise
    return Site(mode, hosts, *started)


def through_sidecar(
    site: Site, prompt: str | Sequence[int], timeout: float = 60.0, **params: Any
) -> list[int]:
    """A client's request to the decode host's sidecar, prefill named in the header."""
    p = list(prompt) if not isinstance(prompt, str) else prompt
    body: dict[str, Any] = {"logprobs": None, "return_token_ids": True, **params}
    out = site.sidecar.complete(
        p,
        headers={sidecar.PREFILL_HEADER: site.prefill_target},
        timeout=timeout,
        **body,
    )
    return tokens(out)
