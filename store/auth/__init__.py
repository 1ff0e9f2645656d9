"""Authentication and authorisation after RocketMQ ACL 2.0: users (Super or Normal,
enabled or not) with scrypt password hashes, and policies of subject x resource x
actions x source IP x Allow/Deny. Users and policies live in the store's metadata;
every node keeps them in memory and reloads on change."""

from store.auth.manager import AUTH_EVENT, AuthConfig, AuthError, AuthManager, Subject
from store.auth.policy import ACTIONS, Policy, parse_resource

__all__ = ["ACTIONS", "AUTH_EVENT", "AuthConfig", "AuthError", "AuthManager", "Policy", "Subject",
           "parse_resource"]
