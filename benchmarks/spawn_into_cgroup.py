"""Does starting a replica straight into its cgroup pay? Prints JSON.

    python benchmarks/spawn_into_cgroup.py [N]     # N spawns per round (default 300), 4 rounds

Issue 17's remaining lever was "a spawn without the move": today a replica is started with
``os.posix_spawn`` and then moved into its cgroup (``pidfd_open``, then ``cgroup.procs`` opened,
written and closed). ``clone3(CLONE_INTO_CGROUP)`` starts it inside its cgroup instead; glibc 2.36
has no wrapper for it, so ``experiments/clone3_spawn.c`` (compiled here with gcc, loaded through
ctypes, which lets go of the GIL during the call) does what ``posix_spawn`` does — a child on its own
stack sharing the caller's memory until it has exec'd — with the cgroup and a pidfd given to the
kernel. Both start ``sh -c 'exit 0'`` in a new session, stdout and stderr on a pipe, each into a new
cgroup (made beforehand, not timed), rounds interleaved. Measured: the calling thread's wall time
and processor time per start (what the event loop would spend), median and mean in microseconds.

Needs x86_64, root (a cgroup v2 directory one may create cgroups in) and gcc.
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from asynctorchx.schedulers._local import contain  # noqa: E402

ARGV = [b"sh", b"-c", b"exit 0"]


def load(tmp: str) -> ctypes.CDLL:
    lib_path = os.path.join(tmp, "libclone3_spawn.so")
    source = str(HERE / "experiments" / "clone3_spawn.c")
    subprocess.run(
        ["gcc", "-O2", "-fPIC", "-shared", "-Wl,-z,now", "-o", lib_path, source], check=True
    )
    lib = ctypes.CDLL(lib_path)
    lib.atx_spawn.restype = ctypes.c_long
    charpp = ctypes.POINTER(ctypes.c_char_p)
    lib.atx_spawn.argtypes = [ctypes.c_char_p, charpp, charpp]
    lib.atx_spawn.argtypes += [ctypes.c_int] * 3 + [ctypes.c_char_p, ctypes.c_int]
    lib.atx_spawn.argtypes += [ctypes.POINTER(ctypes.c_int)]
    return lib


def c_strings(items: list[bytes]) -> ctypes.Array[ctypes.c_char_p]:
    return (ctypes.c_char_p * (len(items) + 1))(*items, None)


def spawn_then_move(cgroup: str, env: dict[bytes, bytes], fds: tuple[int, int]) -> int:
    """What the launcher does today on a warm migration lock; returns the pidfd."""
    stdin, out = fds
    pid = os.posix_spawn(
        "/bin/sh",
        ARGV,
        env,
        file_actions=[
            (os.POSIX_SPAWN_DUP2, stdin, 0),
            (os.POSIX_SPAWN_DUP2, out, 1),
            (os.POSIX_SPAWN_DUP2, out, 2),
        ],
        setsid=True,
        setsigdef=(13, 25),
        setsigmask=(),
    )
    pidfd = os.pidfd_open(pid)
    contain.move(cgroup, pid)
    return pidfd


def spawn_into(lib: ctypes.CDLL, cgroup: str, envp: list[bytes], fds: tuple[int, int]) -> int:
    """The replica started inside ``cgroup``; returns the pidfd."""
    stdin, out = fds
    cgroup_fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        pidfd = ctypes.c_int(-1)
        pid = lib.atx_spawn(
            b"/bin/sh", c_strings(ARGV), c_strings(envp), stdin, out, out, None, cgroup_fd,
            ctypes.byref(pidfd),
        )  # fmt: skip
    finally:
        os.close(cgroup_fd)
    if pid < 0:
        raise OSError(-pid, os.strerror(-pid))
    return pidfd.value


def one_round(mode: str, n: int, base: str, lib: ctypes.CDLL) -> dict[str, object]:
    env = dict(os.environb)
    envp = [k + b"=" + v for k, v in env.items()]
    stdin = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    dirs = [os.path.join(base, f"{mode}-{i}") for i in range(n)]
    for d in dirs:
        os.mkdir(d)
    walls, cpus, pidfds = [], [], []
    try:
        for d in dirs:
            r, w = os.pipe()
            t0, c0 = time.perf_counter(), time.thread_time()
            if mode == "posix_spawn_then_move":
                pidfd = spawn_then_move(d, env, (stdin, w))
            else:
                pidfd = spawn_into(lib, d, envp, (stdin, w))
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
            os.close(w)
            os.close(r)
            pidfds.append(pidfd)
            if len(pidfds) > 16:  # (a few alive at once, as in a sweep)
                done = pidfds.pop(0)
                os.waitid(os.P_PIDFD, done, os.WEXITED)
                os.close(done)
        for done in pidfds:
            os.waitid(os.P_PIDFD, done, os.WEXITED)
            os.close(done)
    finally:
        os.close(stdin)
        for d in dirs:
            while not contain.remove_tree(d):
                time.sleep(0.01)

    def us(xs: list[float]) -> dict[str, float]:
        return {
            "median": round(statistics.median(xs) * 1e6, 1),
            "mean": round(statistics.mean(xs) * 1e6, 1),
        }

    return {"mode": mode, "wall_us": us(walls), "cpu_us": us(cpus)}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    parent = contain.own_cgroup_dir()
    if parent is None:
        sys.exit("no cgroup v2 directory to work in")
    base = os.path.join(parent, f"atx-spawn-bench-{os.getpid()}")
    os.mkdir(base)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            lib = load(tmp)
            rounds = [
                one_round(mode, n, base, lib)
                for _ in range(2)
                for mode in ("posix_spawn_then_move", "clone3_into_cgroup")
            ]
    finally:
        contain.remove_tree(base)
    print(json.dumps({"n": n, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
