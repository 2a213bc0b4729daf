"""The two forms of the paged decode kernel, behind one interface.

Both take the same params struct, grid and outputs, and share the v2 partition reduce; they
differ in what they can run, how "auto" picks v1 or v2, and what v1 needs at launch:
- MmaForm (cuda_src/paged_attention_mma.cuh): tensor cores, 16-bit caches, head sizes that
  are multiples of 16; v1 keeps no logits, so it has no length limit.
- SimtForm (cuda_src/paged_attention.cuh): CUDA cores, every cache and head size; v1 keeps
  a sequence's logits in dynamic shared memory, which bounds its length.
``form_for`` returns the one cuattn.tuning chooses.
"""
from __future__ import annotations

import functools

import cupy

from .. import tuning
from .._launch import NULL, Launch
from ..jit import Variant, device_info, get_kernel, max_dynamic_smem, set_max_dynamic_smem
from ..param_structs import PAGED_PARAMS, PAGED_REDUCE_PARAMS


class V1TooLong(ValueError):
    """v1 of the CUDA-core form cannot hold the logits of sequences this long."""


class PagedForm:
    name: str

    def variant(self, dtype: str, cache: str, head_size: int, block_size: int, group: int,
                partition_size: int, alibi: bool, softcap: bool = False, sinks: bool = False,
                nhd: bool = False) -> Variant:
        """The main kernel's key (partition_size 0: v1)."""
        raise NotImplementedError

    def choose(self, version: str, partition_size: int | None, num_ctas_v1: int,
               max_context: int, device_id: int, v1_key: Variant) -> tuple[str, int]:
        """(version, partition_size) a call runs: "auto" by this form's rule, and v2's
        partition when the call names none."""
        raise NotImplementedError

    def v1_launch(self, key: Variant, max_context: int, device_id: int):
        """(kernel, dynamic shared memory bytes, logits_stride) of v1; V1TooLong when the
        sequences can be too long for it."""
        raise NotImplementedError

    def logits_stride(self, key: Variant) -> int:
        """The logits_stride field of v2 (0: the form keeps no logits)."""
        return 0


class MmaForm(PagedForm):
    name = "mma"

    def variant(self, dtype, cache, head_size, block_size, group, partition_size, alibi,
                softcap=False, sinks=False, nhd=False):
        return tuning.paged_mma_variant(dtype, head_size, block_size, group, partition_size,
                                        alibi, softcap, sinks, nhd)

    def choose(self, version, partition_size, num_ctas_v1, max_context, device_id, v1_key):
        num_sms = device_info(device_id).sm_count
        if version == "auto":
            return tuning.paged_mma_plan(num_ctas_v1, max_context, num_sms, partition_size)
        if version == "v2" and partition_size is None:
            return "v2", tuning.paged_mma_partition(num_ctas_v1, max_context, num_sms)
        return version, partition_size or 0

    def v1_launch(self, key, max_context, device_id):
        return get_kernel(key, device_id), key.dynamic_smem_bytes, 0


class SimtForm(PagedForm):
    name = "simt"

    def variant(self, dtype, cache, head_size, block_size, group, partition_size, alibi,
                softcap=False, sinks=False, nhd=False):
        assert not nhd, "the CUDA-core form reads vLLM's layout only"
        return tuning.paged_simt_variant(dtype, cache, head_size, block_size, group,
                                         partition_size, alibi, softcap, sinks)

    def choose(self, version, partition_size, num_ctas_v1, max_context, device_id, v1_key):
        auto_version, ps = tuning.paged_simt_plan(max_context, partition_size)
        if version != "auto":
            return version, ps
        if auto_version == "v1" and not self._v1_fits(v1_key, max_context, device_id)[0]:
            auto_version = "v2"
        return auto_version, ps

    def v1_launch(self, key, max_context, device_id):
        fits, need, limit = self._v1_fits(key, max_context, device_id)
        if not fits:
            raise V1TooLong(
                f"block_tables: v1 keeps the logits of a whole sequence in shared memory; "
                f"max_blocks_per_seq * block_size = {max_context} tokens x {key.group} heads "
                f"needs {need} bytes, more than this device's {limit}; use version='v2' "
                "or 'auto'")
        return self._v1_kernel(key, device_id)[0], need, key.logits_stride(max_context)

    def logits_stride(self, key):
        return key.logits_stride(0)

    @staticmethod
    @functools.cache
    def _v1_kernel(key, device_id: int):
        """The v1 kernel with its dynamic shared memory limit raised to the device's most."""
        kernel = get_kernel(key, device_id)
        with cupy.cuda.Device(device_id):
            limit = max_dynamic_smem(kernel, device_id)
            set_max_dynamic_smem(kernel, limit)
        return kernel, limit

    def _v1_fits(self, key, max_context: int, device_id: int) -> tuple[bool, int, int]:
        limit = self._v1_kernel(key, device_id)[1]
        need = key.logits_bytes(max_context)
        return need <= limit, need, limit


FORMS = {"mma": MmaForm(), "simt": SimtForm()}


def form_for(cache: str, head_size: int, group: int, nhd: bool = False) -> PagedForm:
    """The form tuning chooses (the NHD layout: always the tensor-core form)."""
    return FORMS["mma" if nhd else tuning.paged_form(cache, head_size, group)]


# ---- the launches of a decode call, either form ---------------------------------------------

# A window side no position reaches (window_bound): the kernels' int32 positions stay below.
_UNBOUNDED = 2**30


def window_bound(side: int) -> int:
    """A window side for PagedParams (window_left / window_right): -1 (unbounded) becomes
    a value no position reaches."""
    return _UNBOUNDED if side < 0 else min(side, _UNBOUNDED)


def decode_launches(form, key_for, version: str, partition_size: int, v1, *, grid: tuple,
                    rows: int, max_context: int, sinks: bool, slots: tuple, fields: dict,
                    device_id: int) -> dict:
    """The launches of a checked decode call (paged_attention, and paged_prefill's few-token
    form) as Plan fields: v1 alone, or v2's main kernel and its reduce over scratch.

    key_for(partition_size): the main kernel's variant. v1: form.v1_launch's (kernel, shared
    memory, logits_stride) when version is "v1". grid: (head groups, sequences); rows: the
    query rows (sequences, or total_q for multi-token decode). slots: the pointer slots of
    out, lse, tmp_out, tmp_lse, q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes,
    sinks, cu_seqlens_q, k_scales, v_scales. fields: every other PagedParams field but
    max_parts and logits_stride (the out / lse strides those of the final output).
    """
    out, lse, tmp_out, tmp_lse, *inputs = slots
    inputs = tuple(inputs)
    if version == "v1":
        kernel, smem, logits_stride = v1
        tail = PAGED_PARAMS.tail(max_parts=1, logits_stride=logits_stride, **fields)
        return dict(launches=(Launch(kernel, grid + (1,), (key_for(0).num_threads,), smem,
                                     PAGED_PARAMS.dtype, (out, lse, NULL, NULL) + inputs,
                                     tail),))
    key = key_for(partition_size)
    head_size, num_heads = key.head_size, fields["num_heads"]
    rkey = tuning.paged_reduce_variant(key.dtype, head_size, sinks=sinks)
    max_parts = max(1, -(-max_context // partition_size))
    tmp_out_bytes = rows * num_heads * max_parts * head_size * 4   # a multiple of 16
    tmp_lse_bytes = rows * num_heads * max_parts * 4
    tail = PAGED_PARAMS.tail(max_parts=max_parts, logits_stride=form.logits_stride(key),
                             **fields)   # (v2 writes tmp_out / tmp_lse: out strides unused)
    final = {n: fields[n] for n in ("out_stride_seq", "out_stride_head", "lse_stride_head",
                                    "lse_stride_seq")}
    rtail = PAGED_REDUCE_PARAMS.tail(**final, num_heads=num_heads, max_parts=max_parts,
                                     partition_size=partition_size, max_seq_len=max_context,
                                     num_seqs=fields["num_seqs"])
    launches = []
    if max_context > 0:     # else every sequence is empty: the reduce writes zeros alone
        launches.append(Launch(get_kernel(key, device_id), grid + (max_parts,),
                               (key.num_threads,), key.dynamic_smem_bytes, PAGED_PARAMS.dtype,
                               (NULL, NULL, tmp_out, tmp_lse) + inputs, tail))
    seq_lens, sinks_slot, cu_q = inputs[4], inputs[6], inputs[7]
    launches.append(Launch(get_kernel(rkey, device_id), (num_heads, rows), (rkey.num_threads,),
                           0, PAGED_REDUCE_PARAMS.dtype,
                           (out, lse, tmp_out, tmp_lse, seq_lens, sinks_slot, cu_q), rtail))
    return dict(scratch=(0, tmp_out_bytes), scratch_bytes=tmp_out_bytes + tmp_lse_bytes,
                launches=tuple(launches))
