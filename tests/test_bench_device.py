"""``kvxfer bench --device``: the bench's cache in torch memory.

CI has no GPU, so the torch cache runs here on torch's CPU memory: the same code a GPU
run takes except for the memory kind NIXL registers (docs/PERFORMANCE.md, "GPU memory",
has the H200 runs). ``--device cuda`` on this machine is refused, naming why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from kvxfer.core.layout import MemKind
from kvxfer.testing.kvcache import HostKVCache
from kvxfer.tools.bench import cases as bc
from kvxfer.tools.bench import cli as bench
from kvxfer.tools.bench.data import fill_regions, verify_regions
from kvxfer.tools.bench.device import (
    DeviceMemcpy,
    DevicePool,
    TorchKVCache,
    check_device,
    parse_device,
)
from tests.benchkit import rereport

SHAPE = bc.SHAPES[bc.QWEN]


def test_the_torch_cache_fills_the_same_words_as_the_numpy_cache() -> None:
    host = HostKVCache(SHAPE, 16, 9)
    fill_regions(host.regions)
    dev = TorchKVCache(SHAPE, 16, 9, "cpu")
    dev.fill()
    copies = dev.host_regions()
    assert len(copies) == len(host.regions) == 2 * SHAPE.layers
    for a, b in zip(host.regions, copies):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert np.array_equal(a, b)


def test_the_torch_cache_layout_describes_its_own_memory() -> None:
    dev = TorchKVCache(SHAPE, 16, 9, "cpu")
    layout, host = dev.layout(), HostKVCache(SHAPE, 16, 9).layout()
    assert [r.base for r in layout.regions] == dev.bases()
    assert all(r.mem is MemKind.DRAM for r in layout.regions)  # torch's CPU memory
    # The same geometry as the numpy cache's, region for region: only the bases differ.
    strip = [(r.num_blocks, r.stride, r.block_len, r.layer, r.part) for r in layout.regions]
    assert strip == [(r.num_blocks, r.stride, r.block_len, r.layer, r.part) for r in host.regions]
    assert dev.nbytes == sum(r.num_blocks * r.block_len for r in layout.regions)


def test_zero_clears_exactly_the_rows_asked() -> None:
    dev = TorchKVCache(SHAPE, 16, 9, "cpu")
    dev.fill()
    dev.zero(np.array([2, 7]))
    for words in dev.regions:
        nonzero = (words != 0).any(dim=1).tolist()
        assert nonzero == [i not in (2, 7) for i in range(9)]


def test_verify_reads_a_host_copy_at_the_device_addresses() -> None:
    """The consumer's check on a torch cache: descriptors name the cache's addresses,
    the words checked are a host copy's."""
    prod = HostKVCache(SHAPE, 16, 12)
    fill_regions(prod.regions)
    cons = TorchKVCache(SHAPE, 16, 12, "cpu")
    local, remote = np.array([3, 4, 9]), np.array([0, 5, 6])
    block = prod.regions[0].nbytes // 12
    pl, cl = prod.layout(), cons.layout()
    la = np.array([r.base + b * block for r in cl.regions for b in local.tolist()], dtype=np.uint64)
    ra = np.array(
        [r.base + b * block for r in pl.regions for b in remote.tolist()], dtype=np.uint64
    )
    n = np.full(len(la), block, dtype=np.uint64)
    rows = [local] * len(cons.regions)

    def check() -> int:
        return verify_regions(cons.host_regions(), la, ra, n, pl, rows, cons.bases())

    assert check() > 0  # nothing landed
    for words, src in zip(cons.regions, prod.regions):
        words[torch.as_tensor(local)] = torch.from_numpy(src[remote].view(np.int64))
    assert check() == 0
    cons.regions[5][4, 11] += 1
    assert check() == 1


def test_device_memcpy_copies_the_bytes_asked() -> None:
    dev = TorchKVCache(SHAPE, 16, 4, "cpu")
    dev.fill()
    stream = np.concatenate([r.reshape(-1).view(np.uint8) for r in dev.host_regions()])
    nbytes = int(stream.size) * 2 // 3 + 5  # across regions, not a multiple of anything
    copy = DeviceMemcpy(dev.regions, nbytes + 3)  # room for all of it: no wrap-around
    assert copy.run(nbytes) > 0
    assert np.array_equal(copy.scratch[:nbytes].numpy(), stream[:nbytes])
    assert bool((copy.scratch[nbytes:] == 1).all())  # nothing past what was asked
    # More than the scratch holds wraps around it: the last bytes copied end up first.
    small = DeviceMemcpy(dev.regions, 1000)
    assert small.run(1500, threads=2) > 0
    assert np.array_equal(small.scratch[:500].numpy(), stream[1000:1500])
    small.close()


def _pool_cache() -> tuple[Any, np.ndarray]:
    """A TP rank's cache carved from one host pool, as ``kvxfer bench --tp`` builds it."""
    from kvxfer.core.heads import HeadLayout
    from kvxfer.testing.tp_kvcache import TPHostCache

    cache = TPHostCache(HeadLayout(num_kv_heads=8, tp_size=2), 1, num_blocks=6, fill_seed=3)
    first = next(iter(cache.buffers.values()))
    pool = np.zeros(first.nbytes * len(cache.buffers), dtype=np.uint8)
    for k, key in enumerate(list(cache.buffers)):
        pool[k * first.nbytes : (k + 1) * first.nbytes] = cache.buffers[key].reshape(-1)
        cache.buffers[key] = pool[k * first.nbytes : (k + 1) * first.nbytes].reshape(first.shape)
    return cache, pool


def test_a_device_pool_moves_the_layout_onto_its_copy() -> None:
    cache, pool = _pool_cache()
    on = DevicePool(pool, "cpu")
    host = cache.layout(per_head=True)
    moved = on.rebase(host)
    shift = int(on.tensor.data_ptr()) - int(pool.ctypes.data)
    assert shift != 0  # a distinct copy, on CPU too
    assert [r.base - shift for r in moved.regions] == [r.base for r in host.regions]
    assert [(r.stride, r.block_len, r.head) for r in moved.regions] == [
        (r.stride, r.block_len, r.head) for r in host.regions
    ]
    outside = np.zeros(64, dtype=np.uint8)
    stray = host.regions[0].__class__(
        base=int(outside.ctypes.data), num_blocks=1, stride=8, block_len=8
    )
    with pytest.raises(ValueError, match=r"region 0 .* is outside the pool"):
        on.rebase(host.__class__(block_size=host.block_size, regions=(stray,)))


def test_a_device_pool_zeroes_on_the_copy_and_reads_back() -> None:
    cache, pool = _pool_cache()
    before = pool.copy()
    on = DevicePool(pool, "cpu")
    on.zero_blocks(len(cache.buffers), cache.num_blocks, np.array([1, 4]))
    assert np.array_equal(pool, before)  # the host pool is untouched until read back
    on.download()
    for buf in cache.buffers.values():
        assert not buf[[1, 4]].any() and buf[[0, 2, 3, 5]].any()
    assert cache.mismatches([0, 2, 3, 5], [0, 2, 3, 5], 3) == []


@pytest.mark.parametrize("text", ["cpu", "cuda", "cuda:3"])
def test_device_forms_accepted(text: str) -> None:
    assert parse_device(text) == text


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:x", "CUDA", "cpu:0", ""])
def test_device_forms_refused_naming_option_value_and_rule(text: str) -> None:
    with pytest.raises(ValueError, match=rf"--device {text!r}: must be cpu, cuda or cuda:N"):
        parse_device(text)


def test_cuda_is_refused_where_torch_sees_no_gpu() -> None:
    if torch.cuda.is_available():  # pragma: no cover - CI and this machine have no GPU
        pytest.skip("a GPU is present")
    assert check_device("cuda") == "torch sees no CUDA device here"
    assert check_device("cpu") is None


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--device", "cpu", "--netns"], "--device cpu: not with --netns"),
        (
            ["--device", "cpu", "--backends", "ucx,host_bounce"],
            "--backends ucx,host_bounce: a device cache is benched on ucx only",
        ),
        (["--device", "cuda"], "--device cuda: torch sees no CUDA device here"),
    ],
)
def test_bench_refuses_device_runs_it_cannot_do(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if "cuda" in argv and torch.cuda.is_available():  # pragma: no cover
        pytest.skip("a GPU is present")
    assert bench.main(argv) == 2
    assert needle in capsys.readouterr().err


def test_bench_refuses_a_malformed_device(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--device", "gpu0"])
    assert "argument --device: 'gpu0': must be cpu, cuda or cuda:N" in capsys.readouterr().err


# -- one real run ---------------------------------------------------------------------------
@pytest.mark.proc
def test_a_torch_cache_run_through_two_processes_verifies(tmp_path: Any) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvxfer.cli",
            "bench",
            "--device",
            "cpu",
            "--models",
            bc.QWEN,
            "--block-sizes",
            "16",
            "--tokens",
            "100",
            "--patterns",
            "scattered",
            "--reps",
            "2",
            "--max-reps",
            "2",
            "--no-planning",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    objs = [json.loads(line) for line in out.stdout.splitlines()]
    assert objs[0]["kind"] == "run" and objs[0]["device"] == "cpu"
    cases = [o for o in objs if o["kind"] == "transfer"]
    # --device picks ucx when no backend is named; both directions by default.
    assert sorted((r["backend"], r["direction"]) for r in cases) == [
        ("ucx", "pull"),
        ("ucx", "push"),
    ]
    for r in cases:
        assert r["status"] == "ok", r
        assert r["verified"] is True and r["mismatched_words"] == {"kvxfer": 0, "nixl": 0}
        assert r["kvxfer_gbps"] > 0 and r["nixl_gbps"] > 0 and r["memcpy_gbps"] > 0
    again = rereport(tmp_path, out.stdout)
    assert again.returncode == 0, again.stderr
    assert "caches in torch memory on cpu (memcpy: a copy there)" in again.stdout


@pytest.mark.proc
def test_tp_ranks_on_a_device_copy_verify(tmp_path: Any) -> None:
    """``--tp --device``: each rank's cache built on the host, moved to the device copy,
    moved between the ranks there and checked from a copy read back."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvxfer.cli",
            "bench",
            "--tp",
            "2:1",
            "--device",
            "cpu",
            "--directions",
            "pull",
            "--tokens",
            "40",
            "--reps",
            "1",
            "--max-reps",
            "1",
            "--firsts",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    objs = [json.loads(line) for line in out.stdout.splitlines()]
    assert objs[0]["kind"] == "run" and objs[0]["device"] == "cpu"
    rows = [o for o in objs if o["kind"] == "tp"]
    assert [r["direction"] for r in rows] == ["pull"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["verified"] is True
        assert r["mismatches"] == {"kvxfer": 0, "nixl": 0, "nixl_runs": 0}
        assert r["runs"] == r["descriptors_posted"] // 4  # 4 heads of a block merge
        assert r["kvxfer_gbps"] > 0 and r["memcpy_gbps"] > 0
