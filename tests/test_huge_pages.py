"""device.huge_page_buffer / collapse_huge_pages: 2 MiB-aligned memory advised into transparent huge pages where the
machine allows them (THP "always" or "madvise"), and a switch that turns them off. Whether the kernel then gives huge
pages is its best effort (memory pressure, fragmentation), so the tests check the advice (smaps' THPeligible) and
the contents, and count huge pages only where the kernel reports success. The native rollout keeps its fp32 panels
there (tests/engines/test_cpu_linear.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from hybridflow import device

MIB = 1 << 20


def _thp_allowed() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def test_availability_follows_the_kernel_setting_and_the_switch():
    assert device.huge_pages_available() == (_thp_allowed() and not device.is_cuda_available()
                                             and os.environ.get("HYBRIDFLOW_HUGE_PAGES", "1") != "0")
    code = "from hybridflow import device; print(device.huge_pages_available())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "HYBRIDFLOW_HUGE_PAGES": "0"}).stdout.split()
    assert out == ["False"]


def test_a_buffer_is_aligned_sized_and_advised():
    buffer = device.huge_page_buffer(5 * MIB + 3)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 5 * MIB + 3
    assert buffer.data_ptr() % device.HUGE_PAGE_BYTES == 0
    buffer.fill_(7)
    assert int(buffer[-1]) == 7 and int(buffer[0]) == 7
    assert device.huge_page_state(buffer)["eligible"] == device.huge_pages_available()


def test_collapse_keeps_the_values_and_what_it_reports_is_there():
    # 40 MiB: over glibc's mmap threshold, so pages of its own, written while not advised (4 KiB ones)
    t = torch.arange(40 * MIB // 4, dtype=torch.float32)
    done = device.collapse_huge_pages(t)
    assert torch.equal(t, torch.arange(40 * MIB // 4, dtype=torch.float32))
    if done:  # the kernel collapsed every whole 2 MiB page inside it (19 of them)...
        seen = [device.huge_page_state(t)["bytes"]]
        # ...but may split one again before smaps is read (reclaim under the other test process's load did, once
        # in CI: 18 of 19); a collapse that reports success and never leaves them there fails all three reads
        while seen[-1] < 38 * MIB and len(seen) < 3 and device.collapse_huge_pages(t):
            seen.append(device.huge_page_state(t)["bytes"])
        assert max(seen) >= 38 * MIB, seen
    assert not device.collapse_huge_pages(torch.zeros(16))  # no whole 2 MiB page inside: nothing to do
