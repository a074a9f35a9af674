"""This agent as its parts see it: who it is, what memory it registered, how it signs.

One :class:`LocalEnd` is shared by the Agent's runtime, push writer and peer cache
(none of which holds the Agent): the identity the handshake announces, the layout and
descriptor table once memory is registered, and the encoding of signed messages.
"""

from __future__ import annotations

from kvxfer.agent_config import AgentConfig
from kvxfer.core import blocks, wire
from kvxfer.core.blocks import BlockIds
from kvxfer.core.descriptors import DescriptorTable
from kvxfer.core.heads import TPRank, heads_per_region
from kvxfer.core.layout import GroupKind, KVLayout
from kvxfer.core.staging import StagingSlots
from kvxfer.core.tp_plan import HeadSection
from kvxfer.errors import RegistrationError
from kvxfer.types import Direction, Role, posts

__all__ = ["LocalEnd"]


class LocalEnd:
    """Identity and registered memory of one agent (internal).

    Attributes:
        config: The agent's configuration.
        incarnation: This process life's random id (R-HS-4).
        compat_hash: The fingerprint's digest, carried by every message.
        auth_key: The side channel's shared secret as bytes (None: unsigned).
        layout: The layout as the engine described it (None until registered).
        exposed_layout: The layout peers address (the backend's view of ``layout``).
        table: The descriptor table of ``exposed_layout``.
        heads: Its regions one head each, prepared after ``table`` (a posting side
            whose regions hold several heads: pairs across TP sizes may need them),
            else None.
        deferred: A layout kept until :meth:`Agent.complete_registration`.
    """

    def __init__(self, config: AgentConfig, incarnation: int) -> None:
        self.config = config
        self.incarnation = incarnation
        self.compat_hash = config.fingerprint.digest()
        self.auth_key = config.auth_secret.encode() if config.auth_secret else None
        self.layout: KVLayout | None = None
        self.exposed_layout: KVLayout | None = None
        self.table: DescriptorTable | None = None
        self.heads: HeadSection | None = None
        self.deferred: KVLayout | None = None
        #: What ``exposed_layout`` says of block ids (None until registered).
        self.rules: blocks.BlockRules | None = None
        #: The gather path's staging buffer as the handshake announces it, and its
        #: slots (None: gather off, or the backend has no staging memory; issue 55).
        self.staging: wire.StagingInfo | None = None
        self.staging_slots: StagingSlots | None = None

    def registered(
        self,
        layout: KVLayout,
        exposed: KVLayout,
        table: DescriptorTable,
        heads: HeadSection | None,
    ) -> None:
        """The memory is registered: ``layout`` as the engine gave it, ``exposed`` as
        peers address it, its table and head section."""
        self.layout, self.exposed_layout, self.table, self.heads = layout, exposed, table, heads
        self.rules = blocks.BlockRules(
            num_groups=len(exposed.groups),
            num_blocks=exposed.num_blocks,
            block_size=exposed.block_size,
            sliding=tuple(g.kind is GroupKind.SLIDING for g in exposed.groups),
            state=tuple(g.is_state for g in exposed.groups),
        )

    def require_registered(self) -> tuple[DescriptorTable, KVLayout]:
        """The table and exposed layout; RegistrationError before registration."""
        if self.table is None or self.exposed_layout is None:
            state = "deferred" if self.deferred is not None else "missing"
            raise RegistrationError(f"KV memory registration is {state}; register() first")
        return self.table, self.exposed_layout

    def block_groups(self, block_ids: BlockIds) -> blocks.Groups:
        """The caller's block ids, checked against the registered layout (one flat list
        serves every group): bad ids fail here, before anything is posted.

        Raises:
            RegistrationError: nothing registered yet.
            PlanError: an id that is not an integer, out of range or repeated.
        """
        rules = self.require_rules()
        return blocks.block_groups(
            block_ids, rules.num_groups, num_blocks=rules.num_blocks, broadcast=True
        )

    def check_counts(self, local: blocks.Groups, num_tokens: int, cached_blocks: int) -> int:
        """The block count rule (:func:`kvxfer.core.blocks.check_counts`) for this layout."""
        rules = self.require_rules()
        return blocks.check_counts(
            local,
            num_tokens=num_tokens,
            block_size=rules.block_size,
            cached_blocks=cached_blocks,
            sliding=rules.sliding,
            state=rules.state,
        )

    def require_rules(self) -> blocks.BlockRules:
        """The block-id rules; RegistrationError before registration."""
        if self.rules is None:
            self.require_registered()  # raises, saying why
        assert self.rules is not None
        return self.rules

    @property
    def block_size(self) -> int:
        """The registered layout's block size (RegistrationError before registration)."""
        _, layout = self.require_registered()
        return layout.block_size

    def encode(self, msg: wire.Message) -> bytes:
        """``msg`` framed, with the compatibility hash, signed when a secret is set."""
        return wire.encode(msg, self.compat_hash, auth_key=self.auth_key)

    def hello(self, expected_engine_id: str | None) -> wire.Hello:
        """The handshake's opening message to a peer."""
        if self.exposed_layout is None:
            raise RegistrationError("register memory before connecting to peers")
        config = self.config
        return wire.Hello(
            engine_id=config.engine_id,
            expected_engine_id=expected_engine_id,
            incarnation=self.incarnation,
            role=config.role,
            direction=config.direction,
            layout=self.exposed_layout,
            rails=config.rails,
            tp=config.tp,
        )

    @property
    def posts(self) -> bool:
        """Whether this agent posts transfers (a pull's consumer, a push's producer,
        either as ``kv_both``): only such a side plans against its peers' tables."""
        return posts(self.config.role, self.config.direction)

    def across_tp(self, theirs: TPRank | None, role: Role, direction: Direction) -> TPRank | None:
        """This rank's TP identity when this agent is ``role`` in ``direction`` and
        ``theirs`` (a peer's) is of another TP size; None otherwise (nothing to plan
        per rank ahead)."""
        config = self.config
        mine = config.tp
        if (
            config.role is not role
            or config.direction is not direction
            or mine is None
            or theirs is None
            or mine.heads.tp_size == theirs.heads.tp_size
        ):
            return None
        return mine

    def posting_table(self, peer_heads: int) -> tuple[DescriptorTable, int]:
        """The table this agent posts from against a peer table whose regions hold
        ``peer_heads`` heads each (across TP sizes), and where its ids start in the
        prepared list: the one-head section when the peer's regions hold fewer heads
        than ours (the peer's table was cut at the handshake to match it), else the
        whole-block table.

        Raises:
            RegistrationError: nothing registered yet.
            LayoutError: the layout disagrees with this agent's head layout.
        """
        table, _ = self.require_registered()
        tp = self.config.tp
        if tp is None or self.heads is None:
            return table, 0
        if peer_heads < heads_per_region(table.layout, tp.heads, tp.rank):
            return self.heads.table, self.heads.offset
        return table, 0
