"""Page images as encoder inputs, duck-typed: an item with a ``path`` attribute is an image
document (with its optional ``text`` shown beside the page), a plain ``str`` is text. The
image is opened only when its chunk is embedded.

PIL is imported lazily (it comes with the ``vision`` extra and with matplotlib).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import DataError

__all__ = ["is_image_doc", "image_text", "load_image"]


def is_image_doc(item: Any) -> bool:
    """Whether ``item`` is an image document: not a string, and has a ``path``."""
    return not isinstance(item, str) and hasattr(item, "path")


def image_text(item: Any) -> str:
    """The text shown beside an image document's page ("" when it has none)."""
    return getattr(item, "text", "") or ""


def load_image(path: str | Path) -> Any:
    """The image at ``path`` as an RGB ``PIL.Image``.

    Raises:
        DataError: naming the file, when it is missing, not an image, or over Pillow's
            decompression-bomb limit.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except Image.DecompressionBombError as e:
        raise DataError(f"image too large to open safely ({e}); shrink it",
                        path=str(path)) from e
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise DataError(f"cannot read image: {e}", path=str(path)) from e
