"""A small Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU, KV cache) with seeded weights.

Every operation keeps its reductions inside one row, so a row's result does not depend on how
many rows are computed with it. The aligned attention path presents each query row a key length
padded to a multiple of ``KV_PAD`` (-inf mask on the tail), taken from one contiguous K/V view, so
single-shot prefill and incremental decode run the same reductions on the same inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runners.reference.config import KV_PAD, Q_BLOCK, ModelConfig, pad_to

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class KVCache:
    """Per-layer K [kv_heads, capacity, head_dim] and V stored transposed [kv_heads, head_dim,
    capacity] (both GEMMs then reduce along a contiguous row, the fast layout here); zero beyond
    the written positions."""

    def __init__(self, cfg: ModelConfig, capacity: int, dtype: torch.dtype, device: str) -> None:
        k_shape = (cfg.kv_heads, capacity, cfg.head_dim)
        v_shape = (cfg.kv_heads, cfg.head_dim, capacity)
        self.k = [torch.zeros(k_shape, dtype=dtype, device=device) for _ in range(cfg.layers)]
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(cfg.layers)]
        self.capacity = capacity
        self.length = 0


@dataclass
class AttnPlan:
    """How one forward call reduces attention.

    aligned: keys padded to KV_PAD with a -inf mask, one contiguous view (else unpadded lengths).
    split_current: reduce cached keys and the current token separately, then merge (the
    unaligned decode path, and the split_kv injection).
    """

    aligned: bool = True
    split_current: bool = False


class Model:
    """Weights generated from a seed; forward over any number of new tokens with a KV cache."""

    def __init__(
        self,
        cfg: ModelConfig,
        model_seed: int,
        dtype: torch.dtype,
        device: str,
        max_pos: int,
        *,
        copy_head: bool = False,
    ) -> None:
        """copy_head: tie the LM head to a strong embedding, so each position's top-1 is the
        token it read (a greedy decode then repeats the prefill's top-1, as a well-read-out
        engine must for B3.11's prefill_last_top1 == decode0_top1 to hold)."""
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        gen = torch.Generator(device="cpu").manual_seed(model_seed)

        def weight(rows: int, cols: int, std: float) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, dtype=torch.float32) * std
            return w.to(dtype=dtype, device=device)

        d, hd, f = cfg.d_model, cfg.head_dim, cfg.ffn_dim
        self.embed = weight(cfg.vocab, d, 1.0)
        self.blocks = []
        for _ in range(cfg.layers):
            self.blocks.append(
                {
                    "wq": weight(cfg.heads * hd, d, d**-0.5),
                    "wk": weight(cfg.kv_heads * hd, d, d**-0.5),
                    "wv": weight(cfg.kv_heads * hd, d, d**-0.5),
                    "wo": weight(d, cfg.heads * hd, (cfg.heads * hd) ** -0.5),
                    "w_gate": weight(f, d, d**-0.5),
                    "w_up": weight(f, d, d**-0.5),
                    "w_down": weight(d, f, f**-0.5),
                    "attn_norm": self._norm_weight(gen),
                    "mlp_norm": self._norm_weight(gen),
                }
            )
        self.final_norm = self._norm_weight(gen)
        self.lm_head = weight(cfg.vocab, d, 3.0 * d**-0.5)
        if copy_head:
            self.embed = self.embed * 4
            self.lm_head = self.embed
        # One table for the whole run, same length in every mode, so each position's cos/sin is
        # computed identically whichever path asks for it.
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.rope_cos = torch.cos(angles).to(torch.float32).to(device)
        self.rope_sin = torch.sin(angles).to(torch.float32).to(device)
        self.scale = 1.0 / math.sqrt(hd)

    def _norm_weight(self, gen: torch.Generator) -> torch.Tensor:
        w = 1.0 + 0.1 * torch.randn(self.cfg.d_model, generator=gen, dtype=torch.float32)
        return w.to(self.device)

    # -- building blocks -------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        ms = (xf * xf).mean(dim=-1, keepdim=True)
        # sqrt and division are correctly rounded on every path (rsqrt may not be)
        return (xf / torch.sqrt(ms + self.cfg.norm_eps) * w).to(self.dtype)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [M, heads, head_dim] -> rotated (NeoX halves), computed in fp32."""
        half = x.shape[-1] // 2
        cos = self.rope_cos[positions][:, None, :]
        sin = self.rope_sin[positions][:, None, :]
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(self.dtype)

    def _keys(self, kbuf: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Positions [lo, hi) of a K buffer as one contiguous [heads, hi-lo, hd] tensor."""
        group = self.cfg.heads // self.cfg.kv_heads
        return kbuf[:, lo:hi].repeat_interleave(group, dim=0).contiguous()

    def _values_t(self, vbuf: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Positions [lo, hi) of a transposed V buffer as contiguous [heads, hd, hi-lo]."""
        group = self.cfg.heads // self.cfg.kv_heads
        return vbuf[:, :, lo:hi].repeat_interleave(group, dim=0).contiguous()

    def _attend_block(
        self, q: torch.Tensor, k: torch.Tensor, v_t: torch.Tensor, q_pos: torch.Tensor
    ) -> torch.Tensor:
        """q [H, m, hd], k [H, L, hd], v_t [H, hd, L]; keys after each query's position: -inf."""
        length = k.shape[1]
        scores = torch.matmul(q, k.transpose(1, 2)).float() * self.scale
        key_pos = torch.arange(length, device=q.device)
        scores = scores.masked_fill(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(self.dtype)
        return torch.matmul(probs, v_t.transpose(1, 2))

    def _attend_split(
        self, q: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor, pos: int, aligned: bool
    ) -> torch.Tensor:
        """One query row at ``pos``: the cached keys [0, pos) and the current token are reduced
        apart (each with its own rounding to the model dtype) and then merged."""
        length = pad_to(pos, KV_PAD) if aligned else pos
        kc, vc_t = self._keys(kbuf, 0, length), self._values_t(vbuf, 0, length)
        k_cur, v_cur_t = self._keys(kbuf, pos, pos + 1), self._values_t(vbuf, pos, pos + 1)
        s_c = torch.matmul(q, kc.transpose(1, 2)).float() * self.scale
        key_pos = torch.arange(length, device=q.device)
        s_c = s_c.masked_fill(key_pos[None, None, :] >= pos, float("-inf"))
        m_c = s_c.amax(dim=-1, keepdim=True)
        e_c = torch.exp(s_c - m_c)
        l_c = e_c.sum(dim=-1, keepdim=True)
        o_c = torch.matmul((e_c / l_c).to(self.dtype), vc_t.transpose(1, 2))
        s_n = torch.matmul(q, k_cur.transpose(1, 2)).float() * self.scale
        m = torch.maximum(m_c, s_n)
        a_c = torch.exp(m_c - m) * l_c
        a_n = torch.exp(s_n - m)
        total = a_c + a_n
        merged = o_c.float() * (a_c / total) + v_cur_t.transpose(1, 2).float() * (a_n / total)
        return merged.to(self.dtype)

    def attention(
        self, li: int, q: torch.Tensor, cache: KVCache, start: int, plan: AttnPlan
    ) -> torch.Tensor:
        """q [H, M, hd] for positions start..start+M-1, whose K/V are already in the cache."""
        m_rows = q.shape[1]
        end = start + m_rows
        kbuf, vbuf = cache.k[li], cache.v[li]
        if plan.split_current:
            if m_rows != 1 or start == 0:
                raise ValueError("the split reduction is a decode path: one row after a prefix")
            return self._attend_split(q, kbuf, vbuf, start, plan.aligned)
        outs = []
        r0 = start
        while r0 < end:
            if plan.aligned:
                # rows whose padded key length is the same form one block: a row at position p
                # always sees pad_to(p + 1) keys, whatever else is computed with it
                length = pad_to(r0 + 1, KV_PAD)
                r1 = min(end, length)
            else:
                r1 = min(end, r0 + Q_BLOCK)
                length = r1
            q_pos = torch.arange(r0, r1, device=q.device)
            k, v_t = self._keys(kbuf, 0, length), self._values_t(vbuf, 0, length)
            outs.append(self._attend_block(q[:, r0 - start : r1 - start], k, v_t, q_pos))
            r0 = r1
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    # -- forward ---------------------------------------------------------------------------

    def forward(
        self, tokens: torch.Tensor, cache: KVCache, plan: AttnPlan, last_only: bool = False
    ) -> torch.Tensor:
        """Run tokens (ids, [M]) at positions cache.length.. and append their K/V to the cache.

        Returns the final hidden (before the final norm): [M, D], or [1, D] for the last token
        when ``last_only`` (the last layer then computes K/V for every row, everything else for
        the last row only: nothing else reaches the last row's logits).
        """
        cfg = self.cfg
        m_rows = tokens.shape[0]
        start = cache.length
        end = start + m_rows
        if end > cache.capacity:
            raise ValueError(f"KV cache capacity {cache.capacity} < {end} tokens")
        positions = torch.arange(start, end, device=self.device)
        x = self.embed[tokens]
        hd = cfg.head_dim
        linear = torch.nn.functional.linear
        for li, blk in enumerate(self.blocks):
            h = self.rms_norm(x, blk["attn_norm"])
            k = self.rope(linear(h, blk["wk"]).view(-1, cfg.kv_heads, hd), positions)
            v = linear(h, blk["wv"]).view(-1, cfg.kv_heads, hd)
            cache.k[li][:, start:end] = k.transpose(0, 1)
            cache.v[li][:, :, start:end] = v.permute(1, 2, 0)
            q_start = start
            if last_only and li == cfg.layers - 1 and m_rows > 1:
                x, h, q_start = x[-1:], h[-1:], end - 1
            rows = x.shape[0]
            q = self.rope(linear(h, blk["wq"]).view(rows, cfg.heads, hd), positions[-rows:])
            attn = self.attention(li, q.transpose(0, 1).contiguous(), cache, q_start, plan)
            attn = attn.transpose(0, 1).reshape(rows, cfg.heads * hd)
            x = x + linear(attn, blk["wo"])
            h = self.rms_norm(x, blk["mlp_norm"])
            gate = linear(h, blk["w_gate"])
            up = linear(h, blk["w_up"])
            x = x + linear(torch.nn.functional.silu(gate) * up, blk["w_down"])
        cache.length = end
        return x

    def final_norm_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.rms_norm(hidden, self.final_norm)

    def lm_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[M, D] normed hidden -> [M, vocab] float32 logits (the GEMM runs in the model dtype)."""
        return torch.nn.functional.linear(normed, self.lm_head).float()


def prompt_ids(seed: int, length: int, vocab: int) -> list[int]:
    """The prompt token ids of a seed: the same list in every mode and on every device."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()
