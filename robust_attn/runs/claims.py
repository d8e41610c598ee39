"""Claims: how several processes share the chunks of one run directory (:mod:`robust_attn.runs.store`).

Before computing a (condition, chunk), a process claims it by creating
``claims/<condition>/<chunk>.claim.<n>`` exclusively (``os.link`` of a finished temporary file:
atomic, fails if the name exists, and never shows a half-written claim). The claim records pid,
host, process start time and time; after claiming, the process checks again that the chunk is still
missing (another process may have finished it in between), so no chunk is computed twice. A claim is
*stale*, and taken over, when its process is gone: on the same host its pid is dead (or a zombie, or
reused by a process with another start time); from another host when its heartbeat (the file's
mtime, touched after each condition written) is older than the claim timeout
(``ROBUST_ATTN_CLAIM_TIMEOUT`` seconds, default 6 hours). Taking over claim ``n`` means creating
``n + 1`` exclusively, so two processes that both find ``n`` stale cannot both win; stale claim files
are never deleted by a taker, which is what makes the takeover race-free. Once the chunk exists its
claim files are deleted (they no longer matter).
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path

__all__ = ["Claim", "claim_chunk", "claim_timeout", "CLAIM_TIMEOUT_ENV"]

CLAIM_SUFFIX = ".claim"
CLAIMS = "claims"
CLAIM_TIMEOUT_ENV = "ROBUST_ATTN_CLAIM_TIMEOUT"
DEFAULT_CLAIM_TIMEOUT = 6 * 3600.0

_HOST = socket.gethostname()
_LIVE_TOKENS: set[str] = set()  # claims held by this process right now


def _process_start(pid: int) -> str | None:
    """The start time of ``pid`` (Linux ``/proc``; None elsewhere or when it is gone); 'Z' for
    a zombie (killed, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return "Z" if fields[0] in ("Z", "X") else fields[19]


def _pid_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _process_start(pid)
    if now == "Z":
        return False
    return start is None or now is None or now == start


def claim_timeout() -> float:
    return float(os.environ.get(CLAIM_TIMEOUT_ENV, DEFAULT_CLAIM_TIMEOUT))


class Claim:
    """This process's claim on one (condition, chunk): ``release()`` when done or abandoned,
    ``touch()`` as a heartbeat."""

    def __init__(self, path: Path, token: str, chunk: Path):
        self.path, self.token, self.chunk = path, token, chunk
        _LIVE_TOKENS.add(token)

    def touch(self) -> None:
        try:
            os.utime(self.path)
        except OSError:
            pass

    def release(self) -> None:
        """Drop the claim; once the chunk exists, every claim file of it goes (stale ones too)."""
        _LIVE_TOKENS.discard(self.token)
        paths = _claim_files(self.chunk) if self.chunk.is_file() else [self.path]
        for path in paths:
            try:
                path.unlink()
            except FileNotFoundError:
                pass


def _claim_dir(chunk: Path) -> Path:
    """``<run>/claims/<condition>`` of ``<run>/records/<condition>/<chunk>``: beside the records,
    not among them, so that a condition folder holds chunk files only."""
    return chunk.parents[2] / CLAIMS / chunk.parent.name


def _claim_files(chunk: Path) -> list[Path]:
    prefix = chunk.name + CLAIM_SUFFIX + "."
    folder = _claim_dir(chunk)
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if p.name.startswith(prefix) and p.name[len(prefix):].isdigit()]


def _claim_held(path: Path, timeout: float) -> bool | None:
    """True while the claim's process may still be computing; None if the file is gone."""
    try:
        mtime = path.stat().st_mtime
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        info = {}
    if info.get("host") == _HOST and isinstance(info.get("pid"), int):
        if info["pid"] == os.getpid():
            return info.get("token") in _LIVE_TOKENS
        return _pid_alive(info["pid"], info.get("start"))
    return time.time() - mtime < timeout


def claim_chunk(chunk: Path, timeout: float | None = None) -> Claim | None:
    """Claim the computation of ``chunk`` for this process; None when it exists already or a
    live process holds it (see the module docstring)."""
    timeout = claim_timeout() if timeout is None else timeout
    base = chunk.name + CLAIM_SUFFIX + "."
    for _ in range(100):
        if chunk.is_file():
            return None
        claims = sorted(_claim_files(chunk), key=lambda p: int(p.name[len(base):]))
        gen = 0
        if claims:
            held = _claim_held(claims[-1], timeout)
            if held:
                return None
            if held is None:  # released meanwhile: look again
                continue
            gen = int(claims[-1].name[len(base):]) + 1
        token = uuid.uuid4().hex
        record = {"pid": os.getpid(), "host": _HOST, "start": _process_start(os.getpid()), "token": token,
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        path = _claim_dir(chunk) / f"{base}{gen}"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{token}.tmp"
        tmp.write_text(json.dumps(record))
        try:
            os.link(tmp, path)
        except FileExistsError:
            continue  # another process took this generation first: look again
        finally:
            tmp.unlink()
        claim = Claim(path, token, chunk)
        if chunk.is_file():  # finished by another process between our look and our claim
            claim.release()
            return None
        return claim
    raise RuntimeError(f"could not claim {chunk}: claim files keep changing")
