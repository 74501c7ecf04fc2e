"""The ``streamproc`` command line (argument parsing only; see DESIGN.md section 6)."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from streamproc.errors import StreamprocError
from streamproc.workloads.registry import BUILTIN_WORKLOADS

if TYPE_CHECKING:
    from streamproc.tools.local_service import LocalService

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
mlflow_app = typer.Typer(
    no_args_is_help=True, help="A local MLflow tracking server with its model registry (SQLite)."
)
app.add_typer(mlflow_app, name="mlflow")
tracing_app = typer.Typer(
    no_args_is_help=True,
    help="A local trace backend: Zipkin behind an OpenTelemetry Collector (OTLP in).",
)
app.add_typer(tracing_app, name="tracing")
model_app = typer.Typer(
    no_args_is_help=True,
    help="A running pipeline's model versions (its admin endpoint on the metrics port).",
)
app.add_typer(model_app, name="model")

DEFAULT_BROKER_DIR = Path(".streamproc/kafka")
DEFAULT_REGISTRY_DIR = Path(".streamproc/registry")
DEFAULT_MLFLOW_DIR = Path(".streamproc/mlflow")
DEFAULT_TRACING_DIR = Path(".streamproc/tracing")
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


def _start_server(
    directory: Path,
    name: str,
    address_file: str,
    make: Callable[[Path], LocalService],
    last_line: str,
    stop_command: str | None = None,
) -> bool:
    """Start a local server (``make`` of the resolved ``directory``) in the background unless
    the one recorded in ``directory`` runs (says which, how to stop it: ``stop_command``, by
    default ``streamproc NAME stop --dir DIRECTORY``, and where its log is); the last line
    printed is ``last_line`` with the server's address in its ``{}``. True when one already
    ran."""
    from streamproc.tools.local_service import start_recorded

    directory = directory.resolve()
    try:
        address, server, running = start_recorded(
            directory, name, address_file, lambda: make(directory)
        )
    except StreamprocError as exc:
        raise _fail(exc) from exc
    if running is not None:
        stop_command = stop_command or f"streamproc {name} stop --dir {directory}"
        typer.echo(f"{name} server already running (pid {running}); stop it with `{stop_command}`")
    elif server is not None:
        typer.echo(f"{name} log: {server.log_path}")
    typer.echo(last_line.format(address))
    return running is not None


def _stop_server(directory: Path, name: str, label: str) -> None:
    """Stop the ``name`` server recorded in ``directory`` (says which; ``label``: its name in
    the message)."""
    from streamproc.tools.local_service import stop_recorded

    pid = stop_recorded(directory, name)
    typer.echo(
        f"no {label} recorded in {directory}" if pid is None else f"stopped {label} pid {pid}"
    )


RegistryDir = Annotated[Path, typer.Option("--dir", help="Registry state folder.")]
MlflowDir = Annotated[Path, typer.Option("--dir", help="MLflow state folder.")]
TracingDir = Annotated[
    Path, typer.Option("--dir", help="Trace backend folder (zipkin/ and collector/ below it).")
]


@registry_app.command("start")
def registry_start(directory: RegistryDir = DEFAULT_REGISTRY_DIR) -> None:
    """Start a local Schema Registry in the background (loopback, in-memory, BACKWARD
    compatibility); the last line is SCHEMA_REGISTRY_URL=..."""
    from streamproc.tools.registry_local import LocalRegistry, ensure_registry_app

    _start_server(
        directory,
        "registry",
        "url",
        lambda at: LocalRegistry(at, ensure_registry_app(), own_lifetime=False),
        "SCHEMA_REGISTRY_URL={}",
    )


@registry_app.command("stop")
def registry_stop(directory: RegistryDir = DEFAULT_REGISTRY_DIR) -> None:
    """Stop the registry started with `registry start --dir DIR`; no process is left behind."""
    _stop_server(directory, "registry", "registry")


@mlflow_app.command("start")
def mlflow_start(directory: MlflowDir = DEFAULT_MLFLOW_DIR) -> None:
    """Start a local MLflow tracking server in the background (loopback, SQLite store, artifacts
    served by the server; installs MLflow into its own environment on first use); the last line
    is export MLFLOW_TRACKING_URI=..."""
    from streamproc.tools.mlflow_local import LocalMlflow, ensure_mlflow_server

    _start_server(
        directory,
        "mlflow",
        "tracking_uri",
        lambda at: LocalMlflow(at, ensure_mlflow_server(), own_lifetime=False),
        "export MLFLOW_TRACKING_URI={}",
    )


@mlflow_app.command("stop")
def mlflow_stop(directory: MlflowDir = DEFAULT_MLFLOW_DIR) -> None:
    """Stop the MLflow server started with `mlflow start --dir DIR`; no process is left behind
    (its database and artifacts stay in DIR)."""
    _stop_server(directory, "mlflow", "MLflow server")


@tracing_app.command("start")
def tracing_start(directory: TracingDir = DEFAULT_TRACING_DIR) -> None:
    """Start a local trace backend in the background, on loopback: Zipkin (in-memory trace
    store, query API, UI) behind an OpenTelemetry Collector that takes OTLP over HTTP and gRPC.
    The first start fetches Zipkin with Maven and builds the collector with Go (minutes). The
    collector is started afresh on its previous port, pointed at the Zipkin that runs; when it
    fails, a Zipkin started now is stopped again. The last line is export
    OTEL_EXPORTER_OTLP_ENDPOINT=... OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"""
    from streamproc.tools.local_service import stop_recorded
    from streamproc.tools.tracing_local import (
        LocalCollector,
        LocalZipkin,
        claim_tracing_dir,
        ensure_collector,
        ensure_zipkin_jar,
        previous_port,
    )

    root = directory.resolve()
    try:  # everything fetched or built before either server starts
        claim_tracing_dir(root)
        jar, binary = ensure_zipkin_jar(), ensure_collector()
    except StreamprocError as exc:
        raise _fail(exc) from exc
    stop = f"streamproc tracing stop --dir {root}"
    zipkin_was_running = _start_server(
        root / "zipkin", "zipkin", "ui",
        lambda at: LocalZipkin(at, jar, own_lifetime=False), "trace UI: {}", stop,
    )  # fmt: skip
    zipkin_url = (root / "zipkin" / "ui").read_text().strip().removesuffix("/zipkin/")
    stop_recorded(root / "collector", "collector")
    port = previous_port(root / "collector" / "endpoint")
    try:
        _start_server(
            root / "collector", "collector", "endpoint",
            lambda at: LocalCollector(at, binary, zipkin_url, own_lifetime=False, port=port),
            "export OTEL_EXPORTER_OTLP_ENDPOINT={} OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf",
            stop,
        )  # fmt: skip
    except typer.Exit:
        if not zipkin_was_running:
            stop_recorded(root / "zipkin", "zipkin")
        raise


@tracing_app.command("stop")
def tracing_stop(directory: TracingDir = DEFAULT_TRACING_DIR) -> None:
    """Stop the trace backend started with `tracing start --dir DIR` (the collector, then
    Zipkin, whose traces are lost: in-memory storage); no process is left behind."""
    root = directory.resolve()
    _stop_server(root / "collector", "collector", "trace collector")
    _stop_server(root / "zipkin", "zipkin", "Zipkin server")


AdminUrl = Annotated[
    str,
    typer.Option(
        "--url",
        envvar="STREAMPROC_ADMIN_URL",
        help="The process's metrics/admin endpoint (else $STREAMPROC_ADMIN_URL).",
    ),
]

AdminToken = Annotated[
    str,
    typer.Option(
        "--token",
        envvar="STREAMPROC_ADMIN_TOKEN",
        help="admin.token (else $STREAMPROC_ADMIN_TOKEN).",
    ),
]
PipelineName = Annotated[str, typer.Argument(help="The pipeline's name (pipelines[].name).")]


@model_app.command("use")
def model_use(
    pipeline: PipelineName,
    version: Annotated[str, typer.Argument(help="A version name, latest, or an MLflow @alias.")],
    url: AdminUrl = "http://127.0.0.1:9108",
    token: AdminToken = "",
    shadow: Annotated[
        bool, typer.Option("--shadow", help="Score it in shadow beside the serving version.")
    ] = False,
    timeout_s: Annotated[float, typer.Option("--timeout-s", min=1)] = 600.0,
) -> None:
    """Load VERSION of PIPELINE's model beside the serving one and switch at the next batch
    boundary (the process stays in its consumer group); exits 1 when the version is refused
    (the serving one goes on), 2 when the endpoint refuses the call."""
    from streamproc.tools.model_admin import AdminCallFailed, use_version

    mode = "shadow" if shadow else "swap"
    if not token:
        raise _fail(ValueError("no admin token: set $STREAMPROC_ADMIN_TOKEN or pass --token"))
    try:
        answer = use_version(url, token, pipeline, version, mode, timeout_s)
    except AdminCallFailed as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1 if exc.status in (409, 422, 504) else 2) from None
    typer.echo(f"{answer['pipeline']}: version {answer['version']} {answer['done']}")


@model_app.command("drop")
def model_drop(
    pipeline: PipelineName,
    version: Annotated[str, typer.Argument(help="The shadow candidate's version.")],
    url: AdminUrl = "http://127.0.0.1:9108",
    token: AdminToken = "",
) -> None:
    """Stop scoring VERSION of PIPELINE's model in shadow and let it go (polling does not load
    it again); exits 1 when it is not the shadow candidate."""
    from streamproc.tools.model_admin import AdminCallFailed, use_version

    if not token:
        raise _fail(ValueError("no admin token: set $STREAMPROC_ADMIN_TOKEN or pass --token"))
    try:
        answer = use_version(url, token, pipeline, version, "drop")
    except AdminCallFailed as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1 if exc.status in (409, 422) else 2) from None
    typer.echo(f"{answer['pipeline']}: version {answer['version']} {answer['done']}")


@model_app.command("demo")
def model_demo(bootstrap: Bootstrap = None) -> None:
    """A model swap live: a local broker (unless --bootstrap), the iot pipeline serving
    version 1 of a model repository, a replay of the real recording, a switch to version 2
    (a fine-tuned retrain) through the admin endpoint mid-stream, and the report."""
    from streamproc import logs
    from streamproc.tools.model_demo import run_model_demo

    logs.configure("warning", "console")
    try:
        report = run_model_demo(bootstrap)
    except StreamprocError as exc:
        raise _fail(exc) from exc
    typer.echo(report.render())
    raise typer.Exit(0 if report.ok else 1)


@model_app.command("status")
def model_status(url: AdminUrl = "http://127.0.0.1:9108") -> None:
    """Print every versioned pipeline's versions and recent events (JSON)."""
    import json

    from streamproc.tools.model_admin import AdminCallFailed, models_state

    try:
        typer.echo(json.dumps(models_state(url), indent=2))
    except AdminCallFailed as exc:
        raise _fail(exc) from None


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
        typer.Option(
            min=0.0,
            help=(
                "Exit 0 after this many seconds with no input and no work, once the group's "
                "committed offset of every input partition is at its end offset (exit 1 naming "
                "the partitions left after kafka.assignment_timeout_s without progress)."
            ),
        ),
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
        outcome = summary.outcomes[spec.input_topic]
        typer.echo(
            outcome.line(spec.name, spec.input_topic, spec.output_topic, spec.dead_letter_topic)
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
    tracing: Annotated[
        bool,
        typer.Option(
            "--tracing",
            help="Trace a tenth of the batches to the local trace backend (`streamproc tracing "
            "start`; started when not running, left running) and print one trace's URL per "
            "workload.",
        ),
    ] = False,
) -> None:
    """Local broker + replay of real video, IoT and trade data + one consumer + report."""
    from streamproc import logs
    from streamproc.tools.demo import DEFAULT_PLAN, TraceBackend, run_demo

    chosen = workloads or list(DEFAULT_PLAN)
    unknown = sorted(set(chosen) - set(DEFAULT_PLAN))
    if unknown:
        raise _fail(ValueError(f"--workload: unknown {unknown}; allowed: {list(DEFAULT_PLAN)}"))
    plan = {w: (max(1, round(DEFAULT_PLAN[w][0] * scale)), DEFAULT_PLAN[w][1]) for w in chosen}
    if value_format not in ("json", "avro", "protobuf", "jsonschema"):
        raise _fail(
            ValueError(f"--format: {value_format!r}; allowed: json, avro, protobuf, jsonschema")
        )
    backend = None
    if tracing:
        tracing_start(DEFAULT_TRACING_DIR)
        root = DEFAULT_TRACING_DIR.resolve()
        ui_url = (root / "zipkin" / "ui").read_text().strip()
        backend = TraceBackend(
            (root / "collector" / "endpoint").read_text().strip(),
            ui_url,
            ui_url.removesuffix("zipkin/") + "api/v2",
        )
    logs.configure("warning", "console")
    try:
        report = run_demo(plan=plan, value_format=value_format, tracing=backend)
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
    loads: Annotated[
        str,
        typer.Option(
            help="Comma-separated paced loads, percent of the reference rate (streamproc's "
            "median msg/s, or --rate).",
        ),
    ] = "10,50,80",
    rate: Annotated[
        float | None,
        typer.Option(
            help="Reference rate of the paced runs (msg/s, = 100 %); given, only the paced "
            "runs run (no backlog contenders).",
        ),
    ] = None,
    paced_repetitions: Annotated[
        int | None,
        typer.Option(help="Paced repetitions per load (default: the workload's, 3 or 1)."),
    ] = None,
) -> None:
    """The side-by-side benchmark: passthrough, the honest at-least-once floor, floor + work,
    streamproc (adaptive, fixed batch, decode processes), Quix Streams, serial, model-only;
    msg/s and process CPU-µs per message (median and range over the repetitions); end-to-end
    latency of streamproc and the floor at 10/50/80 % load, with P50/P99 per stage."""
    from streamproc.tools.bench.runner import Paced
    from streamproc.tools.bench.runner import main as bench_main

    chosen = tuple(w.strip() for w in workloads.split(",") if w.strip())
    try:
        fractions = tuple(float(x) / 100 for x in loads.split(",") if x.strip())
        paced = Paced(fractions, rate, paced_repetitions)
        code = bench_main(bootstrap, chosen, repetitions, quick, paced)
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
