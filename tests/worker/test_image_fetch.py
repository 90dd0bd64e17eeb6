"""Row images fetched and decoded by the worker: real PNG and JPEG bytes from data: URLs, a local
store, moto S3 and a local HTTP server; every bound (bytes, pixels, images per row, http hosts) and
the job's input_uri rules turn an image into `ImageRejected` naming the part, never a crash."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import PIL.Image
import pytest

from bulkinfer.jobs.image_limits import ImageLimits
from bulkinfer.jobs.image_rules import image_read_rule
from bulkinfer.jobs.object_store import LocalObjectStore
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.worker.images import ImageFetcher, ImageRejected, StoreOpener, job_image_fetcher
from tests.support.http_server import serving


def encoded(size: tuple[int, int] = (8, 6), mode: str = "RGB", kind: str = "PNG",
            color: object = (200, 30, 10)) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new(mode, size, color).save(buffer, kind)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header says `width` x `height` (its pixels would never fit in memory)."""
    data = bytearray(encoded((1, 1)))
    data[16:24] = struct.pack(">II", width, height)  # IHDR's width and height
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))  # the chunk's CRC over type + data
    return bytes(data)


def user(*urls: str, detail: str | None = None) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}
             for url in urls]
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]


def rejected(fetcher: ImageFetcher, messages: list[dict]) -> str:
    with pytest.raises(ImageRejected) as error:
        fetcher.fetch(messages)
    return str(error.value)


class RecordingStore(LocalObjectStore):
    """A local store that remembers the ranges read from it."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.ranges: list[tuple[str, int, int]] = []

    def read_range(self, key: str, start: int, end: int) -> bytes:
        self.ranges.append((key, start, end))
        return super().read_range(key, start, end)


@pytest.fixture
def files(tmp_path: Path) -> tuple[RecordingStore, Path]:
    """A store over the whole file system (as input_uri's local paths are read) and a folder of images."""
    folder = tmp_path / "pics"
    folder.mkdir()
    (folder / "red.png").write_bytes(encoded())
    (folder / "grey.jpg").write_bytes(encoded((5, 4), "L", "JPEG", 90))
    (folder / "clear.png").write_bytes(encoded((3, 3), "RGBA", color=(0, 0, 255, 0)))
    return RecordingStore("/"), folder


def local_fetcher(store: LocalObjectStore, limits: ImageLimits | None = None) -> ImageFetcher:
    return ImageFetcher(lambda uri: (store, uri.removeprefix("file://").lstrip("/")), limits)


def test_images_come_decoded_as_rgb_in_order_of_appearance_with_their_detail(files) -> None:
    store, folder = files
    fetcher = local_fetcher(store)
    jpeg = data_url(encoded((4, 2), kind="JPEG"), "image/jpeg")
    clear = f"file://{folder / 'clear.png'}"
    images = fetcher.fetch(user(jpeg, str(folder / "grey.jpg"), clear, detail="low"))
    assert [(image.image.size, image.image.mode, image.detail) for image in images] == [
        ((4, 2), "RGB", "low"), ((5, 4), "RGB", "low"), ((3, 3), "RGB", "low")]
    assert images[1].image.getpixel((0, 0)) == (90, 90, 90)
    assert fetcher.fetch([{"role": "user", "content": "no images"}]) == []
    octets = data_url(encoded(), "application/octet-stream")  # a Parquet cell's bytes: Pillow sniffs them
    assert fetcher.fetch(user(octets))[0].image.getpixel((1, 1)) == (200, 30, 10)


def sideways_photo() -> bytes:
    """A 6 x 4 JPEG, left half red, whose EXIF says "rotate 90 degrees clockwise to view" (Orientation
    6: a phone held upright): seen as meant, it is 4 x 6 with the red half on top."""
    image = PIL.Image.new("RGB", (6, 4), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 3, 4))
    exif = PIL.Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=100, exif=exif.tobytes())
    return buffer.getvalue()


def test_a_photos_exif_orientation_is_applied_by_the_worker_and_the_engine() -> None:
    from bulkinfer.engine.multimodal.images import image_digest, load_image

    fetched = local_fetcher(RecordingStore("/")).fetch(user(data_url(sideways_photo(), "image/jpeg")))
    engine = load_image(sideways_photo())
    for image in (fetched[0].image, engine):
        assert image.size == (4, 6)
        red, green, blue = image.getpixel((2, 1))
        assert red > 200 and blue < 60, image.getpixel((2, 1))  # the red half is on top
    assert image_digest(fetched[0].image) == image_digest(engine)
    upright = load_image(encoded((6, 4)))  # no orientation: as stored
    assert upright.size == (6, 4)


def test_a_store_image_is_read_with_one_bounded_range_and_a_bigger_one_is_refused_by_its_size(files) -> None:
    store, folder = files
    size = (folder / "red.png").stat().st_size
    [image] = local_fetcher(store, ImageLimits(max_bytes=size)).fetch(user(str(folder / "red.png")))
    assert image.image.size == (8, 6)
    assert store.ranges == [(str(folder / "red.png").lstrip("/"), 0, size + 1)]
    message = rejected(local_fetcher(store, ImageLimits(max_bytes=size - 1)), user(str(folder / "red.png")))
    assert message == f"messages[1].content[1]: image is {size:,} bytes, over the limit of {size - 1:,}"
    big = data_url(b"x" * 31_457_280)
    assert rejected(local_fetcher(store), user(big)) == (
        "messages[1].content[1]: image is 31,457,280 bytes, over the limit of 20,971,520")


def test_missing_corrupt_or_truncated_images_are_rejected_naming_the_part(files) -> None:
    store, folder = files
    (folder / "notes.txt").write_bytes(b"not an image at all")
    (folder / "cut.png").write_bytes(encoded((64, 64))[:80])
    fetcher = local_fetcher(store)
    assert rejected(fetcher, user(str(folder / "red.png"), str(folder / "gone.png"))) == (
        f"messages[1].content[2]: image {folder / 'gone.png'} not found")
    unreadable = ("messages[1].content[1]: not an image Pillow can read (cannot identify image file); the "
                  "formats read here are PNG, JPEG, GIF, WEBP and BMP")
    assert rejected(fetcher, user(str(folder / "notes.txt"))) == unreadable
    assert rejected(fetcher, user(data_url(encoded(kind="TIFF"), "image/tiff"))) == unreadable
    assert fetcher.fetch(user(data_url(encoded(kind="WEBP"), "image/webp")))[0].image.size == (8, 6)
    assert rejected(fetcher, user(str(folder / "cut.png"))).startswith(
        "messages[1].content[1]: not an image Pillow can read (")
    assert rejected(fetcher, user("data:image/png;base64,%%%")).startswith(
        "messages[1].content[1]: the data: URL is not valid base64")
    assert rejected(fetcher, user("ftp://host/x.png")).startswith(
        "messages[1].content[1]: ftp://host/x.png is not an image location this server reads")


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_pixels_are_bounded_from_the_header_before_anything_is_decoded() -> None:
    fetcher = ImageFetcher(StoreOpener(), ImageLimits(max_pixels=100))
    assert rejected(fetcher, user(data_url(encoded((20, 10))))) == (
        "messages[1].content[1]: image is 20x10 pixels, over the limit of 100")
    default = ImageFetcher(StoreOpener())
    assert rejected(default, user(data_url(png_claiming(12_000, 12_000)))) == (
        "messages[1].content[1]: image is 12000x12000 pixels, over the limit of 40,000,000")
    # A deployment's bound above Pillow's: Pillow's decompression-bomb check still stops it.
    lenient = ImageFetcher(StoreOpener(), ImageLimits(max_pixels=10**10))
    assert rejected(lenient, user(data_url(png_claiming(20_000, 20_000)))).startswith(
        "messages[1].content[1]: image is too large to decode safely (Image size (400000000 pixels) exceeds")
    assert rejected(lenient, user(data_url(png_claiming(10_000, 10_000)))) == (
        "messages[1].content[1]: image is 10000x10000 pixels, over Pillow's decompression-bomb limit of "
        f"{PIL.Image.MAX_IMAGE_PIXELS:,}")


def test_too_many_images_are_refused_before_any_is_read(files) -> None:
    store, folder = files
    fetcher = local_fetcher(store, ImageLimits(max_images_per_row=2))
    assert rejected(fetcher, user(*[str(folder / "red.png")] * 3)) == (
        "the row: it gives 3 images, over the limit of 2 per row (image_max_per_row)")
    assert store.ranges == []


def test_s3_images_are_read_from_their_bucket(s3) -> None:
    s3.client().create_bucket(Bucket="pics")
    s3.client().put_object(Bucket="pics", Key="cats/tabby.jpg", Body=encoded((7, 3), kind="JPEG"))
    fetcher = ImageFetcher(StoreOpener(s3.endpoint_url))
    [image] = fetcher.fetch(user("s3://pics/cats/tabby.jpg"))
    assert image.image.size == (7, 3) and image.image.mode == "RGB"
    assert rejected(fetcher, user("s3://pics/cats/missing.jpg")) == (
        "messages[1].content[1]: image s3://pics/cats/missing.jpg not found")


class ImageHandler(BaseHTTPRequestHandler):
    routes = {"/red.png": encoded(), "/big.png": encoded((300, 300), color=None)}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/red.png")
            self.end_headers()
            return
        body = self.routes.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


def test_http_images_come_only_from_allowed_hosts_without_redirects_and_within_the_bound() -> None:
    with serving(HTTPServer(("127.0.0.1", 0), ImageHandler)) as server:
        base = f"http://127.0.0.1:{server.server_port}"
        limits = ImageLimits(max_bytes=len(encoded()) + 10,
                             allowed_http_hosts=(f"127.0.0.1:{server.server_port}",))
        with ImageFetcher(StoreOpener(), limits) as fetcher:
            [image] = fetcher.fetch(user(f"{base}/red.png"))
            assert image.image.size == (8, 6)
            assert rejected(fetcher, user(f"{base}/nothing.png")) == (
                f"messages[1].content[1]: image {base}/nothing.png answered HTTP 404")
            assert rejected(fetcher, user(f"{base}/moved")) == (
                f"messages[1].content[1]: image {base}/moved answered HTTP 302 (redirects are not followed)")
            size = len(ImageHandler.routes["/big.png"])
            assert rejected(fetcher, user(f"{base}/big.png")) == (
                f"messages[1].content[1]: image is {size:,} bytes, over the limit of {limits.max_bytes:,}")
    nowhere = ImageFetcher(StoreOpener())  # the default: no host at all
    assert rejected(nowhere, user("https://example.com/cat.png")) == (
        "messages[1].content[1]: http(s) image host example.com is not allowed here (image_http_hosts)")
    tricked = ImageFetcher(StoreOpener(), ImageLimits(allowed_http_hosts=("example.com",)))
    assert rejected(tricked, user("https://example.com@evil.test/cat.png")) == (
        "messages[1].content[1]: http(s) image host evil.test is not allowed here (image_http_hosts)")


def test_store_locations_follow_the_tenant_rules_of_input_uri(tmp_path: Path) -> None:
    root = tmp_path / "store"
    for name in ("tenants/acme/cat.png", "tenants/globex/dog.png", "jobs/j1/output/x.png"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(encoded())
    (tmp_path / "elsewhere.png").write_bytes(encoded())
    settings = Settings(store_uri=str(root), tenant_prefixes=json.dumps({"acme": ["s3://acme-data/"]}))
    spec = JobSpec(input_uri=str(root / "tenants/acme/rows.parquet"), model="m", prompt_column="q",
                   image_column="img", tenant="acme")
    fetcher = job_image_fetcher(settings, spec)
    assert fetcher.limits == settings.image_limits()
    [image] = fetcher.fetch(user(str(root / "tenants/acme/cat.png")))
    assert image.image.size == (8, 6)
    assert rejected(fetcher, user(f"file://{root}/tenants/globex/dog.png")) == (
        f"messages[1].content[1]: image location 'file://{root}/tenants/globex/dog.png' is outside the "
        f"prefixes tenant 'acme' may use ({root}/tenants/acme/, s3://acme-data/; and its own uploads); the "
        "deployment's tenant_prefixes setting says where else each tenant's data may be")
    assert "outside the prefixes tenant 'acme'" in rejected(fetcher, user("s3://other-bucket/x.png"))
    other_jobs_output = user(str(root / "jobs/j1/output/x.png"))
    assert "inside or holds the job store's jobs/ folder" in rejected(fetcher, other_jobs_output)
    assert "is outside the store directory" in rejected(fetcher, user(str(tmp_path / "elsewhere.png")))
    # `..` is followed where it really points.
    assert "outside the prefixes" in rejected(fetcher, user(f"{root}/tenants/acme/../globex/dog.png"))
    # An admin's job (no tenant) is bound only by the store's own areas.
    admin = image_read_rule(settings, None)
    assert admin(str(root / "tenants/globex/dog.png")) is None
    assert "jobs/ folder" in str(admin(str(root / "jobs/j1/output/x.png")))


def test_a_refused_location_is_never_opened(tmp_path: Path) -> None:
    opened: list[str] = []

    def open_store(uri: str) -> tuple:
        opened.append(uri)
        raise AssertionError("a refused location was opened")

    fetcher = ImageFetcher(open_store,
                           may_read=lambda uri: f"image location {uri} is not one this job may read")
    assert rejected(fetcher, user("s3://other-bucket/x")) == (
        "messages[1].content[1]: image location s3://other-bucket/x is not one this job may read")
    assert opened == []
    s3_settings = Settings(store_uri="s3://jobs/prod")
    assert "this deployment keeps jobs in S3" in str(image_read_rule(s3_settings, None)("/etc/passwd"))
