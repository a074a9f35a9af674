"""Byte-level check of a KV transfer: digests written inside the engines, compared here.

:mod:`tests.e2e.verify_connector` (loaded into the real vLLM servers) writes one JSON
line per request and tensor-parallel rank to ``$KVXFER_VERIFY_OUT``: on a producer
rank when it holds a prompt's blocks for the consumer, on a consumer rank once that
request's load completed (before decode's own forward touches the blocks). Each line
holds one digest per (layer, K or V, *global* KV head, token position) of the bytes
that token's head occupies in that rank's cache.

This module reads those lines and compares them; it imports neither torch nor vLLM,
so the test process stays light.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvxfer.adapters.vllm.scheduler import base_request_id

__all__ = [
    "ENV",
    "Comparison",
    "DigestRecord",
    "Key",
    "compare",
    "read_records",
    "transfer_id",
    "wait_for_records",
]

#: The environment variable naming the directory the verifying connector writes to.
ENV = "KVXFER_VERIFY_OUT"

#: (layer name, "K" or "V", global KV head, token position in the prompt).
Key = tuple[str, str, int, int]


@dataclasses.dataclass(frozen=True)
class DigestRecord:
    """One rank's digests of one request (a JSON line of the verifying connector).

    Attributes:
        side: ``"producer"`` (at the hold) or ``"consumer"`` (at the load's end).
        request_id: vLLM's request id on that instance.
        transfer_id: the id both sides know the transfer by (pull: the producer's
            request id; push: the base id), which pairs producer and consumer lines.
        tp_rank: the rank that wrote the line; ``tp_size`` its instance's TP size.
        start: first token position digested; ``end``: one past the last.
        heads: the global KV heads this rank holds.
        digests: per (layer, part, global head), one hex digest per token from
            ``start``.
        error: set instead of digests when the connector could not take them.
    """

    side: str
    request_id: str
    transfer_id: str
    tp_rank: int
    tp_size: int
    start: int
    end: int
    heads: tuple[int, ...]
    digests: dict[tuple[str, str, int], list[str]]
    error: str | None = None

    @classmethod
    def from_json(cls, line: str) -> DigestRecord:
        raw: dict[str, Any] = json.loads(line)
        digests: dict[tuple[str, str, int], list[str]] = {}
        for name, values in (raw.get("digests") or {}).items():
            layer, part, head = str(name).rsplit("|", 2)
            digests[(layer, part, int(head))] = [str(v) for v in values]
        return cls(
            side=str(raw["side"]),
            request_id=str(raw["request_id"]),
            transfer_id=str(raw["transfer_id"]),
            tp_rank=int(raw["tp_rank"]),
            tp_size=int(raw["tp_size"]),
            start=int(raw.get("start", 0)),
            end=int(raw.get("end", 0)),
            heads=tuple(int(h) for h in raw.get("heads", ())),
            digests=digests,
            error=raw.get("error"),
        )

    def items(self) -> Iterator[tuple[Key, str]]:
        """Every (key, digest) of this record."""
        for (layer, part, head), values in self.digests.items():
            for i, value in enumerate(values):
                yield (layer, part, head, self.start + i), value


def transfer_id(params: dict[str, Any]) -> str:
    """The id both sides' records of the transfer behind a producer's
    ``kv_transfer_params`` carry: pull, the producer's request id; push, its base id
    (vLLM's random suffix stripped: the producer holds and the consumer registers
    under it)."""
    rid = str(params["remote_request_id"])
    return base_request_id(rid) if params.get("transfer_mode") == "push" else rid


def read_records(directory: Path) -> list[DigestRecord]:
    """Every record written so far under ``directory`` (all files, all ranks); a
    line a rank is still writing (no newline yet) is left for the next read."""
    out: list[DigestRecord] = []
    for path in sorted(directory.glob("*.jsonl")):
        *lines, _partial = path.read_text().split("\n")
        for line in lines:
            if line.strip():
                out.append(DigestRecord.from_json(line))
    return out


def wait_for_records(
    directory: Path, transfer_id: str, *, timeout_s: float = 10.0
) -> tuple[list[DigestRecord], list[DigestRecord]]:
    """The producer and consumer records of ``transfer_id``, one per rank of each
    side (as many as the ``tp_size`` the records carry), waiting up to ``timeout_s``
    for them: a producer's hold runs in an engine step after its response left.

    Raises:
        AssertionError: not every rank wrote its record in time, one wrote twice, or
            one wrote an error instead of digests.
    """

    def complete(records: list[DigestRecord]) -> bool:
        return bool(records) and len(records) >= records[0].tp_size

    deadline = time.monotonic() + timeout_s
    while True:
        mine = [r for r in read_records(directory) if r.transfer_id == transfer_id]
        prod = sorted((r for r in mine if r.side == "producer"), key=lambda r: r.tp_rank)
        cons = sorted((r for r in mine if r.side == "consumer"), key=lambda r: r.tp_rank)
        if complete(prod) and complete(cons):
            break
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{transfer_id}: producer ranks {[r.tp_rank for r in prod]} and consumer "
                f"ranks {[r.tp_rank for r in cons]} wrote digests in {directory}"
            )
        time.sleep(0.1)
    for side, records in (("producer", prod), ("consumer", cons)):
        ranks = [r.tp_rank for r in records]
        assert ranks == list(range(records[0].tp_size)), f"{transfer_id}: {side} ranks {ranks}"
        for r in records:
            assert r.error is None, f"{transfer_id}: {side} rank {r.tp_rank}: {r.error}"
    return prod, cons


@dataclasses.dataclass
class Comparison:
    """The result of :func:`compare`.

    Attributes:
        compared: consumer digests checked against a producer digest.
        expected: the (layer, part, head, token) keys the consumers had to cover:
            every layer and part the producers digested, every global head, every
            token of the consumers' range.
        token_range: the consumers' ``(start, end)``.
        mismatches: keys whose consumer digest differs from the producer's.
        not_on_producer: consumer keys no producer record has.
        missing: expected keys no consumer rank reported.
        repeated: keys more than one consumer rank reported.
        problems: anything else wrong (ranges that differ between ranks, ...).
    """

    compared: int = 0
    expected: int = 0
    token_range: tuple[int, int] = (0, 0)
    mismatches: list[Key] = dataclasses.field(default_factory=list)
    not_on_producer: list[Key] = dataclasses.field(default_factory=list)
    missing: list[Key] = dataclasses.field(default_factory=list)
    repeated: list[Key] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.mismatches
            or self.not_on_producer
            or self.missing
            or self.repeated
            or self.problems
            or self.compared == 0
        )

    def summary(self) -> str:
        def first(keys: Sequence[Key]) -> str:
            return f"{len(keys)} (first {sorted(keys)[:4]})"

        return (
            f"compared {self.compared} of {self.expected} over tokens {self.token_range}; "
            f"mismatches {first(self.mismatches)}; not on producer "
            f"{first(self.not_on_producer)}; missing {first(self.missing)}; repeated "
            f"{first(self.repeated)}; problems {self.problems}"
        )


def compare(
    producers: Iterable[DigestRecord], consumers: Iterable[DigestRecord], *, replicas: int = 1
) -> Comparison:
    """Check every consumer digest against the producer digest of the same (layer,
    K/V, global head, token), and that the consumer ranks together cover every
    (layer, K/V, head, token) of their range exactly ``replicas`` times (the consumer
    ranks holding each head: 1 when the consumer's TP size is at most the number of KV
    heads)."""
    producers, consumers = list(producers), list(consumers)
    result = Comparison()
    source: dict[Key, str] = {}
    layers_parts: set[tuple[str, str]] = set()
    heads: set[int] = set()
    for rec in producers:
        heads.update(rec.heads)
        for key, value in rec.items():
            if source.setdefault(key, value) != value:
                result.problems.append(f"producer ranks disagree on {key}")
            layers_parts.add((key[0], key[1]))
    ranges = {(rec.start, rec.end) for rec in consumers}
    if len(ranges) != 1:
        result.problems.append(f"consumer ranks cover different token ranges {sorted(ranges)}")
        return result
    start, end = result.token_range = ranges.pop()
    if start >= end:
        result.problems.append(f"empty consumer token range {(start, end)}")
    seen: Counter[Key] = Counter()
    for rec in consumers:
        for key, value in rec.items():
            seen[key] += 1
            want = source.get(key)
            if want is None:
                result.not_on_producer.append(key)
                continue
            result.compared += 1
            if want != value:
                result.mismatches.append(key)
    expected = {
        (layer, part, head, token)
        for layer, part in layers_parts
        for head in heads
        for token in range(start, end)
    }
    result.expected = len(expected)
    result.missing = sorted(expected - set(seen))
    result.repeated = sorted(k for k, n in seen.items() if n > replicas)
    result.missing += sorted(k for k, n in seen.items() if 0 < n < replicas)
    return result
