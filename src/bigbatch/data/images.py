"""Image documents (:class:`~bigbatch.data.types.ImageDoc`, a reference to a page image on
disk, opened only when its chunk is embedded): a cheap up-front check that every image
referenced by the data can be read, and loading one.

PIL is imported lazily (it comes with the ``vision`` extra and with matplotlib).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import DataError
from .types import ImageDoc, doc_key

# ImageDoc and doc_key are defined in bigbatch.data.types and stay importable from here
__all__ = ["ImageDoc", "doc_key", "check_image", "load_image"]


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
