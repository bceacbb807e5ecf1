"""The tensor-parallel ranks besides rank 0: one process each, started by
the engine (rank 0), holding their shard of the weights and of the KV cache.
Rank 0's plans reach them through pipes (engine/tp_channel.py), tensors
through torch.distributed.

A worker's life: join the group, load its shard (engine/loader.py's
tp_shard), take rank 0's number of KV blocks and context length (which
decide its CUDA graphs on a GPU), then run every plan rank 0 sends
(prepare, forward: the same collectives in the same order as rank 0) until
the plan is None. It exits when rank 0 says so or when rank 0 is gone (its
pipe ends; and a watchdog polls its parent, since collectives have no
deadline and a worker inside one would otherwise wait for it for ever).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import os
import socket
import threading
import time
from multiprocessing.connection import Connection
from typing import Callable, Optional

from tandem.engine.config import ConfigError, EngineConfig
from tandem.engine.tensor_parallel import (abort_tp, broadcast_tensor, destroy_tp, gather_objects_to_first, init_tp,
                                           rank_device)
from tandem.engine.tp_channel import PlanSender, WorkerGone, receive
from tandem.engine.tp_kv import TPKVCacheView, TPKVJob, receive_loads, send_layer

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How long rank 0's step may go on waiting after a worker exited before the
# process ends itself (TPWorkers._watch).
LOST_RANK_GRACE_S = 30.0
# A step that failed waits up to this long for the watcher to name a lost
# worker before its own error stands: a killed worker's sockets can close
# (gloo's "Connection closed by peer" on rank 0) a moment before its process
# handle reports the exit, and the step must fail naming the worker, not the
# socket. Only a failed step waits, and with every worker alive its error
# comes this much later.
FAILED_STEP_REAP_S = 2.0


def _abort_and_drain(device, drained: threading.Event) -> None:
    """Abort the group, then wait for the device's queued work; set drained
    when both returned. Either may block for ever (NCCL's abort can wait on
    a stream a stuck kernel holds), so the caller only waits on the event."""
    try:
        abort_tp()
    except Exception:  # noqa: BLE001 - the caller's deadline still guards against a hang
        log.exception("aborting the tensor-parallel group failed")
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    drained.set()


def exports_kv_cache(config: EngineConfig) -> bool:
    """Whether every rank's KV cache is shared memory (or CUDA IPC) that a
    decode on the host reads blocks from: a producer of the direct transfer."""
    return config.kv_transfer == "direct" and config.kv_role in ("producer", "both")


def _exited(procs) -> str:
    return ", ".join(f"{p.name} exited with code {p.exitcode}" for p in procs if not p.is_alive())


def _reap_exited(procs, timeout: float) -> Optional[str]:
    """The workers whose processes ended, waited up to `timeout` s for,
    named with their exit codes; None if none ended."""
    from multiprocessing.connection import wait

    ready = wait([p.sentinel for p in procs], timeout=timeout)
    gone = [p for p in procs if p.sentinel in ready]
    for p in gone:
        p.join(5)  # its sentinel closes a moment before it can be reaped for its exit code
    return _exited(gone) or None


def _exit_with_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.5)


def _worker_main(rank: int, world_size: int, init_method: str, config: EngineConfig, parent: int,
                 started, plans: Connection) -> None:
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    # Each rank is one of N processes on the host's cores: torch's default
    # thread count (all cores) in each would oversubscribe them N times.
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    started.set()  # rank 0 may join the group now: this process got this far
    init_tp(rank, world_size, init_method, config.resolved_device(), config.peer_all_reduce)
    from tandem.engine.hub import HubSource
    from tandem.engine.loader import load_model_info
    from tandem.engine.model_runner import ModelRunner

    mc = config.model
    info = load_model_info(mc.model, mc.load_format, mc.hf_config, mc.tokenizer, mc.max_model_len,
                           HubSource(mc.revision, mc.download_dir))
    runner = ModelRunner(config, info)
    runner.set_num_blocks(receive(plans))
    shared = None
    if exports_kv_cache(config):  # the direct transfer's producer: a decode reads every rank's cache
        from tandem.engine.connector.shared_cache import ExportedKVCache

        shared = ExportedKVCache(runner.layout.shape, runner.kv_dtype, runner.device)
        runner.bind_kv_cache(shared.tensor)
        gather_objects_to_first(shared.export)
    else:
        runner.bind_kv_cache()
    # Decode CUDA graphs hold the model's all-reduces: every rank captures the
    # same batch sizes in the same order, and replays the same one each step.
    max_model_len = receive(plans)
    runner.warm_up_kernels(max_model_len)  # the same batches as rank 0's, in the same order
    runner.enable_cuda_graphs(max_model_len)
    # Fault injection for tests: exit on the Nth plan without running it, so
    # rank 0 is left in that step's collectives (a kill lands anywhere).
    exit_at = int(os.environ.get("TANDEM_FAULT_TP_WORKER_EXIT_AT_PLAN", "0"))
    num_plans = 0
    while True:
        try:
            message = receive(plans)
        except EOFError:  # rank 0 is gone without a word
            break
        if message is None:
            break
        plan, pending = message
        num_plans += 1
        if num_plans == exit_at:
            os._exit(99)
        runner.swap(plan)  # the host tier's copies of this rank's heads, as rank 0 makes its own
        if plan.is_empty:  # a plan that only swapped: nothing to run
            continue
        pending_tokens = None
        if pending is not None:  # the step before's sampled tokens, still on rank 0's device
            shape, dtype = pending
            pending_tokens = broadcast_tensor(torch.empty(shape, dtype=getattr(torch, dtype),
                                                          device=runner.device))
        job: Optional[TPKVJob] = plan.connector_meta
        after_layer = None
        if job is not None:  # this rank's part of the step's KV transfer (engine/tp_kv.py)
            if job.load_block_ids:
                receive_loads(runner.kv_cache, job.load_block_ids)
            if job.save_block_ids:
                ids = torch.tensor(job.save_block_ids, device=runner.device)
                after_layer = functools.partial(send_layer, runner.kv_cache, block_ids=ids)
        runner.forward(runner.prepare(plan, pending_tokens), plan, None, after_layer)
    runner.release_cuda_graphs()  # before the group is destroyed
    destroy_tp()
    if shared is not None:
        shared.close()


def check_tensor_parallel(config: EngineConfig, hf_config) -> None:
    """What tensor parallelism is not built for yet, refused by name before
    any process starts: the settings' part (EngineConfig's, which EngineArgs
    runs earlier with the --device setting) on the device resolved now, then
    the model's."""
    from tandem.engine.models.moe import MOE_MODEL_TYPES, MoEConfig

    config.check_tensor_parallel(config.resolved_device())
    flag = f"--tensor-parallel-size {config.tensor_parallel_size}"
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    counts = [(heads, "attention heads"), (kv_heads, "KV heads"), (hf_config.intermediate_size, "MLP channels")]
    if getattr(hf_config, "model_type", "") in MOE_MODEL_TYPES:  # each expert's channels split too
        counts.append((MoEConfig.from_hf(hf_config).intermediate_size, "expert MLP channels"))
    for total, what in counts:
        if total % config.tensor_parallel_size:
            raise ConfigError(f"{flag} does not divide the model's {total} {what}")


class TPWorkers:
    """Ranks 1..N-1 of an engine, and this process joined as rank 0."""

    def __init__(self, config: EngineConfig) -> None:
        import torch

        world = config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = multiprocessing.get_context("spawn")  # a fork would copy this process's threads' locks
        started = [ctx.Event() for _ in range(1, world)]
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, world)]  # (worker's reader, rank 0's writer)
        self.procs = [ctx.Process(target=_worker_main, name=f"tandem-tp-rank{rank}", daemon=True,
                                  args=(rank, world, init_method, config, os.getpid(), started[rank - 1],
                                        pipes[rank - 1][0]))
                      for rank in range(1, world)]
        for p in self.procs:
            p.start()
        for reader, _ in pipes:
            reader.close()  # the worker's now: a write to a worker that exited then fails at once
        self.plans = PlanSender([writer for _, writer in pipes], [p.name for p in self.procs])
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        log.info("tensor parallelism: %d ranks, workers %s", world, [p.pid for p in self.procs])
        try:
            self._wait_for_start(started)
        except RuntimeError:
            self._kill()
            raise
        init_tp(0, world, init_method, config.resolved_device(), config.peer_all_reduce)
        self.kv_view: Optional[TPKVCacheView] = None  # set by cache_view when the engine has a KV connector
        self.lost: Optional[str] = None  # the workers that exited while the engine ran, by name
        self._lost_named = threading.Event()  # set once the watcher has set lost
        self._stopping = threading.Event()
        self.device = rank_device(config.resolved_device(), 0)
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def _watch(self) -> None:
        """A worker that exits while the engine runs fails rank 0's step by
        name (check), at once: NCCL collectives waiting on it are aborted.
        If rank 0's GPU work still has not finished LOST_RANK_GRACE_S later
        (a kernel that waits on peer memory, which no abort reaches), the
        process ends itself: a lost rank cannot be replaced, and a process
        whose GPU waits for ever serves nobody, where an exit is restarted
        by whatever runs it."""
        from multiprocessing.connection import wait

        wait([p.sentinel for p in self.procs])
        if self._stopping.is_set():  # asked for: stop() joins them (two threads must not reap one child)
            return
        self.lost = _reap_exited(self.procs, timeout=0)
        self._lost_named.set()
        log.error("tensor-parallel worker %s; cutting rank 0's collectives short", self.lost)
        drained = threading.Event()
        threading.Thread(target=_abort_and_drain, args=(self.device, drained), name="tp-abort",
                         daemon=True).start()
        if not drained.wait(LOST_RANK_GRACE_S):
            log.critical("tensor-parallel worker %s and rank 0's GPU work is still waiting on it after "
                         "%.0f s; exiting this process", self.lost, LOST_RANK_GRACE_S)
            logging.shutdown()
            os._exit(70)

    def check(self, failed: bool = False) -> None:
        """Fail the step if a worker was lost while it ran (its outputs may
        have been computed from cut-short collectives). failed: the step
        failed already, maybe on a worker the watcher has not reported yet
        (a write to its pipe, a closed socket): the watcher, the one thread
        that reaps workers, is given FAILED_STEP_REAP_S to name it."""
        if failed:
            self._lost_named.wait(FAILED_STEP_REAP_S)
        if self.lost is not None:
            raise RuntimeError(f"tensor-parallel worker {self.lost}; the engine cannot step")

    def _wait_for_start(self, started: list) -> None:
        """Until every worker is about to join the group. Joining blocks
        until all ranks have joined, with no deadline: a worker that died
        before it would leave rank 0 waiting for ever."""
        while not all(event.wait(0.1) for event in started):
            for p in self.procs:
                if not p.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel worker {p.name} exited with code {p.exitcode} before joining its "
                        f"group (its error is above). The workers are spawned processes that import the "
                        f"main script: a script that makes an LLM with tensor_parallel_size above 1 must "
                        f"do so under `if __name__ == '__main__':`")

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(10)

    def share_num_blocks(self, num_blocks: int) -> None:
        """Every rank sizes its KV cache as rank 0 did (their memory may differ)."""
        self.plans.send(num_blocks)

    def share_max_model_len(self, max_model_len: int) -> None:
        """Every rank captures the CUDA graphs rank 0 does (none on a CPU)."""
        self.plans.send(max_model_len)

    def gather_exports(self, own) -> list:
        """Every rank's KVExport (this one's `own`), in rank order: the
        workers send theirs once their caches are bound (exports_kv_cache)."""
        return gather_objects_to_first(own)

    def cache_view(self, kv_cache) -> TPKVCacheView:
        """The view of whole blocks a KV connector on rank 0 moves (engine/tp_kv.py)."""
        self.kv_view = TPKVCacheView(kv_cache)
        return self.kv_view

    def swap_only(self, plan) -> None:
        """A plan that runs nothing but moves blocks to or from the host tier
        (a lone request swapped out): the workers copy their heads too."""
        self.plans.send((dataclasses.replace(plan, connector_meta=None), None))

    def run(self, plan, pending_tokens=None) -> None:
        """Hand the step's plan to the workers, the step before's sampled
        tokens where the plan reads them on the device (asynchronous
        scheduling: they never reach rank 0's host first), and the workers'
        heads of the blocks the connector loaded (after start_load); rank 0
        then runs it too. A worker that is gone fails the step (and so the
        engine, loudly) rather than leaving rank 0 waiting in a collective."""
        if not all(p.is_alive() for p in self.procs):
            raise RuntimeError(f"tensor-parallel worker {_exited(self.procs)}; the engine cannot step")
        meta, job, loaded = plan.connector_meta, None, None
        if meta is not None:  # the connector's meta holds rank 0's state: the workers get block ids
            load_ids, loaded = self.kv_view.take_loads()
            job = TPKVJob(load_ids, meta.saved_block_ids())
        pending = None
        if plan.pending_entries:
            pending = (tuple(pending_tokens.shape), str(pending_tokens.dtype).removeprefix("torch."))
        self.plans.send((dataclasses.replace(plan, connector_meta=job), pending))
        if pending is not None:
            broadcast_tensor(pending_tokens.contiguous())
        if loaded is not None:
            self.kv_view.send_loads(loaded)

    def gathering(self, save_layer: Callable[[int], None], block_ids: list[int]) -> Callable[[int], None]:
        """The after-layer hook of a step that saves: every rank's heads of the
        saved blocks gathered on rank 0, then the connector's save_layer."""
        import torch

        ids = torch.tensor(block_ids, device=self.kv_view.device)

        def hook(layer: int) -> None:
            self.kv_view.gather_layer(layer, ids)
            save_layer(layer)
        return hook

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()  # the workers' exits from here on are asked for
        try:
            if all(p.is_alive() for p in self.procs):
                self.plans.send(None)
        except WorkerGone as exc:  # a rank went away meanwhile: the others are killed below
            log.warning("tensor-parallel workers did not take the stop: %s", exc)
        finally:
            self.plans.close()
            destroy_tp()
            for p in self.procs:
                p.join(timeout_s)
                if p.is_alive():
                    p.kill()

