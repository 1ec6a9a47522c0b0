"""The kvfs-internal comparisons of ``--compare``: batcher on/off, prefix chains vs separate puts."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .adapters import ChainReads, ChainStore, CountingStore, SeparatePutStore, SingleGetStore
from .compare import Cell, Comparison, StoreFactory, compare
from .jobs import CHAIN_BLOCKS, CHAIN_BS
from .options import DEFAULT_RUNTIME_S
from .runner import KEY_NAMESPACE, BenchError, Workload, run_workload
from .store import Store
from .target import BenchTarget

__all__ = ["Internal", "run_internal"]


@dataclass
class Internal:
    """The kvfs-internal comparisons of ``--compare``."""

    batcher: Comparison | None = None
    chains: Comparison | None = None
    chain_reads: dict[str, ChainReads] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "batcher": self.batcher.to_json() if self.batcher else None,
            "prefix_chains": self.chains.to_json() if self.chains else None,
            "server_reads_per_chain": {k: v.per_chain() for k, v in self.chain_reads.items()},
        }


async def run_internal(
    target: BenchTarget,
    *,
    runtime_s: float | None = None,
    progress: bool | None = None,
    say: Any = None,
    nchains: int = 32,
    get_keys: int = 8192,
) -> Internal:
    """128 concurrent single-key get() with the batcher on and off; prefix chains vs separate puts."""
    runtime = runtime_s if runtime_s is not None else DEFAULT_RUNTIME_S
    say = say or (lambda msg: None)
    out = Internal()
    # 1. 128 concurrent single-key get(): batcher on vs off
    wl = Workload(name="get128", rw="randread", bs=4 << 10, batch=128, iodepth=1, nkeys=max(128, get_keys),
                  runtime_s=runtime, key_prefix=KEY_NAMESPACE + b"get128/", prefill_timeout_s=120.0)

    def single(batch: bool) -> StoreFactory:
        async def make() -> Store:
            return SingleGetStore(target.client(batch=batch))

        return make

    say("kvfs internal: 128 concurrent get(), batcher on vs ClientConfig(batch=False)")
    out.batcher = await compare({"batcher on": single(True), "batch=False": single(False)}, [wl],
                                progress=progress)
    # 2. prefix chains of 64 x 64 KiB: one put_many per chain, read per chain,
    #    vs the same blocks by separate puts, read at random
    n = CHAIN_BLOCKS
    nkeys = n * nchains
    chain_wl = Workload(name=f"chains-{n}x64k", rw="read", bs=CHAIN_BS, batch=n, iodepth=1,
                        nkeys=nkeys, runtime_s=runtime, key_prefix=KEY_NAMESPACE + b"chain/",
                        prefill_timeout_s=300.0)
    sep_wl = replace(chain_wl, rw="randread", key_prefix=KEY_NAMESPACE + b"sep/")
    comp = Comparison(stores=["chain put_many", "separate puts"], workloads=[chain_wl])
    say(f"kvfs internal: prefix chains {n} x 64KiB, per-chain put_many+read vs separate puts+random reads")
    for label, w, inner in (
        ("chain put_many", chain_wl, ChainStore(target.client(), n)),
        ("separate puts", sep_wl, SeparatePutStore(target.client())),
    ):
        reads = out.chain_reads[label] = ChainReads()
        store = CountingStore(inner, target.server_reads, reads)
        try:
            res = await run_workload(store, w, progress=progress)
            comp.cells[(chain_wl.name, label)] = Cell(label, result=res)
        except (BenchError, OSError) as e:
            comp.cells[(chain_wl.name, label)] = Cell(label, skipped=f"failed: {e}")
        finally:
            await store.close()
    out.chains = comp
    return out
