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
from ..jit import Variant, device_info, get_kernel, max_dynamic_smem, set_max_dynamic_smem


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
