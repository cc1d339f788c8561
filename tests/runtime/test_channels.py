"""kiln_runtime/channels.py: a channel statement signed by the build (pipeline/release/signing.py `sign_statement`)
and read by a deployment host — its signature, its binding to a reference, its expiry, and this host's floor (the
newest statement it accepted per channel). The pulls through a real registry, with real releases, are in
tests/release/test_system_release.py and tests/runtime/test_oci.py."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from kiln_runtime import channels
from pipeline.errors import GateFailed, KilnError
from pipeline.release import signing

SHA = "sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("channel-keys")
    private, public = signing.keygen(d / "publisher.pem")
    other, other_pub = signing.keygen(d / "other.pem")
    return {"private": private, "public": public, "other": other, "other_pub": other_pub}


def statement(version: int = 2, issued: dt.datetime | None = None, days: float = 30, channel: str = "prod",
              repository: str = "kiln/demo", previous: dict | None = None) -> channels.Statement:
    t = issued or channels.now()
    return channels.Statement(repository, channel, "demo", version, f"kiln-system-demo-v{version}.tar.gz", SHA,
                              "sha256:" + "cd" * 32, channels.stamp(t), channels.stamp(t + dt.timedelta(days=days)),
                              previous)


def signed(st: channels.Statement, key: Path) -> bytes:
    return signing.sign_statement(channels.payload(st), key)


def test_a_statement_signed_by_the_build_reads_back_on_a_host(keys):
    st = statement(previous={"version": 1, "issued": "2026-01-01T00:00:00.000000Z"})
    bundle = signed(st, keys["private"])
    assert bundle == signed(st, keys["private"])                 # RFC 6979: the same statement, the same bytes
    got = channels.read(bundle, keys["public"], "prod")
    assert got.digest.startswith("sha256:") and {**got.__dict__, "digest": ""} == {**st.__dict__, "digest": ""}
    channels.bind(got, "kiln/demo", "prod")
    channels.bind(got, "kiln/demo", None)                         # pulled by digest: the channel is the statement's
    channels.fresh(got)


@pytest.mark.parametrize("case, needle", [
    ("other key", "Key mismatch"), ("edited", "InvalidSignature"), ("not json", "JSONDecodeError"),
    ("deep", "RecursionError"), ("release predicate", "not a Kiln channel statement"),
    ("expires first", "expires is not after issued"), ("bad time", "issued: not an RFC 3339 UTC time")])
def test_a_statement_that_is_not_the_publishers_is_one_line(keys, case, needle):
    st = statement()
    if case == "other key":
        bundle = signed(st, keys["other"])
    elif case == "edited":                            # the payload changed after signing (version 2 → 3)
        doc = json.loads(signed(st, keys["private"]))
        import base64

        raw = base64.b64decode(doc["dsseEnvelope"]["payload"]).replace(b'"version":2', b'"version":3')
        doc["dsseEnvelope"]["payload"] = base64.b64encode(raw).decode()
        bundle = json.dumps(doc).encode()
    elif case == "not json":
        bundle = b"{not json"
    elif case == "deep":
        bundle = b"[" * 100_000 + b"]" * 100_000
    else:                                             # signed by the publisher, but not a statement Kiln reads
        raw = channels.payload(st)
        if case == "release predicate":
            raw = raw.replace(channels.PREDICATE_TYPE.encode(), b"https://model_signing/signature/v1.0")
        elif case == "expires first":
            raw = raw.replace(st.expires.encode(), st.issued.encode())
        else:
            raw = raw.replace(st.issued.encode(), b"yesterday")
        bundle = signing.sign_statement(raw, keys["private"])
    with pytest.raises(GateFailed, match=needle) as e:
        channels.read(bundle, keys["public"], "REF: the channel statement")
    assert e.value.message.startswith("REF: the channel statement") and "\n" not in e.value.message


def test_a_statement_binds_to_its_repository_and_channel(keys):
    got = channels.read(signed(statement(), keys["private"]), keys["public"], "s")
    for repo, channel in (("evil/demo", "prod"), ("kiln/demo", "staging")):
        with pytest.raises(GateFailed, match="the channel statement is for kiln/demo:prod"):
            channels.bind(got, repo, channel)


def test_an_expired_or_future_statement_is_refused(keys):
    old = channels.read(signed(statement(issued=channels.now() - dt.timedelta(days=3), days=2), keys["private"]),
                        keys["public"], "s")
    with pytest.raises(GateFailed, match="expired at .*stale channel"):
        channels.fresh(old)
    ahead = channels.read(signed(statement(issued=channels.now() + dt.timedelta(hours=1)), keys["private"]),
                          keys["public"], "s")
    with pytest.raises(GateFailed, match="in this host's future"):
        channels.fresh(ahead)


def test_the_floor_refuses_an_older_statement_and_records_a_signed_rollback(keys, tmp_path):
    """TUF's rollback attack: once a host accepted v2's statement, v1's older statement (validly signed) is refused;
    a NEW statement pointing at v1 is a real rollback: accepted, and recorded as one in channels.log."""
    t0 = channels.now() - dt.timedelta(minutes=10)
    v1 = channels.read(signed(statement(1, t0), keys["private"]), keys["public"], "s")
    v2 = channels.read(signed(statement(2, t0 + dt.timedelta(minutes=1)), keys["private"]), keys["public"], "s")
    state = tmp_path / "state"
    assert channels.check_floor(v1, state) is None and channels.accept(v1, "reg/kiln/demo:prod", state) is None
    assert channels.check_floor(v2, state)["version"] == 1 and channels.accept(v2, "r", state) is None
    assert channels.check_floor(v2, state)["version"] == 2                     # the same statement again: fine
    with pytest.raises(GateFailed, match=r"older than the one this host already accepted \(v2"):
        channels.check_floor(v1, state)
    twin = channels.read(signed(statement(3, t0 + dt.timedelta(minutes=1)), keys["private"]), keys["public"], "s")
    with pytest.raises(GateFailed, match="refusing to roll back"):         # another statement, the same instant
        channels.check_floor(twin, state)
    back = channels.read(signed(statement(1, t0 + dt.timedelta(minutes=2), previous={"version": 2,
                                                                                    "issued": v2.issued}),
                                keys["private"]), keys["public"], "s")
    channels.check_floor(back, state)
    note = channels.accept(back, "r", state)
    assert note and "a signed rollback of kiln/demo:prod: v2 → v1" in note
    log = [json.loads(ln) for ln in (state / "channels.log").read_text(encoding="utf-8").splitlines()]
    assert [(e["version"], e["from_version"], e["rollback"]) for e in log] == [(1, None, False), (2, 1, False),
                                                                              (1, 2, True)]
    floors = json.loads((state / "channels.json").read_text(encoding="utf-8"))["channels"]
    assert floors["kiln/demo:prod"]["version"] == 1 and floors["kiln/demo:prod"]["statement"] == back.digest
    with pytest.raises(GateFailed, match="older than"):                     # and v2's statement is now below it
        channels.check_floor(v2, state)
    # other channels and repositories have floors of their own
    assert channels.check_floor(channels.read(signed(statement(1, t0, channel="staging"), keys["private"]),
                                              keys["public"], "s"), state) is None


def test_an_unwritable_or_damaged_floor_is_one_line(keys, tmp_path):
    st = channels.read(signed(statement(), keys["private"]), keys["public"], "s")
    (tmp_path / "file").write_text("x", encoding="utf-8")
    with pytest.raises(KilnError, match="cannot keep this host's channel floors"):
        channels.check_floor(st, tmp_path / "file" / "state")
    (tmp_path / "s").mkdir()
    for broken in ("{broken", '{"channels": []}', '{"channels": {"kiln/demo:prod": {"version": 2}}}',
                   '{"channels": {"kiln/demo:prod": {"version": 2, "statement": "x", "issued": "yesterday"}}}'):
        (tmp_path / "s" / "channels.json").write_text(broken, encoding="utf-8")      # never taken for no floor
        with pytest.raises(KilnError, match="channels.json: unreadable"):
            channels.check_floor(st, tmp_path / "s")
