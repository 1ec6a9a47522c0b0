"""What the size of one pwrite costs when it fills new page-cache pages: ``--mib`` MiB
appended to a new file (blocks reserved up front, as a chunk's) in pwrite calls of each
``--pieces`` size, one thread's CPU per GB (``time.thread_time``); every file is kept until
the end, so each pass takes pages the page cache did not hold.  Sizes run in alternating
order, ``--reps`` times.  Then, where ``/proc/kpageflags`` can be read (root), the page-cache
folios a 16 MiB file gets from 4 MiB and from 256 KiB writes at an offset like a record's
(60 bytes past a page): how many pages each folio holds.

python bench/results/pwrite_pieces.py [--dir DIR] [--mib 256] [--reps 3] [--pieces 4096,1024,256]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import struct
import tempfile
import time

FOLIO_FILE = 16 << 20


def folio_pages(path: str) -> dict[int, int] | None:
    """{pages in a folio: how many such folios} of ``path``'s first FOLIO_FILE bytes."""
    try:
        kf = os.open("/proc/kpageflags", os.O_RDONLY)
    except OSError:
        return None
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    pm = os.open("/proc/self/pagemap", os.O_RDONLY)
    addr = libc.mmap(None, FOLIO_FILE, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    sizes: dict[int, int] = {}
    try:
        cur = 0
        for i in range(FOLIO_FILE // 4096):
            ctypes.c_char.from_address(addr + i * 4096).value  # noqa: B018  (maps the page)
            entry = struct.unpack("<Q", os.pread(pm, 8, (addr // 4096 + i) * 8))[0]
            flags = struct.unpack("<Q", os.pread(kf, 8, (entry & ((1 << 55) - 1)) * 8))[0]
            if flags >> 16 & 1:  # KPF_COMPOUND_TAIL: the folio before goes on
                cur += 1
                continue
            if cur:
                sizes[cur] = sizes.get(cur, 0) + 1
            cur = 1
        sizes[cur] = sizes.get(cur, 0) + 1
    finally:
        libc.munmap(addr, FOLIO_FILE)
        for f in (fd, pm, kf):
            os.close(f)
    return dict(sorted(sizes.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pieces", default="4096,1024,256", help="KiB per pwrite, comma list")
    a = ap.parse_args()
    d = tempfile.mkdtemp(dir=a.dir, prefix="pieces-")
    src = memoryview(os.urandom(4 << 20))
    pieces = [int(k) << 10 for k in a.pieces.split(",")]
    total = a.mib << 20
    files: list[str] = []
    cpu: dict[int, list[float]] = {p: [] for p in pieces}
    try:
        for rep in range(a.reps):
            for piece in pieces if rep % 2 == 0 else pieces[::-1]:
                path = os.path.join(d, f"{piece}-{rep}")
                files.append(path)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                os.posix_fallocate(fd, 0, total)
                c0, off = time.thread_time(), 0
                while off < total:
                    for j in range(0, src.nbytes, piece):
                        os.pwrite(fd, src[j:j + piece], off)
                        off += piece
                cpu[piece].append((time.thread_time() - c0) / (total / 1e9))
                os.close(fd)
        for piece in pieces:
            runs = " / ".join(f"{x:.3f}" for x in cpu[piece])
            print(f"pwrite {piece >> 10:5d} KiB: s/GB {runs}  median {statistics.median(cpu[piece]):.3f}")
        for piece in (4 << 20, 256 << 10):
            path = os.path.join(d, f"folios-{piece}")
            files.append(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            os.posix_fallocate(fd, 0, FOLIO_FILE)
            off = 60
            while off + piece <= FOLIO_FILE:
                os.pwrite(fd, src[:piece], off)
                off += piece
            os.pwrite(fd, src[:FOLIO_FILE - off], off)
            os.close(fd)
            got = folio_pages(path)
            print(f"folios of {piece >> 10} KiB writes (pages per folio: count):",
                  got if got is not None else "not readable (/proc/kpageflags needs root)")
    finally:
        for p in files:
            os.unlink(p)
        os.rmdir(d)


if __name__ == "__main__":
    main()
