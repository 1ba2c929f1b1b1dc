"""Shape of the reference model and the padding rule; no torch here, so flags parse fast."""

from __future__ import annotations

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
