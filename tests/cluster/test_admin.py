"""The admin endpoints' key rule (``duet.cluster.admin``), and the client keys a config gives."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from duet.cluster.admin import admin_refusal
from duet.cluster.config import AppConfigError, RouterSettings


def _request(token: str | None) -> Request:
    headers = [] if token is None else [(b"authorization", f"Bearer {token}".encode())]
    return Request({"type": "http", "method": "GET", "path": "/duet/status", "headers": headers})


def test_only_the_admin_key_opens_the_admin_endpoints():
    admin = [b"admin-key"]
    assert admin_refusal(_request("admin-key"), admin, has_client_keys=True) is None
    for token in ("client-key", None, "admin-ke"):
        assert admin_refusal(_request(token), admin, has_client_keys=True).status == 401


def test_client_keys_without_an_admin_key_close_the_admin_endpoints():
    """Guards a client key pinning a pool's size: with client keys but no admin key, no key opens /duet/."""
    refusal = admin_refusal(_request("client-key"), [], has_client_keys=True)
    assert refusal.status == 403 and "router.admin_api_key" in refusal.message


def test_an_open_server_has_open_admin_endpoints():
    assert admin_refusal(_request(None), [], has_client_keys=False) is None


def test_client_keys_come_from_the_setting_a_file_and_the_environment(tmp_path, monkeypatch):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nteam-a\n\n  team-b  \n")
    monkeypatch.setenv("DUET_API_KEY", "from-env")
    settings = RouterSettings(api_key=["one", "two"], api_keys_file=str(keys_file))
    assert settings.client_keys() == ["one", "two", "team-a", "team-b", "from-env"]
    monkeypatch.delenv("DUET_API_KEY")
    assert RouterSettings(api_key="single").client_keys() == ["single"]
    assert RouterSettings().client_keys() == []


def test_an_unreadable_keys_file_or_an_empty_key_is_refused_with_the_setting_named(tmp_path):
    with pytest.raises(AppConfigError, match="router.api_keys_file: cannot read"):
        RouterSettings(api_keys_file=str(tmp_path / "missing")).client_keys()
    with pytest.raises(ValueError, match="may not be empty"):
        RouterSettings(api_key=["ok", " "])
