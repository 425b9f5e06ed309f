"""Hosts for real-process tests that need more than one: Linux network namespaces joined by veth pairs and a bridge.

`Hosts` makes a switch (a namespace holding a bridge) and hosts on it, each a namespace with one address, and
tears them all down again; every name starts with `t58-<pid>-`, so concurrent runs do not meet, and nothing is
made in the namespace the test runs in, so no traffic leaves the namespaces it made. A host can sit behind a
router of its own (`behind`): a private link to a router host that forwards packets, and a TCP port forward
(`python -m tests.integration.netns forward LISTEN TARGET`, run in the router's namespace) as a home router's
port forward does. `run` starts a process in a host, `get` reads a URL there. Making namespaces needs root and
iproute2's `ip`; `unavailable()` says why a test must skip, in one line.

    python -m tests.integration.netns forward 10.58.0.4:4001 192.168.58.2:4001
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

PREFIX = f"t58-{os.getpid()}-"
SUBNET = "10.58.0"
PRIVATE = "192.168.58"


def unavailable() -> str | None:
    """Why this machine cannot make network namespaces (None: it can)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed: no network namespaces for the multi-host test"
    if os.geteuid() != 0:
        return "making network namespaces needs root: the multi-host test runs where root is available"
    probe = f"{PREFIX}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """Namespaces on one bridge; a context manager that removes them all on the way out."""

    def __init__(self) -> None:
        self.switch = f"{PREFIX}sw"
        self.namespaces: list[str] = []
        self.addresses: dict[str, str] = {}
        self._next = 1

    def __enter__(self) -> Hosts:
        self._add_namespace(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        return self

    def __exit__(self, *exc: object) -> None:
        for namespace in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)

    def namespace(self, host: str) -> str:
        return f"{PREFIX}{host}"

    def add(self, host: str) -> str:
        """A host on the bridge; its address."""
        namespace = self._add_namespace(self.namespace(host))
        address = f"{SUBNET}.{self._next}"
        self._next += 1
        ip("-n", self.switch, "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        ip("-n", self.switch, "link", "set", host, "master", "br0", "up")
        ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", namespace, "link", "set", "eth0", "up")
        self.addresses[host] = address
        return address

    def behind(self, host: str, router: str, routed_from: list[str]) -> str:
        """`host` on a private link to `router` (a host on the bridge), which forwards its packets; the hosts
        `routed_from` get a route to the private link through the router, the others none. Its address."""
        namespace = self._add_namespace(self.namespace(host))
        ip("-n", self.namespace(router), "link", "add", "lan", "type", "veth", "peer", "name", "eth0",
           "netns", namespace)
        ip("-n", self.namespace(router), "addr", "add", f"{PRIVATE}.1/24", "dev", "lan")
        ip("-n", self.namespace(router), "link", "set", "lan", "up")
        ip("-n", namespace, "addr", "add", f"{PRIVATE}.2/24", "dev", "eth0")
        ip("-n", namespace, "link", "set", "eth0", "up")
        ip("-n", namespace, "route", "add", "default", "via", f"{PRIVATE}.1")
        subprocess.run(["ip", "netns", "exec", self.namespace(router), "sh", "-c",
                        "echo 1 > /proc/sys/net/ipv4/ip_forward"], check=True)
        for other in routed_from:
            ip("-n", self.namespace(other), "route", "add", f"{PRIVATE}.0/24", "via", self.addresses[router])
        self.addresses[host] = f"{PRIVATE}.2"
        return self.addresses[host]

    def run(self, host: str, argv: list[str], log: IO[bytes], cwd: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Start `argv` in `host`'s namespace, its output to `log`; it dies with this process."""
        from node.sim.process import die_with_parent

        return subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv], cwd=cwd, env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)

    def get(self, host: str, url: str) -> Any:
        """GET a JSON document from inside `host`; None if it does not answer (yet)."""
        code = ("import sys, urllib.request\n"
                "try:\n    sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=3).read().decode())\n"
                "except OSError as e:\n    sys.exit(1)")
        done = subprocess.run(["ip", "netns", "exec", self.namespace(host), sys.executable, "-I", "-S", "-c", code,
                               url], capture_output=True, text=True, timeout=30)
        return json.loads(done.stdout) if done.returncode == 0 and done.stdout else None

    def connects(self, host: str, address: str, port: int) -> bool:
        """Whether a TCP connection from `host` to `address:port` is made within 3 s."""
        code = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)\n"
                "except OSError:\n    sys.exit(1)")
        return subprocess.run(["ip", "netns", "exec", self.namespace(host), sys.executable, "-I", "-S", "-c", code,
                               address, str(port)], capture_output=True, timeout=30).returncode == 0

    def _add_namespace(self, namespace: str) -> str:
        ip("netns", "add", namespace)
        self.namespaces.append(namespace)
        ip("-n", namespace, "link", "set", "lo", "up")
        return namespace


async def forward(listen: str, target: str) -> None:
    """Accept TCP connections on `listen` (HOST:PORT) and pipe each to `target`, both ways, until killed."""
    target_host, target_port = target.rsplit(":", 1)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(target_host, int(target_port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    host, port = listen.rsplit(":", 1)
    server = await asyncio.start_server(accept, host, int(port))
    print(f"forwarding {listen} to {target}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "forward":
        sys.exit(__doc__)
    asyncio.run(forward(sys.argv[2], sys.argv[3]))
