"""The device adapter's decisions, tested with device-type strings (no torch-npu needed)."""

from __future__ import annotations

import subprocess
import sys
import types

from kvflow.executors.torch.npu import (
    event_state,
    memory_stats,
    stream_kwargs,
    task_queue_enabled,
    traits_for,
)


def test_npu_streams_have_no_priority_and_cuda_asks_for_the_lowest() -> None:
    assert stream_kwargs(traits_for("npu", {})) == {}
    assert stream_kwargs(traits_for("cuda", {})) == {"priority": 0}
    assert not traits_for("cpu", {}).has_streams and traits_for("npu", {}).has_streams


def test_task_queue_makes_the_completion_thread_synchronize() -> None:
    on = traits_for("npu", {})  # torch-npu's default: task queue on
    assert on.task_queue and on.wait_mode == "synchronize"
    for level in ("1", "2"):
        assert traits_for("npu", {"TASK_QUEUE_ENABLE": level}).wait_mode == "synchronize"
    off = traits_for("npu", {"TASK_QUEUE_ENABLE": "0"})
    assert not off.task_queue and off.wait_mode == "query"
    assert task_queue_enabled({}) and not task_queue_enabled({"TASK_QUEUE_ENABLE": "0"})
    assert traits_for("cuda", {}).wait_mode == "blocking"  # sleeps in the driver, no polling
    assert traits_for("cpu", {}).wait_mode == "inline"


def test_not_yet_is_never_a_failure() -> None:
    for device_type in ("npu", "cuda", "xpu"):
        traits = traits_for(device_type, {})
        assert event_state(traits, False) == "pending"
        assert event_state(traits, True) == "done"


def test_host_pinning_and_memory_stats_sources() -> None:
    assert traits_for("cuda", {}).pin_strategy == "cuda_host_register"
    assert traits_for("npu", {}).pin_strategy == "pin_memory"
    assert traits_for("cpu", {}).pin_strategy == "none"
    calls: list[tuple[str, object]] = []
    fake_torch = types.SimpleNamespace(
        npu=types.SimpleNamespace(memory_stats=lambda d: calls.append(("npu", d)) or {"a": 1}),
        accelerator=types.SimpleNamespace(
            memory_stats=lambda d: calls.append(("acc", d)) or {"b": 2}
        ),
    )
    assert memory_stats(fake_torch, "npu:0", traits_for("npu", {})) == {"a": 1}
    assert memory_stats(fake_torch, "cuda:0", traits_for("cuda", {})) == {"b": 2}
    assert memory_stats(fake_torch, "cpu", traits_for("cpu", {})) == {}
    assert calls == [("npu", "npu:0"), ("acc", "cuda:0")]


def test_unknown_accelerators_get_the_conservative_choices() -> None:
    t = traits_for("xpu", {})
    assert t.stream_priority is None and t.wait_mode == "synchronize"


def test_importing_executors_does_not_import_torch() -> None:
    code = (
        "import sys, kvflow.executors, kvflow.executors.torch.npu; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
