"""Human text of a ``--compare`` run: the peer table, then the kvfs-internal comparisons."""

from __future__ import annotations

from .compare import Comparison
from .internal import Internal
from .jobs import describe

__all__ = ["render_compare", "render_internal"]


def render_compare(comp: Comparison, internal: Internal | None) -> str:
    """One table kvfs / each peer / ratio per workload, then the kvfs-internal ones."""
    lines = ["", "kvfs vs peers (cells: keys/s, bandwidth, p99 per-key latency; ratio = kvfs keys/s / peer keys/s)",
             comp.table()]
    lines.append("MB/s ratios (kvfs MB/s / peer MB/s):")
    for wl in comp.workloads:
        kv = comp.cell(wl, "kvfs").bytes_per_s
        parts = []
        for peer in comp.stores[1:]:
            pb = comp.cell(wl, peer).bytes_per_s
            parts.append(f"{peer}={'-' if not kv or not pb else f'{kv / pb:.2f}x'}")
        lines.append(f"  {describe(wl)}: " + " ".join(parts))
    return "\n".join(lines) + "\n" + (render_internal(internal) if internal is not None else "")


def render_internal(internal: Internal) -> str:
    """The kvfs-internal comparisons: batcher on/off, prefix chains, server reads per chain."""
    lines: list[str] = []
    if internal.batcher is not None:
        lines += ["", "kvfs: 128 concurrent single-key get() (ratio = batcher on / batch=False keys/s)",
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
