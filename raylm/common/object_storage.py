"""Checkpoints in object storage: a `model`, draft model, LoRA adapter or `dynamic_lora_loading_path` given as
`s3://bucket/prefix` (or `gs://`, where gcsfs is installed) is copied into the user cache once per node, by whichever
process on the node asks first (the engine resolving its config, a Ray worker loading weights); the others wait on
the copy's lock and find it done. fsspec's s3fs reads the usual environment: AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_PROFILE, AWS_ENDPOINT_URL for an S3-compatible server.

A copy lives in <cache>/object-storage/<key of the URI>/: `manifest.json` records each object's size and ETag,
`partial/` holds the downloads in progress and `<name>` (the URI's last part: a folder, or one file such as a .gguf)
the finished files. A file reaches the copy only once its size matches the listing, by rename; a download cut off
leaves its part and the part's ETag behind, and the next caller continues it while the object's ETag is unchanged
(else fetches it again); a continued object whose ETag is an MD5 (S3's, for an object put in one part) must hash to
it, else it is fetched again from its first byte. Each call lists the objects (one request) so that an object changed
in the bucket is fetched again.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeGuard

from raylm.configs.cache import cache_path, content_key

SCHEMES = ("s3://", "gs://", "gcs://")
CHUNK_BYTES = 64 << 20  # one ranged GET each: large enough to stream, small enough to hold in memory
# gs:// needs the gcsfs release of the installed fsspec's version (s3fs, a dependency, pins fsspec)
_PACKAGES = {"s3": "s3fs==2026.9.0", "gs": "gcsfs==<fsspec's version>", "gcs": "gcsfs==<fsspec's version>"}
# An ETag that is the object's MD5: S3's for an object put in one part (a multipart one's ends in -<parts>; one
# encrypted with a KMS or customer key has another, which a continued download then fetches again, whole).
_MD5 = re.compile(r"[0-9a-f]{32}")
_HINT = ("give s3://bucket/prefix (or gs://bucket/prefix) of objects that this machine's credentials can read: "
         "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or an instance role), with AWS_ENDPOINT_URL "
         "for an S3-compatible server; GOOGLE_APPLICATION_CREDENTIALS for gs://")


def is_object_uri(path: object) -> TypeGuard[str]:
    return isinstance(path, str) and path.startswith(SCHEMES)


def local_copy(uri: str, field: str) -> Path:
    """This node's verified copy of `uri` (a prefix: a folder; one object: a file), downloaded and completed here if
    needed. `field` is the setting that named it, for errors."""
    path = _split(uri, field)[1].rstrip("/")
    name = path.rsplit("/", 1)[-1]
    fs = _filesystem(uri, field)
    objects = _list(fs, uri, field)  # before any folder is made: a URI refused leaves nothing behind
    root = cache_path("object-storage", content_key(uri))
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / "lock"):
        manifest = _read_manifest(root, uri)
        _drop_unlisted(root / name, objects, manifest)
        missing = {rel: info for rel, info in objects.items() if not _done(root / name, rel, info, manifest)}
        if missing:
            print(f"raylm: {field}: copying {len(missing)} of {len(objects)} object(s) of {uri} "
                  f"({sum(info['size'] for info in missing.values()) / 1e6:.1f} MB) into {root / name} "
                  f"(once per node)...", file=sys.stderr, flush=True)
        for rel, info in missing.items():
            try:
                _fetch(fs, f"{path}/{rel}" if rel else path, rel, info, root, name, manifest)
            except OSError as err:
                raise _refusal(err, uri, field) from err
    return root / name


def checkpoint_here(path: str, source: str, field: str) -> str:
    """Where a worker loads a resolved checkpoint from: this node's copy of `source`, the object-storage URI it was
    copied from on the engine's node (found done there, fetched once on another node), else `path` itself."""
    return str(local_copy(source, field)) if source else path


def check_source(uri: str, field: str) -> None:
    """Refuse, naming `field`, a URI that is malformed, unreadable with this machine's credentials or empty: the
    check before anything is placed on the cluster, for sources that are copied later (LoRA adapters)."""
    _list(_filesystem(uri, field), uri, field)


def object_exists(uri: str, field: str) -> bool:
    fs = _filesystem(uri, field)
    try:
        return bool(fs.exists(_split(uri, field)[1]))
    except OSError as err:
        raise _refusal(err, uri, field) from err


def folders_holding(uri: str, filename: str, field: str) -> list[str]:
    """The names of the folders directly under `uri` that hold an object `filename` (adapters by their config)."""
    fs = _filesystem(uri, field)
    prefix = _split(uri, field)[1].rstrip("/")
    try:
        return sorted(key[len(prefix) + 1:].split("/")[0] for key in fs.glob(f"{prefix}/*/{filename}"))
    except FileNotFoundError:
        return []
    except OSError as err:
        raise _refusal(err, uri, field) from err


# ---- the listing ---------------------------------------------------------------------------------------------------

def _split(uri: str, field: str) -> tuple[str, str]:
    """(protocol, bucket/key) of a URI with a bucket and a key."""
    protocol, _, path = uri.partition("://")
    bucket, _, key = path.partition("/")
    if not bucket or not key.strip("/"):
        raise ValueError(f"{field}: {uri!r} names no {'object or prefix' if bucket else 'bucket'}; {_HINT}")
    return protocol, path


def _filesystem(uri: str, field: str) -> Any:
    import fsspec

    protocol = _split(uri, field)[0]
    try:
        # A fresh client: fsspec's cached ones do not survive a fork, and each call may see new credentials.
        return fsspec.filesystem(protocol, skip_instance_cache=True)
    except ImportError as err:
        raise ValueError(f"{field}: {uri} needs fsspec's {protocol}:// filesystem ({err}); "
                         f"pip install {_PACKAGES[protocol]}") from None


def _list(fs: Any, uri: str, field: str) -> dict[str, dict[str, Any]]:
    """{path under the URI ("" for the URI's one object): {"size", "etag"}}; refuses an empty prefix."""
    path = _split(uri, field)[1].rstrip("/")
    try:
        info = fs.info(path)
        found = {path: info} if info["type"] == "file" else fs.find(path, detail=True)
    except FileNotFoundError:
        found = {}
    except Exception as err:  # OSError, and the clients' own: missing credentials, a malformed endpoint
        raise _refusal(err, uri, field) from err
    objects = {key[len(path) + 1:]: {"size": int(entry["size"]), "etag": _etag(entry)}
               for key, entry in found.items() if entry["type"] == "file" and not key.endswith("/")}
    if not objects:
        raise ValueError(f"{field}: {uri} holds no objects (no such object, prefix or bucket); {_HINT}")
    return objects


def _etag(entry: dict[str, Any]) -> str:
    return str(entry.get("ETag") or entry.get("etag") or "").strip('"')  # s3fs's spelling, then gcsfs's


def _refusal(err: BaseException, uri: str, field: str) -> ValueError:
    kind = type(err).__name__
    if "Credentials" in kind:
        why = "no credentials were found"
    elif isinstance(err, PermissionError):
        why = "access was denied"
    else:
        why = "it could not be read"
    return ValueError(f"{field}: {uri}: {why} ({kind}: {err}); {_HINT}")


# ---- the copy ------------------------------------------------------------------------------------------------------

@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock: the kernel drops it when its holder dies, so a killed download blocks nobody."""
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read_manifest(root: Path, uri: str) -> dict[str, Any]:
    try:
        manifest: dict[str, Any] = json.loads((root / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = {}
    if manifest.get("uri") != uri:
        manifest = {"uri": uri, "files": {}}
    return manifest


def _write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    tmp = root / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, root / "manifest.json")


def _drop_unlisted(copy: Path, objects: dict[str, dict[str, Any]], manifest: dict[str, Any]) -> None:
    """Delete the copied files the bucket no longer holds: a re-sharded checkpoint's old shards must not load."""
    unlisted = [rel for rel in manifest["files"] if rel not in objects]
    for rel in unlisted:
        (copy / rel if rel else copy).unlink(missing_ok=True)
        del manifest["files"][rel]
    if unlisted:
        _write_manifest(copy.parent, manifest)


def _done(copy: Path, rel: str, info: dict[str, Any], manifest: dict[str, Any]) -> bool:
    """Whether the copy holds this object as listed: the ETag it was fetched at and its size on disk."""
    entry = manifest["files"].get(rel)
    target = copy / rel if rel else copy
    return (entry is not None and entry.get("done") and entry["etag"] == info["etag"]
            and entry["size"] == info["size"] and target.is_file() and target.stat().st_size == info["size"])


def _fetch(fs: Any, source: str, rel: str, info: dict[str, Any], root: Path, name: str,
           manifest: dict[str, Any]) -> None:
    """Download the object `source` into partial/, continuing a part fetched at the same ETag; rename it into the
    copy once its size matches (and a continued one's MD5 its ETag, where that is an MD5)."""
    part = root / "partial" / (rel or name)
    target = root / name / rel if rel else root / name
    entry = manifest["files"].get(rel)
    resume = entry is not None and entry["etag"] == info["etag"] and part.is_file()
    offset = part.stat().st_size if resume else 0
    if offset > info["size"]:
        offset = 0
    manifest["files"][rel] = {"size": info["size"], "etag": info["etag"], "done": False}
    _write_manifest(root, manifest)  # the part's ETag is on record before its first byte
    part.parent.mkdir(parents=True, exist_ok=True)
    _download(fs, source, part, offset, info["size"])
    if offset and _MD5.fullmatch(info["etag"]) and _md5(part) != info["etag"]:
        print(f"raylm: {source}: the continued download does not hash to its ETag {info['etag']}; fetching it "
              f"again from its first byte", file=sys.stderr, flush=True)
        _download(fs, source, part, 0, info["size"])
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, target)
    manifest["files"][rel]["done"] = True
    _write_manifest(root, manifest)


def _download(fs: Any, source: str, part: Path, offset: int, size: int) -> None:
    """The object's bytes from `offset` on appended to the first `offset` bytes of `part`."""
    with open(part, "r+b" if offset else "wb") as out:
        out.truncate(offset)
        out.seek(offset)
        while offset < size:
            chunk = fs.cat_file(source, start=offset, end=offset + min(CHUNK_BYTES, size - offset))
            if not chunk:
                break
            out.write(chunk)
            out.flush()  # a process killed now leaves the bytes it fetched
            offset += len(chunk)
    if part.stat().st_size != size:
        raise OSError(f"{source} ended at {part.stat().st_size} of its {size} bytes")


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as file:
        while block := file.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()
