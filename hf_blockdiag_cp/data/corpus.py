"""An embedded training corpus of real documents: the running Python's standard library.

No downloads: the source files are already on every machine that runs this library. Each
top-level unit of a module (its header, i.e. docstring and imports, and every top-level
`def` / `class` with its decorators) is one document, so documents are real, self-contained
and heavy-tailed: median ≈ 480 bytes, 90th percentile ≈ 3.6k, largest ≈ 750k, close to the
13.4M-document histogram in `hf_blockdiag_cp/bench/data/doc_length_distribution.csv`. (One document per
*file*, `unit="file"`, has a median of ≈ 8k bytes: almost every 1k-token pack would then hold
a single piece of one file and block-diagonal attention would have little to do.)

Tokens are bytes: id = byte + 1, id 0 is reserved for padding, so `VOCAB_SIZE = 257`.
Files are read in sorted relative-path order and the test suites are left out, so the corpus
is deterministic for a given Python installation.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

PAD_TOKEN_ID = 0
VOCAB_SIZE = 257
UNITS = ("definition", "file")

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_TOP_LEVEL_STARTS = (b"def ", b"async def ", b"class ", b"@")


@dataclass(frozen=True)
class Document:
    source: str  # "relative/path.py:first_line"
    text: bytes


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[Path]:
    """Every non-empty `.py` file under `root` (default: the stdlib) outside test suites and site-packages, sorted."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise ValueError(f"corpus root {str(root)!r} is not a directory")
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_DIRS)
        files += [Path(directory, n) for n in names if n.endswith(".py")]
    return sorted((p for p in files if p.stat().st_size > 0), key=lambda p: p.relative_to(root).as_posix())


def split_top_level(text: bytes) -> Iterator[tuple[int, bytes]]:
    """`(first_line, chunk)` per top-level unit: a new unit starts at an unindented def/class/decorator.

    Decorators stay with the definition they decorate; blank-only chunks are dropped.
    """
    lines = text.splitlines(keepends=True)
    start, previous_decorator = 0, False
    for i, line in enumerate(lines):
        starts_unit = line.startswith(_TOP_LEVEL_STARTS)
        if starts_unit and not previous_decorator and i > start:
            chunk = b"".join(lines[start:i])
            if chunk.strip():
                yield start + 1, chunk
            start = i
        if line.strip():
            previous_decorator = line.startswith(b"@")
    chunk = b"".join(lines[start:])
    if chunk.strip():
        yield start + 1, chunk


def documents(unit: str = "definition", root: Path | None = None) -> list[Document]:
    """The corpus documents in deterministic order (see the module docstring)."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {', '.join(map(repr, UNITS))}; got {unit!r}")
    root = stdlib_root() if root is None else Path(root)
    docs = []
    for path in source_files(root):
        name = path.relative_to(root).as_posix()
        text = path.read_bytes()
        if unit == "file":
            docs.append(Document(f"{name}:1", text))
        else:
            docs += [Document(f"{name}:{line}", chunk) for line, chunk in split_top_level(text)]
    return docs


def encode_bytes(text: bytes | str) -> np.ndarray:
    """Byte-level token ids (byte + 1; 0 is padding) as int32."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32) + 1


def decode_bytes(ids) -> bytes:
    """Inverse of `encode_bytes`; padding (0) is dropped."""
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        raise ValueError(f"byte token ids must lie in [0, {VOCAB_SIZE}); got range [{arr.min()}, {arr.max()}]")
    return (arr[arr > 0] - 1).astype(np.uint8).tobytes()


def cut_documents(docs: list[Document], max_length: int) -> list[Document]:
    """`docs` with every document longer than `max_length` bytes cut into pieces of `max_length`
    (the last one shorter), each its own document (`source` + `#k`, the k-th piece): the cut
    `PackedBatchSampler(oversize="split")` makes, made up front, so packing has nothing to split."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
        raise ValueError(f"max_length must be a positive integer or None; got {max_length!r}")
    out = []
    for doc in docs:
        if len(doc.text) <= max_length:
            out.append(doc)
            continue
        out += [Document(f"{doc.source}#{k}", doc.text[start : start + max_length])
                for k, start in enumerate(range(0, len(doc.text), max_length))]
    return out


def load_corpus(unit: str = "definition", root: Path | None = None, max_documents: int | None = None,
                max_length: int | None = None):
    """The corpus as a `datasets.Dataset` with columns `input_ids` (byte tokens) and `source`.

    `max_length`: cut longer documents into pieces of at most that many tokens (`cut_documents`;
    after `max_documents`), as the examples do with their pack size: the corpus is heavy-tailed, and
    cutting is their own choice, not something packing should warn about.
    Built straight from Arrow buffers (no Python loop over tokens), in memory, no cache files.
    """
    import datasets
    import pyarrow as pa

    docs = documents(unit, root)
    if max_documents is not None:
        if isinstance(max_documents, bool) or not isinstance(max_documents, int) or max_documents <= 0:
            raise ValueError(f"max_documents must be a positive integer or None; got {max_documents!r}")
        docs = docs[:max_documents]
    if not docs:
        raise ValueError(f"the corpus under {str(root or stdlib_root())!r} holds no documents")
    if max_length is not None:
        docs = cut_documents(docs, max_length)
    lengths = np.array([len(d.text) for d in docs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = encode_bytes(b"".join(d.text for d in docs))
    offset_type = pa.int32() if offsets[-1] < 2**31 else pa.int64()
    list_type = pa.ListArray if offset_type == pa.int32() else pa.LargeListArray
    input_ids = list_type.from_arrays(pa.array(offsets, type=offset_type), pa.array(tokens))
    table = pa.table({"input_ids": input_ids, "source": pa.array([d.source for d in docs])})
    return datasets.Dataset(table)
