"""The accuracy ndp promises per dtype: the one table of tolerances its tests and benchmarks check results against
(docs/design.md, "Conventions: tests"), public so a user can check their own runs against the same bounds."""
import torch

TOL = {
    torch.float64: {"out": (1e-7, 1e-7), "grad": (1e-7, 1e-7)},
    torch.float32: {"out": (1e-5, 1e-5), "grad": (1e-4, 1e-4)},
    torch.float16: {"out": (2e-3, 1e-3), "grad": (1e-2, 1e-2)},
    torch.bfloat16: {"out": (1e-2, 1.6e-2), "grad": (3e-2, 1.6e-2)},
}


def tol(dtype, kind="out"):
    """(atol, rtol) for comparing a `dtype` result against an fp32/fp64 reference."""
    return TOL[dtype][kind]


def assert_close(actual, expected, dtype, kind="out", msg=""):
    """Compare in fp64 with the table's tolerances for `dtype`."""
    atol, rtol = tol(dtype, kind)
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol,
                               equal_nan=False, msg=(lambda m: f"{msg}: {m}") if msg else None)


def assert_within_lowp_bound(actual, expected, lowp_ref, dtype, kind="out"):
    """fp16/bf16 rule: max|kernel - ref| <= 2 * max|ref(upcast=False) - ref| + atol."""
    atol, _ = tol(dtype, kind)
    err = (actual.double() - expected.double()).abs().max().item()
    base = (lowp_ref.double() - expected.double()).abs().max().item()
    assert err <= 2 * base + atol, f"max error {err:.3e} > 2*{base:.3e} + {atol:.1e} (low-precision bound)"
