"""Your own run in one command: the getting-started page's "Your own run", run as written.

The page gives a task file (a ``dataset`` family), a reward function by dotted path and a recipe
with an llm judge that wants an API key, then the commands: the tasks' self-check, ``config
validate``, ``launch --dry-run`` and ``launch --max-versions 2``. The test writes the page's files,
points the llm judge at a local grader, and runs every command on the session's local cluster.
Checked: versions were trained, the run's recorded config has the hash ``launch`` reported, each
judge wrote rewards (the grader saw the key), the processes were written as systemd units and a
Compose file, and a role started by hand with another config is refused naming the key.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers import decode_all

from rlstream.consumers.run_log import run_manifest
from rlstream.ops.run import recorded
from rlstream.schemas import topics

pytestmark = [pytest.mark.slow, pytest.mark.unsecured_only("the grader and recipe are unsecured")]

PAGE = Path(__file__).resolve().parents[2] / "docs" / "getting-started.md"
FILES = {"json": "my-tasks.jsonl", "python": "my_rewards.py", "toml": "my-run.toml"}
DOC_GRADER = "http://127.0.0.1:8000/v1/completions"


def _section() -> dict[str, str]:
    """The fenced blocks of the page's "Your own run" section, by language."""
    text = PAGE.read_text().split("## Your own run", 1)[1].split("\n## ", 1)[0]
    return {lang: body for lang, body in re.findall(r"```(\w+)\n(.*?)```", text, re.S)}


@pytest.fixture
def grader() -> Iterator[tuple[list[str | None], str]]:
    keys: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            keys.append(self.headers.get("Authorization"))
            score = len(body["prompt"]) % 11  # varies with the answer: groups have a signal
            text = json.dumps({"score": score, "reason": "graded"})
            data = json.dumps({"choices": [{"text": text}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield keys, f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    finally:
        server.shutdown()
        server.server_close()


def test_your_own_run_as_the_page_walks_it(
    kafka, cluster_home: Path, unique_run: str, tmp_path: Path, grader
) -> None:
    keys, url = grader
    blocks = _section()
    for lang, name in FILES.items():
        (tmp_path / name).write_text(blocks[lang].replace(DOC_GRADER, url))
    assert url in (tmp_path / "my-run.toml").read_text()
    env = {k: v for k, v in os.environ.items() if k != "RLSTREAM_BOOTSTRAP"}
    exports = [line for line in blocks["bash"].splitlines() if line.startswith("export ")]
    for item in shlex.split(exports[0])[1:]:
        name, _, value = item.partition("=")
        env[name] = value.replace("$PWD", str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], os.environ.get("PYTHONPATH", "")])
    where = ["--home", str(cluster_home)]
    result = None
    commands = [line for line in blocks["bash"].splitlines() if line.startswith(".venv/bin/")]
    assert len(commands) == 4
    for line in commands:
        args = shlex.split(line)[1:]
        if args[0] == "launch":
            args += where
            if "--dry-run" not in args:
                args += ["--run", unique_run, "--json", "--out", str(tmp_path / "runs")]
                args += ["--minutes", "6", "--set", f"learner.state_dir={tmp_path / 'learner'}"]
        cmd = [sys.executable, "-m", "rlstream", *args]
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=540, env=env, cwd=tmp_path
        )
        assert out.returncode == 0, f"{line}\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        if args[0] == "launch" and "--dry-run" in args:
            assert out.stdout.count("rlstream run ") == 7
        elif args[0] == "launch":
            result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result is not None
    assert result["run"] == unique_run and result["stopped"] == "max_versions"
    assert result["versions"] >= 2

    manifest = run_manifest(kafka, unique_run)
    assert manifest is not None and manifest["status"] == "finished"
    view = recorded.recorded_view(manifest["config_json"])
    assert view is not None and recorded.config_hash(view) == result["config_hash"]

    rewards = decode_all(kafka, topics.topic_name(unique_run, "rewards"))
    by_judge: dict[str, list[dict]] = {}
    for r in rewards:
        by_judge.setdefault(r.record["judge"], []).append(r.record)
    assert set(by_judge) == {"tests", "brevity", "grader"}
    assert all(r["rationale"].endswith(" characters") for r in by_judge["brevity"])
    assert all(r.get("error") is None for r in by_judge["grader"])
    assert keys and set(keys) == {"Bearer your-key"}

    deploy = tmp_path / "runs" / unique_run / "deploy"
    assert (
        len(list(deploy.glob("*.service"))) == 7
    )  # learner, admission, 3 judges, 1 worker, scheduler
    learner_unit = (deploy / f"rlstream-{unique_run}-learner.service").read_text()
    assert "RLSTREAM_WEIGHTS_SIGNING_KEY=" in learner_unit
    assert "RestartPreventExitStatus=2" in learner_unit
    compose = json.loads((deploy / "compose.json").read_text())
    assert "RLSTREAM_WEIGHTS_SIGNING_KEY" not in compose["services"]["scheduler"]["environment"]

    recipe = str(tmp_path / "my-run.toml")
    other = [sys.executable, "-m", "rlstream", "run", "scheduler", "--run", unique_run, *where]
    other += ["--config", recipe, "--set", "group_size=8"]
    refused = subprocess.run(
        other, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "group_size: recorded 4, here 8" in refused.stderr
