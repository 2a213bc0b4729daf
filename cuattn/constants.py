"""The flash kernels' enumerations, as their C++ spells them: what a key's ``mask``, ``kv``
and ``features`` fields hold and the plan builders and tuning pass around."""
from __future__ import annotations

# Mask kinds of the flash kernel (cuda_src/common/mask.cuh kMask*).
MASK_NONE, MASK_CAUSAL, MASK_WINDOW = 0, 1, 2
# K/V sources of the flash kernels (cuda_src/flash/features.cuh kKv*): dense, or a paged cache.
KV_DENSE, KV_PAGED_NHD, KV_PAGED_VLLM = 0, 1, 2
# Feature bits of the flash kernels (cuda_src/flash/features.cuh k*): logits hooks, sinks, and the
# query heads of one KV head packed into a block's rows.
FEAT_SOFTCAP, FEAT_ALIBI, FEAT_SINKS, FEAT_PACK_GQA = 1, 2, 4, 8

# The architecture of the Hopper kernels (sm_90a machine code runs on sm_90 only).
SM90_ARCH = "sm_90"
