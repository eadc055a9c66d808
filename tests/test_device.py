"""device.keep_freed_host_memory: afterwards a freed tensor's memory stays in the process for the next one, where
glibc's defaults hand it back to the kernel (and the next tensor faults fresh pages in). Each case runs in a child
process, which reads glibc's own accounting (mallinfo2)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning is glibc's mallopt")

# a 24 MiB tensor (over glibc's initial 128 KiB mmap threshold, under the 32 MiB set here): allocated, written and
# freed; then how much of it glibc had mmap'd, and how much free memory the heap's top kept after the free
_CHILD = """
import ctypes, sys, torch
from hybridflow import device
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
tuned = device.keep_freed_host_memory() if sys.argv[1] == "tuned" else False
t = torch.empty(24 << 18).fill_(1.0)
mmapped = libc.mallinfo2().hblkhd
del t
print(tuned, mmapped >> 20, libc.mallinfo2().keepcost >> 20)
"""


def _child(mode: str, switch: str = "1") -> tuple[str, int, int]:
    env = {**os.environ, "HYBRIDFLOW_KEEP_FREED_MEMORY": switch}
    tuned, mmapped_mib, kept_mib = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True,
                                                  text=True, env=env, timeout=120, check=True).stdout.split()
    return tuned, int(mmapped_mib), int(kept_mib)


def test_a_freed_tensor_stays_in_the_heap_for_the_next():
    tuned, mmapped, kept = _child("tuned")
    assert tuned == "True"
    assert mmapped < 24 and kept >= 24, (mmapped, kept)  # from the heap, and kept at its top once freed
    _, mmapped, kept = _child("plain")
    assert mmapped >= 24 and kept < 24, (mmapped, kept)  # glibc's defaults: mmap'd, and unmapped at the free


def test_the_environment_switch_leaves_glibc_defaults():
    tuned, mmapped, _ = _child("tuned", switch="0")
    assert tuned == "False" and mmapped >= 24
