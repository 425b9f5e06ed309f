"""Tessera's protocol: the pure, synchronous rules every node must compute identically.

Nothing here imports torch, libp2p or does I/O beyond reading a spec or key file the caller names.
"""
