"""Operator tools, not pipeline stages.

These drive, feed and judge the pipeline from the outside; none of them runs inside a consumer::

    kafka_local.py  a local Apache Kafka broker (Maven Central jars, KRaft) for tests, the demo
                    and development (``streamproc kafka start|stop``)
    replay.py       real data of a built-in workload into a topic (``streamproc produce``)
    verify.py       a run judged from the broker: missing/duplicate results, commits, latency
    demo.py         local broker + replay + one consumer + report (``streamproc demo``)
    bench/          every contender side by side on one broker, the honest at-least-once
                    floor among them (``streamproc bench``; plots with the optional ``bench``
                    extra)

They may import the stages; no stage module (anything in ``streamproc/`` outside ``tools/``
and ``cli.py``) may import them.
"""
