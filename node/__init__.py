"""Tessera's node: the only package with I/O and concurrency (CLI, config, libp2p, storage, HTTP, duties).

It builds on `validator`, `training` and `protocol`; nothing imports it.
"""
