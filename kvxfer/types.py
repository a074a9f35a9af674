"""Engine-neutral vocabulary shared by the core, the Agent and every adapter.

What an instance does with KV (:class:`Role`), who moves the bytes
(:class:`Direction`) and the limits the wire schema enforces. Pure: no imports beyond
the standard library, so every layer may use it.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["MAX_ENGINE_ID_LEN", "Direction", "Role", "posts"]


class Role(enum.Enum):
    """What an instance does with KV: produce it (prefill), consume it (decode), or both."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"


class Direction(enum.Enum):
    """Who moves the bytes: the consumer READs (pull) or the producer WRITEs (push)."""

    PULL = "pull"
    PUSH = "push"


def posts(role: Role, direction: Direction) -> bool:
    """Whether an instance of ``role`` posts transfers in ``direction`` (a pull's
    consumer, a push's producer, either as ``kv_both``): only that side plans against
    its peers' tables and connects to them ahead of requests."""
    return role is not (Role.PRODUCER if direction is Direction.PULL else Role.CONSUMER)


#: Engine ids travel in every handshake frame; the wire schema bounds them to this.
MAX_ENGINE_ID_LEN: Final = 256
