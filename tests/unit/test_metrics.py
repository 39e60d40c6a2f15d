"""Prometheus metrics: the registry, the text exposition format, the exporter, the loop hook.

Properties asserted (prometheus_client keeps the values and writes the format; these pin what
our registry module makes of it): every exposition line follows the text format's grammar and
label values are escaped; histogram buckets are cumulative and end with +Inf == _count; counters
never go down and concurrent updates are not lost; a name registers once; the exporter serves
/metrics over HTTP and is off unless a port is given; ``LoopMetrics`` publishes exactly what the
loop's stats gained, and ``TransactionalLoop.run`` feeds it after every batch.
"""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request

import pytest

from rlstream.consumers.transactional import LoopStats
from rlstream.producers.runtime import metrics as M

# One sample line: name, optional {labels}, a value (Prometheus text format 0.0.4).
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\\\|\\"|\\n)*"'
_SAMPLE = re.compile(
    rf"^[a-zA-Z_:][a-zA-Z0-9_:]*(\{{{_LABEL}(,{_LABEL})*\}})? "
    r"(-?[0-9.e+-]+|\+Inf|-Inf|NaN)$"
)


def _check_grammar(text: str) -> dict[str, float]:
    """Assert every line is HELP, TYPE or a sample; return samples by their series text."""
    assert text.endswith("\n")
    samples = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        assert _SAMPLE.match(line), f"bad exposition line: {line!r}"
        series, value = line.rsplit(" ", 1)
        samples[series] = float(value)
    return samples


def test_exposition_grammar_labels_escaped_and_types() -> None:
    reg = M.Registry()
    c = reg.counter("rlstream_test_total", 'Things\n"done".', ("group", "kind"))
    c.labels("g1", 'a"b\\c\nd').inc(2)
    c.labels(group="g1", kind="plain").inc(1)
    g = reg.gauge("rlstream_level", "A level.")
    g.set(-3.5)
    text = reg.exposition()
    samples = _check_grammar(text)
    assert samples['rlstream_test_total{group="g1",kind="a\\"b\\\\c\\nd"}'] == 2
    assert samples['rlstream_test_total{group="g1",kind="plain"}'] == 1
    assert samples["rlstream_level"] == -3.5
    assert "# TYPE rlstream_test_total counter" in text and "# TYPE rlstream_level gauge" in text
    assert '# HELP rlstream_test_total Things\\n"done".' in text


def test_histogram_buckets_are_cumulative() -> None:
    reg = M.Registry()
    h = reg.histogram("rlstream_latency_seconds", "Latency.", ("group",), buckets=(0.1, 1.0, 5.0))
    for value in (0.05, 0.1, 0.5, 2.0, 7.0, 9.0):
        h.labels("g").observe(value)
    samples = _check_grammar(reg.exposition())
    bucket = lambda le: samples[f'rlstream_latency_seconds_bucket{{group="g",le="{le}"}}']  # noqa: E731
    assert [bucket("0.1"), bucket("1.0"), bucket("5.0"), bucket("+Inf")] == [2, 3, 4, 6]
    assert samples['rlstream_latency_seconds_count{group="g"}'] == 6
    assert samples['rlstream_latency_seconds_sum{group="g"}'] == pytest.approx(18.65)


def test_counters_only_go_up_and_concurrent_increments_are_kept() -> None:
    reg = M.Registry()
    c = reg.counter("rlstream_hits_total", "Hits.")
    assert "rlstream_hits_total 0" in reg.exposition()  # shown before the first update
    with pytest.raises(ValueError, match="non-negative"):
        c.inc(-1)

    def work() -> None:
        for _ in range(5000):
            c.inc()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reg.collectors.get_sample_value("rlstream_hits_total") == 20_000


def test_names_register_once_and_are_validated() -> None:
    reg = M.Registry()
    first = reg.counter("rlstream_x_total", "X.", ("group",))
    assert reg.counter("rlstream_x_total", "X again.", ("group",)) is first
    with pytest.raises(ValueError, match="already registered"):
        reg.gauge("rlstream_x_total", "X.", ("group",))
    with pytest.raises(ValueError, match="already registered"):
        reg.counter("rlstream_x_total", "X.", ("role",))
    for bad in ("1abc", "a-b", "a b"):
        with pytest.raises(ValueError, match="invalid metric name"):
            reg.counter(bad, "bad")
    with pytest.raises(ValueError, match="invalid label"):
        reg.counter("rlstream_y_total", "Y.", ("a-b",))
    with pytest.raises(ValueError, match="Reserved label"):
        reg.histogram("rlstream_z_seconds", "Z.", ("le",))
    with pytest.raises(ValueError, match="Incorrect label count"):
        first.labels("g", "extra")


def test_values_are_written_as_prometheus_reads_them() -> None:
    reg = M.Registry()
    g = reg.gauge("rlstream_value", "A value.", ("v",))
    values = {"three": 3.0, "quarter": 0.25, "inf": float("inf"), "ninf": float("-inf")}
    for name, value in {**values, "nan": float("nan")}.items():
        g.labels(name).set(value)
    text = reg.exposition()
    samples = _check_grammar(text)
    for name, value in values.items():
        assert samples[f'rlstream_value{{v="{name}"}}'] == value
    assert 'rlstream_value{v="inf"} +Inf' in text and 'rlstream_value{v="ninf"} -Inf' in text
    assert 'rlstream_value{v="nan"} NaN' in text


def test_exporter_serves_metrics_over_http() -> None:
    reg = M.Registry()
    reg.counter("rlstream_served_total", "Served.").inc(7)
    exporter = M.MetricsExporter(reg, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(exporter.url, timeout=10) as resp:
            assert resp.headers["Content-Type"] == M.CONTENT_TYPE
            assert _check_grammar(resp.read().decode())["rlstream_served_total"] == 7
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(exporter.url.replace("/metrics", "/nope"), timeout=10)
        assert err.value.code == 404
    finally:
        exporter.stop()


def test_exporter_port_comes_from_argument_or_environment() -> None:
    assert M.metrics_port(None, {}) == 0
    assert M.metrics_port(None, {M.PORT_ENV: " 9464 "}) == 9464
    assert M.metrics_port(9100, {M.PORT_ENV: "9464"}) == 9100
    for bad in ("http", "70000"):
        with pytest.raises(ValueError, match=M.PORT_ENV):
            M.metrics_port(None, {M.PORT_ENV: bad})
    assert M.start_exporter(0) is None  # 0 = off


def test_loop_metrics_publish_what_the_stats_gained() -> None:
    reg = M.Registry()
    lm = M.LoopMetrics("rlstream.r1.judge.tests", reg)
    stats = LoopStats()
    lm.observe(stats)  # an idle poll publishes nothing
    for i in range(1, 6):
        stats.batches, stats.records, stats.outputs = i, 10 * i, 12 * i
        stats.last_batch_s = 0.02 * i
        lm.observe(stats)
        lm.observe(stats)  # observing twice without progress adds nothing
    stats.aborts, stats.dead_letters, stats.extra = 2, 1, {"pending_groups": 4.0}
    lm.observe(stats)
    g = '{group="rlstream.r1.judge.tests"}'
    samples = _check_grammar(reg.exposition())
    assert samples[f"rlstream_loop_records_total{g}"] == 50
    assert samples[f"rlstream_loop_outputs_total{g}"] == 60
    assert samples[f"rlstream_loop_batches_total{g}"] == 5
    assert samples[f"rlstream_loop_aborts_total{g}"] == 2
    assert samples[f"rlstream_loop_dead_letters_total{g}"] == 1
    assert samples[f"rlstream_loop_batch_seconds_count{g}"] == 5
    assert samples[f"rlstream_loop_batch_seconds_sum{g}"] == pytest.approx(0.3)
    assert samples['rlstream_loop_stat{group="rlstream.r1.judge.tests",name="pending_groups"}'] == 4


def test_transactional_loop_run_feeds_its_metrics_after_every_batch() -> None:
    from rlstream.consumers.consumer import Stopper
    from rlstream.consumers.transactional import LoopStats, TransactionalLoop

    seen: list[int] = []
    stopper = Stopper()
    loop = TransactionalLoop.__new__(TransactionalLoop)  # no Kafka: only run() is exercised
    loop.stats = LoopStats()

    def run_once() -> int:
        loop.stats.batches += 1
        loop.stats.records += 3
        if loop.stats.batches == 4:
            stopper.stop()
        return 3

    class Recorder:
        def observe(self, stats: LoopStats) -> None:
            seen.append(stats.records)

    loop.run_once, loop.close, loop.metrics = run_once, lambda: None, Recorder()
    loop.run(stopper)
    assert seen == [3, 6, 9, 12]


def test_a_service_registry_carries_the_process_metrics() -> None:
    samples = _check_grammar(M.Registry(process=True).exposition())
    assert samples["process_cpu_seconds_total"] > 0
    assert samples["process_resident_memory_bytes"] > 0
    assert any(s.startswith("python_info{") for s in samples)
    assert "process_cpu_seconds_total" not in M.Registry().exposition()
