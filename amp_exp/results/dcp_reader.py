"""Reading torch.distributed.checkpoint (DCP) directories without running code from them.

DCP unpickles two things with Python's full unpickler, which runs whatever a file asks for: the
``.metadata`` file (``FileSystemReader.read_metadata``, plain ``pickle.load``) and every
non-tensor value in the ``.distcp`` shards (``DefaultLoadPlanner.load_bytes``,
``torch.load(weights_only=False)``). A checkpoint directory is data that may come from anyone, so
here the metadata is unpickled with only DCP's own metadata classes and the torch and Python
basics they hold, and every non-tensor value must load with ``weights_only=True``: when a resume
chooses its checkpoint (``check_checkpoint``: an unsafe one is passed over like a corrupt one),
and again as DCP loads it (``SafeLoadPlanner``).
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from amp_exp.results.files import open_data

DCP_METADATA = ".metadata"
# Everything a DCP .metadata file of plain and FSDP2 state dicts refers to by name.
ALLOWED_GLOBALS = frozenset(
    {
        *(("torch.distributed.checkpoint.metadata", name) for name in dcp_metadata.__all__),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        # How torch.layout pickles itself: a lookup of the layout by name.
        ("torch.serialization", "_get_layout"),
        # StorageMeta.checkpoint_id: the directory the checkpoint was saved to.
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
    }
)


class UnsafeCheckpoint(ValueError):
    """The file names something a checkpoint never holds; nothing of it ran."""


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # a tensor's dtype, pickled as torch.<name>
        raise UnsafeCheckpoint(
            f"{DCP_METADATA} refers to {module}.{name}, which no checkpoint holds; refused "
            "unread (it may be code)"
        )


def read_metadata(path: Path) -> Metadata:
    """A DCP ``.metadata`` file, unpickled with DCP's own classes only."""
    with os.fdopen(open_data(path), "rb") as file:
        metadata = MetadataUnpickler(file).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{DCP_METADATA} holds a {type(metadata).__name__}, not Metadata")
    return metadata


def check_checkpoint(path: Path) -> None:
    """Raise ``UnsafeCheckpoint`` unless the DCP checkpoint in directory ``path`` holds only data:
    its metadata, and each non-tensor value (read where the metadata says it lies, inside
    ``path``), under ``weights_only=True``. Tensors DCP always reads with ``weights_only=True``."""
    metadata = read_metadata(path / DCP_METADATA)
    root = path.resolve()
    for index, where in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        shard = (root / where.relative_path).resolve()
        if shard.parent != root or where.transform_descriptors:
            raise UnsafeCheckpoint(
                f"the value of {index.fqn} lies in {where.relative_path}, transformed by "
                f"{where.transform_descriptors or 'nothing'}: not where amp_exp saves one"
            )
        with os.fdopen(open_data(shard), "rb") as file:
            file.seek(where.offset)
            load_plain(io.BytesIO(file.read(where.length)), index.fqn)


def load_plain(value: io.BytesIO, fqn: str) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpoint(
            f"the value of {fqn} is not plain data; refused unread ({str(error).splitlines()[0]})"
        ) from None


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata comes from ``read_metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        # What FileSystemReader.read_metadata does after unpickling: tag the metadata with this
        # load, which the rest of DCP's load reads.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor values must load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        load_plain(value, read_item.dest_index.fqn)
        # What weights_only accepts calls nothing but torch's own allowlisted constructors, so
        # the planner's own load of the same bytes runs no code either.
        value.seek(0)
        super().load_bytes(read_item, value)
