"""The GPU check's bundle (benchmarks/gpu_bundle.py, issue 39): what ``make gpu-bundle`` pins,
the frames file, and the dry run's view of the machine's packages. The install from the bundle
with no registry is ``make gpu-dry-run`` (.ci/run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_bundle
from streamproc.workloads.video import Frame

ROOT = Path(__file__).resolve().parents[3]


def test_the_bundle_pins_what_the_check_imports_besides_the_machines_packages() -> None:
    lock = (ROOT / "requirements.lock").read_text()
    pinned = gpu_bundle.requirements(lock)
    names = {gpu_bundle.canonical(p.split("==")[0]) for p in pinned}
    # the four the first GPU machine failed to import, and their own needs (pycparser: cffi's)
    assert {"msgspec", "fastavro", "authlib", "cachetools", "cffi", "pycparser"} <= names
    assert all(p in lock.splitlines() for p in pinned)  # the lock's versions, byte for byte
    # the machine's own: torch (its CUDA build), what torch needs, numpy, pillow, torchvision
    assert not names & {"torch", "torchvision", "numpy", "pillow", "sympy", "typing-extensions"}
    with pytest.raises(ValueError, match=r"not pinned in requirements.lock: \['msgspec'\]"):
        gpu_bundle.requirements(lock.replace("msgspec==", "# msgspec=="))


def test_frames_file_round_trip(tmp_path: Path) -> None:
    frames = [Frame("bikes", 0, b"\xff\xd8one"), Frame("carphone", 4, b"\xff\xd8\n\ntwo")]
    path = tmp_path / "frames.bin"
    assert gpu_bundle.write_frames(path, frames) == 2
    assert gpu_bundle.read_frames(path) == frames
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ValueError, match="cut short at frame 1"):
        gpu_bundle.read_frames(path)


def test_machine_site_links_the_machines_packages_and_nothing_else(tmp_path: Path) -> None:
    linked = gpu_bundle.machine_site(tmp_path)
    assert {"torch", "numpy", "pillow", "torchvision"} <= set(linked)
    assert (tmp_path / "torch").is_symlink() and (tmp_path / "PIL").is_symlink()
    assert not (tmp_path / "msgspec").exists() and "msgspec" not in linked
    # a Python that sees only that folder imports torch and fails on what the bundle brings
    probe = "import torch, numpy, PIL\ntry:\n import msgspec\nexcept ImportError:\n print('ok')"
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", f"import sys; sys.path[:0] = [{str(tmp_path)!r}]\n"
         + probe],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr


def test_the_bundle_stays_out_of_git() -> None:
    for path in (".gpu-bundle/cp312/x.whl", ".gpu-bundle/frames.bin"):
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, check=False)
        assert done.returncode == 0, f"{path} is not ignored"


@pytest.mark.parametrize("data", [b"", b"not json\n", b"[[1, 2]]\n"])
def test_a_broken_frames_file_is_a_value_error_saying_so(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "frames.bin"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"not a frames file.*make gpu-bundle"):
        gpu_bundle.read_frames(path)


def check_copy(tmp_path: Path, files: dict[str, bytes]) -> Path:
    """A repository holding only benchmarks/gpu_check.sh and the given .gpu-bundle files."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    (repo / "benchmarks" / "gpu_check.sh").write_bytes(
        (ROOT / "benchmarks" / "gpu_check.sh").read_bytes()
    )
    for name, data in files.items():
        (repo / ".gpu-bundle" / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / ".gpu-bundle" / name).write_bytes(data)
    return repo


TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"
WHEEL = f"{TAG}/six-1.16.0-py2.py3-none-any.whl"


@pytest.mark.parametrize(
    ("files", "named"),
    [
        ({WHEEL: b"", "frames.bin": b"x"}, "requirements.txt"),
        ({WHEEL: b"", "frames.bin": b"x", "requirements.txt": b"numpy==1.0\n"}, "numpy==1.0"),
        ({WHEEL: b"", "frames.bin": b"", "requirements.txt": b"six==1.16.0\n"}, "frames.bin"),
    ],
    ids=["no-requirements", "no-wheel-for-a-requirement", "empty-frames"],
)
def test_a_partial_bundle_exits_2_with_one_line_and_leaves_no_scratch_folder(
    tmp_path: Path, files: dict[str, bytes], named: str
) -> None:
    repo = check_copy(tmp_path, files)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    done = subprocess.run(
        ["bash", str(repo / "benchmarks" / "gpu_check.sh"), "--device", "cpu"],
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "TMPDIR": str(scratch)},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert (done.returncode, len(lines)) == (2, 1), done.stderr
    assert named in lines[0] and "make gpu-bundle" in lines[0], lines[0]
    assert list(scratch.iterdir()) == []  # the scratch site folder is gone
