"""torchrun elastic agents on this machine, each standing for a node of 2 ranks running train_elastic.py:
start them, wait for what the script logs, kill one node. Shared by tests/test_elastic.py and
benchmarks/elastic.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_elastic.py")


def env(node: str) -> dict:
    """The agent's environment (its workers inherit it): NODE_NAME names their pid files."""
    return {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "NODE_NAME": node,
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def agent(node: str, port: int, rdzv_conf: str, script_args: list[str], out, *, host: bool) -> subprocess.Popen:
    """An agent of 2 ranks (`--nnodes 1:2`) in the c10d rendezvous on 127.0.0.1:`port`; `host`: it serves the store."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
           "--rdzv-conf", f"{rdzv_conf},is_host={'true' if host else 'false'}", "--max-restarts", "3",
           "--monitor-interval", "0.5", SCRIPT, *script_args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env(node), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def records(work: str) -> list[dict]:
    """The script's log (rank 0's lines)."""
    path = os.path.join(work, "log.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def wait_for(work: str, what, agents: dict[str, subprocess.Popen], timeout: float = 400.0) -> dict:
    """The first log record `what` accepts; a `RuntimeError` if an agent exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [r for r in records(work) if what(r)]
        if found:
            return found[0]
        dead = {n: p.returncode for n, p in agents.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"agents exited while waiting: {dead}; log: {records(work)}")
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout:.0f} s; log: {records(work)}")


def kill_workers(work: str, node: str = "") -> None:
    """SIGKILL the live workers of `node` (all nodes: "") by the pids they wrote; each runs in a session of its own,
    so killing its agent leaves it running. A pid is killed only while it is still this script."""
    pids = os.path.join(work, "pids")
    for name in os.listdir(pids) if os.path.isdir(pids) else []:
        if name.startswith(f"{node}-" if node else ""):
            pid = int(name.rsplit("-", 1)[1])
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"train_elastic.py" in f.read():
                        os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass


def kill_node(work: str, node: str, proc: subprocess.Popen) -> None:
    """SIGKILL the agent of `node` and its workers: a lost machine."""
    proc.kill()
    kill_workers(work, node)
    proc.wait(timeout=30)


def stop_all(work: str, agents: dict[str, subprocess.Popen]) -> None:
    """Kill what is left of a run (a failed one: held workers would wait forever)."""
    for proc in agents.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    kill_workers(work)
