"""Run a function on N local processes joined in a torch.distributed group (tests, demo, examples).

`run_local(4, fn, x)` calls `fn(rank, 4, x)` in 4 processes after `init_process_group`, returns the
per-rank results in rank order, and turns any rank's exception, crash or hang into a `RuntimeError`
on the caller that names the rank (with its traceback, or its Python stack for a hang). Real jobs
launch with `torchrun`; `is_torchrun()` tells which case the current process is in.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["free_port", "init_torchrun_group", "is_torchrun", "run_local"]

_stack_file = None  # keeps the child's faulthandler file open


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it by binding port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_torchrun() -> bool:
    """Whether this process was started by torchrun (or run_local): RANK and WORLD_SIZE are set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_torchrun_group(backend: str | None = None, timeout: timedelta | float | None = None) -> None:
    """`init_process_group` from torchrun's environment, safe across torchrun's restarts. On an
    accelerator backend (NCCL, the default where CUDA is available) the current device becomes LOCAL_RANK's.

    torchrun's c10d rendezvous shares one TCPStore across restarts, and the keys a process group
    writes there (gloo's peer addresses, NCCL's unique id) outlive the attempt that wrote them: a
    restarted rank can read a dead peer's address and fail to connect (pytorch/pytorch#135712).
    Each attempt therefore gets its own key prefix (TORCHELASTIC_RESTART_COUNT, the same on every
    rank when the whole group restarts together, as torchrun does on one node).
    """
    from meshplan.runtime.collectives import resolve_timeout

    if not is_torchrun():
        raise ValueError("init_torchrun_group needs torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = resolve_timeout(timeout)
    device = _own_device(backend, int(os.environ.get("LOCAL_RANK", 0)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout, device_id=device)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"meshplan/attempt_{attempt}", store), rank=rank,
                            world_size=world_size, timeout=timeout, device_id=device)


def _own_device(backend: str, local_rank: int) -> torch.device | None:
    """On an accelerator backend (NCCL), this process's device, made current: one device per process of a node,
    local rank i on device i (modulo the devices this process sees, as `group_device` expects). None for gloo."""
    if backend == "gloo" or not torch.accelerator.is_available():
        return None
    index = local_rank % torch.accelerator.device_count()
    torch.accelerator.set_device_index(index)
    # bound to the group too (init_process_group's device_id): NCCL then need not guess it from the global rank
    return torch.device(torch.accelerator.current_accelerator().type, index)


def _worker(rank, world_size, port, backend, timeout, fn, args, conn, stack_path) -> None:
    global _stack_file
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # the ranks share the machine's cores
    try:  # die with the parent (Linux), so a killed test run leaves no orphans
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if hasattr(signal, "SIGUSR1"):  # the parent asks for our Python stack when we hang
        _stack_file = open(stack_path, "w")
        faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout), device_id=_own_device(backend, rank))
        value = fn(rank, world_size, *args)
        if dist.is_initialized():  # nobody leaves (rank 0 hosts the store) before everyone is done
            dist.barrier()
            dist.destroy_process_group()
        data = pickle.dumps(("ok", value))  # plain pickle: tensors by value, no shared memory
    except BaseException:
        data = pickle.dumps(("error", traceback.format_exc()))
    conn.send_bytes(data)
    conn.close()


def _receive(conn, proc) -> tuple[str, Any]:
    try:
        return pickle.loads(conn.recv_bytes())
    except EOFError:
        proc.join(timeout=5)
        return "error", f"process exited with code {proc.exitcode} before returning a result\n"
    except Exception:
        return "error", "its result could not be unpickled in the caller:\n" + traceback.format_exc()


def _start_method(backend: str) -> str:
    if "fork" in mp.get_all_start_methods() and backend == "gloo" and not dist.is_initialized():
        return "fork"  # 2-3x faster than spawn: the ranks don't re-import torch
    return "spawn"  # CUDA and an inherited process group do not survive fork


def run_local(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0,
              backend: str = "gloo", start_method: str | None = None) -> list:
    """Call `fn(rank, world_size, *args)` on `world_size` new local processes; return results by rank.

    Each process joins a `backend` group (init_method tcp://127.0.0.1:<free port>, collective
    timeout `timeout` s), has RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set and one intra-op thread,
    and destroys the group when `fn` returns. Results must be picklable. `timeout` also bounds the
    whole run. Raises `RuntimeError` naming the first failing rank and its traceback (the other
    ranks are killed), or the unfinished ranks and their stacks on timeout. `start_method` defaults
    to "fork" for gloo (fn may then be a closure) and "spawn" otherwise (fn must be importable).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    ctx = mp.get_context(start_method or _start_method(backend))
    port = free_port()
    where = f"run_local(world_size={world_size}, backend={backend!r})"
    stack_dir = tempfile.TemporaryDirectory(prefix="meshplan-launch-")
    stack_paths = [os.path.join(stack_dir.name, f"rank{r}.stack") for r in range(world_size)]
    procs, pending = [], {}
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, name=f"meshplan-rank{rank}", args=(
                rank, world_size, port, backend, timeout, fn, args, send_end, stack_paths[rank]))
            proc.start()
            send_end.close()
            procs.append(proc)
            pending[recv_end] = rank
        while pending and not failures and time.monotonic() < deadline:
            for conn in wait(list(pending), timeout=max(0.0, deadline - time.monotonic())):
                rank = pending.pop(conn)
                status, payload = _receive(conn, procs[rank])
                (results if status == "ok" else failures)[rank] = payload
        if failures:  # collect failures that arrive together (usually consequences of the first)
            for conn in wait(list(pending), timeout=0.2):
                rank = pending.pop(conn)
                status, payload = _receive(conn, procs[rank])
                if status != "ok":
                    failures[rank] = payload
            first, *others = failures  # in order of arrival
            message = f"{where}: rank {first} failed:\n{failures[first]}"
            for rank in others:
                last = failures[rank].strip().splitlines()[-1] if failures[rank].strip() else "?"
                message += f"\n(rank {rank} also failed: {last})"
            raise RuntimeError(message)
        if pending:
            hung = sorted(pending.values())
            raise RuntimeError(f"{where} timed out after {timeout:g} s: ranks {hung} had not returned "
                               f"(ranks {sorted(results)} had).{_stacks(procs, hung, stack_paths)}")
        for proc in procs:
            proc.join(timeout=max(1.0, deadline - time.monotonic()))
        return [results[rank] for rank in range(world_size)]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=5)
        for conn in pending:
            conn.close()
        stack_dir.cleanup()


def _stacks(procs, ranks, stack_paths) -> str:
    """Ask the hung ranks to dump their Python stacks (faulthandler on SIGUSR1) and collect them."""
    if not hasattr(signal, "SIGUSR1"):
        return ""
    for rank in ranks:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(0.5)
    text = ""
    for rank in ranks:
        try:
            with open(stack_paths[rank]) as f:
                stack = f.read().strip()
        except OSError:
            stack = ""
        text += f"\n--- rank {rank} Python stack ---\n{stack or '(not available)'}"
    return text
