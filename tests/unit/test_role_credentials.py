"""A secured local cluster's credentials contain each role (``ops.cluster.security``), without a
broker: one file per principal holding only that principal's password (0600, in 0700
directories); the admin password is in the admin's file only; a role's settings are built from
its own file (and the CA) alone, opening no other principal's; a cluster secured by an older
version (one ``credentials.json`` of every password) is split into those files and the shared
file removed, keeping every password.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from rlstream.ops.cluster import security
from rlstream.ops.run import acls


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_each_principal_has_a_file_of_its_own_secret_only(tmp_path: Path) -> None:
    security.ensure_secrets(tmp_path, acls.PRINCIPALS)
    creds = security.credentials(tmp_path)
    assert set(creds) == {"admin", *acls.PRINCIPALS} and len(set(creds.values())) == len(creds)
    for user, secret in creds.items():
        path = security.credentials_file(tmp_path, user)
        assert json.loads(path.read_text()) == {"user": user, "password": secret}
        assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
        others = [v for u, v in creds.items() if u != user]
        assert not any(other in path.read_text() for other in others), user
    assert not (security.secrets_dir(tmp_path) / "credentials.json").exists()
    assert _mode(security.secrets_dir(tmp_path)) == 0o700


def test_a_role_reads_its_own_file_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    security.ensure_secrets(tmp_path, acls.PRINCIPALS)
    admin = security.password(tmp_path, "admin")
    opened: list[Path] = []
    read_text = Path.read_text

    def spy(self: Path, *args: object, **kwargs: object) -> str:
        opened.append(self)
        return read_text(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", spy)
    settings = security.client_settings(tmp_path, "127.0.0.1:9", "rollout")
    assert settings.sasl_username == "rollout"
    assert opened == [security.credentials_file(tmp_path, "rollout")]
    assert admin not in json.dumps(settings.librdkafka(), default=str)
    # what a rollout host needs: its own file and the CA certificate, nothing else
    for user in ("admin", *acls.PRINCIPALS):
        if user != "rollout":
            security.credentials_file(tmp_path, user).unlink()
    (security.secrets_dir(tmp_path) / "broker.pem").unlink()
    assert security.client_settings(tmp_path, "127.0.0.1:9", "rollout").sasl_password
    with pytest.raises(KeyError, match="acl apply"):
        security.client_settings(tmp_path, "127.0.0.1:9", "admin")


def test_an_older_shared_credentials_file_is_split_and_removed(tmp_path: Path) -> None:
    folder = security.secrets_dir(tmp_path)
    folder.mkdir(parents=True)
    old = {"admin": "admin-secret", "rollout": "rollout-secret"}
    security.write_private(folder / "credentials.json", json.dumps(old).encode())
    assert security.password(tmp_path, "rollout") == "rollout-secret"  # split on first use
    assert not (folder / "credentials.json").exists()
    security.ensure_secrets(tmp_path, ("rollout", "judge"))
    creds = security.credentials(tmp_path)
    assert creds["admin"] == "admin-secret" and creds["rollout"] == "rollout-secret"
    assert set(creds) == {"admin", "rollout", "judge"}
