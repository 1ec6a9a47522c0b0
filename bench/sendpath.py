"""How a chunkserver can send file bytes into a TCP socket, and what each way costs the
sender: ``preadv`` into a buffer then ``send`` (two copies: page cache -> buffer ->
socket), ``mmap`` then ``send`` of the mapping's memoryview (one copy; a file cut short
while mapped would raise SIGBUS), ``mmap`` per value, and ``sendfile`` (page cache ->
socket, no user-space copy).  A receiver process reads into one buffer over loopback.
The file is read once first, so every way reads from the page cache.

    python -m kvfs.bench.sendpath [--dir DIR] [--sizes 1m,8m,32m] [--total 2g] [--repeat 2]

Prints, per way and value size, GB/s and the sender's CPU seconds per GB (its own
``getrusage``).  bench/RESULTS.md has a run.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import resource
import socket
import tempfile
import time
from pathlib import Path

from kvfs.units import parse_size

WAYS = ("preadv", "sendfile", "mmap", "mmap-each")
FILE_BYTES = 256 << 20


def _receive(port: int, total: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    view = memoryview(bytearray(8 << 20))
    got = 0
    while got < total:
        n = sock.recv_into(view)
        if not n:
            break
        got += n
    sock.close()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(path: Path, way: str, size: int, total: int) -> tuple[float, float]:
    """(GB/s, sender CPU s/GB) of sending ``total`` bytes in values of ``size`` one way."""
    ls = socket.create_server(("127.0.0.1", 0))
    rx = mp.get_context("spawn").Process(target=_receive, args=(ls.getsockname()[1], total))
    rx.start()
    conn, _ = ls.accept()
    fd = os.open(path, os.O_RDONLY)
    buf = memoryview(bytearray(size))
    whole = mmap.mmap(fd, FILE_BYTES, access=mmap.ACCESS_READ) if way == "mmap" else None
    t0, c0 = time.perf_counter(), _cpu()
    sent = off = 0
    while sent < total:
        if way == "preadv":
            os.preadv(fd, [buf], off)
            conn.sendall(buf)
        elif way == "sendfile":
            at, left = off, size
            while left:
                n = os.sendfile(conn.fileno(), fd, at, left)
                at += n
                left -= n
        elif way == "mmap":
            assert whole is not None
            with memoryview(whole)[off : off + size] as v:
                conn.sendall(v)
        else:
            each = mmap.mmap(fd, size, offset=off, access=mmap.ACCESS_READ)
            with memoryview(each) as v:
                conn.sendall(v)
            each.close()
        sent += size
        off = (off + size) % FILE_BYTES
    conn.shutdown(socket.SHUT_WR)
    rx.join()
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    if whole is not None:
        whole.close()
    os.close(fd)
    conn.close()
    ls.close()
    return total / wall / 1e9, cpu / (total / 1e9)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvfs.bench.sendpath", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("."),
                    help="where the 256 MiB test file is written (the chunk files' filesystem)")
    ap.add_argument("--sizes", default="1m,8m,32m", help="value sizes, comma-separated")
    ap.add_argument("--total", default="2g", help="bytes sent per way and size")
    ap.add_argument("--repeat", type=int, default=2)
    ns = ap.parse_args(argv)
    sizes = [parse_size(s) for s in ns.sizes.split(",")]
    total = parse_size(ns.total)
    with tempfile.NamedTemporaryFile(dir=ns.dir, prefix="kvfs-sendpath-") as f:
        f.write(os.urandom(FILE_BYTES))
        f.flush()
        path = Path(f.name)
        path.read_bytes()  # in the page cache
        for rep in range(ns.repeat):
            for size in sizes:
                for way in WAYS:
                    rate, cpu = run(path, way, size, total)
                    print(f"pass {rep + 1}  {way:9s}  {size >> 20:3d} MiB  {rate:5.2f} GB/s  "
                          f"sender {cpu:.3f} s/GB", flush=True)


if __name__ == "__main__":
    main()
