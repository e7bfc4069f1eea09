"""The dev cluster as several hosts: a network namespace per node on a private bridge.

The session cluster's own network carries the prefix `dspark-`; the lifecycle tests here make
their own under `dsptst-`, on a subnet of their own, so they never touch the session's.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys

import pytest

from hpc.errors import UserError
from hpc_dev import devcluster_net
from hpc_dev.devcluster_net import DevNetwork
from tests.fixtures.slurm import SlurmCluster

TEST_PREFIX = "dsptst-"


def _ours(prefix: str) -> tuple[list[str], list[str]]:
    """Namespaces and host links that carry `prefix`."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    links = json.loads(subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True).stdout)
    return ([n.split()[0] for n in ns if n.startswith(prefix)],
            [link["ifname"] for link in links if link["ifname"].startswith(prefix)])


def _in(net: DevNetwork, node: str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*net.exec_prefix(node), sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def test_net():
    """A network of the test's own (prefix dsptst-), removed whole afterwards."""
    def make(subnet: str, nodes: tuple[str, ...]) -> DevNetwork:
        return DevNetwork(subnet, nodes, prefix=TEST_PREFIX)

    yield make
    make("10.214.0.0/29", ("node1",)).down()
    assert _ours(TEST_PREFIX) == ([], [])


@pytest.mark.host_wide
def test_nodes_reach_each_other_by_address_and_a_crashed_network_comes_down_whole(test_net) -> None:
    net = test_net("10.214.0.0/29", ("node1", "node2"))
    assert net.up() and net.is_up() and not net.up()  # the second is a no-op
    assert (net.login_addr, net.addr("node1"), net.addr("node2")) == ("10.214.0.1", "10.214.0.2", "10.214.0.3")
    # node2 serves on its address and on its loopback; node1 reaches only the first
    server = subprocess.Popen([*net.exec_prefix("node2"), sys.executable, "-c",
                               "import socket, time\n"
                               "for a in ('10.214.0.3', '127.0.0.1'):\n"
                               "    s = socket.socket(); s.bind((a, 7411)); s.listen(); globals()[a] = s\n"
                               "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        probe = ("import socket\nfor a in ('10.214.0.3', '127.0.0.1'):\n"
                 "    try:\n        socket.create_connection((a, 7411), timeout=3).close(); print(a, 'open')\n"
                 "    except OSError:\n        print(a, 'refused')\n")
        res = _in(net, "node1", probe)
        assert res.stdout.split("\n")[:2] == ["10.214.0.3 open", "127.0.0.1 refused"], res.stderr
        assert _in(net, "node1", "import socket; print(socket.create_connection(('10.214.0.1', 9), 1))"
                   ).returncode != 0  # the login side answers nothing it does not serve
    finally:
        server.kill()
        server.wait()
    # a crash: node2's namespace gone, a stray veth of a third node left behind
    subprocess.run(["ip", "netns", "del", net.netns("node2")], check=True)
    subprocess.run(["ip", "link", "add", f"{TEST_PREFIX}node3", "type", "veth", "peer", "name", "dsptst-x"],
                   check=True)
    assert not net.is_up()
    assert net.up() and net.is_up()  # repaired in place
    # `down` of a smaller cluster still takes out everything that carries the prefix
    assert DevNetwork("10.214.0.0/29", ("node1",), prefix=TEST_PREFIX).down()
    assert _ours(TEST_PREFIX) == ([], [])


def test_bad_subnets_are_one_line_naming_the_key() -> None:
    nodes = ("node1", "node2", "node3")
    says = {s: DevNetwork(s, nodes).check() for s in ("nonsense", "8.8.8.0/24", "10.9.0.0/30", "fd00::/64")}
    assert "is not an IPv4 network" in says["nonsense"][0]
    assert "use a private IPv4 range" in says["8.8.8.0/24"][0] and "use a private IPv4 range" in says["fd00::/64"][0]
    assert "has room for 1 node(s), not 3" in says["10.9.0.0/30"][0]
    assert all(len(v) == 1 and "--subnet" in v[0] and "\n" not in v[0] for v in says.values())


@pytest.mark.host_wide
def test_a_subnet_on_a_route_of_this_machine_is_refused_before_anything_is_made(test_net) -> None:
    routes = json.loads(subprocess.run(["ip", "-j", "-4", "route"], capture_output=True, text=True).stdout)
    taken = next(r for r in routes if r.get("dst", "default") != "default" and not r["dev"].startswith("dspark-"))
    net = test_net(str(ipaddress.IPv4Network(taken["dst"], strict=False)), ("node1",))
    with pytest.raises(UserError, match=rf"collides with the route {taken['dst']} dev {taken['dev']}.*--subnet"):
        net.up()
    assert _ours(TEST_PREFIX) == ([], [])


@pytest.mark.host_wide
def test_a_machine_without_namespaces_names_the_fallback_and_keeps_nothing(test_net, monkeypatch) -> None:
    real = devcluster_net._ip

    def no_netns(*args, **kw):
        if args[:2] == ("netns", "add"):
            return subprocess.CompletedProcess(args, 1, "", "mount --make-shared /run/netns failed: Operation not "
                                                            "permitted")
        return real(*args, **kw)

    monkeypatch.setattr(devcluster_net, "_ip", no_netns)
    with pytest.raises(UserError, match=r"cannot make network namespaces.*Operation not permitted.*"
                                        r"--network loopback"):
        test_net("10.214.0.0/29", ("node1",)).up()
    assert _ours(TEST_PREFIX) == ([], [])  # the bridge it made first is gone again


def test_each_node_runs_its_jobs_on_its_own_address(slurm_cluster: SlurmCluster) -> None:
    """A job step lives in its node's namespace: its address is the node's, its name resolves there."""
    code = ("import os, socket, psutil; me = os.environ['SLURMD_NODENAME']; "
            "addrs = sorted(a.address for i in psutil.net_if_addrs().values() for a in i if a.family == 2); "
            "print(me, socket.gethostbyname(me), *addrs)")
    res = subprocess.run(["srun", "-N3", "--ntasks-per-node=1", "-t", "2", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    seen = {line.split()[0]: line.split()[1:] for line in res.stdout.splitlines()}
    addrs = slurm_cluster.cluster.node_addrs()
    assert seen == {n: [a, *sorted([a, "127.0.0.1"])] for n, a in addrs.items()}
    assert len(set(addrs.values())) == 3 and slurm_cluster.login_addr not in addrs.values()


def test_a_second_clusters_down_leaves_the_live_network(slurm_cluster: SlurmCluster, tmp_path) -> None:
    """The network is the host's, like /etc/hosts: only the state dir that made it takes it down
    (a test's throwaway cluster going down cut the session's nodes off once)."""
    from hpc_dev.devcluster import DevCluster

    assert DevCluster(tmp_path / "dc").down() is False
    assert slurm_cluster.cluster.spec.net.is_up() and slurm_cluster.cluster.is_healthy()
