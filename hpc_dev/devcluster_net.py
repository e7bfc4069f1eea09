"""The dev cluster's network: every node a host of its own on a private bridge.

A real cluster is many hosts, each with its own address; one host's loopback hides binds to
127.0.0.1, hard-coded `localhost`, MLflow's Host-header check and one node dialling another's
loopback. So each node's slurmd (and everything its jobs start: vLLM, Ray, the ranks) runs in
its own network namespace, with one address on a bridge whose host side is the "login node"
(slurmctld, slurmdbd, the tracking server, `dspark submit`):

    login  dspark-login  SUBNET.1   the bridge, in the host's own namespace
    node1  node1         SUBNET.2   namespace dspark-node1, its veth named eth0
    ...

Inside a namespace 127.0.0.1 is that node's own: a server that binds loopback serves its node
only, as on a real cluster. No namespace has a default route, so nothing a job dials can leave
this machine (the host does not forward: net.ipv4.ip_forward stays as it is).

Namespaces isolate the network only: files, users, processes and munge's Unix socket are
shared, which is what a cluster's shared filesystem and accounts give it anyway.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import subprocess
from dataclasses import dataclass

from hpc.errors import UserError

log = logging.getLogger(__name__)

SUBNET_ENV = "DSPARK_DEVCLUSTER_SUBNET"
DEFAULT_SUBNET = "10.213.0.0/24"
LOGIN_NAME = "dspark-login"  # the bridge's address, in /etc/hosts: clients dial the login node by name
PREFIX = "dspark-"  # namespaces dspark-node1.., veths dspark-node1.. (host side), bridge dspark-br
IFNAME_MAX = 15  # Linux interface names
NETNS_DIR = "/run/netns"  # where `ip netns add` keeps each namespace's handle


def default_subnet() -> str:
    return os.environ.get(SUBNET_ENV) or DEFAULT_SUBNET


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise UserError("devcluster: the `ip` command is missing (apt package iproute2); install it, or run "
                        "`dspark-dev devcluster up --network loopback` for a one-address cluster") from None
    if check and res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"devcluster: `{' '.join(argv)}` failed: {last}")
    return res


@dataclass(frozen=True)
class DevNetwork:
    """Addresses and names of the login side and each node; `up`/`down` make and remove them."""

    subnet: str
    nodes: tuple[str, ...]
    prefix: str = PREFIX  # of every namespace and interface it makes: `down` removes all that carry it

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.subnet, strict=False)

    @property
    def login_addr(self) -> str:
        return str(self.network.network_address + 1)

    def addr(self, node: str) -> str:
        return str(self.network.network_address + 2 + self.nodes.index(node))

    def netns(self, node: str) -> str:
        return f"{self.prefix}{node}"

    def veth(self, node: str) -> str:
        return f"{self.prefix}{node}"

    def hosts_lines(self) -> list[tuple[str, str]]:
        """(address, name) pairs /etc/hosts needs: the login name and every node's."""
        return [(self.login_addr, LOGIN_NAME), *((self.addr(n), n) for n in self.nodes)]

    def exec_prefix(self, node: str) -> list[str]:
        """Runs a command inside `node`'s network namespace. Not `ip netns exec`: that also gives the
        command a mount namespace with a fresh /sys, without /sys/fs/cgroup, which slurmd needs."""
        return ["nsenter", f"--net={NETNS_DIR}/{self.netns(node)}", "--"]

    # ---- checks ------------------------------------------------------------------------------

    def check(self) -> list[str]:
        """Problems with the subnet itself (no system call): one line each, naming the key."""
        try:
            net = ipaddress.ip_network(self.subnet, strict=False)
        except ValueError as err:
            return [f"subnet {self.subnet!r} is not an IPv4 network ({err}); give one like {DEFAULT_SUBNET} "
                    f"(--subnet or ${SUBNET_ENV})"]
        if not isinstance(net, ipaddress.IPv4Network) or not net.is_private:
            return [f"subnet {self.subnet}: use a private IPv4 range such as {DEFAULT_SUBNET} (--subnet or "
                    f"${SUBNET_ENV}); the nodes must never take an address that routes off this machine"]
        if net.num_addresses < len(self.nodes) + 3:
            return [f"subnet {self.subnet} has room for {max(net.num_addresses - 3, 0)} node(s), not "
                    f"{len(self.nodes)}; use a larger one (--subnet or ${SUBNET_ENV})"]
        if too_long := [n for n in self.nodes if len(self.veth(n)) > IFNAME_MAX]:
            return [f"node name {too_long[0]!r} is too long for an interface name; use fewer nodes"]
        return []

    def collisions(self) -> list[str]:
        """Routes or addresses of this machine that overlap the subnet (ours excepted)."""
        net = self.network
        found = []
        routes = json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]")
        for r in routes:
            dst, dev = r.get("dst", ""), r.get("dev", "")
            if dev == self.bridge or dst in ("", "default") or r.get("type") in ("broadcast", "local"):
                continue
            try:
                other = ipaddress.IPv4Network(dst, strict=False)
            except ValueError:
                continue
            if other.overlaps(net):
                found.append(f"the route {dst} dev {dev}")
        for link in json.loads(_ip("-j", "-4", "addr").stdout or "[]"):
            if link.get("ifname") == self.bridge:
                continue
            for a in link.get("addr_info", []):
                if ipaddress.IPv4Address(a["local"]) in net:
                    found.append(f"the address {a['local']} on {link.get('ifname')}")
        return found

    def check_free(self) -> None:
        """The subnet is well-formed and no route or address of this machine overlaps it."""
        if problems := self.check():
            raise UserError("devcluster: " + problems[0])
        if clash := self.collisions():
            raise UserError(f"devcluster: subnet {self.subnet} collides with {clash[0]}; pick a free private "
                            f"range with --subnet or ${SUBNET_ENV}")

    # ---- lifecycle ---------------------------------------------------------------------------

    def is_up(self) -> bool:
        """Bridge with the login address, and every node's namespace with its address."""
        br = _ip("-j", "-4", "addr", "show", "dev", self.bridge, check=False)
        if br.returncode != 0 or self.login_addr not in br.stdout:
            return False
        for node in self.nodes:
            res = _ip("-j", "-4", "addr", "show", "dev", "eth0", netns=self.netns(node), check=False)
            if res.returncode != 0 or f'"{self.addr(node)}"' not in res.stdout or "UP" not in res.stdout:
                return False
        return True

    def up(self) -> bool:
        """Make what is missing; never removes a piece that is right (a server may be bound to the
        login address). True if anything was made."""
        self.check_free()
        if self.is_up():
            return False
        if _ip("link", "show", self.bridge, check=False).returncode == 0 and \
                self.login_addr not in _ip("-4", "addr", "show", "dev", self.bridge, check=False).stdout:
            self.down()  # made for another subnet: its addresses would linger beside the new ones
        try:
            self._bridge()
            existing = set(self._namespaces(self.prefix))
            for node in self.nodes:
                self._node(node, fresh=self.netns(node) not in existing)
        except UserError:
            self.down()  # nothing half-made stays behind
            raise
        log.info("devcluster network: login %s, %s", self.login_addr,
                 ", ".join(f"{n} {self.addr(n)}" for n in self.nodes))
        return True

    def down(self) -> bool:
        """Remove every namespace, veth and bridge of ours, whatever node count made them (a crash,
        or an earlier `up --nodes N`). True if anything was there."""
        found = False
        for ns in self._namespaces(self.prefix):
            found = True
            _ip("netns", "del", ns, check=False)  # its veth end goes with it, and takes the peer along
        links = json.loads(_ip("-j", "link", "show", check=False).stdout or "[]")
        for link in links:
            name = link.get("ifname", "")
            if name.startswith(self.prefix):
                found = True
                _ip("link", "del", name, check=False)
        return found

    # ---- internals ---------------------------------------------------------------------------

    @staticmethod
    def _namespaces(prefix: str) -> list[str]:
        res = _ip("netns", "list", check=False)
        return [ln.split()[0] for ln in res.stdout.splitlines() if ln.split() and ln.startswith(prefix)]

    def _bridge(self) -> None:
        if _ip("link", "show", self.bridge, check=False).returncode != 0:
            _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "replace", f"{self.login_addr}/{self.network.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def _node(self, node: str, fresh: bool) -> None:
        ns, veth = self.netns(node), self.veth(node)
        if fresh:
            made = _ip("netns", "add", ns, check=False)
            if made.returncode != 0:
                why = (made.stderr.strip().splitlines() or ["no output"])[-1]
                raise UserError(f"devcluster: cannot make network namespaces on this machine ({why}); "
                                "it needs root and a kernel with netns. Fallback: `dspark-dev devcluster up "
                                "--network loopback`, every node on 127.0.0.1 (nothing then crosses an interface)")
        if _ip("link", "show", "eth0", netns=ns, check=False).returncode != 0:
            _ip("link", "del", veth, check=False)  # a half-made pair from a crash
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("addr", "replace", f"{self.addr(node)}/{self.network.prefixlen}", "dev", "eth0", netns=ns)
        for dev in ("lo", "eth0"):  # lo: a node's own servers on 127.0.0.1 (its vLLM) answer its own clients
            _ip("link", "set", dev, "up", netns=ns)

