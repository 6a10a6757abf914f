"""DHT side of p2p-spes: run records, the bootstrap peer and the status inspector.

Kept apart from the trainer so that a bootstrap or inspector process imports no model code.
"""
