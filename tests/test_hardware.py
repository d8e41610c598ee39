"""What a record names as its hardware: the CPU's model name and its fingerprint, both read from
one copy of ``/proc/cpuinfo`` (robust_attn/utils/hardware.py)."""
from __future__ import annotations

import hashlib
import platform

import robust_attn.utils.hardware as hardware

CPUINFO = ("processor\t: 0", "vendor_id\t: AuthenticAMD", "model name\t: AMD EPYC 9B14",
           "flags\t\t: fpu sse avx2", "", "processor\t: 1", "model name\t: AMD EPYC 9B14",
           "flags\t\t: fpu sse avx2")
UNCACHED_FINGERPRINT = hardware.cpu_fingerprint.__wrapped__   # the real one is cached per process


def _with_cpuinfo(monkeypatch, lines):
    monkeypatch.setattr(hardware, "_cpuinfo_lines", lambda: lines)
    monkeypatch.setattr(hardware, "cpu_fingerprint", UNCACHED_FINGERPRINT)


def test_cpu_name_and_fingerprint_come_from_the_first_processor(monkeypatch):
    _with_cpuinfo(monkeypatch, CPUINFO)
    assert hardware.cpu_name() == "AMD EPYC 9B14"
    expected = hashlib.sha1(b"model name\t: AMD EPYC 9B14\nflags\t\t: fpu sse avx2").hexdigest()[:10]
    assert hardware.cpu_fingerprint() == expected
    other = tuple(ln.replace("avx2", "avx512f") for ln in CPUINFO)
    _with_cpuinfo(monkeypatch, other)
    assert hardware.cpu_fingerprint() != expected          # other instruction sets, another fingerprint


def test_without_cpuinfo_the_platform_names_the_cpu(monkeypatch):
    _with_cpuinfo(monkeypatch, None)
    assert hardware.cpu_name() == (platform.processor() or platform.machine())
    names = f"{platform.processor()}\n{platform.machine()}".encode()
    assert hardware.cpu_fingerprint() == hashlib.sha1(names).hexdigest()[:10]


def test_the_real_cpuinfo_gives_a_name_and_a_stable_fingerprint():
    assert hardware.cpu_name()
    assert hardware.cpu_fingerprint() == hardware.cpu_fingerprint() and len(hardware.cpu_fingerprint()) == 10
