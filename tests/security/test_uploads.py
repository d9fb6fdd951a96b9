"""Hostile demonstration uploads: script injection through an action, zip bombs, oversized
and broken members. Each gets a 400 naming what is wrong, and nothing is imported."""

from __future__ import annotations

import io
import json
import struct
import zipfile

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from PIL import Image

from datamanager.demos import episodes
from datamanager.demos import manifest as demo_manifest
from datamanager.models import Step, Trajectory
from tests.conftest import png_bytes
from tests.dartboard.test_curation_views import finished
from tests.dartboard.test_curation_views import run as run

pytestmark = pytest.mark.django_db

XSS = '"/></svg><script>document.title="owned"</script>'


def zip_of(manifest, files: dict[str, bytes], *, compression=zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as zf:
        zf.writestr("manifest.json", json.dumps(manifest))
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()


def one_step(action: dict, *, shot: str = "s.png", steps: int = 1) -> list[dict]:
    step = {"screenshot": shot, "action": action}
    return [{"task": "click-button", "reward": 1.0, "steps": [step] * steps}]


def post(client, data: bytes):
    f = SimpleUploadedFile("demos.zip", data, content_type="application/zip")
    return client.post(
        "/trajectories/upload/", {"archive": f, "format": "dartboard", "accept": "on"}
    )


def refused(client, data: bytes, message: str) -> None:
    r = post(client, data)
    html = r.content.decode().replace("&#x27;", "'").replace("&quot;", '"')
    assert r.status_code == 400, r.status_code
    assert message in html, html[-2000:]
    assert "nothing was imported" in html
    assert not Trajectory.objects.filter(source="precollected").exists()


def test_a_script_in_an_action_coordinate_is_refused_at_its_field(ada_client, run) -> None:
    data = zip_of(one_step({"type": "click", "x": XSS, "y": 5}), {"s.png": png_bytes()})
    refused(ada_client, data, "manifest.json: [0].steps[0].action: x must be an integer")


def test_a_stored_hostile_action_renders_escaped(ada_client, run) -> None:
    """Steps stored before actions were type-checked (or written by anything else) cannot
    put markup into the trajectory page: the overlay escapes every value."""
    traj = finished(run)
    Step.objects.filter(trajectory=traj, index=0).update(action={"type": "click", "x": XSS, "y": 1})
    Step.objects.filter(trajectory=traj, index=1).update(action={"type": "type", "text": XSS})
    html = ada_client.get(f"/trajectories/{traj.pk}/").content.decode()
    assert "<script>" not in html
    assert "&lt;script&gt;" in html  # the label shows the text, escaped


def test_an_oversized_manifest_is_refused_before_it_is_parsed(ada_client, run) -> None:
    big = one_step({"type": "finished", "text": "x" * (episodes.MAX_MANIFEST_BYTES + 10)})
    refused(ada_client, zip_of(big, {"s.png": png_bytes()}), "manifest.json: larger than 8 MiB")


def test_one_png_named_by_too_many_steps_is_refused(ada_client, run) -> None:
    manifest = one_step({"type": "wait"}, steps=demo_manifest.MAX_STEPS + 1)
    refused(ada_client, zip_of(manifest, {"s.png": png_bytes()}), "at most 50000 in one upload")


def test_a_decompression_bomb_member_is_refused(ada_client, run) -> None:
    bomb = b"\0" * (episodes.MAX_IMAGE_BYTES + 1024)  # compresses to ~20 KB
    data = zip_of(one_step({"type": "wait"}), {"s.png": bomb})
    assert len(data) < 100_000
    refused(ada_client, data, "[0].steps[0].screenshot: s.png: larger than 20 MiB")


def test_a_png_with_too_many_pixels_is_refused_before_decoding(ada_client, run) -> None:
    buf = io.BytesIO()
    Image.new("1", (5000, 5000)).save(buf, "PNG")  # 25 Mpx, a few KB
    data = zip_of(one_step({"type": "wait"}), {"s.png": buf.getvalue()})
    refused(ada_client, data, "5000x5000 is more than 16777216 pixels")


def test_a_corrupt_member_is_reported_at_the_member(ada_client, run) -> None:
    shot = png_bytes()
    data = bytearray(zip_of(one_step({"type": "wait"}), {"s.png": shot}, compression=0))
    at = bytes(data).index(shot) + len(shot) // 2
    data[at] ^= 0xFF  # the stored bytes no longer match their CRC
    refused(ada_client, bytes(data), "s.png: cannot be read from the zip (BadZipFile: Bad CRC-32")


def test_an_encrypted_member_is_reported_at_the_member(ada_client, run) -> None:
    data = bytearray(zip_of(one_step({"type": "wait"}), {"s.png": png_bytes()}))
    for signature, flag_offset in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        start = 0
        while (at := bytes(data).find(signature, start)) >= 0:
            (flags,) = struct.unpack_from("<H", data, at + flag_offset)
            struct.pack_into("<H", data, at + flag_offset, flags | 0x1)  # "encrypted"
            start = at + 4
    refused(ada_client, bytes(data), "cannot be read from the zip")


def test_a_truncated_zip_is_a_clear_400(ada_client, run) -> None:
    data = zip_of(one_step({"type": "wait"}), {"s.png": png_bytes()})
    refused(ada_client, data[: len(data) // 2], "upload: not a readable .zip archive")
