"""How MQTT clients prove who they are, beyond the store's built-in users and passwords:
a JWT in the password (jwt_backend), an operator's HTTP service (http_hook), MQTT 5
enhanced authentication with SCRAM-SHA-256 (enhanced, scram), the order they are asked
in (chain), and `MqttAuth` (mqtt), which puts them in front of the store's AuthManager.
Only MQTT uses them: the store's own clients know the built-in users alone.

Nothing is imported here: the command line reads the chain's settings (chain.py)
without loading the rest."""
