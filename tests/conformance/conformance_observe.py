"""The connector under test, observed: a subclass of it that records what it tells vLLM through
vLLM's connector API (and when), changing nothing.

vLLM builds the connector from ``kv_connector_module_path`` and ``kv_connector``: this module is
the path and ``ObservedConnector`` the name; the class it observes is the one
``KVFLOW_CONFORMANCE_CONNECTOR`` names (``module:Class``). Both sides of the connector (vLLM's
scheduler and its worker) run in the driving process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
one list, ``CALLS``, holds every call of both, in order: ``(seconds, call, request id or None,
details)``.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

CALLS: list[tuple[float, str, str | None, dict[str, Any]]] = []
_LAST_LOOKUP: dict[str, tuple[Any, bool, int]] = {}  # (vLLM asks a held request again every step)
INSTANCES: list[Any] = []  # the connectors vLLM built (scheduler side, worker side)


def load_class(spec: str) -> type:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"a connector class is named as module:Class, got {spec!r}")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def _record(call: str, request_id: str | None, **details: Any) -> None:
    CALLS.append((time.monotonic(), call, request_id, details))


def observed(base: type) -> type:
    """``base`` with its answers to vLLM recorded."""

    class Observed(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            INSTANCES.append(self)

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            answer = super().get_num_new_matched_tokens(request, num_computed_tokens)
            tokens, load_async = answer
            seen = (tokens, bool(load_async), num_computed_tokens)
            if _LAST_LOOKUP.get(request.request_id) == seen:
                return answer  # recorded: the first answer of each run of equal ones
            _LAST_LOOKUP[request.request_id] = seen
            _record("lookup", request.request_id, tokens=tokens, load_async=bool(load_async),
                    computed=num_computed_tokens)  # fmt: skip
            return answer

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            ids = [int(b) for b in blocks.get_block_ids()[0]] if blocks is not None else []
            _record("alloc", request.request_id, block_ids=ids, external=num_external_tokens)
            super().update_state_after_alloc(request, blocks, num_external_tokens)

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            preempted = sorted(scheduler_output.preempted_req_ids or ())
            if preempted:
                _record("preempted", None, requests=preempted)
            return super().build_connector_meta(scheduler_output)

        def request_finished(self, request: Any, block_ids: list[int]) -> Any:
            answer = super().request_finished(request, block_ids)
            _record("finished", request.request_id, delay_free=bool(answer[0]))
            return answer

        def get_finished(self, finished_req_ids: set[str]) -> Any:
            sending, recving = super().get_finished(finished_req_ids)
            if sending or recving:
                _record("get_finished", None, sending=sorted(sending or ()), recving=sorted(recving or ()))
            return sending, recving

        def get_block_ids_with_load_errors(self) -> set[int]:
            errors = super().get_block_ids_with_load_errors()
            if errors:
                _record("load_errors", None, block_ids=sorted(int(b) for b in errors))
            return errors  # type: ignore[no-any-return]

        def reset_cache(self) -> Any:
            answer = super().reset_cache()
            _record("reset", None, answer=answer)
            return answer

        def shutdown(self) -> None:
            started = time.monotonic()
            super().shutdown()
            _record("shutdown", None, seconds=time.monotonic() - started)

    Observed.__name__ = Observed.__qualname__ = f"Observed{base.__name__}"
    return Observed


_SPEC = os.environ.get("KVFLOW_CONFORMANCE_CONNECTOR")
if _SPEC:
    ObservedConnector = observed(load_class(_SPEC))
