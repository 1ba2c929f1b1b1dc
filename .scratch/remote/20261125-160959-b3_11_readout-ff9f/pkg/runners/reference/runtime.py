"""Device choice, determinism switches and progress printing shared by the subcommands."""

from __future__ import annotations

import os
import sys
import time

import torch

from runners.reference.config import ModelConfig
from runners.reference.model import DTYPES, Model


class UsageError(Exception):
    """Bad flags or environment: exit 2 with the message."""


class DeviceError(Exception):
    """The requested device is not there: exit 3 with the message."""


def setup_torch(device: str) -> str:
    """Turn on deterministic kernels and check the device; returns a description of it."""
    if device.startswith("cuda"):
        # cuBLAS needs this before its first call to be deterministic (and to let
        # use_deterministic_algorithms accept matmuls)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if not torch.cuda.is_available():
            raise DeviceError(
                f"--device {device}: this torch ({torch.__version__}) sees no CUDA/ROCm device; "
                "run with --device cpu or install a GPU build of torch on this host"
            )
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.use_deterministic_algorithms(True, warn_only=True)
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    if device != "cpu":
        raise UsageError(f"--device {device!r}: use cpu or cuda (a ROCm torch also reports cuda)")
    # The CPU kernels used here are deterministic already; use_deterministic_algorithms would
    # only add seconds of torch._inductor import to every run.
    return f"cpu ({torch.get_num_threads()} threads)"


def build_model(
    cfg: ModelConfig,
    model_seed: int,
    dtype: str,
    device: str,
    max_pos: int,
    *,
    copy_head: bool = False,
) -> Model:
    problems = cfg.problems()
    if problems:
        raise UsageError("model shape: " + "; ".join(problems))
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return Model(cfg, model_seed, DTYPES[dtype], device, max_pos, copy_head=copy_head)


class Progress:
    """Short flushed lines on stdout, each prefixed with the run's label."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        print(f"{self.label}: {msg}", file=sys.stdout, flush=True)


def checkpoints(total: int, every: int = 4) -> set[int]:
    """1-based counts at which a long loop reports: about ``every`` times, and at the end."""
    step = max(1, total // every)
    return {i for i in range(step, total + 1, step)} | {total}
