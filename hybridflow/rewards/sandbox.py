"""Run untrusted Python (model-generated code) in a boxed subprocess.

What is enforced, and how:
  * **wall time** - the parent kills the whole process group (SIGKILL) after ``time_limit_s``; ``RLIMIT_CPU`` is a
    second, in-process backstop for CPU-bound loops that escape the group;
  * **memory** - ``RLIMIT_AS`` (address space) of ``memory_limit_mb``: a huge allocation raises MemoryError;
  * **output** - stdout/stderr go to files capped by ``RLIMIT_FSIZE`` (``max_output_bytes``);
  * **network** - when ``unshare -n`` works (Linux, root or user namespaces enabled) the code runs in a fresh network
    namespace with no interfaces up: no connection can leave the box. Where it does not, an audit hook refuses socket
    creation; that fallback stops ordinary Python code but not code that reaches C directly, so it is weaker
    (``SandboxResult.network_isolation`` says which one applied);
  * **processes and native code** - the audit hook also refuses fork/exec/subprocess and ``ctypes`` loading;
  * **privileges** - started as root, the child drops to uid/gid 65534 (nobody) after setting its limits, so it
    cannot raise them back and can only read world-readable files. Its interpreter must then be readable by
    nobody: when ``sys.executable``'s stdlib is not (a pyenv under /root), the system ``/usr/bin/python3`` runs the
    code instead (standard library only - model-written solutions need no more);
  * **files and environment** - a fresh scratch directory as working directory and HOME (deleted afterwards), a
    minimal environment, and ``python -I`` (no user site-packages, no PYTHON* variables, script dir not on sys.path).
This is a resource and network box, not a security boundary against a determined kernel-level attacker: use a
container or VM for that.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass

__all__ = ["SandboxResult", "network_isolation_available", "run_python_sandboxed"]

_NOBODY = 65534

# Runs inside the child before the untrusted code: limits, privilege drop, audit hook, then exec the solution.
_BOOTSTRAP = r"""
import os, resource, sys
mem, cpu, fsize, nproc, drop, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6]
for res, lim in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(res, (lim, lim))
with open(path, encoding="utf-8") as f:
    src = f.read()
if drop:
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
_BLOCKED = ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
            "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "os.spawn",
            "pty.spawn", "ctypes.dlopen", "ctypes.dlsym")
def _guard(event, args):
    if event in _BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_guard)
sys.argv = ["solution.py"]
del os, resource, f, mem, cpu, fsize, nproc, drop, path
exec(compile(src, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run. ``ok`` means exit code 0 within the time limit."""

    ok: bool
    stdout: str
    stderr: str
    returncode: int | None  # negative: killed by that signal; None: never finished (timed out)
    timed_out: bool
    memory_exceeded: bool  # the code hit the memory limit (MemoryError or killed while over it)
    output_truncated: bool
    duration_s: float
    network_isolation: str  # "netns" (unshare -n) or "audit-hook" (weaker, see module docstring)


@functools.lru_cache(maxsize=1)
def network_isolation_available() -> bool:
    """Whether ``unshare -n`` can create a network namespace here (probed once per process)."""
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return False
    try:
        return subprocess.run([exe, "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_python_sandboxed(
    code: str,
    stdin: str = "",
    *,
    time_limit_s: float = 5.0,
    memory_limit_mb: int = 512,
    max_output_bytes: int = 1 << 20,
    max_processes: int = 64,
    python: str | None = None,
) -> SandboxResult:
    """Run `code` as a Python script with `stdin`, boxed as described in the module docstring."""
    scratch = tempfile.mkdtemp(prefix="hybridflow-sandbox-")
    try:
        return _run(code, stdin, scratch, time_limit_s, memory_limit_mb, max_output_bytes, max_processes, python)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _world_readable(path: str) -> bool:
    """Whether every directory on the way to `path` lets other users in (so uid nobody can import from it)."""
    path = os.path.realpath(path)
    while True:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return False
        if mode & 0o005 != 0o005 and os.path.isdir(path):
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


@functools.lru_cache(maxsize=4)
def _pick_interpreter(requested: str | None, drop_privileges: bool) -> tuple[str, bool]:
    """(python executable, whether to drop privileges). An unprivileged child needs a world-readable stdlib."""
    if requested is not None or not drop_privileges:
        return requested or sys.executable, drop_privileges
    stdlib = sysconfig.get_paths()["stdlib"]
    if _world_readable(stdlib) and _world_readable(sys.executable):
        return sys.executable, True
    # e.g. a pyenv interpreter under /root: fall back to the system python, whose stdlib everyone can read.
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and _world_readable(candidate):
            return candidate, True
    return sys.executable, False  # no usable interpreter for nobody: keep root (limits stay, but can be raised)


def _run(
    code: str,
    stdin: str,
    scratch: str,
    time_limit_s: float,
    memory_limit_mb: int,
    max_output_bytes: int,
    max_processes: int,
    python: str | None,
) -> SandboxResult:
    exe, drop = _pick_interpreter(python, os.geteuid() == 0)
    if drop:  # the unprivileged child must be able to work in its scratch directory
        os.chmod(scratch, 0o777)
    code_path = os.path.join(scratch, "solution.py")
    with open(code_path, "w", encoding="utf-8") as f:
        f.write(code)
    os.chmod(code_path, 0o644)
    argv = [
        exe, "-I", "-X", "utf8", "-c", _BOOTSTRAP,
        str(memory_limit_mb * 1024 * 1024), str(math.ceil(time_limit_s) + 1), str(max_output_bytes),
        str(max_processes), "1" if drop else "0", code_path,
    ]
    isolation = "audit-hook"
    if network_isolation_available():
        argv = ["unshare", "-n", "--", *argv]
        isolation = "netns"
    env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    out_path, err_path, in_path = (os.path.join(scratch, n) for n in (".stdout", ".stderr", ".stdin"))
    with open(in_path, "w", encoding="utf-8") as f:
        f.write(stdin)
    start = time.monotonic()
    timed_out = False
    with open(in_path, "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
        proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=ferr, cwd=scratch, env=env, start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout=time_limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            returncode = None
        finally:
            # Kill the whole group: children the code left behind must not outlive the run.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    duration = time.monotonic() - start
    stdout, out_trunc = _read_capped(out_path, max_output_bytes)
    stderr, err_trunc = _read_capped(err_path, max_output_bytes)
    if returncode is not None and returncode < 0 and -returncode == signal.SIGXCPU:
        timed_out = True  # the CPU-time backstop fired
    memory_exceeded = "MemoryError" in stderr or "Cannot allocate memory" in stderr
    return SandboxResult(
        ok=returncode == 0 and not timed_out,
        stdout=stdout,
        stderr=stderr,
        returncode=returncode,
        timed_out=timed_out,
        memory_exceeded=memory_exceeded,
        output_truncated=out_trunc or err_trunc or (returncode is not None and -returncode == signal.SIGXFSZ),
        duration_s=duration,
        network_isolation=isolation,
    )


def _read_capped(path: str, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    # Python ignores SIGXFSZ, so a write past RLIMIT_FSIZE fails with EFBIG and the file stops at the limit.
    return data[:limit].decode("utf-8", errors="replace"), len(data) >= limit
