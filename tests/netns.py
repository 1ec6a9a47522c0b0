"""Multi-host tests on one machine: every service in its own network namespace.

:class:`NetLab` makes a Linux bridge and one namespace per host, each joined to the
bridge by a veth pair (the host's end ``eth0`` inside the namespace, its peer on the
bridge), and removes all of it in :meth:`NetLab.close`.  The test process stays in the
root namespace on the bridge's address, as a client on another machine would be.
:meth:`NetLab.cut` takes a host's link down (its packets are dropped, its TCP
connections hang: no reset is ever sent), :meth:`NetLab.heal` brings it back.

:class:`NetnsCluster` is :class:`kvfs.launcher.ProcessCluster` with meta on host 0 and
chunkserver ``i`` on host ``i + 1``: the same child processes as `kvfs up`, each run as
``ip netns exec HOST python -m kvfs ...`` (``ip netns exec`` execs, so the pid is the
service's and SIGKILL reaches it).

Needs root and ``ip`` (iproute2): :func:`netns_unavailable` says why not, for a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvfs.launcher import ProcessCluster, ServiceProcess


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_unavailable() -> str | None:
    """Why these tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs these tests as root)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"kvfsprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


_ECHO = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(); s.settimeout(20)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.sendall(b"ok")
"""
_PROBE = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
assert c.recv(2) == b"ok"
"""


class NetLab:
    """A bridge and ``hosts`` network namespaces on it (10.X.Y.0/24: the bridge is .1, host
    ``i`` is .(10+i)).  Names carry this process's id, so two runs never share one."""

    def __init__(self, hosts: int) -> None:
        tag = f"{os.getpid() % 100_000:05d}"
        self.prefix = f"kv{tag}"  # interface names stay under 15 characters
        self.bridge = f"{self.prefix}br"
        self.hosts = hosts
        used = _ip("-o", "-4", "addr").stdout
        for n in range(256):
            net = f"10.{200 + (os.getpid() + n) % 50}.{(os.getpid() // 50 + n) % 256}"
            if f" {net}." not in used:
                break
        self.net = net
        self.bridge_ip = f"{net}.1"
        self._made: list[tuple[str, ...]] = []  # undo commands, run in reverse

    def ns(self, i: int) -> str:
        return f"{self.prefix}n{i}"

    def ip_of(self, i: int) -> str:
        return f"{self.net}.{10 + i}"

    def veth(self, i: int) -> str:
        """The bridge-side end of host ``i``'s link (cutting it cuts the host off)."""
        return f"{self.prefix}v{i}"

    def start(self) -> NetLab:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", "del", self.bridge))
            _ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.hosts):
                ns, outer, inner = self.ns(i), self.veth(i), f"{self.prefix}e{i}"
                _ip("netns", "add", ns)
                self._made.append(("netns", "del", ns))
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                self._made.append(("link", "del", outer))
                _ip("link", "set", inner, "netns", ns)
                _ip("-n", ns, "link", "set", inner, "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{self.ip_of(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
        except BaseException:
            self.close()
            raise
        return self

    def blocked(self) -> str | None:
        """Why host 1 cannot reach host 0 across the bridge (a firewall on bridged traffic,
        e.g. br_netfilter with a FORWARD policy of DROP), or None."""
        server = subprocess.Popen(self.exec_argv(0, [sys.executable, "-c", _ECHO, self.ip_of(0)]),
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        try:
            port = server.stdout.readline().strip()
            r = subprocess.run(self.exec_argv(1, [sys.executable, "-c", _PROBE, self.ip_of(0), port]),
                               capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                return (f"host 1 cannot reach host 0 over the bridge {self.bridge} "
                        f"({r.stderr.strip()[-200:]}); is bridged traffic filtered "
                        "(net.bridge.bridge-nf-call-iptables=1 and a FORWARD policy of DROP)?")
            return None
        finally:
            server.kill()
            server.wait()
            server.stdout.close()

    def cut(self, i: int) -> None:
        """Host ``i`` drops off the network: its link goes down, nothing is reset."""
        _ip("link", "set", self.veth(i), "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "up")

    def exec_argv(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i), *argv]

    def close(self) -> None:
        while self._made:
            _ip(*self._made.pop(), check=False)  # a namespace's veth end goes with it

    def __enter__(self) -> NetLab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class NetnsCluster(ProcessCluster):
    """Meta on host 0 of ``lab``, chunkserver ``i`` on host ``i + 1``; the GC daemon (if
    any) runs here, in the root namespace, like the test's clients."""

    def __init__(self, lab: NetLab, data: Path, chunkservers: int, *,
                 meta_args: tuple[str, ...] = (), chunkserver_args: tuple[str, ...] = (),
                 gc: bool = False, gc_args: tuple[str, ...] = ()) -> None:
        if lab.hosts < chunkservers + 1:
            raise ValueError(f"{chunkservers} chunkservers and meta need {chunkservers + 1} hosts")
        super().__init__(data, chunkservers, listen=f"{lab.ip_of(0)}:0", meta_args=meta_args,
                         chunkserver_args=chunkserver_args, gc=gc, gc_args=gc_args)
        self.lab = lab

    def host_of_chunkserver(self, i: int) -> int:
        return i + 1

    def _meta_process(self, listen: str) -> ServiceProcess:
        p = super()._meta_process(listen)
        p.argv = self.lab.exec_argv(0, p.argv)
        return p

    def _cs_process(self, i: int) -> ServiceProcess:
        host = self.host_of_chunkserver(i)
        argv = self._kvfs("chunkserver", "--data", str(self.data / f"cs{i}"), "--meta", self.addr,
                          "--listen", f"{self.lab.ip_of(host)}:0", *self.cs_args)
        return ServiceProcess(f"chunkserver {i}", self.lab.exec_argv(host, argv), self.env)

    async def kill_chunkserver(self, i: int) -> None:
        """SIGKILL, no warning: what a crash or a power cut does to the process."""
        svc = self.chunkservers[i]
        svc.kill()
        assert svc.proc is not None
        await svc.proc.wait()

    async def start_chunkserver(self, i: int) -> None:
        """Chunkserver ``i`` again, on its data dir (after :meth:`kill_chunkserver`)."""
        self.chunkservers[i] = self._cs_process(i)
        await self.chunkservers[i].start()

    async def kill_meta(self) -> None:
        assert self.meta is not None
        self.meta.kill()
        assert self.meta.proc is not None
        await self.meta.proc.wait()

    async def start_meta_again(self) -> str:
        """Meta on the port it had (clients and chunkservers find it again)."""
        return await self.start_meta(self._meta_listen())
