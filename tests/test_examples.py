"""The embedding examples run as documented: producer prints a ticket, consumer pulls it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_producer_consumer_examples() -> None:
    env = dict(os.environ, NIXL_LOG_LEVEL="WARN")
    producer = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "producer.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert producer.stdout is not None
        ticket = producer.stdout.readline()
        assert '"request_id":"request-1"' in ticket.replace(" ", "")
        consumer = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "consumer.py")],
            input=ticket,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert consumer.returncode == 0, consumer.stderr
        assert "OK" in consumer.stdout
        _, err = producer.communicate(timeout=60)
        assert producer.returncode == 0, err
        assert "blocks freed" in err
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()


def test_paged_allocator_properties_example() -> None:
    # The engine-author example of docs/TESTING.md: a paged allocator with prefix-cache
    # hits, property-tested against kvxfer's plan by copying real bytes.
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "paged_allocator_properties.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("OK: 60 prompt streams landed exactly")
