"""A pool of spawned processes forming one gloo group, kept alive across tests.

Starting a process and importing torch and flash_metal costs seconds on the
CI's two cores, so each world size gets one pool per test file: P spawned
processes joined in a gloo group (torch.distributed over TCP on localhost,
rendezvous through a file), each serving tasks from a queue. A task is a
function of tests/distributed_tasks.py, called on every rank with the same
keyword arguments; the pool returns each rank's result, or raises with the
traceback of the first rank that failed. A pool that does not answer in time
(a deadlock) is killed and the test fails; the next test gets a fresh one.
"""
import os
import queue
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp

TIMEOUT_S = float(os.environ.get("FLASH_METAL_DIST_TIMEOUT", "240"))


def _serve(rank, world, init_file, tasks, results, path, threads):
    sys.path[:0] = [p for p in path if p not in sys.path]
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    # As tests/conftest.py does for the main process: the ops' outputs come back NaN-filled, so an element
    # a kernel (or the merge) forgets to write stays NaN and fails the comparison.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import distributed_tasks

    while True:
        item = tasks.get()
        if item is None:
            break
        name, kwargs = item
        try:
            results.put((rank, True, getattr(distributed_tasks, name)(rank, world, **kwargs)))
        except BaseException:  # noqa: BLE001  (reported to the test, which fails with it)
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class Pool:
    def __init__(self, world: int, threads: int = 1):
        self.world = world
        ctx = mp.get_context("spawn")
        fd, self.init_file = tempfile.mkstemp(prefix="flash_metal_dist_")
        os.close(fd)
        os.unlink(self.init_file)  # the file store creates it
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        here = os.path.dirname(os.path.abspath(__file__))
        self.procs = [ctx.Process(target=_serve, daemon=True,
                                  args=(r, world, self.init_file, self.tasks[r], self.results, [here] + sys.path,
                                        threads))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, task: str, **kwargs):
        """Runs distributed_tasks.<task>(rank, world, **kwargs) on every rank; returns the results in rank order."""
        assert not self.broken, "this pool was killed after a failure"
        for t in self.tasks:
            t.put((task, kwargs))
        got, failures = {}, []
        deadline = time.monotonic() + TIMEOUT_S
        while len(got) + len(failures) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    self.kill()
                    why = f"rank(s) {dead} died" if dead else f"no answer in {TIMEOUT_S:.0f} s (a deadlock?)"
                    failed = "".join(f"\nrank {r} failed:\n{tb}" for r, tb in failures)
                    raise AssertionError(f"task {task} on {self.world} ranks: {why}; answered: {sorted(got)}"
                                         f"{failed}")
                continue
            if ok:
                got[rank] = value
            else:
                failures.append((rank, value))
        if failures:
            # A rank that failed may leave the others inside a collective; the pool cannot be trusted after.
            self.kill()
            rank, tb = failures[0]
            raise AssertionError(f"task {task} failed on rank {rank} of {self.world}:\n{tb}")
        return [got[r] for r in range(self.world)]

    def kill(self):
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)

    def close(self):
        if self.broken:
            return
        for t in self.tasks:
            t.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self.broken = True
        if os.path.exists(self.init_file):
            os.unlink(self.init_file)


class Pools:
    """One Pool per world size, created on first use; a killed one is replaced. At most `keep` pools live at
    once (the least recently used is closed), to spare the shared machine's memory."""

    def __init__(self, threads: int = 1, keep: int = 2):
        self.threads, self.keep = threads, keep
        self.pools = {}

    def __call__(self, world: int) -> Pool:
        pool = self.pools.pop(world, None)
        if pool is None or pool.broken:
            pool = Pool(world, self.threads)
        self.pools[world] = pool  # most recently used last
        while len(self.pools) > self.keep:
            oldest = next(iter(self.pools))
            self.pools.pop(oldest).close()
        return pool

    def run(self, world: int, task: str, **kwargs):
        return self(world).run(task, **kwargs)

    def close(self):
        for pool in self.pools.values():
            pool.close()
