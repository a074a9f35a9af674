"""Rails: discovery, NIC selection (R-RAIL-1/2), stripe_width (R-RAIL-3), sources (R-RAIL-5).

Selection tests read real addresses and routes from a network namespace with veth
pairs and a fake ``class/infiniband`` tree; each rule is flipped on the live objects
and must flip the choice.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvxfer.errors import ConfigError, RailError
from kvxfer.io.rails import (
    CommandRunner,
    Discovery,
    HostNetwork,
    LinkLayer,
    PortState,
    Rail,
    Reason,
    accelerator_numa,
    discover,
    evaluate,
    rails_for_transfer,
    select_rails,
    shared_rails,
    ucx_env,
    ucx_environment,
)
from tests.railfakes import (
    STANDARD_NICS,
    FakeNic,
    FakePyverbs,
    NetNs,
    VerbsPortSpec,
    build_sysfs,
    netns_context,
    set_numa,
    set_port_state,
)


@pytest.fixture
def ns() -> Iterator[NetNs]:
    with netns_context() as made:
        yield made.standard()


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    return build_sysfs(tmp_path / "sys", STANDARD_NICS)


def chosen(sysfs: Path, ns: NetNs, numa: int = 0) -> list[str]:
    found = discover(sysfs_root=sysfs, runner=ns.runner, pyverbs=False)
    return [r.name for r in evaluate(found, numa).rails]


# ------------------------------------------------------------ selection in netns


@pytest.mark.netns
def test_standard_host_picks_the_one_qualifying_nic(sysfs: Path, ns: NetNs) -> None:
    rails = select_rails(0, sysfs_root=sysfs, runner=ns.runner, pyverbs=False)
    assert rails == (Rail(device="mlx5_1", port=1, netdev="r1", ipv4="10.90.1.1", numa=0),)


@pytest.mark.netns
def test_numa_rule_flips_the_choice(sysfs: Path, ns: NetNs) -> None:
    assert chosen(sysfs, ns, numa=1) == ["mlx5_2:1"]
    set_numa(sysfs, "mlx5_2", 0)
    assert chosen(sysfs, ns, numa=0) == ["mlx5_1:1", "mlx5_2:1"]
    set_numa(sysfs, "mlx5_1", 1)
    assert chosen(sysfs, ns, numa=0) == ["mlx5_2:1"]


@pytest.mark.netns
def test_active_rule_flips_the_choice(sysfs: Path, ns: NetNs) -> None:
    set_port_state(sysfs, "mlx5_3", 1, "ACTIVE")
    assert chosen(sysfs, ns) == ["mlx5_1:1", "mlx5_3:1"]
    for state in ("DOWN", "INIT", "ARMED"):
        set_port_state(sysfs, "mlx5_1", 1, state)
        assert chosen(sysfs, ns) == ["mlx5_3:1"], state


@pytest.mark.netns
def test_ipv4_rule_flips_the_choice(sysfs: Path, ns: NetNs) -> None:
    ns.ip("addr", "add", "10.90.4.1/24", "dev", "r4")
    assert chosen(sysfs, ns) == ["mlx5_1:1", "mlx5_4:1"]
    ns.ip("addr", "flush", "dev", "r1")
    assert chosen(sysfs, ns) == ["mlx5_4:1"]
    # An IPv6 address alone does not qualify a netdev.
    ns.ip("-6", "addr", "add", "fd00:90::1/64", "dev", "r1", "nodad")
    assert chosen(sysfs, ns) == ["mlx5_4:1"]


@pytest.mark.netns
def test_default_route_rule_flips_the_choice(sysfs: Path, ns: NetNs) -> None:
    ns.ip("route", "del", "default")
    assert chosen(sysfs, ns) == ["mlx5_0:1", "mlx5_1:1"]


@pytest.mark.netns
def test_moving_the_default_route_moves_the_choice(sysfs: Path, ns: NetNs) -> None:
    assert chosen(sysfs, ns) == ["mlx5_1:1"]
    ns.ip("route", "replace", "default", "via", "10.90.1.254", "dev", "r1", "onlink")
    assert chosen(sysfs, ns) == ["mlx5_0:1"]
    ns.ip("route", "replace", "default", "via", "10.90.0.254", "dev", "r0", "onlink")
    assert chosen(sysfs, ns) == ["mlx5_1:1"]


@pytest.mark.netns
def test_multipath_default_route_excludes_every_nexthop(sysfs: Path, ns: NetNs) -> None:
    ns.ip(
        "route", "replace", "default",
        "nexthop", "via", "10.90.0.254", "dev", "r0", "onlink",
        "nexthop", "via", "10.90.1.254", "dev", "r1", "onlink",
    )  # fmt: skip
    assert chosen(sysfs, ns) == []


@pytest.mark.netns
def test_no_qualifying_nic_lists_every_rejection(sysfs: Path, ns: NetNs) -> None:
    set_port_state(sysfs, "mlx5_1", 1, "DOWN")
    with pytest.raises(RailError) as info:
        select_rails(0, sysfs_root=sysfs, runner=ns.runner, pyverbs=False)
    text = str(info.value)
    assert text.startswith("no usable data-plane RoCE NIC on numa=0\n")
    lines = {line.split()[0]: line for line in text.splitlines()[2:7]}
    assert set(lines) == {f"mlx5_{i}:1" for i in range(5)}
    assert "netdev r0 carries the default route" in lines["mlx5_0:1"]
    assert "port is DOWN, not ACTIVE" in lines["mlx5_1:1"]
    assert "on numa=1, accelerator on numa=0" in lines["mlx5_2:1"]
    assert "port is DOWN" in lines["mlx5_3:1"]
    assert "netdev r4 has no IPv4 address" in lines["mlx5_4:1"]
    assert "ipv4=10.90.2.1/24" in lines["mlx5_2:1"]


@pytest.mark.netns
def test_error_names_the_numa_node_checked(sysfs: Path, ns: NetNs) -> None:
    found = discover(sysfs_root=sysfs, runner=ns.runner, pyverbs=False)
    with pytest.raises(RailError, match=r"^no usable data-plane RoCE NIC on numa=3\n"):
        evaluate(found, 3).require()
    verdicts = evaluate(found, 3).verdicts
    assert all(Reason.WRONG_NUMA in {r.reason for r in v.rejections} for v in verdicts)


@pytest.mark.netns
def test_every_broken_rule_is_listed_not_only_the_first(tmp_path: Path, ns: NetNs) -> None:
    root = build_sysfs(tmp_path, [FakeNic("mlx5_9", "r0", 1, state="DOWN")])
    found = discover(sysfs_root=root, runner=ns.runner, pyverbs=False)
    (verdict,) = evaluate(found, 0).verdicts
    assert [r.reason for r in verdict.rejections] == [
        Reason.WRONG_NUMA,
        Reason.PORT_NOT_ACTIVE,
        Reason.DEFAULT_ROUTE,
    ]


# ------------------------------------------------------------------ pyverbs


@pytest.mark.netns
def test_pyverbs_without_rdma_subsystem_means_no_devices(tmp_path: Path, ns: NetNs) -> None:
    verbs = FakePyverbs(None)  # raises PyverbsRDMAError like the real module here
    found = discover(sysfs_root=tmp_path / "empty", runner=ns.runner, pyverbs=verbs)
    assert found.ports == ()
    assert any("PyverbsRDMAError: Failed to get devices list" in n for n in found.notes)
    with pytest.raises(RailError, match="NICs seen: none"):
        evaluate(found, 0).require()


@pytest.mark.netns
def test_pyverbs_failure_keeps_the_sysfs_view(sysfs: Path, ns: NetNs) -> None:
    found = discover(sysfs_root=sysfs, runner=ns.runner, pyverbs=FakePyverbs(None))
    assert [r.name for r in evaluate(found, 0).rails] == ["mlx5_1:1"]


@pytest.mark.netns
def test_pyverbs_port_state_wins_and_is_noted(sysfs: Path, ns: NetNs) -> None:
    r1 = ns.ifindex("r1")
    verbs = FakePyverbs({"mlx5_1": [VerbsPortSpec(state=1, ifindexes=(r1,))]})  # DOWN
    found = discover(sysfs_root=sysfs, runner=ns.runner, pyverbs=verbs)
    assert evaluate(found, 0).rails == ()
    port = next(p for p in found.ports if p.device == "mlx5_1")
    assert port.state is PortState.DOWN
    assert "sysfs says ACTIVE, verbs says DOWN; using verbs" in port.notes
    assert all(ctx.closed for ctx in verbs.opened)


@pytest.mark.netns
def test_pyverbs_gid_table_supplies_a_missing_netdev(tmp_path: Path, ns: NetNs) -> None:
    root = build_sysfs(tmp_path, [FakeNic("mlx5_7", None, 0)])
    verbs = FakePyverbs({"mlx5_7": [VerbsPortSpec(ifindexes=(ns.ifindex("r2"),))]})
    assert evaluate(discover(sysfs_root=root, runner=ns.runner, pyverbs=False), 0).rails == ()
    found = discover(sysfs_root=root, runner=ns.runner, pyverbs=verbs)
    assert [(r.name, r.netdev) for r in evaluate(found, 0).rails] == [("mlx5_7:1", "r2")]


@pytest.mark.netns
def test_pyverbs_gid_netdev_mismatch_is_noted(sysfs: Path, ns: NetNs) -> None:
    verbs = FakePyverbs({"mlx5_1": [VerbsPortSpec(ifindexes=(ns.ifindex("r3"),))]})
    found = discover(sysfs_root=sysfs, runner=ns.runner, pyverbs=verbs)
    port = next(p for p in found.ports if p.device == "mlx5_1")
    assert "verbs GID table names r3, sysfs names r1" in port.notes
    assert "verbs GID table names r3" in evaluate(found, 7).error_message()


@pytest.mark.netns
def test_device_seen_only_by_pyverbs_has_unknown_numa(sysfs: Path, ns: NetNs) -> None:
    verbs = FakePyverbs({"mlx5_8": [VerbsPortSpec(ifindexes=(ns.ifindex("r1"),))]})
    found = discover(sysfs_root=sysfs, runner=ns.runner, pyverbs=verbs)
    verdict = next(v for v in evaluate(found, 0).verdicts if v.port.device == "mlx5_8")
    assert verdict.port.numa is None
    assert [r.reason for r in verdict.rejections] == [Reason.WRONG_NUMA]
    assert "seen by pyverbs only" in verdict.describe()


def test_real_pyverbs_without_rdma_is_no_devices(tmp_path: Path) -> None:
    """The installed pyverbs on a kernel without RDMA: "no devices", not a crash."""
    import pyverbs.device as device  # the rdma extra is part of the test environment

    if Path("/sys/class/infiniband").is_dir():
        pytest.skip("this kernel has RDMA devices: the no-RDMA path cannot be shown here")
    found = discover(sysfs_root=tmp_path, runner=lambda argv: "[]", pyverbs=device)
    assert found.ports == ()
    assert any(n.startswith("pyverbs: no RDMA devices") for n in found.notes)


# ------------------------------------------------------------ sources (no netns)


def canned(outputs: dict[str, str]) -> CommandRunner:
    def run(argv: Sequence[str]) -> str:
        key = " ".join(argv)
        if key not in outputs:
            raise FileNotFoundError(argv[0])
        return outputs[key]

    return run


IP_ADDR = json.dumps(
    [
        {"ifindex": 1, "ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1"}]},
        {
            "ifindex": 5,
            "ifname": "ens1",
            "addr_info": [
                {"family": "inet6", "local": "fe80::1", "prefixlen": 64},
                {"family": "inet", "local": "10.1.0.2", "prefixlen": 24},
                {"family": "inet", "local": "10.1.9.2", "prefixlen": 16},
            ],
        },
        {"ifindex": 6, "ifname": "ens2", "addr_info": []},
    ]
)


def test_sources_parse_iproute2_json(tmp_path: Path) -> None:
    run = canned({"ip -j addr show": IP_ADDR, "ip -j route show default": "[]"})
    found = discover(sysfs_root=tmp_path, runner=run, pyverbs=False)
    assert found.network.ipv4 == {
        "lo": ("127.0.0.1/32",),
        "ens1": ("10.1.0.2/24", "10.1.9.2/16"),
    }
    assert found.network.ifindex == {1: "lo", 5: "ens1", 6: "ens2"}
    assert found.network.default_route == ()
    assert found.problems == ()


def test_missing_ip_command_is_a_problem_in_the_error(tmp_path: Path) -> None:
    root = build_sysfs(tmp_path, [FakeNic("mlx5_0", "ens1", 0)])
    found = discover(sysfs_root=root, runner=canned({}), pyverbs=False)
    assert len(found.problems) == 2
    message = evaluate(found, 0).error_message()
    assert "`ip -j addr show` failed: FileNotFoundError" in message
    assert "IPv4 addresses unknown (`ip` failed); default route unknown (`ip` failed)" in message


def test_unreadable_default_route_rejects_every_nic(tmp_path: Path) -> None:
    """A NIC that might be the management interface is never picked."""
    root = build_sysfs(tmp_path, [FakeNic("mlx5_0", "ens1", 0)])
    good = canned({"ip -j addr show": IP_ADDR, "ip -j route show default": "[]"})
    assert select_rails(0, sysfs_root=root, runner=good, pyverbs=False)[0].netdev == "ens1"
    broken = canned({"ip -j addr show": IP_ADDR, "ip -j route show default": "not json"})
    found = discover(sysfs_root=root, runner=broken, pyverbs=False)
    assert found.network.addresses_known and not found.network.routes_known
    (verdict,) = evaluate(found, 0).verdicts
    assert [r.reason for r in verdict.rejections] == [Reason.DEFAULT_ROUTE]
    assert (
        "`ip -j route show default` failed: JSONDecodeError" in evaluate(found, 0).error_message()
    )


def test_sysfs_reader_details(tmp_path: Path) -> None:
    root = build_sysfs(
        tmp_path,
        [
            FakeNic("mlx5_0", "ens1", 0, extra_gid_netdevs=("ens1.100", "ens1")),
            FakeNic("ib0dev", "ib0", 1, link_layer="InfiniBand", state="INIT"),
        ],
    )
    # A dual-port function without GID netdevs: device/net + dev_port pick the netdev.
    dual = root / "class" / "infiniband" / "mlx5_5"
    for port in (1, 2):
        (dual / "ports" / str(port)).mkdir(parents=True)
        set_port_state(root, "mlx5_5", port, "ACTIVE")
    for i, name in enumerate(("enp0", "enp1")):
        (dual / "device" / "net" / name).mkdir(parents=True)
        (dual / "device" / "net" / name / "dev_port").write_text(f"{i}\n")
    (dual / "device" / "numa_node").write_text("garbage\n")
    ndevs = root / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "gid_attrs" / "ndevs"
    (ndevs / "x").write_text("ignored\n")

    found = discover(sysfs_root=root, runner=lambda argv: "[]", pyverbs=False)
    by_name = {p.name: p for p in found.ports}
    assert by_name["mlx5_0:1"].netdev == "ens1"
    assert by_name["mlx5_0:1"].gid_netdevs == ("ens1", "ens1.100")
    assert by_name["mlx5_0:1"].link_layer is LinkLayer.ETHERNET
    assert by_name["ib0dev:1"].link_layer is LinkLayer.INFINIBAND
    assert by_name["ib0dev:1"].state is PortState.INIT
    assert (by_name["mlx5_5:1"].netdev, by_name["mlx5_5:2"].netdev) == ("enp0", "enp1")
    assert by_name["mlx5_5:1"].numa is None
    assert "device/numa_node is unreadable" in by_name["mlx5_5:1"].notes
    assert by_name["mlx5_5:1"].link_layer is LinkLayer.UNSPECIFIED


def test_missing_sysfs_class_says_no_rdma_subsystem(tmp_path: Path) -> None:
    found = discover(sysfs_root=tmp_path, runner=lambda argv: "[]", pyverbs=False)
    assert found.ports == ()
    assert "no RDMA subsystem" in found.notes[0]


@pytest.mark.parametrize(
    ("text", "state"),
    [
        ("4: ACTIVE\n", PortState.ACTIVE),
        ("1: DOWN", PortState.DOWN),
        ("2: INIT", PortState.INIT),
        ("3: ARMED", PortState.ARMED),
        ("5: ACTIVE_DEFER", PortState.ACTIVE_DEFER),
        ("ACTIVE", PortState.ACTIVE),
        ("9: WEIRD", PortState.UNKNOWN),
        ("", PortState.UNKNOWN),
    ],
)
def test_port_state_parsing(text: str, state: PortState) -> None:
    assert PortState.from_sysfs(text) is state


def test_accelerator_numa_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # rbln-smi prints numa_node as a string on some driver versions: accept both.
    smi = json.dumps(
        {
            "devices": [
                {"npu": 0, "status": "normal", "pci": {"bus_id": "0000:ab:00.0", "numa_node": "1"}},
                {"npu": 1, "status": "normal", "pci": {"bus_id": "0000:cd:00.0", "numa_node": 0}},
            ]
        }
    )
    run = canned({"rbln-smi -j": smi})
    assert accelerator_numa(numa_node=3, runner=run).node == 3
    monkeypatch.delenv("RBLN_VISIBLE_DEVICES", raising=False)
    got = accelerator_numa(runner=run)
    assert (got.node, got.source) == (1, "rbln-smi -j, npu 0")
    monkeypatch.setenv("RBLN_VISIBLE_DEVICES", "1,0")
    assert accelerator_numa(runner=run).node == 0
    assert accelerator_numa(runner=run, npu_index=0).node == 1

    pci = tmp_path / "bus" / "pci" / "devices" / "0000:ab:00.0"
    pci.mkdir(parents=True)
    (pci / "numa_node").write_text("2\n")
    got = accelerator_numa(pci_address="0000:ab:00.0", sysfs_root=tmp_path, runner=run)
    assert got.node == 2 and got.source.endswith("0000:ab:00.0/numa_node")

    with pytest.raises(RailError, match=r"rbln-smi not found.*--numa-node N"):
        accelerator_numa(runner=canned({}))
    with pytest.raises(RailError, match=r"no pci\.numa_node for npu 5"):
        accelerator_numa(runner=run, npu_index=5)


# ----------------------------------------------------------- rails per transfer


def rail(i: int) -> Rail:
    return Rail(device=f"mlx5_{i}", port=1, netdev=f"r{i}", ipv4=f"10.90.{i}.1", numa=0)


def test_shared_rails_keep_local_order_and_match_by_name() -> None:
    local = [rail(0), rail(1), rail(2)]
    remote = [
        Rail(device="mlx5_2", port=1, netdev="other", ipv4="10.0.0.9", numa=1),
        rail(1),
        rail(7),
    ]
    assert shared_rails(local, remote) == (rail(1), rail(2))
    assert shared_rails(local, []) == ()
    # The handshake carries names (kvxfer.core.wire): names work on either side.
    assert shared_rails(local, ["mlx5_2:1", "mlx5_0:2"]) == (rail(2),)
    assert shared_rails(["mlx5_0:1", "mlx5_2:1"], remote) == ("mlx5_2:1",)
    assert rails_for_transfer(("mlx5_2:1", "mlx5_3:1"), None) == ("mlx5_2:1",)


def test_stripe_width() -> None:
    shared = (rail(0), rail(1), rail(2))
    assert rails_for_transfer(shared, None) == (rail(0),)
    assert rails_for_transfer(shared, 0) == shared
    for bad in (1, 2, -1, True, False, "0", 0.0):
        with pytest.raises(ConfigError, match=r"^stripe_width=.*must be unset"):
            rails_for_transfer(shared, bad)  # type: ignore[arg-type]
    with pytest.raises(RailError, match="no rail is shared"):
        rails_for_transfer((), None)


def test_ucx_env() -> None:
    assert ucx_env([rail(0), rail(1)]) == "mlx5_0:1,mlx5_1:1"
    assert ucx_env(["mlx5_3:1", rail(1)]) == "mlx5_3:1,mlx5_1:1"
    assert ucx_environment([rail(0), rail(1)], None) == {
        "UCX_NET_DEVICES": "mlx5_0:1,mlx5_1:1",
        "UCX_MAX_RNDV_RAILS": "1",
    }
    assert ucx_environment([rail(0), rail(1)], 0)["UCX_MAX_RNDV_RAILS"] == "2"
    with pytest.raises(RailError):
        ucx_env([])
    with pytest.raises(ConfigError):
        ucx_environment([rail(0)], 3)


def test_rails_and_discovery_roundtrip_through_msgspec() -> None:
    import msgspec

    found = Discovery(
        ports=(),
        network=HostNetwork(ipv4={"r1": ("10.90.1.1/24",)}, ifindex={3: "r1"}),
        notes=("x",),
    )
    data = msgspec.json.encode(found)
    assert msgspec.json.decode(data, type=Discovery) == found
    rails = msgspec.json.decode(msgspec.json.encode([rail(1)]), type=list[Rail])
    assert rails == [rail(1)]


def test_import_stays_light() -> None:
    code = (
        "import sys, kvxfer.io.rails, kvxfer.io.linkmon\n"
        "heavy = {'zmq', 'torch', 'nixl', 'vllm', 'pyverbs'} & set(sys.modules)\n"
        "print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
