"""kvflow as a vLLM KV connector.

- ``connector``: ``KVFlowConnector``, the class vLLM loads (``kv_connector_module_path``
  ``kvflow.integrations.vllm.connector``); it imports vLLM, the rest of this package does not;
- ``sides``: the scheduler side (decisions) and the worker side (copies), tested without vLLM;
- ``kv_events``: vLLM-compatible KV events derived from kvflow's events;
- ``kv_events_zmq``: those events on vLLM's ZMQ wire (``pip install 'kvflow[events]'``).

May import: ``kvflow.core``, ``kvflow.log``, ``kvflow.engine``, ``kvflow.executors``.
"""
