"""mtc's Triton kernels, each beside its pure-torch reference.

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), which keeps a launch's
state in module globals (the grid index, ``tl``'s patched builtins): two threads launching at once
corrupt each other (``InterpreterError: x >= grid_dim[0]``). The engine launches from two threads
where the update runs on the device (the Triton AdamW on the optimizer's thread beside the compute
thread's fused kernels), so under the interpreter every launch holds one lock. On a GPU nothing
changes.
"""

from __future__ import annotations

import os
import threading

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime import interpreter as _interpreter

    _run = _interpreter.InterpretedFunction.run
    if not getattr(_run, "serialised", False):
        _lock = threading.Lock()

        def _serialised_run(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 (triton's signature)
            with _lock:
                return _run(self, *args, **kwargs)

        _serialised_run.serialised = True  # type: ignore[attr-defined]  # a reload must not wrap it twice
        _interpreter.InterpretedFunction.run = _serialised_run
