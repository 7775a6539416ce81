"""The KV connector: everything that talks to the shared store for a sequence, in the shape of
vLLM v1's ``KVConnectorBase_V1``. Its scheduler side (``scheduler_side``) says how many prompt
tokens a sequence can get, from where and when: the store's lookup, the fleet's leases and waits,
the trail after a wait, and the in-worker share (``in_worker``); its worker side (``worker_side``)
copies blocks into and out of the runner's slots and publishes them (``publish_queue``).
``connector.KVConnector`` builds both for one engine."""
