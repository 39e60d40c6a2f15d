"""librdkafka's own log lines go to the Python logger of every client made from
``KafkaSettings``, never straight to the process's stderr (where they would land between a
command's progress lines); a role or the demo sends that logger where it wants it."""

from __future__ import annotations

import socket
import subprocess
import sys


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SCRIPT = """
import logging, sys
from rlstream.producers.client.producer import make_producer
from rlstream.producers.client.settings import KafkaSettings
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("rlstream.librdkafka").addHandler(Keep())
producer = make_producer(KafkaSettings(bootstrap_servers="127.0.0.1:{port}"))
for _ in range(20):
    producer.poll(0.1)
    if any("Connection refused" in line for line in lines):
        break
print(sum("Connection refused" in line for line in lines))
"""


def test_librdkafka_lines_reach_the_logger_and_not_stderr() -> None:
    code = SCRIPT.format(port=_closed_port())
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= 1, out.stdout  # the refused connection was logged ...
    assert "Connection refused" not in out.stderr and "|FAIL|" not in out.stderr, out.stderr


def test_log_librdkafka_to_replaces_the_handlers_and_keeps_the_lines_apart() -> None:
    import logging

    from rlstream.producers.client.settings import LIBRDKAFKA_LOGGER, log_librdkafka_to

    first, second = logging.NullHandler(), logging.NullHandler()
    log_librdkafka_to(first)
    log_librdkafka_to(second, logging.WARNING)
    log = logging.getLogger(LIBRDKAFKA_LOGGER)
    assert log.handlers == [second] and log.level == logging.WARNING and not log.propagate
