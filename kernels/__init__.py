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

        # Without debug, an integer op's overflow check is built and then dropped (device_assert
        # returns before asserting), in the interpreter as in a compiled kernel; the interpreter
        # still computed it, each check a cast, an op, two compares and an and in Python: a third
        # of the interpreter's time in a fused training step here. Skip what would be dropped.
        _builder = getattr(_interpreter, "interpreter_builder", None)
        _opts = getattr(_builder, "options", None)
        if _opts is not None and not getattr(_opts, "debug", True) and getattr(_opts, "sanitize_overflow", False):
            import dataclasses as _dc

            _builder.options = _dc.replace(_opts, sanitize_overflow=False)

        # The interpreter maps a Triton dtype to numpy's by building a 19-entry dict (each key
        # hashed in Python) at every call, several times per interpreted op: remember the answers.
        _np_dtype = getattr(_interpreter, "_get_np_dtype", None)
        if _np_dtype is not None and not getattr(_np_dtype, "cached", False):
            _np_dtypes: dict = {}

            def _get_np_dtype_cached(tt_dtype):  # noqa: ANN001, ANN202 (triton's signature)
                try:
                    return _np_dtypes[tt_dtype]
                except KeyError:
                    got = _np_dtypes[tt_dtype] = _np_dtype(tt_dtype)
                    return got
                except TypeError:  # not hashable: ask the interpreter
                    return _np_dtype(tt_dtype)

            _get_np_dtype_cached.cached = True  # type: ignore[attr-defined]
            _get_np_dtype_cached.original = _np_dtype  # type: ignore[attr-defined]
            _interpreter._get_np_dtype = _get_np_dtype_cached

        _serialised_run.serialised = True  # type: ignore[attr-defined]  # a reload must not wrap it twice
        _interpreter.InterpretedFunction.run = _serialised_run
