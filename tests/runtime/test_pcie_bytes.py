"""What crosses PCIe per step, byte for byte: the copy engine's counters against the program.

Per step, layer-major: each layer's weights cross host-to-device in the compute dtype once per
visit (forward, then backward; the head's one visit does both), whatever the number of
micro-batches; a `ram` layer's gradient crosses back once, in fp32; a `gpu` layer's weights and
gradient stay on the device, and its fp32 state crosses out only at a commit (write-behind); a
`ram` layer updated on the GPU (`gpu_update`) also streams master, m and v in (its gradient waits on the device) and
the new state (and compute copy) back; offloaded boundary activations cross both ways; each
micro-batch's token ids and targets (int64) go up once. On the CPU
device the copy engine runs the same copies on threads, so its counters are exact here.
"""

from __future__ import annotations

import math

import pytest
import torch

from mtc.graphs.program import Program
from mtc.runtime.placement import handed_layers
from mtc.runtime.tiers import state_kinds
from mtc.train import train
from tests.runtime.engine_util import skewed_tokens, small_config


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return skewed_tokens(tmp_path_factory.mktemp("data") / "tok.bin")


def expected_bytes(program: Program, placement: list[str], *, compute_bytes: int, gpu_update: set[int], n_micro: int,
                   offload: bool, commit_kinds: tuple[str, ...], handed: set[int] = frozenset(),
                   first: bool = True) -> tuple[int, int]:
    """(host-to-device, device-to-host) bytes of one step on the CPU device; ``commit_kinds``: the
    state arrays a commit of this step writes (empty on other steps); ``handed``: GPU-updated
    layers whose new weights stay in their scratch sets (`LayerState.device_copy`): they do not
    cross back, and a step after the ``first`` reads them there."""
    L = program.n_layers
    numel = [program.layer_numel(i) for i in range(L)]
    h2d = d2h = 0
    for i in [*range(L - 1), L - 1, *range(L - 2, -1, -1)]:  # forward, head (forward + backward), backward
        # the visit reads its own weights and tied ones of other layers: each crosses unless resident
        reads = {i: numel[i]}
        for k in dict.fromkeys(program.layers[i].param_keys()):
            p = program.params[k]
            if p.layer != i:
                reads[p.layer] = reads.get(p.layer, 0) + p.numel
        h2d += compute_bytes * sum(n for owner, n in reads.items() if placement[owner] != "gpu" and (first or owner not in handed))
    grads_on_device = not offload  # a fixed activation budget: GPU-updated layers' gradients go to the host too
    for i, tier in enumerate(placement):
        if tier == "ram" and (i not in gpu_update or not grads_on_device):
            d2h += 4 * numel[i]  # the fp32 gradient, once per step
        # updated on the GPU: master, m, v in, with the gradient unless it waited on the device
        # since backward; master, m, v (and a bf16 copy) out
        if i in gpu_update:
            h2d += (12 if grads_on_device else 16) * numel[i]
            d2h += (12 + (compute_bytes if compute_bytes != 4 and i not in handed else 0)) * numel[i]
        if tier == "gpu":
            d2h += 4 * len(commit_kinds) * numel[i]  # staged out for the write-behind
        # a disk layer's gradient is accumulated in host memory on the CPU device (on CUDA its
        # update copies it over, 4 B/param); its compute copy crosses like a ram layer's
    h2d += n_micro * 2 * math.prod(program.batch["ids"].shape) * 8  # token ids and targets, int64
    if offload:  # every block's input, per micro-batch, out after its forward and back for its backward
        carry = program.carry.numel * compute_bytes * n_micro * (L - 2)
        h2d, d2h = h2d + carry, d2h + carry
    return h2d, d2h


CASES = {
    "ram-bf16-accum1": dict(compute_dtype="bfloat16", grad_accum=1),
    "ram-bf16-accum4": dict(compute_dtype="bfloat16", grad_accum=4),  # the same bytes as accum1: not per micro-batch
    "ram-fp32-tied-accum3": dict(compute_dtype="float32", grad_accum=3, model_overrides={"n_layers": 2, "tie_embeddings": True}),
    "mixed-offload-bf16": dict(compute_dtype="bfloat16", grad_accum=3, placement="gpu:0,ram:1,disk:2,ram:3", disk_compute="ram",
                               activation_budget_gb=1e-9),
    "mixed-offload-fp32": dict(compute_dtype="float32", grad_accum=2, placement="gpu:0,ram:1,disk:2,ram:3", disk_compute="ram",
                               activation_budget_gb=1e-9),
    "gpu-update-bf16": dict(compute_dtype="bfloat16", gpu_update="1-2"),
    "gpu-update-fp32": dict(compute_dtype="float32", gpu_update="1-2"),
    # layer 1's state crosses in during the backward: the same bytes, earlier; and its new weights
    # stay in its set for its visits (the handoff): they cross neither back nor, after the first
    # step, to the visits
    "gpu-update-prefetch-bf16": dict(compute_dtype="bfloat16", gpu_update="1-2", update_prefetch=1),
    "gpu-update-prefetch-nohandoff-bf16": dict(compute_dtype="bfloat16", gpu_update="1-2", update_prefetch=1, update_handoff=False),
    # with a fixed activation budget the gradients do not wait on the device: down and back up
    "gpu-update-offload-bf16": dict(compute_dtype="bfloat16", gpu_update="1-2", activation_budget_gb=1e-9),
    "gpu-commits-bf16": dict(compute_dtype="bfloat16", placement="gpu:0-1,ram:2-3", durability="full", commit_every=2, steps=3),
}


@pytest.mark.parametrize("mode", CASES.values(), ids=CASES.keys())
def test_bytes_per_step_match_the_program(tokens, mode):
    kw = dict(placement="ram", steps=2, durability="none") | mode
    # GPU-side updates run on the optimizer's thread after the step returns: the serialised
    # schedule lets each step's record hold its own update's copies
    res = train(small_config(**kw), None, tokens, serialize="gpu_update" in mode)
    try:
        cfg = small_config(**kw)
        cbytes = 2 if cfg.resolved_compute_dtype == "bfloat16" else 4
        assert res.gpu_update == ({1, 2} if "gpu_update" in mode else set())
        got = [(r.h2d_bytes, r.d2h_bytes) for r in res.records]
        # loaded ahead into a set no later update reuses, in bf16: handed over
        handed = handed_layers(res.gpu_update, res.prefetch, cbytes, cfg.update_handoff)
        want = [expected_bytes(res.program, res.placement, compute_bytes=cbytes, gpu_update=res.gpu_update, n_micro=cfg.grad_accum,
                               offload="activation_budget_gb" in mode,
                               commit_kinds=state_kinds("gpu", cfg.durability) if r.committed else (),
                               handed=handed, first=k == 0)
                for k, r in enumerate(res.records)]
        assert handed == ({1} if "update_prefetch" in mode and cbytes == 2 and cfg.update_handoff else set())
        assert got == want
        if "commit_every" in mode:  # both kinds of step were seen
            assert [r.committed for r in res.records] == [False, True, True]
    finally:
        res.store.close()


class _OnCuda:
    """Stands for a CUDA tensor in the copy engine's byte counts (it only asks size and device)."""

    device = torch.device("cuda")

    def __init__(self, numel: int) -> None:
        self.n = numel

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return 2

    def copy_(self, src: object) -> None:
        self.src = src


def test_device_to_device_copies_are_not_counted_as_pcie():
    # a visit's fetch may copy a tied weight from a resident owner: on CUDA that copy stays on the device
    from mtc.runtime.timeline import Timeline
    from mtc.runtime.transfer import CopyEngine

    eng = CopyEngine(torch.device("cpu"), Timeline())
    try:
        host, slot = torch.ones(10), torch.empty(10)
        dst, src = _OnCuda(7), _OnCuda(7)
        eng.h2d([(slot, host), (dst, src)]).wait()
        eng.d2h([(host, slot)]).wait()
        assert dst.src is src and torch.equal(slot, host)  # both copies ran
        assert (eng.h2d_bytes, eng.d2h_bytes, eng.d2d_bytes) == (40, 40, 14)
    finally:
        eng.close()


def test_a_copy_that_converts_across_the_link_goes_in_pieces(monkeypatch):
    # the device temporary of a converting copy is one piece, not a whole 175B-shaped layer's 7 GB
    from mtc.runtime import transfer

    monkeypatch.setattr(transfer, "CONVERT_PIECE", 1000)
    dst, src = torch.empty(2500, dtype=torch.bfloat16, device="meta"), torch.zeros(2500)
    pieces = transfer.converting_pieces(dst, src)
    assert [(d.storage_offset(), d.numel(), s.storage_offset(), s.numel()) for d, s in pieces] == [
        (0, 1000, 0, 1000), (1000, 1000, 1000, 1000), (2000, 500, 2000, 500)]
    assert all(d.dtype == torch.bfloat16 and s.dtype == torch.float32 for d, s in pieces)
    # one piece: same dtype, both on one side, or small
    for d, s in ((torch.empty(2500, device="meta"), src), (torch.empty(2500, dtype=torch.bfloat16), src),
                 (dst[:1000], src[:1000])):
        assert transfer.converting_pieces(d, s) == [(d, s)]
