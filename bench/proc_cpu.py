"""CPU time by component of a serving run, from /proc: core-seconds per 1,000 output tokens.

    .venv/bin/python bench/proc_cpu.py TOKENS -- kvlab loadtest ...

runs the load test (its output passes through) between two snapshots of every process's user +
system time, labelled by what it is (an engine replica, Serve's proxy, the ingress, Ray's
daemons, a lone kvlab serve) from its command line, and prints each label's growth per 1,000
of the TOKENS the test produced (with --ignore-eos: requests x max tokens). The load-test
client counts from its own rusage, its start-up (imports) included. "other" is whatever else
ran on the machine meanwhile (/proc/stat's busy time minus all of the above): another job's
load shows there, not in the components. Linux only.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys

HZ = os.sysconf("SC_CLK_TCK")
LABELS = (  # first match wins: (substring of the command line, component)
    ("KvlabEngine", "engine replica"), ("KvlabIngress", "ingress"),
    ("ProxyActor", "Serve proxy"), ("ServeController", "Serve controller"),
    ("kvlab.cli.main serve", "kvlab serve"), ("kvlab serve", "kvlab serve"),
    ("raylet", "Ray daemons"), ("gcs_server", "Ray daemons"), ("ray/dashboard", "Ray daemons"),
    ("DashboardAgent", "Ray daemons"), ("log_monitor", "Ray daemons"),
    ("autoscaler", "Ray daemons"), ("runtime_env", "Ray daemons"),
)


def component(cmdline: str) -> str | None:
    return next((name for key, name in LABELS if key in cmdline), None)


def snapshot() -> dict[str, list]:
    """{pid: [component, core-s]} for the processes of interest, and the machine's busy time."""
    out: dict[str, list] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        name = component(cmd)
        if name is not None:  # utime + stime, fields 14 and 15 of stat
            out[pid] = [name, (int(fields[11]) + int(fields[12])) / HZ]
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    out["machine"] = ["machine", (user + nice + system + irq + softirq) / HZ]
    return out


def report(before: dict[str, list], after: dict[str, list], tokens: int,
           client: float | None) -> dict[str, float]:
    """Core-seconds per 1,000 output tokens of each component, and of "other"."""
    spent: dict[str, float] = {}
    for pid, (name, t) in after.items():
        if pid != "machine":
            old = before.get(pid)
            spent[name] = spent.get(name, 0.0) + t - (old[1] if old and old[0] == name else 0.0)
    if client is not None:
        spent["load-test client"] = client
    machine = after["machine"][1] - before["machine"][1]
    spent["other"] = max(0.0, machine - sum(spent.values()))
    return {name: 1000 * s / tokens for name, s in spent.items()}


def main(argv: list[str]) -> None:
    if len(argv) < 3 or not argv[0].isdigit() or argv[1] != "--":
        sys.exit(__doc__)
    before = snapshot()
    code = subprocess.run(argv[2:], check=False).returncode
    after = snapshot()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    per_1k = report(before, after, int(argv[0]), usage.ru_utime + usage.ru_stime)
    mine = sum(per_1k.values()) - per_1k["other"]
    print("core-s per 1,000 output tokens: " + ", ".join(
        f"{name} {v:.2f}" for name, v in sorted(per_1k.items(), key=lambda kv: -kv[1])
        if v >= 0.005) + f"; all but other {mine:.2f}", flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
