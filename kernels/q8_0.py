"""Products with weights held as Q8_0 blocks: a GGUF's own, read at the bytes they need.

Q8_0 holds a weight as blocks of 32 int8 values and one scale (fp16 in the file and in the
packed tiles): 1.0625 bytes a weight, against 2 for an fp16 copy. A decode step reads every
weight once, so the fewer bytes are the point. `kernels.gguf_blocks` finds a model's blocks:
the embedded Gemma 3 270M's tied head (Q8_0, read where the file keeps it) and its linears
(Q5_0 and Q8_0 widened to int8; Q4_K and Q6_K as int8 with a minimum per 32 or a scale per 16, the
two kinds beyond Q8_0's the kernel takes); `Q8_0Weight` holds them and packs them once.

The product is a small C kernel (`csrc/q8_0_gemv.c`: AVX-512 with or without VNNI, AVX2 or
plain C, whichever the machine has), compiled at first use with `-march=native` (less
AVX-512 where torch dispatches below it: `native_flags`) and cached per source and CPU
under the kvactor cache, loaded with ctypes; it runs on the process's
OpenMP team (torch's). It reads the blocks repacked into tiles of 16 rows
(`Q8_0Weight.packed`). Its activations are quantized per 32-block to int16 (each value off
by at most 2^-16 of its block's largest), so on a bf16 model (activations already rounded to
bf16's 8 bits) its results are as close to the exact path's as an fp16 copy's, or closer:
that copy holds the weights rounded to bf16, or to fp16 on an fp32 model
(tests/model/test_q8_0_head.py, test_gguf_blocks.py; `bin/engine bench quality` measures
the model). The head (`LmHead`) and the linears (`kernels.linear.Q8_0NarrowLinear`) take
it in place of their fp16 copies wherever the kernel builds with AVX2 or wider
(`vectorized`); where no C compiler runs, the kernel is unavailable and they keep those
copies (`kernel_status` says why). Where a C++ compiler runs too, `load_operator` builds the
product as a torch operator as well (`csrc/q8_0_op.cpp`: `torch.ops.kvactor.q8_0_linear`),
which `Q8_0Packed.linear` calls, and a compiled graph can hold as a node of its own (no
custom op calling back into Python, no ctypes marshalling).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).parent / "csrc" / "q8_0_gemv.c"
OP_SOURCE = Path(__file__).parent / "csrc" / "q8_0_op.cpp"  # the product as a torch operator
BLOCK = 32
TILE = 16  # rows per tile of the packed layout
BUILD_TIMEOUT_S = 180
ISA_NAMES = {3: "avx512-vnni", 2: "avx512bw", 1: "avx2", 0: "plain C"}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_status = "not built yet"
_operator_lock = threading.Lock()  # its own: the kernel's callers never wait on its build
_operator_loaded = False
_operator_status = "not built yet"


@dataclass(frozen=True)
class Q8_0Weight:
    """A [V, H] weight as Q8_0 blocks: `q` int8 [V, H / 32, 32] (any strides with the last
    one 1: a view of a GGUF's own records works), `scales` fp32 [V, H / 32]. Two blocks'
    kinds beyond Q8_0's hold K-quants exactly: `scales` [V, H / 32, 2], a scale per 16 values
    (Q6_K's sub-blocks), and `mins` fp32 [V, H / 32], subtracted from each weight of the
    block (Q4_K's): w = scale * q - min."""

    q: Tensor
    scales: Tensor
    mins: Tensor | None = None

    def __post_init__(self) -> None:
        if self.q.dtype != torch.int8 or self.q.dim() != 3 or self.q.shape[2] != BLOCK:
            raise ValueError(f"Q8_0 weights are int8 [V, H / {BLOCK}, {BLOCK}]")
        if self.q.stride(2) != 1:
            raise ValueError("a Q8_0 block's values must be adjacent")
        v, ng, _ = self.q.shape
        shape = tuple(self.scales.shape)
        if self.scales.dtype != torch.float32 or shape not in ((v, ng), (v, ng, 2)):
            raise ValueError(f"Q8_0 scales are fp32 [{v}, {ng}] or [{v}, {ng}, 2]")
        if self.mins is not None and (
            self.mins.dtype != torch.float32 or tuple(self.mins.shape) != (v, ng)
        ):
            raise ValueError(f"block minimums are fp32 [{v}, {ng}]")

    @property
    def subblocks(self) -> int:
        """Scales a block: 1, or 2 (one per 16 values)."""
        return 1 if self.scales.dim() == 2 else 2

    @property
    def shape(self) -> tuple[int, int]:
        v, ng, _ = self.q.shape
        return v, ng * BLOCK

    def dequantized(self) -> Tensor:
        """The fp32 [V, H] weight these blocks hold (as the GGUF reader dequantizes it)."""
        v, ng, _ = self.q.shape
        n = self.subblocks
        scaled = self.q.float().view(v, ng, n, BLOCK // n) * self.scales.view(v, ng, n, 1)
        if self.mins is not None:
            scaled = scaled - self.mins.view(v, ng, 1, 1)
        return scaled.reshape(self.shape)

    @classmethod
    def quantize(cls, weight: Tensor) -> Q8_0Weight:
        """`weight` [V, H] in Q8_0 blocks as llama.cpp quantizes it (for tests and benches;
        a GGUF's own come from `kernels.gguf_blocks`)."""
        v, h = weight.shape
        blocks = weight.detach().float().reshape(v, h // BLOCK, BLOCK)
        scales = (blocks.abs().amax(-1) / 127).half().float()  # Q8_0 stores fp16 scales
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(blocks / safe[..., None]).clamp(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scales.contiguous())

    def packed(self, lib: ctypes.CDLL | None = None, rows: int | None = None) -> Q8_0Packed:
        """Its first `rows` rows (default: all) in the kernel's tiled layout
        (`csrc/q8_0_gemv.c`; `lib`: a build other than this process's own), padded with
        zero rows to whole tiles. Reads the values where they lie: no other copy. The
        scales are packed as fp16 where every one is an fp16 value (a GGUF's Q8_0, Q5_0 and
        Q4_0 blocks: the file's own) and a block has one and no minimum: a step reads two
        bytes a scale instead of four, the same values."""
        lib = _library_or_raise(lib)
        v, h = self.shape
        rows = v if rows is None else min(rows, v)
        padded = -(-rows // TILE) * TILE
        n = self.subblocks
        scales = self.scales.contiguous()
        if n == 1 and self.mins is None and torch.equal(scales.half().float(), scales):
            scales = scales.half()
        pq = torch.empty(padded, h, dtype=torch.int8)  # the tiles' bytes: [padded rows, H]
        ps = torch.empty(padded * (h // BLOCK) * n, dtype=scales.dtype)
        pm = None if self.mins is None else torch.empty(padded * (h // BLOCK), dtype=torch.float32)
        mins = None if self.mins is None else self.mins.contiguous()
        lib.q8_0_pack(
            self.q.data_ptr(),
            self.q.stride(0),
            self.q.stride(1),
            scales.data_ptr(),
            n,
            scales.dtype == torch.float16,
            None if mins is None else mins.data_ptr(),
            rows,
            padded,
            h,
            pq.data_ptr(),
            ps.data_ptr(),
            None if pm is None else pm.data_ptr(),
        )
        return Q8_0Packed(pq, ps, rows, h, lib, n, pm)


@dataclass(frozen=True)
class Q8_0Packed:
    """Q8_0 blocks of a [rows, hidden] weight in the kernel's tiled layout."""

    q: Tensor  # int8 [whole tiles of 16 rows, hidden], in the tiles' byte order
    scales: Tensor  # fp32, or fp16 (one a block, no minimums: `Q8_0Weight.packed`)
    rows: int
    hidden: int
    lib: ctypes.CDLL  # the build that packed them (the layout is its own)
    subblocks: int = 1  # scales a block
    mins: Tensor | None = None  # fp32, one a block, or None

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        return (self.q, self.scales) if self.mins is None else (self.q, self.scales, self.mins)

    def product(self, rows: Tensor) -> Tensor:
        """fp32 [n, rows] = `rows` [n, hidden] times the weight's transpose, on torch's
        thread count."""
        x = rows.detach().to(torch.float32).contiguous()
        n, h = x.shape
        if h != self.hidden:
            raise ValueError(f"rows of {h} features for a [{self.rows}, {self.hidden}] weight")
        padded = self.q.numel() // h
        out = torch.empty((n, padded), dtype=torch.float32)
        failed = self.lib.q8_0_gemv(
            x.data_ptr(),
            n,
            h,
            self.q.data_ptr(),
            self.scales.data_ptr(),
            self.subblocks,
            self.scales.dtype == torch.float16,
            None if self.mins is None else self.mins.data_ptr(),
            padded,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if failed == -1:
            raise MemoryError("the Q8_0 kernel's scratch memory could not be allocated")
        if failed:
            raise ValueError(f"the Q8_0 kernel refused {self.subblocks} scales a block")
        return out if padded == self.rows else out[:, : self.rows].contiguous()

    @property
    def traceable(self) -> bool:
        """Whether `linear` runs as the operator (which a compiled graph can hold): it is
        built, and these blocks are in the layout of the build it calls."""
        return _operator_loaded and self.lib is _library

    def linear(self, rows: Tensor, bias: Tensor | None = None) -> Tensor:
        """`product` plus `bias`, in the rows' dtype: `torch.ops.kvactor.q8_0_linear`
        where `traceable`, else the same through ctypes."""
        if self.traceable:
            return torch.ops.kvactor.q8_0_linear(
                rows, self.q, self.scales, self.mins, bias, self.rows, self.subblocks
            )
        out = self.product(rows)
        if bias is not None:
            out += bias
        return out.to(rows.dtype)


def _library_or_raise(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    lib = lib or kernel()
    if lib is None:
        raise RuntimeError(f"the Q8_0 kernel is unavailable: {_status}")
    return lib


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel (built and cached at first use), or None where it cannot be
    built here (`kernel_status` says why)."""
    global _library, _status
    with _lock:
        if _library is None and _status == "not built yet":
            try:
                _library = load_library(build_library(native_flags()))
                _status = f"built for {ISA_NAMES[_library.q8_0_isa()]}"
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _status = f"not built: {exc}"
        return _library


def kernel_status() -> str:
    return _status


def load_operator() -> bool:
    """Whether `torch.ops.kvactor.q8_0_linear` is registered: built (`build_operator`,
    seconds, cached) and loaded at the first call, over this process's kernel. Blocks take
    it from then on (`Q8_0Packed.linear`); where it cannot be built they keep the ctypes
    path, with the same results (`operator_status` says why)."""
    global _operator_loaded, _operator_status
    lib = kernel()
    with _operator_lock:
        if not _operator_loaded and _operator_status == "not built yet":
            try:
                if lib is None:
                    raise RuntimeError(f"the kernel is unavailable: {_status}")
                torch.ops.load_library(str(build_operator(Path(lib._name))))
                torch.library.register_fake("kvactor::q8_0_linear", _operator_shape)
                _operator_loaded = True
                _operator_status = "built"
            except Exception as exc:  # noqa: BLE001 - any failure leaves the ctypes path
                _operator_status = f"not built: {str(exc)[-300:] or type(exc).__name__}"
        return _operator_loaded


def operator_status() -> str:
    return _operator_status


def _operator_shape(rows: Tensor, q, scales, mins, bias, out_features: int, subblocks: int):
    """The operator's output for tracing: [rows, out_features] in the rows' dtype."""
    return rows.new_empty((rows.shape[0], out_features))


def vectorized() -> bool:
    """The kernel built here runs on AVX2 or wider (the plain C build is no faster than
    the fp16 copy it would replace)."""
    lib = kernel()
    return lib is not None and lib.q8_0_isa() >= 1


def compiler() -> str | None:
    """The C compiler: $CC, else cc, gcc or clang on PATH."""
    return _on_path("CC", ("cc", "gcc", "clang"))


def cxx_compiler() -> str | None:
    """The C++ compiler: $CXX, else c++, g++ or clang++ on PATH."""
    return _on_path("CXX", ("c++", "g++", "clang++"))


def _on_path(variable: str, names: tuple[str, ...]) -> str | None:
    for name in (os.environ.get(variable), *names):
        if name and shutil.which(name):
            return name
    return None


def _version(tool: str) -> str:
    done = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=30)
    return done.stdout.split("\n")[0]


def _built(target: Path, command: Callable[[Path], list]) -> Path:
    """`target`, compiled by `command(output path)` unless it exists: into a scratch folder
    beside it, then renamed, so it is whole or absent for another process building too."""
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        argv = command(built)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode:
            raise RuntimeError(f"{' '.join(map(str, argv))} failed: {done.stderr.strip()[-400:]}")
        os.replace(built, target)
    return target


def native_flags() -> tuple[str, ...]:
    """This CPU's instructions, less AVX-512 where torch's dispatch level leaves it unused
    (`kernels.cpu.avx512_disabled`: an AVX2 CPU's choices, made on a wider one)."""
    from kernels.cpu import avx512_disabled

    return ("-march=native", "-mno-avx512f") if avx512_disabled() else ("-march=native",)


def build_library(flags: tuple[str, ...] = ("-march=native",), directory: Path | None = None):
    """The kernel's shared library for `flags`, compiled once into the kvactor cache, under
    a key of the source, the flags, the compiler, the machine type and the CPU's flags, so a
    cache shared between machines never hands one of them another's instructions. Where
    this CPU's flags cannot be read, the build is this process's own (a fresh folder)."""
    import platform

    from kernels.cpu import cpu_features
    from kernels.gguf_loader import kvactor_cache_dir

    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install cc/gcc/clang)")
    cpu_flags = sorted(cpu_features().flags)
    parts = [SOURCE.read_text(), *flags, cc, _version(cc), platform.machine(), *cpu_flags]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    if directory is None:
        directory = kvactor_cache_dir() / "kernels"
        if not cpu_flags:
            directory = Path(tempfile.mkdtemp(prefix="kvactor-q8_0-"))
    directory.mkdir(parents=True, exist_ok=True)
    return _built(
        directory / f"q8_0_gemv-{key}.so",
        lambda out: [cc, "-O3", *flags, "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", out],
    )


def build_operator(kernel_library: Path) -> Path:
    """`csrc/q8_0_op.cpp` as a shared library linked to `kernel_library` (a build of the
    kernel), compiled once against this torch's headers into the same folder, under a key
    of the source, torch's version, the compiler and its whole command (the kernel's path
    included: a cache that moved builds anew)."""
    from torch.utils import cpp_extension

    cxx = cxx_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX, or install c++/g++/clang++)")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    kernel_library = kernel_library.resolve()  # linked by this path: part of the key

    def command(out) -> list:
        return [
            cxx,
            "-O2",
            "-std=c++20",
            "-shared",
            "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in cpp_extension.include_paths()),
            str(OP_SOURCE),
            str(kernel_library),  # no soname: recorded by this path
            *(f"-L{p}" for p in cpp_extension.library_paths()),
            "-lc10",
            "-ltorch_cpu",
            "-o",
            out,
        ]

    parts = [OP_SOURCE.read_text(), torch.__version__, _version(cxx), *map(str, command("-"))]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return _built(kernel_library.parent / f"q8_0_op-{key}.so", command)


def load_library(path: Path) -> ctypes.CDLL:
    """A build of the kernel (`kernel` loads this process's own; tests load each ISA's)."""
    # torch is imported first, so the library's libgomp.so.1 is the one torch loaded: its
    # OpenMP team (and thread count) is torch's own.
    lib = ctypes.CDLL(str(path))
    lib.q8_0_gemv.restype = ctypes.c_int
    lib.q8_0_gemv.argtypes = [
        ctypes.c_void_p,  # x
        ctypes.c_int64,  # B
        ctypes.c_int64,  # H
        ctypes.c_void_p,  # packed q
        ctypes.c_void_p,  # packed scales
        ctypes.c_int,  # scales a block
        ctypes.c_int,  # the scales are fp16
        ctypes.c_void_p,  # packed minimums, or NULL
        ctypes.c_int64,  # V (padded)
        ctypes.c_void_p,  # out
        ctypes.c_int,  # threads
    ]
    lib.q8_0_pack.restype = None
    lib.q8_0_pack.argtypes = [
        ctypes.c_void_p,  # q
        ctypes.c_int64,  # row stride
        ctypes.c_int64,  # block stride
        ctypes.c_void_p,  # scales
        ctypes.c_int,  # scales a block
        ctypes.c_int,  # the scales are fp16 (and so packed)
        ctypes.c_void_p,  # minimums, or NULL
        ctypes.c_int64,  # rows
        ctypes.c_int64,  # padded rows
        ctypes.c_int64,  # H
        ctypes.c_void_p,  # packed q
        ctypes.c_void_p,  # packed scales
        ctypes.c_void_p,  # packed minimums, or NULL
    ]
    lib.q8_0_isa.restype = ctypes.c_int
    lib.q8_0_isa.argtypes = []
    return lib
