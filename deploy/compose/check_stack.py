"""Checks of `make compose-test`, run inside the streamproc container of the stack
(``docker compose exec -T streamproc python - ARGS < deploy/compose/check_stack.py``):

``verify [--allow-duplicates] [--expect-inputs N] [--timeout-s S]``
    From the broker, for every pipeline of the mounted config: every input record has a result or
    a dead-letter record (0 missing), none has two (0 duplicates; after a crash, at-least-once
    allows them: ``--allow-duplicates``), and the group's committed offsets equal the end offsets
    (a partition that never received a record counts as done). Retried until it holds or
    ``--timeout-s`` seconds pass; exit 1 then, with the verdicts.
``avro-results TOPIC REGISTRY_URL``
    Every result in TOPIC is framed Avro that confluent-kafka's stock ``AvroDeserializer`` reads
    (its writer schema fetched by id from the registry at REGISTRY_URL) and holds a ``score``.
``prometheus URL ALERT...``
    Prometheus at URL scrapes streamproc (``up{job="streamproc"} == 1`` and
    ``streamproc_messages_consumed_total`` > 0) and has loaded the alert rules named. Retried
    likewise.
``traces URL``
    Zipkin at URL holds a trace of streamproc: a ``process <input topic>`` span of a pipeline
    with its stage spans (decode, device.wait, device, encode, produce) as children (the
    replayers' records carry no ``traceparent``: the batches sampled are roots, and their
    results carry the batch span's context, no ``create`` span). Retried likewise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable

from streamproc.config import load_config
from streamproc.tools.verify import Verdict, verify

CONFIG = "/etc/streamproc/config.yaml"
STAGE_SPANS = ("decode", "device.wait", "device", "encode", "produce")
"""The child spans of a batch's ``process`` span (``streamproc.tracing.batch``)."""


def log(message: str) -> None:
    print(f"[compose-test]   {message}", file=sys.stderr, flush=True)


def retry(check: Callable[[], bool], timeout_s: float, interval_s: float = 2.0) -> bool:
    """Call ``check`` until it returns True or ``timeout_s`` seconds pass; return its last value."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        if check():
            return True
        if time.monotonic() >= deadline_s:
            return False
        time.sleep(interval_s)


def broker_verdicts(allow_duplicates: bool, expect_inputs: int | None, timeout_s: float) -> int:
    config = load_config(CONFIG)
    last: list[Verdict] = []

    def check() -> bool:
        last[:] = [
            verify(
                config.bootstrap_servers,
                p.input_topic,
                p.output_topic,
                p.dead_letter_topic,
                config.kafka.group_id,
            )
            for p in config.pipelines
        ]
        total = sum(v.inputs for v in last)
        return (
            all(
                not v.missing
                and (allow_duplicates or v.duplicates == 0)
                and v.committed_equals_end
                and v.output_stable
                for v in last
            )
            and (expect_inputs is None or total == expect_inputs)
            and all(v.results > 0 for v in last)
        )

    ok = retry(check, timeout_s)
    for v in last:
        empty = sum(1 for end in v.end_offsets.values() if end == 0)
        log(
            f"{v.topic}: {v.inputs} inputs, {v.results} results, {v.dead_lettered} dead-lettered, "
            f"{len(v.missing)} missing, {v.duplicates} duplicates, committed == end: "
            f"{v.committed_equals_end} ({len(v.end_offsets)} partitions, {empty} never written)"
        )
    total = sum(v.inputs for v in last)
    if expect_inputs is not None and total != expect_inputs:
        log(f"expected {expect_inputs} inputs in all, found {total}")
    return 0 if ok else 1


def avro_results(topic: str, registry_url: str) -> int:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    from streamproc.tools.verify import read_topic

    config = load_config(CONFIG)
    values = [v for _, v, _, _ in read_topic(config.bootstrap_servers, topic).records.values()]
    context = SerializationContext(topic, MessageField.VALUE)
    with SchemaRegistryClient({"url": registry_url}) as client:
        stock = AvroDeserializer(client)
        documents = [stock(value, context) for value in values]
    scored = sum(1 for doc in documents if isinstance(doc.get("score"), float))
    log(f"{topic}: {len(values)} results, {scored} read as Avro with a score; first: {documents[:1]}")
    return 0 if values and scored == len(values) else 1


def get_json(base: str, path: str, **query: str) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(query)}" if query else f"{base}{path}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


def prometheus(base: str, alerts: list[str], timeout_s: float) -> int:
    state: dict[str, object] = {}

    def check() -> bool:
        try:
            up = get_json(base, "/api/v1/query", query='up{job="streamproc"}')["data"]["result"]
            consumed = get_json(
                base, "/api/v1/query", query="sum(streamproc_messages_consumed_total)"
            )["data"]["result"]
            groups = get_json(base, "/api/v1/rules")["data"]["groups"]
        except OSError as exc:
            state["error"] = str(exc)
            return False
        state["up"] = [r["value"][1] for r in up]
        state["consumed"] = [r["value"][1] for r in consumed]
        state["rules"] = sorted(r["name"] for g in groups for r in g["rules"])
        return (
            state["up"] == ["1"]
            and bool(consumed)
            and float(consumed[0]["value"][1]) > 0
            and set(alerts) <= set(state["rules"])
        )

    ok = retry(check, timeout_s)
    log(f"prometheus: {json.dumps(state)}")
    return 0 if ok else 1


def traces(base: str, timeout_s: float) -> int:
    """Zipkin holds one batch's trace whole (see the module docstring)."""
    topics = {p.input_topic for p in load_config(CONFIG).pipelines}
    state: dict[str, object] = {}

    def check() -> bool:
        try:
            found = get_json(base, "/api/v2/traces", serviceName="streamproc", limit="50")
        except OSError as exc:
            state["error"] = str(exc)
            return False
        state["traces"] = len(found)
        for spans in found:
            batches = {s["id"] for s in spans if s["name"].removeprefix("process ") in topics}
            children = {s["name"] for s in spans if s.get("parentId") in batches}
            if batches and set(STAGE_SPANS) <= children:
                state["trace"] = sorted({span["name"] for span in spans})
                return True
        return False

    ok = retry(check, timeout_s)
    log(f"zipkin: {json.dumps(state)}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(prog="check_stack.py")
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify")
    v.add_argument("--allow-duplicates", action="store_true")
    v.add_argument("--expect-inputs", type=int)
    v.add_argument("--timeout-s", type=float, default=300.0)
    a = sub.add_parser("avro-results")
    a.add_argument("topic")
    a.add_argument("registry_url")
    p = sub.add_parser("prometheus")
    p.add_argument("url")
    p.add_argument("alerts", nargs="*")
    p.add_argument("--timeout-s", type=float, default=300.0)
    t = sub.add_parser("traces")
    t.add_argument("url")
    t.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    if args.command == "verify":
        return broker_verdicts(args.allow_duplicates, args.expect_inputs, args.timeout_s)
    if args.command == "avro-results":
        return avro_results(args.topic, args.registry_url)
    if args.command == "traces":
        return traces(args.url.rstrip("/"), args.timeout_s)
    return prometheus(args.url.rstrip("/"), args.alerts, args.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
