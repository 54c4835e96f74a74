"""The sdpa engine and auto's per-block choice: pieces cover every mask exactly, every engine matches the float64
reference (out, lse, dq, dk, dv), forced engines refuse blocks they cannot do, tables are read and validated."""
import json
import types

import pytest
import torch

import ndp
import ndp.ops
import ndp_kernels
from ndp.ops import _reference, _sdpa, engines, tune
from ndp.ops._pieces import plan_pieces
from ndp_kernels import NO_LIMIT, Segments, tuning
from ndp_kernels.reference import attn_bwd_segments_ref, attn_fwd_segments_ref, flash_attn_bwd_ref, \
    flash_attn_fwd_ref
from _engine_cases import TABLES, _assert_matches, _inputs, _ref
from ndp.testing import assert_close

N = NO_LIMIT


def _visibility(pieces, sq, sk):
    m = torch.zeros(sq, sk, dtype=torch.int64)
    for p in pieces:
        i = torch.arange(p.rows)[:, None]
        j = torch.arange(p.k1 - p.k0)[None, :]
        if p.kind == "full":
            vis = torch.ones(p.rows, p.k1 - p.k0, dtype=torch.bool)
        elif p.kind == "causal":
            assert p.rows == p.k1 - p.k0, p
            vis = j <= i
        else:
            vis = (j - i >= p.lo) & (j - i <= p.hi)
        assert vis.any(1).all(), f"piece {p} has a row that sees no key"
        m[p.q0:p.q1, p.k0:p.k1] += vis.long()
    return m


@pytest.mark.parametrize("mask_rows", [1024, 4])
@pytest.mark.parametrize("name", sorted(TABLES))
def test_pieces_cover_the_mask_exactly(name, mask_rows):
    rows, sq, sk = TABLES[name]
    got = _visibility(plan_pieces(rows, sq, sk, mask_rows=mask_rows), sq, sk)
    want = Segments.from_rows(rows).mask(sq, sk).long()
    assert torch.equal(got, want)  # every visible pair exactly once, no hidden pair


def test_pieces_of_the_common_blocks_need_no_mask():
    kinds = lambda name: [p.kind for p in plan_pieces(*TABLES[name])]  # noqa: E731
    assert kinds("zigzag_diagonal") == ["causal"]        # one causal call for the whole zigzag diagonal step
    assert kinds("causal_q_lt_k") == ["full", "causal"]  # bottom-right causal = full block + causal square
    assert kinds("striped_shift") == ["causal"]
    assert kinds("full") == ["full"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(TABLES))
def test_sdpa_segments_match_reference(name, dtype):
    rows, sq, sk = TABLES[name]
    segs = Segments.from_rows(rows)
    q, k, v, dout = _inputs(2, sq, sk, 4, 2, 16, dtype, seed=len(name))
    scale = 0.37
    out, lse = ndp.ops.attention_fwd(q, k, v, segs, softmax_scale=scale, backend="sdpa")
    assert out.dtype == dtype and lse.dtype == ndp_kernels.acc_dtype(dtype)
    grads = ndp.ops.attention_bwd(dout, q, k, v, out, lse, segs, softmax_scale=scale, backend="sdpa")
    assert all(g.dtype == dtype for g in grads)
    want = _ref(dout, q, k, v, segs, scale)
    # Backward takes the engine's own out/lse as a ring step does; the reference's are within tolerance.
    lowp = _ref(dout, q, k, v, segs, scale, upcast=False) if dtype in (torch.float16, torch.bfloat16) else None
    _assert_matches((out, lse) + tuple(grads), dtype, want, lowp)
    rows_without_key = ~segs.mask(sq, sk).any(1)
    assert torch.all(out[:, rows_without_key] == 0) and torch.all(lse[:, :, rows_without_key] == float("-inf"))
    assert torch.all(grads[0][:, rows_without_key] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["zigzag_diagonal", "overlapping_keys", "window_both", "causal_q_lt_k"])
def test_sdpa_accumulators_over_key_blocks(name, dtype):
    """Blocks merged into fp32 accumulators (what a ring step does) equal the whole attention, to fp32
    precision even for bf16 inputs: a block is never rounded to bf16 before its merge."""
    rows, sq, sk = TABLES[name]
    segs = Segments.from_rows(rows)
    q, k, v, dout = _inputs(1, sq, sk, 4, 1, 32, dtype, seed=3)
    out, lse = attn_fwd_segments_ref(q.double(), k.double(), v.double(), segs, softmax_scale=0.2)
    out, lse = out.float(), lse.float()
    oa, la = torch.zeros(q.shape), torch.full((1, 4, sq), float("-inf"))
    cut = sk // 3
    parts = []
    for a, b in ((0, cut), (cut, sk)):
        # The same visibility restricted to keys [a, b), as a table on the key slice.
        m = segs.mask(sq, sk)[:, a:b]
        prow = [(i, 1, 0, b - a, int(m[i].nonzero().min()), int(m[i].nonzero().max()))
                for i in range(sq) if m[i].any()]
        part = Segments.from_rows([(i, 1, ks, kl, lo, hi) for i, _, ks, kl, lo, hi in prow])
        parts.append((a, b, part))
        ndp.ops.attention_fwd(q, k[:, a:b], v[:, a:b], part, softmax_scale=0.2, out_acc=oa, lse_acc=la,
                              backend="sdpa")
    assert_close(oa, out, torch.float32)
    assert_close(torch.where(torch.isfinite(lse), la, 0), torch.where(torch.isfinite(lse), lse, 0), torch.float32)
    out = out.to(dtype)  # the final out a ring backward gets is in the input dtype (the reference takes it too)
    want = attn_bwd_segments_ref(dout.double(), q.double(), k.double(), v.double(), out.double(), lse.double(), segs,
                                 softmax_scale=0.2)
    dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
    for a, b, part in parts:
        ndp.ops.attention_bwd(dout, q, k[:, a:b], v[:, a:b], out, lse, part, softmax_scale=0.2, dq_acc=dq,
                              dk_acc=dk[:, a:b], dv_acc=dv[:, a:b], backend="sdpa")
    for got, w in zip((dq, dk, dv), want):
        assert_close(got, w, torch.float32, "grad")


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (16, -1)), (False, (7, 3))])
@pytest.mark.parametrize("sq,sk,h,hk,d", [(97, 97, 4, 1, 64), (17, 40, 4, 2, 80), (40, 17, 2, 2, 16)])
def test_public_attention_sdpa_matches_reference(causal, window, sq, sk, h, hk, d):
    q, k, v, dout = _inputs(2, sq, sk, h, hk, d, torch.float64, seed=sq + d)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = ndp.ops.attention(q, k, v, causal=causal, window_size=window, backend="sdpa", return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ro, rl = flash_attn_fwd_ref(q.detach(), k.detach(), v.detach(), causal=causal, window_size=window)
    rg = flash_attn_bwd_ref(dout, q.detach(), k.detach(), v.detach(), ro, rl, causal=causal, window_size=window)
    _assert_matches((out, lse) + grads, torch.float64, (ro, rl) + tuple(rg))


def test_packed_documents_with_empty_and_single_token_docs():
    lens = [1, 17, 0, 64, 30, 1]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v, dout = (x[0] for x in _inputs(1, sum(lens), sum(lens), 4, 2, 32, torch.float64, seed=5))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, window_size=(9, 0))
    out, lse = ndp.ops.attention(q, k, v, backend="sdpa", return_lse=True, **kw)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ro, rl = flash_attn_fwd_ref(q.detach(), k.detach(), v.detach(), **kw)
    rg = flash_attn_bwd_ref(dout, q.detach(), k.detach(), v.detach(), ro, rl, **kw)
    _assert_matches((out, lse) + grads, torch.float64, (ro, rl) + tuple(rg))


def test_sdpa_gradients_are_deterministic():
    q, k, v, dout = _inputs(2, 300, 300, 8, 2, 64, torch.float32, seed=9)
    runs = []
    for _ in range(2):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        out = ndp.ops.attention(qq, kk, vv, causal=True, deterministic=True)
        runs.append(torch.autograd.grad(out, (qq, kk, vv), dout))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_block_classes():
    cls = lambda name: engines.block_class(Segments.from_rows(TABLES[name][0]), *TABLES[name][1:])  # noqa: E731
    assert cls("full") == "full"
    assert cls("causal") == "causal" and cls("causal_q_lt_k") == "causal" and cls("striped_shift") == "causal"
    assert cls("window_both") == "window" and cls("window_left_only") == "window"
    assert cls("packed_docs") == "varlen"
    assert cls("zigzag_diagonal") == "other" and cls("overlapping_keys") == "other" and cls("partial_rows") == "other"


def test_auto_on_cpu_runs_sdpa_for_every_class_from_the_shipped_table(tmp_path, monkeypatch):
    monkeypatch.setenv("NDP_TUNING_DIR", str(tmp_path))  # no user table: the shipped one
    table = engines.engine_table("cpu", reload=True)
    assert table.source.endswith("engines-cpu.json"), table.source
    q = torch.zeros(1, 40, 4, 64)
    for name in ("full", "causal", "window_both", "packed_docs", "zigzag_diagonal"):
        rows, sq, sk = TABLES[name]
        segs = Segments.from_rows(rows)
        cls = engines.block_class(segs, sq, sk)
        order, how = table.order(cls, torch.float32, 64)
        assert order and order[0] == "sdpa" and how == "measured", (cls, order, how)
        assert engines.choose(segs, q[:, :sq], q[:, :sk]) == "sdpa"


@pytest.fixture
def probing(tmp_path, monkeypatch):
    """No table anywhere, probing on for CPU (the GPU default), only sdpa and the reference measured."""
    monkeypatch.setenv("NDP_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(engines, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setattr(engines, "AUTO_PROBE", ("cpu",))
    monkeypatch.setattr(engines, "_TABLES", {})
    monkeypatch.setattr(engines, "_PROBE_FAILED", set())
    monkeypatch.setattr(tune, "engine_available",
                        lambda e, d: (False, "not here") if e == "triton" else engines.engine_available(e, d))
    timed = []

    def fake_time(engine, cls, dtype, head_dim, device, *, s, iters, h, hk):
        timed.append((engine, cls, str(dtype), head_dim, s, (h, hk)))
        return 1.5
    monkeypatch.setattr(tune, "time_engine", fake_time)
    yield timed
    engines._TABLES.clear()


def test_auto_measures_a_missing_row_once_and_saves_it(probing, tmp_path):
    q = torch.zeros(1, 40, 4, 80)
    segs = Segments.dense(40, 40, causal=True)
    assert engines.choose(segs, q, q) == "sdpa"
    # Measured at the head_dim bucket (128), on the probe's block size, for the engines auto may pick.
    assert probing == [("sdpa", "causal", "torch.float32", 128, tune.PROBE_SEQLEN, (8, 8))]   # MHA block: MHA row
    saved = json.loads((tmp_path / "engines-cpu.json").read_text())
    row = saved["rows"]["causal/float32/128/mha"]
    assert row["order"] == ["sdpa"] and row["probed"] and row["ms"] == {"sdpa": 1.5}
    assert engines.choose(Segments.dense(40, 40, causal=True), q, q) == "sdpa"   # a new table: no new probe
    assert engines.choose(Segments.dense(40, 40, causal=True), q.double(), q.double()) == "sdpa"
    assert len(probing) == 2 and probing[1][2] == "torch.float64"               # a new dtype is a new row
    engines._TABLES.clear()                                                      # as in a new process
    table = engines.engine_table("cpu")
    assert table.order("causal", torch.float32, 128, "mha") == (("sdpa",), "measured")
    assert engines.choose(Segments.dense(40, 40, causal=True), q, q) == "sdpa" and len(probing) == 2
    assert set(json.loads((tmp_path / "engines-cpu.json").read_text())["rows"]) == {"causal/float32/128/mha",
                                                                                    "causal/float64/128/mha"}
    assert engines.choose(Segments.dense(40, 40, causal=True), q, q[:, :, :2]) == "sdpa"   # GQA: its own row
    assert probing[-1][-1] == (8, 2) and "causal/float32/128/gqa" in json.loads(
        (tmp_path / "engines-cpu.json").read_text())["rows"]


def test_a_shipped_row_measured_without_an_engine_installed_here_is_measured_again(probing, tmp_path, monkeypatch):
    """A row shipped in the package counts only where every engine auto may run here was installed when it was
    measured; once measured here, the user's row wins over it in every later process, other shipped rows stay."""
    (tmp_path / "shipped").mkdir()
    causal, full = "causal/float32/64/mha", "full/float32/64/mha"
    rows = {causal: {"order": ["sdpa"], "ms": {"sdpa": 1.0}, "engines": ["sdpa"]},
            full: {"order": ["sdpa"], "ms": {"sdpa": 1.0}, "engines": ["sdpa", "triton"]}}
    (tmp_path / "shipped" / "engines-cpu.json").write_text(json.dumps({"device_key": "cpu", "rows": rows}))
    monkeypatch.setattr(engines, "engine_available", lambda e, d: (e in ("sdpa", "triton"), "a stand-in"))
    q = torch.zeros(1, 28, 2, 64)  # a size no other test's choice is memoised for
    assert engines.choose(Segments.dense(28, 28, causal=True), q, q) == "sdpa"
    assert len(probing) == 1 and probing[0][:2] == ("sdpa", "causal")        # triton was not installed there
    assert engines.choose(Segments.dense(28, 28, causal=False), q, q) == "sdpa" and len(probing) == 1  # full: it was
    table = engines.engine_table("cpu")
    assert table.shipped == {("full", "float32", 64, "mha")} and table.rows[("causal", "float32", 64, "mha")]["probed"]
    engines._TABLES.clear()                                                      # as in a new process
    table = engines.engine_table("cpu")
    assert set(table.rows) == {("causal", "float32", 64, "mha"), ("full", "float32", 64, "mha")}
    assert table.shipped == {("full", "float32", 64, "mha")} and table.source == str(tmp_path / "engines-cpu.json")
    assert engines.choose(Segments.dense(28, 28, causal=True), q, q) == "sdpa" and len(probing) == 1


def test_the_shipped_h100_rows_decide_where_no_other_engine_is_installed(tmp_path, monkeypatch):
    """The H100 table ships its measured rows (read through a stand-in device key): they decide auto's order without a
    measurement where only the engines it was measured with are installed, and not where flash-attn is."""
    h100 = "NVIDIA_H100_80GB_HBM3"
    data = json.loads((engines.SHIPPED_DIR / f"engines-{h100}.json").read_text())
    monkeypatch.setenv("NDP_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(engines, "_TABLES", {})
    monkeypatch.setattr(tuning, "device_key", lambda device: h100)
    table = engines.engine_table("cpu")
    assert len(table.rows) == len(data["rows"]) and table.shipped == set(table.rows)
    assert all(row["engines"] == ["sdpa", "triton"] for row in data["rows"].values())
    assert table.order("causal", torch.bfloat16, 128, "gqa") == (("sdpa", "triton"), "measured")
    installed = {"sdpa", "triton"}
    monkeypatch.setattr(engines, "engine_available", lambda e, d: (e in installed, "a stand-in"))
    assert engines._measured_here(table, "causal", torch.bfloat16, 128, "gqa", "cpu")
    installed.add("flash_attn")
    assert not engines._measured_here(table, "causal", torch.bfloat16, 128, "gqa", "cpu")
    assert not engines._measured_here(table, "full", torch.bfloat16, 128, "gqa", "cpu")   # no such row


def test_a_cache_that_cannot_be_written_keeps_the_measured_row_for_this_process(probing, tmp_path, monkeypatch,
                                                                                caplog):
    def read_only(path, data):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(tuning, "save_json", read_only)
    q = torch.zeros(1, 16, 2, 64)
    with caplog.at_level("WARNING", logger="ndp"):
        assert engines.choose(Segments.dense(16, 16, causal=True), q, q) == "sdpa"
    assert "could not save the measured rows" in caplog.text and not (tmp_path / "engines-cpu.json").exists()
    assert engines.engine_table("cpu").order("causal", torch.float32, 64, "mha") == (("sdpa",), "measured")
    assert engines.choose(Segments.dense(16, 16, causal=True), q, q) == "sdpa" and len(probing) == 1


def test_a_failed_probe_falls_back_and_is_not_retried(probing, monkeypatch, caplog):
    def broken(*a, **k):
        raise torch.OutOfMemoryError("out of memory")
    monkeypatch.setattr(tune, "time_engine", broken)
    q = torch.zeros(1, 16, 2, 64)
    with caplog.at_level("WARNING", logger="ndp.ops.engines"):
        assert engines.choose(Segments.dense(16, 16, causal=False), q, q) == "sdpa"      # DEFAULT_ORDER on CPU
    assert "out of memory" in caplog.text and "full/float32/64" in caplog.text
    monkeypatch.setattr(tune, "time_engine", lambda *a, **k: pytest.fail("probed twice"))
    assert engines.choose(Segments.dense(16, 16, causal=False), q, q) == "sdpa"


@pytest.mark.skipif(not ndp.ops.available_backends("cpu")["triton"][0], reason="needs triton (interpreter)")
def test_an_engine_that_fails_its_measurement_is_never_run_by_auto(probing, monkeypatch, tmp_path):
    # e.g. a flash-attn whose private signature ndp cannot fill: the other engines are still measured, and the
    # failing one is named in the row and skipped, the default order (which lists it first here) included.
    monkeypatch.setattr(tune, "engine_available", engines.engine_available)
    real = tune.check_engine

    def check(engine, *a, **k):
        if engine == "sdpa":
            raise TypeError("_flash_attention_forward() got an unexpected keyword argument 'window'")
        return real(engine, *a, **k)
    monkeypatch.setattr(tune, "check_engine", check)
    q = torch.zeros(1, 20, 2, 64)                                                # blocks no test has memoised
    assert engines.choose(Segments.dense(20, 20, causal=True), q, q) == "triton"
    row = json.loads((tmp_path / "engines-cpu.json").read_text())["rows"]["causal/float32/64/mha"]
    assert row["order"] == ["triton"] and "TypeError" in row["rejected"]["sdpa"]
    engines._TABLES.clear()                                                      # as in a new process
    monkeypatch.setattr(engines, "engine_available",
                        lambda e, d: (False, "not here") if e == "triton" else (True, ""))
    q = torch.zeros(1, 24, 2, 64)
    with pytest.raises(RuntimeError, match="sdpa: failed: TypeError"):          # never falls back onto it
        engines.choose(Segments.dense(24, 24, causal=True), q, q)


def test_no_probe_while_compiling_or_capturing(monkeypatch):
    monkeypatch.setattr(engines, "AUTO_PROBE", ("cpu",))
    assert engines._may_probe(torch.device("cpu"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not engines._may_probe(torch.device("cpu"))
    monkeypatch.setattr(engines, "AUTO_PROBE", ())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert not engines._may_probe(torch.device("cpu"))


def test_a_tuned_table_in_the_cache_dir_takes_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("NDP_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(engines, "SHIPPED_DIR", tmp_path / "shipped")  # the user's rows alone (nearest-row lookup)
    path = tmp_path / "engines-cpu.json"
    path.write_text(json.dumps({"device_key": "cpu", "rows": {"causal/float32/64": {"order": ["triton", "sdpa"],
                                                                                    "ms": {}}}}))
    table = engines.engine_table("cpu", reload=True)
    try:
        assert table.source == str(path)
        assert table.order("causal", torch.float32, 64) == (("triton", "sdpa"), "measured")
        assert table.order("causal", torch.float32, 128)[1] == "measured at head_dim 64"
        segs = Segments.dense(8, 8, causal=True)
        q = torch.zeros(1, 8, 2, 64)
        want = "triton" if ndp.ops.available_backends("cpu")["triton"][0] else "sdpa"
        assert engines.choose(segs, q, q) == want
        path.write_text("{not json")
        with pytest.raises(RuntimeError, match="unreadable.*re-run the tuning command"):
            engines.engine_table("cpu", reload=True)
        path.write_text(json.dumps({"device_key": "cpu", "rows": {"causal/float32/64": {"order": ["cudnn"]}}}))
        with pytest.raises(RuntimeError, match="malformed.*python -m ndp.ops.tune"):
            engines.engine_table("cpu", reload=True)
    finally:
        monkeypatch.undo()
        engines.engine_table("cpu", reload=True)


def test_forced_engines_refuse_what_they_cannot_run():
    q, k, v, _ = _inputs(1, 8, 8, 2, 2, 16, torch.float64)
    with pytest.raises(RuntimeError, match="flash-attn needs a CUDA device"):
        ndp.ops.attention(q, k, v, backend="flash_attn")
    with pytest.raises(RuntimeError, match="FlashAttention-3"):
        ndp.ops.attention(q, k, v, backend="flash_attn3")
    with pytest.raises(ValueError, match="backend must be one of"):
        ndp.ops.attention(q, k, v, backend="cudnn")
    if ndp.ops.available_backends("cpu")["triton"][0]:
        with pytest.raises(TypeError, match=r"cannot run this full attention block.*float64.*Engines that can here: "
                                            r"\['sdpa', 'torch'\]"):
            ndp.ops.attention(q, k, v, backend="triton")
    assert ndp.ops.resolve_backend("auto", "cpu") == "auto"


def test_tune_checks_before_timing_and_rejects_a_wrong_engine(monkeypatch):
    ok, err = tune.check_engine("sdpa", "other", torch.float32, 32, torch.device("cpu"))
    assert ok and err < 1e-4
    real = _sdpa.fwd

    def off_by_a_bit(*a, **kw):
        out, lse = real(*a, **kw)
        return out * 1.01, lse

    monkeypatch.setattr(_sdpa, "fwd", off_by_a_bit)
    ok, err = tune.check_engine("sdpa", "causal", torch.float32, 32, torch.device("cpu"))
    assert not ok and err > 1e-3
    monkeypatch.setattr(_sdpa, "fwd", real)
    table = tune.tune("cpu", dtypes=[torch.float32], head_dims=[32], s=64, iters=1, log=lambda *_: None)
    assert set(table["rows"]) == {f"{c}/float32/32/{k}" for c in engines.CLASSES for k in engines.HEAD_KINDS}
    for row in table["rows"].values():
        assert row["order"][0] == "sdpa" and set(row["ms"]) >= {"sdpa", "torch"} and "torch" not in row["order"]


def test_info_shows_the_engine_table_and_the_kernel_configs(tmp_path, monkeypatch):
    from ndp import info

    monkeypatch.setenv("NDP_TUNING_DIR", str(tmp_path))
    report = info.collect()
    eng = report["engines"]
    assert eng["source"].endswith("engines-cpu.json") and eng["rows"]["causal/float32/64"]["auto"] == "sdpa"
    assert report["kernel_configs"]["source"].startswith("static tables")
    text = info.format_report(report)
    assert "backend='auto' engine table" in text and "causal/float32/64      -> sdpa" in text
    assert "Triton launch configurations: static tables" in text
    engines.engine_table("cpu", reload=True)


def test_a_new_engine_is_one_module_and_one_entry(monkeypatch):
    # An engine module (here the reference, counting its calls) and its entry in ENGINE_MODULES: forced by name,
    # it runs the forward and the backward of ndp.ops.attention (the custom op) and gives the reference's numbers.
    calls = []
    counting = types.ModuleType("counting")
    counting.SOFTCAP = False
    counting.available = lambda device: (True, "")
    counting.capable = lambda segs, q4, k4, *, deterministic=False: (True, "")
    counting.fwd = lambda *a, **k: calls.append("fwd") or _reference.fwd(*a, **k)
    counting.bwd = lambda *a, **k: calls.append("bwd") or _reference.bwd(*a, **k)
    monkeypatch.setitem(engines.ENGINE_MODULES, "counting", counting)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, 2, 16, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))
    got = ndp.ops.attention(q, k, v, causal=True, backend="counting")
    got.sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    want = ndp.ops.attention(q, k, v, causal=True, backend="torch")
    want.sum().backward()
    assert calls == ["fwd", "bwd"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(a, x.grad, rtol=0, atol=0)
