"""A few PTX instructions run in Python, so that a kernel's inline PTX text (which the Triton
interpreter cannot run) is checked on the CPU: the decode kernels' byte-permute and LOP3 code
conversions read their asm string from the kernel's source and run it here on chosen words.
Covers what those asm blocks use: prmt.b32 (default mode), lop3.b32, shr.u32, sub.f16x2 and
mov.b32 (a constant, or the split of a 32-bit register into two 16-bit outputs)."""

from __future__ import annotations

import ast
import inspect

import numpy as np

M32 = 0xFFFFFFFF


def asm_of(module, function: str) -> str:
    """The asm string of the inline_asm_elementwise call in `function` of `module`'s source."""
    fn = next(n for n in ast.walk(ast.parse(inspect.getsource(module)))
              if isinstance(n, ast.FunctionDef) and n.name == function)
    return next(kw.value.value for n in ast.walk(fn) if isinstance(n, ast.Call) for kw in n.keywords if kw.arg == "asm")


def prmt(a: int, b: int, c: int) -> int:
    """prmt.b32 d, a, b, c: byte i of d is byte (c >> 4i) & 7 of the eight bytes b:a (a the low
    four), sign-replicated when bit 3 of that selector nibble is set."""
    src = (b & M32) << 32 | (a & M32)
    out = 0
    for i in range(4):
        sel = (c >> 4 * i) & 0xF
        byte = (src >> 8 * (sel & 7)) & 0xFF
        out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << 8 * i
    return out


def lop3(a: int, b: int, c: int, lut: int) -> int:
    """lop3.b32 d, a, b, c, lut: each bit of d is bit (4a + 2b + c) of lut, bit by bit."""
    out = 0
    for i in range(32):
        bit = (a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1)
        out |= (lut >> bit & 1) << i
    return out


def sub_f16x2(a: int, b: int) -> int:
    """sub.f16x2 d, a, b: the two fp16 halves subtracted (round to nearest)."""
    x = np.array([a & 0xFFFF, a >> 16 & 0xFFFF], np.uint16).view(np.float16)
    y = np.array([b & 0xFFFF, b >> 16 & 0xFFFF], np.uint16).view(np.float16)
    d = (x - y).view(np.uint16)
    return int(d[0]) | int(d[1]) << 16


def run(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """Run the asm block with the operands `inputs` ({"$8": word, …}); every register after it
    (16-bit outputs as written by a mov.b32 {lo, hi} split)."""
    reg = {k: v & M32 for k, v in inputs.items()}

    def val(x: str) -> int:
        return reg[x] if x in reg else int(x, 0) & M32

    for ins in (i.strip() for i in asm.strip().strip("{}").split(";")):
        if not ins or ins.startswith(".reg") or ins == "}":
            continue
        op, rest = ins.split(None, 1)
        if op == "mov.b32" and rest.lstrip().startswith("{"):
            halves, src = (x.strip() for x in rest.split("},"))
            lo, hi = (x.strip() for x in halves.strip("{").split(","))
            reg[lo], reg[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        d, *srcs = (x.strip() for x in rest.split(","))
        if op == "mov.b32":
            reg[d] = val(srcs[0])
        elif op == "prmt.b32":
            reg[d] = prmt(*(val(x) for x in srcs))
        elif op == "lop3.b32":
            reg[d] = lop3(*(val(x) for x in srcs))
        elif op == "shr.u32":
            reg[d] = val(srcs[0]) >> val(srcs[1])
        elif op == "sub.f16x2":
            reg[d] = sub_f16x2(val(srcs[0]), val(srcs[1]))
        else:
            raise AssertionError(f"the asm uses {op}, which ptx_emulation does not run")
    return reg
