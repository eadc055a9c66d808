"""File modes of what hybridflow writes.

safetensors 0.8 writes its files with mode 0600 whatever the umask (a private temporary file renamed into place), so
a checkpoint's shards and an exported model's weights were readable by their owner only while the config and
tokenizer files beside them follow the umask (0644 under the usual 022). A model folder served by another account,
or a checkpoint shared on a cluster, then fails on its weights alone. `umask_modes` gives such files the mode every
other new file of the process gets.
"""

from __future__ import annotations

import glob
import os

__all__ = ["process_umask", "umask_modes"]


def process_umask() -> int:
    """The process's umask, read without changing it (Linux: /proc/self/status); 0o022 where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def umask_modes(*paths: str, pattern: str = "*.safetensors") -> None:
    """Give each file (a folder: its files matching `pattern`) the mode a new file gets under the umask."""
    mode = 0o666 & ~process_umask()
    for path in paths:
        files = glob.glob(os.path.join(path, pattern)) if os.path.isdir(path) else [path]
        for name in files:
            if os.path.isfile(name) and (os.stat(name).st_mode & 0o777) != mode:
                os.chmod(name, mode)
