"""Client quotas on a real broker, set with Kafka's own ``kafka-configs`` (``ConfigCommand``).

confluent-kafka's AdminClient has no client-quota call (librdkafka 2.16), so the tests run the
tool from ``org.apache.kafka:kafka-tools`` (fetched from Maven Central once, as the broker's
container image is: ``ensure_kafka_jars(tools=True)``). A ``producer_byte_rate`` on one
``client.id`` makes the broker delay that producer's acknowledgements (it answers, then mutes
the connection for the throttle time) while every other client, the consumer included, goes on.
"""

from __future__ import annotations

import subprocess

from streamproc.tools.kafka_local import ensure_kafka_jars

TOOL = "org.apache.kafka.tools.ConfigCommand"


def set_producer_byte_rate(bootstrap: str, client_id: str, bytes_per_s: int | None) -> None:
    """Limit the produce rate of ``client_id`` to ``bytes_per_s`` (None: remove the quota).

    Raises:
        subprocess.CalledProcessError: the tool failed (its output is in the error).
    """
    libs = ensure_kafka_jars(tools=True)
    change = (
        ["--delete-config", "producer_byte_rate"]
        if bytes_per_s is None
        else ["--add-config", f"producer_byte_rate={bytes_per_s}"]
    )
    subprocess.run(
        [
            "java",
            "-Xmx256m",
            "-cp",
            f"{libs}/*",
            TOOL,
            "--bootstrap-server",
            bootstrap,
            "--alter",
            *change,
            "--entity-type",
            "clients",
            "--entity-name",
            client_id,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
