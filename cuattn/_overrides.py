"""The tuning choices a sweep or test forces (``cuattn.tuning.override``), read by both tuning
modules (cuattn.tuning, cuattn.tuning_bwd): the one place that holds them, so neither
reaches into the other's state.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

_OVERRIDE_KEYS = {
    "flash_tiles": "FlashTiles every flash forward kernel takes, masked or not",
    "prefill_tiles": "FlashTiles of paged_prefill's kernel",
    "paged_form": '"mma" or "simt": the paged decode form, wherever that form can run',
    "paged_mma": "PagedMmaTiles of the tensor-core paged form",
    "multi_token_group": "query heads per block of multi-token decode (a divisor of the GQA "
                         "ratio)",
    "prefill_form": '"decode" or "flash": paged_prefill\'s kernel, wherever that one can run',
    "flash_path": '"wgmma" or "mma": the kernels of flash_forward / flash_varlen_forward and '
                  "of their backward",
    "flash_sm90_tiles": "FlashSm90Tiles of the Hopper forward kernel",
    "flash_bwd_tiles": "FlashBwdTiles of the backward's mma.sync kernel (cuattn.tuning_bwd; "
                       "implies that path)",
    "flash_bwd_sm90_tiles": "FlashBwdSm90Tiles of the Hopper backward kernel (cuattn.tuning_bwd)",
    "flash_bwd_lpt": "False: the backward's causal calls on the plain grid, not the causal "
                     "schedule; a positive int: (KV head, batch) pairs per section of that "
                     "schedule (cuattn.tuning_bwd.flash_bwd_lpt_group)",
}
_forced: dict = {}


@contextlib.contextmanager
def override(**choices) -> Iterator[None]:
    """Force tuning choices for the calls made inside the block (sweeps and tests).

    Keys: flash_tiles (FlashTiles; implies the mma.sync path), prefill_tiles (FlashTiles),
    paged_form ("mma" / "simt"), paged_mma (PagedMmaTiles), multi_token_group (int),
    prefill_form ("decode" / "flash"), flash_path ("wgmma" / "mma"; forward and backward),
    flash_sm90_tiles (FlashSm90Tiles), flash_bwd_tiles (cuattn.tuning_bwd.FlashBwdTiles;
    implies the backward's mma.sync path), flash_bwd_sm90_tiles
    (cuattn.tuning_bwd.FlashBwdSm90Tiles), flash_bwd_lpt (False: no causal schedule; an int:
    pairs per section).
    The launch plans cached so far are dropped on entry and on exit.
    """
    unknown = sorted(set(choices) - set(_OVERRIDE_KEYS))
    if unknown:
        raise TypeError(f"override: unknown choice(s) {unknown}; known: {sorted(_OVERRIDE_KEYS)}")
    if choices.get("paged_form") not in (None, "mma", "simt"):
        raise ValueError(f"override: paged_form is 'mma' or 'simt', got {choices['paged_form']!r}")
    if choices.get("flash_path") not in (None, "wgmma", "mma"):
        raise ValueError(f"override: flash_path is 'wgmma' or 'mma', got {choices['flash_path']!r}")
    if choices.get("prefill_form") not in (None, "decode", "flash"):
        raise ValueError("override: prefill_form is 'decode' or 'flash', got "
                         f"{choices['prefill_form']!r}")
    lpt = choices.get("flash_bwd_lpt")
    if lpt is not None and lpt is not False and not (type(lpt) is int and lpt > 0):
        raise ValueError(f"override: flash_bwd_lpt is False or a positive int, got {lpt!r}")
    saved = dict(_forced)
    _forced.update(choices)
    _changed()
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)
        _changed()


def _changed() -> None:
    from ._launch import clear_plans
    clear_plans()


def get(key: str, default=None):
    """The forced choice ``key`` (one of override's keys), or ``default`` where none is."""
    return _forced.get(key, default)


def has(key: str) -> bool:
    """Whether ``key`` is forced (a choice may be forced to a falsy value)."""
    return key in _forced
