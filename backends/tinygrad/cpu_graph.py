"""A tinygrad graph runner for the CPU device: jitted kernels replayed in a tight loop, the
thread-split ones on all cores.

Two things cost tinygrad 0.14's CPU device most of its decode speed (profiles in docs/backend-tinygrad.md):
- per kernel launch, `run_linear` resolves the call's buffers and variables through UOp
  rewrites and builds ctypes arguments: ~0.1-0.4 ms of Python per kernel, 200+ kernels a step;
- the hand-coded optimizer splits large kernels across cores (a THREAD axis read through the
  `core_id` argument), but `CPUProgram.__call__` then calls the pieces one after another on
  the calling thread: one core busy, whatever NUM_CPU_THREADS says.
The CPU device has no graph runner of its own (`Device["CPU"].graph` is None), and a graph
runner is the extension point tinygrad gives a device for replaying a JIT's kernels. This one
precomputes every kernel's function pointer and argument list when the JIT is captured, patches
only the JIT's input buffers and bound variables per call, and hands the `core_id` pieces of a
split kernel to a pool of threads (ctypes releases the GIL while a kernel runs). A piece the pool
has not started by the time the calling thread finished its own runs on the calling thread: on
a machine whose other processes hold the cores, waiting for a pool thread to be scheduled made
2 threads slower than 1.

The replay itself runs in C (native_replay.c): one call per step walks every kernel, and the
pieces of a split kernel are claimed by the calling thread and native workers that spin between
kernels. Replayed from Python, a SmolLM2 decode step's ~480 kernel calls and ~150 pool handoffs
took about a quarter of the step (30-31 against 40-43 tokens/s, Xeon, 2 threads). Per call,
Python patches only the inputs' addresses and the variables into the argument table. Where the
C loop cannot be built, or a kernel has more arguments than it passes, the Python loop below
replays the step.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tinygrad.engine.jit import GraphRunner

from . import native_replay
from .toolchain import CompilerNotFoundError


class KernelLaunch:
    """One compiled kernel of the graph with its argument list (buffer addresses, then variables)."""

    def __init__(self, runtime, program, buffers, device_vars: dict[str, int], input_slots: list[tuple[int, int]]):
        info = program.arg
        self.runtime = runtime  # keeps the kernel's executable memory alive
        self.args: list[int] = [buffers[i]._buf.va_addr for i in info.globals] + [0] * len(info.vars)
        self.function = ctypes.CFUNCTYPE(None, *([ctypes.c_uint64] * len(self.args)))(runtime.addr)
        # JIT inputs change buffers per call: (argument position, input slot)
        self.inputs = [(info.globals.index(p), slot) for p, slot in input_slots if p in info.globals]
        first_var = len(info.globals)
        self.core_arg = next((first_var + i for i, v in enumerate(info.vars) if v.expr == "core_id"), None)
        self.vars = [(first_var + i, v.expr) for i, v in enumerate(info.vars) if v.expr != "core_id"]
        self.device_vars = device_vars
        self.info = info
        self.static_pieces = info.global_size[0] if isinstance(info.global_size[0], int) else None

    def prepare(self, input_uops, var_vals: dict[str, int]) -> int:
        """Patch this call's inputs and variables into the arguments; returns the number of pieces."""
        for position, slot in self.inputs:
            self.args[position] = input_uops[slot].buffer.ensure_allocated()._buf.va_addr
        values = {**var_vals, **self.device_vars}
        for position, name in self.vars:
            self.args[position] = values[name]
        if self.static_pieces is not None:
            return self.static_pieces
        return self.info.launch_dims(values)[0][0]


class NativeLaunches:
    """The launches as native_replay's launch_t records over one argument table, and what a call
    patches into them."""

    def __init__(self, launches: list[KernelLaunch]):
        self.table = np.zeros((len(launches), native_replay.MAX_ARGS), np.uint64)
        self.records = np.zeros(len(launches), native_replay.LAUNCH)
        self.inputs: dict[int, tuple[list[int], list[int]]] = {}  # input slot -> (rows, columns)
        self.vars: dict[str, tuple[list[int], list[int]]] = {}
        self.dynamic = [(i, launch) for i, launch in enumerate(launches) if launch.static_pieces is None]
        for i, launch in enumerate(launches):
            self.table[i, : len(launch.args)] = launch.args
            self.records[i] = (
                launch.runtime.addr,
                self.table[i].ctypes.data,
                -1 if launch.core_arg is None else launch.core_arg,
                launch.static_pieces or 1,
            )
            for position, slot in launch.inputs:
                rows, columns = self.inputs.setdefault(slot, ([], []))
                rows.append(i), columns.append(position)
            for position, name in launch.vars:
                if name in launch.device_vars:  # fixed at capture (a multi-device shard's index)
                    self.table[i, position] = launch.device_vars[name]
                    continue
                rows, columns = self.vars.setdefault(name, ([], []))
                rows.append(i), columns.append(position)

    def run(self, pool: native_replay.NativePool, input_uops, values: dict[str, int]) -> None:
        for slot, (rows, columns) in self.inputs.items():
            self.table[rows, columns] = input_uops[slot].buffer.ensure_allocated()._buf.va_addr
        for name, (rows, columns) in self.vars.items():
            self.table[rows, columns] = values[name]
        for i, launch in self.dynamic:
            self.records[i]["pieces"] = launch.info.launch_dims({**values, **launch.device_vars})[0][0]
        pool.run(self.records)


class KilnCPUGraph(GraphRunner):
    """Replays a batch of a JIT's CPU kernels; set as `Device["CPU"].graph` by `install_cpu_graph`."""

    pool: ThreadPoolExecutor | None = None
    native_pool: native_replay.NativePool | None = None
    threads = 1

    def __init__(self, linear, input_uops=()):
        super().__init__(linear, input_uops)
        self.launches = [
            KernelLaunch(self.runtimes[j], program, buffers, device_vars, self.uop_replace[j])
            for j, (_, program, buffers, device_vars) in enumerate(self.calls)
        ]
        fits = all(len(launch.args) <= native_replay.MAX_ARGS for launch in self.launches)
        self.native = NativeLaunches(self.launches) if fits and self.native_pool is not None else None

    def __call__(self, input_uops, var_vals: dict[str, int], wait: bool = False) -> float | None:
        start = time.perf_counter()
        if self.native is not None:
            self.native.run(self.native_pool, input_uops, var_vals)
            return time.perf_counter() - start if wait else None
        for launch in self.launches:
            pieces = launch.prepare(input_uops, var_vals)
            if launch.core_arg is None:
                launch.function(*launch.args)
            else:
                self._run_pieces(launch, pieces)
        return time.perf_counter() - start if wait else None

    def _run_pieces(self, launch: KernelLaunch, pieces: int) -> None:
        """Run core_id 0..pieces-1: on the pool when there is one, else one after another."""
        core = launch.core_arg
        calls = []
        for piece in range(pieces):
            args = list(launch.args)
            args[core] = piece
            calls.append(args)
        if self.pool is None or pieces == 1:
            for args in calls:
                launch.function(*args)
            return
        futures = [self.pool.submit(launch.function, *args) for args in calls[1:]]
        launch.function(*calls[0])
        for future, args in zip(futures, calls[1:]):
            if future.cancel():  # not started yet (its thread has no core now): run it here, don't wait
                launch.function(*args)
            else:
                future.result()


def install_cpu_graph(threads: int | None = None) -> None:
    """Make KilnCPUGraph tinygrad's CPU graph runner, splitting kernels over `threads` cores.

    `threads` None: every core this process may use. Kernels compiled before the call keep the
    thread count they were compiled for (NUM_CPU_THREADS is read at code generation).
    """
    from tinygrad import Device
    from tinygrad.helpers import NUM_CPU_THREADS

    threads = threads or len(os.sched_getaffinity(0))
    NUM_CPU_THREADS.value = threads
    if threads != KilnCPUGraph.threads:
        if KilnCPUGraph.pool is not None:
            KilnCPUGraph.pool.shutdown()
        KilnCPUGraph.pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="kiln-tinygrad") if threads > 1 else None
        KilnCPUGraph.threads = threads
    if KilnCPUGraph.native_pool is None or KilnCPUGraph.native_pool.threads != threads:
        if KilnCPUGraph.native_pool is not None:
            KilnCPUGraph.native_pool.close()
        KilnCPUGraph.native_pool = _native_pool(threads)
    device = Device["CPU"]
    if device.graph is None or device.graph is KilnCPUGraph:
        device.graph = KilnCPUGraph


def _native_pool(threads: int) -> native_replay.NativePool | None:
    """A native pool of `threads`, or None (steps then replay from Python) where the C loop
    cannot be built."""
    try:
        return native_replay.NativePool(threads)
    except (OSError, subprocess.CalledProcessError, CompilerNotFoundError):
        return None
