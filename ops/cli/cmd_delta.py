"""``rlstream delta encode|apply|inspect``: weight deltas as files, outside Kafka.

- ``encode --old A --new B --out D`` writes D, the delta from A to B (``--keyframe`` and no
  ``--old`` for a full snapshot);
- ``apply --old A --delta D --out C`` decodes D against A, verifies every checksum and hash,
  and only then writes C (bit-exact B);
- ``inspect D`` lists per tensor the changed fraction, encoding and sizes, and checks the
  chunk checksums.

State files are torch state dicts (``.pt``), numpy archives (``.npz``), safetensors files
(``.safetensors``) or Hugging Face model directories (every ``*.safetensors`` in the directory,
shards included), chosen by extension. ``apply --out DIR`` writes ``DIR/model.safetensors`` and,
when ``--old`` is a directory, copies its other files (``config.json``, tokenizer files) beside
it, so DIR is a model directory ``from_pretrained`` loads.
numpy has no bfloat16/float8: in ``.npz`` files those tensors are stored as their bit
patterns (uint16/uint8) and an entry ``__rlstream_dtypes__`` (JSON ``{name: dtype}``) restores
the tag. D is the single-file container of ``rlstream.schemas.deltacodec.file``.

Exit codes: 0 done; 1 refused (wrong base, damaged delta, failed verification: nothing is
written); 2 unusable input (missing file, unknown extension, not a state dict).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Any

from rlstream.schemas.errors import RlstreamError

DTYPES_KEY = "__rlstream_dtypes__"
REFUSED, UNUSABLE = 1, 2


class UsageError(RlstreamError):
    """An input the tool cannot use (exit code 2)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "delta",
        help="encode, apply and inspect lossless weight deltas (files)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    sub = parser.add_subparsers(dest="delta_action", metavar="ACTION")
    enc = sub.add_parser("encode", help="write the delta (or keyframe) from --old to --new")
    enc.add_argument(
        "--old", type=Path, help="base state (.pt/.npz/.safetensors/HF dir); omit with --keyframe"
    )
    enc.add_argument(
        "--new", type=Path, required=True, help="new state (.pt/.npz/.safetensors/HF dir)"
    )
    enc.add_argument("--out", type=Path, required=True, help="delta file to write")
    enc.add_argument("--keyframe", action="store_true", help="full snapshot, no base")
    enc.add_argument("--base-version", type=int, default=0, help="version of --old")
    enc.add_argument("--version", type=int, default=None, help="version of --new (base + 1)")
    enc.add_argument("--max-chunk-bytes", type=int, default=900_000, help="chunk size limit")
    enc.set_defaults(func=_encode)
    app = sub.add_parser("apply", help="decode --delta against --old, verify, write --out")
    app.add_argument(
        "--old",
        type=Path,
        help="base state (.pt/.npz/.safetensors/HF dir); not needed for keyframes",
    )
    app.add_argument("--delta", type=Path, required=True, help="delta file")
    app.add_argument(
        "--out",
        type=Path,
        required=True,
        help="state to write (.pt/.npz/.safetensors, or a directory)",
    )
    app.set_defaults(func=_apply)
    ins = sub.add_parser("inspect", help="per-tensor changes, encodings and sizes of a delta")
    ins.add_argument("delta", type=Path, help="delta file")
    ins.add_argument("--json", action="store_true", help="print the manifest as JSON")
    ins.set_defaults(func=_inspect)
    warm = sub.add_parser(
        "warm",
        help="compile the codec's numba kernels into numba's cache (a set-up step; fast after)",
    )
    warm.set_defaults(func=_warm)
    parser.set_defaults(func=lambda _args: _usage(parser))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return UNUSABLE


def _guarded(action: Any, args: argparse.Namespace) -> int:
    """Run an action, turning codec refusals and unusable inputs into exit codes."""
    from rlstream.schemas.deltacodec import DeltaError

    try:
        return int(action(args))
    except DeltaError as exc:
        print(f"refused: {type(exc).__name__}: {exc}", file=sys.stderr)
        return REFUSED
    except (UsageError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return UNUSABLE


def _encode(args: argparse.Namespace) -> int:
    return _guarded(_encode_action, args)


def _apply(args: argparse.Namespace) -> int:
    return _guarded(_apply_action, args)


def _inspect(args: argparse.Namespace) -> int:
    return _guarded(_inspect_action, args)


def _warm(args: argparse.Namespace) -> int:
    import time

    from rlstream.schemas.deltacodec import compile_kernels

    print(
        "delta codec: compiling its kernels (or loading them from numba's cache) ...",
        file=sys.stderr,
    )
    started = time.perf_counter()
    used = compile_kernels()
    took = time.perf_counter() - started
    print(f"delta codec: kernels ready in {took:.1f} s ({', '.join(used)})", file=sys.stderr)
    return 0


def _encode_action(args: argparse.Namespace) -> int:
    from rlstream.schemas import deltacodec
    from rlstream.schemas.deltacodec import file as delta_file

    if args.keyframe == (args.old is not None):
        raise UsageError("give --old (delta) or --keyframe (snapshot), not both or neither")
    new = load_state(args.new)
    version = args.version if args.version is not None else args.base_version + 1
    if args.keyframe:
        enc = deltacodec.encode_keyframe(new, version=version, max_chunk_bytes=args.max_chunk_bytes)
    else:
        enc = deltacodec.encode_delta(
            load_state(args.old),
            new,
            version=version,
            base_version=args.base_version,
            max_chunk_bytes=args.max_chunk_bytes,
        )
    args.out.write_bytes(delta_file.pack(enc))
    m = enc.manifest
    print(
        f"wrote {args.out}: {m['kind']} v{m['version']}"
        + (f" against v{m['base_version']}" if m["base_version"] is not None else "")
        + f", {len(m['tensors'])} tensors, {len(m['chunks'])} chunks,"
        f" {m['raw_bytes']:,} -> {m['encoded_bytes']:,} bytes ({enc.ratio:.1f}x)"
    )
    return 0


def _apply_action(args: argparse.Namespace) -> int:
    from rlstream.schemas import deltacodec
    from rlstream.schemas.deltacodec import file as delta_file

    enc = delta_file.unpack(_read(args.delta))
    kind = enc.manifest.get("kind")
    if kind == "delta" and args.old is None:
        raise UsageError(f"{args.delta} is a delta: --old (its base state) is required")
    base = load_state(args.old) if args.old is not None and kind == "delta" else None
    state = deltacodec.decode(enc.manifest, enc.chunks, base)
    save_state(args.out, state, like=args.old)
    print(
        f"wrote {args.out}: v{enc.manifest['version']}, {len(state)} tensors,"
        f" verified (state hash {enc.manifest['state_hash']})"
    )
    return 0


def _inspect_action(args: argparse.Namespace) -> int:
    from rlstream.schemas import deltacodec
    from rlstream.schemas.deltacodec import file as delta_file

    enc = delta_file.unpack(_read(args.delta))
    m = enc.manifest
    deltacodec.validate_manifest(m)
    bad = []
    for i, payload in enumerate(enc.chunks):
        try:
            deltacodec.verify_chunk(m, i, payload)
        except deltacodec.ChunkCorrupt as exc:
            bad.append(str(exc))
    if args.json:
        print(json.dumps(m, indent=1))
    else:
        for line in inspect_lines(m):
            print(line)
    for problem in bad:
        print(f"corrupt: {problem}", file=sys.stderr)
    if len(enc.chunks) != len(m["chunks"]):
        bad.append("chunk count")
        print(
            f"corrupt: {len(enc.chunks)} chunks, manifest lists {len(m['chunks'])}", file=sys.stderr
        )
    return REFUSED if bad else 0


def inspect_lines(m: dict[str, Any]) -> list[str]:
    """Human summary of a manifest: one line per tensor, then the totals."""
    base = f" against v{m['base_version']}" if m["base_version"] is not None else ""
    lines = [
        f"{m['kind']} v{m['version']}{base}: {len(m['tensors'])} tensors, "
        f"{len(m['chunks'])} chunks (max {m['max_chunk_bytes']:,} bytes each)",
        f"{'tensor':40s} {'dtype':>9s} {'shape':>16s} {'changed':>9s} {'encoding':>16s}"
        f" {'raw':>12s} {'encoded':>11s} {'ratio':>8s}",
    ]
    for t in m["tensors"]:
        numel = max(1, _numel(t["shape"]))
        lines.append(
            f"{t['name'][:40]:40s} {t['dtype']:>9s} {'x'.join(map(str, t['shape'])) or '()':>16s}"
            f" {t['changed'] / numel:>9.4%} {t['encoding'][:16]:>16s} {t['raw_bytes']:>12,}"
            f" {t['encoded_bytes']:>11,} {t['raw_bytes'] / max(1, t['encoded_bytes']):>7.1f}x"
        )
    changed = sum(t["changed"] for t in m["tensors"])
    numel = max(1, sum(_numel(t["shape"]) for t in m["tensors"]))
    lines.append(
        f"total: {changed:,} of {numel:,} elements changed ({changed / numel:.4%}),"
        f" {m['raw_bytes']:,} -> {m['encoded_bytes']:,} bytes"
        f" ({m['raw_bytes'] / max(1, m['encoded_bytes']):.1f}x), state {m['state_hash']}"
    )
    return lines


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _read(path: Path) -> bytes:
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    return path.read_bytes()


def load_state(path: Path) -> dict[str, Any]:
    """A ``.pt`` state dict, ``.npz`` archive, ``.safetensors`` file or HF model directory as
    ``{name: TensorBits}``."""
    from rlstream.schemas.deltacodec import TensorBits, from_torch

    if path.is_dir():
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise UsageError(f"{path}: a directory without *.safetensors files")
        state: dict[str, Any] = {}
        for shard in shards:
            part = _load_safetensors(shard)
            if state.keys() & part.keys():
                raise UsageError(f"{shard}: repeats tensors of another shard")
            state.update(part)
        return state
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    if path.suffix == ".safetensors":
        return _load_safetensors(path)
    if path.suffix == ".pt":
        import torch

        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for a bad file
            raise UsageError(f"{path}: not a torch state dict ({exc})") from exc
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise UsageError(f"{path}: expected a flat dict of tensors")
        return from_torch(obj)
    if path.suffix == ".npz":
        import numpy as np

        try:
            with np.load(path, allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
        except (ValueError, OSError) as exc:
            raise UsageError(f"{path}: not a numpy archive ({exc})") from exc
        tags = json.loads(str(arrays.pop(DTYPES_KEY))) if DTYPES_KEY in arrays else {}
        try:
            return {k: TensorBits.from_numpy(a, tags.get(k)) for k, a in arrays.items()}
        except ValueError as exc:
            raise UsageError(f"{path}: {exc}") from exc
    raise UsageError(f"{path}: unknown state format (use .pt, .npz, .safetensors or a directory)")


def _load_safetensors(path: Path) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from rlstream.schemas.deltacodec import from_torch

    try:
        return from_torch(load_file(str(path), device="cpu"))
    except (SafetensorError, OSError, ValueError) as exc:
        raise UsageError(f"{path}: not a safetensors file ({exc})") from exc


def save_state(path: Path, state: dict[str, Any], like: Path | None = None) -> None:
    """Write ``{name: TensorBits}`` as ``.pt``, ``.npz`` or ``.safetensors`` (by extension), or
    as ``path/model.safetensors`` when ``path`` has no extension or is a directory (with the
    other files of the directory ``like``, when it is one: config, tokenizer)."""
    from rlstream.schemas.deltacodec import BITS_ONLY_DTYPES, to_torch

    if path.is_dir() or not path.suffix:
        path.mkdir(parents=True, exist_ok=True)
        if like is not None and like.is_dir():
            for extra in like.iterdir():
                if (
                    extra.is_file()
                    and extra.suffix != ".safetensors"
                    and extra.name != "model.safetensors.index.json"
                ):
                    shutil.copyfile(extra, path / extra.name)
        path = path / "model.safetensors"
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in to_torch(state).items()}, str(path))
    elif path.suffix == ".pt":
        import torch

        torch.save(to_torch(state), path)
    elif path.suffix == ".npz":
        import numpy as np

        arrays = {k: t.to_numpy() for k, t in state.items()}
        tags = {k: t.dtype for k, t in state.items() if t.dtype in BITS_ONLY_DTYPES}
        if tags:
            arrays[DTYPES_KEY] = np.array(json.dumps(tags))
        # What np.savez does, minus its keyword API (a tensor may be called "file").
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
            for name, array in arrays.items():
                with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, array, allow_pickle=False)
    else:
        raise UsageError(
            f"{path}: unknown state format (use .pt, .npz, .safetensors or a directory)"
        )
