"""The project's own quantizers for the K types (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), which gguf-py lacks: round
to nearest after llama.cpp's scale search per sub-block (its `make_qkx2_quants` / `make_qx_quants`), blocks
packed in GGUF's layout. `gguf.quants.dequantize` and `QuantWeight.dequantize` read them back."""
from __future__ import annotations

import torch

ROWS_PER_CHUNK = 256  # bounds the search's working memory (21 candidates x the chunk's weights)


def quantize_k(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """(N, K) float, K a multiple of 256 -> (N, K / 256 * block bytes) uint8 blocks of `qtype`."""
    pack = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}[qtype]
    w = w.detach().float()
    if w.dim() != 2 or w.shape[1] % 256:
        raise ValueError(f"{qtype} needs rows of a multiple of 256 weights, not {tuple(w.shape)}")
    out = [pack(w[i:i + ROWS_PER_CHUNK].reshape(-1, 256)) for i in range(0, w.shape[0], ROWS_PER_CHUNK)]
    return torch.cat(out).reshape(w.shape[0], -1).contiguous()


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """(B,) float32 -> (B, 2) little-endian float16 bytes."""
    return x.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _weighted_affine(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of x (S, n): scale > 0 and offset >= 0 with x ~ scale * q - offset, q in 0..nmax, chosen
    as make_qkx2_quants does: 21 trial scales around (max - min) / nmax, each refit by weighted least
    squares (weights |x| + rms(x)), the one with the smallest weighted error kept."""
    weight = x.abs() + x.pow(2).mean(-1, keepdim=True).sqrt()
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True)
    span = (hi - lo).clamp(min=1e-30)
    steps = torch.arange(21, dtype=torch.float32).view(1, 21, 1) * 0.1 - 1.0  # rmin -1, rdelta 0.1
    iscale = (steps + nmax) / span.unsqueeze(1)  # (S, 21, 1)
    q = torch.round(iscale * (x - lo).unsqueeze(1)).clamp(0, nmax)  # (S, 21, 32)
    w = weight.unsqueeze(1)
    sw, swx = w.sum(-1), (w * x.unsqueeze(1)).sum(-1)
    swl, swl2, swlx = (w * q).sum(-1), (w * q * q).sum(-1), (w * q * x.unsqueeze(1)).sum(-1)
    det_raw = sw * swl2 - swl * swl
    det = det_raw.clamp(min=1e-30)
    scale = (sw * swlx - swx * swl) / det
    offset = (swl2 * swx - swl * swlx) / det  # x ~ scale * q + offset: offset <= 0 wanted
    # Where the refit wants a positive offset, or cannot tell scale from offset (all codes equal), the
    # offset is 0 and the scale refit alone.
    positive = (offset > 0) | (det_raw <= 1e-6 * sw * swl2)
    scale = torch.where(positive, swlx / swl2.clamp(min=1e-30), scale)
    offset = torch.where(positive, torch.zeros_like(offset), offset)
    err = (w * (scale.unsqueeze(-1) * q + offset.unsqueeze(-1) - x.unsqueeze(1)).pow(2)).sum(-1)
    best = err.argmin(-1, keepdim=True)
    scale, offset = scale.gather(1, best).squeeze(1), offset.gather(1, best).squeeze(1)
    flat = span.squeeze(1) <= 1e-30  # a constant sub-block: q = 0, offset = -x
    return torch.where(flat, torch.zeros_like(scale), scale), torch.where(flat, lo.squeeze(1), offset).neg()


def _six_bit(values: torch.Tensor, top: int = 63) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, n) non-negative -> super-block factor (B,) and codes 0..top (B, n) (six bits; Q2_K's four:
    top 15), values ~ factor * code."""
    factor = values.amax(-1) / top
    inv = torch.where(factor > 0, 1 / factor, torch.zeros_like(factor))
    return factor, torch.round(values * inv.unsqueeze(-1)).clamp(0, top).to(torch.uint8)


def _k_affine_codes(x: torch.Tensor, nmax: int):
    """Q4_K / Q5_K: (B, 256) -> d, dmin (B,) float16-rounded, scale and min codes (B, 8), q (B, 8, 32)."""
    b = x.shape[0]
    sub = x.reshape(b * 8, 32)
    scale, offset = _weighted_affine(sub, nmax)
    d, sc = _six_bit(scale.reshape(b, 8))
    dmin, mn = _six_bit(offset.reshape(b, 8))
    d, dmin = d.half().float(), dmin.half().float()
    step = (d.unsqueeze(-1) * sc.float()).reshape(b, 8, 1)
    low = (dmin.unsqueeze(-1) * mn.float()).reshape(b, 8, 1)
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    q = torch.round((x.reshape(b, 8, 32) + low) * inv).clamp(0, nmax).to(torch.uint8)
    return d, dmin, sc, mn, q


def _pack_k_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """8 six-bit scales and mins -> GGUF's 12 bytes (the inverse of quant.k_scales)."""
    out = torch.zeros(sc.shape[0], 12, dtype=torch.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _low_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(B, 8, 32) codes -> 128 bytes: chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high."""
    low = q & 15
    return (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(q.shape[0], 128)


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, sc, mn, q = _k_affine_codes(x, 15)
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), _low_nibbles(q)], dim=1)


def _q5_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, sc, mn, q = _k_affine_codes(x, 31)
    bits = ((q >> 4) & 1).to(torch.int32) << torch.arange(8, dtype=torch.int32).view(1, 8, 1)
    qh = bits.sum(1).to(torch.uint8)  # (B, 32): bit s of byte l is sub-block s, position l
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qh, _low_nibbles(q)], dim=1)


def _symmetric_codes(x: torch.Tensor, nmax: int, scale_max: int):
    """Q3_K / Q6_K: (B, 256) -> d (B,) float16-rounded, signed scale codes (B, 16) in -scale_max ..
    scale_max - 1 and codes q (B, 16, 16) in -nmax .. nmax - 1, x ~ d * scale * q per 16 weights. Each
    sub-block's scale: the best of 19 trial scales around max|x| / nmax by weighted least squares."""
    b = x.shape[0]
    sub = x.reshape(b * 16, 16)
    weight = sub.pow(2)
    idx = sub.abs().argmax(-1, keepdim=True)
    peak = sub.gather(1, idx)  # signed value of largest magnitude: maps to -nmax
    safe = torch.where(peak == 0, torch.ones_like(peak), peak)
    trials = torch.arange(-9, 10, dtype=torch.float32).view(1, 19, 1) * 0.1
    iscale = -(nmax + trials) / safe.unsqueeze(1)  # (S, 19, 1)
    q = torch.round(iscale * sub.unsqueeze(1)).clamp(-nmax, nmax - 1)
    w = weight.unsqueeze(1)
    sumlx, suml2 = (w * sub.unsqueeze(1) * q).sum(-1), (w * q * q).sum(-1)
    scale = torch.where(suml2 > 0, sumlx / suml2.clamp(min=1e-30), torch.zeros_like(sumlx))
    gain = scale * sumlx  # the weighted error falls by this much: maximise it
    best = gain.argmax(-1, keepdim=True)
    scale = torch.where(peak.squeeze(1) == 0, torch.zeros(b * 16), scale.gather(1, best).squeeze(1))
    scale = scale.reshape(b, 16)
    big = scale.gather(1, scale.abs().argmax(-1, keepdim=True))  # signed scale of largest magnitude
    inv = torch.where(big != 0, -scale_max / big, torch.zeros_like(big))
    sc = torch.round(inv * scale).clamp(-scale_max, scale_max - 1)
    d = torch.where(big != 0, 1 / inv, torch.zeros_like(inv)).squeeze(1).half().float()
    step = (d.unsqueeze(-1) * sc).unsqueeze(-1)  # (B, 16, 1)
    inv_step = torch.where(step != 0, 1 / step, torch.zeros_like(step))
    return d, sc, torch.round(x.reshape(b, 16, 16) * inv_step).clamp(-nmax, nmax - 1)


def _two_bit_bytes(q: torch.Tensor) -> torch.Tensor:
    """(B, 256) codes 0..3 -> Q2_K / Q3_K's 64 bytes: byte 32 h + l holds, at bits 2 s, the weight at
    128 h + 32 s + l (the inverse of quant._two_bits)."""
    q = q.reshape(q.shape[0], 2, 4, 32).to(torch.uint8)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(q.shape[0], 64)


def _q2_k(x: torch.Tensor) -> torch.Tensor:
    """16 sub-blocks of 16, x ~ d * scale * q - dmin * min with q in 0..3 and four-bit scales and mins."""
    b = x.shape[0]
    scale, offset = _weighted_affine(x.reshape(b * 16, 16), 3)
    d, sc = _six_bit(scale.reshape(b, 16), 15)
    dmin, mn = _six_bit(offset.reshape(b, 16), 15)
    d, dmin = d.half().float(), dmin.half().float()
    step = (d.unsqueeze(-1) * sc.float()).reshape(b, 16, 1)
    low = (dmin.unsqueeze(-1) * mn.float()).reshape(b, 16, 1)
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    q = torch.round((x.reshape(b, 16, 16) + low) * inv).clamp(0, 3)
    return torch.cat([sc | (mn << 4), _two_bit_bytes(q), _f16_bytes(d), _f16_bytes(dmin)], dim=1)


def _q3_k(x: torch.Tensor) -> torch.Tensor:
    """16 sub-blocks of 16, q in -4..3 (stored + 4: two bits, and the third in the high mask), six-bit
    scales stored + 32, a float16 super-block factor."""
    b = x.shape[0]
    d, sc, q = _symmetric_codes(x, 4, 32)
    u = (q + 4).to(torch.uint8).reshape(b, 8, 32)  # [sub-block j, position l]
    hmask = ((u >> 2).to(torch.int32) << torch.arange(8, dtype=torch.int32).view(1, 8, 1)).sum(1).to(torch.uint8)
    s = (sc + 32).to(torch.uint8)  # (B, 16), 0..63
    low = (s[:, :8] & 15) | ((s[:, 8:] & 15) << 4)
    high = s >> 4  # two bits of scale i go to byte 8 + i % 4, bits 2 (i / 4)
    high = high[:, 0:4] | (high[:, 4:8] << 2) | (high[:, 8:12] << 4) | (high[:, 12:16] << 6)
    return torch.cat([hmask, _two_bit_bytes(u & 3), low, high, _f16_bytes(d)], dim=1)


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    """16 sub-blocks of 16, q in -32..31 (stored + 32), int8 scales, a float16 super-block factor."""
    b = x.shape[0]
    d, sc, q = _symmetric_codes(x, 32, 128)
    q = (q + 32).to(torch.uint8).reshape(b, 2, 4, 32)  # [half, group of 32 within the half, position]
    low, high = q & 15, q >> 4
    ql = torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], dim=-1)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return torch.cat([ql.reshape(b, 128), qh.reshape(b, 64), sc.to(torch.int8).view(torch.uint8),
                      _f16_bytes(d)], dim=1)
