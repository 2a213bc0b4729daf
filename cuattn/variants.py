"""The variant keys of every kernel and their parameter structs: the Python mirror of cuda_src/.

Each key is pure data (cuattn.jit.Variant): the values of one C++ traits type, which the
generated entry point instantiates; ``cuattn.tuning`` is what chooses them. Each params
struct mirrors a header under cuda_src/params/. ``shipped(ops)`` is the set
``python -m cuattn precompile`` builds by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ._dtypes import BY_SHORT
from .jit import ParamsStruct, Variant

# ---- params structs (cuda_src/params/*.cuh) ---------------------------------------------------

FLASH_PARAMS = ParamsStruct("FlashFwdParams", [
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("out", "out"), ("lse", "out"),
    ("oaccum", "out"), ("lseaccum", "out"), ("cu_seqlens_q", "ptr"), ("cu_seqlens_k", "ptr"),
    ("block_tables", "ptr"), ("seqused_k", "ptr"), ("alibi_slopes", "ptr"), ("sinks", "ptr"),
    ("k_scales", "ptr"), ("v_scales", "ptr"), ("q_descale", "ptr"), ("k_descale", "ptr"),
    ("v_descale", "ptr"),
    ("q_stride_batch", "i64"), ("q_stride_row", "i64"), ("q_stride_head", "i64"),
    ("k_stride_batch", "i64"), ("k_stride_row", "i64"), ("k_stride_head", "i64"),
    ("v_stride_batch", "i64"), ("v_stride_row", "i64"), ("v_stride_head", "i64"),
    ("o_stride_batch", "i64"), ("o_stride_row", "i64"), ("o_stride_head", "i64"),
    ("lse_stride_batch", "i64"), ("lse_stride_head", "i64"), ("lse_stride_row", "i64"),
    ("k_stride_block", "i64"), ("v_stride_block", "i64"), ("k_stride_chunk", "i64"),
    ("v_stride_dim", "i64"), ("bt_stride_seq", "i64"),
    ("batch", "i32"), ("num_heads", "i32"), ("head_group", "i32"), ("seqlen_q", "i32"),
    ("seqlen_k", "i32"), ("total_q", "i32"), ("head_dim", "i32"), ("window_left", "i32"),
    ("window_right", "i32"), ("num_splits", "i32"), ("block_shift", "i32"),
    ("max_blocks_per_seq", "i32"), ("new_keys", "i32"),
    ("scale_log2", "f32"), ("softmax_scale_inv", "f32"), ("softcap_in", "f32"),
    ("softcap_out", "f32"), ("v_scale", "f32"), ("m_blocks", "i32"),
    ("k_scales_stride", "i32"), ("v_scales_stride", "i32"), ("alibi_stride_batch", "i32"),
    ("q_descale_stride_batch", "i32"), ("q_descale_stride_head", "i32"),
    ("k_descale_stride_batch", "i32"), ("k_descale_stride_head", "i32"),
    ("v_descale_stride_batch", "i32"), ("v_descale_stride_head", "i32"),
])

FLASH_BWD_PARAMS = ParamsStruct("FlashBwdParams", [
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("out", "ptr"), ("dout", "ptr"), ("lse", "ptr"),
    ("dq", "out"), ("dk", "out"), ("dv", "out"), ("dq_accum", "out"), ("dsum", "out"),
    ("lse2", "out"), ("cu_seqlens_q", "ptr"), ("cu_seqlens_k", "ptr"), ("alibi_slopes", "ptr"),
    ("sinks", "ptr"), ("dsinks", "out"),
    ("q_stride_batch", "i64"), ("q_stride_row", "i64"), ("q_stride_head", "i64"),
    ("k_stride_batch", "i64"), ("k_stride_row", "i64"), ("k_stride_head", "i64"),
    ("v_stride_batch", "i64"), ("v_stride_row", "i64"), ("v_stride_head", "i64"),
    ("o_stride_batch", "i64"), ("o_stride_row", "i64"), ("o_stride_head", "i64"),
    ("do_stride_batch", "i64"), ("do_stride_row", "i64"), ("do_stride_head", "i64"),
    ("dq_stride_batch", "i64"), ("dq_stride_row", "i64"), ("dq_stride_head", "i64"),
    ("dk_stride_batch", "i64"), ("dk_stride_row", "i64"), ("dk_stride_head", "i64"),
    ("dv_stride_batch", "i64"), ("dv_stride_row", "i64"), ("dv_stride_head", "i64"),
    ("lse_stride_batch", "i64"), ("lse_stride_head", "i64"), ("lse_stride_row", "i64"),
    ("batch", "i32"), ("num_heads", "i32"), ("head_group", "i32"), ("seqlen_q", "i32"),
    ("seqlen_k", "i32"), ("total_q", "i32"), ("head_dim", "i32"), ("window_left", "i32"),
    ("window_right", "i32"), ("dq_slices", "i32"), ("deterministic", "i32"),
    ("scale_log2", "f32"), ("softmax_scale", "f32"), ("softmax_scale_inv", "f32"),
    ("softcap_in", "f32"), ("softcap_out", "f32"), ("alibi_stride_batch", "i32"),
    ("lpt_group", "i32"),
])

MERGE_PARAMS = ParamsStruct("MergeParams", [
    ("out", "out"), ("out_lse", "out"),
    ("a_out", "ptr"), ("a_lse", "ptr"), ("b_out", "ptr"), ("b_lse", "ptr"),
    ("out_stride_token", "i64"), ("out_stride_head", "i64"),
    ("lse_stride_head", "i64"), ("lse_stride_token", "i64"),
    ("a_stride_token", "i64"), ("a_stride_head", "i64"),
    ("a_lse_stride_head", "i64"), ("a_lse_stride_token", "i64"),
    ("b_stride_token", "i64"), ("b_stride_head", "i64"),
    ("b_lse_stride_head", "i64"), ("b_lse_stride_token", "i64"),
    ("state_stride", "i64"), ("lse_state_stride", "i64"),
    ("num_states", "i32"), ("num_tokens", "i32"), ("num_heads", "i32"),
])

PAGED_PARAMS = ParamsStruct("PagedParams", [
    ("out", "out"), ("lse", "out"), ("tmp_out", "out"), ("tmp_lse", "out"), ("q", "ptr"),
    ("k_cache", "ptr"), ("v_cache", "ptr"), ("block_tables", "ptr"), ("seq_lens", "ptr"),
    ("alibi_slopes", "ptr"), ("sinks", "ptr"), ("cu_seqlens_q", "ptr"), ("k_scales", "ptr"),
    ("v_scales", "ptr"),
    ("q_stride_seq", "i64"), ("q_stride_head", "i64"),
    ("out_stride_seq", "i64"), ("out_stride_head", "i64"),
    ("lse_stride_head", "i64"), ("lse_stride_seq", "i64"),
    ("k_stride_block", "i64"), ("k_stride_head", "i64"), ("k_stride_x", "i64"),
    ("k_stride_token", "i64"),
    ("v_stride_block", "i64"), ("v_stride_head", "i64"), ("v_stride_dim", "i64"),
    ("v_stride_token", "i64"), ("bt_stride_seq", "i64"),
    ("scale_log2", "f32"), ("v_scale", "f32"), ("softcap_in", "f32"), ("softcap_out", "f32"),
    ("num_seqs", "i32"), ("num_heads", "i32"), ("gqa_ratio", "i32"),
    ("max_blocks_per_seq", "i32"), ("max_parts", "i32"), ("logits_stride", "i32"),
    ("window_left", "i32"), ("window_right", "i32"), ("k_scales_stride", "i32"),
    ("v_scales_stride", "i32"), ("alibi_stride_seq", "i32"),
])

PAGED_REDUCE_PARAMS = ParamsStruct("PagedReduceParams", [
    ("out", "out"), ("lse", "out"), ("tmp_out", "ptr"), ("tmp_lse", "ptr"), ("seq_lens", "ptr"),
    ("sinks", "ptr"), ("cu_seqlens_q", "ptr"),
    ("out_stride_seq", "i64"), ("out_stride_head", "i64"),
    ("lse_stride_head", "i64"), ("lse_stride_seq", "i64"),
    ("num_heads", "i32"), ("max_parts", "i32"), ("partition_size", "i32"),
    ("max_seq_len", "i32"), ("num_seqs", "i32"),
])

RESHAPE_PARAMS = ParamsStruct("ReshapeCacheParams", [
    ("key", "ptr"), ("value", "ptr"), ("k_cache", "out"), ("v_cache", "out"),
    ("slot_mapping", "ptr"), ("k_scales", "ptr"), ("v_scales", "ptr"),
    ("key_stride_token", "i64"), ("key_stride_head", "i64"),
    ("value_stride_token", "i64"), ("value_stride_head", "i64"),
    ("k_stride_block", "i64"), ("k_stride_head", "i64"), ("k_stride_x", "i64"),
    ("k_stride_token", "i64"),
    ("v_stride_block", "i64"), ("v_stride_head", "i64"), ("v_stride_dim", "i64"),
    ("v_stride_token", "i64"),
    ("k_scale", "f32"), ("v_scale", "f32"),
    ("num_tokens", "i32"), ("num_kv_heads", "i32"), ("head_size", "i32"), ("block_size", "i32"),
    ("k_scales_stride", "i32"), ("v_scales_stride", "i32"),
])

FLASHINFER_TABLES_PARAMS = ParamsStruct("FlashInferTablesParams", [
    ("kv_indptr", "ptr"), ("kv_indices", "ptr"), ("kv_last_page_len", "ptr"),
    ("block_tables", "out"), ("seq_lens", "out"),
    ("bt_stride_seq", "i64"),
    ("num_indices", "i32"), ("max_blocks_per_seq", "i32"), ("page_size", "i32"),
])

KVCACHE_APPEND_PARAMS = ParamsStruct("KvCacheAppendParams", [
    ("k", "ptr"), ("v", "ptr"), ("cache_seqlens", "ptr"), ("cache_batch_idx", "ptr"),
    ("k_cache", "out"), ("v_cache", "out"),
    ("k_stride_batch", "i64"), ("k_stride_row", "i64"), ("k_stride_head", "i64"),
    ("v_stride_batch", "i64"), ("v_stride_row", "i64"), ("v_stride_head", "i64"),
    ("kc_stride_batch", "i64"), ("kc_stride_row", "i64"), ("kc_stride_head", "i64"),
    ("vc_stride_batch", "i64"), ("vc_stride_row", "i64"), ("vc_stride_head", "i64"),
    ("num_heads_kv", "i32"), ("head_dim", "i32"), ("seqlen_cache", "i32"),
    ("batch_cache", "i32"), ("cache_len", "i32"),
])

QUANTIZE_PARAMS = ParamsStruct("QuantizeE4m3Params", [
    ("x", "ptr"), ("out", "out"), ("scales", "ptr"),
    ("x_stride_row", "i64"), ("x_stride_head", "i64"),
    ("out_stride_row", "i64"), ("out_stride_head", "i64"),
    ("scale", "f32"), ("num_heads", "i32"), ("head_dim", "i32"), ("head_group", "i32"),
    ("scales_stride", "i32"),
])

# Mask kinds of the flash kernel (cuda_src/common/mask.cuh kMask*).
MASK_NONE, MASK_CAUSAL, MASK_WINDOW = 0, 1, 2
_MASK_NAMES = {MASK_NONE: "c0", MASK_CAUSAL: "c1", MASK_WINDOW: "win"}
# K/V sources of the flash kernel (cuda_src/flash_fwd.cuh kKv*): dense, or a paged cache.
KV_DENSE, KV_PAGED_NHD, KV_PAGED_VLLM = 0, 1, 2
_KV_NAMES = {KV_DENSE: (), KV_PAGED_NHD: ("nhd",), KV_PAGED_VLLM: ("vllm",)}
# Feature bits of the flash kernel (cuda_src/flash_fwd.cuh k*): logits hooks, sinks, and the
# query heads of one KV head packed into a block's rows.
FEAT_SOFTCAP, FEAT_ALIBI, FEAT_SINKS, FEAT_PACK_GQA = 1, 2, 4, 8
_FEATURE_NAMES = ((FEAT_SOFTCAP, "cap"), (FEAT_ALIBI, "alibi"), (FEAT_SINKS, "sink"),
                  (FEAT_PACK_GQA, "gqa"))


def _feature_parts(features: int) -> tuple[str, ...]:
    """The name parts of a flash kernel's FEAT_* bits."""
    return tuple(name for bit, name in _FEATURE_NAMES if features & bit)


# The architecture of the Hopper forward kernel (sm_90a machine code runs on sm_90 only).
SM90_ARCH = "sm_90"


# ---- flash (cuda_src/flash_fwd.cuh) -------------------------------------------------------------

@dataclass(frozen=True)
class FlashFwdVariant(Variant):
    dtype: str            # f16 / bf16
    head_dim: int         # compiled head dim (a multiple of 32)
    block_m: int
    block_n: int
    num_warps: int
    stages: int
    mask: int             # MASK_NONE / MASK_CAUSAL / MASK_WINDOW
    split: bool           # write fp32 partials for the split-KV combine
    q_smem: int           # FlashFwdTraits' knobs (cuda_src/flash_fwd.cuh, tuning.FlashTiles)
    kv_split: bool
    softmax: int
    kv: int = KV_DENSE    # the K/V source
    features: int = 0     # FEAT_* bits
    fp8: bool = False     # a paged fp8 e4m3 cache, widened in shared memory

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

    def name_parts(self):
        parts = (self.dtype, f"hd{self.head_dim}", f"bm{self.block_m}", f"bn{self.block_n}",
                 f"w{self.num_warps}", f"st{self.stages}", _MASK_NAMES[self.mask])
        qs = {0: (), 1: ("qs",)}.get(self.q_smem, (f"qs{self.q_smem}",))
        knobs = qs + (("kvs",) if self.kv_split else ()) + \
            ((f"sm{self.softmax}",) if self.softmax else ())
        return parts + knobs + (("split",) if self.split else ()) + _KV_NAMES[self.kv] + \
            (("e4m3",) if self.fp8 else ()) + _feature_parts(self.features)

    def traits_args(self):
        return (BY_SHORT[self.dtype].cpp, self.head_dim, self.block_m, self.block_n,
                self.num_warps, self.stages, self.mask, self.split, self.q_smem, self.kv_split,
                self.softmax, self.kv, self.features, self.fp8)

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
    dtype: str            # f16 / bf16, or e4m3 (the FP8 form)
    head_dim: int         # compiled head dim (a multiple of 64; e4m3: of 128)
    block_m: int          # 64 query rows per warpgroup
    block_n: int
    stages: int
    mask: int             # MASK_NONE / MASK_CAUSAL / MASK_WINDOW
    split: bool           # write fp32 partials for the split-KV combine
    features: int = 0     # FEAT_* bits but FEAT_PACK_GQA
    tma: bool = False     # the producer loads by TMA (tensor maps of Q / K / V), else cp.async
    kv: int = KV_DENSE    # dense K / V, or a paged cache (paged_prefill; by TMA only)
    out: str = ""         # e4m3: the output's dtype (f16 / bf16); else "" (the inputs')

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

    def name_parts(self):
        return (self.dtype, f"hd{self.head_dim}", f"bm{self.block_m}", f"bn{self.block_n}",
                f"st{self.stages}") + (("tma",) if self.tma else ()) + \
            (_MASK_NAMES[self.mask],) + (("split",) if self.split else ()) + \
            _KV_NAMES[self.kv] + _feature_parts(self.features) + \
            ((f"o{self.out}",) if self.out else ())

    def traits_args(self):
        return (BY_SHORT[self.dtype].cpp, self.head_dim, self.block_m, self.block_n,
                self.stages, self.tma, self.mask, self.split, self.features, self.kv) + \
            ((BY_SHORT[self.out].cpp,) if self.out else ())

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
    dtype: str
    head_dim: int         # (compiled) head dim: bounds the per-thread column passes
    threads: int
    sinks: bool           # each head's sink logit joins the merged state

    def name_parts(self):
        return (self.dtype, f"hd{self.head_dim}", f"t{self.threads}") + \
            (("sinks",) if self.sinks else ())

    def traits_args(self):
        return (BY_SHORT[self.dtype].cpp, self.head_dim, self.threads, self.sinks)


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
    dtype: str            # f16 / bf16
    head_dim: int         # compiled head dim (a multiple of 32)
    block_m: int          # query rows per tile (a multiple of 32)
    num_warps: int        # BLOCK_N = 16 x num_warps keys
    q_chunk: int          # queries of a tile whose scores a warp holds at once (a multiple of 16)
    mask: int             # MASK_NONE / MASK_CAUSAL / MASK_WINDOW
    features: int = 0     # FEAT_SOFTCAP / FEAT_ALIBI (sinks change nothing here)

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

    def name_parts(self):
        return (self.dtype, f"hd{self.head_dim}", f"bm{self.block_m}", f"w{self.num_warps}",
                f"qc{self.q_chunk}", _MASK_NAMES[self.mask]) + _feature_parts(self.features)

    def traits_args(self):
        return (BY_SHORT[self.dtype].cpp, self.head_dim, self.block_m, self.num_warps,
                self.q_chunk, self.mask, self.features)

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
    dtype: str            # f16 / bf16
    head_dim: int         # compiled head dim (a multiple of 64)
    block_m: int          # query rows per tile (a multiple of 64)
    num_wg: int           # warpgroups: BLOCK_N = 64 x num_wg keys
    mask: int             # MASK_NONE / MASK_CAUSAL / MASK_WINDOW
    features: int = 0     # FEAT_SOFTCAP / FEAT_ALIBI (sinks change nothing here)

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

    def name_parts(self):
        return (self.dtype, f"hd{self.head_dim}", f"bm{self.block_m}", f"wg{self.num_wg}",
                _MASK_NAMES[self.mask]) + _feature_parts(self.features)

    def traits_args(self):
        return (BY_SHORT[self.dtype].cpp, self.head_dim, self.block_m, self.num_wg, self.mask,
                self.features)

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
    dtype: str
    head_dim: int         # compiled head dim: bounds the per-lane column passes
    threads: int

    header: ClassVar[str] = "flash_bwd.cuh"
    traits: ClassVar[str] = "FlashBwdRowsTraits"
    params: ClassVar[ParamsStruct] = FLASH_BWD_PARAMS

    def name_parts(self):
        return (self.dtype, f"hd{self.head_dim}", f"t{self.threads}")

    def traits_args(self):
        return (BY_SHORT[self.dtype].cpp, self.head_dim, self.threads)

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
    dtype: str          # f16 / bf16
    head_size: int
    stacked: bool       # k states on a leading axis (merge_states) vs two arrays
    threads: int

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

    def name_parts(self):
        return (self.dtype, f"hd{self.head_size}", "stack" if self.stacked else "pair",
                f"t{self.threads}")

    def traits_args(self):
        return (BY_SHORT[self.dtype].cpp, self.head_size, self.threads, self.stacked)


# ---- paged decode (cuda_src/paged_attention*.cuh, paged_reduce.cuh, reshape_and_cache.cuh) ----

def _hook_names(key) -> tuple:
    return (("cap",) if key.softcap else ()) + (("sink",) if key.sinks else ())


@dataclass(frozen=True)
class PagedSimtVariant(Variant):
    """The CUDA-core form (cuda_src/paged_attention.cuh): fp8 caches, any head size."""
    dtype: str            # q / out: f16 / bf16
    cache_dtype: str      # f16 / bf16 (same as dtype) or e4m3
    head_size: int
    block_size: int
    group: int            # query heads per thread block (divides the GQA ratio)
    partition_size: int   # 0 = v1 (whole sequence), else v2's partition in tokens
    alibi: bool
    threads: int
    softcap: bool = False
    sinks: bool = False   # v1 only (v2's sinks join in the reduce)

    op: ClassVar[str] = "paged"
    header: ClassVar[str] = "paged_attention.cuh"
    kernel: ClassVar[str] = "paged_attention_kernel"
    traits: ClassVar[str] = "PagedSimtTraits"
    params: ClassVar[ParamsStruct] = PAGED_PARAMS

    def name_parts(self):
        return (self.dtype, f"kv{self.cache_dtype}", f"hd{self.head_size}", f"bs{self.block_size}",
                f"g{self.group}", f"p{self.partition_size}" if self.partition_size else "v1",
                f"a{int(self.alibi)}", f"t{self.threads}") + _hook_names(self)

    def traits_args(self):
        return (BY_SHORT[self.dtype].cpp, BY_SHORT[self.cache_dtype].cpp, self.head_size,
                self.block_size, self.group, self.partition_size, self.alibi, self.threads,
                self.softcap, self.sinks)

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
    dtype: str            # q / out / caches: f16 / bf16
    head_size: int
    block_size: int
    group: int            # query heads per thread block, <= 8 (N columns: tokens x group)
    partition_size: int   # 0 = v1 (whole sequence), else v2's partition in tokens
    alibi: bool
    num_warps: int        # the ring (tuning.PagedMmaTiles)
    stages: int
    softcap: bool = False
    sinks: bool = False   # v1 only (v2's sinks join in the reduce)
    nhd: bool = False     # the NHD cache layout
    tokens: int = 1       # query tokens per sequence (> 1: multi-token decode, paged_prefill)

    op: ClassVar[str] = "paged_mma"
    header: ClassVar[str] = "paged_attention_mma.cuh"
    kernel: ClassVar[str] = "paged_attention_mma_kernel"
    traits: ClassVar[str] = "PagedMmaTraits"
    params: ClassVar[ParamsStruct] = PAGED_PARAMS
    smem_from_traits: ClassVar[bool] = True
    TILE: ClassVar[int] = 16      # tokens per warp step (PagedMmaTraits::TILE)

    def name_parts(self):
        return (self.dtype, f"hd{self.head_size}", f"bs{self.block_size}", f"g{self.group}",
                f"p{self.partition_size}" if self.partition_size else "v1",
                f"a{int(self.alibi)}", f"w{self.num_warps}", f"st{self.stages}") + \
            _hook_names(self) + (("nhd",) if self.nhd else ()) + \
            ((f"q{self.tokens}",) if self.tokens > 1 else ())

    def traits_args(self):
        return (BY_SHORT[self.dtype].cpp, self.head_size, self.block_size, self.group,
                self.partition_size, self.alibi, self.num_warps, self.stages, self.softcap,
                self.sinks, self.nhd, self.tokens)

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
    dtype: str            # key / value
    cache_dtype: str
    slot64: bool          # slot_mapping int64 (else int32)
    threads: int

    op: ClassVar[str] = "reshape_and_cache"
    header: ClassVar[str] = "reshape_and_cache.cuh"
    kernel: ClassVar[str] = "reshape_and_cache_kernel"
    traits: ClassVar[str] = "ReshapeCacheTraits"
    params: ClassVar[ParamsStruct] = RESHAPE_PARAMS

    def name_parts(self):
        return (self.dtype, f"kv{self.cache_dtype}", "s64" if self.slot64 else "s32",
                f"t{self.threads}")

    def traits_args(self):
        return (BY_SHORT[self.dtype].cpp, BY_SHORT[self.cache_dtype].cpp, self.slot64,
                self.threads)


@dataclass(frozen=True)
class FlashInferTablesVariant(Variant):
    threads: int

    op: ClassVar[str] = "flashinfer_tables"
    header: ClassVar[str] = "flashinfer_tables.cuh"
    kernel: ClassVar[str] = "flashinfer_tables_kernel"
    traits: ClassVar[str] = "FlashInferTablesTraits"
    params: ClassVar[ParamsStruct] = FLASHINFER_TABLES_PARAMS

    def name_parts(self):
        return (f"t{self.threads}",)

    def traits_args(self):
        return (self.threads,)


@dataclass(frozen=True)
class KvCacheAppendVariant(Variant):
    dtype: str
    threads: int

    op: ClassVar[str] = "kvcache_append"
    header: ClassVar[str] = "kvcache_append.cuh"
    kernel: ClassVar[str] = "kvcache_append_kernel"
    traits: ClassVar[str] = "KvCacheAppendTraits"
    params: ClassVar[ParamsStruct] = KVCACHE_APPEND_PARAMS

    def name_parts(self):
        return (self.dtype, f"t{self.threads}")

    def traits_args(self):
        return (BY_SHORT[self.dtype].cpp, self.threads)


@dataclass(frozen=True)
class QuantizeE4m3Variant(Variant):
    """e4m3 queries from 16-bit ones (cuda_src/quantize_e4m3.cuh): paged_prefill's q_scale."""
    dtype: str            # the input's: f16 / bf16
    threads: int

    op: ClassVar[str] = "quantize_e4m3"
    header: ClassVar[str] = "quantize_e4m3.cuh"
    kernel: ClassVar[str] = "quantize_e4m3_kernel"
    traits: ClassVar[str] = "QuantizeE4m3Traits"
    params: ClassVar[ParamsStruct] = QUANTIZE_PARAMS

    def name_parts(self):
        return (self.dtype, f"t{self.threads}")

    def traits_args(self):
        return (BY_SHORT[self.dtype].cpp, self.threads)


# ---- the shipped set -------------------------------------------------------------------------------

def shipped(ops: list[str] | None = None, arch: str | None = None) -> list[Variant]:
    """What ``python -m cuattn precompile`` builds: every variant a default call with a
    shipped size reaches (cuattn.tuning.SHIPPED has the lists), for any architecture, or
    (``arch``) those a device of that architecture can run."""
    from . import tuning
    ops = list(tuning.SHIPPED) if not ops else ops
    unknown = [op for op in ops if op not in tuning.SHIPPED]
    if unknown:
        raise ValueError(f"--ops: unknown op(s) {unknown}; known: {sorted(tuning.SHIPPED)}")
    out: dict[Variant, None] = {}
    for op in ops:
        out.update(dict.fromkeys(tuning.SHIPPED[op]()))
    return [v for v in out if arch is None or v.runs_on(arch)]
