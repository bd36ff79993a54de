"""The sensitivity sweep's trials and the vault's encoding fanned out over a Ray cluster: the one module of smoe
that imports ray.

Each worker is an actor holding its own copy of the source model (read from the checkpoint, which every
worker reaches on a shared filesystem), with the calibration statistics and windows the driver put in the
object store: `build(*args)` makes its meter and a trial is one `measure(meter, *trial)` call (the sweep's
own functions, smoe.quality.sensitivity's, passed in), so a worker computes exactly what the single-process
sweep computes. The driver hands each worker its next trial as the last one returns and
records every value as it arrives: a run stopped midway (a worker lost, the driver interrupted) resumes
from the table it left. `cluster` is "local" (a cluster started on this machine, one worker per core) or a
Ray address.
"""

from __future__ import annotations

import dataclasses
import socket

from smoe.errors import SmoeError

try:
    import ray
except ImportError:  # pragma: no cover - the error says how to install it
    ray = None


def measure_on_cluster(cluster: str, build, args: tuple, measure, todo: list, record) -> None:
    """record(trial, value) for each trial of `todo` ((layer, unit, bits)), measure(build(*args), *trial) computed by
    the cluster's workers."""
    started = connect(cluster)
    workers = []
    try:
        cores = max(1, int(ray.cluster_resources().get("CPU", 1)))
        shared = ray.put((build, args, measure))
        workers = [Trial.remote(shared) for _ in range(min(cores, len(todo)))]
        queue, running = list(todo), {}
        for worker in workers:
            submit(worker, queue, running)
        while running:
            (done,), _ = ray.wait(list(running), num_returns=1)
            worker, trial = running.pop(done)
            record(trial, result(done, f"measuring layer {trial[0]} {trial[1]} at Q{trial[2]}", SWEEP_KEPT))
            submit(worker, queue, running)
    finally:
        for worker in workers:
            ray.kill(worker)
        if started:
            ray.shutdown()


def encoder_on(cluster: str, source):
    """A write_experts `encode_all` that encodes on the cluster's workers: one task per MoE layer (its experts to
    encode, and that layer's calibration statistics alone), each worker opening the checkpoint at `source` (the model
    directory or GGUF file) itself; EncodedExperts come back in the order asked, at most two layers per worker in
    flight, so the driver holds a few layers' blobs and statistics at a time, whatever the depth (statistics streamed
    layer by layer, calibrate.StreamedStats, are asked for in layer order, as the tasks are made)."""
    check_cluster(cluster)

    def encode_all(ckpt, expert_map, coder, dev, todo: list):
        from smoe.convert.sculpt import encode_expert

        layers = [[key for key in todo if key[0] == layer] for layer in dict.fromkeys(key[0] for key in todo)]
        started = connect(cluster)
        try:
            def task(keys: list):
                shared = ray.put((str(source), expert_map, layer_coder(coder, keys[0][0]), coder.stats is not None))
                return encode_layer.remote(shared, keys, encode_expert)

            workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
            pending = [task(keys) for keys in layers[: 2 * workers]]
            for i in range(len(layers)):
                done = result(pending.pop(0), f"encoding layer {layers[i][0][0]}", VAULT_KEPT)
                if 2 * workers + i < len(layers):
                    pending.append(task(layers[2 * workers + i]))
                yield from done
        finally:
            if started:
                ray.shutdown()

    return encode_all


def layer_coder(coder, layer: int):
    """The coder a task of `layer` needs: with that layer's statistics only (streamed ones hold a layer at a time)."""
    at = getattr(coder.stats, "at", None)
    return coder if at is None else dataclasses.replace(coder, stats=at(layer))


def check_cluster(cluster: str) -> None:
    """Before any work: Ray is installed, and an address given answers."""
    if ray is None:
        raise SmoeError("--ray needs the ray package: pip install 'smoe[ray]'")
    if cluster != "local" and not ray.is_initialized():
        check_answers(cluster)


def connect(cluster: str) -> bool:
    """Join the cluster (or start a local one); whether this call started Ray (and so shuts it down)."""
    check_cluster(cluster)
    if ray.is_initialized():
        return False
    try:
        if cluster == "local":
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=cluster, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise SmoeError(f"--ray {cluster}: no Ray cluster answers there ({one_line(err)})") from None
    return True


def check_answers(address: str, seconds: float = 5.0) -> None:
    """A HOST:PORT (or ray://HOST:PORT) address must accept a connection within `seconds`: Ray itself retries an
    address that does not answer for minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise SmoeError(f"--ray {address}: expected HOST:PORT (a Ray head's address) or no value (a local cluster)")
    try:
        socket.create_connection((host, int(port)), timeout=seconds).close()
    except OSError as err:
        raise SmoeError(f"--ray {address}: no Ray cluster answers there ({err.strerror or type(err).__name__})") from None


def submit(worker, queue: list, running: dict) -> None:
    if queue:
        trial = queue.pop(0)
        running[worker.kl.remote(*trial)] = (worker, trial)


SWEEP_KEPT = "the sensitivity table keeps every value measured so far"
VAULT_KEPT = "the partial vault keeps every expert written so far"


def result(ref, doing: str, kept: str):
    """The task's value; its own error (a non-finite KL, a bad checkpoint) or a lost worker as one line."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        cause = err.as_instanceof_cause()
        if isinstance(cause, SmoeError):
            raise SmoeError(str(cause)) from None
        raise SmoeError(f"a Ray worker failed {doing}: {one_line(err)}") from None
    except ray.exceptions.RayError as err:  # the worker or its node is gone
        raise SmoeError(f"a Ray worker was lost {doing} ({type(err).__name__}); {kept}: run the same command again "
                        "to resume") from None


def one_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


if ray is not None:

    @ray.remote(num_cpus=1)
    def encode_layer(shared, keys: list, encode_expert) -> list:
        """One layer's experts of `keys`, encoded on a worker from its own reading of the checkpoint (on its CPU)."""
        import torch

        from smoe.hf.gguf import open_source

        model_dir, expert_map, coder, calibrated = shared
        ckpt = open_source(model_dir, calibrated=calibrated)  # as the driver opened it
        return [encode_expert(ckpt, expert_map, coder, torch.device("cpu"), key) for key in keys]

    @ray.remote(num_cpus=1)
    class Trial:
        """A worker's copy of the source model and its KL meter over the calibration windows."""

        def __init__(self, shared):
            build, args, self.measure = shared
            self.meter = build(*args)

        def kl(self, layer: int, unit: str, bits: int) -> float:
            return self.measure(self.meter, layer, unit, bits)
