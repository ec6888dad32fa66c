"""`nanoserve serve`: starts the engine-core processes (one, or `--data-parallel-size` pinned to disjoint
CPU sets) and N API-server processes, which share the listening port and reach every core over ZMQ;
forwards SIGTERM / Ctrl-C so the API servers drain their in-flight requests; exits non-zero as soon as
any process dies on its own."""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import tempfile
import time
from multiprocessing.connection import wait
from typing import Optional

from nanoserve.config import EngineConfig, ServerConfig
from nanoserve.entrypoints.openai.api_server import listening_socket, run_api_server

logger = logging.getLogger("nanoserve.launcher")


def _engine_core_main(config, address, max_waiting, log_level, cpus, name) -> None:
    """An engine-core process's entry: pins it to `cpus` (when given) before torch and the kernels'
    thread pools exist, so every compute thread inherits the set; imports the engine here only, so that
    the launcher itself stays a small process."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    from nanoserve.engine.core_proc import run_engine_core

    run_engine_core(config, address, max_waiting, log_level, name)


def engine_cpu_sets(data_parallel_size: int, cpus_per_engine: int, available: list[int]) -> list[Optional[list[int]]]:
    """The CPUs each engine core is pinned to: `cpus_per_engine` each (0: an even split of `available`),
    disjoint, in order; one engine without `cpus_per_engine` is not pinned (None). ValueError when they
    do not fit."""
    if data_parallel_size < 1:
        raise ValueError("--data-parallel-size must be >= 1")
    if cpus_per_engine < 0:
        raise ValueError("--cpus-per-engine must be >= 0")
    if data_parallel_size == 1 and cpus_per_engine == 0:
        return [None]
    per = cpus_per_engine or len(available) // data_parallel_size
    if per == 0 or per * data_parallel_size > len(available):
        raise ValueError(f"--data-parallel-size {data_parallel_size} with {per or 1} CPU(s) per engine needs "
                         f"{(per or 1) * data_parallel_size} CPUs; this process may use {len(available)} "
                         f"({','.join(map(str, available))})")
    return [available[i * per:(i + 1) * per] for i in range(data_parallel_size)]


def serve(config: EngineConfig, settings: ServerConfig) -> int:
    """Runs until SIGTERM / SIGINT (returns 0 after a drain) or until a process fails (returns 1)."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s launcher %(levelname)s %(message)s",
                        force=True)  # the CLI configured a quieter root logger first
    cpu_sets = engine_cpu_sets(settings.data_parallel_size, settings.cpus_per_engine,
                               sorted(os.sched_getaffinity(0)))
    listening_socket(settings.host, settings.port).close()  # fail here, clearly, if the port is taken
    workdir = tempfile.mkdtemp(prefix="nanoserve-")
    metrics_dir = os.path.join(workdir, "metrics")
    os.makedirs(metrics_dir)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the API servers
    settings.engine_addresses = [f"ipc://{workdir}/engine-{i}.sock" for i in range(len(cpu_sets))]
    ctx = multiprocessing.get_context("spawn")
    cores = []
    for i, (address, cpus) in enumerate(zip(settings.engine_addresses, cpu_sets)):
        name = "engine-core" if len(cpu_sets) == 1 else f"engine-core-{i}"
        core = ctx.Process(target=_engine_core_main, name=name,
                           args=(config, address, settings.max_waiting_requests, settings.log_level.upper(),
                                 cpus, name))
        core.start()
        cores.append(core)
        if cpus is not None:
            logger.info("%s: pinned to CPU(s) %s, %d compute thread(s)", name, ",".join(map(str, cpus)),
                        config.num_threads or len(cpus))
    servers = []
    for i in range(settings.api_server_count):
        s = dataclasses.replace(settings, index=i)
        p = ctx.Process(target=run_api_server, name=f"api-server-{i}", args=(s,))
        p.start()
        servers.append(p)
    logger.info("serving %s on http://%s:%d with %d API server(s) and %d engine core(s)%s",
                settings.served_model_names[0], settings.host, settings.port, settings.api_server_count,
                len(cores), "" if len(cores) == 1 else
                f", prefix affinity {'on' if settings.prefix_affinity else 'off'}")

    stopping = {"signal": None}

    def on_signal(signum, frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        while stopping["signal"] is None:
            ready = wait([p.sentinel for p in cores + servers], timeout=0.5)
            if ready:
                who = next(p for p in cores + servers if p.sentinel in ready)
                who.join(5.0)  # reap it: until then its pid still exists (a zombie) for the others
                logger.error("%s exited with code %s; stopping the server", who.name, who.exitcode)
                if who in cores:  # the API servers notice on their own and fail in-flight requests first
                    for p in servers:
                        p.join(5.0)
                _stop(cores, servers, drain=2.0)
                return 1
        logger.info("shutting down: draining in-flight requests (up to %.0f s)", settings.drain_timeout)
        _stop(cores, servers, drain=settings.drain_timeout + 5.0)
        return 0
    finally:
        for p in [*cores, *servers]:
            if p.is_alive():
                p.kill()


def _stop(cores, servers, drain: float) -> None:
    """SIGTERM to the API servers (uvicorn finishes in-flight requests), then to the engine cores."""
    for p in servers:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + drain
    for p in servers:
        p.join(max(0.0, deadline - time.monotonic()))
    for core in cores:
        if core.is_alive():
            core.terminate()
    for core in cores:
        core.join(5.0)
