"""What this machine's processor is, as text: the key of the caches built or measured for one processor (the CPU
decode-attention kernel's build, the MFU's matmul peak), and its vendor (which fp32 matmul library the training engine
takes)."""

from __future__ import annotations

import functools
import platform


@functools.cache
def cpu_description() -> str:
    """The processor's model name and instruction-set flags (from /proc/cpuinfo; elsewhere platform.processor())
    and the architecture: equal on two machines that run the same compiled code at the same speed per core."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = sorted({line.strip() for line in f if line.startswith(("model name", "flags"))})
    except OSError:
        lines = [platform.processor()]
    return "\n".join([*lines, platform.machine()])


@functools.cache
def cpu_vendor() -> str:
    """The processor's vendor as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD", ...); "" where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
