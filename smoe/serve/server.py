"""`smoe serve`: an OpenAI- and Anthropic-compatible HTTP API and a web chat page for one vault.

The application (smoe/serve/app.py) runs on uvicorn over the guarded connections of
smoe/serve/transport.py; this module opens the vault, starts them and closes the vault on the way out.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from pathlib import Path

from smoe.errors import SmoeError
from smoe.format.vault import DATA_FILE
from smoe.serve.api import Limits
from smoe.serve.app import AccessLog, create_app
from smoe.serve.auth import usable_key
from smoe.serve.transport import ACCEPT_BURST, Connections, GuardedH11, fit_connections, listen, url_of, warn_if_exposed
from smoe.serve.worker import Worker

LOG_LEVELS = ("debug", "info", "warning", "error")


def run_server(open_model, load_tokenizer, vault, host: str, port: int, limits: Limits,
               api_key: str | None = None) -> int:
    import uvicorn

    if min(limits.max_tokens, limits.max_body_bytes, limits.max_queue, limits.max_connections) < 1 \
            or min(limits.idle_timeout, limits.request_timeout) <= 0:
        raise SmoeError("--max-tokens, --max-body-mb, --max-queue, --max-connections, --idle-timeout and "
                        "--request-timeout must be positive")
    if api_key is not None:
        usable_key(api_key)  # before the model loads
    limits = fit_connections(limits)
    sock = listen(host, port)
    worker = Worker(open_model(), load_tokenizer(vault), Path(vault).resolve().name, limits.max_queue)
    check_still_there(worker.sm)
    # no limit_concurrency: uvicorn's counts idle connections and answers in plain text; GuardedH11 caps them
    protocol = functools.partial(GuardedH11, Connections(limits))
    logging.basicConfig(level=limits.log_level.upper(), format="smoe: %(message)s", stream=sys.stderr)
    # uvicorn's own access log is off: AccessLog's line also says what the request generated
    config = uvicorn.Config(AccessLog(create_app(worker, limits, api_key)), http=protocol, ws="none",
                            log_level=max(limits.log_level, "warning", key=LOG_LEVELS.index),
                            access_log=False, timeout_keep_alive=limits.idle_timeout, timeout_graceful_shutdown=5,
                            server_header=False, backlog=ACCEPT_BURST)
    warn_if_exposed(sock, api_key)
    print(f"smoe: serving {worker.model_id} at {url_of(sock)} (web chat at /, OpenAI API at /v1, "
          f"Anthropic API at /v1/messages)", flush=True)
    previous, stopped = signal.signal(signal.SIGTERM, terminated), False
    try:
        stopping_server(config, worker).run(sockets=[sock])
    except Terminated:
        stopped = True
    finally:
        signal.signal(signal.SIGTERM, previous)
        worker.sm.close()
    if stopped:
        print("smoe: stopped (SIGTERM); the vault is closed", file=sys.stderr, flush=True)
    return 0


def check_still_there(sm) -> None:
    """The files are opened one by one at start-up and then held open, so what is served stays the vault
    opened whatever becomes of its directory; a directory replaced while they were opened could have
    mixed two vaults' files, so that start is refused."""
    try:
        same = os.path.samestat(os.fstat(sm.vault.fd), os.stat(sm.vault.dir / DATA_FILE))
    except OSError:
        same = False
    if not same:
        sm.close()
        raise SmoeError(f"{sm.vault.dir} was replaced while the server was opening it: start it again")


def stopping_server(config, worker: Worker):
    """uvicorn's server, which tells the worker as soon as a shutdown begins (SIGTERM, Ctrl-C): generation stops
    at the next token and each request in flight or queued gets a 503 in its API's shape within the graceful
    period, instead of being cancelled after it (a plain-text 500)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            worker.stopping.set()
            super().handle_exit(sig, frame)

    return Server(config)


class Terminated(Exception):
    """SIGTERM (a service manager stopping the server): after uvicorn's graceful shutdown it re-raises
    the signal, which would end the process before the vault is closed; this handler turns it into
    an exception that unwinds through the `finally` that closes it."""


def terminated(signum, frame):
    raise Terminated
