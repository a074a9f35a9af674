"""The backend notifications an agent drains, and what each may do (issue 16).

A consumer's DONE/ABORT notice frees a producer's hold only with the hold's
capability; a producer's PUSHED/FAILED notice settles a push reception only when it
echoes the reception's registration token; anything undecodable, unauthenticated or
without the right token is ignored and counted (``notices_failed``,
``capability_rejects``). :class:`Notices` is the runtime's (internal; it runs under
the agent lock).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvxfer._agent.guard import FreeReason
from kvxfer._agent.leases import LeaseBook
from kvxfer._agent.local import LocalEnd
from kvxfer._agent.readers import ReaderCount
from kvxfer._agent.receptions import Receptions
from kvxfer.agent_config import AgentStats
from kvxfer.core import wire
from kvxfer.errors import KvxferError, TransferError
from kvxfer.transfer import FailureKind, Transfer
from kvxfer.types import Role

__all__ = ["Notices"]

log = logging.getLogger("kvxfer.agent")


class Notices:
    """Acts on drained notifications (internal).

    Args:
        local: Identity and the shared secret that authenticates notices.
        leases: The producer's holds (freed by DONE/ABORT).
        receptions: The consumer's push receptions (settled by PUSHED/FAILED).
        stats: The agent's counters.
        fail: Fails a transfer (the runtime's).
        readers: Counts the consumer ranks that read one request across TP sizes: a
            hold is freed once every one of them reported.
    """

    def __init__(
        self,
        local: LocalEnd,
        leases: LeaseBook,
        receptions: Receptions,
        stats: AgentStats,
        fail: Callable[[Transfer, FailureKind, BaseException], None],
        readers: ReaderCount,
    ) -> None:
        self._local = local
        self._config = local.config
        self._leases = leases
        self._receptions = receptions
        self._stats = stats
        self._fail = fail
        self._readers = readers

    def handle(self, notes: list[tuple[str, bytes]]) -> list[Transfer]:
        """Act on drained notices (under the lock); returns the push receptions that are
        now complete, for the caller to settle outside the lock (stage-in copies)."""
        complete: list[Transfer] = []
        receptions = self._receptions
        for sender, payload in notes:
            # A final PUSHED notice its producer announced (already checked when the
            # registration's reply brought it): known by its exact bytes while fresh.
            known = receptions.announced(payload)
            if known is not None:
                t = receptions.pushed(known)
                if t is not None:
                    complete.append(t)
                continue
            try:
                # With a shared secret a notice must be signed by it: a DONE frees held
                # blocks and a PUSHED settles a transfer, so neither may be forged.
                notice = wire.decode_notice(
                    payload,
                    max_bytes=self._config.max_message_bytes,
                    auth_key=self._local.auth_key,
                )
            except KvxferError as exc:
                self._stats.notices_failed += 1
                log.warning("ignored a notification from %s: %s", sender, exc)
                continue
            if notice.kind in (wire.NoticeKind.DONE, wire.NoticeKind.ABORT):
                self._hold_notice(notice)
            elif notice.kind is wire.NoticeKind.FAILED:
                expected = receptions.of(notice)
                if expected is None:
                    continue
                if not self._token_ok(expected, notice):
                    continue
                receptions.unexpect(notice.request_id, notice.source)
                reason = f": {notice.reason}" if notice.reason else ""
                self._fail(
                    expected,
                    FailureKind.PEER_GONE,
                    TransferError(f"producer {notice.engine_id} reported a failed write{reason}"),
                )
            elif notice.kind is wire.NoticeKind.PUSHED:
                expected = receptions.of(notice)
                if expected is not None and not self._token_ok(expected, notice):
                    continue
                t = receptions.pushed(notice)
                if t is not None:
                    complete.append(t)
        return complete

    def _token_ok(self, reception: Transfer, notice: wire.Notice) -> bool:
        """Whether a PUSHED/FAILED notice echoes the reception's registration token
        (a forged one would settle it); counted when not."""
        token = reception.meta.capability
        if not token or wire.capability_matches(token, notice.capability):
            return True
        self._stats.capability_rejects += 1
        self._stats.notices_failed += 1
        log.warning(
            "ignored a %s notice for %s: wrong capability", notice.kind.value, notice.request_id
        )
        return False

    def _hold_notice(self, notice: wire.Notice) -> None:
        """A consumer's DONE/ABORT notice: frees the hold only with its capability."""
        leases = self._leases
        lease = leases.held.get(notice.request_id)
        if lease is None:
            # Not held (yet): remembered (capped) so its hold frees at once; a stranger
            # can cause a recompute that way, never a wrong DONE (the guard word).
            if self._config.role is not Role.CONSUMER:
                leases.remember_early(notice.request_id)
            return
        if not leases.authorized(lease, notice.capability):
            self._stats.capability_rejects += 1
            self._stats.notices_failed += 1
            log.warning(
                "ignored a %s notice for %s from %s: wrong capability",
                notice.kind.value,
                notice.request_id,
                notice.engine_id,
            )
            return
        if not self._readers.last(notice.request_id, notice.readers, notice.reader):
            return  # other consumer ranks may still read it (TP sizes differ)
        done = notice.kind is wire.NoticeKind.DONE
        leases.free(notice.request_id, FreeReason.DONE if done else FreeReason.ABORTED)
