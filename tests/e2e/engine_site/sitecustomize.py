"""Run at start-up by every Python process of a test vLLM server (this folder is put
on their ``PYTHONPATH`` by ``tests/e2e/servers.py``).

vLLM's CPU attention picks its AMX kernel on CPUs that report AMX tiles (bf16, block
sizes that are multiples of 32) but never asks Linux for the AMX state, which each
process must request once (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``)
before its first tile instruction; without it the engine dies of SIGILL in its first
forward pass. Asking here costs one system call and changes nothing on CPUs without
AMX (the call fails and is ignored).
"""

from __future__ import annotations

import ctypes
import platform
import sys


def _request_amx_state() -> None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata)
    except (OSError, AttributeError):
        pass


_request_amx_state()
