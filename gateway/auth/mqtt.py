"""MQTT clients' authentication: the backends they meet in order (--auth-order), MQTT 5
enhanced authentication (§4.12) and the HTTP hook's topic decisions (--auth-http-acl),
in front of the store's AuthManager, which keeps the users and policies, the audit log
and the brute-force delay."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from gateway.auth.chain import BackendConfig, build_backends
from gateway.auth.enhanced import SUCCESS, Authenticator, AuthStep
from gateway.auth.scram import METHOD as SCRAM_METHOD
from gateway.auth.scram import ScramSha256
from store.api import ALLOW, IGNORE, AuthManager, Backend, Subject

if TYPE_CHECKING:  # loaded with httpx only when a deployment has the hook
    from gateway.auth.http_hook import HttpHook


class MqttAuth:
    def __init__(self, manager: AuthManager, backends: BackendConfig | None = None) -> None:
        cfg = backends or BackendConfig()
        self.manager = manager
        self.chain: list[Backend] = build_backends(cfg, manager.builtin)
        hooks = [cast("HttpHook", b) for b in self.chain if b.name == "http" and cfg.http_acl]
        self.acl_hook: HttpHook | None = hooks[0] if hooks else None  # --auth-http-acl
        # Enhanced authentication methods by name, one new exchange each. They prove
        # built-in users, so they are offered only while builtin is in the chain.
        self._scram_secret = os.urandom(32)  # per process: fake salts for unknown names
        self.enhanced_methods: dict[str, Callable[[], Authenticator]] = {
            SCRAM_METHOD: lambda: ScramSha256(manager.scram_verifier, self._scram_secret),
        }

    async def authenticate(self, username: str | None, password: str | None, ip: str,
                           cert_identity: str | None, client_id: str) -> Subject:
        """A CONNECT's credentials, asked of the chain; AuthError if refused."""
        return await self.manager.authenticate(username, password, ip, "mqtt", cert_identity,
                                               client_id, chain=self.chain)

    # -- enhanced authentication (MQTT 5 AUTH) -----------------------------------------
    def enhanced(self, method: str) -> Authenticator | None:
        """A new exchange for `method`, or None when it is not offered (0x8C)."""
        factory = self.enhanced_methods.get(method)
        if factory is None or not self.manager.enabled or self.manager.builtin not in self.chain:
            return None
        return factory()

    async def enhanced_wait(self, ip: str) -> None:
        """The brute-force delay before an exchange, as before a password check."""
        await self.manager.backoff_wait(ip)

    def enhanced_result(self, method: str, step: AuthStep, ip: str, client_id: str = ""
                        ) -> Subject:
        """The subject an exchange's last step proved, or AuthError; audited."""
        return self.manager.proved(method, step.user, step.outcome == SUCCESS, step.reason,
                                   ip, "mqtt", client_id)

    # -- the HTTP hook's topic decisions ------------------------------------------------
    def asks_hook(self, subject: Subject) -> bool:
        """Whether the HTTP hook decides this subject's PUB/SUB (--auth-http-acl): then
        `authorize_by_hook`, which awaits, instead of the manager's `authorize`."""
        return self.acl_hook is not None and subject.backend == "http"

    async def authorize_by_hook(self, subject: Subject, name: str, action: str, *,
                                is_filter: bool = False) -> bool:
        """PUB or SUB on a topic, asked of the HTTP hook. Its answers are cached for
        --auth-http-cache-s (by the hook), not per connection: the operator's service
        may change its mind, whatever --auth-strategy says."""
        manager, hook = self.manager, self.acl_hook
        if not manager.enabled or subject.super_user or hook is None:
            return True
        d = await hook.authorize(subject.client_id, subject.name, subject.ip, action, name)
        if d.outcome == IGNORE:  # as if there were no hook: the subject's ACL, or "*"
            ok, reason = manager.explain(subject, "Topic", name, action, is_filter)
            reason = f"{d.reason}, then {reason}"
        else:
            ok, reason = d.outcome == ALLOW, d.reason
        return manager.decided(subject, action, f"Topic:{name}", ok, reason)
