"""Users, policies and the decisions over them, kept in memory and stored in metadata.

One `AuthManager` per process. On a storage node it owns the data (changes write the
`users` and `acl` column families, then tell other nodes with `AUTH_EVENT`); on a
gateway node it is a replica, reloaded on that event and every few seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import trio

from serving.values import split_credentials
from store.auth import audit
from store.auth.backends import ALLOW, IGNORE, Backend, Credentials, Decision
from store.auth.backoff import FailureBackoff
from store.auth.changes import policy_changes, user_changes
from store.auth.passwords import PasswordChecker, hash_password, make_verifier
from store.auth.policy import EVERYONE, Policy, decide
from store.auth.topic_acl import TopicAcl
from store.config import AuthConfig

log = logging.getLogger("lightgate.auth")

AUTH_EVENT = "\x00auth"  # a notify name no topic can have (MQTT forbids U+0000)
STORED_IN = ("users", "acl")  # the metadata column families users and policies live in
ANONYMOUS = "anonymous"  # the policy subject of clients without a username
RESERVED_NAMES = (EVERYONE, ANONYMOUS, "")
# The policy subject an outside identity is decided as when it brings no ACL of its own:
# a name no user can have, so only the "*" policies match it.
OUTSIDER = "\0outsider"
_DUMMY_HASH = hash_password("not a password")  # equal work for unknown users


class AuthError(Exception):
    """Authentication failed; `reason` goes to the audit log, never to the client."""

    def __init__(self, reason: str, disabled: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.disabled = disabled


@dataclass
class User:
    name: str
    password: str  # scrypt hash
    super: bool = False
    enabled: bool = True
    created: float = field(default_factory=time.time)
    # SCRAM-SHA-256 verifier, made with the password; None for users whose password was
    # set before SCRAM support (SCRAM fails for them until it is set again)
    scram: str | None = None
    # A node (a gateway joining the store): it makes the requests only nodes make, reads
    # users and policies (it checks MQTT passwords itself) and every queue. A role of its
    # own, so that no policy (an operator's Cluster UPDATE) ever makes one by accident.
    node: bool = False

    def public(self) -> dict[str, Any]:
        return {"name": self.name, "super": self.super, "node": self.node,
                "enabled": self.enabled, "created": self.created}


@dataclass(frozen=True, slots=True)  # slots: one per connection
class Subject:
    """Who is on the other end of one connection; `name` is "" for anonymous."""

    name: str
    ip: str
    via: str  # mqtt | native | http
    backend: str = "builtin"  # who let it in: builtin | jwt | http
    client_id: str = ""
    acl: TopicAcl | None = None  # its own ACL (token claim, hook answer) instead of policies
    super_user: bool = False  # the hook said is_superuser
    expires: float | None = None  # epoch seconds its credentials lapse (a token's exp)

    @property
    def outsider(self) -> bool:
        """Vouched for by a JWT or the HTTP hook: not one of the built-in users, even if
        a built-in user has the same name."""
        return self.backend != "builtin"


class DecisionCache:
    """Stateful strategy: one decision per connection, resource and action, until the
    users or policies change. At most MAX_ENTRIES, oldest out first: topic names come
    from the client, so one publishing to ever new topics must not grow it without end."""

    MAX_ENTRIES = 1024

    def __init__(self) -> None:
        self.version = -1
        self.entries: dict[tuple, bool] = {}

    def put(self, key: tuple, ok: bool) -> None:
        entries = self.entries
        if len(entries) >= self.MAX_ENTRIES:
            del entries[next(iter(entries))]
        entries[key] = ok


class BuiltinUsers:
    """The built-in users as a backend. An unknown name is no definite answer (a JWT or
    the hook may know it); a wrong password or a disabled user is."""

    name = "builtin"

    def __init__(self, manager: AuthManager) -> None:
        self._m = manager

    async def authenticate(self, creds: Credentials) -> Decision:
        users = self._m.users
        cert = creds.cert_cn
        if cert:  # a client certificate the TLS layer verified
            user = users.get(cert)
            if user is not None and user.enabled:
                return Decision.allow("", name=cert)
            reason = f"certificate user {cert!r} unknown or disabled"
            return Decision.deny(reason, disabled=True) if user else Decision.ignore(reason)
        if not creds.username:
            return Decision.ignore("anonymous access is off")
        user = users.get(creds.username)
        encoded = user.password if user is not None else _DUMMY_HASH
        password = creds.password or ""
        checker = self._m._checker
        ok = checker.cached(password, encoded) or await trio.to_thread.run_sync(
            checker.verify, password, encoded)
        if user is None:
            return Decision.ignore("bad username or password")
        if not ok:
            return Decision.deny("bad username or password")
        if not user.enabled:
            return Decision.deny("user disabled", disabled=True)
        return Decision.allow("")


class AuthManager:
    def __init__(self, store: Any, *, enabled: bool = False, allow_anonymous: bool = False,
                 strategy: str = "stateful",
                 notify: Callable[[set[str]], None] | None = None) -> None:
        if strategy not in ("stateful", "stateless"):
            raise ValueError("auth strategy must be stateful or stateless")
        self.store = store
        self.enabled = enabled
        self.allow_anonymous = allow_anonymous
        self.stateful = strategy == "stateful"
        self.notify = notify
        self.users: dict[str, User] = {}
        self.policies: list[Policy] = []
        self.version = 0
        self.backoff = FailureBackoff()
        self.auth_failures = 0
        self.denials = 0
        self._checker = PasswordChecker()
        self._listeners: list[Callable[[], None]] = []
        self._copy_landed: trio.Event | None = None  # see reload_on_copy
        # The native protocol and the HTTP API know only the built-in users (server apps
        # and operators are not devices); MQTT clients may meet more (gateway.auth).
        self.builtin = BuiltinUsers(self)

    @classmethod
    async def start(cls, store: Any, cfg: AuthConfig,
                    notify: Callable[[set[str]], None] | None = None) -> AuthManager:
        """The storage node's manager: loaded, with the initial user, checked usable."""
        if cfg.audit_log:
            audit.to_file(cfg.audit_log)
        enabled = cfg.on
        auth = cls(store, enabled=enabled, allow_anonymous=cfg.allow_anonymous,
                   strategy=cfg.strategy, notify=notify)
        await auth.load()
        if cfg.init_user:
            await auth.ensure_super_user(cfg.init_user)
        if enabled and not any(u.super and u.enabled for u in auth.users.values()):
            why = "--auth" if cfg.enabled else (
                f"--auth-order {','.join(cfg.mqtt_chain)} turns authentication on and")
            raise ValueError(f"{why} needs a Super user (the native port and the dashboard "
                             "know only built-in users): start once with "
                             "--init-user NAME:PASSWORD")
        if enabled:
            log.info("authentication on: %d users, %d policies, %s, anonymous %s, MQTT "
                     "backends %s", len(auth.users), len(auth.policies), cfg.strategy,
                     "allowed" if cfg.allow_anonymous else "refused",
                     ",".join(cfg.mqtt_chain))
        return auth

    # -- loading and change -----------------------------------------------------------
    async def load(self) -> None:
        users = {k: User(**v) for k, v in await self.store.meta_items("users")}
        policies = []
        for key, value in await self.store.meta_items("acl"):
            try:
                policies.append(Policy.from_dict(value))
            except (KeyError, ValueError) as exc:
                log.error("ignoring a bad policy %r: %s", key, exc)
        changed = users != self.users or policies != self.policies
        self.users, self.policies = users, policies
        if changed:
            self.version += 1
            for listener in self._listeners:
                listener()

    async def reread(self) -> list[str]:
        """Load users and policies again (SIGHUP), and what changed since the copy in
        memory, one line each. A change reaches the connections as any other does
        (`on_change`: sessions of disabled users end, cached decisions and the native
        plane's ACL caches are dropped)."""
        users, policies = self.users, self.policies
        await self.load()
        return [*user_changes(users, self.users), *policy_changes(policies, self.policies)]

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` (in the trio thread) after users or policies changed."""
        self._listeners.append(listener)

    async def _changed(self) -> None:
        await self.load()
        if self.notify is not None:
            self.notify({AUTH_EVENT})

    async def run_refresh(self, interval: float = 5.0) -> None:
        """Replicas: reload now and then, in case a change event was missed."""
        while True:
            await trio.sleep(interval)
            try:
                await self.load()
            except Exception as exc:  # the store may be away; keep the last copy
                log.debug("auth reload failed: %s", exc)

    def reload_on_copy(self, meta: Any) -> None:
        """A store group's node: reload when its copy of the master's metadata writes
        users or policies (a replica makes no changes of its own, so `_changed` never
        runs there). Reloads run in `run_copy_reloads`, one at a time, so an older read
        never lands after a newer one; copies that land meanwhile make one more."""
        token = trio.lowlevel.current_trio_token()
        self._copy_landed = trio.Event()

        def copied(cfs: set[str]) -> None:  # in the thread that wrote the copy
            if not cfs.isdisjoint(STORED_IN):
                try:
                    token.run_sync_soon(self._wake_copy_reload)
                except trio.RunFinishedError:
                    pass

        meta.on_copied = copied

    def _wake_copy_reload(self) -> None:
        if self._copy_landed is not None:
            self._copy_landed.set()

    async def run_copy_reloads(self) -> None:
        while self._copy_landed is not None:
            await self._copy_landed.wait()
            self._copy_landed = trio.Event()
            try:
                await self.load()
            except Exception as exc:  # noqa: BLE001 - kept: the next copy retries
                log.warning("reloading copied users and policies failed: %s", exc)

    # -- users ------------------------------------------------------------------------
    async def add_user(self, name: str, password: str, *, super_user: bool = False,
                       node: bool = False) -> User:
        _check_name(name)
        if not password:
            raise ValueError("a password is needed")
        if name in self.users:
            raise ValueError(f"user {name!r} exists")
        hashed = await trio.to_thread.run_sync(hash_password, password)
        verifier = await trio.to_thread.run_sync(make_verifier, password)
        user = User(name, hashed, super_user, scram=verifier, node=node)
        await self.store.meta_put("users", name, asdict(user))
        await self._changed()
        log.info("user %r added (%s)", name,
                 "super" if super_user else "node" if node else "normal")
        return user

    async def update_user(self, name: str, *, password: str | None = None,
                          enabled: bool | None = None, super_user: bool | None = None,
                          node: bool | None = None) -> User:
        user = replace(self._user(name))  # a copy: `load` sees the change
        if password:
            user.password = await trio.to_thread.run_sync(hash_password, password)
            user.scram = await trio.to_thread.run_sync(make_verifier, password)
        if enabled is not None:
            user.enabled = enabled
        if super_user is not None:
            user.super = super_user
        if node is not None:
            user.node = node
        await self.store.meta_put("users", name, asdict(user))
        await self._changed()
        return user

    async def delete_user(self, name: str) -> None:
        self._user(name)
        ops: list[tuple[str, str, str, Any]] = [("delete", "users", name, None)]
        ops += [("delete", "acl", p.key, None) for p in self.policies if p.user == name]
        await self.store.meta_write(ops)
        await self._changed()

    def _user(self, name: str) -> User:
        user = self.users.get(name)
        if user is None:
            raise KeyError(f"no user {name!r}")
        return user

    async def ensure_super_user(self, spec: str) -> None:
        """`--init-user NAME:PASSWORD`: create this Super user unless it exists."""
        name, password = split_credentials(spec, "--init-user")
        if not password:
            raise ValueError("--init-user takes NAME:PASSWORD")
        if name not in self.users:
            await self.add_user(name, password, super_user=True)

    # -- policies ---------------------------------------------------------------------
    async def add_policy(self, policy: Policy) -> Policy:
        if policy.user not in (EVERYONE, ANONYMOUS) and policy.user not in self.users:
            raise KeyError(f"no user {policy.user!r}")
        await self.store.meta_put("acl", policy.key, policy.to_dict())
        await self._changed()
        return policy

    async def delete_policies(self, user: str, resource: str | None = None,
                              match: str | None = None) -> int:
        doomed = [p for p in self.policies if p.user == user
                  and (resource is None or p.resource == _canonical(resource, match))
                  and (match is None or p.match == match.lower())]
        if doomed:
            await self.store.meta_write([("delete", "acl", p.key, None) for p in doomed])
            await self._changed()
        return len(doomed)

    def list_policies(self, user: str | None = None) -> list[dict[str, Any]]:
        return [p.to_dict() for p in self.policies if user is None or p.user == user]

    # -- decisions --------------------------------------------------------------------
    async def authenticate(self, username: str | None, password: str | None, ip: str,
                           via: str, cert_identity: str | None = None,
                           client_id: str = "", chain: Sequence[Backend] = ()) -> Subject:
        """The subject for these credentials, or AuthError (after the brute-force delay).
        `chain`: the backends to ask in order (MQTT's, gateway.auth); the built-in users
        alone when empty."""
        if not self.enabled:
            return Subject(username or "", ip, via)
        delay = self.backoff.delay(ip)
        if delay:
            await trio.sleep(delay)
        try:
            subject, reason = await self._authenticate(
                Credentials(client_id, username, password, ip, cert_identity), via,
                chain or (self.builtin,))
        except AuthError as exc:
            self.backoff.failed(ip)
            self.auth_failures += 1
            audit.authentication(username or cert_identity or "", ip, via, False, exc.reason)
            raise
        self.backoff.succeeded(ip)
        audit.authentication(subject.name, ip, via, True, reason)
        return subject

    async def _authenticate(self, creds: Credentials, via: str, chain: Sequence[Backend]
                            ) -> tuple[Subject, str]:
        """Ask the backends in order; the first allow or deny decides."""
        ignored = []
        for backend in chain:
            d = await _ask(backend, creds)
            if d.outcome == IGNORE:
                ignored.append(d.reason)
                continue
            if d.outcome != ALLOW:
                raise AuthError(d.reason, disabled=d.disabled)
            if d.expires is not None and d.expires <= time.time():  # a cached hook answer
                raise AuthError(f"{backend.name}: credentials expired")
            name = d.name if d.name is not None else creds.username or ""
            return Subject(name, creds.ip, via, backend.name, creds.client_id, d.acl,
                           d.super_user, d.expires), d.reason
        if not creds.username and not creds.cert_cn and self.allow_anonymous:
            return Subject("", creds.ip, via, client_id=creds.client_id), ""
        # No definite answer: what the first backend saw ("bad username or password", or
        # "anonymous access is off"), then the others'.
        raise AuthError("; ".join(dict.fromkeys(ignored)) or "no backend knows this client")

    # -- proofs made elsewhere (MQTT 5 enhanced authentication, gateway.auth) --------
    def scram_verifier(self, name: str) -> str | None:
        """The user's SCRAM verifier; "" for a user whose password was set before there
        were verifiers; None for no such user."""
        user = self.users.get(name)
        return None if user is None else user.scram or ""

    async def backoff_wait(self, ip: str) -> None:
        """The brute-force delay before a proof from `ip`, as before a password check."""
        delay = self.backoff.delay(ip)
        if delay:
            await trio.sleep(delay)

    def proved(self, method: str, user_name: str | None, ok: bool, reason: str, ip: str,
               via: str, client_id: str = "") -> Subject:
        """The subject an exchange (`method`) proved to be built-in user `user_name`, or
        AuthError; audited and counted for the brute-force delay like a password."""
        user = self.users.get(user_name or "") if ok else None
        if user is None or not user.enabled:
            reason = reason or (f"{method}: user disabled" if user is not None
                                else f"{method}: user unknown")
            self.backoff.failed(ip)
            self.auth_failures += 1
            audit.authentication(user_name or "", ip, via, False, reason)
            raise AuthError(reason, disabled=user is not None and not user.enabled)
        self.backoff.succeeded(ip)
        audit.authentication(user.name, ip, via, True, method)
        return Subject(user.name, ip, via, client_id=client_id)

    def is_super(self, subject: Subject) -> bool:
        if not self.enabled:
            return True
        if subject.outsider:
            return subject.super_user
        user = self.users.get(subject.name) if subject.name else None
        return user is not None and user.enabled and user.super

    def is_node(self, subject: Subject) -> bool:
        """A Super user, or a user made a node (`lightgate user add NAME --node`)."""
        if self.is_super(subject):
            return True
        user = self.users.get(subject.name) if subject.name and not subject.outsider else None
        return user is not None and user.enabled and user.node

    def still_valid(self, subject: Subject) -> bool:
        """False once the subject's user is deleted or disabled: its sessions must end."""
        if not self.enabled or not subject.name or subject.outsider:
            return True
        user = self.users.get(subject.name)
        return user is not None and user.enabled

    def authorize(self, subject: Subject, rtype: str, name: str, action: str, *,
                  is_filter: bool = False, cache: DecisionCache | None = None) -> bool:
        if not self.enabled:
            return True
        if cache is not None and self.stateful:
            if cache.version != self.version:
                cache.version, cache.entries = self.version, {}
            key = (rtype, name, action, is_filter)
            hit = cache.entries.get(key)
            if hit is not None:
                return hit
        ok, reason = self.explain(subject, rtype, name, action, is_filter)
        self.decided(subject, action, rtype if rtype == "Cluster" else f"{rtype}:{name}",
                     ok, reason)
        if cache is not None and self.stateful:
            cache.put(key, ok)
        return ok

    def decided(self, subject: Subject, action: str, resource: str, ok: bool,
                reason: str) -> bool:
        """Count and audit a decision made (here, or by an outside service); `ok`."""
        if not ok:
            self.denials += 1
        audit.authorization(subject.name, subject.ip, action, resource, ok, reason)
        return ok

    def explain(self, subject: Subject, rtype: str, name: str, action: str,
                is_filter: bool) -> tuple[bool, str]:
        """What the policies (or the subject's own ACL) say, and why; not audited."""
        if subject.outsider:
            return self._decide_outsider(subject, rtype, name, action, is_filter)
        if subject.name:
            user = self.users.get(subject.name)
            if user is None or not user.enabled:
                return False, "user unknown or disabled"
            if user.super:
                return True, "super user"
        who = subject.name or ANONYMOUS
        ok, policy = decide(self.policies, who, rtype, name, action, subject.ip, is_filter)
        if policy is None:
            return False, "no matching policy (default deny)"
        return ok, _describe(policy)

    def _decide_outsider(self, subject: Subject, rtype: str, name: str, action: str,
                         is_filter: bool) -> tuple[bool, str]:
        """A JWT's or the hook's client: its own ACL if it brought one, else the policies
        for "*" (never those of a built-in user it shares a name with)."""
        if subject.super_user:
            return True, f"{subject.backend} superuser"
        if subject.acl is not None:
            if rtype != "Topic":
                return False, f"{subject.backend} acl covers topics only"
            ok, reason = subject.acl.decide(action, name, is_filter)
            return ok, f"{subject.backend} {reason}"
        ok, policy = decide(self.policies, OUTSIDER, rtype, name, action, subject.ip, is_filter)
        if policy is None:
            return False, f"{subject.backend} client without acl, no '*' policy (default deny)"
        return ok, _describe(policy)


async def _ask(backend: Any, creds: Credentials) -> Decision:
    """The backend's answer; a deny if it fails. Whatever a client sends must end in a
    refusal it can read (and the audit line and the back-off), never in a closed socket."""
    try:
        return await backend.authenticate(creds)
    except Exception as exc:  # noqa: BLE001 - a backend's bug, not the client's
        log.error("auth backend %s failed on a CONNECT from %s", backend.name, creds.ip,
                  exc_info=exc)
        return Decision.deny(f"{backend.name}: internal error ({type(exc).__name__})")


def _describe(policy: Policy) -> str:
    return f"policy {policy.resource} {policy.match} {','.join(policy.actions)}" + (
        f" from {policy.ip}" if policy.ip else "") + (" deny" if policy.deny else " allow")


def _check_name(name: str) -> None:
    if name in RESERVED_NAMES or any(c in name for c in "\0:") or len(name) > 128:
        raise ValueError(f"invalid user name {name!r} (reserved, empty, or has ':' or NUL)")


def _canonical(resource: str, match: str | None) -> str:
    return Policy.create("x", resource, "GET", match=match or "literal").resource
