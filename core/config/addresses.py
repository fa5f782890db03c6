"""A task's address: ``host:port``, the form of every entry of a cluster spec (TF's
``ClusterSpec``, ``TF_CONFIG``'s ``cluster``, ``strategy.cluster``)."""

from __future__ import annotations

__all__ = ["is_address"]


def is_address(value: object) -> bool:
    """``"host:port"`` with a port in 1..65535 (the form of every task address)."""
    if not isinstance(value, str):
        return False
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536)
