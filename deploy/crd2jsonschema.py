#!/usr/bin/env python3
"""Convert CustomResourceDefinition YAML files to strict JSON schemas for kubeconform.

For every served version of every CRD given, writes ``OUT/<group>/<kind>_<version>.json``
(kind in lower case), which is what kubeconform's schema-location template
``OUT/{{ .Group }}/{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json`` resolves to.

The OpenAPI v3 structural schema of a CRD is close to JSON Schema; the differences handled here:

* ``x-kubernetes-int-or-string: true`` becomes ``anyOf: [integer, string]``;
* ``nullable: true`` adds ``null`` to the allowed types;
* strictness: an object schema that lists ``properties`` rejects unknown keys
  (``additionalProperties: false``) unless it is marked ``x-kubernetes-preserve-unknown-fields``,
  mirroring how the API server prunes and how ``kubeconform -strict`` treats built-in kinds;
* ``apiVersion`` and ``kind`` are pinned to the CRD's values.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml


def convert(node: Any) -> Any:
    """Return a JSON-schema copy of one OpenAPI v3 structural schema node."""
    if isinstance(node, list):
        return [convert(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties", "definitions"):
            out[key] = {name: convert(sub) for name, sub in value.items()}
        elif key.startswith("x-kubernetes-") or key == "nullable":
            continue
        else:
            out[key] = convert(value)
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    preserve = node.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


def crd_schemas(crd: dict[str, Any]) -> list[tuple[Path, dict[str, Any]]]:
    """(relative path, JSON schema) for each served version of one CRD."""
    spec = crd["spec"]
    group, kind = spec["group"], spec["names"]["kind"]
    result = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        raw = (version.get("schema") or {}).get("openAPIV3Schema")
        if raw is None:
            raise ValueError(f"{kind} {version['name']}: no openAPIV3Schema")
        schema = convert(raw)
        props = schema.setdefault("properties", {})
        props["apiVersion"] = {"type": "string", "enum": [f"{group}/{version['name']}"]}
        props["kind"] = {"type": "string", "enum": [kind]}
        schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind"})
        schema["$schema"] = "http://json-schema.org/draft-07/schema#"
        schema["title"] = f"{kind} ({group}/{version['name']})"
        result.append((Path(group) / f"{kind.lower()}_{version['name']}.json", schema))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("crds", nargs="+", type=Path, help="CRD YAML files")
    args = parser.parse_args(argv)
    written = 0
    for path in args.crds:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            for relative, schema in crd_schemas(doc):
                target = args.out / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
                written += 1
    if not written:
        print("crd2jsonschema: no CustomResourceDefinition found", file=sys.stderr)
        return 1
    print(f"crd2jsonschema: wrote {written} schema(s) to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
