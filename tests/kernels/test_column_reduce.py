"""The column reductions' second stage against its torch reference (interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from mtc.kernels import column_reduce
from mtc.kernels.column_reduce import combine_partials, combine_partials_ref

from mtc.errors import KernelInputError


@pytest.mark.parametrize("split,n", [(1, 7), (3, 19), (5, 1031), (130, 33)])
@pytest.mark.parametrize("how", ["sum", "mean", "amax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_combine_matches_reference(split, n, how, dtype):
    parts = torch.randn(split, n) - (3.0 if how == "amax" else 0.0)  # all below 0: a masked tail must not win a max
    got = combine_partials(parts, how, 37, dtype)
    want = combine_partials_ref(parts, how, 37, dtype)
    assert got.dtype == dtype and got.shape == (n,)
    # fp32 sums of up to 130 values in another order than torch's: rounding, not error
    torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 1e-3, atol=1e-5)


@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("how", ["sum", "mean", "amax"])
def test_several_outputs_combine_in_one_launch(split, how):
    # (K, SPLIT, N): each of the K outputs is combined from its own partials, none from another's
    parts = torch.randn(3, split, 19)
    got = combine_partials(parts, how, 11, torch.float16)
    assert got.shape == (3, 19) and got.dtype == torch.float16
    for k in range(3):
        torch.testing.assert_close(got[k], combine_partials_ref(parts[k], how, 11, torch.float16), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(combine_partials(parts, how, 11, torch.float32), combine_partials_ref(parts, how, 11, torch.float32))


def test_combine_rejects_bad_partials():
    with pytest.raises(KernelInputError, match="fp32"):
        combine_partials(torch.randn(2, 3, dtype=torch.float16), "sum", 2, torch.float32)
    with pytest.raises(KernelInputError, match="how"):
        combine_partials(torch.randn(2, 3), "prod", 2, torch.float32)
    with pytest.raises(KernelInputError, match="fp32"):
        combine_partials(torch.randn(2, 2, 2, 3), "sum", 2, torch.float32)


def test_gpu_tiles_fold_many_chunks_in_tall_tiles(monkeypatch):
    # a rowcol kernel's 528 chunks (4 per SM on an H100) into GPT-2's 1600 columns: 50 programs of
    # 128 chunks x 32 columns, each looping 5 times, not 2 programs looping 528 times
    assert column_reduce._tiles(528, 1600, cuda=True) == (128, 32)
    assert column_reduce._tiles(10, 6400, cuda=True) == (16, 256)
    assert column_reduce._tiles(3, 7, cuda=True) == (4, 8)
    # the GPU's tiles in the interpreter: tail rows and columns masked, several loop turns
    monkeypatch.setattr(column_reduce, "_tiles", lambda split, n, cuda: (128, 32))
    for how in ("sum", "mean", "amax"):
        parts = torch.randn(2, 300, 40) - (3.0 if how == "amax" else 0.0)
        got = combine_partials(parts, how, 300, torch.float32)
        torch.testing.assert_close(got, combine_partials_ref(parts, how, 300, torch.float32), rtol=1e-5, atol=1e-5)
