"""The FUSE requests the kernel sends a kvfs mount per page file (bench/RESULTS.md,
2026-12-03): ``kvfs up`` and one ``kvfs mount`` (ARGS: its arguments, e.g. --write-behind
256MiB); 20 files written with numpy ``tofile``, then read back as HiCacheFile does
(``open(..., "rb", buffering=0).readinto``), then read the same way through a second mount
of the cluster (another node's cold read), while ``strace`` logs the mount's reads of
/dev/fuse; prints each phase's requests by opcode (READ with its sizes).

    python bench/results/fuse-requests.py --write-behind 256MiB > bench/results/fuse-requests.txt
    SIZE=2097152 python bench/results/fuse-requests.py --write-behind 256MiB --direct-first-open \
        >> bench/results/fuse-requests.txt
    FLOOR=1 python bench/results/fuse-requests.py [--flush] >> bench/results/fuse-requests.txt
    env: SIZE (page bytes, 131072); FLOOR=1: the floor (python -m kvfs.bench.memfs ARGS) instead,
    one mount, no cluster
"""

import collections
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvfs.bench.mount_pages import _mounted, kvfs_up
from kvfs.mount import is_mounted

OPS = {1: "LOOKUP", 2: "FORGET", 3: "GETATTR", 4: "SETATTR", 12: "RENAME", 14: "OPEN", 15: "READ",
       16: "WRITE", 18: "RELEASE", 20: "FSYNC", 22: "GETXATTR", 25: "FLUSH", 35: "CREATE",
       39: "IOCTL", 42: "BATCH_FORGET"}
N = 20
SIZE = int(os.environ.get("SIZE", str(128 << 10)))
FLOOR = os.environ.get("FLOOR") == "1"
_BYTES = re.compile(r"\\x([0-9a-f]{2})")


def requests(log: Path) -> collections.Counter[str]:
    """The requests in an ``strace -xx`` log of reads: a read whose first 4 bytes (the
    request's length) equal its return value is a request from /dev/fuse."""
    out: collections.Counter[str] = collections.Counter()
    for line in log.read_text().splitlines():
        m = re.search(r'read\(\d+, "((?:\\x[0-9a-f]{2})+)".* = (\d+)$', line)
        if not m:
            continue
        head = bytes(int(h, 16) for h in _BYTES.findall(m.group(1)))
        if len(head) < 8 or int.from_bytes(head[:4], "little") != int(m.group(2)):
            continue
        op = OPS.get(int.from_bytes(head[4:8], "little"), str(int.from_bytes(head[4:8], "little")))
        if op == "READ" and len(head) >= 64:
            op += f" of {struct.unpack_from('<I', head, 56)[0]} bytes"
        out[op] += 1
    return out


def traced(pid: int, log: Path, work: object) -> collections.Counter[str]:
    """The requests process ``pid`` read from /dev/fuse while ``work()`` ran."""
    st = subprocess.Popen(["strace", "-f", "-p", str(pid), "-e", "trace=read", "-xx", "-s", "64",
                           "-o", str(log)], stderr=subprocess.PIPE, text=True)
    try:
        assert st.stderr is not None
        for line in st.stderr:  # "Process N attached with M threads": every thread traced
            if "attached" in line:
                break
        else:
            raise SystemExit(f"strace did not attach to {pid}")
        work()  # type: ignore[operator]
        time.sleep(1.0)  # the kernel sends RELEASE in the background after close returns
    finally:
        st.terminate()  # (it writes out its log as it exits)
        st.wait()
    return requests(log)


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="fuse-requests-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        mnt, other = root / "mnt", root / "mnt2"
        mnt.mkdir()
        if FLOOR:  # the floor alone, in one directory: no cluster, no second mount
            fs = _mounted(mnt, ["kvfs.bench.memfs", *sys.argv[1:], str(mnt)], procs)
            d = mnt
        else:
            addr = kvfs_up(root, procs)
            fs = _mounted(mnt, ["kvfs", "mount", str(mnt), "--addr", addr, *sys.argv[1:]], procs)
            other.mkdir()
            _mounted(other, ["kvfs", "mount", str(other), "--addr", addr, *sys.argv[1:]], procs)
            d = mnt / "d"
            d.mkdir()
        page = np.frombuffer(os.urandom(SIZE), dtype=np.uint8)
        names = [d / f"{i:04d}.bin" for i in range(N)]
        buf = np.empty(SIZE, dtype=np.uint8)

        def write() -> None:
            for n in names:
                page.tofile(n)

        def read(where: list[Path] = names) -> None:
            for n in where:
                with open(n, "rb", buffering=0) as f:
                    assert f.readinto(buf.data) == SIZE and np.array_equal(buf, page)

        print(f"{'python -m kvfs.bench.memfs' if FLOOR else 'kvfs mount'} "
              f"{' '.join(sys.argv[1:]) or '(default)'}, {N} files of {SIZE} bytes, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        phases = [("tofile", fs.pid, write), ("readinto (unbuffered)", fs.pid, read)]
        if not FLOOR:
            elsewhere = [other / "d" / n.name for n in names]
            phases.append(("readinto through the second mount", procs[-1].pid, lambda: read(elsewhere)))
        for i, (what, pid, work) in enumerate(phases):
            got = traced(pid, root / f"{i}.strace", work)
            print(f"{what}: {sum(got.values())} requests, {sum(got.values()) / N:.1f} per file: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(got.items(), key=lambda kv: -kv[1])))
    finally:
        for m in ("mnt", "mnt2"):
            if is_mounted(str(root / m)):
                subprocess.run(["fusermount3", "-u", str(root / m)], check=False)
        for p in reversed(procs):
            p.terminate()
            p.wait(30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
