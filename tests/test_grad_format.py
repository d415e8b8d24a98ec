"""qgZ's packed gradient format (runtime/quantization/grad_format.py), checked with an
independent pure-Python decoder, and the ops' argument checks."""

import math
import struct

import pytest
import torch
from grad_quant_common import C_BOUND, DEV, triton_ok

from zpp_compile.runtime.quantization import grad_format as gq_format
from zpp_compile.runtime.quantization import grad_ops as gq


def py_decode(buf: bytes, S: int, B: int, bits: int):
    """One packed piece -> (list of int codes [nb*B], list of float scales [nb])."""
    nb = -(-S // B)
    cb = nb * B * bits // 8
    codes = []
    for byte in buf[:cb]:
        if bits == 8:
            codes.append(byte - 256 if byte >= 128 else byte)
        else:
            for nib in (byte & 15, byte >> 4):
                codes.append(nib - 16 if nib >= 8 else nib)
    scales = list(struct.unpack(f"<{nb}f", buf[cb:cb + 4 * nb]))
    return codes, scales


def test_piece_bytes():
    assert gq.piece_bytes(1, 32, 4) == 16 + 4
    assert gq.piece_bytes(1, 32, 8) == 32 + 4
    assert gq.piece_bytes(4097, 256, 4) == 17 * 128 + 17 * 4
    assert gq.piece_bytes(4097, 256, 8) == 17 * 256 + 17 * 4
    assert gq.piece_bytes(100, 40, 4) == 3 * 20 + 12
    for S in (1, 7, 33, 4097):
        for B in (32, 40, 256):
            for bits in (4, 8):
                assert gq.piece_bytes(S, B, bits) % 4 == 0
    with pytest.raises(ValueError):
        gq.piece_bytes(10, 36, 4)     # not a multiple of 8
    with pytest.raises(ValueError):
        gq.piece_bytes(10, 24, 4)     # below 32
    with pytest.raises(ValueError):
        gq.piece_bytes(10, 32, 2)


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_layout_by_hand(bits):
    q = 7 if bits == 4 else 127
    B, S = 32, 40                     # two blocks, the second one 8 elements long
    x = torch.zeros(S)
    x[0], x[1], x[2], x[3] = 2.0 * q, -2.0 * q, 2.0, -3.0   # absmax 2q -> scale 2 exactly
    x[4] = 5.0                        # 2.5 -> rint half to even -> 2
    x[5] = 7.0                        # 3.5 -> 4
    x[32:40] = torch.tensor([0.0, 1, 2, 3, 4, 5, 6, float(q)])  # block 2: scale 1
    buf = torch.ops.zpp.qgz_quantize(x, 1, 1, bits, B)
    assert buf.dtype == torch.uint8 and buf.numel() == gq.piece_bytes(S, B, bits)
    codes, scales = py_decode(bytes(buf.tolist()), S, B, bits)
    assert scales == [2.0, 1.0]
    assert codes[:6] == [q, -q, 1, -2, 2, 4]
    assert codes[6:32] == [0] * 26
    assert codes[32:40] == [0, 1, 2, 3, 4, 5, 6, q]
    assert codes[40:] == [0] * 24     # tail padding codes are 0
    if bits == 4:                     # element 2i in the low nibble, 2i+1 in the high nibble
        assert buf[0].item() == (q & 15) | ((-q & 15) << 4)


def test_nonfinite_and_zero_blocks_by_hand():
    B = 32
    x = torch.zeros(3 * B)
    x[0], x[1], x[2], x[3] = float("inf"), float("-inf"), float("nan"), 5.0
    x[B:2 * B] = 0.0                  # all-zero block
    x[2 * B] = 1.0
    for bits, q in ((4, 7), (8, 127)):
        buf = gq.qgz_quantize_ref(x, 1, 1, bits, B)
        codes, scales = py_decode(bytes(buf.tolist()), 3 * B, B, bits)
        assert scales[0] == math.inf and scales[1] == 0.0
        assert scales[2] == struct.unpack("<f", struct.pack("<f", 1.0 / q))[0]
        assert codes[:4] == [q, -q, -(q + 1), 0]
        assert codes[B:2 * B] == [0] * B
        back = gq.dequantize_pieces_ref(buf, 1, 3 * B, bits, B)[0]
        assert back[0] == math.inf and back[1] == -math.inf and math.isnan(back[2])
        assert torch.equal(back[3:2 * B], torch.zeros(2 * B - 3))   # no NaN from 0 * inf
        assert not torch.isnan(back[2 * B:]).any()
        assert abs(back[2 * B].item() - 1.0) <= (1.0 / q) * C_BOUND
        # normal blocks never emit -(q+1)
        y = torch.randn(64 * B) * 10
        c, _ = gq.unpack_pieces(gq.qgz_quantize_ref(y, 1, 1, bits, B), 1, 64 * B, bits, B)
        assert c.min() >= -q and c.max() <= q and (c.abs() == q).any()


def test_bf16_and_fp16_read_in_their_own_dtype():
    """The quantizer must upcast bf16 / fp16 exactly: same bytes as the float32 copy. Values
    beyond fp16's range in bf16 (and fp16 bit patterns) would quantize differently if misread."""
    g = torch.tensor([1e20, -3e-30, 2.5e10, 7.0] * 16 + [0.5] * 32).to(torch.bfloat16)
    h = (torch.randn(96) * 1000).to(torch.float16)
    for x in (g, h):
        for bits in (4, 8):
            ref = gq.qgz_quantize_ref(x.float(), 1, 1, bits, 32)
            assert torch.equal(torch.ops.zpp.qgz_quantize(x, 1, 1, bits, 32), ref)
            if triton_ok:
                assert torch.equal(gq.qgz_quantize_triton(x.to(DEV), 1, 1, bits, 32).cpu(), ref)
            back = gq.dequantize_pieces_ref(ref, 1, x.numel(), bits, 32)[0]
            _, sc = gq.unpack_pieces(ref, 1, x.numel(), bits, 32)
            err = (back.double() - x.double()).abs()
            assert (err <= sc.repeat_interleave(32).double() * C_BOUND).all()
    # misreading bf16 bits as fp16 gives other values: the check above can fail
    assert not torch.equal(g.view(torch.float16).float(), g.float())


def test_fma_emulation_is_correctly_rounded():
    """The twin's fused multiply-add (the GPU's FFMA) against exact rational arithmetic,
    including products that sit exactly on a float32 rounding midpoint."""
    from fractions import Fraction
    gen = torch.Generator().manual_seed(0)
    n = 3000
    code = torch.randint(-128, 128, (n,), generator=gen).double()
    scale = (torch.rand(n, generator=gen) * torch.exp2(torch.randint(-40, 40, (n,),
                                                                      generator=gen).float()))
    acc = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-60, 60, (n,),
                                                                   generator=gen).float())
    code[:500], scale[:500] = 3.0, 1 + 2.0 ** -23       # 3 + 3 * 2**-23: a midpoint
    acc[:500] = torch.randn(500, generator=gen) * 1e-30  # tiny addend decides the rounding
    got = gq_format._fma_f32(acc, code * scale.double())

    def round_f32(fr):
        lo = torch.tensor(float(fr), dtype=torch.float32)
        cands = [lo, torch.nextafter(lo, torch.tensor(math.inf)),
                 torch.nextafter(lo, torch.tensor(-math.inf))]
        return min(cands, key=lambda v: (abs(Fraction(v.item()) - fr),
                                         int(v.view(torch.int32)) & 1)).item()

    for i in range(n):
        exact = Fraction(code[i].item()) * Fraction(scale[i].item()) + Fraction(acc[i].item())
        assert got[i].item() == round_f32(exact), i
    naive = (code.float() * scale + acc)                # two roundings: differs somewhere
    assert not torch.equal(naive, got)
    # Addends of close magnitude (scales in [1, 2), acc in [1, 2)): every float64 sum is exact.
    near_acc = torch.rand(1000, generator=gen) + 1
    near_product = code[500:1500] * (torch.rand(1000, generator=gen) + 1).double()
    got = gq_format._fma_f32(near_acc, near_product)
    for i in range(1000):
        exact = Fraction(near_acc[i].item()) + Fraction(near_product[i].item())
        assert got[i].item() == round_f32(exact), i


def test_finite_blocks_quantize_as_the_nonfinite_path_does():
    """Finite gradients skip the passes for inf and NaN; those passes give every finite block
    the same codes and scales (zero, tiny and large blocks, values on rounding midpoints)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 64, generator=gen) * torch.exp2(torch.randint(-130, 120, (40, 1), generator=gen).float())
    x[0] = 0.0
    x[1, :8] = torch.arange(8) + 0.5    # rint on exact halves
    for bits in (4, 8):
        code, scale = gq_format._quantize_blocks(x, bits)
        general_code, general_scale = gq_format._quantize_nonfinite_blocks(x, bits)
        assert torch.equal(code, general_code) and torch.equal(scale, general_scale)


def test_bad_arguments():
    g = torch.randn(12)
    with pytest.raises(ValueError):
        torch.ops.zpp.qgz_quantize(g, 5, 1, 4, 32)          # 12 not divisible by 5
    with pytest.raises(ValueError):
        torch.ops.zpp.qgz_quantize(g, 2, 2, 3, 32)
    with pytest.raises(ValueError):
        torch.ops.zpp.qgz_quantize(g.to(torch.int32), 2, 2, 4, 32)
    with pytest.raises(ValueError):
        torch.ops.zpp.qgz_dequantize_reduce(torch.zeros(7, dtype=torch.uint8), 1, 3, 4, 32,
                                            torch.float32, 1.0)


@pytest.mark.parametrize("op", ["quantize", "reduce", "dequantize"])
def test_opcheck(op):
    S, B = 37, 32
    g = torch.randn(4 * S)
    buf = gq.qgz_quantize_ref(g, 2, 2, 8, B)
    if op == "quantize":
        torch.library.opcheck(torch.ops.zpp.qgz_quantize.default, (g, 2, 2, 4, B))
    elif op == "reduce":
        torch.library.opcheck(torch.ops.zpp.qgz_reduce_requantize.default,
                              (buf, 2, 2, S, 8, 4, B))
    else:
        torch.library.opcheck(torch.ops.zpp.qgz_dequantize_reduce.default,
                              (buf, 4, S, 8, B, torch.bfloat16, 0.25))


