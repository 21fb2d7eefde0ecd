"""AsyncEngine: the engine's step loop on its own thread, one async iterator of outputs per request.

Three threads meet here. The engine thread runs the steps (`Engine.core_step`) and nothing else; the output thread
turns each step's tokens into clients' outputs (detokenization, stop strings, `RequestOutput`s: the output
processor, model/engine/output_processor.py) and hands them to the event loops, one `call_soon_threadsafe` per loop
per step; the asyncio side never touches engine state: submissions and aborts go through an inbox the engine thread
drains between steps. A stop string the output thread finds comes back through the inbox too. vLLM v1 splits the
same way, with processes (EngineCore and the API server's output processor).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from model.engine.engine import Engine, EngineStats, FatalEngineError, RequestOutput
from model.engine.output_processor import Finish, StepOutputs
from model.engine.request import FinishReason, Sequence
from model.engine.sampling_params import SamplingParams
from model.engine.scheduler import QueueFullError
from model.engine.stream import bind_device
from model.engine.request_options import PLAIN, RequestOptions

log = logging.getLogger("llamascope.engine")


class EngineDeadError(RuntimeError):
    """The engine thread is not running (stopped, or crashed outside a step)."""


class EngineJob(Protocol):
    """Work that needs the model but is not a generation (an inspection): run on the engine thread one `step()`
    at a time, between two engine steps, each given a time budget, so serving keeps most of its rate."""

    def step(self, budget_s: float) -> bool:
        """Advance by about `budget_s` seconds of work; True when finished."""
        ...


# A job's share of the engine thread while requests are in flight: each serving step earns the job JOB_SHARE of
# that step's time as credit, and a job step runs only on credit, spending what it took (a token bucket, so the
# job's share holds even when one of its steps overshoots its budget: decoding keeps about 1 / (1 + JOB_SHARE) of
# its rate during any inspection). Credit is capped at a few steps' worth, so a job never bursts. When no request
# is in flight, a job runs in longer slices that still let a new request start within one.
JOB_SHARE = 0.5
MAX_JOB_CREDIT_STEPS = 4
IDLE_JOB_BUDGET_S = 0.05


# Engines started in this process, while they live: the interpreter's exit stops them (`_stop_started`).
_started: weakref.WeakSet["AsyncEngine"] = weakref.WeakSet()


@atexit.register
def _stop_started() -> None:
    """Stop every started engine and wait for its threads before the interpreter finalizes. Its threads are daemons
    (a program that never calls `stop` still exits), and a daemon thread still running then is halted wherever it
    next takes the GIL: mid-step, inside PyTorch's C++, the process aborts instead of exiting with its own status.
    Atexit functions run before daemon threads are halted (Python's Py_FinalizeEx). A server exits without
    finalizing (service/main.py `exit_now`), after its lifespan stopped the engine."""
    for engine in list(_started):
        engine.stop()


# ---- the inbox's messages (asyncio side -> engine thread) ---------------------------------------------------

@dataclass
class _Submit:
    """New requests, admitted together: (request id, prompt) pairs, their sampling, one options record each."""

    prompts: list[tuple[str, list[int]]]
    params: SamplingParams
    options: list[RequestOptions]
    submitted: asyncio.Future  # resolved by the engine thread: None, or the refusal


@dataclass
class _Abort:
    request_id: str


@dataclass
class _AbortAll:
    error: str  # each open choice ends with finish_reason "abort" and this error


@dataclass
class _Ended:
    """The output thread ended a choice (a stop string in its text, or its processing failed): the engine ends it."""

    seq: Sequence
    end: Finish


class _Call:
    """An EngineJob of one call on the engine thread (what only that thread may change: a feature's per-engine state)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def step(self, budget_s: float) -> bool:
        self.fn()
        return True


class _QueuedJob:
    def __init__(self, job: EngineJob, loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
        self.job, self.loop, self.done = job, loop, done
        self.cancelled = False  # set by the awaiting side when it leaves (client disconnect)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Submit | _Abort | _AbortAll | _Ended | _QueuedJob] = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue[StepOutputs | None] = queue.SimpleQueue()  # engine -> output thread
        self._output_thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards _streams and _num_pending
        self._num_pending = 0  # submitted sequences not yet seen by the engine thread
        self._stop = False
        self._dead = False  # set (under _lock) as the engine thread ends: nothing is accepted after it
        self._thread: threading.Thread | None = None
        # Called once, on the engine thread, when it ends for any reason but `stop()` (the service turns /health
        # 503 and, in a real server process, exits non-zero so the orchestrator restarts it).
        self.on_dead: Callable[[BaseException | None], None] | None = None
        # Observers of each step (metrics, tests): (stats snapshot, the step's outputs, seconds), on the engine thread.
        self.step_hooks: list[Callable[[EngineStats, StepOutputs, float], None]] = []
        # The engine's counters as the engine thread last published them (after every step and inbox drain): what
        # other threads read instead of walking the engine's live dicts while it changes them.
        self.stats: EngineStats = engine.stats()
        self._jobs: deque[_QueuedJob] = deque()  # engine thread only
        self._job_credit = 0.0  # seconds of engine time a job may use now (engine thread only)
        self._num_jobs = 0  # submitted and not finished (guarded by _lock)

    # ---- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        _started.add(self)
        self._output_thread = threading.Thread(target=self._output_loop, name="llamascope-output", daemon=True)
        self._output_thread.start()
        self._thread = threading.Thread(target=self._loop, name="llamascope-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the engine thread; every stream still open ends with EngineDeadError."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._dead

    # ---- requests -----------------------------------------------------------------------------------------

    async def add_requests(self, prompts: list[tuple[str, list[int]]], params: SamplingParams,
                           options: RequestOptions | list[RequestOptions] = PLAIN) -> list["RequestStream"]:
        """Submit several prompts (request id, token ids) with the same sampling, all in one inbox message, so the
        engine thread admits them in the same drain and they prefill together. `options` (what each carries beside
        prompt and sampling, model/engine/request_options.py): one for every prompt, or a list of one per prompt
        (the cells of an activation-patching sweep). All or nothing: ValueError (an invalid prompt), QueueFullError
        (the waiting queue is full) or EngineDeadError, and then none is queued. Returns one stream of outputs per
        prompt; closing a stream early aborts its request and frees its blocks."""
        each = options if isinstance(options, list) else [options] * len(prompts)
        if len(each) != len(prompts):
            raise ValueError(f"options: {len(each)} for {len(prompts)} prompts")
        loop = asyncio.get_running_loop()
        submitted: asyncio.Future = loop.create_future()  # resolved by the engine thread: None or an exception
        streams = [RequestStream(self, rid, params.n, loop) for rid, _ in prompts]
        n = params.n * len(prompts)
        with self._lock:
            if self._dead or self._thread is None:
                raise EngineDeadError("the engine is not running")
            waiting = self.stats.num_waiting + self._num_pending
            if waiting + n > self.engine.config.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({waiting} of {self.engine.config.max_waiting} sequences)")
            self._num_pending += n
            for stream in streams:
                self._streams[stream.request_id] = (loop, stream.queue)
        self._inbox.put(_Submit([(rid, list(ids)) for rid, ids in prompts], params, each, submitted))
        self._wake.set()
        try:
            await submitted  # re-raises the engine's ValueError / QueueFullError here
        except BaseException:  # refused, or the caller was cancelled while waiting: nothing may stay queued
            for stream in streams:
                stream.close()
            raise
        return streams

    @property
    def max_model_len(self) -> int:
        """The longest prompt + max_tokens the engine serves (the model's context, clamped to the KV pool)."""
        return self.engine.max_model_len

    def check(self, options: RequestOptions) -> None:
        """InvalidOption naming the request field this engine cannot serve (`Engine.check`: fixed configuration and
        the features' thread-safe caches only, so any thread may ask; a feature's check may compile what the request
        carries, so call it on a worker thread when it does)."""
        self.engine.check(options)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield each step's outputs for this request until every choice has finished.

        Raises ValueError (invalid request) or QueueFullError (waiting queue full) before the first output.
        Leaving the iterator early (client disconnect, cancellation) aborts the request and frees its blocks.
        """
        [stream] = await self.add_requests([(request_id or uuid.uuid4().hex, prompt_token_ids)], params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def run_job(self, job: EngineJob, max_queued: int | None = None) -> None:
        """Run `job` to completion on the engine thread, interleaved with serving steps; re-raises its exception.
        QueueFullError when `max_queued` jobs are already waiting or running. Cancelling the caller drops the job
        at its next step."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        with self._lock:
            if self._dead:
                raise EngineDeadError("the engine is not running")
            if max_queued is not None and self._num_jobs >= max_queued:
                raise QueueFullError(f"{self._num_jobs} inspections are already queued (the limit is {max_queued})")
            self._num_jobs += 1
        loop = asyncio.get_running_loop()
        queued = _QueuedJob(job, loop, loop.create_future())
        self._inbox.put(queued)
        self._wake.set()
        try:
            await queued.done
        finally:
            queued.cancelled = True  # a no-op once finished; otherwise the engine thread drops it
            with self._lock:
                self._num_jobs -= 1

    async def call_feature(self, name: str, method: str, *args) -> None:
        """A per-row feature's per-engine call (`Engine.feature(name).method(*args)`: loading an adapter), on the
        engine thread between steps; from the next step on it serves what it changed. Raises as the call does."""
        await self.run_job(_Call(lambda: getattr(self.engine.feature(name), method)(*args)))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))
        self._wake.set()

    def abort_all(self, error: str) -> None:
        """End every request in the engine now (graceful shutdown's deadline): each open choice finishes with
        finish_reason "abort" and `error`, so its stream ends cleanly instead of being cut."""
        self._inbox.put(_AbortAll(error))
        self._wake.set()

    # ---- engine thread ------------------------------------------------------------------------------------

    def _loop(self) -> None:
        error: BaseException | None = None
        try:
            bind_device(self.engine.cache.device)  # this thread's launches, events and captures on the model's device
            self._serve()
        except BaseException as e:  # noqa: BLE001 - whatever ends the thread, no client may be left waiting
            error = e
            log.critical("engine thread failed; ending every open request", exc_info=True)
        finally:
            with self._lock:
                self._dead = True  # from here on nothing is accepted, and `is_running` says so
            if (error is not None or not self._stop) and self.on_dead is not None:
                try:
                    self.on_dead(error)  # before the clients hear of it: /health is already 503 when they do
                except Exception:
                    log.exception("engine on_dead callback failed")
            self._outputs.put(None)  # what the engine produced goes out first, then the output thread ends
            if self._output_thread is not None:
                self._output_thread.join()
            self._end_everything("the engine stopped" if error is None else f"the engine failed: {type(error).__name__}")

    def _serve(self) -> None:
        while not self._stop:
            self._drain_inbox()
            ran_job = self._advance_job()
            if not self.engine.has_unfinished():
                if not ran_job:
                    self._wake.wait(0.5)
                    self._wake.clear()
                continue
            start = time.perf_counter()
            try:
                step = self.engine.core_step()
            except FatalEngineError:  # ends the thread: every client gets its error, the server exits
                raise
            except Exception:  # outside a step's own error handling: fail everything queued, keep the thread
                log.exception("engine step raised; failing all requests")
                step = StepOutputs()
                for rid in list(self.engine.requests):
                    step.finished.update(self.engine.abort_core(rid, FinishReason.ERROR, "the engine failed").finished)
            elapsed = time.perf_counter() - start
            self._job_credit = min(self._job_credit + JOB_SHARE * elapsed, MAX_JOB_CREDIT_STEPS * JOB_SHARE * elapsed)
            self.stats = self.engine.stats()
            if step:
                self._outputs.put(step)
            for hook in self.step_hooks:
                try:
                    hook(self.stats, step, elapsed)
                except Exception:  # an observer's bug (metrics) must not end serving
                    log.exception("engine step hook failed")

    def _output_loop(self) -> None:
        """The output thread: each step's outputs processed and handed to their event loops, in step order."""
        engine = self.engine
        while True:
            step = self._outputs.get()
            if step is None:
                return
            outs, ended = engine.output.process(step, time.perf_counter())
            for seq, end in ended:
                self._inbox.put(_Ended(seq, end))
            if ended:
                self._wake.set()
            self._dispatch(outs)

    def _end_everything(self, reason: str) -> None:
        """The engine thread is ending: refuse new work, and end every open stream, every submission it has not
        seen and every job with EngineDeadError, so no caller waits forever."""
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for loop, stream in streams:
            _call_soon(loop, stream.put_nowait, EngineDeadError(reason))
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(message, _Submit):
                _call_soon(message.submitted.get_loop(), _resolve, message.submitted, EngineDeadError(reason))
            elif isinstance(message, _QueuedJob):
                self._jobs.append(message)
        for queued in self._jobs:
            _call_soon(queued.loop, _resolve, queued.done, EngineDeadError(reason))
        self._jobs.clear()

    def _drain_inbox(self) -> None:
        drained = False
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                if drained:
                    self.stats = self.engine.stats()
                return
            drained = True
            if isinstance(message, _Submit):
                self._submit(message)
            elif isinstance(message, _Abort):
                self._output(self.engine.abort_core(message.request_id))
            elif isinstance(message, _Ended):
                self.engine.finish_by_output(message.seq, message.end)
            elif isinstance(message, _AbortAll):
                for rid in list(self.engine.requests):
                    self._output(self.engine.abort_core(rid, FinishReason.ABORT, message.error))
            else:
                self._jobs.append(message)

    def _submit(self, message: _Submit) -> None:
        added: list[str] = []
        result: BaseException | None = None
        try:
            for (request_id, prompt), options in zip(message.prompts, message.options):
                self.engine.add_request(request_id, prompt, message.params, options)
                added.append(request_id)
        except (ValueError, QueueFullError) as e:  # all or nothing: the caller sees one refusal
            result = e
            for request_id in added:
                self.engine.abort_core(request_id)  # refused: no client reads these
        with self._lock:
            self._num_pending -= message.params.n * len(message.prompts)
            gone = [rid for rid in added if rid not in self._streams]
        _call_soon(message.submitted.get_loop(), _resolve, message.submitted, result)
        for request_id in gone:  # the client left before we got to it
            self._output(self.engine.abort_core(request_id))

    def _output(self, step: StepOutputs) -> None:
        if step:
            self._outputs.put(step)


    def _advance_job(self) -> bool:
        """One step of the oldest job; False when there was none to run."""
        while self._jobs and self._jobs[0].cancelled:
            self._jobs.popleft()
        if not self._jobs:
            return False
        queued = self._jobs[0]
        busy = self.engine.has_unfinished()
        if busy and self._job_credit <= 0:
            return False  # serving steps first, until they have earned the job another slice
        budget = self._job_credit if busy else IDLE_JOB_BUDGET_S
        start = time.perf_counter()
        try:
            finished, error = queued.job.step(budget), None
        except Exception as e:  # the job's own failure (bad input found late, out of memory): its caller's error
            finished, error = True, e
        self._job_credit = self._job_credit - (time.perf_counter() - start) if busy else 0.0
        if finished:
            self._jobs.popleft()
            _call_soon(queued.loop, _resolve, queued.done, error)
        return True

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        """Each output onto its stream's queue: one hand-off per event loop (output thread)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outs:
                entry = self._streams.get(out.request_id)
                if entry is not None:
                    by_loop.setdefault(entry[0], []).append((entry[1], out))
        for loop, items in by_loop.items():
            if not _call_soon(loop, _deliver, items):  # its event loop has closed: nobody reads these streams again
                gone = {out.request_id for _, out in items}
                with self._lock:
                    for rid in gone:
                        self._streams.pop(rid, None)
                for rid in gone:
                    self.abort(rid)


def _deliver(items: list) -> None:
    """On the event loop: a step's outputs onto their streams' queues."""
    for q, out in items:
        q.put_nowait(out)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """`loop.call_soon_threadsafe`, False instead of an exception when the loop has closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


def _resolve(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


class RequestStream:
    """One engine request's outputs, in order, until each of its n choices has finished (an async iterator).
    EngineDeadError if the engine thread ends first. `close()` (idempotent) aborts the request if it is unfinished."""

    def __init__(self, engine: AsyncEngine, request_id: str, n: int, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.request_id, self.n = engine, request_id, n
        self.queue: asyncio.Queue = asyncio.Queue()
        self._finished_choices = 0
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed or self._finished_choices >= self.n:
            raise StopAsyncIteration
        out: RequestOutput | BaseException = await self.queue.get()
        if isinstance(out, BaseException):  # the engine thread ended with this request open
            self._closed = True
            raise out
        if out.finished:
            self._finished_choices += 1
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self.engine._lock:
            self.engine._streams.pop(self.request_id, None)
        if self._finished_choices < self.n:
            self.engine.abort(self.request_id)
