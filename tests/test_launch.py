"""The launch path's plan cache (cuattn/_launch.py): what makes two calls share a plan."""
from __future__ import annotations

import numpy as np

from cuattn._launch import signature


def test_scalars_of_another_type_never_share_a_plan():
    """9.0 == 9 and True == 1 hash alike, but only the int passes the checks: a plan built
    for a valid call must not serve a call whose scalar has the wrong type."""
    base = signature((None,), (9, True, (-1, -1), None))
    assert base == signature((None,), (9, True, (-1, -1), None))
    for other in [(9.0, True, (-1, -1), None), (9, 1, (-1, -1), None),
                  (9, True, (-1.0, -1), None), (np.int64(9), True, (-1, -1), None),
                  (9, True, (-1, -1), 0)]:
        assert signature((None,), other) != base, other


def test_arguments_of_other_libraries_are_not_signed():
    class Foreign:            # e.g. a torch tensor: viewed as cupy first, then signed
        shape = (2,)
    assert signature((Foreign(),), ()) is None
