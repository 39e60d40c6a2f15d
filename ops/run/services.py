"""The run's HTTP services as processes a driver starts and stops (``rlstream serve feedback``,
``rlstream serve policy``): the demo's editor users and the chaos driver both use them. Each is
up once its ``/healthz`` answers 200, logs to ``folder/LABEL.log``, is stopped by its own pid,
and is reached on 127.0.0.1 only (``post``: no proxy)."""

from __future__ import annotations

import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlstream.producers.client.settings import KafkaSettings


def kill9(pid: int, timeout: float = 10.0) -> None:
    """SIGKILL one process (by pid) and wait until it is gone (reaped, or a zombie its parent
    will reap)."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            pass
        stat = Path(f"/proc/{pid}/stat")
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return
        except (OSError, IndexError):
            return  # gone
        time.sleep(0.1)


@dataclass
class Service:
    """An HTTP service of the run (``rlstream serve ...``) as a process the driver started, up
    once its ``/healthz`` answers 200, logging to ``folder/LABEL.log``; ``restart`` kills it
    with SIGKILL and starts it again on the same port."""

    run: str
    settings: KafkaSettings
    folder: Path
    label: str = "service"
    port: int = 0
    proc: Any = None
    env: dict[str, str] = field(default_factory=dict)  # added to its environment (run keys)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The ``rlstream serve`` arguments after ``serve``, port and bootstrap added by start."""
        raise NotImplementedError

    def start(self, timeout: float = 180.0) -> Service:
        import subprocess
        import sys

        from rlstream.producers.runtime.ports import free_port

        self.port = self.port or free_port()
        cmd = [sys.executable, "-m", "rlstream", "serve", *self.command()]
        cmd += ["--port", str(self.port), "--bootstrap", self.settings.bootstrap_servers]
        log = self.folder / f"{self.label}.log"
        with open(log, "ab") as out:
            env = {**os.environ, **self.env}
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if _get(f"{self.url}/healthz") == 200:
                return self
            time.sleep(0.5)
        raise RuntimeError(f"{self.label} did not come up; see {log}")

    def restart(self) -> None:
        kill9(self.proc.pid)
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except Exception:
                self.proc.kill()
                self.proc.wait()


@dataclass
class FeedbackProcess(Service):
    """``rlstream serve feedback`` of the run with one HMAC key (id ``k1``)."""

    label: str = "feedback"
    key: bytes = b""

    def command(self) -> list[str]:
        config = self.folder / "feedback.toml"
        config.write_text(
            f'[serve.feedback]\nhmac_keys = {{ k1 = "{self.key.decode()}" }}\n'
            f'user_id_salt = "{self.key.hex()}"\n'
        )
        config.chmod(0o600)
        return ["feedback", "--run", self.run, "--service-config", str(config)]


@dataclass
class PolicyService(Service):
    """``rlstream serve policy`` of the run (its recipe given by ``recipe``: ``--config`` and
    ``--set`` arguments): following the run's weight stream, or with ``push_token`` serving
    only versions pushed with that token into ``folder/LABEL-pushed``; completions take
    ``api_token`` (``auth``) or the push token."""

    label: str = "policy"
    recipe: tuple[str, ...] = ()
    push_token: str | None = None
    api_token: str = field(default_factory=lambda: secrets.token_hex(16))

    def command(self) -> list[str]:
        api = self._token_file("api", self.api_token)
        cmd = ["policy", "--run", self.run, *self.recipe, "--api-token-file", str(api)]
        if self.push_token is None:
            return cmd
        token = self._token_file("token", self.push_token)
        pushed = self.folder / f"{self.label}-pushed"
        pushed.mkdir(exist_ok=True)
        return [
            *cmd,
            "--weights",
            "push",
            "--push-token-file",
            str(token),
            "--push-dir",
            str(pushed),
        ]

    def _token_file(self, suffix: str, token: str) -> Path:
        path = self.folder / f"{self.label}.{suffix}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(token)
        return path

    @property
    def auth(self) -> dict[str, str]:
        """The header a completion request to this server carries."""
        return {"Authorization": f"Bearer {self.api_token}"}


def _opener() -> Any:
    import urllib.request

    return urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 only


def _get(url: str) -> int:
    import urllib.error

    try:
        with _opener().open(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def post(
    url: str, body: bytes, headers: dict[str, str], timeout: float = 30.0
) -> tuple[int, dict[str, Any] | None]:
    """POST to a service of the run on 127.0.0.1 (no proxy): the status (0 when nothing
    answered) and the answer's JSON object (None when it is not one)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, body, headers, method="POST")
    try:
        with _opener().open(request, timeout=timeout) as r:
            return int(r.status), _json_object(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), _json_object(e.read())
    except OSError:
        return 0, None


def _json_object(raw: bytes) -> dict[str, Any] | None:
    import json

    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _post(url: str, body: bytes, headers: dict[str, str]) -> int:
    return post(url, body, headers)[0]
