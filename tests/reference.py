"""Independent float64 references for attention, written without any graphc code.

Query head h reads KV head ``h // (Hq // Hkv)``; a per-head Python loop makes
the mapping explicit (``kv_head_of`` can be swapped to test other mappings).
"""

from __future__ import annotations

import numpy as np


def consecutive(h: int, hq: int, hkv: int) -> int:
    """torch.repeat_interleave order: query head h reads KV head h // group."""
    return h // (hq // hkv)


def tiled(h: int, hq: int, hkv: int) -> int:
    """The wrong (tile) order: query head h reads KV head h % n_kv."""
    return h % hkv


def ref_sdpa(q, k, v, causal=False, offset=None, mask=None, scale=None, kv_head_of=consecutive, window=None, softcap=None, bias=None):
    """softmax(masks(softcap(scale * q k^T) + bias)) v per query head, float64; fully masked rows give zeros.

    ``window``: query i sees keys i + offset - window < j <= i + offset (Mistral's sliding window).  ``bias``: an additive
    ``[B, 1|Hq, Sq|1, Sk]`` added to the scores (finite; hide keys with the bool ``mask``).
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    offset = sk - sq if offset is None else offset
    out = np.zeros((b, hq, sq, v.shape[3]))
    for h in range(hq):
        kv = kv_head_of(h, hq, hkv)
        s = q[:, h] @ k[:, kv].transpose(0, 2, 1) * scale  # [b, sq, sk]
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        if bias is not None:
            s = s + np.broadcast_to(np.asarray(bias, np.float64)[:, h if bias.shape[1] > 1 else 0], (b, sq, sk))
        keep = np.ones((b, sq, sk), bool)
        if causal:
            i = np.arange(sq)[:, None]
            j = np.arange(sk)[None, :]
            keep &= (j <= i + offset)[None]
            if window is not None:
                keep &= (j > i + offset - window)[None]
        if mask is not None:
            keep &= np.broadcast_to(mask[:, 0], (b, sq, sk))
        for bi in range(b):
            for qi in range(sq):
                row = s[bi, qi][keep[bi, qi]]
                if row.size == 0:
                    continue  # fully masked: zeros
                e = np.exp(row - row.max())
                p = np.zeros(sk)
                p[keep[bi, qi]] = e / e.sum()
                out[bi, h, qi] = p @ v[bi, kv]
    return out


def ref_linear(x, w, b=None):
    """torch.nn.Linear: x @ w.T + b, float64."""
    y = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    return y if b is None else y + b


def ref_layer(cfg, weights, x, memory=None, past_k=None, past_v=None, causal=None, kv_head_of=consecutive):
    """A full attention layer in float64; returns (out, present_k, present_v)."""
    memory = x if memory is None else memory
    causal = cfg.causal if causal is None else causal
    bsz, sq, _ = x.shape
    sk_new = memory.shape[1]
    hq, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.hd
    bias = (lambda n: weights.get(f"{n}.bias")) if cfg.bias else (lambda n: None)
    q = ref_linear(x, weights["q_proj.weight"], bias("q_proj")).reshape(bsz, sq, hq, d).transpose(0, 2, 1, 3)
    k = ref_linear(memory, weights["k_proj.weight"], bias("k_proj")).reshape(bsz, sk_new, hkv, d).transpose(0, 2, 1, 3)
    v = ref_linear(memory, weights["v_proj.weight"], bias("v_proj")).reshape(bsz, sk_new, hkv, d).transpose(0, 2, 1, 3)
    p = 0
    if past_k is not None:
        p = past_k.shape[2]
        k = np.concatenate([past_k, k], axis=2)
        v = np.concatenate([past_v, v], axis=2)
    o = ref_sdpa(q, k, v, causal=causal, offset=p, scale=cfg.softmax_scale, kv_head_of=kv_head_of)
    o = o.transpose(0, 2, 1, 3).reshape(bsz, sq, hq * d)
    return ref_linear(o, weights["o_proj.weight"], bias("o_proj")), k, v
