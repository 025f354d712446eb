"""Ready batches, built off the training loop's critical path.

A *source* builds raw batches: ``source.build(kind, index, alloc)`` returns a dict of
arrays in their stored dtypes (``kind``: "pair", captions with their images; "image";
"text"), every array from ``alloc(shape, dtype)``; a streaming source (shards) also has
``source.stream(spec, worker, n_workers, alloc, start)``, a generator of ``(raw batch,
position after it)``. :class:`Batches` builds ahead of the consumer and hands out batches
as the models read them (:func:`models.data.arrays.finish`: float32, standardised, on the
device):

- ``num_workers = 0``, ``prefetch = 0``: built in the loop, when asked for (debugging);
- ``num_workers = 0``, ``prefetch = P``: built by a thread, up to P ahead (numpy gathers
  and torch copies release the GIL, so building overlaps the step);
- ``num_workers = W``: built by W worker processes, up to P ahead each, batch ``i`` by
  worker ``i % W``, handed out in order.

Every batch is built into a reused :class:`Arena` (shared memory for workers). A CPU batch
is a view of its arena, valid until the next batch is asked for, and is finished by the
builder. On CUDA the producer copies each batch into pinned memory and frees the arena; the
consumer copies it without blocking and finishes it on the device, one batch ahead on a
side stream (:mod:`models.data.staging`).

Order: the tasks' order (a map-style epoch), or, for a stream, round-robin over the
workers; the same on every run with the same worker count. Nothing here draws from
torch's global RNG. Resume: a map-style pass goes on with the tasks left; a stream from
``Stream.start`` = :attr:`Batches.position` (each worker stream's position, whose turn it
is, batches taken), the skip computed (nothing before it is read again).
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass
from itertools import repeat

import numpy as np
import torch

from infra.config import UserError
from infra.resume import init_worker
from models.data.arena import Arena, from_layout
from models.data.arrays import as_tensors, finish, to_device
from models.data.staging import staged_on_cuda

WORKER_CONTEXT = "spawn"  # a fork would copy the threads of an in-process Prefect run
POLL_SECONDS = 0.5  # how often a waiting producer checks that it should stop / is alive


class DataWorkerError(UserError):
    """A data-loading worker failed or died."""


@dataclass(frozen=True)
class Stream:
    """One epoch of a streaming source: ``spec`` is passed to ``source.stream``; at most
    ``steps`` batches are taken (all ranks take the same number)."""

    spec: tuple
    steps: int
    start: dict | None = None  # where to go on from: a Batches.position of this stream


def build(source, kind: str, index: np.ndarray, alloc: Arena) -> dict:
    """A raw batch of ``source`` in ``alloc``: ``source.build`` when it has one, else its
    ``<kind>_batch(index)`` (a test source of ready tensors), copied into the arena."""
    if hasattr(source, "build"):
        return alloc.adopt(source.build(kind, index, alloc))
    return alloc.adopt(getattr(source, f"{kind}_batch")(index))


class _Builder:
    """Builds the batches of one process (a worker, or the trainer's) into the arena each
    request names, finished there when ``finish_here``: ``("build", (kind, index))``, or
    ``("next", (number, spec, start))``, the next batch of pass ``number``'s stream."""

    def __init__(self, source, worker: int, n_workers: int, stats, finish_here: bool):
        self.source, self.worker, self.n_workers = source, worker, n_workers
        self.stats, self.finish_here = stats, finish_here
        self.stream_pass = self.stream = self.arena = None

    def _alloc(self, shape, dtype):  # a stream's batches go to the arena of the request
        return self.arena(shape, dtype)

    def __call__(self, arena: Arena, op: str, task) -> tuple[dict, object] | None:
        """``(batch, position after it)`` in ``arena``; None when the stream is done."""
        arena.reset()
        self.arena, position = arena, None
        if op == "build":
            batch = build(self.source, *task, arena)
        else:
            number, spec, start = task
            if number != self.stream_pass:
                self.stream_pass = number
                self.stream = self.source.stream(
                    spec, self.worker, self.n_workers, self._alloc, start
                )
            raw = next(self.stream, None)
            if raw is None:
                return None
            batch, position = arena.adopt(raw[0]), raw[1]
        if self.finish_here:
            batch = arena.adopt(finish(as_tensors(batch), self.stats, alloc=arena))
        return batch, position


def _worker(source, conn, worker: int, n_workers: int, stats, finish_here: bool) -> None:
    """A worker process: builds the batches it is asked for into its arenas (one per
    slot) and answers with their layout (and an arena's new buffer when it grew)."""
    init_worker()
    torch.set_num_threads(1)
    arenas: dict[int, Arena] = {}
    builder = _Builder(source, worker, n_workers, stats, finish_here)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the training process is gone
            return
        if message is None:
            return
        op, slot, task = message
        if slot not in arenas:
            arenas[slot] = Arena(shared=True)
        arena = arenas[slot]
        try:
            built = builder(arena, op, task)
            if built is None:
                conn.send(("end", slot, None, None, None))
                continue
            fresh = arena.tensor if arena.changed else None
            arena.changed = False
            conn.send(("ok", slot, arena.layout(built[0]), fresh, built[1]))
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the trainer
            text = traceback.format_exc()
            try:
                conn.send(("error", slot, exc, text, None))
            except Exception:  # noqa: BLE001 - an exception that does not pickle
                conn.send(("error", slot, None, text, None))


class _Stopped(Exception):
    """The consumer stopped the pass; the producer winds down."""


class Batches:
    """Ready batches of ``source`` on ``device`` (see the module docstring).

    ``run(tasks)`` is one pass: ``tasks`` is a sequence of ``(kind, index)`` (a map-style
    source) or a :class:`Stream`. Workers start once and serve every pass; ``close()``
    (or leaving a ``with`` block) stops them. One pass at a time: starting a pass ends
    the previous one.
    """

    def __init__(self, source, device, *, num_workers: int = 0, prefetch: int = 2):
        if num_workers and prefetch < 1:
            raise UserError("prefetch: workers build at least one batch ahead; set it >= 1")
        self.source = source
        self.device = torch.device(device)
        self.num_workers = num_workers
        self.prefetch = prefetch
        self.stats = getattr(source, "stats", None) or {}
        self._device_stats = {k: tuple(t.to(self.device) for t in v) for k, v in self.stats.items()}
        # on the CPU the builder finishes batches; on an accelerator the device does
        self._finish_on_host = self.device.type == "cpu"
        self._arenas: list[Arena] = []
        self._workers: list = []
        self._buffers: dict[tuple[int, int], np.ndarray] = {}  # (worker, slot) -> arena
        self._active = None  # the pass in progress
        self._passes = 0  # a worker starts a stream afresh when a new pass asks
        self.position: dict | None = None  # a stream's position after the last batch given

    # -- lifecycle

    def __enter__(self) -> Batches:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the pass in progress and stop the workers."""
        if self._active is not None:
            self._active.close()
            self._active = None
        self._stop_workers()

    def _stop_workers(self) -> None:
        for _, conn in self._workers:
            with suppress(OSError):
                conn.send(None)
        for process, conn in self._workers:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            conn.close()
        self._workers, self._buffers = [], {}

    def __del__(self):
        with suppress(Exception):  # interpreter shutdown
            self.close()

    def _start_workers(self) -> None:
        import torch.multiprocessing as mp

        context = mp.get_context(WORKER_CONTEXT)
        for worker in range(self.num_workers):
            ours, theirs = context.Pipe()
            args = (self.source, theirs, worker, self.num_workers, self.stats, self._finish_on_host)
            process = context.Process(
                target=_worker, args=args, daemon=True, name=f"vse-data-{worker}"
            )
            process.start()
            theirs.close()
            self._workers.append((process, ours))

    # -- one pass

    def run(self, tasks: Sequence[tuple[str, np.ndarray]] | Stream) -> Iterator[dict]:
        """The batches of ``tasks``, ready on the device, in order. For a :class:`Stream`,
        :attr:`position` is where the stream stands after the last batch handed out (what
        ``Stream.start`` takes to go on from there)."""
        if self._active is not None:
            self._active.close()
        self._active = self._run(tasks)
        return self._active

    def _run(self, tasks) -> Iterator[dict]:
        stop = threading.Event()
        self.position = tasks.start if isinstance(tasks, Stream) else None
        if self.num_workers:
            if not self._workers:
                self._start_workers()
            produced = self._from_workers(tasks, stop)
        else:
            produced = self._built_here(tasks, stop)
        if self.num_workers or self.prefetch:
            produced = self._in_thread(produced, stop)
        try:
            if self.device.type == "cuda":  # batch i + 1 staged while step i runs
                pairs = ((position, batch) for batch, _, position in produced)
                for position, batch in staged_on_cuda(pairs, self._ready, self.device):
                    self.position = position
                    yield batch
                return
            for batch, release, position in produced:
                self.position = position
                try:
                    yield self._ready(batch)
                finally:  # the consumer is done with the batch: its arena builds again
                    if release is not None:
                        release()
        finally:
            stop.set()
            produced.close()

    def _ready(self, batch: dict) -> dict:
        """On the CPU the batch is ready; on a device: non-blocking copy, then finish."""
        batch = as_tensors(batch)
        if self._finish_on_host:
            return batch
        return finish(to_device(batch, self.device), self._device_stats)

    def _handoff(self, batch: dict, release, position=None) -> tuple[dict, object, object]:
        """What the producer passes on: on an accelerator a pinned copy (the arena is freed
        at once, the consumer copies without blocking); on the CPU the arena's views."""
        if self._finish_on_host:
            return batch, release, position
        pin = self.device.type == "cuda"  # CUDA's caching host allocator; others: a plain copy
        copied = {}
        for key, value in batch.items():
            if isinstance(value, np.ndarray):  # out of its arena
                value = torch.from_numpy(value)
                value = value.pin_memory() if pin else value.clone()
            copied[key] = value
        release()
        return copied, None, position

    @staticmethod
    def _wait(free: queue.Queue, stop: threading.Event):
        while True:
            try:
                return free.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if stop.is_set():
                    raise _Stopped from None

    def _built_here(self, tasks, stop: threading.Event) -> Iterator[tuple[dict, object]]:
        """Batches built in this process, each in one of ``prefetch + 1`` arenas."""
        while len(self._arenas) < self.prefetch + 1:
            self._arenas.append(Arena())
        free: queue.Queue = queue.Queue()
        for arena in self._arenas[: self.prefetch + 1]:
            free.put(arena)
        builder = _Builder(self.source, 0, 1, self.stats, self._finish_on_host)
        if isinstance(tasks, Stream):
            start = tasks.start or {"streams": {}, "taken": 0}
            first = ("next", (0, tasks.spec, start["streams"].get(0)))
            requests = repeat(first, tasks.steps - start["taken"])
        else:
            requests = (("build", task) for task in tasks)
        for i, (op, task) in enumerate(requests):
            arena = self._wait(free, stop)
            built = builder(arena, op, task)
            if built is None:
                return
            batch, position = built
            if op == "next":  # where the stream (of one worker) stands
                taken = start["taken"] + i + 1
                position = {"streams": {0: position}, "active": [0], "turn": taken, "taken": taken}
            yield self._handoff(batch, lambda a=arena: free.put(a), position)

    def _from_workers(self, tasks, stop: threading.Event) -> Iterator[tuple[dict, object]]:
        """Batches built by the worker processes, taken from each active worker in turn:
        map-style task ``i`` by worker ``i % W``; a stream, the next batch of each worker's
        stream until it ends. Each is built into one of the worker's slots."""
        workers = self.num_workers
        free = [queue.Queue() for _ in range(workers)]
        for q in free:
            for slot in range(self.prefetch + 1):
                q.put(slot)
        pending: list[deque] = [deque() for _ in range(workers)]  # slots asked for, in order
        stream = isinstance(tasks, Stream)
        if stream:
            self._passes += 1
            start, steps = tasks.start or {}, tasks.steps
            first = dict(start.get("streams", {}))  # each worker's start, sent with its first ask
        else:
            tasks = list(tasks)
            start, steps = {}, len(tasks)
            todo = [deque(tasks[w::workers]) for w in range(workers)]
        state = {
            "streams": dict(start.get("streams", {})),
            "active": list(start.get("active", range(workers))),
            "turn": start.get("turn", 0),
            "taken": start.get("taken", 0),
        }

        def ask(w: int, block: bool = False) -> bool:
            """Ask worker ``w`` for its next batch if it has one to build and one of its
            slots is free (``block``: once the consumer frees one)."""
            if not stream and not todo[w]:
                return False
            try:
                slot = self._wait(free[w], stop) if block else free[w].get_nowait()
            except queue.Empty:
                return False
            if stream:
                request = ("next", slot, (self._passes, tasks.spec, first.pop(w, None)))
            else:
                request = ("build", slot, todo[w].popleft())
            self._workers[w][1].send(request)
            pending[w].append(slot)
            return True

        try:
            while state["active"] and state["taken"] < steps:
                active = state["active"]
                for w in active:
                    while ask(w):
                        pass
                w = active[state["turn"] % len(active)]
                # every slot of w is with the consumer: wait for one; none left: w is done
                if not pending[w] and not ask(w, block=True):
                    active.remove(w)
                    continue
                if stop.is_set():
                    raise _Stopped
                status, slot, layout, position = self._receive(w, pending[w])
                if status != "ok":  # this worker's stream is done
                    while pending[w]:
                        self._receive(w, pending[w])
                    active.remove(w)
                    continue
                state["turn"] += 1
                state["taken"] += 1
                if stream:  # where the whole stream stands once this is consumed
                    state["streams"][w] = position
                    position = {**state, "streams": dict(state["streams"]), "active": [*active]}
                batch = from_layout(self._buffers[(w, slot)], layout)
                yield self._handoff(batch, lambda w=w, s=slot: free[w].put(s), position)
        finally:
            for w in range(workers):  # answers still out (a pass ended early): dropped
                while pending[w] and self._workers:
                    try:
                        self._receive(w, pending[w])
                    except DataWorkerError:
                        break

    def _receive(self, w: int, pending: deque) -> tuple[str, int, dict | None, object]:
        """The next answer of worker ``w`` (to the oldest request in ``pending``); keeps
        the worker's new arena buffer; raises what the worker raised."""
        process, conn = self._workers[w]
        try:
            while not conn.poll(POLL_SECONDS):
                if not process.is_alive():
                    raise EOFError
            status, slot, layout, extra, position = conn.recv()
        except (EOFError, OSError):
            process.join(timeout=5)
            code = process.exitcode
            self._stop_workers()  # the next pass starts new ones
            raise DataWorkerError(
                f"data worker {w} exited unexpectedly (exit code {code}; killed for "
                "memory?); lower train.num_workers or train.prefetch"
            ) from None
        expected = pending.popleft()
        if slot != expected:
            raise DataWorkerError(f"data worker {w} answered slot {slot}, not {expected}")
        if status == "ok" and extra is not None:
            self._buffers[(w, slot)] = extra.numpy()
        if status == "error":
            if isinstance(layout, UserError):
                raise layout
            raise DataWorkerError(f"data worker {w} failed:\n{extra}") from (
                layout if isinstance(layout, BaseException) else None
            )
        return status, slot, layout, position

    def _in_thread(self, produced: Iterator, stop: threading.Event) -> Iterator:
        """``produced`` run by a thread, a few items ahead of the consumer."""
        items: queue.Queue = queue.Queue(maxsize=max(1, self.prefetch) * max(1, self.num_workers))
        done = object()

        def put(item) -> bool:
            while True:
                try:
                    items.put(item, timeout=POLL_SECONDS)
                    return True
                except queue.Full:
                    if stop.is_set():
                        return False

        def run():
            try:
                for item in produced:
                    if not put(item):
                        if item[1] is not None:
                            item[1]()
                        return
                put(done)
            except _Stopped:
                pass
            except BaseException as exc:  # noqa: BLE001 - raised again in the consumer
                put(exc)
            finally:
                produced.close()

        thread = threading.Thread(target=run, name="vse-batches", daemon=True)
        thread.start()
        try:
            while True:
                item = items.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while thread.is_alive() or not items.empty():
                try:  # free what the producer still queued, so that it can stop
                    item = items.get(timeout=0.05)
                except queue.Empty:
                    continue
                if isinstance(item, tuple) and item[1] is not None:
                    item[1]()
            thread.join()
