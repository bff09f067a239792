"""An asyncio event loop on virtual time, for tests of timing logic without wall-clock luck.

`loop.time()` starts at 0 and moves only when every task waits on a timer: instead of sleeping
until the next timer, the loop jumps its clock there. So `asyncio.sleep(0.15)` takes no real time
and the order and timestamps of events are exact and the same on every machine.

    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        runner.run(main())
"""

from __future__ import annotations

import asyncio
import selectors


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: "VirtualClockLoop"):
        super().__init__()
        self._loop = loop

    def select(self, timeout=None):
        ready = super().select(0)
        if not ready:
            if timeout is None:
                raise RuntimeError("virtual clock: every task waits, and on no timer (a deadlock)")
            self._loop.now += timeout
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        self.now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self.now


def run(coroutine):
    """`asyncio.run` on a VirtualClockLoop."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(coroutine)
