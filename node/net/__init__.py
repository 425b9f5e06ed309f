"""Networking: the interface duties code against, the gossip judge, the in-memory twin and libp2p (p2p/)."""
