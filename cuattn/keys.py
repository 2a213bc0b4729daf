"""The variant keys of every kernel: the Python mirror of cuda_src/'s traits types.

Each key is pure data (cuattn.jit.Variant): the values of one C++ traits type, which the
generated entry point instantiates; ``cuattn.tuning`` is what chooses them. A field
declares its part of the kernel's symbol and its template argument (key_field); a key
writes name_parts / traits_args out only where they are more than its fields in order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ._dtypes import BY_SHORT
from .constants import (FEAT_ALIBI, FEAT_PACK_GQA, FEAT_SINKS, FEAT_SOFTCAP, KV_DENSE,
                        KV_PAGED_NHD, KV_PAGED_VLLM, MASK_CAUSAL, MASK_NONE, MASK_WINDOW,
                        SM90_ARCH)
from .jit import ParamsStruct, Variant, key_field
from .param_structs import (FLASH_BWD_PARAMS, FLASH_PARAMS, FLASHINFER_TABLES_PARAMS,
                            KVCACHE_APPEND_PARAMS, MERGE_PARAMS, PAGED_PARAMS,
                            PAGED_REDUCE_PARAMS, QUANTIZE_PARAMS, RESHAPE_PARAMS)

# ---- how fields spell themselves ---------------------------------------------------------------

_MASK_NAMES = {MASK_NONE: "c0", MASK_CAUSAL: "c1", MASK_WINDOW: "win"}
_KV_NAMES = {KV_DENSE: (), KV_PAGED_NHD: ("nhd",), KV_PAGED_VLLM: ("vllm",)}
_FEATURE_NAMES = ((FEAT_SOFTCAP, "cap"), (FEAT_ALIBI, "alibi"), (FEAT_SINKS, "sink"),
                  (FEAT_PACK_GQA, "gqa"))


def _features(features: int) -> tuple[str, ...]:
    return tuple(name for bit, name in _FEATURE_NAMES if features & bit)


def _flag(word: str):
    """The name part of a bool field: ``word`` when set."""
    return lambda on: (word,) if on else ()


def _cpp_type(short: str) -> tuple:
    return (BY_SHORT[short].cpp,)


def _dtype(prefix: str = "", **field_args):
    """A dtype field (f16 / bf16 / e4m3): its short name in the symbol, its C++ type in the
    traits."""
    return key_field(prefix + "{}", cpp=_cpp_type, **field_args)


def _mask(mask: int) -> tuple[str, ...]:
    return (_MASK_NAMES[mask],)


def _partition(partition_size: int) -> tuple[str, ...]:
    return (f"p{partition_size}" if partition_size else "v1",)     # 0: v1 (whole sequence)


def _alibi(on: bool) -> tuple[str, ...]:
    return (f"a{int(on)}",)

# ---- flash (cuda_src/flash_fwd.cuh) -------------------------------------------------------------

@dataclass(frozen=True)
class FlashFwdVariant(Variant):
    dtype: str = _dtype()                      # f16 / bf16
    head_dim: int = key_field("hd{}")          # compiled head dim (a multiple of 32)
    block_m: int = key_field("bm{}")
    block_n: int = key_field("bn{}")
    num_warps: int = key_field("w{}")
    stages: int = key_field("st{}")
    mask: int = key_field(_mask)             # MASK_NONE / MASK_CAUSAL / MASK_WINDOW
    split: bool = key_field(_flag("split"))    # write fp32 partials for the split-KV combine
    # FlashFwdTraits' knobs (cuda_src/flash_fwd.cuh, tuning.FlashTiles)
    q_smem: int = key_field(lambda q: {0: (), 1: ("qs",)}.get(q, (f"qs{q}",)))
    kv_split: bool = key_field(_flag("kvs"))
    softmax: int = key_field(lambda s: (f"sm{s}",) if s else ())
    kv: int = key_field(_KV_NAMES.get, default=KV_DENSE)         # the K/V source
    features: int = key_field(_features, default=0)             # FEAT_* bits
    # a paged fp8 e4m3 cache, widened in shared memory
    fp8: bool = key_field(_flag("e4m3"), default=False)

    name_order = ("dtype", "head_dim", "block_m", "block_n", "num_warps", "stages", "mask",
                  "q_smem", "kv_split", "softmax", "split", "kv", "fp8", "features")

    op: ClassVar[str] = "flash_fwd"
    header: ClassVar[str] = "flash_fwd.cuh"
    kernel: ClassVar[str] = "flash_fwd_kernel"
    traits: ClassVar[str] = "FlashFwdTraits"
    params: ClassVar[ParamsStruct] = FLASH_PARAMS
    smem_from_traits: ClassVar[bool] = True

    def __post_init__(self):
        if self.mask not in _MASK_NAMES or self.softmax not in (0, 1, 2, 3) or \
                self.q_smem not in (0, 1, 2) or self.kv not in _KV_NAMES or \
                not 0 <= self.features < 16 or \
                (self.fp8 and (self.kv == KV_DENSE or self.kv_split)):
            raise ValueError(f"FlashFwdVariant: mask 0 to 2 (got {self.mask}), softmax 0 to 3 "
                             f"(got {self.softmax}), q_smem 0 to 2 (got {self.q_smem}), kv 0 "
                             f"to 2 (got {self.kv}), features 0 to 15 (got {self.features}), "
                             f"fp8 paged and without kv_split (got {self.fp8})")

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def min_blocks(self) -> int | None:
        # 1- and 2-warp blocks (paged_prefill's few-rows tiles): under the plain bound ptxas
        # (NVRTC 13.0) capped them at 128-168 registers and spilled; (threads, 1) lets them
        # take up to 255 like the 4-warp forms, whose plain bound stays as it is.
        return 1 if self.num_warps < 4 else None

    @property
    def dynamic_smem_bytes(self) -> int:
        # Q tile + STAGES x (K tile + V tile), 2-byte elements, and with fp8 each stage's raw
        # K and V bytes (pinned to Traits::SMEM_BYTES)
        raw = 2 * self.stages * self.block_n * self.head_dim if self.fp8 else 0
        return 2 * self.head_dim * (self.block_m + 2 * self.stages * self.block_n) + raw


@dataclass(frozen=True)
class FlashFwdSm90Variant(Variant):
    """The Hopper forward kernel (cuda_src/flash_fwd_sm90.cuh): wgmma, compiled for sm_90a."""
    dtype: str = _dtype()                      # f16 / bf16, or e4m3 (the FP8 form)
    head_dim: int = key_field("hd{}")          # compiled head dim (a multiple of 64; e4m3: of 128)
    block_m: int = key_field("bm{}")           # 64 query rows per warpgroup
    block_n: int = key_field("bn{}")
    stages: int = key_field("st{}")
    mask: int = key_field(_mask)             # MASK_NONE / MASK_CAUSAL / MASK_WINDOW
    split: bool = key_field(_flag("split"))    # write fp32 partials for the split-KV combine
    features: int = key_field(_features, default=0)   # FEAT_* bits but FEAT_PACK_GQA
    # the producer loads by TMA (tensor maps of Q / K / V), else cp.async
    tma: bool = key_field(_flag("tma"), default=False)
    # dense K / V, or a paged cache (paged_prefill; by TMA only)
    kv: int = key_field(_KV_NAMES.get, default=KV_DENSE)
    # e4m3: the output's dtype (f16 / bf16); else "" (the inputs')
    out: str = key_field(lambda o: (f"o{o}",) if o else (),
                         cpp=lambda o: _cpp_type(o) if o else (), default="")

    name_order = ("dtype", "head_dim", "block_m", "block_n", "stages", "tma", "mask", "split",
                  "kv", "features", "out")
    traits_order = ("dtype", "head_dim", "block_m", "block_n", "stages", "tma", "mask", "split",
                    "features", "kv", "out")

    op: ClassVar[str] = "flash_fwd_sm90"
    header: ClassVar[str] = "flash_fwd_sm90.cuh"
    kernel: ClassVar[str] = "flash_fwd_sm90_kernel"
    traits: ClassVar[str] = "FlashFwdSm90Traits"
    params: ClassVar[ParamsStruct] = FLASH_PARAMS
    # cuattn._tma.FlashMaps
    extra_params: ClassVar[tuple] = (("FlashTmaMaps", "maps"), ("FlashSm90Schedule", "sched"))
    smem_from_traits: ClassVar[bool] = True

    def __post_init__(self):
        if self.mask not in _MASK_NAMES or not 0 <= self.features < 16 or \
                self.features & FEAT_PACK_GQA or self.block_m % 64 or self.head_dim % 64 or \
                self.kv not in _KV_NAMES or (self.kv and not self.tma):
            raise ValueError(f"FlashFwdSm90Variant: mask 0 to 2 (got {self.mask}), features "
                             f"without FEAT_PACK_GQA (got {self.features}), block_m and "
                             f"head_dim multiples of 64 (got {self.block_m}, {self.head_dim}), "
                             f"kv dense or paged by TMA (got {self.kv}, tma {self.tma})")
        fp8 = self.dtype == "e4m3"
        if (self.out not in ("f16", "bf16")) if fp8 else self.out != "":
            raise ValueError(f"FlashFwdSm90Variant: out f16 / bf16 for e4m3, else '' "
                             f"(got {self.out!r})")
        if fp8 and (not self.tma or self.kv == KV_PAGED_VLLM or self.head_dim % 128 or
                    self.block_n % 32):
            raise ValueError("FlashFwdSm90Variant: e4m3 loads dense or NHD-paged K / V by "
                             "TMA, head_dim a "
                             f"multiple of 128 and block_n of 32 (got tma {self.tma}, kv "
                             f"{self.kv}, {self.head_dim}, {self.block_n})")

    @property
    def num_threads(self) -> int:
        return 128 * (1 + self.block_m // 64)     # a producer warpgroup + the consumers

    @property
    def min_blocks(self) -> int | None:
        return 1      # a register cap at entry: setmaxnreg needs it

    @property
    def dynamic_smem_bytes(self) -> int:
        # 1024 B of alignment slack + Q tile + STAGES x (K tile + V tile (+ e4m3: a V^T tile
        # of 128-key rows)) + the mbarriers (e4m3: 5 per stage) + two 16-byte item slots, +
        # a 16-bit O tile where it fits in 227 KB and the kernel stores O (pinned to
        # Traits::SMEM_BYTES)
        fp8 = self.dtype == "e4m3"
        elem = 1 if fp8 else 2
        vt_tile = -(-self.block_n // 128) * 128 * self.head_dim if fp8 else 0
        without_o = 1024 + elem * self.head_dim * self.block_m + \
            self.stages * (2 * elem * self.head_dim * self.block_n + vt_tile) + \
            8 * (2 + (5 if fp8 else 4) * self.stages) + 32
        o_tile = 2 * self.head_dim * self.block_m
        return without_o + (o_tile if not self.split and without_o + o_tile <= 227 * 1024 else 0)

    def grid(self, m_blocks: int, heads: int, entries_z: int, *, varlen: bool,
             sm_count: int) -> tuple:
        """The launch grid for m_blocks row tiles per (head, batch x split) entry
        (flash_fwd_sm90.cuh for_each_tile): one block per SM at most (its registers allow no
        second) over the items: dense calls stride over them (pairs of row tiles under a
        causal or window mask: Traits::PAIR_TILES), varlen ones by TMA fetch them from a
        counter (at most m_blocks per entry); other varlen calls take one block per row
        tile."""
        if varlen and not self.fetches_varlen:
            return (m_blocks, heads, entries_z)
        per_entry = -(-m_blocks // 2) if self.pairs_tiles and not varlen else m_blocks
        return (min(per_entry * heads * entries_z, sm_count),)

    @property
    def fetches_varlen(self) -> bool:
        """Whether its varlen calls take row tiles from a counter (Traits::FETCH_VARLEN: TMA
        forms of at most two consumer warpgroups; three leave the producer too few
        registers)."""
        return self.tma and self.block_m // 64 < 3

    @property
    def pairs_tiles(self) -> bool:
        """Whether a dense call's items are pairs of row tiles (Traits::PAIR_TILES)."""
        return self.mask != MASK_NONE

    def traits_asserts(self) -> tuple:
        return (("FETCH_VARLEN", self.fetches_varlen), ("PAIR_TILES", self.pairs_tiles))

    def target_arch(self, device_arch: str) -> str:
        return "sm_90a"   # wgmma exists only in the arch-specific target

    def runs_on(self, arch: str) -> bool:
        return arch == SM90_ARCH


@dataclass(frozen=True)
class _CombineKey:
    """The key of a kernel that merges fp32 partial rows by their lse (split-KV's combine,
    paged v2's reduce), whose traits are <T, HEAD_DIM, NUM_THREADS, SINKS>; a Variant mixes
    it in."""
    dtype: str = _dtype()
    head_dim: int = key_field("hd{}")   # (compiled) head dim: bounds the per-thread column passes
    threads: int = key_field("t{}")
    sinks: bool = key_field(_flag("sinks"))   # each head's sink logit joins the merged state


@dataclass(frozen=True)
class FlashCombineVariant(_CombineKey, Variant):
    op: ClassVar[str] = "flash_combine"
    header: ClassVar[str] = "flash_combine.cuh"
    kernel: ClassVar[str] = "flash_fwd_combine_kernel"
    traits: ClassVar[str] = "FlashCombineTraits"
    params: ClassVar[ParamsStruct] = FLASH_PARAMS


# ---- flash backward (cuda_src/flash_bwd.cuh) ------------------------------------------------------

def _bwd_smem_bytes(block_m: int, block_n: int, head_dim: int, ds_tiles: int = 1) -> int:
    """Both backward main kernels' tiles: K and V + 2 stages x (Q tile, dO tile, lse2 and D
    rows) + ds_tiles dS^T tiles, 2-byte elements (pinned to their Traits::SMEM_BYTES)."""
    kv = 2 * 2 * block_n * head_dim
    stage = 2 * 2 * block_m * head_dim + 2 * 4 * block_m
    return kv + 2 * stage + ds_tiles * 2 * block_n * block_m


@dataclass(frozen=True)
class FlashBwdVariant(Variant):
    """The backward's main kernel: one block per KV tile, 16 keys per warp (mma.sync)."""
    dtype: str = _dtype()                 # f16 / bf16
    head_dim: int = key_field("hd{}")     # compiled head dim (a multiple of 32)
    block_m: int = key_field("bm{}")      # query rows per tile (a multiple of 32)
    num_warps: int = key_field("w{}")     # BLOCK_N = 16 x num_warps keys
    # queries of a tile whose scores a warp holds at once (a multiple of 16)
    q_chunk: int = key_field("qc{}")
    mask: int = key_field(_mask)        # MASK_NONE / MASK_CAUSAL / MASK_WINDOW
    # FEAT_SOFTCAP / FEAT_ALIBI (sinks change nothing here)
    features: int = key_field(_features, default=0)

    op: ClassVar[str] = "flash_bwd"
    header: ClassVar[str] = "flash_bwd.cuh"
    kernel: ClassVar[str] = "flash_bwd_kernel"
    traits: ClassVar[str] = "FlashBwdTraits"
    params: ClassVar[ParamsStruct] = FLASH_BWD_PARAMS
    smem_from_traits: ClassVar[bool] = True
    # Spill stores (bytes) its forms may show: with every loop unrolled (the fastest forms
    # measured, bench/NOTES.md "Backward") dK, dV and the score chunks sit at the
    # 255-register edge and ptxas spills a few loop-invariant values, up to 140 B at hd128.
    # The compile tests (tests/compiled.py unclean) allow this much for this kernel alone.
    spill_bound: ClassVar[int] = 160

    def __post_init__(self):
        row_tiles = self.block_m // 16
        if self.mask not in _MASK_NAMES or self.features & ~(FEAT_SOFTCAP | FEAT_ALIBI) or \
                self.head_dim % 32 or self.block_m % 32 or self.num_warps % row_tiles or \
                (self.head_dim // (self.num_warps // row_tiles)) % 16 or self.q_chunk % 16 or \
                self.block_m % self.q_chunk:
            raise ValueError(f"FlashBwdVariant: mask 0 to 2 (got {self.mask}), features softcap "
                             f"/ alibi (got {self.features}), head_dim and block_m multiples of "
                             f"32 (got {self.head_dim}, {self.block_m}), num_warps a multiple "
                             f"of block_m / 16 splitting head_dim into k16 steps (got "
                             f"{self.num_warps}), q_chunk a multiple of 16 dividing block_m "
                             f"(got {self.q_chunk})")

    @property
    def block_n(self) -> int:
        return 16 * self.num_warps

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def min_blocks(self) -> int | None:
        return 1      # up to 255 registers: dK and dV of a warp's keys live in registers

    @property
    def dynamic_smem_bytes(self) -> int:
        return _bwd_smem_bytes(self.block_m, self.block_n, self.head_dim)


@dataclass(frozen=True)
class FlashBwdSm90Variant(Variant):
    """The Hopper backward's main kernel (cuda_src/flash_bwd_sm90.cuh): the GEMMs on wgmma,
    64 keys per warpgroup, compiled for sm_90a."""
    dtype: str = _dtype()                 # f16 / bf16
    head_dim: int = key_field("hd{}")     # compiled head dim (a multiple of 64)
    block_m: int = key_field("bm{}")      # query rows per tile (a multiple of 64)
    num_wg: int = key_field("wg{}")       # warpgroups: BLOCK_N = 64 x num_wg keys
    mask: int = key_field(_mask)        # MASK_NONE / MASK_CAUSAL / MASK_WINDOW
    # FEAT_SOFTCAP / FEAT_ALIBI (sinks change nothing here)
    features: int = key_field(_features, default=0)

    op: ClassVar[str] = "flash_bwd_sm90"
    header: ClassVar[str] = "flash_bwd_sm90.cuh"
    kernel: ClassVar[str] = "flash_bwd_sm90_kernel"
    traits: ClassVar[str] = "FlashBwdSm90Traits"
    params: ClassVar[ParamsStruct] = FLASH_BWD_PARAMS
    smem_from_traits: ClassVar[bool] = True
    # Spill stores (bytes) its default forms may show (tests/compiled.py unclean): the
    # producer warpgroup's two roles (loads, dQ adds) in 40 registers spill 88-300 B at hd64 /
    # hd128 (each role alone: 0-48 B); the consumers' 232 hold their tiles (bench/NOTES.md
    # "Hopper backward", v3).
    spill_bound: ClassVar[int] = 320

    def __post_init__(self):
        row_tiles = self.block_m // 64
        if self.mask not in _MASK_NAMES or self.features & ~(FEAT_SOFTCAP | FEAT_ALIBI) or \
                self.head_dim % 64 or self.head_dim > 256 or self.block_m % 64 or \
                not 0 < row_tiles <= self.num_wg <= 2 or self.num_wg % row_tiles or \
                (self.head_dim // (self.num_wg // row_tiles)) % 64:
            raise ValueError(f"FlashBwdSm90Variant: mask 0 to 2 (got {self.mask}), features "
                             f"softcap / alibi (got {self.features}), head_dim a multiple of 64 "
                             f"up to 256 (got {self.head_dim}), block_m a multiple of 64 whose "
                             f"64-row tiles divide num_wg (1 or 2) into groups of whole "
                             f"64-column blocks "
                             f"(got {self.block_m}, {self.num_wg})")

    def target_arch(self, device_arch: str) -> str:
        return "sm_90a"   # wgmma exists only in the arch-specific target

    def runs_on(self, arch: str) -> bool:
        return arch == SM90_ARCH

    @property
    def block_n(self) -> int:
        return 64 * self.num_wg

    @property
    def num_threads(self) -> int:
        return 128 * (self.num_wg + 1)   # the consumers and one producer warpgroup

    @property
    def min_blocks(self) -> int | None:
        return 1      # a register cap at entry (setmaxnreg needs it): the consumers' dK and dV

    @property
    def dynamic_smem_bytes(self) -> int:
        # + 1024 B of alignment slack (the 128-byte swizzle's period)
        # (1024 bytes of alignment slack; two dS^T tiles; 8 mbarriers; the fp32 dQ tile, rows
        # padded by 32 bytes, where it fits in 227 KB)
        base = 1024 + _bwd_smem_bytes(self.block_m, self.block_n, self.head_dim, 2) + 8 * 8
        dq_tile = self.block_m * (self.head_dim * 4 + 32)
        return base + dq_tile if base + dq_tile <= 227 * 1024 else base


@dataclass(frozen=True)
class _BwdRowsKey:
    """The key of a backward kernel that takes one warp per (token, head) row (the pre-pass,
    the dQ convert) or a block per head (the sinks' gradient): <T, HEAD_DIM, THREADS>."""
    dtype: str = _dtype()
    head_dim: int = key_field("hd{}")     # compiled head dim: bounds the per-lane column passes
    threads: int = key_field("t{}")

    header: ClassVar[str] = "flash_bwd.cuh"
    traits: ClassVar[str] = "FlashBwdRowsTraits"
    params: ClassVar[ParamsStruct] = FLASH_BWD_PARAMS

    @property
    def min_blocks(self) -> int:
        # Under the plain bound ptxas (NVRTC 12.9, sm_80) capped the dQ convert at 32
        # registers and spilled 12 B; 4 blocks of 256 threads leave it up to 64.
        return 4


@dataclass(frozen=True)
class FlashBwdPrepVariant(_BwdRowsKey, Variant):
    op: ClassVar[str] = "flash_bwd_prep"
    kernel: ClassVar[str] = "flash_bwd_prep_kernel"


@dataclass(frozen=True)
class FlashBwdDqVariant(_BwdRowsKey, Variant):
    op: ClassVar[str] = "flash_bwd_dq"
    kernel: ClassVar[str] = "flash_bwd_dq_kernel"


@dataclass(frozen=True)
class FlashBwdDsinksVariant(_BwdRowsKey, Variant):
    op: ClassVar[str] = "flash_bwd_dsinks"
    kernel: ClassVar[str] = "flash_bwd_dsinks_kernel"


# ---- merge (cuda_src/merge_attn_states.cuh) --------------------------------------------------------

@dataclass(frozen=True)
class MergeVariant(Variant):
    dtype: str = _dtype()               # f16 / bf16
    head_size: int = key_field("hd{}")
    # k states on a leading axis (merge_states) vs two arrays
    stacked: bool = key_field(lambda s: ("stack" if s else "pair",))
    threads: int = key_field("t{}")

    traits_order = ("dtype", "head_size", "threads", "stacked")

    op: ClassVar[str] = "merge"
    header: ClassVar[str] = "merge_attn_states.cuh"
    kernel: ClassVar[str] = "merge_attn_states_kernel"
    traits: ClassVar[str] = "MergeTraits"
    params: ClassVar[ParamsStruct] = MERGE_PARAMS

    @property
    def min_blocks(self) -> int:
        # Every thread's loads wait on its own (one 16-byte row per state, behind the state's
        # weight), so threads in flight set the pace: 2048 per SM needs <= 32 registers.
        # Without the bound the stacked form took 36 (7 blocks per SM) and merge_states of
        # 4 states ran 8% slower (bench/ab.py, H200).
        return 2048 // self.threads


# ---- paged decode (cuda_src/paged_attention*.cuh, paged_reduce.cuh, reshape_and_cache.cuh) ----

@dataclass(frozen=True)
class PagedSimtVariant(Variant):
    """The CUDA-core form (cuda_src/paged_attention.cuh): fp8 caches, any head size."""
    dtype: str = _dtype()                 # q / out: f16 / bf16
    cache_dtype: str = _dtype("kv")       # f16 / bf16 (same as dtype) or e4m3
    head_size: int = key_field("hd{}")
    block_size: int = key_field("bs{}")
    group: int = key_field("g{}")         # query heads per thread block (divides the GQA ratio)
    # 0 = v1 (whole sequence), else v2's partition in tokens
    partition_size: int = key_field(_partition)
    alibi: bool = key_field(_alibi)
    threads: int = key_field("t{}")
    softcap: bool = key_field(_flag("cap"), default=False)
    # v1 only (v2's sinks join in the reduce)
    sinks: bool = key_field(_flag("sink"), default=False)

    op: ClassVar[str] = "paged"
    header: ClassVar[str] = "paged_attention.cuh"
    kernel: ClassVar[str] = "paged_attention_kernel"
    traits: ClassVar[str] = "PagedSimtTraits"
    params: ClassVar[ParamsStruct] = PAGED_PARAMS

    @property
    def min_blocks(self) -> int:
        # With a minimum of blocks per SM ptxas keeps the 255-register cap of 128-thread
        # blocks (the form as measured, bench/NOTES.md paged round 2); under the plain bound
        # it squeezed the group-8 kernels from 167 to 96 registers (NVRTC 13.0, sm_90).
        return 1

    def logits_stride(self, max_context: int) -> int:
        """Floats per head of the dynamic shared logits buffer (also holds the V slot sums)."""
        tokens = self.partition_size or max_context
        return max(-(-tokens // 4) * 4, self.threads)

    def logits_bytes(self, max_context: int) -> int:
        """The dynamic shared memory of a call whose sequences span up to max_context."""
        return 4 * self.group * self.logits_stride(max_context)

    @property
    def dynamic_smem_bytes(self) -> int:
        # v2: fixed by the partition; v1: per call (logits_bytes), its limit raised by the plan
        return self.logits_bytes(0) if self.partition_size else 0


@dataclass(frozen=True)
class PagedMmaVariant(Variant):
    """The tensor-core form (cuda_src/paged_attention_mma.cuh): 16-bit caches, head sizes
    that are multiples of 16; same params, grid and outputs as PagedSimtVariant."""
    dtype: str = _dtype()                 # q / out / caches: f16 / bf16
    head_size: int = key_field("hd{}")
    block_size: int = key_field("bs{}")
    # query heads per thread block, <= 8 (N columns: tokens x group)
    group: int = key_field("g{}")
    # 0 = v1 (whole sequence), else v2's partition in tokens
    partition_size: int = key_field(_partition)
    alibi: bool = key_field(_alibi)
    num_warps: int = key_field("w{}")     # the ring (tuning.PagedMmaTiles)
    stages: int = key_field("st{}")
    softcap: bool = key_field(_flag("cap"), default=False)
    # v1 only (v2's sinks join in the reduce)
    sinks: bool = key_field(_flag("sink"), default=False)
    nhd: bool = key_field(_flag("nhd"), default=False)      # the NHD cache layout
    # query tokens per sequence (> 1: multi-token decode, paged_prefill)
    tokens: int = key_field(lambda t: (f"q{t}",) if t > 1 else (), default=1)

    op: ClassVar[str] = "paged_mma"
    header: ClassVar[str] = "paged_attention_mma.cuh"
    kernel: ClassVar[str] = "paged_attention_mma_kernel"
    traits: ClassVar[str] = "PagedMmaTraits"
    params: ClassVar[ParamsStruct] = PAGED_PARAMS
    smem_from_traits: ClassVar[bool] = True
    TILE: ClassVar[int] = 16      # tokens per warp step (PagedMmaTraits::TILE)

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def min_blocks(self) -> int:
        # Shared memory, not registers, bounds the blocks per SM (2 at hd128); under a plain
        # __launch_bounds__(threads) ptxas capped some rings at 96 registers and spilled
        # (NVRTC 12.x, sm_90, stages 4), while (threads, 1) leaves it 150-230 spill-free.
        return 1

    @property
    def dynamic_smem_bytes(self) -> int:
        # PagedMmaTraits::SMEM_BYTES: each warp's ring, stages x (K tile + V tile), 2-byte
        # elements, and with more than one n-tile Q^T after them; or, if more, the epilogue's
        # fp32 merge of every warp's O^T (8 columns an n-tile, rows padded by 4)
        ring = self.num_warps * self.stages * 2 * self.TILE * self.head_size * 2
        n_tiles = -(-self.tokens * self.group // 8)
        q = 8 * -(-n_tiles // 2) * 2 * (self.head_size + 8) * 2 if n_tiles > 1 else 0
        return max(ring + q, self.num_warps * 8 * n_tiles * (self.head_size + 4) * 4)


@dataclass(frozen=True)
class PagedReduceVariant(_CombineKey, Variant):
    """threads: 4 dims per thread in whole warps, times thread groups (tuning)."""
    op: ClassVar[str] = "paged_reduce"
    header: ClassVar[str] = "paged_reduce.cuh"
    kernel: ClassVar[str] = "paged_attention_reduce_kernel"
    traits: ClassVar[str] = "PagedReduceTraits"
    params: ClassVar[ParamsStruct] = PAGED_REDUCE_PARAMS


@dataclass(frozen=True)
class ReshapeCacheVariant(Variant):
    dtype: str = _dtype()                 # key / value
    cache_dtype: str = _dtype("kv")
    slot64: bool = key_field(lambda s: ("s64" if s else "s32",))   # slot_mapping int64 (else int32)
    threads: int = key_field("t{}")

    op: ClassVar[str] = "reshape_and_cache"
    header: ClassVar[str] = "reshape_and_cache.cuh"
    kernel: ClassVar[str] = "reshape_and_cache_kernel"
    traits: ClassVar[str] = "ReshapeCacheTraits"
    params: ClassVar[ParamsStruct] = RESHAPE_PARAMS


@dataclass(frozen=True)
class FlashInferTablesVariant(Variant):
    threads: int = key_field("t{}")

    op: ClassVar[str] = "flashinfer_tables"
    header: ClassVar[str] = "flashinfer_tables.cuh"
    kernel: ClassVar[str] = "flashinfer_tables_kernel"
    traits: ClassVar[str] = "FlashInferTablesTraits"
    params: ClassVar[ParamsStruct] = FLASHINFER_TABLES_PARAMS


@dataclass(frozen=True)
class KvCacheAppendVariant(Variant):
    dtype: str = _dtype()
    threads: int = key_field("t{}")

    op: ClassVar[str] = "kvcache_append"
    header: ClassVar[str] = "kvcache_append.cuh"
    kernel: ClassVar[str] = "kvcache_append_kernel"
    traits: ClassVar[str] = "KvCacheAppendTraits"
    params: ClassVar[ParamsStruct] = KVCACHE_APPEND_PARAMS


@dataclass(frozen=True)
class QuantizeE4m3Variant(Variant):
    """e4m3 queries from 16-bit ones (cuda_src/quantize_e4m3.cuh): paged_prefill's q_scale."""
    dtype: str = _dtype()                 # the input's: f16 / bf16
    threads: int = key_field("t{}")

    op: ClassVar[str] = "quantize_e4m3"
    header: ClassVar[str] = "quantize_e4m3.cuh"
    kernel: ClassVar[str] = "quantize_e4m3_kernel"
    traits: ClassVar[str] = "QuantizeE4m3Traits"
    params: ClassVar[ParamsStruct] = QUANTIZE_PARAMS
