"""The engine: what a serving engine embeds. Decisions, an executor, a clock and a log.

- ``manager``: ``OffloadManager``, the decisions behind the engine API and the one scheduler
  step (``step``: results applied, timeouts, the jobs to hand over, the step's report);
- ``notices``: what the engine learns after the call that caused it (loads finished or failed,
  device blocks released, fences), and ``StepReport``, the notices with what a step did;
- ``protocols``: the ``Executor`` protocol and the abilities an executor may have (a host pool,
  its block size, a remote tier's probes), checked once when an engine is built;
- ``sync``: ``SyncEngine``, the façade for synchronous schedulers: the manager's step with an
  executor, a clock and a watch;
- ``async_engine``: ``Engine``, its asyncio (anyio) form;
- ``watch``: counters, latencies and logs from the applied events; fences and pins held too long;
- ``metrics``: Prometheus metrics from the counters (``pip install 'kvflow[metrics]'``).

Guarantees to the embedding engine: it never raises because a transfer failed (executor
exceptions become failed results, F2); every job is handed to the executor once (F5) and its
device blocks stay held until a report releases them; logging goes through structlog with stable
dotted event names, and the library never configures logging.

May import: ``kvflow.core`` and ``kvflow.log``.
"""
