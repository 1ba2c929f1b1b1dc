"""Shape of the reference model and the padding rule; no torch here, so flags parse fast."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

KV_PAD = 256  # FATTN_KQ_STRIDE in seed 002: the KV length attention sees is a multiple of this
Q_BLOCK = 256  # query rows per attention block; one block shares one padded key length


def pad_to(n: int, multiple: int) -> int:
    """n rounded up to a multiple (at least one multiple)."""
    return max(multiple, -(-n // multiple) * multiple)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the reference model; all of it is recorded in each run's metadata."""

    vocab: int = 32000
    layers: int = 2
    d_model: int = 128
    heads: int = 4
    kv_heads: int = 2
    ffn_dim: int = 0  # 0: derived from d_model (8/3 * d_model rounded up to 64)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.ffn_dim == 0:
            object.__setattr__(self, "ffn_dim", pad_to(8 * self.d_model // 3, 64))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def problems(self) -> list[str]:
        """Human-readable reasons this shape cannot be built (empty when it can)."""
        out = []
        for name in ("vocab", "layers", "d_model", "heads", "kv_heads"):
            if getattr(self, name) < 1:
                out.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if out:
            return out
        if self.vocab < 2:
            out.append(f"--vocab must be >= 2 (top-2 needs two ids), got {self.vocab}")
        if self.d_model % self.heads:
            out.append(f"--d-model {self.d_model} is not a multiple of --heads {self.heads}")
        elif self.head_dim % 2:
            out.append(f"head_dim {self.head_dim} (d_model/heads) must be even for RoPE")
        if self.heads % self.kv_heads:
            out.append(f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}")
        return out

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["head_dim"] = self.head_dim
        d["kv_pad"] = KV_PAD
        return d


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model's shape, weights seed, dtype and device: flags every command shares."""
    d = ModelConfig()
    g = p.add_argument_group("model")
    g.add_argument("--vocab", type=int, default=d.vocab)
    g.add_argument("--layers", type=int, default=d.layers)
    g.add_argument("--d-model", type=int, default=d.d_model)
    g.add_argument("--heads", type=int, default=d.heads)
    g.add_argument("--kv-heads", type=int, default=d.kv_heads)
    g.add_argument("--ffn-dim", type=int, default=0, help="0: 8/3 d_model rounded up to 64")
    g.add_argument("--model-seed", type=int, default=0, help="seed of the weights")
    g.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (ROCm torch reports cuda)")


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab=args.vocab,
        layers=args.layers,
        d_model=args.d_model,
        heads=args.heads,
        kv_heads=args.kv_heads,
        ffn_dim=max(args.ffn_dim, 0),
    )
