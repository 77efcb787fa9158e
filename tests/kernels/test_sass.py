"""pallas_kernels.sass: its SASS parser on a fixed listing, and one real compile of a kernel case (where the triton
wheel installs: Linux x86-64)."""

import pytest

from pallas_kernels import sass

LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA 0x90 ;
        /*0020*/                   LDS.64 R12, [R54+UR6+0x4e00] ;
        /*0030*/                   IMAD.MOV.U32 R10, RZ, RZ, R12 ;
        /*0040*/                   MOV R8, R14 ;
        /*0050*/                   HMMA.16816.F32.BF16 R20, R8, R44, R20 ;
        /*0060*/                   HMMA.16816.F32.BF16 R24, R8, R28, R24 ;
        /*0070*/               @!P1 BRA 0x20 ;
        /*0080*/                   ISETP.NE.AND P0, PT, R2, RZ, PT ;
        /*0090*/                   LOP3.LUT R4, R4, 0x80008000, RZ, 0xc0, !PT ;
        /*00a0*/               @P0 BRA 0x0 ;
        /*00b0*/                   EXIT ;
        /*00c0*/                   BRA 0xc0;
"""


def test_parser_finds_each_loop_and_its_moves():
    instructions = sass.parse_instructions(LISTING)
    assert len(instructions) == 13
    assert instructions[3] == (0x30, "IMAD.MOV.U32")
    inner, outer = sass.find_loops(LISTING)  # the forward branch and the trap's branch to itself are no loops
    assert (inner.start, inner.end) == (0x20, 0x70)
    assert inner.instructions == 6 and inner.moves == 2
    assert inner.opcodes["HMMA.16816.F32.BF16"] == 2
    assert (outer.start, outer.end) == (0x0, 0xa0) and outer.instructions == 11


def test_word_order_decode_tile_compiles_to_its_mma_count():
    """The MXFP4 decode tile of 2 warps (16 x 64 x 512): per warp and K step 32 columns x 512 K in m16n8k16 MMAs is
    128 HMMAs, and the decode must not spill."""
    pytest.importorskip("triton")
    [kernel] = sass.case_sass("grouped_gemm_mxfp4_words_two_warps")
    assert kernel.kernel.num_warps == 2 and kernel.stack_bytes == 0
    hot = max(kernel.loops, key=lambda loop: loop.instructions)
    assert hot.opcodes["HMMA.16816.F32.BF16"] == 128
    assert 1000 < hot.instructions < 3000
