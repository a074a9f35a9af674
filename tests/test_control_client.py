"""The side-channel client: bounded waits, and close() cancelling pending requests
(issue 16: a process whose handshake towards a dead peer is pending exits at once)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from kvxfer.errors import HandshakeError, HandshakeTimeout
from kvxfer.io import control
from kvxfer.io.control import SideChannelClient, SideChannelServer


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port where a peer accepts connections and never answers (a hung process)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield port
    sock.close(0)
    ctx.term()


def test_a_request_is_answered() -> None:
    with SideChannelServer(
        "127.0.0.1", 0, lambda data: b"re:" + data, max_bytes=1024, oversize_reply=lambda n: b""
    ) as server:
        client = SideChannelClient(timeout_s=2.0)
        assert client.request("127.0.0.1", server.port, b"hi") == b"re:hi"


def test_no_answer_times_out_after_every_try(silent_port: int) -> None:
    client = SideChannelClient(timeout_s=0.1, retries=1, backoff_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(HandshakeTimeout, match=r"after 2 tries of 0\.1s"):
        client.request("127.0.0.1", silent_port, b"hello")
    assert 0.2 <= time.monotonic() - t0 < 1.5
    # a per-request budget (a liveness probe's) overrides the client's
    t0 = time.monotonic()
    with pytest.raises(HandshakeTimeout, match=r"after 1 tries of 0\.05s"):
        client.request("127.0.0.1", silent_port, b"ping", timeout_s=0.05, retries=0)
    assert time.monotonic() - t0 < 1.0


#: "At once" for a cancelled request: well under one try's 5 s timeout.
_AT_ONCE_S = 2.5


@pytest.mark.parametrize("port_kind", ["silent", "nothing-listens"])
def test_close_cancels_a_pending_request_at_once(silent_port: int, port_kind: str) -> None:
    port = silent_port if port_kind == "silent" else 9  # discard: connection refused
    client = SideChannelClient(timeout_s=5.0, retries=2)
    outcome: list[BaseException] = []
    ended = threading.Event()

    def run() -> None:
        try:
            client.request("127.0.0.1", port, b"hello")
        except BaseException as exc:
            outcome.append(exc)
        ended.set()

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    client.close()
    # Uncancelled, the request would wait out its try (5 s, then two more): half a try
    # tells the two apart on a loaded 2-core host too (0.52 s was seen under load).
    assert ended.wait(_AT_ONCE_S), "close() left the request waiting"
    assert time.monotonic() - t0 < _AT_ONCE_S
    thread.join()
    assert len(outcome) == 1 and isinstance(outcome[0], HandshakeError)
    assert "cancelled" in str(outcome[0]) and f"127.0.0.1:{port}" in str(outcome[0])
    with pytest.raises(HandshakeError, match="cancelled"):  # closed: refused at once
        client.request("127.0.0.1", port, b"again")
    assert client.closed


def test_a_process_with_a_pending_request_exits_soon_after_close(
    silent_port: int,
) -> None:
    # The request runs on a non-daemon thread, as on a ThreadPoolExecutor worker that
    # the interpreter joins at exit: without cancellation the process lives 3 x 5 s.
    script = textwrap.dedent(
        f"""
        import sys, threading, time
        from kvxfer.io.control import SideChannelClient
        client = SideChannelClient(timeout_s=5.0, retries=2)
        def run():
            try:
                client.request("127.0.0.1", {silent_port}, b"hello")
            except Exception as exc:
                # One write per line: print() writes its parts apart, and the two
                # threads' lines interleaved once.
                sys.stdout.write(f"worker: {{type(exc).__name__}}\\n")
                sys.stdout.flush()
        threading.Thread(target=run).start()
        time.sleep(0.3)
        client.close()
        sys.stdout.write(f"closed {{time.monotonic()}}\\n")
        sys.stdout.flush()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30
    )
    exited = time.monotonic()
    assert done.returncode == 0, done.stderr
    closed_at = float(
        next(ln for ln in done.stdout.splitlines() if ln.startswith("closed")).split()[1]
    )
    assert "worker: HandshakeError" in done.stdout
    # Uncancelled, the process lives out 3 x 5 s; its exit itself (interpreter teardown)
    # took 1.23 s once on a loaded host.
    assert exited - closed_at < _AT_ONCE_S, f"exit took {exited - closed_at:.2f}s after close()"


_STALL_SCRIPT = textwrap.dedent(
    """
    import time
    from kvxfer.io.control import SideChannelClient, SideChannelServer

    def held_up_inline(data):
        time.sleep(float(data))  # an inline answer that holds the server thread up
        return b"late"

    with SideChannelServer(
        "127.0.0.1", 0, held_up_inline, max_bytes=1024, oversize_reply=lambda n: b""
    ) as server:
        client = SideChannelClient(timeout_s=5.0, retries=1)
        assert client.request("127.0.0.1", server.port, b"1.2") == b"late"
        assert client.request("127.0.0.1", server.port, b"0") == b"late"
    print("served")
    """
)


@pytest.mark.parametrize("dump_s", ["0.3", ""])
def test_a_held_up_round_writes_every_stack_while_it_lasts(dump_s: str) -> None:
    """KVXFER_STALL_DUMP_S: a round longer than it dumps the threads' stacks during the
    stall (the held-up handler's frame among them); unset, nothing is written."""
    env = {**os.environ, "KVXFER_STALL_DUMP_S": dump_s}
    out = subprocess.run(
        [sys.executable, "-c", _STALL_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "served"
    if dump_s:
        assert "Timeout (0:00:00.300000)!" in out.stderr, out.stderr
        assert "in held_up_inline" in out.stderr, out.stderr
        # (a loaded host may hold up another round past 0.3 s too: at least one dump)
    else:
        assert "Timeout (" not in out.stderr, out.stderr


def test_the_stall_dump_is_rearmed_every_third_of_its_time_not_every_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each arming of the fault handler joins its previous thread and starts a new one
    while holding the GIL: a producer's stall dump (CI 2026-12-02, load 28) caught its
    server thread inside that very call. Armed every 0.1 s round before (10 thread
    starts a second), it is armed every dump_s / 3 now: twice in 1.2 s at dump_s 3."""
    arms: list[float] = []
    monkeypatch.setattr(
        control.faulthandler, "dump_traceback_later", lambda *a, **kw: arms.append(a[0])
    )
    monkeypatch.setattr(control.faulthandler, "cancel_dump_traceback_later", lambda: None)
    monkeypatch.setenv("KVXFER_STALL_DUMP_S", "3")
    with SideChannelServer(
        "127.0.0.1", 0, lambda data: b"pong", max_bytes=1024, oversize_reply=lambda n: b""
    ):
        time.sleep(1.2)
    assert arms and set(arms) == {3.0}
    assert len(arms) <= 2, f"armed {len(arms)} times in 1.2 s"


def test_deferred_work_never_starts_a_thread_on_the_server_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server thread only queues deferred work: its workers are running before it
    serves. A loaded producer once held its server thread in Thread.start() for more
    than 3 s (the new thread not yet run), answering no Ping meanwhile. Here every
    thread started after the server takes 5 s to start: the deferred requests and an
    inline one are still answered at once."""
    with SideChannelServer(
        "127.0.0.1",
        0,
        lambda data: (lambda: b"slow:" + data) if data.startswith(b"hello") else b"pong",
        max_bytes=1024,
        oversize_reply=lambda n: b"",
    ) as server:
        real_start = threading.Thread.start

        def slow_start(self: threading.Thread) -> None:
            time.sleep(5.0)
            real_start(self)

        monkeypatch.setattr(threading.Thread, "start", slow_start)
        client = SideChannelClient(timeout_s=2.0, retries=0)
        t0 = time.monotonic()
        assert client.request("127.0.0.1", server.port, b"hello-1") == b"slow:hello-1"
        assert client.request("127.0.0.1", server.port, b"ping") == b"pong"
        assert client.request("127.0.0.1", server.port, b"hello-2") == b"slow:hello-2"
        assert time.monotonic() - t0 < 2.0
        monkeypatch.undo()
