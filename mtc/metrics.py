"""What a training step reports beyond its loss: model FLOPs, TFLOP/s and MFU, memory, per-phase time.

Model FLOPs follow the PaLM convention (Chowdhery et al. 2022, appendix B), written down once in
`model_flops`: per token, ``6 * N`` for the matmuls of forward and backward over ``N`` parameters,
plus ``12 * seq_len * width`` for attention's two matmuls (QK^T and AV, forward and backward, the
full square although causal attention needs half of it: the usual convention, so figures compare
with other trainers), ``width`` summed over the model's attentions: each one's query heads times
head size, read off the traced program (``n_blocks * hidden`` for a transformer whose heads span
its hidden width; not for one whose heads are wider or narrower, as Qwen3's or Gemma's, or a
custom model with attention in some blocks only). ``N`` counts every parameter except the tables the embed
stage only looks up (an untied token embedding, learned positions): a lookup does no matmul. The
recompute of each block in the backward is not counted: these are model FLOPs, not hardware FLOPs.

MFU divides model TFLOP/s by a peak rate, and always says which (`PeakRate.source`): the matmul
rate measured by `mtc calibrate` when a machine profile of this device and dtype exists, else the
datasheet dense peak of the GPU for the compute dtype (TF32 for fp32 with TF32 allowed), else none
("n/a": the CPU, or a GPU not in the table).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
from pathlib import Path

import torch

from mtc.graphs.program import Program, Template

__all__ = [
    "PROFILE_PATH", "FlopCounter", "PeakRate", "gpu_peak_bytes", "host_rss_bytes", "model_flops", "peak_rate", "phase_seconds",
]

# where `mtc calibrate` saves the machine profile (mtc.calibrate.DEFAULT_PROFILE_PATH)
PROFILE_PATH = Path.home() / ".cache" / "mtc" / "machine.json"

# Dense peak TFLOP/s from NVIDIA's datasheets (no sparsity), by (name fragment, dtype). The first
# fragment the device name contains wins, so the more specific names come first.
_DATASHEET: list[tuple[str, dict[str, float]]] = [
    ("H200 NVL", {"bfloat16": 835.5, "tf32": 417.5, "float32": 60.0}),  # the PCIe card (H200 datasheet: 1,671 / 835 sparse)
    ("H200", {"bfloat16": 989.4, "tf32": 494.7, "float32": 66.9}),
    ("H100 PCIe", {"bfloat16": 756.0, "tf32": 378.0, "float32": 51.2}),
    ("H100 NVL", {"bfloat16": 835.5, "tf32": 417.8, "float32": 60.0}),
    ("H100", {"bfloat16": 989.4, "tf32": 494.7, "float32": 66.9}),  # SXM5 (e.g. "NVIDIA H100 80GB HBM3")
    ("GH200", {"bfloat16": 989.4, "tf32": 494.7, "float32": 66.9}),
    ("A100", {"bfloat16": 312.0, "tf32": 156.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.1, "tf32": 183.0, "float32": 91.6}),
    ("A10G", {"bfloat16": 70.0, "tf32": 35.0, "float32": 31.2}),
    ("L4", {"bfloat16": 121.0, "tf32": 60.0, "float32": 30.3}),
    ("RTX 4090", {"bfloat16": 165.2, "tf32": 82.6, "float32": 82.6}),
]


def model_flops(tokens: int, *, n_params: int, attention_width: int, seq_len: int) -> float:
    """Model FLOPs of training on ``tokens`` tokens (forward + backward): the one formula mtc uses.

    ``tokens * (6 * n_params + 12 * seq_len * attention_width)``, ``attention_width`` summed over
    the model's attentions (query heads x head size each); see the module docstring.
    """
    return float(tokens) * (6.0 * n_params + 12.0 * seq_len * attention_width)


@dataclasses.dataclass(frozen=True, slots=True)
class FlopCounter:
    """The shape figures `model_flops` needs, read off a traced program."""

    n_params: int  # parameters that take part in matmuls (all but lookup-only tables)
    n_blocks: int
    attention_width: int  # query heads x head size, summed over every attention of one pass through the model
    seq_len: int

    @classmethod
    def of(cls, program: Program, seq_len: int) -> FlopCounter:
        """Counts from ``program``: parameters the embed stage owns and the head does not use are lookups."""
        head_keys = set(program.layers[-1].param_keys())
        lookup = sum(p.numel for p in program.layer_params(0) if p.key not in head_keys)
        total = sum(p.numel for p in program.params.values())
        batch = int(program.batch["ids"].shape[0])
        widths = {tid: _attention_width(t, batch) for tid, t in program.templates.items()}
        return cls(n_params=total - lookup, n_blocks=max(0, program.n_layers - 2),
                   attention_width=sum(widths[c.template] for c in program.layers), seq_len=seq_len)

    def flops(self, tokens: int) -> float:
        """Model FLOPs of ``tokens`` training tokens."""
        return model_flops(tokens, n_params=self.n_params, attention_width=self.attention_width, seq_len=self.seq_len)


def _attention_width(tmpl: Template, batch: int) -> int:
    """Query heads x head size, summed over the template's attentions (a micro-batch of ``batch``)."""
    width = 0
    for n in tmpl.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None or schema.name.split("::")[-1] != "scaled_dot_product_attention":
            continue
        q = getattr(n.args[0], "meta", {}).get("val")
        if isinstance(q, torch.Tensor) and q.dim() >= 2:  # (..., heads, T, D): the leading dims are batch x heads
            width += q.numel() // q.shape[-2] // batch
    return width


@dataclasses.dataclass(frozen=True, slots=True)
class PeakRate:
    """The denominator of MFU: TFLOP/s (None: none known) and where it comes from."""

    tflops: float | None
    source: str  # e.g. "calibrated matmul rate (~/.cache/mtc/machine.json, bfloat16)", "datasheet ...", "n/a: ..."

    def mfu(self, tflops: float) -> float | None:
        """Model FLOPs utilisation of ``tflops`` (a fraction), or None without a denominator."""
        return tflops / self.tflops if self.tflops else None


def _calibrated(device_name: str, dtype: str, profile: Path) -> PeakRate | None:
    """The fastest matmul rate of a machine profile for this device and dtype, if one was saved.

    The fastest, not a middle one: calibrate times thin shapes on purpose (the cost model's
    K/V projections, the CPU's 16-row updates), far below the device's peak, and MFU is measured
    against what the device can do (with the median a CPU run read 160-174 % MFU)."""
    try:
        d = json.loads(profile.read_text())
        points = d.get("matmul") or []
        if d.get("matmul_dtype") != dtype or d.get("device") != device_name or not points:
            return None
        rate = max(float(p["tflops"]) for p in points)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # no profile, or one of another format: fall back to the datasheet
    return PeakRate(rate, f"calibrated matmul rate ({profile}, {dtype}, {device_name})") if rate > 0 else None


def peak_rate(device: torch.device | str, compute_dtype: str, *, allow_tf32: bool = True,
              profile: Path | None = None) -> PeakRate:
    """MFU's denominator on ``device`` for ``compute_dtype``: calibrated, else datasheet, else n/a."""
    device = torch.device(device)
    profile = PROFILE_PATH if profile is None else profile
    if device.type != "cuda":
        cal = _calibrated(_cpu_name(), compute_dtype, profile)
        return cal or PeakRate(None, "n/a: no datasheet peak for the CPU (run `mtc calibrate` for a measured rate)")
    name = torch.cuda.get_device_name(device)
    cal = _calibrated(name, compute_dtype, profile)
    if cal is not None:
        return cal
    key = "tf32" if compute_dtype == "float32" and allow_tf32 else compute_dtype
    for frag, rates in _DATASHEET:
        if frag in name and key in rates:
            return PeakRate(rates[key], f"datasheet dense {key} peak of the {name}")
    return PeakRate(None, f"n/a: {name} is not in mtc's datasheet table (run `mtc calibrate` for a measured rate)")


def _cpu_name() -> str:
    # the profile names a CPU machine "cpu (<model>, <cores> cores)"; only an exact match counts
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name"))
    except (OSError, StopIteration):
        model = "unknown"
    return f"cpu ({model}, {os.cpu_count()} cores)"


def host_rss_bytes() -> int:
    """This process's resident set size now (Linux /proc; elsewhere its peak from getrusage)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gpu_peak_bytes(device: torch.device | str, *, reset: bool = True) -> int | None:
    """Peak bytes allocated on a CUDA ``device`` since the last reset (then reset); None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    peak = int(torch.cuda.max_memory_allocated(device))
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peak


def phase_seconds(spans: list, start: float, end: float) -> dict[str, float]:
    """Seconds each stage was busy within [start, end] (timeline spans clipped to it, summed over threads).

    Stages run on several threads at once (an update beside the next layer's compute), so the
    figures may sum to more than the wall time; that overlap is the engine's point.
    """
    out: dict[str, float] = {}
    for s in spans:
        lo, hi = max(s.start, start), min(s.end, end)
        if hi > lo:
            out[s.stage] = out.get(s.stage, 0.0) + (hi - lo)
    return {k: round(v, 6) for k, v in sorted(out.items())}
