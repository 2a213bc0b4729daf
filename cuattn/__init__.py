"""cuattn: attention kernels for CuPy, compiled at run time with NVRTC.

Public API (DESIGN.md section 1): merge_attn_states, merge_states.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .merge import merge_attn_states, merge_states

__all__ = ["merge_attn_states", "merge_states", "__version__"]
