"""Triton's interpreter without its language re-patch at every device-function call.

Under ``TRITON_INTERPRET=1`` a launch patches ``triton.language`` once (``GridExecutor``), but every call of a
``@triton.jit`` helper inside a kernel (``tl.sum``, ``tl.max``, ``tl.zeros``: helpers of ``triton.language.standard``)
patches it again, an ``inspect.getmembers`` walk over the language's modules: a third of the interpreted attention
kernels' CPU (four such calls per key block of every program). Within one launch nothing undoes a patch, so the
first patch for a helper serves all its later calls in that launch: the same arithmetic, no walk.

The interpreter's options also ask for integer-overflow sanitizing (``sanitize_overflow``) without ``debug``: each
int32 ``+``/``-``/``*`` (the kernels' index and pointer arithmetic) is then redone in int64 and compared with the
type's bounds, and the resulting ``device_assert`` is dropped because ``debug`` is off: a quarter of an interpreted
kernel's CPU that checks nothing. Without ``debug`` the sanitizing is switched off; with it, it stays.

``_get_np_dtype`` (a Triton type's NumPy storage type, asked at every cast, splat and load) builds its table of
twenty types anew at each call; its answers are memoized per scalar type (a block's is its element's).

Every op of the interpreted front end makes new ``block_type`` objects, and each one builds its shape as a
``triton.language.tuple`` (with a type of its own), validates it and formats it into its name. A shape's tuple,
element count and text are the same for every block of that shape: made once per shape, shared (the element
type, and so the name, stays per block). A shape that is not plain ints takes the original path and its errors.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
from typing import Any, Callable

#: The device functions whose language was patched in the current launch.
_PATCHED: set[Callable[..., Any]] = set()


def install() -> None:
    """Patch once per launch and helper; a no-op where triton is compiled (``TRITON_INTERPRET`` unset) or absent."""
    try:
        import triton  # noqa: PLC0415
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

    options = interpreter.interpreter_builder.options
    if not options.debug:  # device_assert returns at once without debug: the sanitizer's checks are never asserted
        interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)
    interpreter._get_np_dtype = _memoized_np_dtype(interpreter._get_np_dtype)
    if triton.knobs.runtime.interpret:  # the compiler's front end (a GPU's) keeps its own block types
        _share_block_shapes()
    call._patch_once = True
    interpreter.GridExecutor.__call__ = launch_once
    interpreter.InterpretedFunction.__call__ = call


def _memoized_np_dtype(np_dtype: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``np_dtype`` with its answer for each scalar type kept (pointer and block types themselves are unhashable)."""
    import triton.language as tl  # noqa: PLC0415 - only where triton is installed

    known: dict[Any, Any] = {}

    def memoized(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return np_dtype(scalar)
        if scalar not in known:
            known[scalar] = np_dtype(scalar)
        return known[scalar]
    return memoized


def _share_block_shapes() -> None:
    """``block_type.__init__`` that builds a shape's tuple, element count and text once per shape."""
    from triton.language import core  # noqa: PLC0415 - only where triton is installed

    init = core.block_type.__init__
    known: dict[builtins.tuple[int, ...], builtins.tuple[Any, int, str]] = {}

    @functools.wraps(init)
    def block_type_init(self, element_ty, shape) -> None:
        dims = builtins.tuple(core._unwrap_shape(shape)) if isinstance(shape, (list, core.tuple)) else ()
        shared = known.get(dims) if dims and all(type(d) is int for d in dims) else None
        if shared is None:  # the original, its checks and errors; a valid shape of ints is kept
            init(self, element_ty, shape)
            if dims and all(type(d) is int for d in dims):
                known[dims] = (self.shape, self.numel, str(self.shape))
            return
        self.element_ty = element_ty
        self.shape, self.numel, text = shared
        self.name = f"<{text}, {element_ty}>"

    core.block_type.__init__ = block_type_init
