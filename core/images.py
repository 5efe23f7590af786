"""Images in prompts: the image parts of a row's messages, where each image is, and reading it.

A message's content may be a list of parts. An image part is transformers' ``{"type": "image",
"image": SOURCE}`` or OpenAI's ``{"type": "image_url", "image_url": {"url": SOURCE}}``; SOURCE is a
file path (relative to the dataset file's folder), an ``http(s)://`` URL or a ``data:image/...;base64,``
URL. :func:`resolve_images` checks a row's images when the dataset loads (a file must exist and
decode; a URL is fetched when the prompt is first used) and rewrites every image part as
transformers' form with the file's absolute path, which is what the rollouts, the processors and
the samplers read.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

import attrs

from grpo_core.errors import DataError, PluginError
from grpo_core.types import Prompt

IMAGE = "image"
IMAGE_URL = "image_url"
WEB_SCHEMES = ("http://", "https://")
DATA_URL = "data:"
URL_TIMEOUT_S = 30.0


def image_sources(messages: list[dict[str, Any]] | None) -> list[str]:
    """The images of resolved ``messages`` (:func:`resolve_images`), in the order the chat shows them."""
    return [part[IMAGE] for message in messages or () for part in _parts(message) if part.get("type") == IMAGE]


def has_images(prompt: Prompt) -> bool:
    return any(part.get("type") in (IMAGE, IMAGE_URL) for message in prompt.messages or () for part in _parts(message))


def _parts(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    return [p for p in content if isinstance(p, dict)] if isinstance(content, list) else []


def resolve_images(prompt: Prompt, where: str, base: Path | None) -> Prompt:
    """``prompt`` with each image part as ``{"type": "image", "image": SOURCE}`` (a file as its
    absolute path), every file checked to exist and decode; a DataError naming ``where`` (the row)
    otherwise. ``base``: the folder relative paths start from (None: a hub dataset, where there is none)."""
    if not has_images(prompt):
        return prompt
    messages = []
    for i, message in enumerate(prompt.messages or (), start=1):
        content = message["content"]
        if isinstance(content, list):
            content = [_resolved_part(part, f"{where}: message {i} part {j}", base) for j, part in enumerate(content, start=1)]
        messages.append({**message, "content": content})
    return attrs.evolve(prompt, messages=messages)


def _resolved_part(part: Any, where: str, base: Path | None) -> Any:
    if not isinstance(part, dict) or part.get("type") not in (IMAGE, IMAGE_URL):
        return part
    if part["type"] == IMAGE:
        source = part.get(IMAGE)
        shape = '{"type": "image", "image": PATH or URL}'
    else:
        url = part.get(IMAGE_URL)
        source = url.get("url") if isinstance(url, dict) else url
        shape = '{"type": "image_url", "image_url": {"url": URL}}'
    if not isinstance(source, str) or not source.strip():
        raise DataError(f"{where}: an image part is {shape}")
    if source.startswith(WEB_SCHEMES):
        return {"type": IMAGE, IMAGE: source}
    if source.startswith(DATA_URL):
        read_image(source, where)
        return {"type": IMAGE, IMAGE: source}
    path = Path(source.removeprefix("file://")).expanduser()
    if not path.is_absolute():
        if base is None:
            raise DataError(f"{where}: image '{source}' is a relative path, and this dataset has no folder it is relative to")
        path = base / path
    if not path.is_file():
        raise DataError(f"{where}: image file not found: {path}")
    read_image(str(path), where)
    return {"type": IMAGE, IMAGE: str(path.resolve())}


def read_image(source: str, where: str) -> Any:
    """The image at ``source`` (a resolved one: an absolute path, an http(s) URL or a data URL) as
    an RGB PIL image; a DataError naming ``where`` when it cannot be read or decoded."""
    image_module = _pil()
    try:
        if source.startswith(WEB_SCHEMES):
            import httpx

            response = httpx.get(source, timeout=URL_TIMEOUT_S, follow_redirects=True)
            response.raise_for_status()
            data = response.content
        elif source.startswith(DATA_URL):
            header, sep, payload = source.partition(",")
            if not sep or not header.endswith(";base64"):
                raise ValueError("a data URL of an image is data:image/FORMAT;base64,DATA")
            data = base64.b64decode(payload, validate=True)
        else:
            data = Path(source).read_bytes()
        image = image_module.open(io.BytesIO(data))
        image.load()
    except Exception as exc:  # noqa: BLE001 - httpx, base64, OS and PIL errors all mean the same to the user: this image is unusable
        reason = "not valid base64" if isinstance(exc, binascii.Error) else str(exc) or type(exc).__name__
        raise DataError(f"{where}: cannot read image {_shown(source)}: {reason}") from None
    return image.convert("RGB")


def _shown(source: str) -> str:
    return f"{source[:40]}..." if source.startswith(DATA_URL) else source


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise PluginError("image prompts need Pillow: pip install 'grpo-core[vision]'") from None
    return Image


def openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A chat whose image parts are resolved, as an OpenAI-compatible server takes it: each image as
    an ``image_url`` part (:func:`image_url`), every other part and string content as it is."""
    return [{**m, "content": [openai_part(p) for p in m["content"]] if isinstance(m["content"], list) else m["content"]} for m in messages]


def openai_part(part: Any) -> Any:
    if isinstance(part, dict) and part.get("type") == IMAGE:
        return {"type": IMAGE_URL, IMAGE_URL: {"url": image_url(part[IMAGE])}}
    return part


def image_url(source: str) -> str:
    """What an OpenAI-compatible server gets for a resolved image: a file as a data URL of its bytes
    (the server decodes the very bytes the trainer's processor read), a URL as it is."""
    if source.startswith((*WEB_SCHEMES, DATA_URL)):
        return source
    path = Path(source)
    kind = (_pil().open(path).format or "png").lower()
    return f"data:image/{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"
