"""``kvxfer bench --device``: the bench's KV cache in torch memory, on a GPU or not.

Without ``--device`` each bench process holds its cache in numpy arrays (host memory).
``--device cuda`` (or ``cuda:N``) puts it on a GPU (every process on that one device,
``--tp`` ranks too), where a GPU engine's paged KV cache
lives; ``--device cpu`` in torch's CPU memory, as a CPU engine allocates it. kvxfer and
raw NIXL then register and move that memory (NIXL VRAM on a GPU). The provenance fill
and the exact check are :mod:`.data`'s, on the same words: the fill runs on the device,
the check on a host copy of the consumer's regions. The memcpy reference becomes a copy
of the same bytes on the device.

torch is imported only by the processes that hold such a cache (and by the parent's
check that the device exists), never by ``import kvxfer``.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer.core.layout import KVLayout, MemKind
from kvxfer.testing.kvcache import ModelShape, model_layout
from kvxfer.tools.bench.data import REGION_SHIFT, WORD_FACTOR

__all__ = [
    "DEVICE_RULE",
    "DeviceMemcpy",
    "DevicePool",
    "TorchKVCache",
    "check_device",
    "cuda_ipc_get",
    "parse_device",
    "refusal",
    "report_note",
]

#: What ``--device`` accepts.
DEVICE_RULE = "cpu, cuda or cuda:N (a torch device)"
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def parse_device(text: str) -> str:
    """The ``--device`` value, checked for form only.

    Raises:
        ValueError: naming the option, the value and the rule.
    """
    if not _DEVICE.fullmatch(text):
        raise ValueError(f"--device {text!r}: must be {DEVICE_RULE}")
    return text


def check_device(device: str) -> str | None:
    """Why this machine cannot hold the bench's cache on ``device``; None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'kvxfer[torch]')"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return "torch sees no CUDA device here"
        index = int(device.split(":")[1]) if ":" in device else 0
        count = torch.cuda.device_count()
        if index >= count:
            return f"torch sees {count} CUDA device(s) here (cuda:0 to cuda:{count - 1})"
    return None


def refusal(device: str, *, netns: bool, backends: str | None) -> str | None:
    """Why ``kvxfer bench --device`` cannot run with the other options or here."""
    if netns:
        return "not with --netns (device memory moves between processes of one host)"
    if backends and {b.strip() for b in backends.split(",") if b.strip()} != {"ucx"}:
        return (
            f"--backends {backends}: a device cache is benched on ucx only (host "
            "bounce needs the engine's copy op; nixl_rbln's emulation is host memory)"
        )
    return check_device(device)


def report_note(device: str | None) -> str:
    """The report header's words for ``--device``."""
    if device is None:
        return ""
    return f", caches in torch memory on {device} (memcpy: a copy there)"


def cuda_ipc_get() -> str | None:
    """``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` as the bench's processes start their agents
    (the operator's value, or kvxfer's default on a GPU host)."""
    from kvxfer.backends._nixl import CUDA_IPC_GET_ZCOPY, ucx_defaults

    return os.environ.get(CUDA_IPC_GET_ZCOPY, ucx_defaults().get(CUDA_IPC_GET_ZCOPY))


def list_writes() -> bool:
    """Whether the bench's agents post each WRITE as one UCX list (``NIXL_UCX_SGL_ENABLE``,
    read by NIXL: kvxfer's and raw NIXL's agents alike)."""
    from kvxfer.backends._nixl import list_writes as _list_writes

    return _list_writes(os.environ)


def list_writes_note(on: bool | None) -> str:
    """The header line's note on UCX list writes (nothing when off)."""
    return ", UCX list writes (NIXL_UCX_SGL_ENABLE)" if on else ""


def _torch() -> Any:
    import torch

    return torch


class TorchKVCache:
    """A model-shaped cache in torch memory: one pool, carved into ``layers × {K, V}``
    regions of ``num_blocks`` blocks (as an engine's KV pool is one allocation).

    ``regions[i]`` is region *i* as ``(num_blocks, words)`` int64 words. The interface
    the bench uses is :class:`~kvxfer.testing.kvcache.HostKVCache`'s (``regions``,
    ``layout()``) plus the fill, zeroing and host copy the numpy cache does with
    :mod:`.data`'s functions.
    """

    def __init__(self, shape: ModelShape, block_size: int, num_blocks: int, device: str) -> None:
        torch = _torch()
        self.shape, self.block_size, self.num_blocks = shape, block_size, num_blocks
        self.device = torch.device(device)
        block_bytes = block_size * shape.token_bytes()
        if block_bytes % 8:
            raise ValueError(f"block of {block_bytes} B: the bench's words are 8 bytes")
        self.words = block_bytes // 8
        count = 2 * shape.layers
        self._pool = torch.zeros(count * num_blocks * self.words, dtype=torch.int64, device=device)
        size = num_blocks * self.words
        self.regions = [
            self._pool[i * size : (i + 1) * size].view(num_blocks, self.words) for i in range(count)
        ]

    @property
    def nbytes(self) -> int:
        """Total bytes of the cache."""
        return int(self._pool.numel()) * 8

    def layout(self) -> KVLayout:
        """The layout of this cache; VRAM on a GPU, DRAM in torch's CPU memory."""
        gpu = self.device.type != "cpu"
        return model_layout(
            self.shape,
            self.block_size,
            self.num_blocks,
            [int(r.data_ptr()) for r in self.regions],
            mem=MemKind.VRAM if gpu else MemKind.DRAM,
            device_id=int(self.device.index or 0) if gpu else 0,
        )

    def sync(self) -> None:
        """Wait for the device's queued work (a no-op on CPU)."""
        _sync(self.device)

    def fill(self) -> None:
        """Write :func:`.data.fill_regions`' provenance pattern, on the device."""
        torch = _torch()
        # The pattern's uint64 arithmetic in int64: two's complement wraps the same way.
        factor = torch.tensor(
            np.array([WORD_FACTOR], dtype=np.uint64).view(np.int64), device=self.device
        )
        col = torch.arange(self.words, dtype=torch.int64, device=self.device)
        row = torch.arange(self.num_blocks, dtype=torch.int64, device=self.device) * self.words
        for r, words in enumerate(self.regions):
            first = (row + (r << REGION_SHIFT))[:, None] + col[None, :]
            torch.mul(first, factor, out=words)
        self.sync()

    def zero(self, rows: npt.NDArray[np.int64]) -> None:
        """Zero the given blocks of every region (before a verified transfer)."""
        torch = _torch()
        idx = torch.as_tensor(np.ascontiguousarray(rows, dtype=np.int64), device=self.device)
        for words in self.regions:
            words.index_fill_(0, idx, 0)
        self.sync()

    def host_regions(self) -> list[npt.NDArray[np.uint16]]:
        """A host copy of every region, shaped as the numpy cache's regions (for
        :func:`.data.verify_regions`, with :meth:`bases`)."""
        self.sync()
        return [r.cpu().numpy().view(np.uint16) for r in self.regions]

    def bases(self) -> list[int]:
        """Each region's address (in device memory on a GPU)."""
        return [int(r.data_ptr()) for r in self.regions]


class DevicePool:
    """A device copy of a cache built in one host allocation (``kvxfer bench --tp
    --device``): the rank's cache is made and filled on the host as without a device,
    then copied once to the device, where kvxfer and raw NIXL move it. Its layout is
    the host layout moved onto the copy; checks read the copy back.

    Args:
        host: the host pool (every buffer of the cache, one allocation).
        device: the torch device of the copy (a distinct copy on ``cpu`` too).
    """

    def __init__(self, host: npt.NDArray[np.uint8], device: str) -> None:
        torch = _torch()
        self.host = host
        self.device = torch.device(device)
        self.tensor = torch.from_numpy(host).to(self.device, copy=True)
        _sync(self.device)

    def rebase(self, layout: KVLayout) -> KVLayout:
        """``layout`` (of the host pool) moved onto the device copy.

        Raises:
            ValueError: a region lies outside the host pool.
        """
        lo = int(self.host.ctypes.data)
        hi, base = lo + self.host.nbytes, int(self.tensor.data_ptr())
        gpu = self.device.type != "cpu"
        regions = []
        for i, r in enumerate(layout.regions):
            if not lo <= r.base or r.end > hi:
                raise ValueError(f"region {i} [{r.base:#x}, {r.end:#x}) is outside the pool")
            regions.append(
                msgspec.structs.replace(
                    r,
                    base=r.base - lo + base,
                    mem=MemKind.VRAM if gpu else MemKind.DRAM,
                    device_id=int(self.device.index or 0) if gpu else 0,
                )
            )
        return msgspec.structs.replace(layout, regions=tuple(regions))

    def download(self) -> None:
        """Copy the device copy back into the host pool (before a check)."""
        _sync(self.device)
        self.host[:] = self.tensor.cpu().numpy()

    def zero_blocks(self, buffers: int, num_blocks: int, rows: npt.NDArray[np.int64]) -> None:
        """Zero ``rows`` of each of the pool's ``buffers`` equal buffers of
        ``num_blocks`` blocks, on the device."""
        torch = _torch()
        idx = torch.as_tensor(np.ascontiguousarray(rows, dtype=np.int64), device=self.device)
        self.tensor.view(buffers, num_blocks, -1).index_fill_(1, idx, 0)
        _sync(self.device)


def _sync(device: Any) -> None:
    if device.type == "cuda":
        _torch().cuda.synchronize(device)


class DeviceMemcpy:
    """A copy of ``nbytes`` of device tensors (the consumer's cache) into scratch on the
    same device: the memcpy reference for a device cache (the bytes a transfer moves,
    moved by the device's own copy engine, with no second process or transport).

    ``threads`` is accepted for :class:`.data.MemcpyBench`'s interface; a device copy
    is one stream's work either way.
    """

    def __init__(self, sources: Sequence[Any], scratch_bytes: int) -> None:
        torch = _torch()
        self.device = sources[0].device
        self._src = [t.reshape(-1).view(torch.uint8) for t in sources]
        #: Where the copies land (one uint8 tensor on the device).
        self.scratch = torch.ones(max(scratch_bytes, 1), dtype=torch.uint8, device=self.device)

    def _pieces(self, nbytes: int) -> Sequence[tuple[Any, Any]]:
        """(source, destination) slices: the regions in order (again if needed), each
        cut where the scratch wraps around, as :class:`.data.MemcpyBench` walks them."""
        out, left, at, cap = [], nbytes, 0, int(self.scratch.numel())
        while left > 0:
            for src in self._src:
                done, size = 0, min(left, int(src.numel()))
                while done < size:
                    n = min(size - done, cap - at)
                    out.append((src[done : done + n], self.scratch[at : at + n]))
                    done += n
                    at = 0 if at + n >= cap else at + n
                left -= size
                if left <= 0:
                    break
        return out

    def run(self, nbytes: int, threads: int = 1) -> float:
        """Seconds to copy ``nbytes``, from the first copy queued to the device idle."""
        pieces = self._pieces(nbytes)
        _sync(self.device)
        t0 = time.perf_counter()
        for src, dst in pieces:
            dst.copy_(src, non_blocking=True)
        _sync(self.device)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Nothing to stop (the interface of :class:`.data.MemcpyBench`)."""
