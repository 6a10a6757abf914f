"""DHT side of p2p-spes: run records, the bootstrap peer and the status inspector.

Kept apart from the trainer so that a bootstrap or inspector process imports no model code: of
``p2p_spes`` it uses only ``config`` and ``errors``, and nothing in ``p2p_spes.config`` or
``p2p_spes.errors`` imports ``dht``. Inside, each module imports only the ones above it here:

* ``keys``: the DHT key names of a run (pure).
* ``identity``: identity key files, peer ids, the peer id behind an owner subkey.
* ``auth``: private runs (secret, allow-list) and their record validator.  [identity]
* ``records``: record value schemas and typed readers (PeerRecord, VersionRecord, signed_values).  [keys, identity]
* ``validators``: the validators every DHT of a run installs.  [identity, auth, records]
* ``node``: ``start_dht``, a run's DHT node.  [identity, auth, validators]
* ``run_config``, ``bootstrap``, ``inspector``: the published run config, the bootstrap peer, the inspector.
"""
