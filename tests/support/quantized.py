"""Quantization formats written out from their definitions, for tests/core/test_quantization.py: random codes and
scales encoded as each format stores them, and dequantized as each format defines it (no quantization
library). Every decoder takes a layer's tensors by suffix and returns its logical weight `[N, K]` in float32
(`[E, K, N]` for gpt-oss's MXFP4 experts), from the full tensors or from one rank's shards alike.

- FP8 block: code x scale of its block (`weight_scale_inv` `[ceil(N/bn), ceil(K/bk)]`); per channel or per
  tensor: code x scale.
- GPTQ (`qweight` `[K/8, N]`): code k of column n is nibble k % 8 (from the low bits) of word k // 8; zeros
  packed along N likewise; w = (code - (zero + 1)) x scale of group g_idx[k] (the gptq layout stores zero - 1).
- AWQ (`qweight` `[K, N/8]`): column 8j + c sits at bits [0, 16, 4, 20, 8, 24, 12, 28][c] of word j (AutoAWQ
  packs columns in the order 0 2 4 6 1 3 5 7); w = (code - zero) x scale of group k // g.
- compressed-tensors pack-quantized: codes (offset by 2^(bits-1)) packed from the low bits along K, zero points
  packed along N; w = (code - zero) x scale of group (g_idx[k] with act-order).
- NVFP4: E2M1 codes two per byte (low nibble first) x FP8 scale per 16 / weight_global_scale (compressed-tensors
  divides by the global scale).
- MXFP4: E2M1 codes two per byte x 2^(E8M0 - 127) per block of 32.
"""

from __future__ import annotations

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: slot i of a word holds column AWQ_PACK_ORDER[i]
AWQ_SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)  # vLLM's unpacking: column c of a word sits at this shift


def int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (held in int64) as the int32 the formats store."""
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)


def pack(codes: torch.Tensor, dim: int, bits: int = 4, order=None) -> torch.Tensor:
    """Codes (non-negative ints) packed into int32 words along `dim`, slot i of a word at bits [bits*i, ...),
    slot i holding code `order[i]` of the word's group (default: i)."""
    per = 32 // bits
    c = codes.long().movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    words = sum(c[..., (order or range(per))[i]] << (bits * i) for i in range(per))
    return int32(words).movedim(-1, dim).contiguous()


def unpack(words: torch.Tensor, dim: int, bits: int = 4, shifts=None) -> torch.Tensor:
    """The inverse of `pack`: code c of each word read at bits `shifts[c]` (default: bits * c)."""
    per = 32 // bits
    w = words.long().movedim(dim, -1) & 0xFFFFFFFF
    out = torch.stack([(w >> (shifts[c] if shifts else bits * c)) & (2**bits - 1) for c in range(per)], -1)
    return out.reshape(*w.shape[:-1], w.shape[-1] * per).movedim(-1, dim)


def fp8(shape, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * 4).to(torch.float8_e4m3fn)


def scales(shape, g: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    return (torch.rand(shape, generator=g) + 0.5).to(dtype)


def codes(shape, g: torch.Generator, high: int = 16) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=g)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expand(s: torch.Tensor, unit_n: int, unit_k: int, n: int, k: int) -> torch.Tensor:
    """A grid of scales, one per `unit_n` x `unit_k` block, as one scale per entry of an `[n, k]` weight."""
    return s.float().repeat_interleave(unit_n, 0).repeat_interleave(unit_k, 1)[:n, :k]


# --- FP8 stored whole ----------------------------------------------------------------------------------


def fp8_block_encode(n: int, k: int, g: torch.Generator, block=(128, 128)) -> dict:
    return {"weight": fp8((n, k), g), "weight_scale_inv": scales((cdiv(n, block[0]), cdiv(k, block[1])), g)}


def fp8_block_decode(t: dict, block=(128, 128)) -> torch.Tensor:
    w = t["weight"]
    return w.float() * expand(t["weight_scale_inv"], *block, *w.shape)


def fp8_channel_encode(n: int, k: int, g: torch.Generator) -> dict:
    return {"weight": fp8((n, k), g), "weight_scale": scales((n, 1), g, torch.bfloat16),
            "input_scale": scales((1,), g)}


def fp8_scaled_decode(t: dict) -> torch.Tensor:
    return t["weight"].float() * t["weight_scale"].float()  # [N, 1] per channel, [] per tensor: broadcast


def fp8_tensor_encode(n: int, k: int, g: torch.Generator) -> dict:
    return {"weight": fp8((n, k), g), "weight_scale": scales((), g), "input_scale": scales((), g)}


# --- GPTQ and AWQ -------------------------------------------------------------------------------------------


def gptq_encode(n: int, k: int, g: torch.Generator, group: int = 128, act_order: bool = False) -> dict:
    q, z = codes((k, n), g), codes((k // group, n), g, 15)
    g_idx = torch.arange(k) // group
    if act_order:  # columns quantized in a permuted order: a group's columns are spread over the input
        g_idx = g_idx[torch.randperm(k, generator=g)]
    return {"qweight": pack(q, 0), "qzeros": pack(z, 1), "scales": scales((k // group, n), g, torch.float16),
            "g_idx": g_idx.to(torch.int32)}


def gptq_decode(t: dict, group: int = 128, act_order: bool = False) -> torch.Tensor:
    q, z = unpack(t["qweight"], 0), unpack(t["qzeros"], 1)
    groups = t["g_idx"].long() if act_order else torch.arange(q.shape[0]) // group
    return ((q - (z[groups] + 1)) * t["scales"].float()[groups]).T


def awq_encode(n: int, k: int, g: torch.Generator, group: int = 128) -> dict:
    q, z = codes((k, n), g), codes((k // group, n), g)
    return {"qweight": pack(q, 1, order=AWQ_PACK_ORDER), "qzeros": pack(z, 1, order=AWQ_PACK_ORDER),
            "scales": scales((k // group, n), g, torch.float16)}


def awq_decode(t: dict, group: int = 128) -> torch.Tensor:
    q, z = unpack(t["qweight"], 1, shifts=AWQ_SHIFTS), unpack(t["qzeros"], 1, shifts=AWQ_SHIFTS)
    groups = torch.arange(q.shape[0]) // group
    return ((q - z[groups]) * t["scales"].float()[groups]).T


# --- compressed-tensors -------------------------------------------------------------------------------------


def ct_int4_encode(n: int, k: int, g: torch.Generator, group: int = 128, zero_point: bool = False,
                   act_order: bool = False) -> dict:
    out = {"weight_packed": pack(codes((n, k), g), 1), "weight_scale": scales((n, k // group), g, torch.bfloat16),
           "weight_shape": torch.tensor([n, k])}
    if zero_point:
        out["weight_zero_point"] = pack(codes((n, k // group), g), 0)
    if act_order:
        out["weight_g_idx"] = (torch.arange(k) // group)[torch.randperm(k, generator=g)].to(torch.int32)
    return out


def ct_int4_decode(t: dict, group: int = 128) -> torch.Tensor:
    q = unpack(t["weight_packed"], 1) - 8
    groups = t["weight_g_idx"].long() if "weight_g_idx" in t else torch.arange(q.shape[1]) // group
    z = unpack(t["weight_zero_point"], 0)[:, groups] - 8 if "weight_zero_point" in t else 0
    return (q - z) * t["weight_scale"].float()[:, groups]


def nvfp4_encode(n: int, k: int, g: torch.Generator) -> dict:
    c = codes((n, k), g)
    return {"weight_packed": (c[:, 0::2] | (c[:, 1::2] << 4)).to(torch.uint8),
            "weight_scale": (torch.rand((n, k // 16), generator=g) * 4 + 0.25).to(torch.float8_e4m3fn),
            "weight_global_scale": scales((1,), g) * 100, "input_global_scale": scales((1,), g) * 100}


def fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 values of bytes holding two codes each, the low nibble first, along the last dim."""
    p = packed.long()
    return E2M1[torch.stack([p & 0xF, p >> 4], -1).reshape(*p.shape[:-1], p.shape[-1] * 2)]


def nvfp4_decode(t: dict) -> torch.Tensor:
    v = fp4_codes(t["weight_packed"])
    return v * (t["weight_scale"].float() / t["weight_global_scale"]).repeat_interleave(16, 1)


# --- gpt-oss MXFP4 -------------------------------------------------------------------------------------------


def mxfp4_encode(e: int, n: int, k: int, g: torch.Generator) -> dict:
    c = codes((e, n, k // 32, 32), g)
    return {"blocks": (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8),
            "scales": torch.randint(120, 134, (e, n, k // 32), generator=g).to(torch.uint8)}


def mxfp4_decode(t: dict) -> torch.Tensor:
    v = fp4_codes(t["blocks"]) * torch.exp2(t["scales"].float() - 127)[..., None]
    return v.reshape(*v.shape[:-2], -1).transpose(-1, -2)  # [E, N, K] -> transformers' [E, K, N]
