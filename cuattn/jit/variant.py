"""Variant keys: the only description of a compiled kernel.

A variant is a frozen dataclass holding exactly the knobs that change code generation.
``key.name`` is its exported ``extern "C"`` symbol (what profilers show), and
``key.source()`` is the whole translation unit NVRTC sees: the kernel's header plus a
generated entry point that instantiates the header's template with the key's values.
"""
from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

from .params import ParamsStruct


@dataclasses.dataclass(frozen=True)
class Variant:
    """Base of every kernel kind's key. A subclass sets the class variables and fields."""

    op: ClassVar[str]                 # short op name, the first part of the symbol
    header: ClassVar[str]             # kernel header under cuda_src/
    kernel_template: ClassVar[str]    # C++ __device__ function template the entry calls
    params: ClassVar[ParamsStruct]    # the single by-value kernel argument

    # -- what a subclass provides -------------------------------------------------------
    def name_parts(self) -> tuple[str, ...]:
        """Readable pieces of the symbol after the op, e.g. ("bf16", "hd128")."""
        raise NotImplementedError

    def template_args(self) -> tuple:
        """C++ template arguments, in the order of ``kernel_template``'s parameters."""
        raise NotImplementedError

    @property
    def num_threads(self) -> int:
        raise NotImplementedError

    @property
    def dynamic_smem_bytes(self) -> int:
        return 0

    # -- derived ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return f"cuattn_{self.op}__" + "_".join(self.name_parts())

    def source(self) -> str:
        args = ", ".join(_cpp_literal(a) for a in self.template_args())
        return (
            f'#include "{self.header}"\n'
            f"namespace cuattn {{\n{self.params.layout_asserts()}\n}}\n"
            f'extern "C" __global__ void __launch_bounds__({self.num_threads})\n'
            f"{self.name}(const cuattn::{self.params.cpp_name} params) {{\n"
            f"  cuattn::{self.kernel_template}<{args}>(params);\n"
            f"}}\n"
        )


def _cpp_literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):   # a C++ type such as __nv_bfloat16
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_:]*", value):
            raise ValueError(f"not a C++ identifier: {value!r}")
        return value
    raise TypeError(f"cannot spell {value!r} as a C++ template argument")
