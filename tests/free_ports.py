"""A run of free local ports for the multi-process tests (torch.distributed ranks, vLLM's DP groups)."""

from __future__ import annotations

import random
import socket


def free_ports(span: int = 1) -> int:
    """The first of ``span`` free ports in a row, drawn below the kernel's ephemeral range, where no outgoing
    connection's own port can take one between this check and the caller's bind."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    for port in random.sample(range(20000, ephemeral - span), 64):
        try:
            for p in range(port, port + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {span} free ports in a row below {ephemeral}")
