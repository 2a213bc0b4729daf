"""The benchmark suites without a GPU: the backward suite's FLOP formula, its configuration
grid, and its row and table plumbing with every measurement faked."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import ab, run, suite_bwd  # noqa: E402
from bench.harness import Ceilings  # noqa: E402


def test_backward_flops_are_two_and_a_half_forwards():
    full = suite_bwd.standard(128, 4096, causal=False)
    assert (full.batch, full.q_heads, full.kv_heads) == (4, 16, 16)
    assert suite_bwd.forward_flops(full) == 4 * 4 * 16 * 4096 * 4096 * 128
    assert suite_bwd.backward_flops(full) == 2.5 * 4 * 4 * 16 * 4096 * 4096 * 128
    causal = suite_bwd.standard(128, 4096, causal=True)
    assert suite_bwd.backward_flops(causal) == suite_bwd.backward_flops(full) / 2
    gqa = suite_bwd.Config(128, 16384, True, 32, 8)         # the query heads count
    assert suite_bwd.backward_flops(gqa) == 2.5 * 4 * 1 * 32 * 16384 * 16384 * 128 / 2


def test_the_grid():
    rows = suite_bwd.configs(quick=False)
    standard = [c for c in rows if c.q_heads == c.kv_heads]
    assert {(c.head_dim, c.seqlen) for c in standard} == (
        {(d, s) for d in (64, 128) for s in (512, 1024, 2048, 4096, 8192, 16384)}
        | {(256, 2048), (256, 8192)})
    assert len(standard) == 2 * 14                            # causal and full each
    for c in standard:
        assert c.batch * c.seqlen == 16384 and c.q_heads * c.head_dim == 2048
    gqa = [c for c in rows if c.q_heads != c.kv_heads]
    assert [(c.head_dim, c.seqlen, c.causal, c.q_heads, c.kv_heads, c.batch) for c in gqa] == [
        (128, 4096, True, 32, 8, 4), (128, 16384, True, 32, 8, 1)]
    assert len({c.label for c in rows}) == len(rows)
    seen = []                       # the rows of one shape are neighbours (inputs reused)
    for c in rows:
        if not seen or seen[-1] != c.shape:
            assert c.shape not in seen
            seen.append(c.shape)


def test_the_quick_grid():
    labels = [c.label for c in suite_bwd.configs(quick=True)]
    assert labels == [f"hd128 S{s} B{16384 // s} H16 {m}" for s in (2048, 4096, 16384)
                      for m in ("full", "causal")] + [
        "hd128 S4096 B4 H32/8 causal", "hd128 S16384 B1 H32/8 causal"]


def test_bwd_is_registered():
    assert run.SUITES["bwd"] == "bench.suite_bwd"
    assert "bwd" in run._available_suites()
    assert "bwd" in (run.__doc__ or "").split("\n\n")[0]


def test_the_ab_grid_has_bwd_rows():
    assert "bwd" in ab.AB_SUITES and "bwd" not in ab.DEFAULT_SUITES


class _Fake:
    """Stands in for a GPU: cupy's few calls, cuattn's two functions, fixed timings."""

    def __init__(self, monkeypatch, *, backward: bool):
        self.calls = []
        fake_cupy = SimpleNamespace(
            empty_like=np.empty_like, asarray=np.asarray,
            get_default_memory_pool=lambda: SimpleNamespace(free_all_blocks=lambda: None),
            cuda=SimpleNamespace(Device=lambda: SimpleNamespace(synchronize=lambda: None)))
        monkeypatch.setattr(suite_bwd, "cupy", fake_cupy)
        monkeypatch.setattr(suite_bwd, "inputs", lambda c: tuple(
            np.zeros((c.batch, 1, h, 1), np.float32)
            for h in (c.q_heads, c.kv_heads, c.kv_heads, c.q_heads)))
        monkeypatch.setattr(suite_bwd, "VARLEN_LENGTHS", (3, 1))   # dense: 2 x 2
        monkeypatch.setattr(suite_bwd, "randn", lambda *shape: np.zeros(shape, np.float32))
        self.varlen_calls = []
        cuattn = SimpleNamespace(
            flash_forward=lambda q, k, v, causal, return_lse: (q, q),
            flash_varlen_forward=lambda q, k, v, cu_q, cu_k, max_q, max_k, causal, return_lse:
                (q, q))
        if backward:
            cuattn.flash_varlen_backward = (
                lambda dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal, dq, dk, dv:
                self.varlen_calls.append((tuple(cu_q), max_q, causal)))
            def flash_backward(dout, q, k, v, out, lse, *, causal, deterministic, dq, dk, dv):
                self.calls.append((causal, deterministic))
            cuattn.flash_backward = flash_backward
        monkeypatch.setattr(suite_bwd, "cuattn", cuattn)
        monkeypatch.setattr(suite_bwd.torch_peers, "load", lambda: None)
        monkeypatch.setattr(suite_bwd.jax_peers, "load", lambda: None)

        def timed(ms):
            def measure(fn, *args, **kwargs):
                fn()
                return ms
            return measure
        monkeypatch.setattr(suite_bwd, "median_ms", timed(2.0))
        monkeypatch.setattr(suite_bwd, "eager_ms", timed(4.0))
        monkeypatch.setattr(suite_bwd, "wall_ms", timed(8.0))


CEILINGS = Ceilings(copy_gbps=4000.0, read_gbps=4500.0, matmul_tflops=700.0, device="fake")


def test_rows_and_tables_with_faked_measurements(monkeypatch):
    fake = _Fake(monkeypatch, backward=True)
    rows = suite_bwd.run(CEILINGS, quick=True)
    *rows, varlen = rows                        # quick: the full varlen row only
    assert [r["config"] for r in rows] == [c.label for c in suite_bwd.configs(quick=True)]
    assert varlen["config"] == "varlen hd128 2 seqs 4 tokens full"
    assert fake.varlen_calls and set(fake.varlen_calls) == {((0, 3, 4), 3, False)}
    # work 2.5 x 4 H D sum(len^2) against the dense call's 2 x 2^2, both timed at 2 ms
    assert varlen["varlen/dense (varlen, graph)"] == pytest.approx((9 + 1) / (2 * 4))
    assert varlen["cuattn TFLOP/s (varlen, graph)"] == pytest.approx(
        2.5 * 4 * 16 * 128 * 10 / 2.0 / 1e9)
    first, c = rows[0], suite_bwd.configs(quick=True)[0]
    flops = suite_bwd.backward_flops(c)
    assert first["floor ms"] == pytest.approx(flops / 700e9)
    assert first["cuattn TFLOP/s (graph)"] == pytest.approx(flops / 2.0 / 1e9)
    assert first["cuattn-det TFLOP/s (eager)"] == pytest.approx(flops / 4.0 / 1e9)
    assert first["% matmul (graph)"] == pytest.approx(100 * flops / 2.0 / 1e9 / 700)
    assert first["FA2 TFLOP/s (graph)"] is None and first["cuattn/cuDNN (eager)"] is None
    assert not any(key.endswith("(wall)") for key in first)      # no FA3 loaded
    assert (True, True) in fake.calls and (False, False) in fake.calls
    titled = suite_bwd.tables([*rows, varlen])
    assert [title.split(" ")[0] for title, _ in titled] == ["kernel-only", "eager", "varlen"]
    assert titled[-1][1] == [varlen]
    for title, table in titled[:-1]:
        method = "(graph)" if title.startswith("kernel") else "(eager)"
        for row in table:
            assert all(key in ("config", "floor ms") or key.endswith(method) for key in row)


def test_a_tree_without_flash_backward_leaves_cells_empty(monkeypatch, capsys):
    _Fake(monkeypatch, backward=False)
    rows = suite_bwd.run(CEILINGS, quick=True)
    assert all(r["cuattn TFLOP/s (graph)"] is None for r in rows)
    assert capsys.readouterr().err.count("has no flash_backward") == 1


def test_fa3_rows_count_only_where_finite(monkeypatch, capsys):
    _Fake(monkeypatch, backward=True)
    monkeypatch.setattr(suite_bwd.jax_peers, "load", lambda: object())
    monkeypatch.setattr(suite_bwd.jax_peers, "fa3_backward",
                        lambda fa3, q, k, v, dout, causal: (lambda: None, causal))
    monkeypatch.setattr(suite_bwd.jax_peers, "fa3_wall_ms", lambda fa3, call, **kw: 16.0)
    rows = {r["config"]: r for r in suite_bwd.run(CEILINGS, quick=True)}
    causal, full = rows["hd128 S4096 B4 H16 causal"], rows["hd128 S4096 B4 H16 full"]
    assert causal["cuattn/FA3 (wall)"] == pytest.approx(2.0)    # 8 ms beside 16 ms
    assert "FA3 TFLOP/s (wall)" not in full and "not finite" in full["note"]
    assert "not finite" in capsys.readouterr().err
    wall = dict(suite_bwd.tables(list(rows.values())))
    (title,) = [t for t in wall if t.startswith("wall")]
    assert len(wall[title]) == len(rows) - 1      # every row but varlen's is head dim 128


def test_wall_clock_syncs_once_per_rep():
    from bench import harness
    called, synced = [], []
    ms = harness.wall_ms(lambda: called.append(1) or len(called), synced.append, calls=4,
                         n_warmup=1, n_repeat=3)
    assert ms >= 0 and len(called) == 1 + 4 * (1 + 3)
    assert synced == [1, 5, 9, 13, 17]     # the first call's result, then each rep's last


def test_run_docstring_names_every_suite():
    usage = " ".join(run.__doc__.split())
    assert [s for s in run.SUITES if s not in usage.split("[--quick]")[0]] == []
