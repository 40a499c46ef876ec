"""Image documents (:class:`~bigbatch.data.records.types.ImageDoc`, a reference to a page image on
disk, opened only when its chunk is embedded): a cheap up-front check that every image
referenced by the data can be read and will be accepted by the vision-language image
processors (the encoders open them: :mod:`bigbatch.encoders.image_inputs`).

What the image processors of the vision-language towers bigbatch trains (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL) accept, from transformers' ``smart_resize``
(``models/qwen2_vl/image_processing_qwen2_vl.py``, which the others copy): the longer side
may be at most :data:`MAX_ASPECT_RATIO` (200) times the shorter, else it raises "absolute
aspect ratio must be smaller than 200" in the middle of a training step. There is no
minimum side: a small image is scaled up to the ``min_pixels`` budget (transformers 5,
which the ``vision`` extra requires; the ``height < factor`` refusal of transformers 4 is
gone), so a 1x1 image is accepted.

PIL is imported lazily (it comes with the ``vision`` extra and with matplotlib).
"""

from __future__ import annotations

from pathlib import Path

from ...errors import shown
from ..readers.files import MAX_IMAGE_BYTES, open_regular
from .types import ImageDoc, doc_key

# ImageDoc and doc_key are defined in bigbatch.data.records.types and stay importable from here
__all__ = ["ImageDoc", "doc_key", "check_image", "MAX_ASPECT_RATIO"]

# the longest side over the shortest that Qwen2-VL / 2.5-VL / 3-VL's smart_resize accepts
MAX_ASPECT_RATIO = 200


def check_image(path: str | Path) -> str | None:
    """``None`` if ``path`` is a readable image that the vision-language image processors
    accept (aspect ratio at most :data:`MAX_ASPECT_RATIO`), else why not. Only a regular
    file of at most :data:`~bigbatch.data.readers.files.MAX_IMAGE_BYTES` is opened (never a FIFO or
    a device); the pixels are not decoded."""
    p = Path(path)
    if not p.exists():
        return f"image file not found: {shown(str(p))}"
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:  # pragma: no cover
        return "Pillow is not installed: pip install pillow (the vision extra: pip install -e '.[vision]')"
    try:
        with open_regular(p, "rb", MAX_IMAGE_BYTES, "page image") as f, Image.open(f) as im:
            width, height = im.size
            im.verify()
    except Image.DecompressionBombError as e:
        return f"image {shown(str(p))} is too large to open safely ({e}); shrink it"
    except UnidentifiedImageError:
        return f"cannot read image {shown(str(p))}: not an image format Pillow can identify"
    except OSError as e:
        return f"cannot read image {shown(str(p))}: {e.strerror or e}"
    except (SyntaxError, ValueError) as e:
        return f"cannot read image {shown(str(p))}: {e}"
    ratio = max(width, height) / max(1, min(width, height))
    if ratio > MAX_ASPECT_RATIO:
        return (f"image {shown(str(p))} is {width}x{height} pixels, an aspect ratio of {ratio:.0f}:1; "
                f"the Qwen2-VL/2.5-VL/3-VL image processors refuse more than "
                f"{MAX_ASPECT_RATIO}:1 (transformers' smart_resize), which would stop training "
                f"at the step that embeds it: crop, pad or split the image")
    return None
