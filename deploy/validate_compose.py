#!/usr/bin/env python3
"""Validate Compose files against the Compose Specification JSON schema, offline.

    validate_compose.py --schema compose-spec.json docker-compose.yml [override.yml ...]

For each file: YAML anchors and merge keys are resolved, ``${VAR}``, ``${VAR:-default}`` and
``${VAR-default}`` are interpolated the way ``docker compose`` does (from the environment, else the
default), the result is validated against the schema (taken from the compose-go Go module, see
deploy/tools.sh), and every local file the project refers to must exist: build contexts and
Dockerfiles, bind-mounted sources, env_file, and file-based configs and secrets. Relative paths
resolve against the first file's folder (the project directory), as Compose does.
Exit status 0 when every file is valid; the problems are printed otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\})")


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """Compose-style variable interpolation of every string in NODE."""
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(item, env) for item in node]
    if not isinstance(node, str):
        return node

    def substitute(match: re.Match[str]) -> str:
        if match.group(1):
            return "$"
        name, op, arg = match.group(2), match.group(3), match.group(4)
        value = env.get(name)
        if op in (":-", ":?") and not value:
            value = None
        if value is None:
            if op and op.endswith("?"):
                raise ValueError(f"required variable {name} is not set: {arg}")
            return arg if op else ""
        return value

    return _VAR.sub(substitute, node)


def referenced_paths(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, path) for every local path the Compose file refers to."""
    found: list[tuple[str, str]] = []
    for name, service in (doc.get("services") or {}).items():
        build = service.get("build")
        if isinstance(build, str):
            build = {"context": build}
        if isinstance(build, dict):
            context = build.get("context", ".")
            if "://" not in context:
                found.append((f"services.{name}.build.context", context))
                dockerfile = build.get("dockerfile")
                if dockerfile:
                    found.append(
                        (f"services.{name}.build.dockerfile", str(Path(context) / dockerfile))
                    )
                elif "dockerfile_inline" not in build:
                    found.append(
                        (f"services.{name}.build (Dockerfile)", str(Path(context) / "Dockerfile"))
                    )
        for volume in service.get("volumes") or []:
            source = volume.split(":", 1)[0] if isinstance(volume, str) else None
            if isinstance(volume, dict) and volume.get("type") == "bind":
                source = volume.get("source")
            if source and source.startswith((".", "/", "~")):
                found.append((f"services.{name}.volumes", source))
        env_files = service.get("env_file") or []
        for entry in [env_files] if isinstance(env_files, str) else env_files:
            path = entry if isinstance(entry, str) else entry.get("path")
            if isinstance(entry, dict) and entry.get("required") is False:
                continue
            found.append((f"services.{name}.env_file", path))
    for section in ("configs", "secrets"):
        for name, item in (doc.get(section) or {}).items():
            if isinstance(item, dict) and item.get("file"):
                found.append((f"{section}.{name}.file", item["file"]))
    return found


def check(path: Path, project_dir: Path, validator: jsonschema.protocols.Validator) -> list[str]:
    problems = []
    try:
        raw = yaml.safe_load(path.read_text())
        doc = interpolate(raw, dict(os.environ))
    except (OSError, yaml.YAMLError, ValueError) as exc:
        return [f"{path}: {exc}"]
    if not isinstance(doc, dict):
        return [f"{path}: the top level must be a mapping"]
    for error in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(part) for part in error.absolute_path) or "<root>"
        problems.append(f"{path}: {where}: {error.message}")
    for where, ref in referenced_paths(doc):
        target = Path(os.path.expanduser(ref))
        if not target.is_absolute():
            target = project_dir / target
        if not target.exists():
            problems.append(f"{path}: {where}: {ref} does not exist")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schema", type=Path, required=True, help="compose-spec.json")
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    schema = json.loads(args.schema.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    project_dir = args.files[0].resolve().parent
    problems = [p for f in args.files for p in check(f, project_dir, validator)]
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        names = ", ".join(str(f) for f in args.files)
        print(f"compose: {names} valid against {args.schema.name} ({cls.__name__})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
