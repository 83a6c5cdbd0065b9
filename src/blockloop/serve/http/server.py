"""Running the app under uvicorn with a bounded shutdown.

On SIGINT or SIGTERM uvicorn stops accepting connections and waits for the requests in flight. Left alone it
waits for as long as they take (or a client holds its connection), and past ``timeout_graceful_shutdown`` it
cancels their handlers: a bare 500 and a traceback per request. Here the requests in flight get
``shutdown_timeout`` seconds to finish; then the engine ends those left with a 503 the client can read, and
the handlers answer it themselves, as do those still waiting for a slow client's request body. A second Ctrl-C does that at once (uvicorn would quit by force, cancelling
the handlers); a third quits by force, which skips the app's shutdown, so the engine thread is stopped here too:
one still inside torch when the interpreter exits aborts the process.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from blockloop.serve.http.app import SHUTTING_DOWN
from blockloop.signals import terminate_as_interrupt

# What the handlers get, past the drain, to answer their clients before uvicorn cancels them.
ANSWER_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown ends the requests still running after ``drain_s`` with a 503."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_s: float) -> None:
        super().__init__(config)
        self.app, self.drain_s = app, drain_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.cut_off = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        cut_off = self.loop.call_later(self.drain_s, self._cut_off)
        try:
            await super().shutdown(sockets)
        finally:
            cut_off.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT and not self.cut_off and self.loop is not None:
            self.loop.call_soon_threadsafe(self._cut_off)  # not from the handler: it may interrupt the worker's lock
            return
        super().handle_exit(sig, frame)

    def _cut_off(self) -> None:
        if not self.cut_off:
            self.cut_off = True
            self.app.state.stopping.set()  # handlers still reading a request's body answer it now
            self.app.state.served.worker.stop(SHUTTING_DOWN)


def serve(app: FastAPI, sock: socket.socket, *, log_level: str, shutdown_timeout: float) -> None:
    """Serve ``app`` on ``sock`` until SIGINT or SIGTERM (either a normal stop: this returns)."""
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout + ANSWER_S)
    # uvicorn raises the signal that stopped it again once it is done: SIGTERM then ends here as SIGINT does.
    try:
        with terminate_as_interrupt():
            DrainingServer(config, app, shutdown_timeout).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        app.state.served.worker.close()
