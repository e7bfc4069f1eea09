"""Layout and config files of the local dev Slurm cluster (see hpc_dev/devcluster.py).

Everything lives under one private state directory so that the cluster never touches the
host's /etc/slurm, /etc/munge or system MariaDB, and `rm -rf` of that directory resets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hpc_dev.devcluster_net import LOGIN_NAME, DevNetwork, default_subnet

# Unix socket paths are limited to 108 bytes (sun_path); keep a margin for munge's ".lock".
MAX_SOCKET_PATH = 100
ACCOUNTING_DB = "slurm_acct_db"


@dataclass(frozen=True)
class DevClusterSpec:
    """Where the cluster lives and what it looks like; every path derives from ``root``."""

    root: Path
    partition: str = "debug"
    num_nodes: int = 3
    cpus_per_node: int = 2
    memory_mb: int = 6000
    gpus_per_node: int = 2
    first_node_port: int = 17001
    # Off the default 6817/6819 so a system Slurm on the same host is left alone.
    ctld_port: int = 16817
    dbd_port: int = 16819
    cluster_name: str = "dspark"
    # "netns": every node a host of its own on a private bridge (hpc_dev/devcluster_net.py);
    # "loopback": the fallback where namespaces cannot be made, every node on 127.0.0.1.
    network: str = "netns"
    subnet: str = field(default_factory=default_subnet)

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.num_nodes + 1)]

    @property
    def net(self) -> DevNetwork:
        return DevNetwork(self.subnet, tuple(self.node_names))

    @property
    def isolated(self) -> bool:
        return self.network == "netns"

    @property
    def login_addr(self) -> str:
        """Where slurmctld, slurmdbd and the tracking server are reached from the nodes."""
        return self.net.login_addr if self.isolated else "127.0.0.1"

    def node_addr(self, node: str) -> str:
        return self.net.addr(node) if self.isolated else "127.0.0.1"

    def hosts_lines(self) -> list[tuple[str, str]]:
        """(address, name) pairs /etc/hosts needs for the login name and every node."""
        return [(self.login_addr, LOGIN_NAME), *((self.node_addr(n), n) for n in self.node_names)]

    @property
    def etc_dir(self) -> Path:
        return self.root / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc_dir / "slurm.conf"

    @property
    def slurmdbd_conf(self) -> Path:
        # slurmdbd and slurmd look for their extra config files next to $SLURM_CONF.
        return self.etc_dir / "slurmdbd.conf"

    @property
    def gres_conf(self) -> Path:
        return self.etc_dir / "gres.conf"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.sock"

    @property
    def munge_key(self) -> Path:
        return self.munge_dir / "munge.key"

    @property
    def db_dir(self) -> Path:
        return self.root / "mariadb"

    @property
    def db_socket(self) -> Path:
        return self.root / "run" / "mariadb.sock"

    @property
    def ctld_state_dir(self) -> Path:
        return self.root / "ctld-state"

    @property
    def spool_dir(self) -> Path:
        return self.root / "spool"

    @property
    def gpu_dir(self) -> Path:
        return self.root / "gpus"

    def pid_file(self, daemon: str) -> Path:
        return self.run_dir / f"{daemon}.pid"

    def log_file(self, daemon: str) -> Path:
        return self.log_dir / f"{daemon}.log"

    def check(self) -> list[str]:
        """Problems that would only surface later as an obscure daemon failure."""
        problems = []
        if self.network not in ("netns", "loopback"):
            problems.append(f"network={self.network!r}: use netns (a host per node) or loopback")
        elif self.isolated:
            problems += self.net.check()
        if self.num_nodes < 1:
            problems.append(f"num_nodes={self.num_nodes}: need at least 1 node")
        if not self.partition or not self.partition.replace("_", "").replace("-", "").isalnum():
            problems.append(f"partition={self.partition!r}: use letters, digits, '-' or '_'")
        for sock in (self.munge_socket, self.db_socket):
            if len(str(sock)) > MAX_SOCKET_PATH:
                problems.append(f"state dir {self.root} is too long for the socket {sock.name}")
        return problems


def _gpu_range(count: int) -> str:
    return "0" if count == 1 else f"[0-{count - 1}]"


def render_slurm_conf(spec: DevClusterSpec) -> str:
    auth = f"socket={spec.munge_socket}"
    gres = f" Gres=gpu:{spec.gpus_per_node}" if spec.gpus_per_node else ""
    nodes = [
        # One slurmd per node on this host, told apart by its port (Debian builds slurmd with
        # multiple-slurmd support); NodeAddr is the node's own address (its namespace's).
        f"NodeName={name} NodeHostname=localhost NodeAddr={spec.node_addr(name)} Port={spec.first_node_port + i}"
        f" CPUs={spec.cpus_per_node} RealMemory={spec.memory_mb}{gres} State=UNKNOWN"
        for i, name in enumerate(spec.node_names)
    ]
    lines = [
        "# Generated by `dspark-dev devcluster`; rewritten on every fresh start.",
        f"ClusterName={spec.cluster_name}",
        # "localhost" lets slurmctld know itself on any hostname; the nodes dial the login address.
        f"SlurmctldHost=localhost({spec.login_addr})",
        f"SlurmctldPort={spec.ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # Without cred_expire=10 a requeued job waits ~180 s for its old credential to expire.
        f"AuthInfo={auth},cred_expire=10",
        f"StateSaveLocation={spec.ctld_state_dir}",
        f"SlurmdSpoolDir={spec.spool_dir}/%n",
        f"SlurmctldPidFile={spec.pid_file('slurmctld')}",
        f"SlurmdPidFile={spec.run_dir}/slurmd-%n.pid",
        f"SlurmctldLogFile={spec.log_file('slurmctld')}",
        f"SlurmdLogFile={spec.log_dir}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # No cgroups (and no systemd) here: track and launch tasks the plain way.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0",
        # Must be its own key: inside SchedulerParameters it is silently ignored, and without it
        # an afterok child of a failed parent stays PENDING forever instead of being cancelled.
        "DependencyParameters=kill_invalid_depend",
        # All slurmds share one host, so every node sees the whole machine: trust slurm.conf
        # instead of draining nodes whose real hardware looks smaller or larger.
        "SlurmdParameters=config_overrides",
        "MailProg=/bin/true",
        "ReturnToService=2",
        # A dependency on a job slurmctld has already purged is rejected as invalid.
        "MinJobAge=3600",
        "KillWait=5",
        "InactiveLimit=0",
        "SlurmdTimeout=60",
        "GresTypes=gpu",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/slurmdbd",
        f"AccountingStorageHost={spec.login_addr}",  # sacct inside a job (a node) dials it too
        f"AccountingStoragePort={spec.dbd_port}",
        # 22.05 reads the munge socket for slurmdbd traffic from here, not from AuthInfo;
        # without it slurmctld talks to the default socket and dies.
        f"AccountingStoragePass={spec.munge_socket}",
        *nodes,
        f"PartitionName={spec.partition} Nodes={','.join(spec.node_names)} Default=YES"
        " MaxTime=INFINITE State=UP OverSubscribe=NO",
    ]
    return "\n".join(lines) + "\n"


def render_slurmdbd_conf(spec: DevClusterSpec) -> str:
    lines = [
        "# Generated by `dspark-dev devcluster`.",
        "AuthType=auth/munge",
        f"AuthInfo=socket={spec.munge_socket}",
        "DbdHost=localhost",
        f"DbdPort={spec.dbd_port}",
        "SlurmUser=root",
        f"PidFile={spec.pid_file('slurmdbd')}",
        f"LogFile={spec.log_file('slurmdbd')}",
        "DebugLevel=info",
        "StorageType=accounting_storage/mysql",
        # "localhost" makes the MySQL client use the unix socket named by $MYSQL_UNIX_PORT.
        "StorageHost=localhost",
        "StorageUser=root",
        f"StorageLoc={ACCOUNTING_DB}",
    ]
    return "\n".join(lines) + "\n"


def render_gres_conf(spec: DevClusterSpec) -> str:
    if not spec.gpus_per_node:
        return "# No GPUs configured.\n"
    # A gres without File= drains the node; the files are harmless /dev/null clones.
    return f"Name=gpu File={spec.gpu_dir}/gpu{_gpu_range(spec.gpus_per_node)}\n"
