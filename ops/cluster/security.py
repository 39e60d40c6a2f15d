"""A secured local cluster (``rlstream cluster up --secure``): who may connect, and how.

Clients speak SASL_SSL (TLS with the cluster's own CA, then SCRAM-SHA-512); the controller
listener requires mutual TLS; ``StandardAuthorizer`` denies what no ACL allows (``ops.run.acls``).
Principals: ``admin``, the broker, one user per role and per service, one per MirrorMaker link.

Rules a maintainer must keep:
- secrets live in ``HOME/secrets`` (0700, every file 0600), one credentials file per principal;
- a role is contained: it reads its own file and the CA certificate only, and no role's file
  holds another principal's secret;
- nothing here prints or logs a password (``KafkaSettings`` keeps it as a ``SecretStr``).

Details: docs/security.md (The secured local cluster).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlstream.producers.client.settings import KafkaSettings

ADMIN = "admin"
BROKER_CN = "rlstream-broker"
MECHANISM = "SCRAM-SHA-512"
PROTOCOL = "SASL_SSL"
CERT_DAYS = 3650
_LEGACY = "credentials.json"


def secrets_dir(home: Path) -> Path:
    return Path(home) / "secrets"


def weights_key_file(home: Path, run: str) -> Path:
    """Where a secured cluster keeps run ``run``'s weight-signing key (made by ``acl apply``;
    a role started there is given its part: ``consumers.weights.trust.key_folder_env``)."""
    return secrets_dir(home) / "weights" / run / "weights-signing-key.pem"


def ca_file(home: Path) -> Path:
    return secrets_dir(home) / "ca.pem"


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by its owner only (0600 from creation on)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(path, 0o600)


def ensure_secrets(home: Path, users: tuple[str, ...] = ()) -> None:
    """Create the CA, the broker's key and certificate and a password per user (``admin`` and
    ``users``), each in its own file, keeping every one that exists already."""
    folder = secrets_dir(home)
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    if not (folder / "ca.pem").exists() or not (folder / "broker.pem").exists():
        ca_pem, broker_pem = _certificates()
        write_private(folder / "ca.pem", ca_pem)
        write_private(folder / "broker.pem", broker_pem)
    _split_legacy(home)
    for user in (ADMIN, *users):
        if not credentials_file(home, user).exists():
            _write_credentials(home, user, secrets.token_urlsafe(24))


def credentials_file(home: Path, user: str) -> Path:
    """The file holding ``user``'s password, and nothing else (see the module rules)."""
    if not user or "/" in user or user.startswith("."):
        raise ValueError(f"not a principal name: {user!r}")
    return secrets_dir(home) / "users" / f"{user}.json"


def _write_credentials(home: Path, user: str, secret: str) -> None:
    path = credentials_file(home, user)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    write_private(path, json.dumps({"user": user, "password": secret}).encode())


def _split_legacy(home: Path) -> None:
    """One file per principal from an older ``credentials.json`` of every password (then
    removed, so no file holds more than one principal's secret)."""
    legacy = secrets_dir(home) / _LEGACY
    if not legacy.exists():
        return
    for user, secret in dict(json.loads(legacy.read_text())).items():
        if not credentials_file(home, user).exists():
            _write_credentials(home, user, secret)
    legacy.unlink()


def credentials(home: Path) -> dict[str, str]:
    """user -> password of every principal of the secured cluster at ``home`` (the admin side's
    view, e.g. ``acl apply``; empty when none was generated). A role never calls this."""
    folder = secrets_dir(home) / "users"
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    return {f.stem: password(home, f.stem) for f in files}


def password(home: Path, user: str) -> str:
    """``user``'s password, read from its own file only."""
    path = credentials_file(home, user)
    if not path.exists() and (secrets_dir(home) / _LEGACY).exists():
        _split_legacy(home)  # a cluster secured by an older version
    if not path.exists():
        raise KeyError(
            f"no credentials for user {user!r} in {path.parent}; "
            "`rlstream acl apply --run RUN` creates the role users"
        )
    return str(json.loads(path.read_text())["password"])


def client_settings(home: Path, bootstrap: str, user: str = ADMIN) -> KafkaSettings:
    """How ``user`` reaches the secured cluster at ``home``: SASL_SSL with SCRAM-SHA-512,
    trusting the cluster's CA only."""
    return KafkaSettings(
        bootstrap_servers=bootstrap,
        security_protocol=PROTOCOL,
        sasl_mechanism=MECHANISM,
        sasl_username=user,
        sasl_password=password(home, user),
        ssl_ca_location=str(ca_file(home)),
    )


def mirror_client_properties(home: Path, alias: str, user: str) -> list[str]:
    """MirrorMaker 2's per-cluster client overrides (``ALIAS.security.protocol`` ...), which its
    Connect worker, connectors and their producers, consumers and admin clients all take up."""
    jaas = (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{user}" password="{password(home, user)}";'
    )
    return [
        f"{alias}.security.protocol = {PROTOCOL}",
        f"{alias}.sasl.mechanism = {MECHANISM}",
        f"{alias}.sasl.jaas.config = {jaas}",
        f"{alias}.ssl.truststore.type = PEM",
        f"{alias}.ssl.truststore.location = {ca_file(home)}",
    ]


def authorize(
    admin_settings: KafkaSettings,
    home: Path,
    users: Iterable[str],
    grants: Iterable[Any],
    timeout: float = 30.0,
) -> None:
    """As ``admin_settings``'s super user, create (or set again, to the same password) the SCRAM
    credential of each of ``users`` (generated once in ``home``) and the ALLOW ACLs of
    ``grants`` (``ops.run.acls.Grant``) in the cluster it reaches. Kafka keeps one copy of an ACL
    created twice, so this is idempotent."""
    from rlstream.producers.client.admin import admin_client

    users = tuple(users)
    ensure_secrets(home, users)
    admin = admin_client(admin_settings)
    _upsert_users(admin, {u: password(home, u) for u in users}, timeout)
    bindings = [_binding(g) for g in grants]
    if bindings:
        for future in admin.create_acls(bindings, request_timeout=timeout).values():
            future.result()


def _upsert_users(admin: Any, passwords: dict[str, str], timeout: float) -> None:
    from confluent_kafka.admin import (
        ScramCredentialInfo,
        ScramMechanism,
        UserScramCredentialUpsertion,
    )

    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192)
    upserts = [UserScramCredentialUpsertion(u, info, p.encode()) for u, p in passwords.items()]
    if not upserts:
        return
    for future in admin.alter_user_scram_credentials(upserts, request_timeout=timeout).values():
        future.result()


def _binding(grant: Any) -> Any:
    """The confluent_kafka ``AclBinding`` of an ``acls.Grant`` (ALLOW, any host)."""
    from confluent_kafka.admin import (
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    return AclBinding(
        ResourceType[grant.resource.upper()],
        grant.name,
        ResourcePatternType[grant.pattern.upper()],
        f"User:{grant.principal}",
        "*",
        AclOperation[grant.operation.upper()],
        AclPermissionType.ALLOW,
    )


def broker_properties(home: Path, broker_port: int, controller_port: int) -> dict[str, str]:
    """The server.properties lines of a secured region (see the module docstring)."""
    folder = secrets_dir(home)
    admin_password = password(home, ADMIN)
    jaas = (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{ADMIN}" password="{admin_password}";'
    )
    return {
        "listeners": (
            f"{PROTOCOL}://127.0.0.1:{broker_port},CONTROLLER://127.0.0.1:{controller_port}"
        ),
        "advertised.listeners": f"{PROTOCOL}://127.0.0.1:{broker_port}",
        "listener.security.protocol.map": f"CONTROLLER:SSL,{PROTOCOL}:{PROTOCOL}",
        "inter.broker.listener.name": PROTOCOL,
        "sasl.enabled.mechanisms": MECHANISM,
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        f"listener.name.{PROTOCOL.lower()}.{MECHANISM.lower()}.sasl.jaas.config": jaas,
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(folder / "broker.pem"),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(folder / "ca.pem"),
        "listener.name.controller.ssl.client.auth": "required",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:{ADMIN};User:CN={BROKER_CN}",
    }


def format_args(home: Path) -> list[str]:
    """StorageTool arguments that store the admin user's SCRAM credential at format time."""
    return ["--add-scram", f"{MECHANISM}=[name={ADMIN},password={password(home, ADMIN)}]"]


def _certificates() -> tuple[bytes, bytes]:
    """A fresh CA (PEM certificate) and the broker's PEM keystore: its unencrypted PKCS#8 key,
    then its certificate (CN ``BROKER_CN``, valid for 127.0.0.1 and localhost) and the CA's."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rlstream local CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, BROKER_CN)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    ca_pem = ca.public_bytes(pem)
    return ca_pem, key_pem + cert.public_bytes(pem) + ca_pem
