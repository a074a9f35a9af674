"""Start-up of the vLLM connectors: checks, and the worker's Agent.

The checks run in the connector's constructor, the first connector code vLLM runs in
its engine core, so a refusal stops the server before any KV memory is registered,
with the key, value and rule (``ConfigError``), R-RAIL-2's NIC report
(``RailError``) or the missing package's install hint (``MissingDependency``).

:func:`agent_factory` turns vLLM's config into the worker's
:class:`~kvxfer.agent.AgentConfig` (fingerprint, side-channel port per rank,
backend) and returns the function :class:`~kvxfer.adapters.vllm.worker.WorkerSide`
calls once the KV cache is known. Importable without vLLM or torch (vLLM is imported
inside the functions that read its runtime state).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Sequence
from typing import Any

import msgspec

from kvxfer.adapters.vllm.kv_transfer_config import TransferConfig, parse_kv_transfer_config
from kvxfer.adapters.vllm.state_split import derive_state_split, model_config_of
from kvxfer.adapters.vllm.worker import AgentFactory
from kvxfer.agent import Agent, AgentConfig, PushPost
from kvxfer.agent_config import DEFAULT_WARM_UP_DESCRIPTORS, check_warm_up_descriptors
from kvxfer.backend import Backend
from kvxfer.core.compat import Fingerprint
from kvxfer.core.heads import HeadLayout, TPRank, place_heads, region_heads
from kvxfer.core.layout import ConvLayout, Group, GroupKind, KVLayout, MemKind
from kvxfer.core.state_plan import check_state_layout
from kvxfer.errors import ConfigError, KvxferError
from kvxfer.types import Direction

__all__ = [
    "AUTH_SECRET_ENV",
    "LEASE_KEY",
    "PUSH_POST_KEY",
    "TIMEOUT_KEY",
    "WARM_UP_KEY",
    "KVGroups",
    "agent_factory",
    "check_model_support",
    "check_parallelism",
    "data_plane_rails",
    "kv_groups",
    "parse_vllm_config",
    "positive_seconds",
    "push_post",
    "require_nixl_rbln",
    "state_tp_identity",
    "warm_up_descriptors",
]

log = logging.getLogger("kvxfer.adapters.vllm")

#: Environment variable with the side channel's shared secret (>= 16 bytes; both
#: instances of a pair need the same). Unset: unauthenticated, with a warning.
AUTH_SECRET_ENV = "KVXFER_AUTH_SECRET"

# vLLM's KVTransferConfig fields kvxfer's parser sees (the rest is vLLM's business).
_CONFIG_FIELDS = (
    "kv_connector",
    "kv_role",
    "kv_buffer_device",
    "engine_id",
    "kv_connector_extra_config",
    "kv_connector_module_path",
    "kv_load_failure_policy",
)
# kv_connector_extra_config keys the adapter reads besides the core parser's own (the
# parser passes them through; they are checked here): upstream NIXL's lease length,
# and how long a consumer waits for a load before failing it.
LEASE_KEY = "kv_lease_duration"  # seconds a producer holds blocks (default 30, as upstream)
TIMEOUT_KEY = "transfer_timeout_s"  # seconds before a pending load fails (default 30)
PUSH_POST_KEY = "push_post"  # which thread posts a push producer's writes (PushPost)
WARM_UP_KEY = "warm_up_descriptors"  # AgentConfig.warm_up_descriptors (default 65536)


def parse_vllm_config(vllm_config: Any) -> TransferConfig:
    """kvxfer's typed config from vLLM's; raises ConfigError(key, value, rule).

    vLLM fills ``kv_buffer_device`` with the platform's device type when the user
    leaves it out ("cpu" on the CPU platform) and ``engine_id`` with a fresh uuid.
    """
    kvt = vllm_config.kv_transfer_config
    mapping = {name: getattr(kvt, name, None) for name in _CONFIG_FIELDS}
    return parse_kv_transfer_config({k: v for k, v in mapping.items() if v is not None})


def positive_seconds(cfg: TransferConfig, key: str, default: float) -> float:
    value = cfg.extra_passthrough.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"kv_connector_extra_config.{key}", value, "must be a number > 0")
    return float(value)


def push_post(cfg: TransferConfig) -> PushPost:
    """``kv_connector_extra_config.push_post``: "auto" (default), "engine" or "writer"."""
    value = cfg.extra_passthrough.get(PUSH_POST_KEY, PushPost.AUTO.value)
    try:
        return PushPost(value)
    except ValueError:
        choices = ", ".join(repr(p.value) for p in PushPost)
        raise ConfigError(
            f"kv_connector_extra_config.{PUSH_POST_KEY}", value, f"must be one of {choices}"
        ) from None


def warm_up_descriptors(cfg: TransferConfig) -> int:
    """``kv_connector_extra_config.warm_up_descriptors``: how many descriptors the
    worker's first warm-up transfer posts (:attr:`AgentConfig.warm_up_descriptors
    <kvxfer.agent.AgentConfig.warm_up_descriptors>`); raise it to the most units one
    request of yours posts (long prompts at small block sizes across TP sizes)."""
    value = cfg.extra_passthrough.get(WARM_UP_KEY, DEFAULT_WARM_UP_DESCRIPTORS)
    return check_warm_up_descriptors(f"kv_connector_extra_config.{WARM_UP_KEY}", value)


class KVGroups(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's KV cache groups as kvxfer sees them.

    Attributes:
        groups: one :class:`~kvxfer.core.layout.Group` per vLLM KV cache group, in vLLM's
            order (full attention, sliding window with its window in tokens, or
            recurrent state).
        layer_groups: the group of each attention or state layer, by vLLM's layer name.
        spec_slots: per group, the speculative scratch slots vLLM appends to a state
            group's per-request list (``MambaSpec.num_speculative_blocks``; 0 for
            attention groups). They hold draft states, never the request's own.
        state_parts: per state group (by index), the bytes of each state a slot
            packs, in vLLM's order (conv state, then SSM state).
    """

    groups: tuple[Group, ...]
    layer_groups: dict[str, int]
    spec_slots: tuple[int, ...] = ()
    state_parts: dict[int, tuple[int, ...]] = msgspec.field(default_factory=dict)

    @property
    def windows(self) -> tuple[int, ...]:
        """Each group's sliding window in tokens (0: full attention or state)."""
        return tuple(g.window for g in self.groups)

    @property
    def hybrid(self) -> bool:
        """True when some group is a sliding-window one."""
        return any(g.kind is GroupKind.SLIDING for g in self.groups)

    @property
    def has_state(self) -> bool:
        """True when some group holds recurrent state (Mamba2, Gated DeltaNet)."""
        return any(g.is_state for g in self.groups)


#: Attention specs whose blocks are token-positional KV moved whole, by vLLM class name:
#: full attention, and MLA's latent KV (one "head" of latent + rope elements per token,
#: the same on every TP rank).
_FULL_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
_SLIDING_SPECS = frozenset({"SlidingWindowSpec", "SlidingWindowMLASpec"})
#: Recurrent-state backends whose per-request state kvxfer moves (vLLM's
#: ``MambaAttentionBackendEnum`` member names): Mamba2 (Granite-4 hybrid, Nemotron-H,
#: Falcon-H1, Zamba2) and Gated DeltaNet (Qwen3-Next, Qwen3.5). Their state is a
#: conv state and an SSM state per slot, moved whole.
_STATE_BACKENDS = frozenset({"MAMBA2", "GDN_ATTN"})
_MOVED = (
    "full attention (FullAttentionSpec, MLAAttentionSpec), sliding window "
    "(SlidingWindowSpec, SlidingWindowMLASpec) and Mamba2 / Gated DeltaNet state "
    "(MambaSpec with mamba_type MAMBA2 or GDN_ATTN)"
)


def _spec_group(spec: Any, index: int) -> Group:
    """One vLLM KV cache spec as a :class:`Group`, or the start-up refusal."""
    kind = type(spec).__name__
    window = getattr(spec, "sliding_window", None)
    if kind in _SLIDING_SPECS and isinstance(window, int) and window > 0:
        return Group(kind=GroupKind.SLIDING, window=window)
    if kind in _FULL_SPECS:
        return Group(kind=GroupKind.FULL)
    if kind == "MambaSpec":
        backend = getattr(getattr(spec, "mamba_type", None), "name", None)
        if backend in _STATE_BACKENDS:
            return Group(kind=GroupKind.STATE, conv_layout=conv_state_layout())
        raise ConfigError(
            f"kv_cache_groups[{index}].mamba_type",
            backend,
            "kvxfer moves the state of Mamba2 and Gated DeltaNet layers only; Mamba1, "
            "ShortConv (LFM2) and linear-attention (MiniMax) state is not moved: serve "
            "this model unified, or with vLLM's own NixlConnector where it supports it",
        )
    raise ConfigError(
        f"kv_cache_groups[{index}]",
        kind,
        f"kvxfer's vLLM connectors move {_MOVED} KV cache groups only",
    )


def conv_state_layout() -> ConvLayout:
    """The conv-state order this engine's state layers use.

    kvxfer moves state slots whole, so it needs neither order; it states the one in
    use in its layout, and the handshake refuses a peer with the other one (the same
    bytes would be other state there). vLLM picks it per process from
    ``VLLM_SSM_CONV_STATE_LAYOUT`` (its CPU platform sets DS only for connectors
    named ``Nixl*``), so two instances started with different settings disagree.
    """
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    return ConvLayout(get_conv_state_layout())


def kv_groups(kv_cache_config: Any) -> KVGroups:
    """Read vLLM's KV cache groups (one full-attention group when there are none).

    Raises:
        ConfigError: a group of a kind kvxfer cannot move (Mamba1, ShortConv, chunked
            local attention, ...), named with its index and spec.
    """
    raw = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not raw:
        return KVGroups(groups=(Group(kind=GroupKind.FULL),), layer_groups={})
    groups = tuple(_spec_group(g.kv_cache_spec, i) for i, g in enumerate(raw))
    layer_groups = {
        str(name): i for i, g in enumerate(raw) for name in getattr(g, "layer_names", ())
    }
    spec_slots = tuple(
        int(getattr(g.kv_cache_spec, "num_speculative_blocks", 0) or 0) if group.is_state else 0
        for g, group in zip(raw, groups, strict=True)
    )
    state_parts = {
        i: _state_bytes(g.kv_cache_spec)
        for i, (g, group) in enumerate(zip(raw, groups, strict=True))
        if group.is_state
    }
    return KVGroups(
        groups=groups, layer_groups=layer_groups, spec_slots=spec_slots, state_parts=state_parts
    )


def _state_bytes(spec: Any) -> tuple[int, ...]:
    """Bytes of each state of a ``MambaSpec`` slot (``shapes`` x ``dtypes``); () when
    the spec does not say (the slot is then described as one region)."""
    shapes, dtypes = getattr(spec, "shapes", None), getattr(spec, "dtypes", None)
    if not shapes or not dtypes or len(shapes) != len(dtypes):
        return ()
    out = []
    for shape, dtype in zip(shapes, dtypes, strict=True):
        count = 1
        for d in shape:
            count *= int(d)
        out.append(count * int(getattr(dtype, "itemsize", 0)))
    return tuple(out) if all(out) else ()


def check_parallelism(parallel_config: Any) -> None:
    """Refuse, at start-up, the parallel layouts whose KV kvxfer does not pair.

    Raises:
        ConfigError: ``pipeline_parallel_size`` > 1 (each stage holds other layers'
            KV, and tickets name one rank per TP rank), or a decode / prefill
            context-parallel size > 1 (each rank then holds every DCP/PCP-th token
            of a block: kvxfer's block plans are per whole token range).
    """
    for key, rule in (
        (
            "pipeline_parallel_size",
            "kvxfer pairs tensor-parallel ranks only; each pipeline stage holds other "
            "layers' KV: run prefill and decode with pipeline_parallel_size 1",
        ),
        (
            "decode_context_parallel_size",
            "with decode context parallelism each rank holds an interleaved share of "
            "every block's tokens, which kvxfer's plans do not cut: leave it at 1",
        ),
        (
            "prefill_context_parallel_size",
            "with prefill context parallelism each rank holds an interleaved share of "
            "every block's tokens, which kvxfer's plans do not cut: leave it at 1",
        ),
    ):
        value = getattr(parallel_config, key, 1)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            raise ConfigError(key, value, rule)


def check_model_support(cfg: TransferConfig, kv_cache_config: Any, block_size: int = 0) -> None:
    """Refuse, at start-up, what the connectors cannot move exactly (R-HYB-2).

    Args:
        cfg: the parsed connector configuration.
        kv_cache_config: vLLM's ``KVCacheConfig`` (its groups).
        block_size: tokens per block (0: not checked against the windows).

    Raises:
        ConfigError: a KV cache group kvxfer cannot move; ``swa_window_mode`` without
            a sliding-window group, or with a window that does not divide
            ``block_size`` (R-DESC-4); ``push_stream`` with a sliding-window group.
    """
    found = kv_groups(kv_cache_config)
    key = "kv_connector_extra_config.swa_window_mode"
    if cfg.swa_window_mode and not found.hybrid:
        raise ConfigError(
            key,
            True,
            "needs a sliding-window KV cache group, and this model has none (or vLLM "
            "runs with --disable-hybrid-kv-cache-manager, which puts every layer in one "
            "full-attention group)",
        )
    for g, group in enumerate(found.groups):
        if cfg.swa_window_mode and block_size and group.window and block_size % group.window:
            raise ConfigError(
                key,
                True,
                f"block_size {block_size} is not a multiple of the sliding window "
                f"{group.window} of KV cache group {g} (window granules must tile a "
                "block): choose --block-size a multiple of the window, or leave "
                "swa_window_mode off",
            )
    if cfg.push_stream and found.hybrid:
        raise ConfigError(
            "kv_connector_extra_config.push_stream",
            True,
            "not with sliding-window KV cache groups: which blocks the window keeps is "
            "known only once the prompt ends, so they go with the hold",
        )
    if cfg.push_stream and found.has_state:
        raise ConfigError(
            "kv_connector_extra_config.push_stream",
            True,
            "not with Mamba / Gated DeltaNet state groups: a request's state is final "
            "only once its prompt ends, so it goes with the hold",
        )


def data_plane_rails(
    cfg: TransferConfig,
    *,
    sysfs_root: str = "/sys",
    runner: Any = None,
    pyverbs: Any = True,
    numa_node: int | None = None,
) -> tuple[Any, ...]:
    """The RDMA rails this instance's data plane uses (R-RAIL-1/2).

    A host without RDMA devices runs without rails (UCX picks its own transports;
    logged). A host with RDMA devices must have a qualifying one on the accelerator's
    NUMA node, or start-up fails with R-RAIL-2's message.

    Raises:
        RailError: RDMA devices present, none qualifies (or the NUMA node is unknown).
    """
    from kvxfer.io.rails import accelerator_numa, discover, evaluate

    found = discover(sysfs_root=sysfs_root, runner=runner, pyverbs=pyverbs)
    if not found.ports:
        log.info(
            "kvxfer: no RDMA devices on this host; the data plane runs without rails "
            "(UCX chooses its transports)"
        )
        return ()
    numa = accelerator_numa(numa_node=numa_node, sysfs_root=sysfs_root, runner=runner)
    rails = evaluate(found, numa.node).require()
    log.info(
        "kvxfer: rails %s on numa=%d (%s)%s",
        ", ".join(r.name for r in rails),
        numa.node,
        numa.source,
        " (stripe_width 0: all of them per transfer)" if cfg.all_rails else "",
    )
    return rails


def require_nixl_rbln() -> None:
    """Device-to-device needs nixl-rbln: fail start-up now, with its install hint.

    Raises:
        MissingDependency: nixl-rbln (or the adapter ``KVXFER_RBLN_ADAPTER`` names)
            cannot be loaded.
    """
    from kvxfer.backends.nixl_rbln import ADAPTER_ENV, load_adapter

    try:
        load_adapter(os.environ.get(ADAPTER_ENV) or None)
    except ImportError as exc:
        log.error("RBLN NIXL (D2D): cannot start: %s", exc)
        raise


def _attention_backend(vllm_config: Any, fallback: str) -> str:
    """The resolved attention backend's name (part of the compatibility hash)."""
    context = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    names = set()
    for layer in context.values():
        backend = getattr(layer, "attn_backend", None)
        if backend is not None and hasattr(backend, "get_name"):
            names.add(str(backend.get_name()))
    return ",".join(sorted(names)) or fallback


def _fingerprint(vllm_config: Any, layout: KVLayout, direction: Direction) -> Fingerprint:
    """What must match between the two instances of a pair (R-COMPAT)."""
    from vllm.platforms import current_platform

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    dtype = str(mc.dtype).removeprefix("torch.")
    kv_dtype = dtype if cc.cache_dtype in (None, "auto") else str(cc.cache_dtype)
    spec = vllm_config.speculative_config
    draft = ""
    if spec is not None and getattr(spec, "draft_model_config", None) is not None:
        draft = str(spec.draft_model_config.model)
    served = mc.served_model_name
    model = str(served[0] if isinstance(served, list | tuple) else (served or mc.model))
    return Fingerprint(
        model=model,
        revision=str(mc.revision or ""),
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        attention_backend=_attention_backend(
            vllm_config, f"{current_platform.device_type}:{layout.kv_layout}"
        ),
        direction=direction,
        draft_model=draft,
    )


def agent_factory(
    vllm_config: Any,
    cfg: TransferConfig,
    *,
    direction: Direction,
    tp_rank: int,
    rails: Sequence[Any] = (),
    kv_cache_config: Any = None,
) -> AgentFactory:
    """The function that builds this worker's Agent once its KV cache is known.

    The ``kv_connector_extra_config`` values are checked now (start-up); vLLM's
    runtime state (side-channel host and port, attention backend) is read when the
    factory runs, after vLLM allocated the cache.

    Args:
        vllm_config: vLLM's ``VllmConfig``.
        cfg: The parsed connector configuration.
        direction: The connector's direction.
        tp_rank: This worker's tensor-parallel rank (side-channel port offset).
        rails: The data-plane rails (:func:`data_plane_rails`).
        kv_cache_config: vLLM's ``KVCacheConfig``: its state groups' specs say how TP
            splits their slots (:func:`state_tp_identity`); None: not stated.

    Raises:
        ConfigError: a bad ``kv_lease_duration``, ``transfer_timeout_s``,
            ``push_post`` or ``warm_up_descriptors``.
    """
    lease_s = positive_seconds(cfg, LEASE_KEY, 30.0)
    timeout_s = positive_seconds(cfg, TIMEOUT_KEY, 30.0)
    post = push_post(cfg)
    warm_up = warm_up_descriptors(cfg)
    engine_id = str(vllm_config.kv_transfer_config.engine_id)
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    rail_names = tuple(r.name for r in rails)
    backend_name = "nixl_rbln" if cfg.device_to_device else "host_bounce"
    tp, state_why = state_tp_identity(vllm_config, tp_rank, kv_cache_config)

    def build(layout: KVLayout, tensors: Sequence[Any]) -> Agent:
        from vllm import envs

        pc = vllm_config.parallel_config
        dp_index = int(getattr(pc, "data_parallel_index", 0) or 0)
        port = int(envs.VLLM_NIXL_SIDE_CHANNEL_PORT) + dp_index * tp_size + tp_rank
        config = AgentConfig(
            engine_id=engine_id,
            fingerprint=_fingerprint(vllm_config, layout, direction),
            role=cfg.role,
            direction=direction,
            backend=backend_name,
            side_channel_host=str(envs.VLLM_NIXL_SIDE_CHANNEL_HOST),
            side_channel_port=port,
            plan=cfg.plan_options(int(vllm_config.scheduler_config.max_num_batched_tokens)),
            push_stream=cfg.push_stream,
            enforce_handshake_compat=cfg.enforce_handshake_compat,
            lease_s=lease_s,
            transfer_timeout_s=timeout_s,
            auth_secret=os.environ.get(AUTH_SECRET_ENV) or None,
            rails=rail_names,
            stripe_width=cfg.stripe_width,
            push_post=post,
            warm_up_descriptors=warm_up,
            tp=_tp_for(layout, tp, state_why),
        )
        backend: Backend | None = None
        on_device = any(r.mem is not MemKind.DRAM for r in layout.regions)
        if backend_name == "host_bounce" and on_device and len(tensors) != len(layout.regions):
            # torch_copy_op copies region i from tensor i.
            raise ConfigError(
                "kv_cache_groups",
                len(layout.groups),
                "host bounce of device memory copies one tensor per region; a cache "
                "whose tensors serve several KV cache groups or whose regions split "
                "heads is not supported there",
            )
        if backend_name == "host_bounce" and on_device:
            # KV cache in device memory: stage with torch copies over the same tensors.
            from kvxfer.backends.host_bounce import HostBounceBackend, torch_copy_op

            backend = HostBounceBackend(
                config.backend_options(f"{engine_id}#r{tp_rank}#{secrets.token_hex(8)}"),
                copy_op=torch_copy_op(list(tensors)),
            )
        try:
            return Agent(config, backend=backend)
        except ImportError as exc:  # MissingDependency: nixl-rbln or NIXL itself
            log.error("RBLN NIXL (D2D): cannot start: %s", exc)
            raise

    return build


def _tp_for(layout: KVLayout, tp: TPRank, state_why: str = "") -> TPRank | None:
    """``tp`` when the layout's regions split by head the way pulls across TP sizes
    plan them (vLLM's head-major CPU and device caches do) and, with Mamba/GDN state
    groups, its slots split as ``tp.state`` says (held bytes equal to the state
    regions', DS conv order); None otherwise, and the worker then refuses a load from
    another TP size, pointing at the reason logged here."""
    state = next((g for g, group in enumerate(layout.groups) if group.is_state), None)
    if state is not None and tp.state is None:
        log.info(
            "kvxfer: Mamba/GDN state across TP sizes: the TP split of kv_cache_groups[%d] "
            "is not known (%s): pair instances of equal TP size",
            state,
            state_why or "not derived",
        )
        return None
    try:
        if tp.state is not None:
            check_state_layout(layout, tp.state, tp.heads.tp_size, side="local")
        region_heads(place_heads(layout, tp.heads, tp.rank), tp.heads, tp.rank)
    except KvxferError as exc:
        what = "Mamba/GDN state across TP sizes: " if tp.state is not None else ""
        log.info(
            "kvxfer: %spulls across TP sizes are not available with this layout: %s", what, exc
        )
        return None
    return tp


def state_tp_identity(vllm_config: Any, tp_rank: int, kv_cache_config: Any) -> tuple[TPRank, str]:
    """:func:`tp_identity` with ``TPRank.state`` derived from the model's config and
    its state groups' specs (:func:`kvxfer.adapters.vllm.state_split.derive_state_split`)
    where it has Mamba2 / Gated DeltaNet groups; the reason when it has such groups and
    no split could be derived ("" otherwise). Never raises for the state: without a
    split the groups pair between equal TP sizes only."""
    tp = tp_identity(vllm_config, tp_rank)
    raw = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    specs = [
        g.kv_cache_spec
        for g in raw
        if type(g.kv_cache_spec).__name__ == "MambaSpec"
        and getattr(getattr(g.kv_cache_spec, "mamba_type", None), "name", None) in _STATE_BACKENDS
    ]
    if not specs:
        return tp, ""
    try:
        split, why = derive_state_split(
            model_config_of(vllm_config), specs, tp.heads.tp_size, conv_state_layout()
        )
        if split is None:
            return tp, why
        return TPRank(heads=tp.heads, rank=tp.rank, state=split), ""
    except (KvxferError, AttributeError, TypeError, ValueError) as exc:
        # A config or spec of another shape than this module knows: no split, and why.
        return tp, f"{type(exc).__name__}: {exc}"


def tp_identity(vllm_config: Any, tp_rank: int) -> TPRank:
    """This worker's place in its TP group: the model's KV heads (all ranks; one
    latent head under MLA) and how ``tensor_parallel_size`` splits them. A pull from a
    producer of another TP size reads each head from the rank holding it
    (:mod:`kvxfer._agent.tp_pull`).

    Raises:
        ConfigError: the TP size cannot split the model's KV heads (vLLM refuses
            those too).
    """
    mc = vllm_config.model_config
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    latent = bool(getattr(mc, "use_mla", False))
    heads = 1 if latent else int(mc.get_total_num_kv_heads())
    return TPRank(
        heads=HeadLayout(num_kv_heads=heads, tp_size=tp_size, latent=latent), rank=tp_rank
    )
