"""`kvfs` command line: its parser (every command's arguments) and ``main()``.

A command's implementation is imported once its command line is parsed, and only its own:
the core commands' from ``kvfs.commands``; ``gc``, ``mount``/``umount`` and ``bench`` add
their arguments from their own modules (``_MODULE_COMMANDS``), imported only when that
command is parsed.  So a server or the GC daemon imports neither the bench (numpy, with
its BLAS threads) nor the mount (pyfuse3, trio), and ``kvfs --help`` none of them.
"""

from __future__ import annotations

import argparse
import logging
import os
import pkgutil
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from kvfs import __version__
from kvfs._loop import run
from kvfs._parent import die_with_parent
from kvfs.config import (
    DURATION,
    LOCAL_STORES,
    ChunkServerConfig,
    MetaConfig,
    TlsConfig,
    UpConfig,
    add_cluster_options,
    add_options,
)
from kvfs.errors import KVFSError

#: what a parser's ``func`` default names: an ``async def f(ns) -> int``, or its
#: ``"module:function"`` (imported once the command line is parsed)
Command = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


# parser -------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``kvfs`` parser: no command's implementation imported (``main`` imports the one it runs)."""
    parser = argparse.ArgumentParser(prog="kvfs", description="kvfs: a file-system-backed KV cache")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    parser.add_argument("--version", action="version", version=f"kvfs {__version__}")
    parser.register("action", "parsers", _Commands)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start meta + N chunkservers + GC on this machine, supervised "
                       "(Ctrl-C stops)")
    add_options(p, UpConfig)
    p.set_defaults(func="kvfs.commands:cmd_up")

    p = sub.add_parser("meta", help="run the metadata service in the foreground; "
                       "or rebuild / back up its database")
    add_options(p, MetaConfig, skip=("data",))
    p.add_argument("--data", type=Path, default=None, help="data directory (SQLite or RocksDB store, token)")
    p.set_defaults(func="kvfs.commands:cmd_meta")
    msub = p.add_subparsers(dest="meta_command", metavar="{rebuild,backup,migrate}")
    q = msub.add_parser("rebuild", help="write a new meta database from the chunkservers' records "
                        "(after meta's database was lost)")
    q.add_argument("--data", type=Path, required=True, help="meta's data directory (the new database)")
    q.add_argument("--store", choices=LOCAL_STORES, default=LOCAL_STORES[0],
                   help=f"the new database's kind (default {LOCAL_STORES[0]}; a meta started with no "
                   "--store opens the kind its --data holds)")
    q.add_argument("--from-chunkservers", required=True, metavar="HOST:PORT[,HOST:PORT...]",
                   help="every chunkserver of the cluster")
    q.add_argument("--token-file", default=None,
                   help="the admin token's file (default: $KVFS_ADMIN_TOKEN, else DATA/admin.token)")
    add_options(q, TlsConfig)
    q.set_defaults(func="kvfs.commands:cmd_meta_rebuild")
    q = msub.add_parser("backup", help="copy meta's live store to DEST while meta serves: a SQLite "
                        "database to the new file DEST (online backup), a RocksDB one to a new store "
                        "in the directory DEST (its rows copied)")
    q.add_argument("file", type=Path, metavar="DEST")
    q.add_argument("--data", type=Path, required=True, help="meta's data directory")
    q.set_defaults(func="kvfs.commands:cmd_meta_backup")
    q = msub.add_parser("migrate", help="move the index between stores, meta stopped: SQLite or "
                        "RocksDB to Redis Cluster or back, SQLite to RocksDB or back, or to another "
                        "Redis namespace (keys, TTLs, last "
                        "access, cluster id, chunkservers, retired chunks, GC state); resumes a run "
                        "that stopped")
    q.add_argument("--from", dest="src", required=True, metavar="STORE",
                   help="sqlite:PATH or rocksdb:PATH (meta's data directory), or "
                   "redis-cluster://HOST:PORT[,...]")
    q.add_argument("--to", dest="dst", required=True, metavar="STORE",
                   help="sqlite:PATH, rocksdb:PATH or redis-cluster://HOST:PORT[,...]: empty, or holding an "
                   "unfinished migration of the same cluster")
    q.add_argument("--from-namespace", default="kvfs", help="a redis source's --store-namespace")
    q.add_argument("--to-namespace", default="kvfs", help="a redis target's --store-namespace")
    q.add_argument("--batch", type=int, default=1000,
                   help="keys read and written per step (memory stays about this many layouts)")
    q.set_defaults(func="kvfs.commands:cmd_meta_migrate")

    p = sub.add_parser("chunkserver", help="run one chunkserver in the foreground")
    add_options(p, ChunkServerConfig)
    p.set_defaults(func="kvfs.commands:cmd_chunkserver")

    p = sub.add_parser("put", help="store FILE (or - for stdin) under KEY")
    p.add_argument("key")
    p.add_argument("file")
    p.add_argument("--ttl", type=DURATION, default=None, metavar="DURATION",
                   help="time until it expires, e.g. 90, 30s, 5min, 1h (default: the cluster's)")
    p.add_argument("--replicas", type=int, default=None)
    add_cluster_options(p)
    p.set_defaults(func="kvfs.commands:cmd_put")

    # (duplicates: the sub-parsers below pair up by shape; each declares its own command's arguments)
    p = sub.add_parser("get", help="write the value of KEY to stdout (or -o FILE)")
    p.add_argument("key")
    p.add_argument("-o", "--output", default=None)
    add_cluster_options(p)
    p.set_defaults(func="kvfs.commands:cmd_get")

    p = sub.add_parser("rm", help="delete keys")
    p.add_argument("keys", nargs="+")
    add_cluster_options(p)
    p.set_defaults(func="kvfs.commands:cmd_rm")

    p = sub.add_parser("ls", help="list keys starting with PREFIX")
    p.add_argument("prefix", nargs="?", default="")
    p.add_argument("-l", "--long", action="store_true",
                   help="size, created, expires, extents, key (with a header line)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--json", action="store_true")
    add_cluster_options(p)
    p.set_defaults(func="kvfs.commands:cmd_ls")

    p = sub.add_parser("stat", help="cluster totals and per-chunkserver usage")
    p.add_argument("--json", action="store_true")
    add_cluster_options(p)
    p.set_defaults(func="kvfs.commands:cmd_stat")

    assert isinstance(sub, _Commands)
    for name, line, adder in _MODULE_COMMANDS:
        sub.add_later(name, line, adder)
    return parser


# The commands whose arguments (and ``func`` defaults) another module adds, in ``kvfs --help``'s
# order after the ones above: the name, its line in ``kvfs --help``, and the ``"module:function"``
# that adds them to its parser, imported only when that command is parsed
_MODULE_COMMANDS = (
    ("gc", "garbage collection: status, run, fsck, scrub, decommission, pause/resume, daemon",
     "kvfs.gc.cli:add_arguments"),
    ("mount", "mount the cluster as a filesystem (FUSE; runs until unmounted)",
     "kvfs.mount.cli:add_mount_arguments"),
    ("umount", "unmount a kvfs mount (also one whose process died)",
     "kvfs.mount.cli:add_umount_arguments"),
    ("bench", "fio-style load generator (no --addr: runs an embedded 3-chunkserver cluster)",
     "kvfs.bench.cli:add_arguments"),
)


class _Commands(argparse._SubParsersAction):
    """``kvfs``'s subcommands, some of whose arguments are added only once that command is
    parsed (``add_later``): ``kvfs --help`` lists them without importing their modules."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._later: dict[str, str] = {}

    def add_later(self, name: str, line: str, adder: str) -> None:
        """Command ``name`` (``line`` in ``kvfs --help``), its arguments added to its parser by
        the function ``adder`` (``"module:function"``) when it is parsed."""
        self.add_parser(name, help=line)
        self._later[name] = adder

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        name = values[0]
        adder = self._later.pop(name, None)
        if adder is not None:
            try:
                add = pkgutil.resolve_name(adder)
            except ModuleNotFoundError as exc:  # an optional part without its extra installed
                if exc.name is None or exc.name.partition(".")[0] == "kvfs":
                    raise  # kvfs's own import broken: a bug, not a missing extra
                parser.error(f"kvfs {name} is not available: {exc}")
            add(self.choices[name])
        super().__call__(parser, namespace, values, option_string)


def command_of(ns: argparse.Namespace) -> Command:
    """The function a parsed command line runs (its module imported)."""
    func: Command = pkgutil.resolve_name(ns.func) if isinstance(ns.func, str) else ns.func
    return func


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent()
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * ns.verbose,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        return run(command_of(ns)(ns))
    except BrokenPipeError:
        return _closed_stdout()
    except KVFSError as exc:
        print(f"kvfs {ns.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"kvfs {ns.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _closed_stdout()
        except Exception:
            pass


def _closed_stdout() -> int:
    """The reader of our stdout went away (``kvfs ls | head -1``): stop quietly, as a process
    killed by SIGPIPE would (exit status 141), without Python's "Broken pipe" message when it
    flushes stdout at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE
