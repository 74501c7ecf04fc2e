"""``streamproc bench``: every contender on the same broker, the same pre-produced input and the
same model, in one run, reported as medians, ranges and ratios.

Modules, in the order a run uses them::

    runner.py       the plan per workload, alternating repetitions, paced runs, ``main``
    child.py        one contender run in a process of its own (forkserver), its outcome
    contenders.py   passthrough, serial, model-only, streamproc, Quix Streams; the bench config
    floor.py        the honest at-least-once floor and "floor + work" (one thread)
    cpu.py          process and per-thread CPU time from /proc, sampled
    measure.py      LogAppendTime topics, throughput, end-to-end latency, median and range
    report.py       rows, the printed table, the plots

This package imports nothing itself: ``benchmarks/quix_app.py`` runs in Quix Streams' own
environment and imports only :mod:`streamproc.tools.bench.cpu`. The method is described in
docs/benchmarks.md.
"""
