"""An ASGI app served by uvicorn on a thread of its own (the trainer's server, the tests').

server = BackgroundServer(make_app(served))     # 127.0.0.1, a free port
client = openai.OpenAI(base_url=server.url, api_key=...)
server.close()
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class BackgroundServer:
    """`app` under uvicorn on `host:port` (port 0: a free one, bound before the thread
    starts, so `port` is known at once), running when the constructor returns; an idle
    connection is closed after `keep_alive` seconds.

    Raises:
        RuntimeError: uvicorn did not start within `timeout` seconds.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0,
                 keep_alive: float = 5.0):  # fmt: skip
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            sock.close()
            raise RuntimeError(
                f"cannot serve on {host}:{port}: {error}; choose another port"
            ) from error
        self.host, self.port = host, sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off",
                                timeout_keep_alive=keep_alive)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="jaxrl-serve-http", daemon=True)  # fmt: skip
        self.thread.start()
        began = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - began > timeout:
                self.close()
                raise RuntimeError(f"uvicorn did not start on {host}:{self.port}")
            time.sleep(0.01)
        self._sock = sock

    @property
    def url(self) -> str:
        """The OpenAI base URL (`.../v1`)."""
        return f"http://{self.host}:{self.port}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
