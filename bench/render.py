"""Human text of a ``--compare`` run: the peer table, then the kvfs-internal comparisons."""

from __future__ import annotations

from .compare import Comparison
from .internal import Internal

__all__ = ["render_compare", "render_internal"]


def render_compare(comp: Comparison, internal: Internal | None) -> str:
    """The narrow table (a row per workload and store), the ratio table, the kvfs-internal ones."""
    lines = ["", "kvfs vs peers: one row per workload and store (one io = one key; MB/s = 10^6 B/s;",
             "p99/key = p99 of a call's latency / its keys, p99/call = p99 of one call's latency;",
             f"{comp.subject}/x = kvfs keys/s / that store's keys/s)", "", comp.table(),
             f"ratios: {comp.subject} keys/s / peer keys/s (the same as the MB/s ratio)", "",
             comp.ratio_table()]
    return "\n".join(lines) + "\n" + (render_internal(internal) if internal is not None else "")


def render_internal(internal: Internal) -> str:
    """The kvfs-internal comparisons: batcher on/off, prefix chains, server reads per chain."""
    lines: list[str] = []
    if internal.batcher is not None:
        lines += ["", "kvfs: 128 concurrent single-key get() (batcher on/x = batcher on / batch=False keys/s)",
                  internal.batcher.table()]
    if internal.chains is not None:
        lines += ["", "kvfs: prefix chains of 64 x 64KiB (ratio = per-chain keys/s / separate-puts keys/s)",
                  internal.chains.table()]
        for label, reads in internal.chain_reads.items():
            pc = reads.per_chain()
            if pc is None:
                lines.append(f"  {label}: server reads per chain: n/a (needs the embedded in-process cluster)")
            else:
                cells = ", ".join(f"cs{i}: {s:.2f} spans / {r:.2f} readv" for i, (s, r) in enumerate(pc))
                lines.append(f"  {label}: server reads per read call of 64 blocks, per server: {cells}")
    return "\n".join(lines) + "\n"
