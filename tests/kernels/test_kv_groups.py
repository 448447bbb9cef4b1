"""Grouped KV heads repeated per query head and gradients summed back (`kernels/kv_groups.py`),
against their pure-torch references, under the Triton interpreter: any strides on either side."""

from __future__ import annotations

import pytest
import torch

from mtc.kernels.kv_groups import expand_heads, expand_heads_ref, sum_groups, sum_groups_ref


def _bthd(B: int, H: int, T: int, D: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A (B, H, T, D) view of a (B, T, H, D) buffer: how the compiled graphs hand q, k and v over."""
    return torch.randn(B, T, H, D, dtype=dtype).transpose(1, 2)


@pytest.mark.parametrize("rep", [1, 3])
@pytest.mark.parametrize("T, D", [(70, 24), (16, 32)])  # T past one 64-row block; a head dim not a power of 2
def test_expand_heads_writes_each_kv_head_for_its_group_in_the_query_layout(rep, T, D):
    torch.manual_seed(0)
    B, Hkv = 2, 2
    q = _bthd(B, Hkv * rep, T, D)
    for k in (_bthd(B, Hkv, T, D), torch.randn(B, Hkv, T, D)):
        out = expand_heads(k, rep, q)
        assert out.stride() == torch.empty_like(q).stride()
        assert torch.equal(out, expand_heads_ref(k, rep))
    half = _bthd(B, Hkv, T, D, torch.float16)  # a copy: exact in any dtype
    assert torch.equal(expand_heads(half, rep, q), expand_heads_ref(half, rep)) and expand_heads(half, rep, q).dtype == torch.float16


@pytest.mark.parametrize("rep", [1, 4])
@pytest.mark.parametrize("T, D", [(70, 24), (16, 32)])
def test_sum_groups_sums_each_group_into_the_kv_layout(rep, T, D):
    torch.manual_seed(1)
    B, Hkv = 2, 2
    k = _bthd(B, Hkv, T, D)
    for g in (torch.randn(B, Hkv * rep, T, D), _bthd(B, Hkv * rep, T, D)):
        out = sum_groups(g, rep, k)
        assert out.stride() == torch.empty_like(k).stride()
        torch.testing.assert_close(out, sum_groups_ref(g, rep), rtol=1e-6, atol=1e-6)
    # the round trip: a group's repeated heads sum to rep times the head
    torch.testing.assert_close(sum_groups(expand_heads(k, rep, _bthd(B, Hkv * rep, T, D)), rep, k), rep * k)


def test_bad_shapes_say_what_was_expected():
    k, q = torch.randn(1, 2, 8, 16), torch.randn(1, 6, 8, 16)
    with pytest.raises(ValueError, match=r"like must have shape \(1, 4, 8, 16\)"):
        expand_heads(k, 2, q)
    with pytest.raises(ValueError, match="do not form groups of 4"):
        sum_groups(q, 4, k)
    with pytest.raises(ValueError, match=r"expected a \(B, H, T, D\) tensor"):
        expand_heads(k[0], 3, q)
