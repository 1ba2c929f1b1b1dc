"""Determinism profiles: environment variables that make GPU runs repeatable."""

from __future__ import annotations

from typing import Any

from runners.templates import render_plain

PROFILES: dict[str, dict[str, str]] = {
    "rocm": {"HIP_LAUNCH_BLOCKING": "1", "AMD_SERIALIZE_KERNEL": "3", "HSA_ENABLE_SDMA": "0"},
    "cuda": {"CUDA_LAUNCH_BLOCKING": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
    # Each CPU BLAS on one thread: a threaded sum splits in an order set by the thread count.
    "cpu": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
    "none": {},
}


def cell_env(preset_data: dict[str, Any], values: dict[str, Any]) -> dict[str, str]:
    """The profile's variables, then the preset's determinism.env and engine.env, rendered per cell."""
    return _env(preset_data, lambda value: render_plain(value, values))


def run_env(preset_data: dict[str, Any]) -> dict[str, str]:
    """The run's environment as the preset writes it: per-cell values stay {placeholders}."""
    return _env(preset_data, lambda value: value)


def _env(preset_data: dict[str, Any], fill: Any) -> dict[str, str]:
    env = dict(PROFILES[preset_data["determinism"]["profile"]])
    for section in ("determinism", "engine"):
        for name, value in preset_data[section]["env"].items():
            env[name] = fill(str(value))
    return env
