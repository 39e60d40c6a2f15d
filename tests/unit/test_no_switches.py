"""No test or benchmark switches in the product: faults and delays come from the harness (a
subclass, a wrapper, an extension it installs), never from a flag the product reads."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("schemas", "producers", "consumers", "trainer", "rollout", "envs")
#: What a switch for the harness looks like in code or in the comment beside it.
SWITCHES = re.compile(
    r"fault_hook|FaultHook|\bFAULT_|_FAULT\b|RLSTREAM_TEST\b|env_latency|EnvLatency|"
    r"(?i:\b(?:tests?|benchmarks?) only\b|\bfor (?:the )?(?:tests|benchmarks)\b|\btest fault\b"
    r"|fault injected)"
)


def test_the_product_reads_no_switch_for_tests_or_benchmarks() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for folder in PRODUCT
        for path in sorted((ROOT / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if SWITCHES.search(line)
    ]
    assert not found, "switches for tests or benchmarks in the product:\n" + "\n".join(found)


def test_the_pattern_finds_the_switches_it_names() -> None:
    for line in (
        "fault_hook=None,",
        'FAULT_ENV = "X"',
        "# tests only: corrupts payloads",
        "env_latency",
    ):
        assert SWITCHES.search(line), line
    assert not SWITCHES.search("a failure after the model was touched is answered broken")
