"""The ``streamproc`` command line (argument parsing only; see DESIGN.md section 6)."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from streamproc.errors import StreamprocError
from streamproc.workloads.registry import BUILTIN_WORKLOADS

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Kafka stream processing with PyTorch models.",
)
kafka_app = typer.Typer(no_args_is_help=True, help="A local Apache Kafka broker (KRaft).")
app.add_typer(kafka_app, name="kafka")
registry_app = typer.Typer(
    no_args_is_help=True, help="A local Schema Registry (Apicurio, Confluent-compatible API)."
)
app.add_typer(registry_app, name="registry")

DEFAULT_BROKER_DIR = Path(".streamproc/kafka")
DEFAULT_REGISTRY_DIR = Path(".streamproc/registry")
Bootstrap = Annotated[
    str | None,
    typer.Option(
        "--bootstrap",
        envvar="KAFKA_BOOTSTRAP_SERVERS",
        help="Broker address host:port (else $KAFKA_BOOTSTRAP_SERVERS).",
    ),
]


def _fail(exc: BaseException) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(2)


@kafka_app.command("start")
def kafka_start(
    directory: Annotated[Path, typer.Option("--dir", help="Broker state folder.")] = (
        DEFAULT_BROKER_DIR
    ),
    brokers: Annotated[
        int,
        typer.Option(
            min=1,
            help="Nodes: 1 (one broker, replication factor 1) or 3+ (a replicated cluster: "
            "replication factor 3, min.insync.replicas 2).",
        ),
    ] = 1,
) -> None:
    """Start a local broker (or cluster) in the background; the last line is
    KAFKA_BOOTSTRAP_SERVERS=..."""
    from streamproc.tools.kafka_local import (
        LocalCluster,
        LocalKafka,
        alive,
        ensure_kafka_jars,
        terminate_pid,
    )

    if brokers == 2:
        raise _fail(ValueError("--brokers: 1, or 3 and more (replication factor 3); got 2"))
    directory = directory.resolve()
    old = _recorded_pids(directory)
    bootstrap_file = directory / "bootstrap"
    if old and all(alive(pid) for pid in old) and bootstrap_file.exists():
        typer.echo(
            f"broker already running (pid {', '.join(map(str, old))}); stop it with "
            f"`streamproc kafka stop --dir {directory}`"
        )
        typer.echo(f"KAFKA_BOOTSTRAP_SERVERS={bootstrap_file.read_text().strip()}")
        return
    for pid in old:
        terminate_pid(pid, 20.0)
    try:
        if brokers == 1:
            broker = LocalKafka(directory, ensure_kafka_jars(), own_lifetime=False)
            bootstrap = broker.start()
            logs = [broker.log_path]
        else:
            cluster = LocalCluster(directory, ensure_kafka_jars(), brokers, own_lifetime=False)
            bootstrap = cluster.start()
            logs = [node.log_path for node in cluster.nodes]
    except StreamprocError as exc:
        raise _fail(exc) from exc
    (directory / "bootstrap").write_text(bootstrap)
    for log in logs:
        typer.echo(f"broker log: {log}")
    typer.echo(f"KAFKA_BOOTSTRAP_SERVERS={bootstrap}")


def _recorded_pids(directory: Path) -> list[int]:
    """Pids recorded by `kafka start`: the single broker's and every cluster node's."""
    from streamproc.tools.kafka_local import read_pid

    files = [directory / "broker.pid", *sorted(directory.glob("node-*/broker.pid"))]
    return [pid for pid in map(read_pid, files) if pid is not None]


@kafka_app.command("stop")
def kafka_stop(
    directory: Annotated[Path, typer.Option("--dir", help="Broker state folder.")] = (
        DEFAULT_BROKER_DIR
    ),
) -> None:
    """Stop the broker (or every node of the cluster) started with `kafka start --dir DIR`; no
    process is left behind."""
    from streamproc.tools.kafka_local import terminate_pid

    pids = _recorded_pids(directory)
    if not pids:
        typer.echo(f"no broker recorded in {directory}")
        return
    for pid in pids:
        terminate_pid(pid, 20.0)
    for path in [directory / "broker.pid", *directory.glob("node-*/broker.pid")]:
        path.unlink(missing_ok=True)
    typer.echo(f"stopped broker pid {', '.join(map(str, pids))}")


@registry_app.command("start")
def registry_start(
    directory: Annotated[Path, typer.Option("--dir", help="Registry state folder.")] = (
        DEFAULT_REGISTRY_DIR
    ),
) -> None:
    """Start a local Schema Registry in the background (loopback, in-memory, BACKWARD
    compatibility); the last line is SCHEMA_REGISTRY_URL=..."""
    from streamproc.tools.kafka_local import alive, read_pid, terminate_pid
    from streamproc.tools.registry_local import LocalRegistry, ensure_registry_app

    directory = directory.resolve()
    pid = read_pid(directory / "registry.pid")
    url_file = directory / "url"
    if pid is not None and alive(pid) and url_file.exists():
        typer.echo(
            f"registry already running (pid {pid}); stop it with "
            f"`streamproc registry stop --dir {directory}`"
        )
        typer.echo(f"SCHEMA_REGISTRY_URL={url_file.read_text().strip()}")
        return
    if pid is not None:
        terminate_pid(pid, 20.0)
    try:
        registry = LocalRegistry(directory, ensure_registry_app(), own_lifetime=False)
        url = registry.start()
    except StreamprocError as exc:
        raise _fail(exc) from exc
    url_file.write_text(url)
    typer.echo(f"registry log: {registry.log_path}")
    typer.echo(f"SCHEMA_REGISTRY_URL={url}")


@registry_app.command("stop")
def registry_stop(
    directory: Annotated[Path, typer.Option("--dir", help="Registry state folder.")] = (
        DEFAULT_REGISTRY_DIR
    ),
) -> None:
    """Stop the registry started with `registry start --dir DIR`; no process is left behind."""
    from streamproc.tools.kafka_local import read_pid, terminate_pid

    pid = read_pid(directory / "registry.pid")
    if pid is None:
        typer.echo(f"no registry recorded in {directory}")
        return
    terminate_pid(pid, 20.0)
    (directory / "registry.pid").unlink(missing_ok=True)
    typer.echo(f"stopped registry pid {pid}")


@app.command("produce")
def produce_cmd(
    workload: Annotated[
        str, typer.Argument(help=f"Built-in workload: {', '.join(BUILTIN_WORKLOADS)}.")
    ],
    topic: Annotated[str, typer.Option("--topic", help="Target topic (created if missing).")],
    bootstrap: Bootstrap = None,
    partitions: Annotated[int, typer.Option(min=1, help="Partitions if created.")] = 4,
    limit: Annotated[int | None, typer.Option(min=1, help="Messages (default: one pass).")] = None,
    rate: Annotated[float | None, typer.Option(min=0.001, help="Messages per second.")] = None,
    transaction_size: Annotated[
        int | None,
        typer.Option(
            min=1, help="Write in transactions of this many messages (as an exactly-once stage)."
        ),
    ] = None,
    value_format: Annotated[
        str,
        typer.Option(
            "--format",
            help="Value format: json (the recording as is), avro, protobuf or jsonschema (the "
            "workload's schema, registered in the Schema Registry under <topic>-value).",
        ),
    ] = "json",
    registry: Annotated[
        str | None,
        typer.Option(
            "--registry",
            envvar="SCHEMA_REGISTRY_URL",
            help="Schema Registry URL for --format avro|protobuf|jsonschema (else "
            "$SCHEMA_REGISTRY_URL).",
        ),
    ] = None,
) -> None:
    """Replay real data of a built-in workload into a topic."""
    from streamproc.tools.replay import produce

    if workload not in BUILTIN_WORKLOADS:
        raise _fail(
            ValueError(f"workload: unknown {workload!r}; allowed: {list(BUILTIN_WORKLOADS)}")
        )
    if not bootstrap:
        raise _fail(ValueError("no broker: pass --bootstrap or set KAFKA_BOOTSTRAP_SERVERS"))
    try:
        count = produce(
            workload,
            topic,
            bootstrap,
            partitions,
            limit,
            rate,
            transaction_size=transaction_size,
            value_format=value_format,
            registry_url=registry,
        )
    except (StreamprocError, RuntimeError, ValueError) as exc:
        raise _fail(exc) from exc
    typer.echo(f"produced {count} {workload} messages to {topic}")


@app.command("run")
def run_cmd(
    config: Annotated[
        Path | None,
        typer.Option("--config", envvar="STREAMPROC_CONFIG", help="YAML config file."),
    ] = None,
    bootstrap: Annotated[
        str | None, typer.Option("--bootstrap", help="Broker address (overrides the config).")
    ] = None,
    exit_when_idle_s: Annotated[
        float | None,
        typer.Option(min=0.0, help="Exit 0 after this many seconds with no input and no work."),
    ] = None,
) -> None:
    """Run the consumer until SIGTERM/SIGINT (or idle)."""
    from streamproc import logs
    from streamproc.config import load_config
    from streamproc.pipeline import Pipeline

    try:
        cfg = load_config(config, bootstrap=bootstrap)
        cfg.bootstrap_servers  # noqa: B018  (fails early when unset)
        logs.configure(cfg.logging.level, cfg.logging.format)
        pipeline = Pipeline(cfg)
    except StreamprocError as exc:
        raise _fail(exc) from exc
    signals = {"count": 0}

    def on_signal(signum: int, _frame: object) -> None:
        signals["count"] += 1
        if signals["count"] > 1:
            os._exit(130)  # a second signal exits at once
        pipeline.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # `kill -USR1 <pid>`: every thread's stack to stderr (a process that does not stop)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        summary = pipeline.run(exit_when_idle_s=exit_when_idle_s)
    except StreamprocError as exc:
        raise _fail(exc) from exc
    for spec in cfg.pipelines:
        metrics = pipeline.metrics
        consumed = metrics.counter_value(metrics.consumed, topic=spec.input_topic)
        produced = metrics.counter_value(metrics.produced, topic=spec.output_topic)
        dead = sum(
            metrics.counter_value(metrics.dead_lettered, topic=spec.input_topic, stage=stage)
            for stage in ("decode", "model", "encode", "produce", "callback")
        )
        typer.echo(
            f"{spec.name}: {consumed:.0f} consumed from {spec.input_topic}, {produced:.0f} "
            f"results to {spec.output_topic}, {dead:.0f} dead-lettered to {spec.dead_letter_topic}"
        )
    if summary.error:
        typer.echo(f"error: {summary.error}", err=True)
    raise typer.Exit(summary.exit_code)


@app.command("demo")
def demo_cmd(
    workloads: Annotated[
        list[str] | None,
        typer.Option("--workload", help="Workloads to run (repeatable; default: every built-in)."),
    ] = None,
    scale: Annotated[
        float, typer.Option(min=0.01, help="Multiply every message count (rates unchanged).")
    ] = 1.0,
    value_format: Annotated[
        str,
        typer.Option(
            "--format",
            help="json, or avro / protobuf / jsonschema: trades and iot schema-managed through a "
            "local Schema Registry (or $SCHEMA_REGISTRY_URL), in and out.",
        ),
    ] = "json",
) -> None:
    """Local broker + replay of real video, IoT and trade data + one consumer + report."""
    from streamproc import logs
    from streamproc.tools.demo import DEFAULT_PLAN, run_demo

    chosen = workloads or list(DEFAULT_PLAN)
    unknown = sorted(set(chosen) - set(DEFAULT_PLAN))
    if unknown:
        raise _fail(ValueError(f"--workload: unknown {unknown}; allowed: {list(DEFAULT_PLAN)}"))
    plan = {w: (max(1, round(DEFAULT_PLAN[w][0] * scale)), DEFAULT_PLAN[w][1]) for w in chosen}
    if value_format not in ("json", "avro", "protobuf", "jsonschema"):
        raise _fail(
            ValueError(f"--format: {value_format!r}; allowed: json, avro, protobuf, jsonschema")
        )
    logs.configure("warning", "console")
    try:
        report = run_demo(plan=plan, value_format=value_format)
    except StreamprocError as exc:
        raise _fail(exc) from exc
    typer.echo(report.render())
    raise typer.Exit(0 if report.ok else 1)


@app.command("bench")
def bench_cmd(
    bootstrap: Bootstrap = None,
    workloads: Annotated[
        str,
        typer.Option(help="Comma-separated workloads, in this order (default: all three)."),
    ] = "trades,iot,video",
    repetitions: Annotated[
        int, typer.Option(min=1, help="Alternating repetitions of every contender.")
    ] = 5,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help="Development: fewer serial, Quix and video messages, one round of 2-second "
            "paced runs.",
        ),
    ] = False,
) -> None:
    """The side-by-side benchmark: passthrough, the honest at-least-once floor, floor + work,
    streamproc (adaptive, fixed batch, decode processes), Quix Streams, serial, model-only;
    msg/s and process CPU-µs per message (median and range over the repetitions); end-to-end
    latency of streamproc and the floor at 10/50/80 % load."""
    from streamproc.tools.bench.runner import main as bench_main

    chosen = tuple(w.strip() for w in workloads.split(",") if w.strip())
    try:
        code = bench_main(bootstrap, chosen, repetitions, quick)
    except ValueError as exc:
        raise _fail(exc) from exc
    raise typer.Exit(code)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
