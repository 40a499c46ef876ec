"""Image documents: a reference to a page image on disk, opened only when its chunk is
embedded, and a cheap up-front check that every image referenced by the data can be read.

PIL is imported lazily (it comes with the ``vision`` extra and with matplotlib).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DataError

__all__ = ["ImageDoc", "IMAGE_SUFFIXES", "is_image_path", "check_image", "load_image", "doc_key"]

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


@dataclass(frozen=True)
class ImageDoc:
    """A document that is an image (``path``, absolute), optionally with text shown beside it."""

    path: str
    text: str = ""

    def __str__(self) -> str:  # what logs and errors show
        return self.path


def is_image_path(value: str) -> bool:
    return Path(value).suffix.lower() in IMAGE_SUFFIXES


def doc_key(doc: Any) -> str:
    """A stable identity for a document: the path of an image, a hash of a text."""
    if isinstance(doc, ImageDoc):
        return doc.path
    from .records import text_id
    return text_id(doc)


def check_image(path: str | Path) -> str | None:
    """``None`` if ``path`` is a readable image, else why not (without decoding the pixels)."""
    p = Path(path)
    if not p.exists():
        return f"image file not found: {str(p)!r}"
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:  # pragma: no cover
        return "Pillow is not installed: pip install 'bigbatch[vision]'"
    try:
        with Image.open(p) as im:
            im.verify()
    except Image.DecompressionBombError as e:
        return f"image {str(p)!r} is too large to open safely ({e}); shrink it"
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
        return f"cannot read image {str(p)!r}: {e}"
    return None


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
