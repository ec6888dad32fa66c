"""Runs a Python function on a thread of its own with a deadline, off the event loop: when it overruns,
an exception is raised inside that thread, so that a runaway chat template stops instead of burning a
core. Code stuck inside one long C call stops when the call returns."""
from __future__ import annotations

import asyncio
import ctypes
import threading
from typing import Any, Callable


class DeadlineExceeded(Exception):
    """Raised inside the worker thread when its deadline passes (and to the awaiting caller)."""


def _interrupt(thread_id: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(DeadlineExceeded))


async def run_with_deadline(fn: Callable[..., Any], timeout: float, *args) -> Any:
    """`fn(*args)` on a new thread; its result or exception, or DeadlineExceeded after `timeout` seconds
    (the thread is interrupted then, at its next Python instruction)."""
    loop = asyncio.get_running_loop()
    result: asyncio.Future = loop.create_future()
    result.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, even after a timeout
    lock, state = threading.Lock(), {"finished": False}

    def deliver(setter, value) -> None:
        if not result.done():
            setter(value)

    def work() -> None:
        try:
            try:
                value = fn(*args)
            finally:
                with lock:  # from here on the thread is never interrupted
                    state["finished"] = True
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            loop.call_soon_threadsafe(deliver, result.set_exception, exc)
        else:
            loop.call_soon_threadsafe(deliver, result.set_result, value)

    thread = threading.Thread(target=work, name="deadline-worker", daemon=True)
    thread.start()
    try:
        return await asyncio.wait_for(asyncio.shield(result), timeout)
    except asyncio.TimeoutError:
        with lock:
            if not state["finished"]:
                _interrupt(thread.ident)
        raise DeadlineExceeded(f"did not finish within {timeout:g} s") from None
