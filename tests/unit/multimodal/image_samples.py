"""Small images for the media tests, well-formed and hostile, built in memory (no files)."""

from __future__ import annotations

import base64
import io
import struct
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="8" height="8"><rect width="8" height="8"/></svg>'


def png(width: int = 16, height: int = 12, seed: int = 0, mode: str = "RGB") -> bytes:
    """A real PNG of noise (``seed`` picks the pixels), so it does not compress away."""
    import random

    from PIL import Image

    rng = random.Random(seed)
    size = width * height * len(mode)
    image = Image.frombytes(mode, (width, height), bytes(rng.getrandbits(8) for _ in range(size)))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def encode(data: bytes, fmt: str) -> bytes:
    """The same pixels in another format (lossless: BMP, PNG, WEBP lossless)."""
    from PIL import Image

    out = io.BytesIO()
    Image.open(io.BytesIO(data)).save(out, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return out.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` (8-bit greyscale) but carries a few bytes of pixel
    data: a decompression bomb's header without its payload (opening it must not allocate it)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + _chunk(b"IEND", b""))


def strip_png(length: int = 100_000) -> bytes:
    """A real 1 x ``length`` PNG."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("L", (1, length), 128).save(out, format="PNG")
    return out.getvalue()


def truncated_png() -> bytes:
    """A noisy 64 x 64 PNG cut in half (its pixel data ends early)."""
    data = png(64, 64, seed=3)
    return data[: len(data) // 2]


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@contextmanager
def image_server(routes: dict[str, tuple[int, dict[str, str], bytes]]) -> Iterator[str]:
    """A local HTTP server of the test's own on 127.0.0.1 (yields its base URL): ``routes`` maps a
    path to (status, headers, body); ``/endless`` streams zeros until the client gives up."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/endless":
                self.send_response(200)
                self.end_headers()
                try:
                    for _ in range(10_000):
                        self.wfile.write(b"\x00" * 4096)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                return
            status, headers, body = routes.get(self.path, (404, {}, b"no"))
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
