"""Triton's interpreter without its language re-patch at every device-function call.

Under ``TRITON_INTERPRET=1`` a launch patches ``triton.language`` once (``GridExecutor``), but every call of a
``@triton.jit`` helper inside a kernel (``tl.sum``, ``tl.max``, ``tl.zeros``: helpers of ``triton.language.standard``)
patches it again, an ``inspect.getmembers`` walk over the language's modules: a third of the interpreted attention
kernels' CPU (four such calls per key block of every program). Within one launch nothing undoes a patch, so the
first patch for a helper serves all its later calls in that launch: the same arithmetic, no walk.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

#: The device functions whose language was patched in the current launch.
_PATCHED: set[Callable[..., Any]] = set()


def install() -> None:
    """Patch once per launch and helper; a no-op where triton is compiled (``TRITON_INTERPRET`` unset) or absent."""
    try:
        from triton.runtime import interpreter  # noqa: PLC0415
    except ImportError:
        return
    if getattr(interpreter.InterpretedFunction.__call__, "_patch_once", False):
        return
    launch = interpreter.GridExecutor.__call__

    @functools.wraps(launch)
    def launch_once(self, *args, **kwargs):
        _PATCHED.clear()  # the previous launch restored its patches
        try:
            return launch(self, *args, **kwargs)
        finally:
            _PATCHED.clear()

    def call(self, *args, **kwargs):  # InterpretedFunction.__call__ with its _patch_lang once per launch
        if self.fn not in _PATCHED:
            interpreter._patch_lang(self.fn)
            _PATCHED.add(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    call._patch_once = True
    interpreter.GridExecutor.__call__ = launch_once
    interpreter.InterpretedFunction.__call__ = call
