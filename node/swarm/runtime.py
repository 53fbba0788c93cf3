"""The node's network thread: one asyncio loop, with a replica of the DHT's libp2p daemon.

Training runs in the main thread; everything that talks to peers (averaging streams, state
downloads, their handlers) runs as coroutines on this loop, so a slow peer never blocks an inner step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class NetworkRuntime:
    def __init__(self, dht) -> None:
        self.dht = dht
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="locoswarm-net", daemon=True)
        self._thread.start()
        self.p2p = self.call(dht.replicate_p2p(), timeout=30)
        self.peer_id = str(self.p2p.peer_id)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the network loop; returns a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if not self.loop.is_running():
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.call(_cancel_all(), timeout=5)
        # The replica's client socket (/tmp/hivemind-p2pclient-*.sock) is removed only by its shutdown, or by
        # its __del__ when that runs before the interpreter exits: test runs left a few such files behind.
        with contextlib.suppress(Exception):
            self.call(self.p2p.shutdown(), timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
