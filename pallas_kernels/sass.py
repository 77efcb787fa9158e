"""The SASS of our Pallas Triton kernels without a GPU: lower a case of :mod:`pallas_kernels.lowering` for an H200,
compile its Triton IR with the ``triton`` wheel (its ``ptxas`` and ``cuobjdump`` ship inside it) and count the
instructions of each loop.

Why: the instruction-bound kernels (the MXFP4 decode, the fp8 MLA decode) are tuned by the instructions their hot
loop issues, and Nsight Compute needs a GPU. This reproduces the GPU's code closely: for the MXFP4 word-order decode
tile (2 warps, 16 x 64 x 512) it counts 1849 instructions and 328 register moves per K step, where Nsight Compute on
the H200 counted 1873 and 330 (BENCHMARKS.md, MXFP4 grouped GEMM). XLA compiles the same Triton IR with the
Triton it bundles, not the wheel's, so a count may differ by a few percent; compare variants under one tool.

Needs the ``sass`` extra (``pip install -e ".[sass]"``: Triton 3.6, the version beside torch on our GPU image, which
gave the figures above); the rest of the project does not. Usage::

    python -m pallas_kernels.sass mla_decode_triton_fp8 grouped_gemm_mxfp4_words_two_warps [--out DIR] [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import tempfile

from pallas_kernels import lowering

CAPABILITY = 90  # Hopper: the H100 / H200
MOVES = ("MOV", "IMAD.MOV.U32")
"""Register moves (``IMAD.MOV`` is ptxas's move on the integer pipe)."""
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.M)
_BRANCH = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+0x([0-9a-f]+)")
_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+)")


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop of the SASS: ``[start, end]`` byte addresses (the end is its backward branch) and its opcodes'
    counts."""

    start: int
    end: int
    opcodes: collections.Counter

    @property
    def instructions(self) -> int:
        return sum(self.opcodes.values())

    @property
    def moves(self) -> int:
        return sum(self.opcodes[op] for op in MOVES)


@dataclasses.dataclass(frozen=True)
class KernelSass:
    """One compiled Triton launch: registers and stack bytes per thread (stack > 0: spills), its instructions and
    its loops, innermost first."""

    kernel: lowering.TritonKernel
    registers: int
    stack_bytes: int
    instructions: int
    loops: tuple[Loop, ...]
    sass: str
    ptx: str
    ttgir: str


def parse_instructions(sass: str) -> list[tuple[int, str]]:
    """``cuobjdump -sass`` text -> [(address, opcode with modifiers)] in address order."""
    return [(int(address, 16), opcode) for address, opcode in _INSTRUCTION.findall(sass)]


def find_loops(sass: str) -> tuple[Loop, ...]:
    """The loops of ``sass``, one per backward branch, innermost (shortest) first."""
    instructions = parse_instructions(sass)
    loops = []
    for branch, target in _BRANCH.findall(sass):
        end, start = int(branch, 16), int(target, 16)
        if start < end:  # not the trap's branch to itself
            opcodes = collections.Counter(op for address, op in instructions if start <= address <= end)
            loops.append(Loop(start, end, opcodes))
    return tuple(sorted(loops, key=lambda loop: loop.end - loop.start))


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_kernel(kernel: lowering.TritonKernel, capability: int = CAPABILITY) -> KernelSass:
    """Compile one lowered launch with the ``triton`` wheel (every stage from its Triton IR on, as XLA does) and
    read back its SASS and resource usage."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget, Language
    from triton.compiler.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", capability, 32))
    options = backend.parse_options({"num_warps": kernel.num_warps, "num_stages": kernel.num_stages})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"{kernel.name}.ttir")
        with open(path, "w") as f:
            f.write(kernel.ttir)
        module = ir.parse_mlir_module(path, context)
        module.context = context
        stages, metadata, outputs = {}, {"hash": kernel.name, "target": backend.target, **options.__dict__}, {}
        backend.add_stages(stages, options, Language.TRITON)
        for ext, stage in stages.items():
            module = stage(module, metadata)
            outputs[ext] = str(module) if ext == "ttgir" else module  # later stages rewrite the module in place
        cubin = os.path.join(folder, f"{kernel.name}.cubin")
        with open(cubin, "wb") as f:
            f.write(outputs["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
    registers, stack = map(int, _RESOURCES.search(usage).groups())
    return KernelSass(kernel, registers, stack, len(parse_instructions(sass)), find_loops(sass), sass,
                      outputs["ptx"], outputs["ttgir"])


def case_sass(case: str) -> list[KernelSass]:
    """Every Triton launch of :data:`pallas_kernels.lowering.CASES` ``[case]``, compiled."""
    fn, args = lowering.CASES[case]
    return [compile_kernel(kernel) for kernel in lowering.triton_kernels(fn, args)]


def report(case: str, kernels: list[KernelSass], top: int) -> str:
    """A short text table: per launch its registers, stack, instruction count, and per loop its instructions,
    register moves and most frequent opcodes."""
    lines = []
    for i, k in enumerate(kernels):
        lines.append(f"{case}[{i}] {k.kernel.name}: {k.kernel.num_warps} warps, {k.kernel.num_stages} stages, "
                     f"{k.registers} registers, {k.stack_bytes} B stack, {k.instructions} instructions")
        for loop in k.loops:
            ops = ", ".join(f"{op} {n}" for op, n in loop.opcodes.most_common(top))
            lines.append(f"  loop 0x{loop.start:x}-0x{loop.end:x}: {loop.instructions} instructions, "
                         f"{loop.moves} moves: {ops}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="+", choices=sorted(lowering.CASES), metavar="CASE",
                        help="cases of pallas_kernels.lowering.CASES")
    parser.add_argument("--top", type=int, default=12, help="opcodes listed per loop")
    parser.add_argument("--out", help="write each launch's .ttgir, .ptx and .sass here")
    args = parser.parse_args(argv)
    for case in args.cases:
        kernels = case_sass(case)
        print(report(case, kernels, args.top))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            for i, k in enumerate(kernels):
                for ext, text in (("ttgir", k.ttgir), ("ptx", k.ptx), ("sass", k.sass)):
                    with open(os.path.join(args.out, f"{case}_{i}.{ext}"), "w") as f:
                        f.write(text)


if __name__ == "__main__":
    main()
