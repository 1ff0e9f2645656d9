"""Which authentication backends MQTT clients meet, in which order, and their settings.

`--auth-order builtin,jwt,http` (default: builtin, then each backend that has settings).
Settings are checked once at start-up (`BackendConfig.check`, ValueError naming the flag)
so a bad one stops the process before it serves; the backends themselves are built by
the AuthManager (`build_backends`).
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from serving.settings import setting

if TYPE_CHECKING:  # the command line reads these settings without loading the store
    from store.api import Backend

log = logging.getLogger("lightgate.auth")

BACKENDS = ("builtin", "jwt", "http")
HMAC_ALGORITHMS = ("HS256", "HS384", "HS512")
PUBLIC_KEY_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256",
                         "ES384", "ES512", "EdDSA")


@dataclass
class BackendConfig:
    """The settings of MQTT's authentication backends; each flag is `--auth-` and the
    field's name (lightgate.settings)."""

    order: tuple[str, ...] | None = setting(  # None: builtin, then whatever is configured
        None, "MQTT authentication backends in order, first definite answer wins: "
        "builtin,jwt,http (default: builtin, then each one configured); any but builtin "
        "turns authentication on", type=str)
    jwt_secret: str | None = setting(
        None, "JWT in the password, HS256 with this secret (VALUE or @FILE)")
    jwt_jwks: str | None = setting(
        None, "JWT in the password, RS256/ES256 with the keys of this JWKS file or "
        "http(s) URL")
    jwt_jwks_refresh_s: float = setting(300.0, "re-read the JWKS this often", above=0)
    jwt_algorithms: tuple[str, ...] | None = setting(  # None: HS256 and/or RS256,ES256
        None, "accepted JWT algorithms, comma list (default: HS256 with a secret, "
        "RS256,ES256 with a JWKS)", type=str)
    http_url: str | None = setting(None, "POST CONNECTs (JSON) to this auth hook URL")
    http_timeout_s: float = setting(5.0, "how long to wait for the auth hook", above=0)
    http_cache_s: float = setting(30.0, "remember the hook's answers this long (0: never)",
        least=0)
    http_on_error: str = setting(
        "deny", "when the hook fails or times out: deny, allow or next (ask the next "
        "backend)", choices=("deny", "allow", "next"))  # http_hook.ON_ERROR (it loads httpx)
    http_acl: bool = setting(
        False, "also ask the hook for each PUBLISH/SUBSCRIBE of the clients it let in")

    @property
    def chain(self) -> tuple[str, ...]:
        if self.order is not None:
            return self.order
        return ("builtin",) + (("jwt",) if self.jwt_secret or self.jwt_jwks else ()) + (
            ("http",) if self.http_url else ())

    @property
    def external(self) -> bool:
        """Whether a backend beyond the built-in users is on (which turns auth on)."""
        return any(name != "builtin" for name in self.chain)

    @property
    def algorithms(self) -> tuple[str, ...]:
        if self.jwt_algorithms:
            return self.jwt_algorithms
        return (("HS256",) if self.jwt_secret else ()) + (
            ("RS256", "ES256") if self.jwt_jwks else ())

    def secret_bytes(self) -> bytes | None:
        """The HMAC secret: the value itself, or the contents of @FILE (one trailing
        newline dropped, as editors add one)."""
        if not self.jwt_secret:
            return None
        if self.jwt_secret.startswith("@"):
            data = Path(self.jwt_secret[1:]).read_bytes()
            return data[:-1] if data.endswith(b"\n") else data
        return self.jwt_secret.encode()

    def check(self) -> None:
        """ValueError with the flag to fix, for any setting that cannot work."""
        chain = self.chain
        bad = [n for n in chain if n not in BACKENDS]
        if bad or not chain or len(set(chain)) != len(chain):
            raise ValueError(f"--auth-order takes a comma list of {', '.join(BACKENDS)}, each "
                             f"once (got {','.join(chain) or 'nothing'})")
        jwt_set = bool(self.jwt_secret or self.jwt_jwks)
        if "jwt" in chain and not jwt_set:
            raise ValueError("the jwt backend needs --auth-jwt-secret VALUE|@FILE or "
                             "--auth-jwt-jwks FILE|URL")
        if jwt_set and "jwt" not in chain:
            raise ValueError("--auth-jwt-secret/--auth-jwt-jwks given but --auth-order leaves "
                             "jwt out")
        if "http" in chain and not self.http_url:
            raise ValueError("the http backend needs --auth-http-url URL")
        if self.http_url and "http" not in chain:
            raise ValueError("--auth-http-url given but --auth-order leaves http out")
        if "jwt" in chain:
            self._check_jwt()
        if "http" in chain:
            self._check_http()

    def _check_jwt(self) -> None:
        if self.jwt_secret:
            try:
                secret = self.secret_bytes()
            except OSError as exc:
                raise ValueError(f"--auth-jwt-secret {self.jwt_secret}: {exc.strerror}") from None
            if not secret:
                raise ValueError("--auth-jwt-secret is empty")
        for alg in self.algorithms:
            if alg in HMAC_ALGORITHMS:
                if not self.jwt_secret:
                    raise ValueError(f"--auth-jwt-algorithms {alg} needs --auth-jwt-secret")
            elif alg in PUBLIC_KEY_ALGORITHMS:
                if not self.jwt_jwks:
                    raise ValueError(f"--auth-jwt-algorithms {alg} needs --auth-jwt-jwks")
            else:
                raise ValueError(f"--auth-jwt-algorithms: unknown algorithm {alg!r} (use "
                                 f"{', '.join(HMAC_ALGORITHMS + PUBLIC_KEY_ALGORITHMS)})")
        if self.jwt_jwks:
            from gateway.auth.jwt_backend import is_url, parse_jwks

            if self.jwt_jwks.startswith("http://") and not _loopback(self.jwt_jwks):
                raise ValueError(f"--auth-jwt-jwks {self.jwt_jwks}: keys over plain http "
                                 "can be swapped on the way, and any token signed with "
                                 "them would pass: use https:// (http only to loopback)")

            if not is_url(self.jwt_jwks):  # a URL may be down at start: it is retried
                try:
                    parse_jwks(Path(self.jwt_jwks).read_bytes())
                except OSError as exc:
                    raise ValueError(f"--auth-jwt-jwks {self.jwt_jwks}: {exc.strerror}") \
                        from None
                except ValueError as exc:
                    raise ValueError(f"--auth-jwt-jwks {self.jwt_jwks}: {exc}") from None
        secret = self.secret_bytes()
        if secret is not None and len(secret) < 32:  # after the errors: they print alone
            # RFC 7518 §3.2: an HS256 key at least as long as the hash
            log.warning("--auth-jwt-secret is %d bytes: HS256 wants at least 32", len(secret))

    def _check_http(self) -> None:
        assert self.http_url is not None
        if not self.http_url.startswith(("http://", "https://")):
            raise ValueError(f"--auth-http-url must be an http:// or https:// URL, not "
                             f"{self.http_url!r}")


def _loopback(url: str) -> bool:
    """Whether the URL's host is this machine (localhost, 127.0.0.0/8, ::1)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_list(value: Any) -> tuple[str, ...] | None:
    """A comma list from a flag or env, or a TOML list; None when not set."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    return tuple(i.strip() for i in items if i.strip())


def build_backends(cfg: BackendConfig, builtin: Backend) -> list[Backend]:
    """The backends in `cfg.chain` order; `builtin` is the manager's own. Imported here,
    not at the top: PyJWT and httpx load only when a deployment uses them."""
    out: list[Backend] = []
    for name in cfg.chain:
        if name == "builtin":
            out.append(builtin)
        elif name == "jwt":
            from gateway.auth.jwt_backend import JwksSource, JwtBackend

            jwks = JwksSource(cfg.jwt_jwks, cfg.jwt_jwks_refresh_s) if cfg.jwt_jwks else None
            out.append(JwtBackend(cfg.secret_bytes(), jwks, cfg.algorithms))
        elif name == "http":
            from gateway.auth.http_hook import HttpHook

            assert cfg.http_url is not None
            out.append(HttpHook(cfg.http_url, timeout_s=cfg.http_timeout_s,
                                cache_s=cfg.http_cache_s, on_error=cfg.http_on_error,
                                acl=cfg.http_acl))
    return out
