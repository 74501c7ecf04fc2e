"""Dockerfile, .dockerignore and the config renderer shipped in the image."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import yaml

from tests.deploy.conftest import ROOT

DOCKERFILE = ROOT / "Dockerfile"
RENDERER = ROOT / "deploy" / "docker" / "streamproc-render-config"


def instructions(dockerfile: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def final_stage() -> list[tuple[str, str]]:
    items = instructions()
    last_from = max(i for i, (word, _) in enumerate(items) if word == "FROM")
    return items[last_from:]


IMAGE_DOCKERFILES = sorted((ROOT / "deploy" / "images").glob("*.Dockerfile"))
# Never in a runtime image (the compose test also lists the built image's packages).
DEV_TOOLS = {"pytest", "pytest-timeout", "ruff", "testcontainers", "docker", "scikit-image"}
NOT_RUNTIME = DEV_TOOLS | {"scipy", "pandas", "matplotlib", "iniconfig", "pluggy"}


def test_hadolint_is_clean(tools: dict[str, str]) -> None:
    for dockerfile in [DOCKERFILE, *IMAGE_DOCKERFILES]:
        result = subprocess.run(
            [tools["HADOLINT"], str(dockerfile)], capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, f"{dockerfile.name}: {result.stdout}{result.stderr}"


def test_builds_with_the_legacy_builder_and_pulls_no_frontend() -> None:
    """Defect 2: `# syntax=` pulled a frontend image; `COPY --chmod` failed without BuildKit."""
    for dockerfile in [DOCKERFILE, *IMAGE_DOCKERFILES]:
        text = dockerfile.read_text()
        assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I), dockerfile.name
        for word, args in instructions(dockerfile):
            flags = re.findall(r"--([a-z-]+)", args.split(" ", 1)[0] if word == "RUN" else args)
            if word in ("COPY", "ADD"):
                assert set(flags) <= {"from"}, (dockerfile.name, word, args)
            if word == "RUN":
                assert not args.startswith("--"), (dockerfile.name, args)
        images = external_images(dockerfile)
        assert images and all(i.startswith("${") for i in images), (dockerfile.name, images)


def stages(dockerfile: Path = DOCKERFILE) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """Each stage in order: (the image or earlier stage it is FROM, its name or "", its
    instructions after FROM)."""
    result: list[tuple[str, str, list[tuple[str, str]]]] = []
    for word, args in instructions(dockerfile):
        if word == "FROM":
            image, _, name = args.partition(" AS ")
            result.append((image.strip(), name.strip(), []))
        elif result:
            result[-1][2].append((word, args))
    return result


def external_images(dockerfile: Path = DOCKERFILE) -> list[str]:
    """The images the stages are FROM, leaving out the stages built FROM an earlier stage."""
    named: set[str] = set()
    images = []
    for image, name, _ in stages(dockerfile):
        if image not in named:
            images.append(image)
        named.add(name)
    return images


def lock_names(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        if line and not line.startswith(("#", "-r")):
            names.add(re.split("[=<>]", line)[0].strip().lower().replace("_", "-"))
    return names


def test_runtime_lock_has_no_dev_tools_and_the_image_installs_only_it() -> None:
    runtime = lock_names(ROOT / "requirements.lock")
    dev = lock_names(ROOT / "requirements-dev.lock")
    assert not runtime & NOT_RUNTIME, runtime & NOT_RUNTIME
    assert not runtime & dev, runtime & dev
    assert dev >= DEV_TOOLS
    assert "-r requirements.lock" in (ROOT / "requirements-dev.lock").read_text()
    assert {"torch", "torchvision", "confluent-kafka", "triton"} <= runtime
    text = DOCKERFILE.read_text()
    assert "requirements-dev.lock" not in " ".join(a for w, a in instructions() if w != "#")
    lock = (ROOT / "requirements.lock").read_text()
    # the CPU variant stops at the marker: only CUDA-only wheels may follow it
    cuda_only = re.split(r"^# cuda-only.*$", lock, maxsplit=1, flags=re.M)[1].splitlines()
    assert [line.split("==")[0] for line in cuda_only if line] == ["triton"]
    assert "sed '/^# cuda-only/,$d' requirements.lock" in text


def test_multi_stage_cpu_by_default_cuda_by_build_arg() -> None:
    items = instructions()
    froms = [args for word, args in items if word == "FROM"]
    assert len(froms) >= 2
    assert all(i.startswith("${BASE_IMAGE}") for i in external_images())
    args = [args for word, args in items if word == "ARG"]
    assert "VARIANT=cpu" in args
    assert any(a.startswith("BASE_IMAGE=python:3.11") for a in args)
    assert "cuda)" in DOCKERFILE.read_text()


def test_final_stage_is_non_root_without_compilers() -> None:
    stage = final_stage()
    words = dict(stage)
    user = words["USER"]
    assert re.fullmatch(r"\d+:\d+", user) and not user.startswith("0:"), user
    assert json.loads(words["ENTRYPOINT"]) == ["streamproc"]
    runs = " ".join(args for word, args in stage if word == "RUN")
    for tool in ("gcc", "g++", "build-essential", "make ", "curl", "apt-get install"):
        assert tool not in runs, tool
    copies = [args for word, args in stage if word == "COPY"]
    assert copies and all(c.startswith("--from=") for c in copies), "only built stages are copied"


def test_a_change_to_the_package_rebuilds_no_dependency_layer() -> None:
    """CI, 2026-12-06: one 3.9 GB layer held dependencies and package, so every code change left
    a copy behind (BuildKit's cache, the test cluster's node) until the disk filled. The final
    stage copies the dependencies from a stage that never sees the package's source."""
    by_name = {name: (image, items) for image, name, items in stages() if name}
    copies = [args.split() for word, args in final_stage() if word == "COPY"]
    sources = {src.removeprefix("--from="): dest for src, _, dest in copies}
    deps_stage = next(name for name, dest in sources.items() if dest == "/opt/streamproc")
    seen: list[str] = []
    name = deps_stage
    while name in by_name:  # the stage and every stage it is built FROM
        image, items = by_name[name]
        seen += [args for word, args in items if word in ("COPY", "ADD")]
        name = image
    assert seen and not [c for c in seen if re.search(r"\bstreamproc\b|pyproject|README", c)], seen
    assert any("requirements.lock" in c for c in seen), seen
    package_copies = [src for src, dest in sources.items() if src != deps_stage]
    assert package_copies, "the package comes in a layer of its own"


def test_healthcheck_uses_python_urllib_on_healthz() -> None:
    check = dict(final_stage())["HEALTHCHECK"]
    assert "urllib.request" in check and "/healthz" in check and "curl" not in check


def test_writable_paths_point_at_tmp() -> None:
    env = " ".join(args for word, args in final_stage() if word == "ENV")
    for name in ("HOME", "STREAMPROC_CACHE_DIR", "TORCH_HOME", "XDG_CACHE_HOME"):
        match = re.search(rf"\b{name}=(\S+)", env)
        assert match and match.group(1).startswith("/tmp"), name


def test_image_environment_is_accepted_by_the_package(monkeypatch) -> None:
    """The image's STREAMPROC_* variables must not trip the package's unknown-variable check."""
    from streamproc.config import load_config

    env = " ".join(args for word, args in final_stage() if word == "ENV")
    names = set(re.findall(r"\b(STREAMPROC_[A-Z_]+)=", env))
    assert {"STREAMPROC_CACHE_DIR", "STREAMPROC_CONFIG"} <= names
    for name in [n for n in os.environ if n.upper().startswith("STREAMPROC_")]:
        monkeypatch.delenv(name)
    for name in names:
        monkeypatch.setenv(name, "/tmp/unused")
    load_config(ROOT / "deploy" / "compose" / "streamproc.yaml")


def test_dockerignore_allows_exactly_what_the_build_copies() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "allow-list: everything else stays out of the build context"
    allowed = [line[1:].rstrip("/") for line in lines if line.startswith("!")]
    for word, args in instructions():
        if word != "COPY" or "--from=" in args:
            continue
        sources = [part for part in args.split() if not part.startswith("--")][:-1]
        for source in sources:
            assert (ROOT / source).exists(), source
            assert any(source == a or source.startswith(f"{a}/") for a in allowed), source


def test_render_config_merges_secret_files(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text(
        "kafka:\n  consumer: {security.protocol: SASL_SSL}\n"
        "pipelines: [{name: a, input_topic: a, output_topic: b, workload: iot}]\n"
    )
    (tmp_path / "password").write_text("s3cr3t:pa$$\n")
    (tmp_path / "username").write_text("svc-user")
    out = tmp_path / "run" / "config.yaml"
    result = subprocess.run(
        [
            sys.executable,
            str(RENDERER),
            f"--in={base}",
            f"--out={out}",
            f"--secret=kafka/consumer/sasl.password={tmp_path / 'password'}",
            f"--secret=kafka/producer/sasl.username={tmp_path / 'username'}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "s3cr3t" not in result.stdout + result.stderr
    rendered = yaml.safe_load(out.read_text())
    assert rendered["kafka"]["consumer"] == {
        "security.protocol": "SASL_SSL",
        "sasl.password": "s3cr3t:pa$$",
    }
    assert rendered["kafka"]["producer"] == {"sasl.username": "svc-user"}
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert os.access(RENDERER, os.X_OK)


def test_render_config_rejects_bad_arguments(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text("kafka: {}\n")
    for secret in ("no-equals-sign", f"kafka/consumer/x={tmp_path / 'absent'}"):
        result = subprocess.run(
            [
                sys.executable,
                str(RENDERER),
                f"--in={base}",
                f"--out={tmp_path / 'o'}",
                f"--secret={secret}",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 2, secret
        assert not (tmp_path / "o").exists()
