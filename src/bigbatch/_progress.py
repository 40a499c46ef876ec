"""Progress bars (tqdm), quiet when not on the main process or when asked."""

from __future__ import annotations

import os
from typing import Any


def progress_bar(total: int | None = None, desc: str | None = None, **kwargs: Any) -> Any:
    """A tqdm bar; disabled on ranks other than 0 and when BIGBATCH_NO_PROGRESS is set."""
    from tqdm.auto import tqdm

    disable = int(os.environ.get("RANK", 0)) != 0 or bool(os.environ.get("BIGBATCH_NO_PROGRESS"))
    return tqdm(total=total, desc=desc, disable=disable, dynamic_ncols=True, **kwargs)
