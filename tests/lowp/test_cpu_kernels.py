"""The compiled CPU kernels (torchnext/lowp/cpu): the quantize casts are byte-identical to the reference quantizer and
the small-M GEMV matches the reference backend, for every compiled instruction-set variant (AVX-512, AVX2, portable)
on random shapes (K not a multiple of the block, N not a multiple of the 16-column tile, both dims, 3-D), NaN/Inf
inputs, every recipe; the fast path is really the one selected here (this machine has a compiler); the fallback
works when the kernels are disabled, the compiler is missing or the build fails (subprocesses)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lowp_data import distributions
from mm_helpers import SQNR_BACKEND_DB, sqnr_db

from torchnext.lowp import Epilogue, QuantOptions, ScaledMMResult, quantize, rng, scaled_mm
from torchnext.lowp.cpu import ISAS, status
from torchnext.lowp.mm import autotune as at
from torchnext.lowp.mm.backends import BackendUnavailable, get_backend
from torchnext.lowp.mm.backends import cpu as cpu_backend
from torchnext.lowp.mm.scaled_mm import make_problem
from torchnext.lowp.quantizers import cpu as cpu_quantizer
from torchnext.lowp.quantizers import get_quantizer

HAVE_CXX = shutil.which(os.environ.get("CXX", "c++")) is not None
needs_kernels = pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler: the compiled CPU kernels cannot be built here")

OPTIONS = [
    ("nvfp4", {}),
    ("nvfp4", {"global_scale": True}),
    ("nvfp4", {"global_scale": 3.5e-3}),
    ("nvfp4", {"recipe": "te"}),
    ("nvfp4", {"recipe": "te", "global_scale": 0.25}),
    ("mxfp8_e4m3", {}),
    ("mxfp8_e4m3", {"scale_mode": "rceil"}),
    ("mxfp8_e5m2", {}),
    ("mxfp8_e5m2", {"scale_mode": "rceil"}),
    ("mxfp4", {}),
    ("mxfp4", {"scale_mode": "rceil"}),
]


def _isas() -> list[str]:
    return list(status().isas) if status().available else ["portable"]


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    name = str(request.param)
    if not HAVE_CXX:
        pytest.skip("no C++ compiler")
    if name not in status().isas:
        pytest.skip(f"{name} is not compiled into this build (CPU lacks it): {status().isas}")
    monkeypatch.setattr(cpu_quantizer, "ISA", name)
    monkeypatch.setattr(cpu_backend.BACKEND, "isa", name)
    return name


# ------------------------------------------------------------------------------------------------ the fast path
@needs_kernels
def test_kernels_are_built_and_selected_here() -> None:
    st = status()
    assert st.available, f"a C++ compiler is on PATH but the CPU kernels are unavailable: {st.reason}"
    assert "portable" in st.isas and st.library and Path(st.library).exists()
    spec = quantize(torch.zeros(1, 16), "nvfp4").spec
    assert get_quantizer("auto", torch.device("cpu"), spec) is cpu_quantizer
    w = quantize(torch.randn(64, 64), "nvfp4")
    p = make_problem(torch.randn(1, 64), w, Epilogue(bias=torch.zeros(64), activation="silu"))
    names = at.eligible_backends(p)
    assert names[0] == "cpu" and "inductor" not in names  # superseded: never compiled/timed for these keys
    assert at.eligible_backends(make_problem(torch.randn(17, 64), w, None))[0] != "cpu"  # M > 16


@needs_kernels
def test_auto_runs_the_compiled_kernels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCHNEXT_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    at.clear_memory_cache()
    calls = {"gemv": 0, "quantize": 0}
    real_ops = cpu_backend.ops()

    class Spy:
        def __getattr__(self, name: str) -> object:
            fn = getattr(real_ops, name)
            if name not in calls:
                return fn

            def wrapped(*args: object) -> object:
                calls[name] += 1
                return fn(*args)

            return wrapped

    monkeypatch.setattr(cpu_backend, "ops", Spy)
    monkeypatch.setattr(cpu_quantizer, "ops", Spy)
    w = quantize(torch.randn(96, 80), "mxfp4")
    assert calls["quantize"] == 1
    y = scaled_mm(torch.randn(3, 80), w)
    assert isinstance(y, torch.Tensor) and y.shape == (3, 96)
    assert calls["gemv"] >= 1
    at.clear_memory_cache()


# --------------------------------------------------------------------------------------------- the quantizer
def _element_codes(q: object) -> torch.Tensor:
    """(rows, k_padded) int codes, one per element (FP4 nibbles unpacked)."""
    u8 = q.qdata.view(torch.uint8).reshape(-1, q.qdata.shape[-1]).to(torch.int32)  # type: ignore[attr-defined]
    if q.spec.element.per_byte == 2:  # type: ignore[attr-defined]
        return torch.stack([u8 & 15, u8 >> 4], dim=-1).reshape(u8.shape[0], -1)
    return u8


def _assert_same(a: object, b: object, what: str, x: torch.Tensor | None = None, dim: int = -1) -> None:
    """Scale bytes identical; element codes identical, except that where the input is NaN only the code's magnitude
    is compared (a NaN's sign bit depends on operand order inside a multiply: unspecified, docs/lowp.md)."""
    assert torch.equal(a.scale_bytes, b.scale_bytes), f"{what}: scale bytes differ"  # type: ignore[attr-defined]
    ca, cb = _element_codes(a), _element_codes(b)
    if x is not None and torch.isnan(x).any():
        xm = x.movedim(dim, -1)
        nan = torch.isnan(torch.nn.functional.pad(xm.float(), (0, ca.shape[1] - xm.shape[-1]))).reshape(ca.shape)
        sign = 8 if a.spec.element.per_byte == 2 else 0x80  # type: ignore[attr-defined]
        ca = torch.where(nan, ca & ~sign, ca)
        cb = torch.where(nan, cb & ~sign, cb)
    if not torch.equal(ca, cb):
        bad = (ca != cb).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: codes differ at {bad}")
    assert a.shape == b.shape and a.swizzled == b.swizzled  # type: ignore[attr-defined]
    assert (a.global_scale is None) == (b.global_scale is None)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("fmt", "opts"), OPTIONS, ids=[f"{f}-{'-'.join(map(str, o.values())) or 'default'}" for f, o in OPTIONS])
def test_quantize_bytes_equal_reference(isa: str, fmt: str, opts: dict[str, object]) -> None:
    g = torch.Generator().manual_seed(11)
    shapes = [((37, 80), -1), ((37, 80), 0), ((5, 48, 21), 1), ((3, 7, 50), -1), ((130, 36), 0), ((2, 33), -1), ((64,), 0)]
    for shape, dim in shapes:
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
        flat = x.view(-1)
        flat[3] = float("nan")
        flat[min(40, flat.numel() - 1)] = float("inf")
        flat[min(77, flat.numel() - 1)] = -float("inf")
        flat[min(5, flat.numel() - 1)] = 0.0
        flat[min(6, flat.numel() - 1)] = -0.0
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            xd = x.to(dtype)
            for swz in (False, True):
                ref = quantize(xd, fmt, dim=dim, backend="reference", swizzle=swz, **opts)
                got = quantize(xd, fmt, dim=dim, backend="cpu", swizzle=swz, **opts)
                _assert_same(got, ref, f"{isa} {fmt} {opts} {shape} dim={dim} {dtype} swizzle={swz}", xd, dim)


@pytest.mark.parametrize(("fmt", "opts"), OPTIONS[::2], ids=[f for f, _ in OPTIONS[::2]])
def test_quantize_bytes_on_stress_distributions(isa: str, fmt: str, opts: dict[str, object]) -> None:
    for name, x in distributions((24, 96), seed=5):
        for dim in (-1, 0):
            ref = quantize(x, fmt, dim=dim, backend="reference", **opts)
            got = quantize(x, fmt, dim=dim, backend="cpu", **opts)
            _assert_same(got, ref, f"{isa} {fmt} {opts} {name} dim={dim}", x, dim)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"])
def test_stochastic_rounding_equals_reference(isa: str, fmt: str) -> None:
    """In-kernel noise: element i of the padded block matrix draws uniform(seed, offset + i) (padding consumes
    counters); the bytes equal the reference's, which expands the same counters in torch."""
    x = torch.randn(21, 45) * 3
    for seed, offset in [(9, 0), ((1 << 63) + 12345, (1 << 32) - 300)]:  # the second crosses the counter's low word
        for dim in (-1, 0):
            for swz in (False, True):
                kw = {"rounding": "stochastic", "seed": seed, "offset": offset, "dim": dim, "swizzle": swz}
                ref = quantize(x, fmt, backend="reference", **kw)  # type: ignore[arg-type]
                got = quantize(x, fmt, backend="cpu", **kw)  # type: ignore[arg-type]
                _assert_same(got, ref, f"{isa} {fmt} dim={dim} seed={seed} stochastic")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8_e4m3"])
def test_stochastic_rounding_from_a_noise_tensor(isa: str, fmt: str) -> None:
    from torchnext.lowp.formats import format_spec
    from torchnext.lowp.quantize import global_scales
    from torchnext.lowp.quantizers import reference
    from torchnext.lowp.scales import ScaleInputs

    spec = format_spec(fmt)
    x2 = torch.randn(30, spec.block_size)
    ro = QuantOptions(rounding="stochastic", seed=1).resolve(spec)
    inp = ScaleInputs(spec, *global_scales(x2, spec, ro))
    noise = torch.rand(x2.shape, generator=torch.Generator().manual_seed(2))
    rc, rs = reference.quantize_blocks(x2, spec, ro, inp, noise)
    cc, cs = cpu_quantizer.quantize_blocks(x2, spec, ro, inp, noise)
    assert torch.equal(rc.view(torch.uint8), cc.view(torch.uint8)) and torch.equal(rs.view(torch.uint8), cs.view(torch.uint8))


@needs_kernels
def test_rng_matches_python_generator() -> None:
    from torchnext.lowp.cpu import ops

    for seed, offset, n in [(0, 0, 100), (1, 2**32 - 5, 10), (2**64 - 1, 2**40 + 7, 33), (12345, 0, 1000)]:
        s = seed - (1 << 64) if seed >= 1 << 63 else seed
        got = ops().rng_uniform(s, offset, n)
        assert torch.equal(got, rng.uniform(seed, offset, (n,))), (seed, offset)


@needs_kernels
def test_tensor_amax() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(1000, 77).to(dtype)
        assert float(cpu_quantizer.tensor_amax(x)) == float(x.float().abs().max())
        assert float(cpu_quantizer.tensor_amax(x[:, ::2])) == float(x[:, ::2].float().abs().max())
        x[500, 3] = -float("inf")
        assert float(cpu_quantizer.tensor_amax(x)) == float("inf")
        x[7, 7] = float("nan")
        assert math.isnan(float(cpu_quantizer.tensor_amax(x)))
    assert float(cpu_quantizer.tensor_amax(torch.full((3,), -0.0))) == 0.0


def test_rht_amax_is_the_transform_amax(isa: str) -> None:
    from torchnext.lowp.hadamard import rht, rht_signs

    for shape in ((37, 45), (64, 16), (3, 100)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(shape) * 5).to(dtype)
            s = rht_signs(shape[0])
            want = rht(x, s, dim=0).abs().max()
            assert float(cpu_quantizer.rht_amax(x, s)) == float(want), (isa, shape, dtype)
    x = torch.randn(20, 20)
    x[3, 3] = float("nan")
    assert math.isnan(float(cpu_quantizer.rht_amax(x, rht_signs(1))))


@needs_kernels
def test_quantize_blocks_interface_and_empty() -> None:
    x2 = torch.randn(50, 32)
    for fmt in ("mxfp8_e4m3", "mxfp4"):
        a = quantize(x2, fmt, backend="cpu")
        b = quantize(x2, fmt, backend="reference")
        _assert_same(a, b, fmt)
    assert quantize(torch.empty(0, 64), "nvfp4", backend="cpu").qdata.shape == (0, 32)
    assert quantize(torch.empty(5, 0), "mxfp4", backend="cpu").qdata.shape == (5, 0)
    q = quantize(torch.randn(3, 40), "nvfp4", backend="cpu")
    assert torch.equal(q.dequantize(backend="cpu"), q.dequantize(backend="reference"))


# ------------------------------------------------------------------------------------------ the two-copy cast
PAIR_CASES = [
    ("nvfp4", QuantOptions(recipe="te"), None),
    ("nvfp4", QuantOptions(), QuantOptions(global_scale=True)),
    ("mxfp8_e4m3", QuantOptions(scale_mode="rceil"), QuantOptions()),
    ("mxfp8_e5m2", QuantOptions(), None),
    ("mxfp4", QuantOptions(scale_mode="rceil"), None),
]


@pytest.mark.parametrize(("fmt", "row_opts", "col_opts"), PAIR_CASES, ids=[c[0] for c in PAIR_CASES])
def test_pair_kernel_equals_two_reference_quantizations(isa: str, fmt: str, row_opts: QuantOptions,
                                                        col_opts: QuantOptions | None) -> None:
    """quantize_pair_blocks: the rowwise and columnwise copies from one read, byte-identical to quantize(dim=1)
    and quantize(dim=0) (or of rht(x, dim=0)) with the reference kernel; stochastic rounding in both copies."""
    from torchnext.lowp import quantize_pair
    from torchnext.lowp.hadamard import rht, rht_signs

    calls: list[int] = []
    real = cpu_quantizer.quantize_pair_blocks

    def spy(*args: object) -> object:
        out = real(*args)  # type: ignore[arg-type]
        calls.append(out is not None)
        return out

    g = torch.Generator().manual_seed(8)
    for shape in ((64, 96), (37, 45), (5, 130)):
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-10, 10, shape, generator=g).float())
        x[1, 2] = float("nan")
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            for stochastic in (False, True):
                ro = row_opts.with_(backend="cpu")
                co = (col_opts or row_opts).with_(backend="cpu")
                if stochastic:
                    ro, co = ro.with_(rounding="stochastic", seed=11, offset=3), co.with_(rounding="stochastic", seed=12)
                signs_list = [None, rht_signs(4)] if fmt == "nvfp4" or fmt == "mxfp4" else [None]
                for signs in signs_list:
                    calls.clear()
                    with pytest.MonkeyPatch.context() as mp:
                        mp.setattr(cpu_quantizer, "quantize_pair_blocks", spy)
                        row, col = quantize_pair(xd, fmt, options=ro, col_options=co, rht_signs=signs)
                    assert calls == [True], "the fused kernel did not run"
                    what = f"{isa} {fmt} {shape} {dtype} sr={stochastic} rht={signs is not None}"
                    want_row = quantize(xd, fmt, dim=1, options=ro.with_(backend="reference"))
                    xc = rht(xd, signs, dim=0) if signs is not None else xd
                    want_col = quantize(xc, fmt, dim=0, options=co.with_(backend="reference"))
                    _assert_same(row, want_row, what + " row", xd, 1)
                    _assert_same(col, want_col, what + " col", xc, 0)


@needs_kernels
def test_pair_kernel_declines_noise_tensors_and_other_devices() -> None:
    from torchnext.lowp.formats import format_spec
    from torchnext.lowp.scales import ScaleInputs

    spec = format_spec("mxfp8_e4m3")
    ro = QuantOptions().resolve(spec)
    inp = ScaleInputs(spec, None)
    x = torch.randn(32, 32)
    assert cpu_quantizer.quantize_pair_blocks(x, spec, ro, ro, inp, inp, None) is not None
    from dataclasses import replace

    tensor_noise = replace(ro, noise=torch.rand(32, 32))  # type: ignore[arg-type]
    assert cpu_quantizer.quantize_pair_blocks(x, spec, tensor_noise, ro, inp, inp, None) is None
    assert cpu_quantizer.quantize_pair_blocks(x, spec, ro, ro, inp, inp, None) is not None
    assert cpu_quantizer.quantize_pair_blocks(x.to("meta"), spec, ro, ro, inp, inp, None) is None


# --------------------------------------------------------------------------------------------------- the GEMV
N_ODD, K_ODD = 50, 80  # N not a multiple of the 16-column tile, K not a multiple of 32 (MX weights are padded)


def _epilogue(m: int, n: int, kind: str) -> Epilogue:
    g = torch.Generator().manual_seed(2)
    if kind == "none":
        return Epilogue()
    if kind == "full":
        return Epilogue(scale=torch.rand(n, generator=g) + 0.5, bias=torch.randn(n, generator=g), activation="gelu_tanh",
                        residual=torch.randn(m, n, generator=g), output_amax=True, out_format="mxfp8_e4m3")
    act = {"relu": "relu", "gelu": "gelu", "silu": "silu"}[kind]
    return Epilogue(scale=1.7, bias=torch.randn(n, generator=g), activation=act, output_amax=True)


def _close(res: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(res)), f"{what}: non-finite positions differ"
    assert torch.equal(ref[~fin].nan_to_num(), res[~fin].nan_to_num()), f"{what}: non-finite values differ"
    if fin.any():
        s = sqnr_db(res[fin], ref[fin])
        assert s >= SQNR_BACKEND_DB, f"{what}: SQNR {s:.1f} dB"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"])
def test_gemv_matches_reference(isa: str, fmt: str) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(N_ODD, K_ODD, generator=g)
    variants = [{"global_scale": True}, {"recipe": "te"}, {}] if fmt == "nvfp4" else [{}, {"scale_mode": "rceil"}]
    for opts in variants:
        wq = quantize(w, fmt, **opts)
        for m in (1, 2, 3, 5, 9, 16):
            for kind in ("none", "full", "relu", "gelu", "silu"):
                for dtype in (torch.float32, torch.bfloat16):
                    a = torch.randn(m, K_ODD, generator=g).to(dtype)
                    ep = _epilogue(m, N_ODD, kind)
                    ref = scaled_mm(a, wq, epilogue=ep, backend="reference")
                    res = scaled_mm(a, wq, epilogue=ep, backend="cpu")
                    what = f"{isa} {fmt} {opts} m={m} {kind} {dtype}"
                    if isinstance(ref, ScaledMMResult):
                        assert isinstance(res, ScaledMMResult)
                        assert res.output.dtype == ref.output.dtype == dtype
                        _close(res.output.float(), ref.output.float(), what)
                        assert res.amax is not None and ref.amax is not None
                        torch.testing.assert_close(res.amax, ref.amax, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=0)
                        if ep.out_format is not None:
                            assert res.quantized is not None
                            if dtype != torch.float32:  # quantized from the fp32 y, as in every backend
                                continue
                            own = quantize(res.output, "mxfp8_e4m3")
                            assert torch.equal(res.quantized.qdata.view(torch.uint8), own.qdata.view(torch.uint8))
                    else:
                        assert isinstance(res, torch.Tensor) and res.dtype == dtype
                        _close(res.float(), ref.float(), what)


def test_gemv_nan_inf_in_activations_and_weights(isa: str) -> None:
    g = torch.Generator().manual_seed(4)
    for fmt in ("nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"):
        w = torch.randn(N_ODD, K_ODD, generator=g)
        w[7, 3] = float("nan")  # a NaN block: its column is NaN whatever a is
        w[9, 40] = float("inf")  # an Inf block (MX: the Inf saturates, neighbours flush to 0)
        wq = quantize(w, fmt)
        for m in (1, 4, 16):
            a = torch.randn(m, K_ODD, generator=g)
            a[0, 5] = float("nan")
            if m > 1:
                a[1, 11] = float("inf")
                a[-1, 70] = -float("inf")
            for ep in (Epilogue(), Epilogue(bias=torch.randn(N_ODD, generator=g), activation="silu", output_amax=True)):
                ref = scaled_mm(a, wq, epilogue=ep, backend="reference")
                res = scaled_mm(a, wq, epilogue=ep, backend="cpu")
                r0 = ref.output if isinstance(ref, ScaledMMResult) else ref
                r1 = res.output if isinstance(res, ScaledMMResult) else res
                _close(r1, r0, f"{isa} {fmt} m={m} NaN/Inf")
                if isinstance(res, ScaledMMResult):
                    assert res.amax is not None and math.isnan(float(res.amax))


def test_gemv_block_scaled_activations_swizzled_weights_and_dtypes(isa: str) -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(N_ODD, 64, generator=g)
    a = torch.randn(6, 64, generator=g)
    for fmt in ("nvfp4", "mxfp8_e4m3"):
        wq = quantize(w, fmt, swizzle=True)
        for aa in (quantize(a, fmt), a.half(), a.double()):
            ref = scaled_mm(aa, wq, backend="reference")
            res = scaled_mm(aa, wq, backend="cpu")
            assert isinstance(res, torch.Tensor) and isinstance(ref, torch.Tensor) and res.dtype == ref.dtype
            _close(res.float(), ref.float(), f"{isa} {fmt} {type(aa).__name__}")
        res16 = scaled_mm(a, wq, epilogue=Epilogue(out_dtype=torch.float16), backend="cpu")
        assert isinstance(res16, torch.Tensor) and res16.dtype == torch.float16


@needs_kernels
def test_gemv_scale_kinds_and_big_mx_scales() -> None:
    g = torch.Generator().manual_seed(6)
    w = torch.randn(33, 64, generator=g)
    a = torch.randn(4, 64, generator=g)
    wq = quantize(w, "nvfp4", global_scale=True)
    for scale in (0.5, torch.tensor(2.0), torch.rand(4, 1, generator=g), torch.rand(33, generator=g)):
        ep = Epilogue(scale=scale, residual=torch.randn(4, 33, generator=g))
        _close(scaled_mm(a, wq, epilogue=ep, backend="cpu"), scaled_mm(a, wq, epilogue=ep, backend="reference"), str(scale))  # type: ignore[arg-type]
    # MXFP8 E4M3 scale bytes >= 247 (an Inf in a block): the kernel's safe decode variant
    w2 = w.clone()
    w2[3, 10] = float("inf")
    wq2 = quantize(w2, "mxfp8_e4m3")
    assert int(wq2.scale_bytes.max()) >= 247
    _close(scaled_mm(a, wq2, backend="cpu"), scaled_mm(a, wq2, backend="reference"), "big scales")  # type: ignore[arg-type]


@needs_kernels
def test_gemv_declines_what_it_does_not_cover() -> None:
    from torchnext.lowp.mm.epilogue import register_activation

    w = quantize(torch.randn(32, 32), "nvfp4")
    b = get_backend("cpu")
    assert b.supports(make_problem(torch.randn(17, 32), w, None)) is not None
    assert b.supports(make_problem(torch.randn(2, 32), torch.randn(32, 32), None)) is not None
    register_activation("_test_square", lambda y: y * y, overwrite=True)
    try:
        why = b.supports(make_problem(torch.randn(2, 32), w, Epilogue(activation="_test_square")))
        assert why is not None and "activation" in why
    finally:
        from torchnext.lowp.mm.epilogue import ACTIVATIONS

        ACTIVATIONS.pop("_test_square", None)
    with pytest.raises(BackendUnavailable):
        scaled_mm(torch.randn(20, 32), w, backend="cpu")


@needs_kernels
def test_packed_weight_is_cached_and_follows_inplace_changes() -> None:
    wq = quantize(torch.randn(40, 64), "nvfp4", global_scale=True)
    a = torch.randn(1, 64)
    p1 = cpu_backend.packed_weight(wq)
    assert cpu_backend.packed_weight(wq) is p1
    first = scaled_mm(a, wq, backend="cpu")
    wq.qdata[:5].zero_()
    assert cpu_backend.packed_weight(wq) is not p1
    res = scaled_mm(a, wq, backend="cpu")
    assert isinstance(res, torch.Tensor) and isinstance(first, torch.Tensor) and not torch.equal(first, res)
    _close(res, scaled_mm(a, wq, backend="reference"), "after in-place change")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------- fallbacks
_CHILD = textwrap.dedent(
    """
    import json, torch
    from torchnext.lowp import quantize, scaled_mm
    from torchnext.lowp.cpu import status
    from torchnext.lowp.mm import autotune as at
    from torchnext.lowp.mm.scaled_mm import make_problem
    from torchnext.lowp.quantizers import get_quantizer
    from torchnext.doctor.lowp_probes import doctor_probes
    st = status()
    x = torch.randn(8, 64)
    q = quantize(x, "nvfp4")
    ref = quantize(x, "nvfp4", backend="reference")
    p = make_problem(torch.randn(1, 64), q, None)
    probe = [pr for pr in doctor_probes() if pr.name == "cpu-kernels"][0].check(None)
    try:
        scaled_mm(torch.randn(1, 64), q, backend="cpu")
        explicit = "ran"
    except Exception as exc:
        explicit = type(exc).__name__
    print(json.dumps({
        "available": st.available, "reason": st.reason, "built": st.build_seconds,
        "auto_quantizer": get_quantizer("auto", x.device, q.spec).__name__,
        "same_bytes": bool(torch.equal(q.qdata, ref.qdata) and torch.equal(q.scale_bytes, ref.scale_bytes)),
        "candidates": at.eligible_backends(p), "explicit_cpu": explicit,
        "probe": [probe.available, probe.reason],
    }))
    """
)


def _child(env: dict[str, str]) -> dict[str, object]:
    full = {**os.environ, "TORCHNEXT_AUTOTUNE": "0", **env}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=full, capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("env", "why"),
    [
        ({"TORCHNEXT_CPU_KERNELS": "0"}, "disabled by TORCHNEXT_CPU_KERNELS=0"),
        ({"TORCHNEXT_CXX": "/nonexistent/g++"}, "no C++ compiler"),
        ({"TORCHNEXT_CXX": "false"}, "build failed"),
    ],
    ids=["disabled", "no-compiler", "build-fails"],
)
def test_fallback_without_the_kernels(env: dict[str, str], why: str, tmp_path: Path) -> None:
    r = _child({**env, "TORCHNEXT_KERNEL_CACHE": str(tmp_path / "kernels")})
    assert r["available"] is False and why in str(r["reason"])
    assert r["auto_quantizer"] == "torchnext.lowp.quantizers.eager" and r["same_bytes"] is True
    cands = r["candidates"]
    assert isinstance(cands, list) and "cpu" not in cands and "eager" in cands
    assert r["explicit_cpu"] == "BackendUnavailable"
    assert r["probe"] == [False, r["reason"]]


@needs_kernels
def test_a_second_process_loads_the_cached_build() -> None:
    assert status().available
    r = _child({})
    assert r["available"] is True and r["built"] is None and "cached at" in str(r["reason"])
    assert r["auto_quantizer"] == "torchnext.lowp.quantizers.cpu" and r["same_bytes"] is True
    assert isinstance(r["candidates"], list) and r["candidates"][0] == "cpu"
    assert r["probe"][0] is True  # type: ignore[index]
