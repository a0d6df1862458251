"""``kvflow simulate``: a workload through the real engine on a virtual clock.

- ``workload``: the Mooncake-format workload reader;
- ``run``: ``simulate`` and ``Simulation``, one instance (sequential or timed);
- ``fleet``: several instances sharing a simulated remote tier;
- ``capacity``: capacity in the user's terms: models' KV geometry, bytes per block, GB to blocks;
- ``example.jsonl``: the example workload that ships with kvflow (``kvflow simulate --example``).

May import: ``kvflow.core``, ``kvflow.log``, ``kvflow.engine``, ``kvflow.executors``,
``kvflow.tiers``.
"""
