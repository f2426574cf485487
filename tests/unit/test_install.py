"""`pip install .` from a checkout gives a working specshim.

No package index serves specshim, so the README's install line installs the
checkout. This builds a wheel of it, installs the wheel into a throwaway
environment and runs that environment's `specshim doctor`.

The wheel is built from a copy of the files git tracks (their working-tree
content), not from the checkout itself: a module that exists here but was never
`git add`-ed would be missing from a clone, and must be missing from the wheel
too. Copying tracked files rather than `git archive HEAD` lets the test see
changes not yet committed, which is what a developer running it wants checked.

The throwaway environment is made with `--system-site-packages` from this
test's interpreter. That interpreter is itself a venv (`.venv`), and a venv made
from a venv sees its *base* Python's packages, not `.venv`'s; so a `.pth` file
adds `.venv`'s site-packages by path. Such a line puts the folder on `sys.path`
without running the `.pth` files in it, so the editable install's own `.pth`
(which would put `src/` on the path) stays inert, and the environment's own
site-packages, holding the wheel, comes first.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tracked_copy(dest: Path) -> Path:
    """The files git tracks (as they are in the working tree), copied to dest."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files to copy")
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listing.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted here is not copied
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def _uv() -> str:
    uv = Path(sys.executable).with_name("uv")
    if not uv.exists():
        pytest.skip(f"no uv next to {sys.executable} (make setup installs it)")
    return str(uv)


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{args}:\n{result.stdout}\n{result.stderr}"
    return result


def _wheel(tmp_path: Path) -> Path:
    source = _tracked_copy(tmp_path / "checkout")
    dist = tmp_path / "dist"
    _run([_uv(), "build", "--wheel", "--out-dir", str(dist), str(source)])
    (wheel,) = dist.glob("specshim-*.whl")
    return wheel


def _environment_with(wheel: Path, venv: Path) -> Path:
    """A venv that sees this interpreter's packages and holds ``wheel``; its
    site-packages folder."""
    make = [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip"]
    _run([*make, str(venv)])
    python = str(venv / "bin" / "python")
    query = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(_run([python, "-c", query]).stdout.strip())
    (site / "_outer_venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([_uv(), "pip", "install", "--python", python, "--no-deps", str(wheel)])
    return site


# Where the environment finds specshim, its vLLM plugin module and the
# distribution that declares the plugin's entry point.
WHERE = """
import json, importlib.metadata as m, specshim, specshim_vllm_plugin
(ep,) = m.entry_points(group="vllm.general_plugins", name="specshim")
print(json.dumps([specshim.__file__, specshim_vllm_plugin.__file__,
                  str(ep.dist.locate_file(""))]))
"""


def test_wheel_of_the_checkout_installs_and_its_doctor_runs(tmp_path):
    venv = tmp_path / "venv"
    site = _environment_with(_wheel(tmp_path), venv)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    env.pop("SPECSHIM_DISABLE", None)

    python = str(venv / "bin" / "python")
    found = json.loads(_run([python, "-c", WHERE], cwd=tmp_path, env=env).stdout)
    for path in found:  # the wheel's, not the editable checkout's
        assert Path(path).resolve().is_relative_to(site.resolve()), found

    doctor = subprocess.run(
        [str(venv / "bin" / "specshim"), "doctor"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    lines = [" ".join(line.split()) for line in doctor.stdout.splitlines()]
    assert "plugin entry point installed, allowed by VLLM_PLUGINS" in lines
    assert lines[-1] == "Nothing to fix."
