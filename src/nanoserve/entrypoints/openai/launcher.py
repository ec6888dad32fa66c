"""`nanoserve serve`: starts the engine-core process and N API-server processes, which share the
listening port and reach the core over ZMQ; forwards SIGTERM / Ctrl-C so the API servers drain their
in-flight requests; exits non-zero as soon as any of them dies on its own."""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import tempfile
import time
from multiprocessing.connection import wait

from nanoserve.config import EngineConfig, ServerConfig
from nanoserve.entrypoints.openai.api_server import listening_socket, run_api_server

logger = logging.getLogger("nanoserve.launcher")


def _engine_core_main(*args) -> None:
    """The engine-core process's entry: imports the engine (and torch) there only, so that the launcher
    itself stays a small process."""
    from nanoserve.engine.core_proc import run_engine_core

    run_engine_core(*args)


def serve(config: EngineConfig, settings: ServerConfig) -> int:
    """Runs until SIGTERM / SIGINT (returns 0 after a drain) or until a process fails (returns 1)."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s launcher %(levelname)s %(message)s")
    listening_socket(settings.host, settings.port).close()  # fail here, clearly, if the port is taken
    workdir = tempfile.mkdtemp(prefix="nanoserve-")
    metrics_dir = os.path.join(workdir, "metrics")
    os.makedirs(metrics_dir)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the API servers
    settings.address = f"ipc://{workdir}/engine.sock"
    ctx = multiprocessing.get_context("spawn")
    core = ctx.Process(target=_engine_core_main, name="engine-core",
                       args=(config, settings.address, settings.max_waiting_requests, settings.log_level.upper()))
    core.start()
    servers = []
    for i in range(settings.api_server_count):
        s = dataclasses.replace(settings, index=i)
        p = ctx.Process(target=run_api_server, name=f"api-server-{i}", args=(s,))
        p.start()
        servers.append(p)
    logger.info("serving %s on http://%s:%d with %d API server(s)", settings.served_model_names[0],
                settings.host, settings.port, settings.api_server_count)

    stopping = {"signal": None}

    def on_signal(signum, frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        while stopping["signal"] is None:
            ready = wait([core.sentinel] + [p.sentinel for p in servers], timeout=0.5)
            if ready:
                who = core if core.sentinel in ready else next(p for p in servers if p.sentinel in ready)
                who.join(5.0)  # reap it: until then its pid still exists (a zombie) for the others
                logger.error("%s exited with code %s; stopping the server", who.name, who.exitcode)
                if who is core:  # the API servers notice on their own and fail in-flight requests first
                    for p in servers:
                        p.join(5.0)
                _stop(core, servers, drain=2.0)
                return 1
        logger.info("shutting down: draining in-flight requests (up to %.0f s)", settings.drain_timeout)
        _stop(core, servers, drain=settings.drain_timeout + 5.0)
        return 0
    finally:
        for p in [core, *servers]:
            if p.is_alive():
                p.kill()


def _stop(core, servers, drain: float) -> None:
    """SIGTERM to the API servers (uvicorn finishes in-flight requests), then to the engine core."""
    for p in servers:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + drain
    for p in servers:
        p.join(max(0.0, deadline - time.monotonic()))
    if core.is_alive():
        core.terminate()
        core.join(5.0)
