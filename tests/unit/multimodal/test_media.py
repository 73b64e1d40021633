"""servelm.multimodal.media: every hostile image class is a clear InvalidRequestError (a 400),
sources are confined (file:// under --allowed-local-media-path, http(s) from allowed hosts only),
and digests follow the pixels, not the encoding."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from servelm.errors import InvalidRequestError
from servelm.multimodal.media import MediaPolicy, decode_image, load_image
from tests.unit.multimodal.image_samples import SVG, data_url, encode, png, png_header_only
from tests.unit.multimodal.image_samples import image_server as serve_images
from tests.unit.multimodal.image_samples import strip_png, truncated_png

POLICY = MediaPolicy()


def refused(source: object, policy: MediaPolicy = POLICY, **kwargs: object) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        load_image(source, policy, param="messages[0].content[1]", **kwargs)  # type: ignore[arg-type]
    error = caught.value
    assert error.param == "messages[0].content[1]" and error.message.startswith(error.param)
    return error


def test_a_png_data_url_loads_as_rgb() -> None:
    item = load_image(data_url(png(16, 12)), POLICY, param="p")
    assert item.image.mode == "RGB" and item.image.size == (16, 12)
    assert item.source == "data:" and len(item.digest) == 64


@pytest.mark.parametrize("make, code, words", [
    (lambda: png_header_only(20_000, 20_000), "image_too_large", "pixels"),   # Pillow's own guard
    (lambda: png_header_only(8_000, 8_000), "image_too_large", "64,000,000 pixels"),  # ours
    (lambda: strip_png(100_000), "invalid_image", "aspect ratio"),
    (truncated_png, "invalid_image", "cannot be decoded"),
    (lambda: SVG, "unsupported_image_format", "SVG"),
    (lambda: b"hello, this is not an image at all", "unsupported_image_format", "not an image"),
    (lambda: b"", "invalid_image", "empty"),
    (lambda: png_header_only(0, 10), "invalid_image", ""),
])
def test_hostile_images_are_refused(make, code, words) -> None:
    error = refused(data_url(make()))
    assert error.code == code, error.message
    assert words in error.message


def test_the_pixel_cap_is_checked_before_decoding() -> None:
    """A header declaring 64 M pixels with 60 bytes of data: refused in well under a second and
    without allocating the image (decoding it would take 64 MB and far longer)."""
    import time
    import tracemalloc

    bomb = png_header_only(8_000, 8_000)
    tracemalloc.start()
    start = time.perf_counter()
    refused(bomb)
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 0.5 and peak < 8 * 1024 * 1024, (elapsed, peak)


def test_svg_by_media_type_and_by_content() -> None:
    assert "SVG" in refused(data_url(SVG, "image/svg+xml")).message
    assert "SVG" in refused(data_url(SVG, "image/png")).message  # sniffed, whatever it claims


def test_byte_cap_holds_before_decoding() -> None:
    small = MediaPolicy(max_image_bytes=1000)
    data = png(64, 64, seed=1)
    assert len(data) > 1000
    assert refused(data_url(data), small).code == "image_too_large"
    assert refused(data, small).code == "image_too_large"
    load_image(data_url(png(4, 4)), small, param="p")


def test_bad_base64_and_schemes() -> None:
    assert "base64" in refused("data:image/png;base64,@@@not-base64@@@").message
    assert "not an image" in refused("data:text/plain;base64,aGVsbG8=").message
    assert "scheme 'ftp'" in refused("ftp://example.com/a.png").message
    assert "data: URL" in refused("just some words").message
    # bare base64 is an image only where the API says so (SGLang's image_data, LightLLM's base64)
    import base64

    raw = base64.b64encode(png(4, 4)).decode()
    refused(raw)
    assert load_image(raw, POLICY, param="p", allow_bare_base64=True).image.size == (4, 4)


def test_digest_follows_pixels_not_encoding() -> None:
    data = png(16, 12, seed=5)
    as_png = load_image(data_url(data), POLICY, param="p")
    for fmt in ("BMP", "WEBP"):
        other = decode_image(encode(data, fmt), POLICY, source="x", param="p")
        assert other.digest == as_png.digest, fmt
    different = load_image(data_url(png(16, 12, seed=6)), POLICY, param="p")
    transposed = load_image(data_url(png(12, 16, seed=5)), POLICY, param="p")
    assert len({as_png.digest, different.digest, transposed.digest}) == 3


def test_transparency_is_laid_on_white() -> None:
    from PIL import Image
    import io

    out = io.BytesIO()
    Image.new("RGBA", (4, 4), (0, 0, 0, 0)).save(out, format="PNG")
    item = load_image(data_url(out.getvalue()), POLICY, param="p")
    assert item.image.getpixel((0, 0)) == (255, 255, 255)


# -- file:// --------------------------------------------------------------------------------------

@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "allowed"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "cat.png").write_bytes(png(8, 8))
    (tmp_path / "secret.png").write_bytes(png(8, 8, seed=9))
    os.symlink(tmp_path / "secret.png", root / "escape.png")
    os.symlink(root / "sub" / "cat.png", root / "inside.png")
    return root


def test_local_files_only_under_the_allowed_path(media_root: Path) -> None:
    policy = MediaPolicy(allowed_local_media_path=str(media_root))
    item = load_image(f"file://{media_root}/sub/cat.png", policy, param="p")
    assert item.image.size == (8, 8) and item.source.endswith("cat.png")
    assert load_image(f"file://{media_root}/inside.png", policy, param="p").digest == item.digest
    for url in (f"file://{media_root}/../secret.png", f"file://{media_root}/sub/../../secret.png",
                f"file://{media_root}/escape.png", "file:///etc/passwd",
                f"file://{media_root}2/x.png"):
        error = refused(url, policy)
        assert error.code == "image_source_not_allowed" and "--allowed-local-media-path" in error.message
    assert "not a regular file" in refused(f"file://{media_root}/sub", policy).message
    assert "cannot read" in refused(f"file://{media_root}/missing.png", policy).message
    assert refused(f"file://otherhost{media_root}/sub/cat.png", policy).code == "image_source_not_allowed"


def test_local_files_are_off_by_default(media_root: Path) -> None:
    error = refused(f"file://{media_root}/sub/cat.png")
    assert error.code == "image_source_not_allowed" and "--allowed-local-media-path" in error.message


# -- http(s) ----------------------------------------------------------------------------------------

@pytest.fixture
def image_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    routes = {"/cat.png": (200, {"Content-Type": "image/png"}, png(10, 10, seed=2)),
              "/redirect": (302, {"Location": "http://localhost:1/cat.png"}, b""),
              "/same-host": (302, {"Location": "/cat.png"}, b"")}
    with serve_images(routes) as base:
        yield base


def test_http_fetch_from_an_allowed_host(image_server: str) -> None:
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",))
    item = load_image(f"{image_server}/cat.png", policy, param="p")
    assert item.image.size == (10, 10) and item.source == f"{image_server}/cat.png"
    assert load_image(f"{image_server}/same-host", policy, param="p").digest == item.digest
    # a redirect to a host that is not allowed is refused, as the URL itself would be
    assert "'localhost' is not in" in refused(f"{image_server}/redirect", policy).message
    assert "HTTP 404" in refused(f"{image_server}/missing.png", policy).message


def test_http_is_off_by_default_and_other_hosts_refused(image_server: str) -> None:
    error = refused(f"{image_server}/cat.png")
    assert error.code == "image_source_not_allowed" and "--allowed-media-domains" in error.message
    other = MediaPolicy(allowed_media_domains=("images.example.com",))
    assert "'127.0.0.1' is not in" in refused(f"{image_server}/cat.png", other).message


def test_http_download_is_cut_at_the_byte_cap(image_server: str) -> None:
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",), max_image_bytes=100_000)
    assert refused(f"{image_server}/endless", policy).code == "image_too_large"
