"""Folders in the user cache (configs.envs.cache_dir) keyed by their content, built once per machine.

A folder is built under a temp name beside it and renamed into place, so no reader sees half of one; an exclusive
flock on a sibling lock file makes concurrent builders (the workers of one engine, two Ray jobs) wait for the first
one instead of building again. The kernel drops the lock when its holder dies, so a killed build blocks nobody.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from raylm.configs.envs import cache_dir

T = TypeVar("T")


def content_key(*parts: bytes | str) -> str:
    """A short digest of everything a cached folder's content depends on."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:16]


def cache_path(kind: str, key: str) -> Path:
    return cache_dir() / kind / key


def build_once(path: Path, build: Callable[[Path], T], announce: str) -> T | None:
    """Make the folder `path` by `build(tmp)`, which fills the empty folder `tmp`, unless `path` exists. Returns what
    build returned, or None when the folder was already there (or another process built it meanwhile). `announce`
    is printed, once, when this process builds: the user waits for it."""
    if path.is_dir():
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        if path.is_dir():
            return None
        print(announce, file=sys.stderr, flush=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            tmp.mkdir()
            result = build(tmp)
            tmp.rename(path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return result
