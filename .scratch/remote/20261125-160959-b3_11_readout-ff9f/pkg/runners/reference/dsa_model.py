"""A small decoder whose attention layers carry DeepSeek-V3.2-Exp's lightning indexer (DSA).

The indexer follows inference/model.py of deepseek-ai/DeepSeek-V3.2-Exp:

    q = wq_b(qr)                       per index head, [rope | nope] split, RoPE on the leading
    k = LayerNorm(wk(x))               rope_head_dim dims of q and k, not interleaved (halves)
    w = weights_proj(x) * n_heads^-1/2 * head_dim^-1/2
    I(t, s) = sum_h w(t, h) * ReLU(q(t, h) . k(s))        for s < end_pos (causal)
    topk_indices = I.topk(min(index_topk, end_pos), sorted=False)

What the demo adds and this model leaves out, because none of it changes which positions are
selected beyond rounding: the fp8 quantisation of q and k (its q_scale factor) and the Hadamard
rotate_activation (an orthonormal transform: q.k is unchanged). Attention in decode sees only the
selected positions (-inf elsewhere), as the demo's index_mask does; prefill adds the causal mask
to both the index score and the attention scores, and is never traced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

# hook(layer_id, topk_indices [B, k], topk_values [B, k]) for a traced decode step
IndexHook = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class DSAConfig:
    vocab: int = 4096
    dim: int = 64
    layers: int = 61
    heads: int = 2
    head_dim: int = 32
    q_lora_rank: int = 32
    index_heads: int = 4
    index_head_dim: int = 32
    rope_head_dim: int = 16
    index_topk: int = 2048
    inter_dim: int = 128
    max_seq_len: int = 16384
    rope_theta: float = 10000.0

    def problems(self) -> list[str]:
        out = []
        for name in ("vocab", "dim", "layers", "heads", "head_dim", "q_lora_rank"):
            if getattr(self, name) < 1:
                out.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("index_heads", "index_head_dim", "index_topk", "inter_dim", "max_seq_len"):
            if getattr(self, name) < 1:
                out.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.rope_head_dim < 2 or self.rope_head_dim % 2:
            out.append(f"--rope-head-dim must be even and >= 2, got {self.rope_head_dim}")
        elif self.rope_head_dim > self.index_head_dim:
            out.append(
                f"--rope-head-dim {self.rope_head_dim} > --index-head-dim {self.index_head_dim}"
            )
        if self.head_dim % 2:
            out.append(f"--head-dim must be even for RoPE, got {self.head_dim}")
        return out

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE: pairs (x[i], x[i + d/2]); x [..., S, H, d], cos/sin [S, d/2]."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def index_scores(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """I(t, s) = sum_h w(t, h) * ReLU(q(t, h) . k(s)): q [B,S,H,D], k [B,T,D], w [B,S,H] -> [B,S,T]."""
    logits = torch.einsum("bshd,btd->bsht", q, k).relu()
    score = torch.einsum("bsht,bsh->bst", logits, w)
    return score if mask is None else score + mask


class DSAModel:
    """Seeded float32 weights; forward over [B, S] tokens at start_pos with per-layer caches."""

    def __init__(
        self, cfg: DSAConfig, seed: int, device: str, max_batch: int, capacity: int = 0
    ) -> None:
        self.cfg = cfg
        self.device = device
        # positions the caches hold: what the run needs, at most --max-seq-len
        self.capacity = min(capacity or cfg.max_seq_len, cfg.max_seq_len)
        gen = torch.Generator(device="cpu").manual_seed(seed)

        def w(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=gen) * cols**-0.5).to(device)

        d, c = cfg.dim, cfg
        self.embed = (torch.randn(c.vocab, d, generator=gen)).to(device)
        self.layers = []
        for _ in range(c.layers):
            self.layers.append(
                {
                    "wq_a": w(c.q_lora_rank, d),
                    "wq": w(c.heads * c.head_dim, c.q_lora_rank),
                    "wk": w(c.heads * c.head_dim, d),
                    "wv": w(c.heads * c.head_dim, d),
                    "wo": w(d, c.heads * c.head_dim),
                    "w1": w(c.inter_dim, d),
                    "w3": w(c.inter_dim, d),
                    "w2": w(d, c.inter_dim),
                    "idx_wq_b": w(c.index_heads * c.index_head_dim, c.q_lora_rank),
                    "idx_wk": w(c.index_head_dim, d),
                    "idx_weights": w(c.index_heads, d),
                    "idx_k_norm_w": 1.0 + 0.1 * torch.randn(c.index_head_dim, generator=gen),
                    "idx_k_norm_b": 0.1 * torch.randn(c.index_head_dim, generator=gen),
                }
            )
        self.lm_head = w(c.vocab, d) * 4.0
        self.rope_attn = self._rope_table(c.head_dim)
        self.rope_index = self._rope_table(c.rope_head_dim)
        shape = (max_batch, self.capacity, c.heads, c.head_dim)
        self.k_cache = [torch.zeros(shape, device=device) for _ in range(c.layers)]
        self.v_cache = [torch.zeros(shape, device=device) for _ in range(c.layers)]
        ishape = (max_batch, self.capacity, c.index_head_dim)
        self.idx_k_cache = [torch.zeros(ishape, device=device) for _ in range(c.layers)]

    def _rope_table(self, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        ang = torch.arange(self.capacity, dtype=torch.float64)[:, None] * inv[None, :]
        return torch.cos(ang).float().to(self.device), torch.sin(ang).float().to(self.device)

    @staticmethod
    def rms(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def indexer(
        self, li: int, x: torch.Tensor, qr: torch.Tensor, start: int, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The lightning indexer of one layer: (topk values, topk indices), each [B, S, k]."""
        c, p = self.cfg, self.layers[li]
        bsz, seqlen, _ = x.shape
        end = start + seqlen
        cos, sin = self.rope_index[0][start:end], self.rope_index[1][start:end]
        q = (qr @ p["idx_wq_b"].T).view(bsz, seqlen, c.index_heads, c.index_head_dim)
        q_pe, q_nope = torch.split(q, [c.rope_head_dim, c.index_head_dim - c.rope_head_dim], -1)
        q = torch.cat([rope_halves(q_pe, cos, sin), q_nope], dim=-1)
        k = torch.nn.functional.layer_norm(
            x @ p["idx_wk"].T, (c.index_head_dim,), p["idx_k_norm_w"], p["idx_k_norm_b"], 1e-6
        )
        k_pe, k_nope = torch.split(k, [c.rope_head_dim, c.index_head_dim - c.rope_head_dim], -1)
        k_pe = rope_halves(k_pe.unsqueeze(2), cos, sin).squeeze(2)
        self.idx_k_cache[li][:bsz, start:end] = torch.cat([k_pe, k_nope], dim=-1)
        weights = (x @ p["idx_weights"].T) * c.index_heads**-0.5 * c.index_head_dim**-0.5
        score = index_scores(q, self.idx_k_cache[li][:bsz, :end], weights, mask)
        return score.topk(min(c.index_topk, end), dim=-1, sorted=False)

    def forward(self, tokens: torch.Tensor, start: int, hook: IndexHook | None) -> torch.Tensor:
        """tokens [B, S] at positions start..start+S-1 -> logits of the last position [B, vocab].

        `hook` sees each layer's selection only in decode (mask is None and seqlen == 1).
        """
        c = self.cfg
        bsz, seqlen = tokens.shape
        end = start + seqlen
        if end > self.capacity:
            raise ValueError(f"sequence of {end} tokens exceeds the KV capacity {self.capacity}")
        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, end), float("-inf"), device=self.device).triu_(start + 1)
        cos, sin = self.rope_attn[0][start:end], self.rope_attn[1][start:end]
        x = self.embed[tokens]
        for li, p in enumerate(self.layers):
            h = self.rms(x)
            qr = self.rms(h @ p["wq_a"].T)
            q = rope_halves((qr @ p["wq"].T).view(bsz, seqlen, c.heads, c.head_dim), cos, sin)
            k = rope_halves((h @ p["wk"].T).view(bsz, seqlen, c.heads, c.head_dim), cos, sin)
            self.k_cache[li][:bsz, start:end] = k
            self.v_cache[li][:bsz, start:end] = (h @ p["wv"].T).view(
                bsz, seqlen, c.heads, c.head_dim
            )
            values, indices = self.indexer(li, h, qr, start, mask)
            if hook is not None and mask is None and seqlen == 1:
                hook(li, indices[:, 0], values[:, 0])
            scores = torch.einsum("bshd,bthd->bsht", q, self.k_cache[li][:bsz, :end])
            scores = scores * c.head_dim**-0.5
            index_mask = torch.full((bsz, seqlen, end), float("-inf"), device=self.device)
            index_mask.scatter_(-1, indices, 0.0)
            if mask is not None:
                index_mask = index_mask + mask
            probs = (scores + index_mask.unsqueeze(2)).softmax(dim=-1)
            attn = torch.einsum("bsht,bthd->bshd", probs, self.v_cache[li][:bsz, :end])
            x = x + attn.reshape(bsz, seqlen, -1) @ p["wo"].T
            h = self.rms(x)
            x = x + (torch.nn.functional.silu(h @ p["w1"].T) * (h @ p["w3"].T)) @ p["w2"].T
        return self.rms(x[:, -1]) @ self.lm_head.T


def reference_topk(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int, end: int
) -> list[set[int]]:
    """An independent loop over the formula (float64, no einsum) for tests: one set per row."""
    out = []
    q64, k64, w64 = q.double(), k.double(), w.double()
    for b in range(q.shape[0]):
        scores = []
        for s in range(end):
            total = 0.0
            for h in range(q.shape[1]):
                total += float(w64[b, h]) * max(0.0, float((q64[b, h] * k64[b, s]).sum()))
            scores.append((total, s))
        scores.sort(key=lambda t: (-t[0], t[1]))
        out.append({s for _, s in scores[: min(topk, end)]})
    return out


def sample(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """Greedy (argmax) at temperature 0, else the demo's exponential-race sampling, seeded."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / max(temperature, 1e-5), dim=-1)
    noise = torch.empty_like(probs).exponential_(1, generator=gen)
    return probs.div_(noise).argmax(dim=-1)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else 0
