"""API keys: which tenant a caller is, from the ``authorization: Bearer KEY`` metadata.

The key file holds one ``TENANT_ID SHA256_HEX_OF_KEY`` line per key (``#`` comments and blank lines
ignored), so it holds no usable secret: reading it does not let anyone call the API. A tenant may
have several keys (rotation). Keys are looked up by their SHA-256, never compared as text.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cachestore.secret_files import SecretFileError, field_lines

_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
BEARER = "bearer "


def key_line(tenant: str, key: str) -> str:
    """The key file's line for ``tenant``'s ``key``, as ``ApiKeys.load`` reads it: the key's SHA-256
    in hex, never the key."""
    return f"{tenant} {hashlib.sha256(key.encode()).hexdigest()}\n"


@dataclass(frozen=True)
class ApiKeys:
    tenant_by_digest: dict[bytes, str] = field(repr=False)

    @classmethod
    def load(cls, path: Path) -> ApiKeys:
        tenants: dict[bytes, str] = {}
        for where, parts in field_lines(path, "API key file"):
            if len(parts) == 3 and parts[2] == "-":
                raise SecretFileError(f"{where}: a third field '-': that is what sha256sum prints after the digest; "
                                      f"keep only the digest (printf %s \"$KEY\" | sha256sum | cut -d' ' -f1)")
            if len(parts) != 2:
                raise SecretFileError(f"{where}: expected 'TENANT_ID SHA256_HEX_OF_KEY' (two fields), got {len(parts)}")
            tenant, digest = parts[0], parts[1].lower()
            if not _TENANT.fullmatch(tenant):
                raise SecretFileError(f"{where}: tenant id must be 1 to 64 of A-Z a-z 0-9 . _ -")
            if not _SHA256_HEX.fullmatch(digest):
                raise SecretFileError(f"{where}: the second field must be the SHA-256 of the key in hex (64 digits), "
                                      "e.g. printf %s \"$KEY\" | sha256sum | cut -d' ' -f1; never the key itself")
            if bytes.fromhex(digest) in tenants:
                raise SecretFileError(f"{where}: this key digest is listed twice")
            tenants[bytes.fromhex(digest)] = tenant
        if not tenants:
            raise SecretFileError(f"{path}: no key: write one 'TENANT_ID SHA256_HEX_OF_KEY' line")
        return cls(tenants)

    def tenant(self, metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
        """The tenant of the first ``authorization: Bearer KEY`` entry whose key is known, else None."""
        for name, value in metadata:
            if name != "authorization" or not isinstance(value, str) or not value.lower().startswith(BEARER):
                continue
            found = self.tenant_by_digest.get(hashlib.sha256(value[len(BEARER):].strip().encode()).digest())
            if found is not None:
                return found
        return None
