"""``bigbatch train --push-to-hub REPO``: the saved model folder (``final/``, with its model
card) uploaded to a Hugging Face Hub repository through ``huggingface_hub`` (imported here):
the repository is created when missing (``HfApi.create_repo(exist_ok=True)``), then the
folder is uploaded in one commit (``HfApi.upload_folder``). The token is huggingface_hub's
own (``HF_TOKEN`` or ``hf auth login``; huggingface_hub 1.0 and later ship the
``hf`` command in place of ``huggingface-cli``)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["push_folder"]


def push_folder(folder: str | Path, repo_id: str, commit_message: str) -> str:
    """Create ``repo_id`` if needed and upload ``folder`` to it in one commit; returns the
    repository's URL.

    Args:
        folder: the model folder (``final/``).
        repo_id: ``namespace/name`` (or ``name``, in the token's namespace).
        commit_message: the commit's message.
    """
    from huggingface_hub import HfApi

    api = HfApi()
    url = api.create_repo(repo_id, repo_type="model", exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                      commit_message=commit_message)
    return str(url)
