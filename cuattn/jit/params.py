"""Kernel parameter structs: one NumPy structured dtype mirrors one C++ struct.

A kernel takes a single ``Params`` argument by value instead of twenty positional
scalars. Python describes the fields once; the generated entry point static_asserts the
size of the struct and of every field (NVRTC has no constant-expression offsetof, so
tests/test_jit.py reads the offsets back from compiled PTX), so a C++ struct that drifts
from its Python mirror fails to compile or a test instead of reading garbage.
"""
from __future__ import annotations

import numpy as np

# Field kinds: C++ spelling and NumPy type. Pointers travel as 64-bit integers: "ptr" to
# what the kernel reads, "out" to what it writes.
_KINDS = {
    "ptr": ("const void*", np.uint64),
    "out": ("void*", np.uint64),
    "i32": ("int", np.int32),
    "i64": ("long long", np.int64),
    "f32": ("float", np.float32),
}


class ParamsStruct:
    """A C++ parameter struct (declared in a header under cuda_src/) and its NumPy mirror."""

    def __init__(self, cpp_name: str, fields: list[tuple[str, str]]):
        self.cpp_name = cpp_name
        self.fields = tuple(fields)
        self.dtype = np.dtype([(n, _KINDS[k][1]) for n, k in fields], align=True)
        self._names = tuple(n for n, _ in fields)
        pointers = [k in ("ptr", "out") for _, k in fields]
        # The pointers lead the struct: the launch path packs a call's pointers in front of
        # the static bytes its plan holds (tail()).
        self.num_pointers = pointers.index(False) if False in pointers else len(pointers)
        assert not any(pointers[self.num_pointers:]), f"{cpp_name}: pointers must come first"

    def pack(self, **values) -> np.void:
        """One structured scalar holding every field (all must be given): the launch argument."""
        if len(values) != len(self._names):
            unknown = sorted(values.keys() - set(self._names))
            missing = sorted(set(self._names) - values.keys())
            raise KeyError(f"{self.cpp_name}: missing fields {missing}, unknown {unknown}")
        # zeros first: the padding between and after fields is then zero too, so the same
        # call packs the same bytes (np.array of a tuple left it uninitialised)
        packed = np.zeros((), dtype=self.dtype)
        for n in self._names:
            packed[n] = values[n]
        return packed[()]

    def pointer_names(self) -> tuple[str, ...]:
        return self._names[:self.num_pointers]

    def tail(self, **values) -> bytes:
        """The bytes of the struct after its leading pointers (every other field given)."""
        zeros = dict.fromkeys(self.pointer_names(), 0)
        return self.pack(**zeros, **values).tobytes()[8 * self.num_pointers:]

    def layout_asserts(self) -> str:
        """C++ static_asserts that the struct's size and every field's size match this dtype.

        NVRTC has no constant-expression offsetof, so the field order is checked by a
        test instead (tests/test_jit.py compiles a probe and reads the offsets back).
        """
        lines = [f"static_assert(sizeof({self.cpp_name}) == {self.dtype.itemsize}, "
                 f"\"{self.cpp_name}: size differs from its Python mirror\");"]
        for name in self._names:
            size = self.dtype.fields[name][0].itemsize
            lines.append(f"static_assert(sizeof({self.cpp_name}::{name}) == {size}, "
                         f"\"{self.cpp_name}.{name}: size differs from its Python mirror\");")
        return "\n".join(lines)

    def offsets(self) -> dict[str, int]:
        return {name: self.dtype.fields[name][1] for name in self._names}

    def cpp_declaration(self) -> str:
        """The struct as C++ would declare it (documentation and tests)."""
        body = "\n".join(f"  {_KINDS[k][0]} {n};" for n, k in self.fields)
        return f"struct {self.cpp_name} {{\n{body}\n}};"
