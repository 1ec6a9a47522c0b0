"""``kvfs mount`` / ``kvfs umount``: the commands, signals and the mount's lifetime."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import sys

from kvfs.address import token_from_file
from kvfs.config import (
    ClientConfig,
    MountConfig,
    TlsConfig,
    add_cluster_options,
    add_options,
    from_options,
    tls_fields,
)
from kvfs.errors import KVFSError
from kvfs.fs import KVFileSystem
from kvfs.mount._fuse import IMPORT_ERROR, enable_asyncio, pyfuse3, stop_watching
from kvfs.mount.mtab import is_mounted, set_read_ahead
from kvfs.mount.ops import KVFSOperations
from kvfs.units import parse_duration

__all__ = ["ATTR_TIMEOUT_S", "add_mount_arguments", "add_umount_arguments", "cmd_mount", "cmd_umount",
           "tune_read_ahead"]

log = logging.getLogger("kvfs.mount")
ATTR_TIMEOUT_S = 1.0  # --attr-timeout's default: the kernel's entry and attribute timeouts


def add_mount_arguments(p: argparse.ArgumentParser) -> None:
    """``kvfs mount``'s arguments (its line in ``kvfs --help``: kvfs.cli)."""
    p.description = ("Mount a kvfs cluster at MOUNTPOINT. Runs in the foreground; "
                     "Ctrl-C, SIGTERM or `kvfs umount MOUNTPOINT` unmounts. A file is committed "
                     "when it is closed (with --write-behind: held, and committed soon after); large files stream (written in order) and are read by "
                     "stripe units, so memory stays bounded per open file.")
    p.add_argument("mountpoint")
    add_cluster_options(p)
    p.add_argument("--timeout", type=parse_duration, default=10.0, metavar="DURATION",
                   help="fail a request with EIO after this long (default 10s)")
    p.add_argument("--attr-timeout", type=parse_duration, default=ATTR_TIMEOUT_S, metavar="DURATION",
                   help="how long the kernel may cache names and sizes (default 1s)")
    p.add_argument("--ttl", type=parse_duration, default=None, metavar="DURATION",
                   help="expiry of files written through the mount (default: the cluster's)")
    p.add_argument("--allow-other", action="store_true", help="let other users use the mount")
    add_options(p, ClientConfig, only=("replicas",))  # of the files written through the mount
    add_options(p, MountConfig)
    p.set_defaults(func=cmd_mount)


def add_umount_arguments(p: argparse.ArgumentParser) -> None:
    """``kvfs umount``'s arguments (its line in ``kvfs --help``: kvfs.cli)."""
    p.add_argument("mountpoint")
    p.add_argument("-z", "--lazy", action="store_true", help="detach now even if busy")
    p.set_defaults(func=cmd_umount)


async def cmd_mount(ns: argparse.Namespace) -> int:
    if pyfuse3 is None:
        print(f"kvfs mount: the FUSE mount needs pyfuse3 and libfuse3 ({IMPORT_ERROR}); install them "
              "with `apt-get install fuse3 libfuse3-dev pkg-config` and `pip install 'kvfs[fuse]'`",
              file=sys.stderr)
        return 2
    mnt = os.path.abspath(ns.mountpoint)
    if not os.path.isdir(mnt):
        print(f"kvfs mount: {mnt} is not a directory", file=sys.stderr)
        return 2
    if not os.path.exists("/dev/fuse"):
        print("kvfs mount: /dev/fuse is missing (load the fuse module, or run the container with "
              "--device /dev/fuse)", file=sys.stderr)
        return 2
    timeout_s = float(ns.timeout)
    try:
        config = from_options(MountConfig, ns)
        cfg = ClientConfig(connect_timeout_s=min(5.0, timeout_s), request_timeout_s=timeout_s,
                           layout_cache_entries=0,  # files are overwritten: always look keys up
                           replicas=ns.replicas, **tls_fields(from_options(TlsConfig, ns)))
    except ValueError as exc:
        print(f"kvfs mount: {exc}", file=sys.stderr)
        return 2
    fs = KVFileSystem(ns.addr, token=token_from_file(ns.token_file), config=cfg, ttl=ns.ttl, asynchronous=True,
                      skip_instance_cache=True)
    try:
        async with asyncio.timeout(cfg.connect_timeout_s + timeout_s):  # connect, then one call:
            await fs.client.stats()  # the client's own error (e.g. naming TLS) comes first
    except (KVFSError, OSError, TimeoutError) as exc:
        await fs._close()
        print(f"kvfs mount: cannot reach the cluster at {fs.addr}: {exc}", file=sys.stderr)
        return 1
    ops = KVFSOperations(fs, timeout_s=timeout_s, attr_timeout_s=float(ns.attr_timeout),
                         config=config)
    options = {"fsname=kvfs", "subtype=kvfs"}
    if ns.allow_other:  # others get the kernel's checks of the modes shown; without it only
        options |= {"allow_other", "default_permissions"}  # this user may enter the mount
    enable_asyncio(on_idle=ops.io.send_held)
    try:
        pyfuse3.init(ops, mnt, options)
    except RuntimeError as exc:
        await fs._close()
        print(f"kvfs mount: cannot mount at {mnt}: {exc} (already mounted? not permitted?)",
              file=sys.stderr)
        return 1
    loop = asyncio.get_running_loop()
    sigs = (signal.SIGINT, signal.SIGTERM)

    stopping = False

    def stop(sig: signal.Signals) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        log.info("%s: unmounting %s", sig.name, mnt)
        pyfuse3.terminate()

    for sig in sigs:
        loop.add_signal_handler(sig, stop, sig)
    print(f"kvfs mount ready {mnt} {fs.addr}", flush=True)
    tune = loop.create_task(_tune(mnt, config))
    try:
        await pyfuse3.main(min_tasks=config.idle_workers)
    finally:
        stop_watching()  # before pyfuse3.close() closes /dev/fuse
        tune.cancel()
        for sig in sigs:
            loop.remove_signal_handler(sig)
        lost = ops.discard_open_writes()
        if lost:
            log.warning("%d file(s) still open for writing were not committed", lost)
        pyfuse3.close(unmount=True)
        try:
            await ops.drain(config.write_behind_drain_s)  # held files (--write-behind)
        finally:
            await fs._close()
    return 0


async def tune_read_ahead(mnt: str, config: MountConfig) -> str | None:
    """Once the kernel has the mount (a stat of it answered: FUSE's INIT, which sets the
    read-ahead too, is done), its read-ahead becomes ``--kernel-read-ahead``; why it was left
    as it is, None when it was set (or not asked for)."""
    if not config.kernel_read_ahead_bytes:
        return None
    await asyncio.to_thread(os.stat, mnt)
    return set_read_ahead(mnt, config.kernel_read_ahead_bytes)


async def _tune(mnt: str, config: MountConfig) -> None:
    why = await tune_read_ahead(mnt, config)
    if why is not None:
        log.info("kernel read-ahead left as it is: %s", why)


async def cmd_umount(ns: argparse.Namespace) -> int:
    mnt = os.path.abspath(ns.mountpoint)
    if not is_mounted(mnt):
        print(f"kvfs umount: {mnt} is not mounted", file=sys.stderr)
        return 1
    lazy = ["-z"] if ns.lazy else []
    commands = [[tool, "-u", *lazy, mnt] for tool in ("fusermount3", "fusermount") if shutil.which(tool)]
    if os.geteuid() == 0 or not commands:
        commands.append(["umount", *(["-l"] if ns.lazy else []), mnt])
    err = ""
    for argv in commands:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        _, stderr = await proc.communicate()
        if proc.returncode == 0 or not is_mounted(mnt):
            return 0
        err = stderr.decode(errors="replace").strip()
    print(f"kvfs umount: {mnt}: {err or 'failed'}", file=sys.stderr)
    return 1
