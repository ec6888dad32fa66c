"""run_with_deadline: a function that overruns is stopped inside its thread, not just abandoned."""
import asyncio
import threading
import time

import pytest

from nanoserve.entrypoints.openai.deadline import DeadlineExceeded, run_with_deadline


def workers() -> int:
    return sum(t.name == "deadline-worker" for t in threading.enumerate())


def test_result_and_exception_come_back():
    assert asyncio.run(run_with_deadline(lambda a, b: a + b, 5.0, 2, 3)) == 5
    with pytest.raises(ZeroDivisionError):
        asyncio.run(run_with_deadline(lambda: 1 / 0, 5.0))


def test_an_endless_function_is_interrupted_and_its_thread_ends():
    reached = []

    def endless():
        try:
            while True:
                pass
        except DeadlineExceeded:
            reached.append(True)
            raise

    with pytest.raises(DeadlineExceeded):
        asyncio.run(run_with_deadline(endless, 0.2))
    for _ in range(100):
        if not workers():
            break
        time.sleep(0.02)
    assert reached == [True] and workers() == 0


def test_the_event_loop_keeps_running_while_it_works():
    async def main():
        slow = asyncio.create_task(run_with_deadline(time.sleep, 5.0, 0.5))
        for _ in range(5):
            await asyncio.sleep(0.01)
        running_meanwhile = not slow.done()
        await slow
        return running_meanwhile

    assert asyncio.run(main())
