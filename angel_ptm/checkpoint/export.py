"""Consolidated weights out of a checkpoint: one safetensors file with `model.state_dict()`'s names.

    export_weights("run/checkpoints/step-100", "out/model.safetensors", dtype=torch.bfloat16)
    angel-ptm export run/checkpoints/step-100 -o out/model.safetensors

Needs no model and no engine: the checkpoint records each state_dict key and the tensor that holds it (a tied
weight's second name points at the first's tensor). The weights are the fp32 master where one was saved (mixed
precision, staleness 1), else the parameters. The file is written streaming, one tensor in memory at a time (its
header first, from the checkpoint's metadata), into a temporary name, fsynced and renamed. The safetensors format
is small (an 8-byte header length, a JSON header, the raw bytes), so it is written here: the `safetensors` package
can only save tensors that are all in memory at once. Where the model was a HuggingFace model (it had a `config`
with `to_dict`), its config.json is written beside the file, so `from_pretrained(out_dir)` loads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from angel_ptm.checkpoint.storage import CheckedReader, fsync_dir
from angel_ptm.errors import CheckpointCorruptError, CheckpointError

ENGINE = "angel_ptm.engine"
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}


def read_object(reader: CheckedReader, fqn: str):
    """A bytes item of the checkpoint (checked), unpickled."""
    import io

    metadata = reader.read_metadata()
    info = metadata.storage_data.get(MetadataIndex(fqn))
    if info is None:
        raise CheckpointCorruptError(f"checkpoint {reader.path}: no '{fqn}' record", str(reader.path))
    return torch.load(io.BytesIO(reader.item(info)), weights_only=False)


def read_tensor(reader: CheckedReader, fqn: str) -> torch.Tensor:
    """Tensor `fqn` whole, from every chunk the ranks wrote (each checked)."""
    import io

    metadata = reader.read_metadata()
    md = metadata.state_dict_metadata[fqn]
    out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    for chunk in md.chunks:
        info = metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
        piece = torch.load(io.BytesIO(reader.item(info)), weights_only=True)
        out[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = piece
    return out


def export_weights(checkpoint: str | os.PathLike, output: str | os.PathLike, dtype: torch.dtype | None = None) -> dict:
    """Write the checkpoint's weights to `output` (.safetensors); floating tensors cast to `dtype` if given.
    Returns {"tensors", "bytes", "path", "config"}."""
    checkpoint, output = Path(checkpoint), Path(output).expanduser().absolute()
    reader = CheckedReader(checkpoint)
    metadata = reader.read_metadata()
    record = read_object(reader, ENGINE)
    keys = record.get("state_dict_keys")
    if not keys:
        raise CheckpointError(f"export: {checkpoint} does not record the model's state_dict names (saved by an older "
                              f"angel-ptm)", str(checkpoint))
    saved = metadata.state_dict_metadata
    plan = []  # (state_dict key, checkpoint fqn, shape, dtype written)
    for key, kind, source in keys:
        candidates = (f"buffer.{source}",) if kind == "buffer" else (f"master.{source}", f"param.{source}")
        fqn = next((f for f in candidates if f in saved), None)
        if fqn is None or not isinstance(saved[fqn], TensorStorageMetadata):
            raise CheckpointCorruptError(f"export: {checkpoint} holds no tensor for '{key}'", str(checkpoint))
        md = saved[fqn]
        out_dtype = dtype if dtype is not None and md.properties.dtype.is_floating_point else md.properties.dtype
        if out_dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"export: '{key}' has dtype {out_dtype}, which safetensors cannot hold")
        plan.append((key, fqn, tuple(md.size), out_dtype))
    header, offset = {}, 0
    for key, _fqn, shape, out_dtype in plan:
        nbytes = torch.Size(shape).numel() * out_dtype.itemsize
        header[key] = {"dtype": SAFETENSORS_DTYPES[out_dtype], "shape": list(shape), "data_offsets": [offset,
                                                                                                     offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt", "source": str(checkpoint), "steps": str(record.get("steps_done"))}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    tmp = output.with_name(output.name + ".tmp")
    try:
        if output.is_dir():
            raise CheckpointError(f"export: {output} is a directory: name the .safetensors file to write", str(output))
        output.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for _key, fqn, _shape, out_dtype in plan:
                tensor = read_tensor(reader, fqn).to(out_dtype).contiguous()
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, output)
        config = record.get("hf_config")
        if config is not None:
            (output.parent / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        fsync_dir(output.parent)
    except OSError as err:
        _drop(tmp)
        raise CheckpointError(f"export: cannot write {err.filename or output}: {err.strerror}", str(output)) from None
    except BaseException:
        _drop(tmp)  # (a corrupt checkpoint, Ctrl-C: no partial file left behind)
        raise
    finally:
        reader.close()
    return {"tensors": len(plan), "bytes": output.stat().st_size, "path": output, "config": config is not None}


def _drop(tmp: Path) -> None:
    """The partial file gone, if there is one (under a path that cannot hold it, there is none)."""
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)
