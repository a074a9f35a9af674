"""The vLLM kv_transfer_config parser: one test per rule of R-VLLM-2, R-DESC-3/5, R-RAIL-3/4."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from kvxfer.adapters.vllm.kv_transfer_config import (
    BufferDevice,
    PeerAddress,
    TransferConfig,
    parse_kv_transfer_config,
)
from kvxfer.core.descriptors import PlanOptions
from kvxfer.errors import ConfigError
from kvxfer.types import Direction, Role

X = "kv_connector_extra_config"


def cfg(**extra: Any) -> dict[str, Any]:
    """A minimal valid pull config with ``extra`` as kv_connector_extra_config."""
    base: dict[str, Any] = {
        "kv_connector": "RblnNixlPullConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "rbln",
    }
    if extra:
        base[X] = extra
    return base


def rejects(config: Any, key: str, *, value: Any = ..., rule: str = "") -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_kv_transfer_config(config)
    err = info.value
    assert err.key == key
    if value is not ...:
        assert err.value == value and type(err.value) is type(value)
    assert rule in err.rule
    assert key in str(err)  # the message names the key
    return err


# -- the seed's example and defaults -------------------------------------------------


def test_seed_example_parses_with_defaults() -> None:
    c = parse_kv_transfer_config(
        '{"kv_connector":"RblnNixlPullConnector","kv_role":"kv_both","kv_buffer_device":"rbln"}'
    )
    assert c == TransferConfig(role=Role.BOTH)
    assert c.direction is Direction.PULL and c.buffer_device is BufferDevice.RBLN
    assert c.device_to_device and not c.all_rails
    assert (c.swa_window_mode, c.chunk_mode, c.push_stream) == (False, False, False)
    assert c.chunk_tokens is None and c.stripe_width is None
    assert c.link_down_exit_s == 0.0 and c.enforce_handshake_compat is True


def test_json_bytes_accepted_and_bad_json_rejected() -> None:
    assert parse_kv_transfer_config(json.dumps(cfg()).encode()).role is Role.BOTH
    rejects("{not json", "kv_transfer_config", rule="not valid JSON")
    rejects("[1, 2]", "kv_transfer_config", rule="mapping")


# -- kv_connector ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "direction"),
    [
        ("RblnNixlPullConnector", Direction.PULL),
        ("RblnNixlConnector", Direction.PULL),
        ("RblnNixlPushConnector", Direction.PUSH),
    ],
)
def test_connector_names_pick_the_direction(name: str, direction: Direction) -> None:
    c = parse_kv_transfer_config({**cfg(), "kv_connector": name})
    assert c.connector == name and c.direction is direction


@pytest.mark.parametrize("name", ["NixlConnector", "rblnnixlpullconnector", None, 3])
def test_unknown_connector_lists_the_accepted_ones(name: Any) -> None:
    config = {**cfg(), "kv_connector": name}
    err = rejects(config, "kv_connector", value=name)
    for accepted in ("RblnNixlPullConnector", "RblnNixlPushConnector", "RblnNixlConnector"):
        assert accepted in err.rule


# -- kv_role ------------------------------------------------------------------------------


@pytest.mark.parametrize("role", list(Role))
def test_each_role_accepted(role: Role) -> None:
    assert parse_kv_transfer_config({**cfg(), "kv_role": role.value}).role is role


def test_role_is_required() -> None:
    config = cfg()
    del config["kv_role"]
    rejects(config, "kv_role", value=None, rule="required")


@pytest.mark.parametrize("role", ["producer", "KV_PRODUCER", 1, True])
def test_bad_role_rejected(role: Any) -> None:
    rejects({**cfg(), "kv_role": role}, "kv_role", value=role, rule="kv_consumer")


# -- kv_buffer_device -------------------------------------------------------------------


def test_buffer_device_cpu_is_host_bounce() -> None:
    c = parse_kv_transfer_config({**cfg(), "kv_buffer_device": "cpu"})
    assert c.buffer_device is BufferDevice.CPU and not c.device_to_device


def test_buffer_device_absent_means_rbln() -> None:
    config = cfg()
    del config["kv_buffer_device"]
    assert parse_kv_transfer_config(config).buffer_device is BufferDevice.RBLN


def test_vllm_default_cuda_rejected_with_explanation() -> None:
    err = rejects({**cfg(), "kv_buffer_device": "cuda"}, "kv_buffer_device", value="cuda")
    assert "vLLM's default" in err.rule and "'rbln'" in err.rule and "'cpu'" in err.rule


@pytest.mark.parametrize("device", ["npu", "RBLN", "", 0])
def test_other_buffer_devices_rejected(device: Any) -> None:
    rejects({**cfg(), "kv_buffer_device": device}, "kv_buffer_device", value=device)


# -- engine_id ----------------------------------------------------------------------------


def test_engine_id_string_or_null() -> None:
    assert parse_kv_transfer_config({**cfg(), "engine_id": "prefill-0"}).engine_id == "prefill-0"
    assert parse_kv_transfer_config({**cfg(), "engine_id": None}).engine_id is None


@pytest.mark.parametrize("engine_id", ["", 7, "x" * 257])
def test_bad_engine_id_rejected(engine_id: Any) -> None:
    rejects({**cfg(), "engine_id": engine_id}, "engine_id", value=engine_id)


# -- kv_connector_extra_config: types ---------------------------------------------------


def test_extra_config_must_be_a_mapping() -> None:
    rejects({**cfg(), X: ["chunk_mode"]}, X, rule="mapping")
    assert parse_kv_transfer_config({**cfg(), X: None}).extra_passthrough == {}


@pytest.mark.parametrize(
    "key", ["swa_window_mode", "chunk_mode", "push_stream", "enforce_handshake_compat"]
)
@pytest.mark.parametrize("value", [1, 0, "true", None])
def test_flags_must_be_bool(key: str, value: Any) -> None:
    # An int is not a bool: 1 for true is a mistake we name instead of guessing.
    rejects(cfg(**{key: value}), f"{X}.{key}", value=value, rule="bool")


def test_enforce_handshake_compat_false() -> None:
    assert not parse_kv_transfer_config(
        cfg(enforce_handshake_compat=False)
    ).enforce_handshake_compat


# -- chunk_mode / chunk_tokens (R-DESC-3) ---------------------------------------------


def test_chunk_mode_with_tokens() -> None:
    c = parse_kv_transfer_config(cfg(chunk_mode=True, chunk_tokens=512))
    assert c.chunk_mode and c.chunk_tokens == 512


@pytest.mark.parametrize("tokens", [0, -4, True, 1.5, "256"])
def test_chunk_tokens_must_be_positive_int(tokens: Any) -> None:
    rejects(cfg(chunk_mode=True, chunk_tokens=tokens), f"{X}.chunk_tokens", value=tokens)


def test_chunk_tokens_without_chunk_mode_rejected() -> None:
    rejects(cfg(chunk_tokens=256), f"{X}.chunk_tokens", value=256, rule="chunk_mode")


def test_plan_options_checks_the_prefill_step() -> None:
    c = parse_kv_transfer_config(cfg(chunk_mode=True, chunk_tokens=512))
    assert c.plan_options(512) == PlanOptions(
        chunk_mode=True, chunk_tokens=512, prefill_step_tokens=512
    )
    with pytest.raises(ConfigError) as info:
        c.plan_options(1024)
    assert info.value.key == f"{X}.chunk_tokens" and "prefill step" in info.value.rule
    assert "1024" in info.value.rule


def test_plan_options_unset_chunk_tokens_means_one_step() -> None:
    opts = parse_kv_transfer_config(cfg(chunk_mode=True)).plan_options(256)
    assert opts.chunk_tokens is None and opts.chunk_bound == 256


def test_plan_options_needs_a_valid_step_with_chunk_mode() -> None:
    c = parse_kv_transfer_config(cfg(chunk_mode=True))
    for step in (None, 0, True):
        with pytest.raises(ConfigError) as info:
            c.plan_options(step)
        assert info.value.key == "max_num_batched_tokens"
    plain = parse_kv_transfer_config(cfg(swa_window_mode=True))
    assert plain.plan_options(None) == PlanOptions(swa_window_mode=True)


# -- device-to-device only (R-DESC-5, R-XFER-3) ----------------------------------------


@pytest.mark.parametrize("key", ["chunk_mode", "swa_window_mode", "push_stream"])
def test_d2d_only_features_rejected_with_host_bounce(key: str) -> None:
    config = {**cfg(**{key: True}), "kv_buffer_device": "cpu"}
    if key == "push_stream":
        config["kv_connector"] = "RblnNixlPushConnector"
    rejects(config, f"{X}.{key}", value=True, rule="device-to-device only")


def test_d2d_features_off_are_fine_with_host_bounce() -> None:
    config = {**cfg(chunk_mode=False, swa_window_mode=False), "kv_buffer_device": "cpu"}
    assert parse_kv_transfer_config(config).buffer_device is BufferDevice.CPU


def test_push_stream_needs_the_push_connector() -> None:
    rejects(cfg(push_stream=True), f"{X}.push_stream", value=True, rule="push direction only")
    ok = {**cfg(push_stream=True), "kv_connector": "RblnNixlPushConnector"}
    assert parse_kv_transfer_config(ok).push_stream


def test_head_regions_is_a_bool_or_null() -> None:
    assert parse_kv_transfer_config(cfg()).head_regions is None
    assert parse_kv_transfer_config(cfg(head_regions=True)).head_regions is True
    rejects(cfg(head_regions="yes"), f"{X}.head_regions", value="yes", rule="bool or null")


# -- stripe_width (R-RAIL-3) ------------------------------------------------------------


def test_stripe_width_unset_or_zero() -> None:
    assert parse_kv_transfer_config(cfg(stripe_width=None)).stripe_width is None
    c = parse_kv_transfer_config(cfg(stripe_width=0))
    assert c.stripe_width == 0 and c.all_rails


@pytest.mark.parametrize("width", [1, 2, -1, False, 0.0, "0"])
def test_other_stripe_widths_rejected(width: Any) -> None:
    rejects(cfg(stripe_width=width), f"{X}.stripe_width", value=width, rule="0")


# -- link_down_exit_s (R-RAIL-4) --------------------------------------------------------


@pytest.mark.parametrize("seconds", [0, 0.0, 5, 2.5])
def test_link_down_exit_on_producer(seconds: float) -> None:
    config = {**cfg(link_down_exit_s=seconds), "kv_role": "kv_producer"}
    c = parse_kv_transfer_config(config)
    assert c.link_down_exit_s == seconds and isinstance(c.link_down_exit_s, float)


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_link_down_exit_rejected_off_producer(role: str) -> None:
    err = rejects({**cfg(link_down_exit_s=10), "kv_role": role}, f"{X}.link_down_exit_s", value=10)
    assert "kv_producer" in err.rule and "replaced from outside" in err.rule


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_link_down_exit_zero_is_fine_anywhere(role: str) -> None:
    assert parse_kv_transfer_config({**cfg(link_down_exit_s=0), "kv_role": role})


@pytest.mark.parametrize("seconds", [-1, True, "10", float("nan"), float("inf"), None])
def test_link_down_exit_must_be_a_finite_nonnegative_number(seconds: Any) -> None:
    config = {**cfg(link_down_exit_s=seconds), "kv_role": "kv_producer"}
    rejects(config, f"{X}.link_down_exit_s", rule="finite number")


# -- passthrough ----------------------------------------------------------------------


def test_upstream_keys_pass_through_untouched() -> None:
    backends = ["UCX"]
    config = {
        **cfg(chunk_mode=False, backends=backends, num_threads=4),
        "kv_connector_module_path": "kvxfer.adapters.vllm",
        "kv_port": 14579,
        "kv_parallel_size": 1,
    }
    c = parse_kv_transfer_config(config)
    assert c.passthrough == {
        "kv_connector_module_path": "kvxfer.adapters.vllm",
        "kv_port": 14579,
        "kv_parallel_size": 1,
    }
    assert c.extra_passthrough == {"backends": ["UCX"], "num_threads": 4}
    assert c.extra_passthrough["backends"] is backends  # untouched, not copied


def test_near_miss_of_our_key_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvxfer.adapters.vllm.kv_transfer_config"):
        c = parse_kv_transfer_config(cfg(chunk_token=512))
    assert c.extra_passthrough == {"chunk_token": 512}
    assert "did you mean 'chunk_tokens'" in caplog.text


def test_config_is_frozen() -> None:
    c = parse_kv_transfer_config(cfg())
    with pytest.raises(AttributeError):
        c.chunk_mode = True  # type: ignore[misc]


# -- direct construction obeys the same rules -------------------------------------------


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"push_stream": True}, f"{X}.push_stream"),
        ({"connector": "RblnNixlPushConnector"}, "kv_connector"),
        ({"connector": "NixlConnector"}, "kv_connector"),
        ({"role": "kv_both"}, "kv_role"),
        ({"buffer_device": "cpu"}, "kv_buffer_device"),
        ({"chunk_mode": 1}, f"{X}.chunk_mode"),
        ({"stripe_width": 2}, f"{X}.stripe_width"),
        ({"link_down_exit_s": 3.0}, f"{X}.link_down_exit_s"),  # role is kv_both
        ({"buffer_device": BufferDevice.CPU, "swa_window_mode": True}, f"{X}.swa_window_mode"),
    ],
)
def test_direct_construction_is_validated(fields: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        TransferConfig(**{"role": Role.BOTH, **fields})
    assert info.value.key == key


def test_direct_construction_normalizes_seconds() -> None:
    c = TransferConfig(role=Role.PRODUCER, link_down_exit_s=5)
    assert c.link_down_exit_s == 5.0 and isinstance(c.link_down_exit_s, float)


# -- connect_ahead ---------------------------------------------------------------------


def test_connect_ahead_parses_to_peer_addresses() -> None:
    peers = [{"host": "10.0.0.1", "port": 5600, "tp_size": 2}, {"host": "p2", "port": 7000}]
    got = parse_kv_transfer_config(cfg(connect_ahead=peers)).connect_ahead
    assert got == (
        PeerAddress(host="10.0.0.1", port=5600, tp_size=2),
        PeerAddress(host="p2", port=7000, tp_size=1, engine_id=None),
    )
    assert parse_kv_transfer_config(cfg()).connect_ahead == ()


def test_connect_ahead_refresh_s_names_a_set_of_instances() -> None:
    peers = [{"host": "prefill.ns.svc", "port": 5600, "refresh_s": 10}]
    (got,) = parse_kv_transfer_config(cfg(connect_ahead=peers)).connect_ahead
    assert got == PeerAddress(host="prefill.ns.svc", port=5600, refresh_s=10.0)
    assert type(got.refresh_s) is float
    zero = [{"host": "p", "port": 5600, "refresh_s": 0, "engine_id": "p"}]
    assert parse_kv_transfer_config(cfg(connect_ahead=zero)).connect_ahead[0].refresh_s == 0.0


@pytest.mark.parametrize(
    ("item", "key", "rule"),
    [
        ({"host": "h"}, "connect_ahead[0].port", "is required"),
        ({"port": 5}, "connect_ahead[0].host", "is required"),
        ({"host": "h", "port": 0}, "connect_ahead[0].port", "in [1, 65535]"),
        ({"host": "h", "port": True}, "connect_ahead[0].port", "in [1, 65535]"),
        ({"host": "h", "port": "5600"}, "connect_ahead[0].port", "in [1, 65535]"),
        ({"host": "", "port": 5}, "connect_ahead[0].host", "non-empty string"),
        ({"host": "h", "port": 5, "tp_size": 0}, "connect_ahead[0].tp_size", "int > 0"),
        ({"host": "h", "port": 5, "engine_id": ""}, "connect_ahead[0].engine_id", "non-empty"),
        ({"host": "h", "port": 5, "tp": 2}, "connect_ahead[0].tp", "unknown key"),
        ({"host": "h", "port": 5, "refresh_s": 0.5}, "connect_ahead[0].refresh_s", "[1, 3600]"),
        ({"host": "h", "port": 5, "refresh_s": -1}, "connect_ahead[0].refresh_s", "[1, 3600]"),
        ({"host": "h", "port": 5, "refresh_s": 7200}, "connect_ahead[0].refresh_s", "[1, 3600]"),
        (
            {"host": "h", "port": 5, "refresh_s": float("nan")},
            "connect_ahead[0].refresh_s",
            "[1, 3600]",
        ),
        ({"host": "h", "port": 5, "refresh_s": True}, "connect_ahead[0].refresh_s", "[1, 3600]"),
        ({"host": "h", "port": 5, "refresh_s": "10"}, "connect_ahead[0].refresh_s", "[1, 3600]"),
        (
            {"host": "h", "port": 5, "refresh_s": 10, "engine_id": "p"},
            "connect_ahead[0].engine_id",
            "must be null with refresh_s",
        ),
        ("h:5600", "connect_ahead[0]", "{host, port, tp_size} object"),
    ],
)
def test_connect_ahead_entries_are_checked_by_name(item: Any, key: str, rule: str) -> None:
    rejects(cfg(connect_ahead=[item]), f"{X}.{key}", rule=rule)


def test_connect_ahead_must_be_a_list() -> None:
    rejects(cfg(connect_ahead={"host": "h", "port": 5}), f"{X}.connect_ahead", rule="a list")


@pytest.mark.parametrize(
    ("connector", "role"),
    [("RblnNixlPullConnector", "kv_producer"), ("RblnNixlPushConnector", "kv_consumer")],
)
def test_connect_ahead_only_where_this_instance_posts(connector: str, role: str) -> None:
    config = {**cfg(connect_ahead=[{"host": "h", "port": 5}]), "kv_connector": connector}
    rejects({**config, "kv_role": role}, f"{X}.connect_ahead", rule="never posts")
    for posting in {"kv_both", "kv_consumer" if role == "kv_producer" else "kv_producer"}:
        assert parse_kv_transfer_config({**config, "kv_role": posting}).connect_ahead
