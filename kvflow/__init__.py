"""kvflow: an event-sourced KV-cache offload engine between accelerator and host memory.

``import kvflow`` imports only the pure core (no torch): events, state, decisions, log.
"""

from kvflow._version import __version__

__all__ = ["__version__"]
