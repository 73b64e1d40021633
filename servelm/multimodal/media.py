"""Loading request images (``data:``, ``file://`` and ``http(s)`` URLs, raw bytes, PIL images)
into checked ``ImageItem``s.

Invariants:
- Every failure is the client's: an ``InvalidRequestError`` (a 400) naming the request field and
  saying what to change, never a 5xx. Nothing here trusts a size the client declares: the byte
  cap holds while reading (a ``data:`` URL's length, a file's size, a download cut off at the cap).
- Pixels are checked from the image header *before* anything is decoded (``Image.open`` reads the
  header only): a decompression bomb (a few KB declaring 100 megapixels) or a 1 x 100000 strip is
  refused without allocating its pixels. Only raster formats with plain decoders are opened
  (``IMAGE_FORMATS``): an SVG is refused by name, and Pillow's plugins that run external programs
  (EPS through Ghostscript) are never reached.
- A truncated file is an error (Pillow's ``LOAD_TRUNCATED_IMAGES`` stays off): the model never sees
  an image with grey rows the client did not send.
- ``file://`` reads only regular files under ``--allowed-local-media-path``, after resolving
  ``..`` and symlinks (an escape through either is refused); ``http(s)`` fetches only from hosts in
  ``--allowed-media-domains`` (each redirect hop checked), within a time limit and the byte cap.
- The result is RGB; a transparent image is laid on white (as vLLM does), so transparent pixels do
  not turn into whatever colour they happened to store. ``digest`` is over the decoded pixels, size
  and mode: equal pixels give equal digests whatever the encoding (PNG or a data: URL of it).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import stat
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, unquote_to_bytes, urljoin, urlsplit

from servelm.errors import InvalidRequestError
from servelm.multimodal.inputs import ImageItem

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""Formats Pillow may open here: the raster formats clients send. Others (TIFF, EPS, ICO, ...) are
refused: EPS runs Ghostscript, and each extra decoder is attack surface nobody asked for."""

MAX_REDIRECTS = 3
"""Redirects followed when fetching an image URL; each new host must be allowed too."""


@dataclass(frozen=True)
class MediaPolicy:
    """What a request's images may be: sources allowed and size limits (from the server config)."""

    max_image_bytes: int = 20 * 1024 * 1024
    """Largest encoded image (after base64 decoding), in bytes."""
    max_image_pixels: int = 50_000_000
    """Largest width x height; checked from the header, before decoding (decompression bombs)."""
    max_aspect_ratio: float = 200.0
    """Longest side / shortest side; a 1 x 100000 strip is refused (Qwen2-VL's own limit is 200)."""
    allowed_local_media_path: str | None = None
    """``file://`` URLs are read only under this directory; None: refused."""
    allowed_media_domains: tuple[str, ...] = ()
    """Hosts ``http(s)`` image URLs may name (exact, case-insensitive); empty: URLs are refused."""
    fetch_timeout_s: float = 5.0
    """Time limit for fetching one image URL (connect, and the whole body)."""
    is_trusted_caller: bool = False
    """The offline Engine: local paths are the caller's own, read from anywhere."""

    @classmethod
    def from_config(cls, config: Any) -> MediaPolicy:
        """From an EngineConfig (its ``multimodal`` section)."""
        mm = config.multimodal
        return cls(max_image_bytes=mm.max_image_bytes, max_image_pixels=mm.max_image_pixels,
                   allowed_local_media_path=mm.allowed_local_media_path,
                   allowed_media_domains=tuple(d.lower() for d in mm.allowed_media_domains or ()),
                   fetch_timeout_s=mm.media_fetch_timeout_s)


def _error(message: str, param: str, code: str = "invalid_image") -> InvalidRequestError:
    return InvalidRequestError(message, param, code=code)


def _size_text(num_bytes: int) -> str:
    return f"{num_bytes / (1024 * 1024):.1f} MiB" if num_bytes >= 1024 * 1024 else f"{num_bytes} bytes"


def _too_big(num_bytes: int | None, policy: MediaPolicy, param: str) -> InvalidRequestError:
    size = f" ({_size_text(num_bytes)})" if num_bytes is not None else ""
    return _error(f"{param}: the image is larger{size} than this server accepts "
                  f"({_size_text(policy.max_image_bytes)}, --max-image-bytes); send a smaller or "
                  "more compressed image", param, "image_too_large")


# -- sources -------------------------------------------------------------------------------------

def read_data_url(url: str, policy: MediaPolicy, param: str) -> bytes:
    """The bytes of a ``data:[<type>][;base64],<data>`` URL (size checked before decoding)."""
    header, comma, payload = url.partition(",")
    if not comma:
        raise _error(f"{param}: a data: URL needs a comma before its data "
                     "(data:image/png;base64,...)", param)
    media_type = header[5:].split(";")[0].strip().lower()
    if media_type == "image/svg+xml":
        raise _svg_error(param)
    if media_type and not media_type.startswith("image/") and media_type != "application/octet-stream":
        raise _error(f"{param}: a data: URL of type {media_type!r} is not an image", param)
    if header.lower().endswith(";base64"):
        return decode_base64(payload, policy, param)
    data = unquote_to_bytes(payload)
    if len(data) > policy.max_image_bytes:
        raise _too_big(len(data), policy, param)
    return data


def decode_base64(text: str, policy: MediaPolicy, param: str) -> bytes:
    """Base64 (standard or URL-safe, whitespace allowed) to bytes; the size is checked first."""
    compact = "".join(text.split())
    if len(compact) * 3 // 4 > policy.max_image_bytes + 2:
        raise _too_big(len(compact) * 3 // 4, policy, param)
    try:
        if "-" in compact or "_" in compact:
            return base64.urlsafe_b64decode(compact + "=" * (-len(compact) % 4))
        return base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise _error(f"{param}: the image data is not valid base64", param) from None


def read_local_file(url: str, policy: MediaPolicy, param: str) -> tuple[bytes, str]:
    """(bytes, path) of a ``file://`` URL (or, for a trusted caller, a plain path)."""
    if url.startswith("file:"):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise _error(f"{param}: file:// URLs must name a local path (file:///path), not host "
                         f"{parts.netloc!r}", param, "image_source_not_allowed")
        path = unquote(parts.path)
    else:
        path = url
    if "\x00" in path or not path:
        raise _error(f"{param}: not a valid file path", param)
    real = os.path.realpath(path)
    if not policy.is_trusted_caller:
        root = policy.allowed_local_media_path
        if root is None:
            raise _error(f"{param}: this server does not read local files (file:// URLs); send the "
                         "image as a data: URL, or start the server with "
                         "--allowed-local-media-path DIR to allow files under DIR", param,
                         "image_source_not_allowed")
        root_real = os.path.realpath(root)
        if not os.path.isabs(path) or os.path.commonpath([real, root_real]) != root_real:
            raise _error(f"{param}: {url!r} is outside the directory this server reads images "
                         "from (--allowed-local-media-path); '..' and symlinks out of it are "
                         "refused", param, "image_source_not_allowed")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(real, flags)
    except OSError as error:
        raise _error(f"{param}: cannot read {url!r}: {error.strerror}", param) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # a directory, a FIFO that would block, a device
        os.close(fd)
        raise _error(f"{param}: {url!r} is not a regular file", param)
    with os.fdopen(fd, "rb") as file:
        if info.st_size > policy.max_image_bytes:
            raise _too_big(info.st_size, policy, param)
        data = file.read(policy.max_image_bytes + 1)
    if len(data) > policy.max_image_bytes:
        raise _too_big(None, policy, param)
    return data, real


def _check_host(url: str, policy: MediaPolicy, param: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _error(f"{param}: {url!r} is not an http(s) URL", param)
    if not policy.allowed_media_domains:
        raise _error(f"{param}: this server does not fetch image URLs; send the image as a data: "
                     "URL (base64), or start the server with --allowed-media-domains HOST to "
                     "allow fetching from HOST", param, "image_source_not_allowed")
    host = parts.hostname.lower().rstrip(".")
    if host not in policy.allowed_media_domains:
        raise _error(f"{param}: the host {host!r} is not in this server's --allowed-media-domains",
                     param, "image_source_not_allowed")


def fetch_url(url: str, policy: MediaPolicy, param: str) -> bytes:
    """Download an image from an allowed host: at most ``max_image_bytes``, within the time
    limit (checked between chunks; one read waits at most the limit), redirects re-checked."""
    _check_host(url, policy, param)  # before anything is set up: a refusal costs nothing
    import httpx

    deadline = time.monotonic() + policy.fetch_timeout_s
    timeout = httpx.Timeout(policy.fetch_timeout_s)
    with httpx.Client(timeout=timeout, follow_redirects=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            _check_host(url, policy, param)
            try:
                with client.stream("GET", url, headers={"Accept": "image/*"}) as response:
                    if response.is_redirect and "location" in response.headers:
                        url = urljoin(url, response.headers["location"])
                        continue
                    if response.status_code != 200:
                        raise _error(f"{param}: fetching {url!r} answered HTTP "
                                     f"{response.status_code}", param, "image_fetch_failed")
                    declared = response.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > policy.max_image_bytes:
                        raise _too_big(int(declared), policy, param)
                    chunks: list[bytes] = []
                    size = 0
                    for chunk in response.iter_bytes():
                        size += len(chunk)
                        if size > policy.max_image_bytes:
                            raise _too_big(None, policy, param)
                        if time.monotonic() > deadline:
                            raise httpx.ReadTimeout("the whole download took too long")
                        chunks.append(chunk)
                    return b"".join(chunks)
            except httpx.TimeoutException:
                raise _error(f"{param}: fetching {url!r} took longer than "
                             f"{policy.fetch_timeout_s:g} s (--media-fetch-timeout-s)", param,
                             "image_fetch_failed") from None
            except httpx.HTTPError as error:
                raise _error(f"{param}: fetching {url!r} failed: {type(error).__name__}: {error}",
                             param, "image_fetch_failed") from None
    raise _error(f"{param}: more than {MAX_REDIRECTS} redirects fetching the image", param,
                 "image_fetch_failed")


# -- decoding ------------------------------------------------------------------------------------

def _svg_error(param: str) -> InvalidRequestError:
    return _error(f"{param}: SVG images are not supported (a vector format); rasterize it and send "
                  f"PNG, JPEG, WebP, GIF or BMP", param, "unsupported_image_format")


def _check_dimensions(width: int, height: int, policy: MediaPolicy, param: str) -> None:
    if width < 1 or height < 1:
        raise _error(f"{param}: the image is {width} x {height} pixels: it has no pixels", param)
    if width * height > policy.max_image_pixels:
        raise _error(f"{param}: the image is {width} x {height} = {width * height:,} pixels, more "
                     f"than this server decodes ({policy.max_image_pixels:,}, --max-image-pixels); "
                     "downscale it", param, "image_too_large")
    ratio = max(width, height) / min(width, height)
    if ratio > policy.max_aspect_ratio:
        raise _error(f"{param}: the image is {width} x {height} pixels, an aspect ratio of "
                     f"{ratio:,.0f}:1; at most {policy.max_aspect_ratio:g}:1 is accepted", param,
                     "invalid_image")


def to_rgb(image: Any) -> Any:
    """RGB, transparency composited onto white (transformers' ``convert_to_rgb``, vLLM's too)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def image_digest(image: Any) -> str:
    """sha256 of mode, size and pixels: equal images, equal digests, whatever their encoding."""
    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def _claimed_format(data: bytes) -> str | None:
    """The format whose signature ``data`` starts with, if any (to tell a broken image from a
    non-image)."""
    signatures = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF8", "GIF"),
                  (b"BM", "BMP"))
    for signature, name in signatures:
        if data.startswith(signature):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return None


def decode_image(data: bytes, policy: MediaPolicy, *, source: str, param: str) -> ImageItem:
    """Check and decode encoded image bytes (see the module invariants)."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > policy.max_image_bytes:
        raise _too_big(len(data), policy, param)
    if not data:
        raise _error(f"{param}: the image is empty (0 bytes)", param)
    head = data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if head.startswith(b"<") and b"<svg" in head:
        raise _svg_error(param)  # text, not a raster image, whatever the data: URL claimed
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise _error(f"{param}: the image declares more pixels than this server decodes "
                     f"({policy.max_image_pixels:,}, --max-image-pixels)", param,
                     "image_too_large") from None
    except UnidentifiedImageError:
        claimed = _claimed_format(data)
        if claimed is not None:
            raise _error(f"{param}: the data starts like a {claimed} image but its header is "
                         "invalid", param) from None
        raise _error(f"{param}: the data is not an image this server reads (PNG, JPEG, WebP, GIF "
                     "or BMP)", param, "unsupported_image_format") from None
    except Exception as error:  # a malformed header: any decoder error is the client's data
        raise _error(f"{param}: the image header cannot be read: {error}", param) from None
    _check_dimensions(image.width, image.height, policy, param)
    try:
        image.seek(0)  # an animation: its first frame
        image.load()
        rgb = to_rgb(image)
        rgb.load()
    except Exception as error:  # truncated or corrupt data
        raise _error(f"{param}: the image cannot be decoded ({image.format}): {error}", param) \
            from None
    return ImageItem(image=rgb, digest=image_digest(rgb), source=source)


def image_from_pil(image: Any, policy: MediaPolicy, *, param: str) -> ImageItem:
    """A PIL image given directly (the offline Engine): the same pixel checks, then RGB."""
    _check_dimensions(image.width, image.height, policy, param)
    rgb = to_rgb(image)
    return ImageItem(image=rgb, digest=image_digest(rgb), source="PIL image")


def _source_label(text: str) -> str:
    return "data:" if text.startswith("data:") else text[:200]


def load_image(source: Any, policy: MediaPolicy, *, param: str,
               allow_bare_base64: bool = False) -> ImageItem:
    """One image from what a request gave: a URL string (``data:``, ``file://``, ``http(s)``),
    bare base64 (``allow_bare_base64``: SGLang's ``image_data``, LightLLM's base64 items), bytes,
    or a PIL image. Blocking (file and network reads, decoding): run it off the event loop."""
    if isinstance(source, (bytes, bytearray)):
        return decode_image(bytes(source), policy, source="bytes", param=param)
    if not isinstance(source, str):
        if hasattr(source, "mode") and hasattr(source, "size"):
            return image_from_pil(source, policy, param=param)
        raise _error(f"{param}: an image must be given as a URL string (data:, file:// or "
                     f"http(s)), got {type(source).__name__}", param)
    text = source.strip()
    lowered = text[:8].lower()
    if lowered.startswith("data:"):
        data = read_data_url(text, policy, param)
    elif lowered.startswith(("http://", "https://")):
        data = fetch_url(text, policy, param)
    elif lowered.startswith("file:") or (policy.is_trusted_caller and os.path.isfile(text)):
        data, path = read_local_file(text, policy, param)
        return decode_image(data, policy, source=path, param=param)
    elif allow_bare_base64 and text:
        data = decode_base64(text, policy, param)
        return decode_image(data, policy, source="base64", param=param)
    else:
        scheme = text.split(":", 1)[0] if ":" in text[:16] else ""
        what = f"the URL scheme {scheme!r} is not supported" if scheme else "not an image URL"
        raise _error(f"{param}: {what}: give a data: URL (data:image/png;base64,...), a file:// "
                     "URL or an http(s) URL", param)
    return decode_image(data, policy, source=_source_label(text), param=param)
