"""The MQTT gateway: what MQTT 3.1.1 and 5.0 clients connect to. Listeners (TCP, TLS,
WebSocket), the protocol's rules (gateway/mqtt, sans-IO), sessions and their
subscriptions, shared groups, retained messages and wills, MQTT authentication, and the
admin API, dashboard and metrics. It keeps no data of its own: messages and session
state live in the store, which it reaches through store.api only."""
