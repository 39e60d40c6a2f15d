"""Kafka jars from Maven Central, and Toxiproxy (the WAN link, ``ops.cluster.wan``) built with
Go, each resolved once into a per-user cache.

`ops/kafka/pom.xml` lists the artifacts (broker, MirrorMaker 2, tools, log4j2 with the slf4j 1.7
binding). `mvn dependency:copy-dependencies` copies them and their dependencies into
``$RLSTREAM_CACHE/kafka-<version>/libs`` (default ``~/.cache/rlstream``). A marker file is written
only after a complete copy, so an interrupted download is redone, never half used.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from rlstream.schemas.errors import SetupError

TOXIPROXY = "toxiproxy-server"
TOXIPROXY_MODULE = "github.com/Shopify/toxiproxy/v2/cmd/server"
TOXIPROXY_VERSION = "v2.5.0"
GO_PLACES = ("/usr/local/go/bin/go", "/usr/lib/go/bin/go")  # where Go's installers put it
POM = Path(__file__).resolve().parent.parent / "kafka" / "pom.xml"


def kafka_version() -> str:
    match = re.search(r"<kafka.version>([^<]+)</kafka.version>", POM.read_text())
    assert match, f"no kafka.version in {POM}"
    return match.group(1)


def cache_root() -> Path:
    return Path(os.environ.get("RLSTREAM_CACHE", Path.home() / ".cache" / "rlstream"))


def java_binary() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if not found:
        raise SetupError(
            "Java 17 or newer is needed to run Kafka: install a JDK (e.g. `apt-get install "
            "openjdk-17-jre-headless`) or set JAVA_HOME."
        )
    return found


#: The JVM's collector and compilers for every JVM the launcher starts (brokers, MirrorMakers,
#: the storage tool): Kafka reads from the page cache and writes through it, so the heap holds
#: only metadata and request buffers, and few compiler and GC threads suit a small machine.
JVM_PERFORMANCE_DEFAULT = (
    "-XX:+UseG1GC",
    "-XX:MaxDirectMemorySize=256m",
    "-XX:CICompilerCount=2",
    "-XX:ParallelGCThreads=2",
    "-XX:ConcGCThreads=1",
)


def jvm_performance_options() -> list[str]:
    """``$KAFKA_JVM_PERFORMANCE_OPTS`` when set (the variable Kafka's own start scripts read, and
    like them it replaces the defaults: e.g. the test suite's short-lived brokers run the serial
    collector and the client compiler only, see tests/conftest.py), else
    ``JVM_PERFORMANCE_DEFAULT``."""
    chosen = os.environ.get("KAFKA_JVM_PERFORMANCE_OPTS", "").split()
    return chosen or list(JVM_PERFORMANCE_DEFAULT)


def libs_dir() -> Path:
    """The directory holding every Kafka jar; resolves it with Maven on first use."""
    target = cache_root() / f"kafka-{kafka_version()}" / "libs"
    marker = target.parent / ".complete"
    if marker.exists():
        return target
    mvn = shutil.which("mvn")
    if not mvn:
        raise SetupError(
            "Maven is needed once to fetch Kafka from Maven Central: `apt-get install maven`, "
            "or point rlstream at an existing cluster with RLSTREAM_BOOTSTRAP."
        )
    staging = target.parent / "libs.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        mvn,
        "-q",
        "-B",
        "-f",
        str(POM),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={staging}",
        "-DincludeScope=runtime",
    ]
    print(
        f"fetching Apache Kafka {kafka_version()} jars from Maven Central into {target} ...",
        flush=True,
    )
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise SetupError(f"Maven could not fetch the Kafka jars:\n{tail}")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    marker.write_text(kafka_version())
    return target


def classpath() -> str:
    return str(libs_dir() / "*")


def toxiproxy_binary() -> Path:
    """The toxiproxy server, installed on first use with ``go install`` into the cache."""
    target = cache_root() / f"toxiproxy-{TOXIPROXY_VERSION}" / TOXIPROXY
    if target.exists():
        return target
    go = shutil.which("go") or next((g for g in GO_PLACES if Path(g).exists()), None)
    if not go:
        raise SetupError(
            "the Go toolchain is needed once to build Toxiproxy for a WAN link "
            "(https://go.dev/doc/install, or `apt-get install golang`)"
        )
    staging = target.parent / "bin.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    print(f"building Toxiproxy {TOXIPROXY_VERSION} with go install into {target} ...", flush=True)
    proc = subprocess.run(
        [go, "install", f"{TOXIPROXY_MODULE}@{TOXIPROXY_VERSION}"],
        capture_output=True,
        text=True,
        env={**os.environ, "GOBIN": str(staging)},
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise SetupError(f"go install of Toxiproxy failed:\n{tail}")
    (staging / "server").rename(target)
    shutil.rmtree(staging, ignore_errors=True)
    return target
