"""Optional Hugging Face Hub mirror of the aux peer's checkpoints. The Hub is a convenience: a failed upload is
logged and retried with a later checkpoint, it never stops the peer.

By default the repo is created private and holds what a user needs to run the model (weights, config, tokenizer),
not the optimizer state: ``--hub_public`` and ``--upload_training_state`` change that. ``--resume_from`` a repo
needs the training state."""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

from lean_transformer.swarm.protocol.settings import is_hub_repo_id

logger = logging.getLogger(__name__)


def upload_arguments(repo_id: str, checkpoint_dir: os.PathLike, epoch: int, public: bool = False,
                     include_training_state: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The keyword arguments of ``HfApi.create_repo`` and ``HfApi.upload_folder`` that mirror one checkpoint: a
    private repo unless ``public`` (an existing repo keeps its visibility), the training state left out unless
    ``include_training_state``, and every other file of the repo replaced (it mirrors exactly one checkpoint)."""
    from lean_transformer.swarm.storage.training_state import TRAINING_STATE_FILE

    create = dict(repo_id=repo_id, private=not public, exist_ok=True)
    upload = dict(repo_id=repo_id, folder_path=Path(checkpoint_dir), commit_message=f"Swarm checkpoint at epoch {epoch}",
                  delete_patterns=["*"], ignore_patterns=None if include_training_state else [TRAINING_STATE_FILE])
    return create, upload


class HubUploader:
    """Uploads a checkpoint directory to the root of a Hub model repo in a background thread, at most once per
    ``interval`` seconds and one upload at a time, so a slow or failing upload never delays metrics or averaging.

    The repo then holds the newest uploaded checkpoint (``from_pretrained(repo_id)`` works, for the model and for
    ``AutoTokenizer``; the repo's git history keeps the older ones). See :func:`upload_arguments` for what goes up.
    """

    def __init__(self, repo_id: str, interval: float, token: Optional[str] = None, public: bool = False,
                 include_training_state: bool = False):
        if interval < 0:
            raise ValueError(f"hub upload interval must be >= 0 seconds, got {interval}")
        self.repo_id, self.interval, self.token = repo_id, interval, token
        self.public, self.include_training_state = public, include_training_state
        self._last_start = -float("inf")
        self._thread: Optional[threading.Thread] = None

    def maybe_upload(self, checkpoint_dir: os.PathLike, epoch: int) -> bool:
        """Start uploading ``checkpoint_dir`` if the interval has passed and no upload is running; return whether
        an upload was started."""
        if self._thread is not None and self._thread.is_alive():
            logger.info(f"Hub upload still running; not uploading epoch {epoch}")
            return False
        if time.monotonic() - self._last_start < self.interval:
            return False
        self._last_start = time.monotonic()
        self._thread = threading.Thread(
            target=self._upload, args=(Path(checkpoint_dir), epoch), name="hub-upload", daemon=True
        )
        self._thread.start()
        return True

    def _upload(self, checkpoint_dir: Path, epoch: int) -> None:
        from huggingface_hub import HfApi

        create, upload = upload_arguments(self.repo_id, checkpoint_dir, epoch, self.public,
                                          self.include_training_state)
        try:
            api = HfApi(token=self.token)
            api.create_repo(**create)
            api.upload_folder(**upload)
            logger.info(f"Uploaded the epoch {epoch} checkpoint to https://huggingface.co/{self.repo_id}")
        except Exception as error:  # network, auth, quota, a pruned directory...: log, keep the peer running
            logger.warning(f"Hub upload of epoch {epoch} to {self.repo_id} failed: {type(error).__name__}: {error}")

    def wait(self, timeout: float) -> None:
        """Give a running upload up to ``timeout`` seconds to finish (called on shutdown)."""
        if self._thread is not None:
            self._thread.join(timeout)


def resolve_checkpoint(source: str, download_dir: os.PathLike, token: Optional[str] = None) -> Path:
    """The checkpoint directory that ``--resume_from SOURCE`` means: a checkpoint directory, the newest checkpoint
    in a folder of them, or a Hub repo (downloaded into ``download_dir``). Raises FileNotFoundError naming the flag.
    """
    from lean_transformer.swarm.storage.training_state import TRAINING_STATE_FILE, find_checkpoint

    origin = source
    if is_hub_repo_id(source):
        from huggingface_hub import snapshot_download

        local_dir = Path(download_dir) / source.replace("/", "--")
        try:
            snapshot_download(source, local_dir=local_dir, token=token)
        except Exception as error:  # not found, no access, no internet: all mean "cannot resume from it"
            raise FileNotFoundError(f"--resume_from: {source} is not a local directory and could not be downloaded as "
                                    f"a Hub repo ({type(error).__name__}: {str(error).splitlines()[0]})") from None
        source = str(local_dir)
    if not os.path.isdir(source):
        raise FileNotFoundError(f"--resume_from: {source} is neither a directory nor a Hub repo id (owner/name)")
    checkpoint = find_checkpoint(source)
    if checkpoint is None and os.path.isfile(os.path.join(source, "config.json")):
        raise FileNotFoundError(f"--resume_from: {origin} holds a model without its training state "
                                f"({TRAINING_STATE_FILE}: optimizer, LR schedule, epoch), so a swarm cannot resume "
                                f"from it; an aux peer uploads that state to the Hub only with --upload_training_state")
    if checkpoint is None:
        raise FileNotFoundError(f"--resume_from: no checkpoint (a directory with {TRAINING_STATE_FILE}) in {source}")
    return checkpoint
