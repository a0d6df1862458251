"""``Engine``: the asyncio (anyio) engine. One task group owns the completion pump and the
trace writer; completions cross from the executor through one bounded memory stream; every
decision is the wrapped ``SyncEngine``'s, run on the caller's task."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvflow.core.commands import JobResult
from kvflow.core.config import Config
from kvflow.engine.manager import OffloadManager
from kvflow.engine.notices import StepReport, merge_reports
from kvflow.engine.protocols import Executor
from kvflow.engine.sync import SyncEngine
from kvflow.engine.watch import Counters, Latencies

P = ParamSpec("P")
R = TypeVar("R")


def _forward(method: Callable[Concatenate[SyncEngine, P], R]) -> Callable[Concatenate[Engine, P], R]:
    """A method of Engine that calls the same method of its SyncEngine (``self.core``)."""

    def forwarded(self: Engine, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(self.core, *args, **kwargs)

    forwarded.__name__ = method.__name__
    forwarded.__qualname__ = f"Engine.{method.__name__}"
    forwarded.__doc__ = method.__doc__
    return forwarded


class Engine(AbstractAsyncContextManager["Engine"]):
    """The asyncio engine: ``async with Engine(config, executor) as engine: ...``.

    A task group owns a completion pump (polls the executor, sends results through a bounded
    memory stream) and, when recording, a trace writer that writes from a worker thread.
    All decisions run on the event loop, in the caller's task, in call order.
    """

    def __init__(
        self,
        config: Config,
        executor: Executor,
        *,
        clock: Callable[[], float] | None = None,
        trace_path: str | None = None,
        trace_meta: dict[str, Any] | None = None,
        bytes_per_block: int = 0,
        poll_interval_s: float = 0.0005,
        flush_interval_s: float = 0.05,
        logger: Any = None,
    ) -> None:
        self.core = SyncEngine(
            config,
            executor,
            clock=clock,
            trace_path=trace_path,
            trace_meta=trace_meta,
            bytes_per_block=bytes_per_block,
            logger=logger,
            _auto_flush=False,
        )
        self.poll_interval_s = poll_interval_s
        self.flush_interval_s = flush_interval_s
        self._tg: Any = None
        self._send: Any = None
        self._recv: Any = None
        self._progress: Any = None

    # convenient pass-throughs
    @property
    def counters(self) -> Counters:
        return self.core.counters

    @property
    def latencies(self) -> Latencies:
        return self.core.latencies

    @property
    def manager(self) -> OffloadManager:
        return self.core.manager

    # The scheduling-time calls are the SyncEngine's, run on the caller's task.
    lookup = _forward(SyncEngine.lookup)
    accept_hits = _forward(SyncEngine.accept_hits)
    blocks_computed = _forward(SyncEngine.blocks_computed)
    device_blocks_evicting = _forward(SyncEngine.device_blocks_evicting)
    touch = _forward(SyncEngine.touch)
    finish_request = _forward(SyncEngine.finish_request)
    invalidate = _forward(SyncEngine.invalidate)
    reset = _forward(SyncEngine.reset)
    fences = _forward(SyncEngine.fences)
    held_device_blocks = _forward(SyncEngine.held_device_blocks)

    async def __aenter__(self) -> Engine:
        import anyio

        self._send, self._recv = anyio.create_memory_object_stream[list[JobResult]](max_buffer_size=256)
        self._progress = anyio.Event()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._tg.start(self._pump)
            if self.core.writer is not None:
                await self._tg.start(self._flusher)
        except BaseException:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        import anyio

        # The body's own exception is not the task group's business: cancel the group's
        # tasks, let them finish, and let the body's exception propagate unchanged (not
        # wrapped in an ExceptionGroup). A failure of the group's own tasks still surfaces.
        self._tg.cancel_scope.cancel()
        try:
            await self._tg.__aexit__(None, None, None)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                self._send.close()
                self._recv.close()
                writer = self.core.writer
                if writer is not None and not writer.closed:
                    blob = writer.take_pending()
                    await anyio.to_thread.run_sync(writer.write_bytes, blob)
                self.core.close()
        return None

    async def _pump(self, *, task_status: Any) -> None:
        import anyio

        task_status.started()
        while True:
            results = self.core.poll_executor()
            if results:
                await self._send.send(results)
                self._progress.set()
            await anyio.sleep(self.poll_interval_s)

    async def _flusher(self, *, task_status: Any) -> None:
        import anyio

        writer = self.core.writer
        assert writer is not None
        task_status.started()
        while True:
            await anyio.sleep(self.flush_interval_s)
            blob = writer.take_pending()
            if blob:
                await anyio.to_thread.run_sync(writer.write_bytes, blob)

    def _drain_stream(self) -> list[JobResult]:
        import anyio

        out: list[JobResult] = []
        while True:
            try:
                out.extend(self._recv.receive_nowait())
            except anyio.WouldBlock:
                return out

    async def step(self, compute_done: Any = None) -> StepReport:
        """One engine step (``SyncEngine.step``) with the completions the pump received."""
        return self.core.step(compute_done, results=self._drain_stream())

    async def wait_idle(self, timeout_s: float = 30.0) -> StepReport:
        """Step until no job is live; the merged report of every step taken."""
        import anyio

        merged = StepReport(now_ms=self.core.clock())
        with anyio.move_on_after(timeout_s):
            while True:
                report = await self.step()
                merge_reports(merged, report)
                if not self.core.has_live_jobs():
                    break
                self._progress = anyio.Event()
                with anyio.move_on_after(max(self.poll_interval_s * 4, 0.001)):
                    await self._progress.wait()
        merged.now_ms = self.core.clock()
        return merged

