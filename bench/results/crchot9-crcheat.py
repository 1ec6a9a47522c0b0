"""CRC-32C speed over bytes just copied (in the CPU's caches) against the same bytes once
more of the answer has been copied after them: 32 MiB copied in pieces of 1..32 MiB, each
piece summed (crc32c.crc32c per MiB) right after its copy; GB/s of the sums alone."""

import os
import time

import crc32c

M = 1 << 20
src = memoryview(os.urandom(64 * M))
dst = memoryview(bytearray(64 * M))
for piece in (1, 2, 4, 8, 16, 32):
    spent = 0.0
    for _ in range(20):
        for j in range(0, 32, piece):
            dst[j * M : (j + piece) * M] = src[j * M : (j + piece) * M]
            t = time.perf_counter()
            for i in range(j, j + piece):
                crc32c.crc32c(dst[i * M : (i + 1) * M])
            spent += time.perf_counter() - t
    print(f"copy {piece:2d} MiB, then sum it: {20 * 32 / 1024 / spent:.1f} GB/s")
