"""Adapters that run kvflow inside serving engines (``kvflow.integrations.vllm``)."""
