"""The event log: where the engine records its commands and events.

- ``protocol``: ``Log``, what the manager records into (each of the logs below is one);
- ``memory``: ``NullLog`` (keeps nothing) and ``MemoryLog`` (a list: tests, tools, short runs);
- ``format``: the trace file's records, header and record chain;
- ``writer``: ``TraceWriter``, a crash-safe trace file written off the engine's thread;
- ``reader``: ``TraceReader`` and ``read_trace``, the streaming reader of every trace version;
- ``source`` (plain or gzip bytes), ``problems`` (decode errors), ``ranges`` (the integers a
  live engine could have recorded): what the reader checks in each line.

May import: ``kvflow.core``.
"""
