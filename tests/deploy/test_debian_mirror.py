"""deploy/images/debian-mirror.sh: the base image's Debian mirror comes from the host's apt sources.

Sample apt configurations in a temporary folder (APT_ETC, OS_RELEASE); nothing is downloaded.
The sample mirrors are on reserved .example names: no real package host is named anywhere in the
repository (checked last).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.deploy.conftest import ROOT

SCRIPT = ROOT / "deploy" / "images" / "debian-mirror.sh"
ARCHIVE = "http://apt.corp.example/archive"
SECURITY = "http://apt.corp.example/security"
OTHER = "https://packages.vendor.example/apt"


def mirror(
    etc: Path, suite: str = "bookworm", os_release: str = "", override: str | None = None
) -> subprocess.CompletedProcess[str]:
    release = etc / "os-release"
    release.write_text(os_release)
    env = {**os.environ, "APT_ETC": str(etc), "OS_RELEASE": str(release)}
    env.pop("DEBIAN_MIRROR", None)
    if override is not None:
        env["DEBIAN_MIRROR"] = override
    return subprocess.run(
        [str(SCRIPT), suite], capture_output=True, text=True, check=False, env=env, timeout=30
    )


def write(etc: Path, name: str, text: str) -> None:
    path = etc / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_one_line_sources_list(tmp_path: Path) -> None:
    write(
        tmp_path,
        "sources.list",
        f"""# the company mirror
deb-src {ARCHIVE} bookworm main
deb [arch=amd64 signed-by=/usr/share/keyrings/corp.gpg] {SECURITY} bookworm-security main
deb [ arch=amd64 ] {ARCHIVE}/ bookworm main contrib  # trailing comment
deb {OTHER} bookworm main
""",
    )
    result = mirror(tmp_path)
    assert (result.returncode, result.stdout) == (0, f"{ARCHIVE}/\n"), result.stderr


def test_deb822_sources_skip_disabled_entries_and_other_suites(tmp_path: Path) -> None:
    write(
        tmp_path,
        "sources.list.d/10-vendor.sources",
        f"""Types: deb
URIs: {OTHER}
Suites: nodistro
Components: main
""",
    )
    write(
        tmp_path,
        "sources.list.d/20-corp.sources",
        f"""# disabled: must not count
Types: deb
URIs: {OTHER}
Suites: bookworm
Components: main
Enabled: no

Types: deb-src deb
URIs: mirror+file:/etc/apt/mirrors.txt
 {ARCHIVE}
Suites: bookworm-updates
 bookworm
Components: main
Signed-By: /usr/share/keyrings/archive-keyring.gpg

Types: deb
URIs: {SECURITY}
Suites: bookworm-security
Components: main
""",
    )
    result = mirror(tmp_path)
    assert (result.returncode, result.stdout) == (0, f"{ARCHIVE}\n"), result.stderr


def test_sources_list_comes_before_the_parts_in_their_order(tmp_path: Path) -> None:
    write(tmp_path, "sources.list.d/b.list", f"deb {OTHER} bookworm main\n")
    write(
        tmp_path,
        "sources.list.d/a.sources",
        f"Types: deb\nURIs: {SECURITY}\nSuites: bookworm\nComponents: main\n",
    )
    write(tmp_path, "sources.list.d/c.list.disabled", f"deb {OTHER}/off bookworm main\n")
    assert mirror(tmp_path).stdout == f"{SECURITY}\n"
    write(tmp_path, "sources.list", f"deb {ARCHIVE} bookworm main\n")
    assert mirror(tmp_path).stdout == f"{ARCHIVE}\n"


def test_a_debian_host_of_another_release_gives_its_own_mirror(tmp_path: Path) -> None:
    write(
        tmp_path,
        "sources.list.d/debian.sources",
        f"Types: deb\nURIs: {ARCHIVE}\nSuites: trixie trixie-updates\nComponents: main\n",
    )
    write(tmp_path, "sources.list.d/vendor.list", f"deb {OTHER} stable main\n")
    debian = 'PRETTY_NAME="Debian GNU/Linux 13 (trixie)"\nID=debian\nVERSION_CODENAME=trixie\n'
    result = mirror(tmp_path, os_release=debian)
    assert (result.returncode, result.stdout) == (0, f"{ARCHIVE}\n"), result.stderr
    other = "ID=ubuntu\nID_LIKE=debian\nVERSION_CODENAME=trixie\n"
    assert mirror(tmp_path, os_release=other).returncode == 1


def test_nothing_found_names_the_override(tmp_path: Path) -> None:
    write(tmp_path, "sources.list", f"deb {OTHER} nodistro main\n")
    result = mirror(tmp_path, os_release="ID=ubuntu\nVERSION_CODENAME=noble\n")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith("debian-mirror: FAIL: no apt source in ")
    assert "set DEBIAN_MIRROR" in result.stderr
    (tmp_path / "sources.list").unlink()
    assert mirror(tmp_path).returncode == 1


def test_debian_mirror_overrides_the_host_sources(tmp_path: Path) -> None:
    write(tmp_path, "sources.list", f"deb {ARCHIVE} bookworm main\n")
    assert mirror(tmp_path, override=OTHER).stdout == f"{OTHER}\n"


def test_the_image_build_takes_the_mirror_from_the_script() -> None:
    build = (ROOT / "deploy" / "images" / "build.sh").read_text()
    assert '"$HERE/debian-mirror.sh" "$DEBIAN_SUITE"' in build
    assert 'debootstrap --variant=minbase "$DEBIAN_SUITE" "$rootfs" "$mirror"' in build


# A Debian or Ubuntu package host: a name under their domains, or an http(s) URL naming them.
PACKAGE_HOST = re.compile(
    r"\b[a-z0-9.-]+\.(?:debian|ubuntu)\.(?:org|net|com)\b|https?://[^\s/\"'<>]*(?:debian|ubuntu)",
    re.IGNORECASE,
)


def test_no_package_host_is_named_in_the_repository() -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    named = []
    for name in filter(None, files.split("\0")):
        path = ROOT / name
        if not path.is_file():
            continue
        text = path.read_bytes().decode(errors="replace")
        named += [f"{name}: {m.group(0)}" for m in PACKAGE_HOST.finditer(text)]
    assert named == []
