"""kvflow inside serving engines: ``vllm/`` (the KV connector, its two sides, KV events).

May import: anything but ``kvflow.cli``.
"""
