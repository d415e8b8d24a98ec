"""zeropp inside the training frameworks users already run; each module imports its framework
only when imported itself (`pip install zeropp[hf]` and so on)."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import CheckpointError

# Every integration saves the model's and the optimizer's shards (`zpp.save_checkpoint`) into this
# folder inside the framework's own checkpoint directory, beside what the framework saves itself.
CHECKPOINT_FOLDER = "zeropp"


def checkpoint_folder(checkpoint: str | Path, fix: str) -> Path:
    """The zeropp folder inside the framework checkpoint `checkpoint`; CheckpointError, ending with
    `fix`, when there is none."""
    folder = Path(checkpoint) / CHECKPOINT_FOLDER
    if not folder.is_dir():
        raise CheckpointError(f"{checkpoint} holds no zeropp checkpoint ({CHECKPOINT_FOLDER}/): {fix}")
    return folder
