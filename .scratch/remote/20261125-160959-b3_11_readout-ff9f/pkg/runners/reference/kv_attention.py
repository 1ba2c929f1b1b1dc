"""The 03C attention op (seed 002): the deterministic KV policy, checked on every call and kept.

The op is ggml_flash_attn_ext's contract on synthetic tensors. Each call gets the query rows of
one step (N new tokens at positions start..start+N-1), one contiguous view of the KV cache
(positions 0..L-1, the same buffer and order whichever flow wrote it), an optional mask
[PAD(N, 64), L] (0 visible, -inf hidden, as llama-graph builds it), ALiBi slopes and sinks.

Why the last token's output is the same bytes in every flow, by construction:
- the view at the last token is pad(P, 256) long in every flow (the policy), with the padded
  tail at -inf, so every flow reduces over the same keys in the same order;
- query rows go through the GEMMs in tiles of a fixed Q_TILE rows (zero rows pad a short step),
  so every GEMM of a cell has one shape, [Q_TILE * group, D] x [D, L], whatever the number of
  rows a flow computes at once (GEMM kernels pick their reduction order by shape: fp32 GEMMs on
  this CPU gave other bits for M < 4 than for M >= 4);
- softmax, bias and mask are per row and elementwise; cached and current tokens are one
  reduction (no split).

A call that breaks the policy raises PreconditionError naming the rule and the fix.
"""

from __future__ import annotations

import math

import torch

FATTN_KQ_STRIDE = 256  # the KV length presented to attention is a multiple of this
GGML_KQ_MASK_PAD = 64  # the mask's rows are padded to a multiple of this (and at least N)
Q_TILE = 8  # query rows per GEMM; divides GGML_KQ_MASK_PAD, so a padded mask covers every tile
ALIBI_MAX_BIAS = 8.0

RULE_KV_STRIDE = "kv_stride_256"
RULE_MASK_PAD = "mask_pad_64"


def pad(n: int, multiple: int) -> int:
    """n rounded up to a multiple (0 stays 0)."""
    return -(-n // multiple) * multiple


class PreconditionError(Exception):
    """The deterministic policy does not hold for this call: invariance cannot be promised."""

    def __init__(self, rule: str, message: str, fix: str) -> None:
        super().__init__(message)
        self.rule = rule
        self.message = message
        self.fix = fix
        self.where = ""


def check_policy(kv_len: int, n_rows: int, mask: torch.Tensor | None) -> None:
    """The seed's two shape rules, as fattn-common.cuh asserts them; raises PreconditionError."""
    if kv_len % FATTN_KQ_STRIDE:
        want = pad(kv_len, FATTN_KQ_STRIDE)
        raise PreconditionError(
            RULE_KV_STRIDE,
            f"the KV length presented to attention is {kv_len}, not a multiple of "
            f"FATTN_KQ_STRIDE ({FATTN_KQ_STRIDE})",
            f"pad the KV view to {want} (a KV cache of a multiple of {FATTN_KQ_STRIDE} cells, the "
            f"tail masked with -inf), or enable deterministic mode (GGML_DETERMINISTIC=1), "
            f"which pads it",
        )
    if mask is None:
        return
    rows, cols = int(mask.shape[0]), int(mask.shape[1])
    want_rows = pad(n_rows, GGML_KQ_MASK_PAD)
    if rows != want_rows or cols != kv_len:
        raise PreconditionError(
            RULE_MASK_PAD,
            f"the KQ mask is [{cols}, {rows}] for N={n_rows} query rows; it must be "
            f"[KV, PAD(N, {GGML_KQ_MASK_PAD})] = [{kv_len}, {want_rows}]",
            f"pad the mask's rows to a multiple of {GGML_KQ_MASK_PAD} (at least N), the padding "
            f"at -inf, or enable deterministic mode (GGML_DETERMINISTIC=1), which builds it so",
        )


def alibi_slopes(heads: int, max_bias: float = ALIBI_MAX_BIAS) -> torch.Tensor:
    """ggml's ALiBi slope per head (ggml_compute_forward_soft_max / flash_attn_ext)."""
    n_log2 = 2 ** math.floor(math.log2(heads))
    m0 = 2.0 ** (-max_bias / n_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_log2)
    slopes = [m0 ** (h + 1) if h < n_log2 else m1 ** (2 * (h - n_log2) + 1) for h in range(heads)]
    return torch.tensor(slopes, dtype=torch.float32)


def build_mask(
    n_rows: int, kv_len: int, start: int, written: int, rows: int, device: torch.device
) -> torch.Tensor:
    """[rows, kv_len] float32: 0 where key j is visible to query row i (j <= start + i and
    j < written), -inf elsewhere; rows past n_rows (the padding) are -inf throughout."""
    q_pos = torch.arange(start, start + rows, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    hidden = (k_pos > q_pos) | (k_pos >= written)
    hidden[n_rows:] = True
    mask = torch.zeros(rows, kv_len, dtype=torch.float32, device=device)
    return mask.masked_fill_(hidden, float("-inf"))


def _grouped_matmul(a: torch.Tensor, b: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """a [B, H, T, X] by b [B, Hkv, X, Y] with query head h on kv head h // group ->
    [B, H, T, Y]; the group's rows are stacked into one GEMM of g*T rows."""
    batch, heads, tile, x = a.shape
    group = heads // kv_heads
    out = torch.matmul(a.reshape(batch, kv_heads, group * tile, x), b)
    return out.reshape(batch, heads, tile, out.shape[-1])


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    start: int,
    mask: torch.Tensor | None,
    slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    split_at: int = 0,
    tile: int = Q_TILE,
) -> torch.Tensor:
    """q [B, H, N, D] at positions start.., k/v [B, Hkv, L, D] (one view of the cache) ->
    [B, H, N, D] in q's dtype. split_at > 0 reduces keys [0, split_at) (the cached tokens) and
    [split_at, L) (the current ones) apart and merges them: what the policy forbids (a canary).
    tile: query rows per GEMM; 0 computes all N rows in one GEMM (the natural shape, which
    bench/bench_kv_invariance.py compares with the fixed tile)."""
    batch, heads, n_rows, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    check_policy(kv_len, n_rows, mask)
    scale = 1.0 / math.sqrt(dim)
    k_t = k.transpose(-1, -2)
    k_pos = torch.arange(kv_len, dtype=torch.float32, device=q.device)
    size = tile if tile > 0 else n_rows
    outs = []
    for t0 in range(0, n_rows, size):
        rows = min(size, n_rows - t0)
        block = torch.zeros(batch, heads, size, dim, dtype=q.dtype, device=q.device)
        block[:, :, :rows] = q[:, :, t0 : t0 + rows]
        scores = _grouped_matmul(block, k_t, kv_heads).float() * scale
        if slopes is not None:
            q_pos = torch.arange(
                start + t0, start + t0 + size, dtype=torch.float32, device=q.device
            )
            distance = (q_pos[:, None] - k_pos[None, :]).abs()
            scores = scores + slopes[:, None, None] * -distance
        if mask is not None:
            scores = scores + mask[t0 : t0 + size]
        if split_at > 0:
            out = _split_reduce(scores, v, sinks, split_at, kv_heads, q.dtype)
        else:
            out = _reduce(scores, v, sinks, kv_heads, q.dtype)
        outs.append(out[:, :, :rows])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _reduce(
    scores: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    kv_heads: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One softmax over every key (and the sink), one GEMM with V."""
    if sinks is not None:
        batch, heads, tile, _ = scores.shape
        sink = sinks[None, :, None, None].expand(batch, heads, tile, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return _grouped_matmul(probs.to(dtype).contiguous(), v, kv_heads)


def _partial(
    scores: torch.Tensor, v: torch.Tensor, kv_heads: int, dtype: torch.dtype, sink: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, sum of exp, normalised output) of one part of the keys."""
    m = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    e = torch.exp(scores - m)
    total = e.sum(dim=-1, keepdim=True) + torch.exp(sink - m)
    o = _grouped_matmul((e / total).to(dtype).contiguous(), v, kv_heads)
    return m, total, o.float()


def _split_reduce(
    scores: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    split_at: int,
    kv_heads: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Cached keys and current keys reduced apart, then merged (online-softmax rescale)."""
    batch, heads, tile, _ = scores.shape
    none = torch.full((batch, heads, tile, 1), float("-inf"), device=scores.device)
    sink = none if sinks is None else sinks[None, :, None, None].expand(batch, heads, tile, 1)
    m_c, l_c, o_c = _partial(scores[..., :split_at], v[:, :, :split_at], kv_heads, dtype, sink)
    m_n, l_n, o_n = _partial(scores[..., split_at:], v[:, :, split_at:], kv_heads, dtype, none)
    m = torch.maximum(m_c, m_n)
    a_c = torch.exp(m_c - m) * l_c
    a_n = torch.exp(m_n - m) * l_n
    return ((o_c * a_c + o_n * a_n) / (a_c + a_n)).to(dtype)
