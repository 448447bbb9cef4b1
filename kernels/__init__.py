"""mtc's Triton kernels, each beside its pure-torch reference.

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), which keeps a launch's
state in module globals (the grid index, ``tl``'s patched builtins): two threads launching at once
corrupt each other (``InterpreterError: x >= grid_dim[0]``). The engine launches from two threads
where the update runs on the device (the Triton AdamW on the optimizer's thread beside the compute
thread's fused kernels), so under the interpreter every launch holds one lock, and a launch patches
``tl`` once rather than again at every call of a ``@triton.jit`` helper (the tests' time). On a GPU
nothing changes.
"""

from __future__ import annotations

import os
import threading

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime import interpreter as _interpreter

    _run = _interpreter.InterpretedFunction.run
    if not getattr(_run, "serialised", False):
        _lock = threading.Lock()

        # The ids of the language modules the running launch has patched; None between launches.
        _patched: set[int] | None = None

        def _serialised_run(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 (triton's signature)
            global _patched
            with _lock:
                _patched = set()
                try:
                    return _run(self, *args, **kwargs)
                finally:
                    _patched = None

        _patch_lang = getattr(_interpreter, "_patch_lang", None)
        if _patch_lang is not None and hasattr(_interpreter, "_LangPatchScope"):
            import triton.language as _tl

            def _patch_lang_once(fn):  # noqa: ANN001, ANN202 (triton's signature)
                # The interpreter re-patches tl's builtins at every call of a @triton.jit helper
                # inside a kernel (inspect.getmembers over tl, tl.tensor, tl.math: ~3 ms a call),
                # though the launch already patched them and the patch does not depend on the
                # helper; the helpers' calls were a third of a compiled parity run's time here. A
                # helper whose language modules the launch has patched gets an empty scope (the
                # launch's scope restores everything at its end, as before).
                langs = {id(v) for v in fn.__globals__.values() if v is _tl or v is _tl.core}
                if _patched is not None and _patched and langs <= _patched:
                    return _interpreter._LangPatchScope()
                scope = _patch_lang(fn)
                if _patched is not None:
                    _patched.update(langs)
                return scope

            _interpreter._patch_lang = _patch_lang_once

        _serialised_run.serialised = True  # type: ignore[attr-defined]  # a reload must not wrap it twice
        _interpreter.InterpretedFunction.run = _serialised_run
