"""The GPU's SM clock, power draw and clock-limit reasons, sampled in the background while a
benchmark times its variants, and attributed to each variant's timed calls.

Why: on the H200 the Llama block's joint graph replayed as a CUDA graph ran 23.1 ms per call
against 21.9 ms eager (bench_fusion-vm-20261126T194042.json), while replay only removes the
gaps between kernels. One explanation to test: back-to-back kernels draw more power, and a GPU at
its power limit lowers its clock, so a gap-free replay may run its matmuls at a lower clock than
an eager call with gaps. These samples say, per variant, at what clock and power its calls ran
and how often the driver reported a power or thermal limit.

Sources, first that works: NVML through ``pynvml`` (nvidia-ml-py, every ``period_s``), else an
``nvidia-smi --query-gpu ... --loop-ms`` subprocess streaming lines; neither (the CPU, or a box
without them): no samples, ``source`` says why. A sample's time is when this process read it
(``time.perf_counter``), within a millisecond or two of the reading.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

# NVML's clock-event ("throttle") reason bits (nvml.h: nvmlClocksEventReason*)
POWER_BITS = 0x4 | 0x80  # software power cap, hardware power brake
THERMAL_BITS = 0x20 | 0x40  # software and hardware thermal slowdown
SLOWDOWN_BITS = 0x8  # hardware slowdown (thermal or power)


@dataclass(slots=True)
class Sample:
    """One reading: when (perf_counter s), SM clock (MHz), power (W), clock-limit reason bits (None: unknown)."""

    t: float
    sm_mhz: float
    power_w: float
    reasons: int | None


@dataclass
class ClockSampler:
    """Samples the GPU in a background thread between ``start()`` and ``stop()`` (or as a context
    manager). ``index``: the GPU's index as NVML and nvidia-smi count it (`nvml_index`)."""

    index: int = 0
    period_s: float = 0.01
    samples: list[Sample] = field(default_factory=list)
    source: str = "not started"
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _proc: subprocess.Popen | None = None

    def start(self) -> ClockSampler:
        """Begin sampling (no-op, with ``source`` saying why, where no source works)."""
        read = _nvml_reader(self.index)
        if read is not None:
            self.source = "nvml"
            self._thread = threading.Thread(target=self._poll, args=(read,), daemon=True)
        else:
            proc, fields = _smi_process(self.index, max(1, int(self.period_s * 1000)))
            if proc is None:
                self.source = "unavailable: neither pynvml nor nvidia-smi"
                return self
            self.source, self._proc = f"nvidia-smi ({', '.join(fields)})", proc
            self._thread = threading.Thread(target=self._read_smi, args=(proc, len(fields)), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        """End sampling; the samples taken."""
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        return self.samples

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _poll(self, read: Any) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(read())
            except Exception:  # noqa: BLE001  (a diagnostic: a failed read ends sampling, not the benchmark)
                self.source += " (a read failed; sampling stopped)"
                return
            self._stop.wait(self.period_s)

    def _read_smi(self, proc: subprocess.Popen, n_fields: int) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            s = parse_smi_line(line, n_fields, time.perf_counter())
            if s is not None:
                self.samples.append(s)
            if self._stop.is_set():
                return


def nvml_index(device_index: int) -> int:
    """The NVML / nvidia-smi index of torch's CUDA device ``device_index`` (CUDA_VISIBLE_DEVICES
    renumbers devices for torch, not for NVML)."""
    vis = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if device_index < len(vis) and vis[device_index].isdigit():
        return int(vis[device_index])
    return device_index


def _nvml_reader(index: int) -> Any:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        reasons_fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)

        def read() -> Sample:
            return Sample(time.perf_counter(), float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                          pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0, int(reasons_fn(h)) if reasons_fn else None)

        read()
        return read
    except Exception:  # noqa: BLE001  (no pynvml, no driver: try nvidia-smi)
        return None


def _smi_process(index: int, period_ms: int) -> tuple[subprocess.Popen | None, list[str]]:
    """An nvidia-smi streaming clock, power and (where this nvidia-smi knows the field) reasons."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, []
    # the reasons field was renamed (clocks_throttle_reasons -> clocks_event_reasons); older names still work on newer drivers
    for fields in (["clocks.sm", "power.draw", "clocks_event_reasons.active"],
                   ["clocks.sm", "power.draw", "clocks_throttle_reasons.active"], ["clocks.sm", "power.draw"]):
        args = [exe, "-i", str(index), f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
        try:
            probe = subprocess.run(args, capture_output=True, text=True, timeout=20, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None, []
        if probe.returncode == 0 and parse_smi_line(probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else "",
                                                    len(fields), 0.0) is not None:
            return subprocess.Popen([*args, f"--loop-ms={period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    text=True), fields
    return None, []


def parse_smi_line(line: str, n_fields: int, t: float) -> Sample | None:
    """A `Sample` from one line of ``nvidia-smi --format=csv,noheader,nounits`` (clock, power[, reasons]),
    or None when the line is not one (a header, '[N/A]')."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != n_fields:
        return None
    try:
        reasons = int(parts[2], 16) if n_fields > 2 else None
        return Sample(t, float(parts[0]), float(parts[1]), reasons)
    except ValueError:
        return None


def attribute(samples: Sequence[Sample], intervals: dict[str, Sequence[tuple[float, float]]]) -> dict[str, dict[str, Any]]:
    """Per label: the samples taken inside its (start, end) intervals summarised: their count,
    median SM clock and power, and the fractions flagged power-limited, thermal-limited or in
    hardware slowdown (of those with reason bits)."""
    out: dict[str, dict[str, Any]] = {}
    ts = sorted(samples, key=lambda s: s.t)
    for label, spans in intervals.items():
        got = [s for s in ts if any(a <= s.t <= b for a, b in spans)]
        rec: dict[str, Any] = {"samples": len(got)}
        if got:
            rec["sm_mhz_median"] = statistics.median(s.sm_mhz for s in got)
            rec["sm_mhz_min"] = min(s.sm_mhz for s in got)
            rec["power_w_median"] = statistics.median(s.power_w for s in got)
            flagged = [s.reasons for s in got if s.reasons is not None]
            if flagged:
                for name, bits in (("power_limited", POWER_BITS), ("thermal_limited", THERMAL_BITS), ("hw_slowdown", SLOWDOWN_BITS)):
                    rec[f"{name}_frac"] = sum(1 for r in flagged if r & bits) / len(flagged)
        out[label] = rec
    return out
