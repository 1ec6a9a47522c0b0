"""Ways a chunkserver could land a large APPEND's payload in a chunk file, measured alone:
one receiving thread's CPU per GB (``time.thread_time``; the sender is another thread of the
process, not counted) for 4 MiB payloads over loopback TCP, each checked with CRC-32C and
written at consecutive offsets of a file with blocks reserved up front (fallocate), as a
chunkserver's appends are.

Ways (``--ways``):
  copy    recv_into a reused 4 MiB buffer, CRC-32C over it, pwrite: today's path, less Python
  piece   the same, CRC-32C over each received piece as it lands (while in the CPU's cache)
  splice  socket -> pipe (1 MiB) -> file with os.splice, then CRC-32C over a mmap view of the
          range just written (what a splice path must do before it may answer)
  mapped  recv_into a MAP_SHARED view of the file's range (no pwrite), CRC-32C over it

Pages (``--pages``): ``fresh`` writes each pass into a new file, kept until the end (every
page-cache page a new one, as appends get: on this VM a page the guest has not touched for
a while); ``cached`` rewrites one 128 MiB file whose pages stay in the cache (as Mooncake's
segment and fio's time-based file are).  The ways run in alternating order, ``--reps`` times.

python bench/results/bigput_receive.py [--dir DIR] [--pages fresh,cached] [--mib 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import fcntl
import mmap
import os
import socket
import statistics
import tempfile
import threading
import time

import crc32c

N = 4 << 20
PIPE = 1 << 20
F_SETPIPE_SZ = 1031


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--pages", default="fresh,cached")
    ap.add_argument("--ways", default="copy,piece,splice,mapped")
    ap.add_argument("--mib", type=int, default=256, help="MiB per pass")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    d = tempfile.mkdtemp(dir=a.dir, prefix="bigput-")
    ls = socket.create_server(("127.0.0.1", 0))
    tx = socket.create_connection(ls.getsockname())
    rx, _ = ls.accept()
    src = os.urandom(N)

    def send() -> None:
        while True:
            tx.sendall(src)

    threading.Thread(target=send, daemon=True).start()
    buf = bytearray(N)
    mv = memoryview(buf)
    pr, pw = os.pipe()
    fcntl.fcntl(pw, F_SETPIPE_SZ, PIPE)
    sock = rx.fileno()

    def recv_all(dst: memoryview, piece: bool) -> int:
        got, c = 0, 0
        while got < N:
            n = rx.recv_into(dst[got:], N - got)
            if piece:
                c = crc32c.crc32c(dst[got:got + n], c)
            got += n
        return c

    def copy(fd: int, off: int) -> int:
        recv_all(mv, False)
        c = crc32c.crc32c(mv)
        os.pwrite(fd, mv, off)
        return c

    def piece(fd: int, off: int) -> int:
        c = recv_all(mv, True)
        os.pwrite(fd, mv, off)
        return c

    def splice(fd: int, off: int) -> int:
        left, pos = N, off
        while left:
            n = os.splice(sock, pw, min(left, PIPE))
            left -= n
            while n:
                k = os.splice(pr, fd, n, offset_dst=pos)
                n -= k
                pos += k
        m = mmap.mmap(fd, N, offset=off, prot=mmap.PROT_READ)
        v = memoryview(m)
        c = crc32c.crc32c(v)
        v.release()
        m.close()
        return c

    def mapped(fd: int, off: int) -> int:
        m = mmap.mmap(fd, N, offset=off)
        v = memoryview(m)
        recv_all(v, False)
        c = crc32c.crc32c(v)
        v.release()
        m.close()
        return c

    fns = {"copy": copy, "piece": piece, "splice": splice, "mapped": mapped}
    ways = a.ways.split(",")
    per = a.mib * (1 << 20) // N
    files: list[str] = []
    try:
        for pages in a.pages.split(","):
            cached = os.path.join(d, "cached")
            if pages == "cached":  # its pages in the cache before any pass is timed
                fd = os.open(cached, os.O_RDWR | os.O_CREAT, 0o600)
                os.posix_fallocate(fd, 0, 128 << 20)
                for i in range(32):
                    copy(fd, i * N)
                os.close(fd)
            cpu: dict[str, list[float]] = {w: [] for w in ways}
            wall: dict[str, list[float]] = {w: [] for w in ways}
            both: dict[str, list[float]] = {w: [] for w in ways}
            for rep in range(a.reps):
                for w in ways if rep % 2 == 0 else ways[::-1]:
                    if pages == "fresh":
                        path = os.path.join(d, f"{w}-{rep}")
                        files.append(path)
                        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                        os.posix_fallocate(fd, 0, per * N)
                    else:
                        fd = os.open(cached, os.O_RDWR)
                    c0, t0, p0 = time.thread_time(), time.perf_counter(), time.process_time()
                    for i in range(per):
                        fns[w](fd, (i * N) if pages == "fresh" else (i % 32) * N)
                    cpu[w].append((time.thread_time() - c0) / (per * N / 1e9))
                    wall[w].append(per * N / 1e9 / (time.perf_counter() - t0))
                    both[w].append((time.process_time() - p0) / (per * N / 1e9))
                    os.close(fd)
            for w in ways:
                runs = " / ".join(f"{x:.3f}" for x in cpu[w])
                print(f"{pages:6s} {w:6s} s/GB {runs}  median {statistics.median(cpu[w]):.3f}"
                      f"  (GB/s median {statistics.median(wall[w]):.2f}; sender + receiver s/GB median"
                      f" {statistics.median(both[w]):.3f})", flush=True)
    finally:
        for p in [*files, os.path.join(d, "cached")]:
            if os.path.exists(p):
                os.unlink(p)
        os.rmdir(d)


if __name__ == "__main__":
    main()
