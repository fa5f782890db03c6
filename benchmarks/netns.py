"""A few "hosts" on one machine: network namespaces joined by veth pairs to a bridge.

Each host is a namespace with one veth end (address ``10.231.0.<i+1>/24``); the other end
sits on a bridge in a hub namespace of its own, so nothing of the machine's own network
is touched and the addresses exist only between namespaces made here. Names carry the
process id and a random tag, unique per run. Needs root and ``ip`` (iproute2); ``tc``
for rate limits. ``close()`` deletes the namespaces, and with them every link made.

    with Hosts(3, rate="1gbit") as hosts:
        hosts.popen(0, ["python", "-m", "csrun.cli.main", "train", ...])
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess

__all__ = ["Hosts", "unavailable", "SUBNET"]

SUBNET = "10.231.0"


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need `ip` (iproute2)"
    probe = f"csprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """``count`` namespaces on one bridge; ``rate`` (e.g. ``"1gbit"``) limits each host's
    link both ways (netem with a 0.2 ms delay when the kernel has it, else tbf: the
    rate only; :attr:`shaping` says which)."""

    def __init__(self, count: int, rate: str | None = None):
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.hub, self.names = f"cs{tag}hub", [f"cs{tag}h{i}" for i in range(count)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(count)]
        self.links = [(f"c{tag}a{i}", f"c{tag}b{i}") for i in range(count)]
        self.shaping = "none"
        try:
            self._build(rate)
        except BaseException:
            self.close()
            raise

    def _build(self, rate: str | None) -> None:
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for name, address, (mine, hubs) in zip(self.names, self.addresses, self.links):
            _ip("netns", "add", name)
            _ip("link", "add", mine, "netns", name, "type", "veth", "peer", "name", hubs,
                "netns", self.hub)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", mine)
            _ip("-n", name, "link", "set", mine, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", self.hub, "link", "set", hubs, "master", "br0")
            _ip("-n", self.hub, "link", "set", hubs, "up")
            if rate:
                self._limit(name, mine, rate)
                self._limit(self.hub, hubs, rate)

    def _limit(self, namespace: str, device: str, rate: str) -> None:
        base = ["tc", "-n", namespace, "qdisc", "add", "dev", device, "root"]
        netem = subprocess.run(base + ["netem", "rate", rate, "delay", "0.2ms", "limit",
                                       "10000"], capture_output=True, text=True)
        if netem.returncode == 0:
            self.shaping = "netem"
            return
        # no netem in this kernel: tbf limits the rate; latency is not emulated
        subprocess.run(base + ["tbf", "rate", rate, "burst", "256kb", "latency", "50ms"],
                       check=True, capture_output=True, text=True)
        self.shaping = "tbf"

    def command(self, host: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], *argv]

    def popen(self, host: int, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def close(self) -> None:
        for name in [*self.names, self.hub]:  # deleting a namespace deletes its links
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
