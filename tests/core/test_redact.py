"""What leaves a process's log has its secrets written as ***: URL passwords, bearer tokens,
API tokens, `NAME=value` with a secret's name, and every secret value the caller knows,
while ordinary lines (token counts, ports) stay as they were."""

from __future__ import annotations

import pytest

from core.redact import redact

PURPOSE_TOKEN = "Qm9vbS1ib29tLXRoaXMtaXMtYS1wdXJwb3NlLXRva2Vu"  # 43 characters, as derived


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("connect postgres://dart:pg-pass@db:5432/dart", "connect postgres://dart:***@db:5432/dart"),
        ("try to connect http://dartboard:abc123@10.0.0.5:5000/screenshot",
         "try to connect http://dartboard:***@10.0.0.5:5000/screenshot"),
        ("Authorization: Bearer dbt_0a1b2c3d4e5f_s3cretpart", "Authorization: Bearer ***"),
        ("used dbt_0a1b2c3d4e5f_s3cretpart-XY once", "used dbt_0a1b2c3d4e5f_*** once"),
        ("DARTBOARD_ADMIN_TOKEN=abcdefgh12345 started", "DARTBOARD_ADMIN_TOKEN=*** started"),
        ("{'aws_secret_access_key': 'wJalrXUtnFEMI/K7MDENG'}", "{'aws_secret_access_key': '***'}"),
        ("password: hunter2", "password: ***"),
        (f"loaded with key {PURPOSE_TOKEN} from env", "loaded with key *** from env"),
    ],
)  # fmt: skip  # one case a line: the line and what is kept of it
def test_secrets_are_masked(line, expected):
    assert redact(line, known=[PURPOSE_TOKEN]) == expected


@pytest.mark.parametrize(
    "line",
    [
        "max_tokens=32 prompt tokens: 812 token_ids=[1, 2]",
        "listening on 127.0.0.1:8201 (router http://127.0.0.1:8200)",
        "step 4: reward 1.0, 12 s",
    ],
)
def test_ordinary_lines_are_kept(line):
    assert redact(line, known=["12", ""]) == line  # known values under 8 characters: kept


def test_a_known_value_inside_a_longer_one_is_masked_whole():
    assert redact("k=abcdefgh-ijkl", known=["abcdefgh", "abcdefgh-ijkl"]) == "k=***"
