"""Variant keys: the only description of a compiled kernel.

A variant is a frozen dataclass holding exactly the knobs that change code generation: pure
data, every field given by the tuning layer (``cuattn.tuning``) that chose it. ``key.name``
is its exported ``extern "C"`` symbol (what profilers show), and ``key.source()`` is the
whole translation unit NVRTC sees: the kernel's header plus a generated entry point that
instantiates the kernel template with one traits type built from the key's values.
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
    kernel: ClassVar[str]             # C++ __device__ function template: kernel<Traits>(params)
    traits: ClassVar[str]             # C++ traits template the key's values instantiate
    params: ClassVar[ParamsStruct]    # the first by-value kernel argument
    # Further by-value arguments, (C++ struct under cuattn::, name): the launch passes them
    # after the params struct (cuattn._launch.Launch.extra), the kernel function takes them
    # after it.
    extra_params: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Whether Traits::SMEM_BYTES is the kernel's dynamic shared memory: the entry point then
    # pins dynamic_smem_bytes (Python's value) to it with a static_assert.
    smem_from_traits: ClassVar[bool] = False

    # The fields in the order of their parts of the symbol and of their template arguments,
    # where that is not the order of declaration (the C++ traits and the names cached on
    # disk fix both orders; the constructor fixes the fields').
    name_order: ClassVar[tuple[str, ...]] = ()
    traits_order: ClassVar[tuple[str, ...]] = ()

    # -- what a subclass provides -------------------------------------------------------
    def name_parts(self) -> tuple[str, ...]:
        """Readable pieces of the symbol after the op, e.g. ("bf16", "hd128"): each field's
        ``name`` (key_field)."""
        return self._spelled("name", self.name_order)

    def traits_args(self) -> tuple:
        """C++ template arguments of ``traits``, in order: each field's ``cpp`` (key_field)."""
        return self._spelled("cpp", self.traits_order)

    @property
    def num_threads(self) -> int:
        """Threads per block: the key's ``threads`` field unless the subclass derives it."""
        return self.threads

    @property
    def min_blocks(self) -> int | None:
        """The second argument of ``__launch_bounds__`` (None: the plain form)."""
        return None

    @property
    def dynamic_smem_bytes(self) -> int:
        return 0

    def target_arch(self, device_arch: str) -> str:
        """The architecture to compile for on a device of ``device_arch`` (``sm_XY``): the
        device's own, unless the kernel needs an arch-specific target such as ``sm_90a``."""
        return device_arch

    def traits_asserts(self) -> tuple:
        """(traits constant, the value Python derives for it) pairs the generated source
        static_asserts."""
        return ()

    def runs_on(self, arch: str) -> bool:
        """Whether a device of ``arch`` can run the kernel (precompile skips the others)."""
        return True

    def _spelled(self, what: str, order: tuple[str, ...]) -> tuple:
        """Each field's ``what`` spelling (key_field's name or cpp), in ``order`` (empty:
        the fields' own)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        out: tuple = ()
        for name in order or fields:
            spell = fields[name].metadata.get(what)
            value = getattr(self, name)
            if spell is None:
                if what == "name":
                    raise TypeError(f"{type(self).__name__}.{name}: no name (key_field)")
                out += (value,)
            elif isinstance(spell, str):
                out += (spell.format(value),)
            else:
                out += tuple(spell(value))
        return out

    # -- derived ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return f"cuattn_{self.op}__" + "_".join(self.name_parts())

    def source(self) -> str:
        args = ", ".join(_cpp_literal(a) for a in self.traits_args())
        bounds = str(self.num_threads) if self.min_blocks is None else \
            f"{self.num_threads}, {self.min_blocks}"
        smem = (f"static_assert(Traits::SMEM_BYTES == {self.dynamic_smem_bytes}, "
                f"\"{self.name}: shared memory differs from its Python value\");\n"
                if self.smem_from_traits else "")
        smem += "".join(f"static_assert(Traits::{k} == {_cpp_literal(v)}, "
                        f"\"{self.name}: {k} differs from its Python value\");\n"
                        for k, v in self.traits_asserts())
        arguments = ",\n    ".join(
            f"const __grid_constant__ cuattn::{cpp} {name}"
            for cpp, name in ((self.params.cpp_name, "params"),) + self.extra_params)
        passed = ", ".join(("params",) + tuple(name for _, name in self.extra_params))
        return (
            f'#include "{self.header}"\n'
            f"namespace cuattn {{\n{self.params.layout_asserts()}\n}}\n"
            f"namespace {{\nusing Traits = cuattn::{self.traits}<{args}>;\n{smem}}}\n"
            f'extern "C" __global__ void __launch_bounds__({bounds})\n'
            f"{self.name}({arguments}) {{\n"
            f"  cuattn::{self.kernel}<Traits>({passed});\n"
            f"}}\n"
        )


def key_field(name, cpp=None, **field_args):
    """A field of a key with its spelling: ``name`` its parts of the symbol (a format string
    of the value such as "hd{}", or a function of the value returning a tuple of parts,
    empty for none), ``cpp`` its template arguments (a function of the value returning a
    tuple; None: the value itself). ``field_args`` go to dataclasses.field (a default)."""
    return dataclasses.field(metadata={"name": name, "cpp": cpp}, **field_args)


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
