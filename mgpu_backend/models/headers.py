"""What the fleet needs to know about a checkpoint before loading it, from the safetensors header alone (no weight
read, no torch): the one service of `models/` the controller and the CLI's fleet path use (a layering test says so).

- `checkpoint_facts(path)`: the transformer's family, attention heads, block count, fp8 / int8 layers and size, as a
  `protocol.fleet_rules.CheckpointFacts` — what the fleet's rules (`fleet_rules.check_fleet`) read;
- `read_header(path)`: the file's tensor names, dtypes, shapes and metadata (`Header`);
- `transformer_prefix(file)`: where the transformer's keys start, refusing a file of another model family;
- `find_component_files` / `CHECKPOINT` (from `folders.py`): which file of a folder fills which slot, by its tensor
  names; `FAMILY_NAMES`: the model families' names;
- `CheckpointError`: a file that cannot be used (the loader raises it too).

A safetensors file starts with an 8-byte little-endian header length and that many bytes of JSON (tensor name ->
dtype, shape, offsets; "__metadata__" -> strings): that is all this module reads.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..protocol.fleet_rules import CheckpointFacts
from . import keymaps
from .families import NAMES as FAMILY_NAMES
from .families import detect_family
from .folders import CHECKPOINT, find_component_files

# a key every LTX-2 audio+video transformer has (ComfyUI's detection uses the same two)
LTX_MARKER = "adaln_single.emb.timestep_embedder.linear_1.bias"
AV_MARKER = "audio_adaln_single.linear.weight"
MAX_HEADER_BYTES = 100 * 2 ** 20  # safetensors' own limit on the JSON header
_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.")
# the other components' keys in a single file (not the transformer's)
_OTHER_PREFIXES = (keymaps.VIDEO_VAE_PREFIX, keymaps.AUDIO_VAE_PREFIX, keymaps.VOCODER_PREFIX,
                   keymaps.TEXT_PROJECTION_PREFIX)
_BYTES_PER = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
              "I8": 1, "U8": 1, "BOOL": 1}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: wrong family, missing or unexpected keys, bad metadata."""


def metadata_config(metadata: dict[str, str], path) -> dict[str, Any]:
    """The parsed JSON `config` entry of a safetensors file's `metadata` ({} when absent). Raises CheckpointError
    naming `path` on invalid JSON."""
    raw = metadata.get("config")
    if raw is None:
        return {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: metadata 'config' is not valid JSON ({exc})") from exc


@dataclass(frozen=True)
class Header:
    """A safetensors file's header: `keys` (tensor names in file order), `dtypes` / `shapes` per name (safetensors'
    dtype names: "BF16", "F8_E4M3", "I8", …) and `metadata` (the string metadata; LTX-2 files keep their model
    configuration as JSON under "config")."""

    path: Path
    keys: tuple[str, ...]
    dtypes: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    metadata: dict[str, str]

    def config(self) -> dict[str, Any]:
        """The parsed JSON `config` metadata ({} when absent). Raises CheckpointError on invalid JSON."""
        return metadata_config(self.metadata, self.path)

    def nbytes(self, key: str) -> int:
        """The stored bytes of tensor `key`."""
        n = _BYTES_PER.get(self.dtypes[key], 1)
        for d in self.shapes[key]:
            n *= d
        return n


def read_header(path: str | Path) -> Header:
    """The header of the safetensors file at `path` (its first bytes only). Raises FileNotFoundError (no such file)
    or CheckpointError (not a readable safetensors file), naming the path."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER_BYTES:
                raise ValueError(f"a header of {length} bytes (over {MAX_HEADER_BYTES})")
            raw = json.loads(f.read(length))
        metadata = raw.pop("__metadata__", None) or {}
        dtypes = {k: v["dtype"] for k, v in raw.items()}
        shapes = {k: tuple(v["shape"]) for k, v in raw.items()}
        end = 8 + length + max((int(v["data_offsets"][1]) for v in raw.values()), default=0)
    except (struct.error, ValueError, KeyError, TypeError, AttributeError, IndexError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
    size = path.stat().st_size
    if size < end:  # a torn download or copy: the header names more data than the file holds
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated: its header names {end} bytes, "
                              f"the file has {size})")
    return Header(path, tuple(raw), dtypes, shapes, dict(metadata))


def transformer_prefix(file) -> str:
    """`model.diffusion_model.` for a single file, '' for a `diffusion_models/` transformer-only file. `file`: a
    `Header` or a `loader.SafetensorsFile` (anything with `keys` and `path`). Raises CheckpointError naming the file
    when it holds no LTX-2 audio+video transformer."""
    keys = set(file.keys)
    for prefix in (keymaps.TRANSFORMER_PREFIX, ""):
        if prefix + LTX_MARKER in keys:
            if prefix + AV_MARKER not in keys:
                raise CheckpointError(f"{file.path}: an LTX-Video (video-only) transformer, not an LTX-2 audio+video "
                                      f"model (no '{prefix}{AV_MARKER}')")
            return prefix
    raise CheckpointError(f"{file.path}: not an LTX-2 checkpoint (no '{keymaps.TRANSFORMER_PREFIX}{LTX_MARKER}' "
                          f"key); is it a checkpoint of another model family?")


def checkpoint_facts(path: str | Path) -> CheckpointFacts:
    """What the header of the transformer file at `path` says (`CheckpointFacts`): family, video attention heads
    (`config.transformer.num_attention_heads`, 32 when the metadata leaves it out, as the loader's default),
    transformer blocks, Linear weights stored as fp8 / int8, and the transformer's and connectors' stored bytes.
    Raises FileNotFoundError or CheckpointError (not safetensors, not an LTX-2 transformer, bad metadata), naming
    the file."""
    header = read_header(path)
    prefix = transformer_prefix(header)
    meta = header.config().get("transformer", {})
    if not isinstance(meta, dict):
        raise CheckpointError(f"{header.path}: metadata config.transformer is not a JSON object")
    own = [k for k in header.keys if k.startswith(prefix) and not k.startswith(_OTHER_PREFIXES)]
    blocks = {m.group(1) for k in own if (m := _BLOCK.match(k[len(prefix):]))}
    weights = [k for k in own if k.endswith(".weight")]
    try:
        heads = int(meta.get("num_attention_heads", 32))
    except (TypeError, ValueError):
        raise CheckpointError(f"{header.path}: metadata config.transformer.num_attention_heads="
                              f"{meta.get('num_attention_heads')!r} is not a number") from None
    return CheckpointFacts(
        path=str(header.path), family=detect_family(meta, header.keys, prefix).name, heads=heads, blocks=len(blocks),
        fp8_layers=sum(header.dtypes[k].startswith("F8_") for k in weights),
        int8_layers=sum(header.dtypes[k] == "I8" for k in weights),
        transformer_bytes=sum(header.nbytes(k) for k in own))


__all__ = ["AV_MARKER", "CHECKPOINT", "CheckpointError", "CheckpointFacts", "FAMILY_NAMES", "Header", "LTX_MARKER",
           "checkpoint_facts", "find_component_files", "read_header", "transformer_prefix"]
